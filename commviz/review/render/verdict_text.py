"""The verdict in words: the lines ``commviz report`` opens with and ``commviz launch`` and
``commviz status`` print (``verdict_text``), each rank's role in it, and its JSON.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import PurePath
from typing import Any

from commviz import metadata as md
from commviz.merge.select import format_ranks
from commviz.record.journal import NEVER_RETURNED
from commviz.review.model.verdict import (Call, Channel, FailureKind, Incident, RankState,
                                          Verdict)

# calls shown per rank of those made after NCCL's watchdog timed out its collective
SHOWN_AFTER = 4
# alike transfers (same kind and culprits, one side never posted) told on one line from this many
SHOWN_ALIKE = 3


def _secs(ns: int | None) -> str:
    return "?" if ns is None else f"{ns / 1e9:.3g} s"


def _at(c: Call) -> str:
    """Where a call was made (" at train.py:12"), and its origin where that says more (the
    framework unit that issued it)."""
    site = f" at {c.callsite}" if c.callsite else ""
    if c.origin and PurePath(c.callsite or "").name != c.origin:
        site += f" ({c.origin})"
    return site


def _where(c: Call | None) -> str:
    if c is None:
        return "no collective or transfer recorded"
    return f"{c.label()}{_at(c)}: {c.state}"


def render_lines(v: Verdict) -> list[str]:
    culprits = format_ranks(v.culprits) if v.culprits else "?"
    lines = [f"VERDICT: {v.kind} - culprit rank(s) {culprits}"]
    root = v.root
    if v.replays is not None:
        lines.append(f"  at {v.replays.describe()}")
    if root is not None:
        lines.append(f"  at {root.title()}: {root.why}")
        waiters = [r for r, c in sorted(root.calls.items())
                   if r not in root.culprits and not c.returned]
        for r in waiters:
            c = root.calls[r]
            said = (c.error if c.error == NEVER_RETURNED      # it says the state itself
                    else f"{c.state}: {_short(c.error)}" if c.error else str(c.state))
            lines.append(f"  rank {r} waited {_secs(v.ranks[r].waited_ns(c))} in it{_at(c)} "
                         f"({said})")
    if root is not None and v.flight and root.channel is None:
        said = v.flight_states(root)
        lines.append("  Flight Recorder there: " + ", ".join(
            f"rank {r} {state or 'no entry'}" for r, state in sorted(said.items())))
    for r in v.culprits:
        s = v.ranks.get(r)
        if s is None:
            lines.append(f"  rank {r}: no record")
            continue
        lines.append(f"  rank {r}: {s.how()}; last call {_where(s.last)}")
        where = s.stopped_at
        if where is not None:
            site = s.at is not None and where == s.at.frame()    # no line of its own code
            lines.append(f"    stopped at {where}"
                         + (f" (its call there: {s.at.state})" if site and s.at else ""))
    lines.append("  each rank's last call:")
    for r, s in sorted(v.ranks.items()):
        queued = f", behind {s.blocked.label()}" if s.blocked not in (None, s.last) else ""
        lines.append(f"    rank {r}: {_where(s.last)}{queued}")
    after = {r: s.after_timeout for r, s in sorted(v.ranks.items()) if s.after_timeout}
    if after:
        lines.append("  made after NCCL's watchdog timed out the rank's collective (set aside, its "
                     "communicators torn down):")
        for r, cs in after.items():
            more = f", ... ({len(cs)} in all)" if len(cs) > SHOWN_AFTER else ""
            lines.append(f"    rank {r}: " + ", ".join(c.label() for c in cs[:SHOWN_AFTER]) + more)
    for inc in v.consequences:
        cause = inc.cause
        behind = f"{cause.title() if cause else '?'}"
        waiting = format_ranks(r for r in inc.calls if r not in inc.waits_on)
        if inc.before:       # its missing ranks never reached the cause, which comes first
            lines.append(f"  then {inc.title()}: rank(s) {waiting} wait in it on rank(s) "
                         f"{format_ranks(inc.missing)} missing, held up before {behind}, which "
                         "comes first in their order of groups")
        elif inc.behind and cause is not None:
            lines.append(f"  then {inc.title()}: rank(s) {waiting} wait in it on rank(s) "
                         f"{format_ranks(inc.behind)}, whose part is queued behind {behind}, "
                         f"which waits on rank(s) {format_ranks(cause.waits_on)}")
        elif not inc.waits_on:  # every rank came: the group's earlier collective never completed
            lines.append(f"  then {inc.title()}: queued behind {behind}")
        else:
            both = [r for r in inc.missing if cause is not None and r in cause.missing]
            waits = [r for r in inc.waits_on if r not in both]
            said = [f"rank(s) {format_ranks(waits)} " + ("missing, " if inc.missing else "")
                    + f"waiting in {behind}"] if waits else []
            if both:
                said.append(f"rank(s) {format_ranks(both)} missing "
                            + ("from both" if waits else f"as from {behind}"))
            lines.append(f"  then {inc.title()}: " + "; ".join(said))
    for alike in _alike(v.others):
        if len(alike) >= SHOWN_ALIKE:
            lines.append(_unposted(alike))
            continue
        for inc in alike:
            lines.append(f"  also {inc.kind} at {inc.title()}: culprit rank(s) "
                         f"{format_ranks(inc.culprits)}: {inc.why}")
    lines.append(f"  open next: {v.open_next()}")
    return lines


def verdict_text(v: Verdict) -> str:
    """The verdict as ``commviz report`` opens with it and ``commviz launch`` and
    ``commviz status`` print it."""
    return "\n".join(render_lines(v)) + "\n"


def _alike(incidents: list[Incident]) -> list[list[Incident]]:
    """Incidents in order, the transfers one side never posted that have the same kind and
    culprits together (a crashed pipeline stage leaves one per transfer with it)."""
    out: list[list[Incident]] = []
    at: dict[tuple[FailureKind, tuple[int, ...]], list[Incident]] = {}
    for inc in incidents:
        if inc.channel is None or not inc.missing:
            out.append([inc])
            continue
        key = (inc.kind, inc.culprits)
        if key not in at:
            at[key] = []
            out.append(at[key])
        at[key].append(inc)
    return out


def _numbers(seqs: list[int]) -> str:
    """Transfer numbers as runs: "#18-21,23"."""
    return "#" + format_ranks(seqs)


def _unposted(alike: list[Incident]) -> str:
    """One line for many transfers whose other side the culprits never posted: per rank that
    posted its side, its sends and receives by peer, as runs of numbers."""
    posted: dict[int, dict[tuple[str, int | None], list[int]]] = defaultdict(
        lambda: defaultdict(list))
    for inc in alike:
        for r, c in inc.calls.items():
            posted[r][(c.signature.op, c.peer)].append(c.seq)
    first = alike[0]
    per_rank = "; ".join(f"rank {r} " + ", ".join(
        f"{md.p2p_op(op, peer)} {_numbers(seqs)}" for (op, peer), seqs in ops.items())
        for r, ops in sorted(posted.items()))
    return (f"  also {first.kind}: rank(s) {format_ranks(first.culprits)} never posted the "
            f"other side of {len(alike)} more transfers: {per_rank}")


def roles(v: Verdict) -> dict[int, str]:
    """What the verdict says of each rank it names, in a few words, for the report's tables
    (which must tell the same story): its culprits first, then the ranks that waited, in the
    root first, then in what followed from it."""
    out = {r: f"culprit ({v.kind})" for r in v.culprits}
    for inc in ([v.root] if v.root is not None else []) + v.consequences + v.others:
        for r, c in sorted(inc.calls.items()):
            if r in out or c.returned or not inc.waits_on:
                continue
            what = c.label() if c.channel is not None else f"{c.group}#{c.seq} {c.signature.op}"
            waited = v.ranks[r].waited_ns(c) if r in v.ranks else None
            out[r] = (f"waited{'' if waited is None else ' ' + _secs(waited)} in {what} for "
                      f"rank(s) {format_ranks(inc.waits_on)}")
    return out


def _short(text: str | None, limit: int = 120) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[:limit - 1] + "…"



def _channel_json(ch: Channel | None) -> dict[str, Any] | None:
    return None if ch is None else {"src": ch.src, "dst": ch.dst}


def _split_json(split: tuple[int, ...] | None) -> list[int] | None:
    return None if split is None else list(split)


def _call_json(c: Call | None) -> dict[str, Any] | None:
    if c is None:
        return None
    sizes = c.signature.sizes
    return {"pg": c.pg, "pg_desc": c.pg_desc, "group": c.group, "seq": c.seq,
            "op": c.signature.op,
            "p2p": _channel_json(c.channel), "label": c.label(),
            "in_nelems": c.signature.in_nelems, "out_nelems": c.signature.out_nelems,
            "in_total": c.signature.in_total, "out_total": c.signature.out_total,
            "in_split": _split_json(sizes.in_split if sizes else None),
            "out_split": _split_json(sizes.out_split if sizes else None),
            "dtype": c.signature.dtype, "callsite": c.callsite, "origin": c.origin,
            "state": str(c.state), "begin_ns": c.begin_ns, "end_ns": c.end_ns, "error": c.error}


def _incident_json(i: Incident, v: Verdict) -> dict[str, Any]:
    """One incident (``seq``: a transfer's number on its channel, ``p2p``: the channel)."""
    return {"kind": str(i.kind), "pg": i.pg, "pg_desc": i.pg_desc, "group": i.group,
            "seq": i.seq,
            "p2p": _channel_json(i.channel), "title": i.title(),
            "culprits": list(i.culprits), "missing": list(i.missing),
            "waits_on": list(i.waits_on), "why": i.why,
            "behind": list(i.behind), "before": i.before,
            "split_pairs": None if i.splits is None else [list(p) for p in i.splits.pairs],
            "ranks": sorted(i.calls),
            "calls": {str(r): _call_json(c) for r, c in sorted(i.calls.items())},
            "waited_ns": {str(r): v.ranks[r].waited_ns(c) for r, c in sorted(i.calls.items())},
            "cause": None if i.cause is None else {"pg": i.cause.pg, "seq": i.cause.seq,
                                                   "p2p": _channel_json(i.cause.channel)}}


def verdict_json(v: Verdict) -> dict[str, Any]:
    """The verdict as plain data (times in ns): ``commviz report --format json``."""
    def where(s: RankState) -> str | None:
        return None if s.stopped_at is None else str(s.stopped_at)
    root = None
    if v.root is not None:
        root = _incident_json(v.root, v)
        if v.flight and v.root.channel is None:
            root["flight_recorder"] = {str(r): state
                                       for r, state in v.flight_states(v.root).items()}
    return {"kind": str(v.kind), "culprits": list(v.culprits),
            "root": root,
            "consequences": [_incident_json(i, v) for i in v.consequences],
            "others": [_incident_json(i, v) for i in v.others],
            "replays": None if v.replays is None else {
                "graph": v.replays.graph, "holds": list(v.replays.holds),
                "counts": {str(r): n for r, n in v.replays.counts.items()}},
            "ranks": {str(r): {"last": _call_json(s.last), "how": s.how(), "stopped_at": where(s),
                               "after_timeout": [_call_json(c) for c in s.after_timeout]}
                      for r, s in sorted(v.ranks.items())},
            "open_next": v.open_next()}
