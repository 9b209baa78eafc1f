"""Why a job hung or died, on one screen: the failure's kind, the culprit ranks, where each
rank stopped and how long the others waited.

Read from what a run dir holds after the job, without torch: every rank's record (a killed
rank's rebuilt from its journal), and the stacks each rank left when it was torn down
(``commviz.record.stacks``). Each process group's collectives are lined up by sequence number
as Flight Recorder's analyzer does, and each point-to-point transfer by its number per (group,
sender, receiver): rank a's send #n to b meets b's receive #n from a. Unlike the analyzer,

- every disagreement of a group is kept, not only its first (``Incident``);
- blame goes to the rank that did not arrive, or whose call differs from the others', never
  to the ranks that waited; any rank can be the culprit, the first one included;
- an incident is a *consequence* of another when a rank it waits on (missing from it) is
  waiting in that other one (rank 0 stuck in the subgroup's collective never reaches the
  world's, nor sends to rank 2, whose receive waits): the root comes first, its consequences
  under it. When two incidents wait on each other (a rank skipped a subgroup's collective and
  went on to the world's), the root is the one whose missing rank broke the order of groups
  it had kept until then; where a transfer is in the circle (two ranks both receive from each
  other first), it is a deadlock of all the ranks in it;
- ranks missing from collectives of several groups (rank 1 stuck before tp#5 is missing from
  tp#5 and from dp#5) were held up before the one their own repeating order of groups reaches
  first: that one is the root, the others follow from it;
- an all_to_all's uneven splits are compared pairwise (``desync.split_mismatch``): what rank i
  sends to j must be what j takes from i; the rank whose splits its peers' do not match is the
  culprit of a size mismatch;
- the kind says why the culprit was missing (``FailureKind``): it raised, was killed, skipped
  the collective and went on, or hung in its own code (its stack says where);
- a transfer is more than "a size or syntax mismatch": a send or receive whose peer never
  posted its side (the peer is the culprit), a send and its receive that differ in size or
  dtype (the side whose size changed from the transfer before is the culprit, else both), a
  deadlock, or a transfer that failed on a side.

On NCCL a collective returns once it is queued. Where a rank's Flight Recorder dump has one
unfinished, its call is ``enqueued, never completed on the GPU`` (``CallState.ENQUEUED``), not
completed, and the rank waits in the first such one: its later GPU work is queued behind it.
Where a rank left no dump (killed before it could write one, or the recorder off), its NCCL
collectives that returned are ``returned once queued`` (``CallState.QUEUED``): nothing says
they ran.
A collective every member made alike, whose part on some is queued behind their earlier
unfinished one, waits on those members (``Incident.behind``).

On NCCL a rank's calls made after the watchdog timed out one of its collectives that never
completed (its Flight Recorder dump: the collective's creation + its timeout) are set aside,
listed apart: the watchdog then tears the rank's communicators down, and a rank blocked behind
the hang goes on into its next step only because of that. Such a call is a consequence, never
evidence that the rank made the call the others wait for; its number may even be the one it
skipped (a rank that skipped a subgroup's collective #5 makes its next one #5). A rank taken
down after that timeout (the watchdog's SIGABRT, an aborted communicator's error) did not fail
on its own.

A point-to-point record covers only the posting of the op (c10d's send/recv enqueue; the wait
comes after), so a rank's transfer is taken as completed only where its peer posted the other
side, and a rank whose last call is a transfer of an incident as stopped in it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from commviz import metadata as md
from commviz.merge.select import format_ranks
from commviz.record import stacks as st
from commviz.record.journal import EXIT as JOURNAL_EXIT, NEVER_RETURNED
from commviz.review.analyses import flightrec
from commviz.review.analyses.desync import (DesyncKind, Signature, first_diff, signature_of,
                                            split_mismatch)
from commviz.review.analyses.exits import Exit
from commviz.review.model.verdict import (Call, CallState, Channel, FailureKind, Incident,
                                          RankState, Replays, Verdict)
from commviz.trace.run import Run, load_run

# incidents kept per group, from its first: enough to see a pattern, never a flood
MAX_PER_GROUP = 10
# how far back a rank's order of groups is checked for a repeating pattern
PATTERN_SPAN = 8

_MISMATCH = {DesyncKind.TYPE: FailureKind.TYPE_MISMATCH, DesyncKind.SIZE: FailureKind.SIZE_MISMATCH,
             DesyncKind.DTYPE: FailureKind.DTYPE_MISMATCH, DesyncKind.ARGS: FailureKind.ARGS_MISMATCH}


# -- reading the run dir ---------------------------------------------------------------------

def _channel(rank: int, meta: Mapping[str, Any]) -> Channel:
    """A point-to-point op's channel, as its record names the two ranks."""
    src, dst = meta.get(md.SRC), meta.get(md.DST)
    return Channel(str(meta.get(md.PG_NAME)), None if src is None else int(src),
                   rank if dst is None else int(dst))


def _offset_ns(record: Mapping[str, Any]) -> int:
    """What takes the rank's clock to rank 0's."""
    return int((record.get("clock") or {}).get("offset_ns") or 0)


def _calls(rank: int, record: Mapping[str, Any]) -> list[Call]:
    """A rank's numbered collectives and its transfers, in the order it made them."""
    offset = _offset_ns(record)
    out = []
    for meta in record.get("collectives") or []:
        kind = meta.get(md.KIND, "collective")
        if meta.get(md.PG_DESC) == md.SIDE_GROUP_DESC:
            continue
        if kind == "collective" and meta.get(md.SEQ) is not None:
            seq, channel = int(meta[md.SEQ]), None
        elif kind == "p2p":
            seq, channel = int(meta.get(md.P2P_SEQ) or 0), _channel(rank, meta)
        else:
            continue
        begin, end = meta.get(md.T_BEGIN), meta.get(md.T_END)
        desc = meta.get(md.PG_DESC)
        out.append(Call(rank=rank, pg=str(meta.get(md.PG_NAME)), pg_desc=str(desc or ""),
                        group=md.group_label(desc, meta.get(md.PG_RANKS)), seq=seq,
                        signature=signature_of(str(meta.get(md.OP)), meta),
                        callsite=meta.get(md.CALLSITE), origin=meta.get(md.ORIGIN),
                        begin_ns=None if begin is None else begin + offset,
                        end_ns=None if end is None else end + offset,
                        error=meta.get(md.ERROR), channel=channel, graph=meta.get(md.GRAPH)))
    return out


def _mark_gpu_state(cs: list[Call], dump: flightrec.Dump | None,
                    record: Mapping[str, Any]) -> list[Call]:
    """A rank's calls, each NCCL collective that returned (queued) marked with what is known of
    its GPU work: with the rank's Flight Recorder dump, those it has unfinished
    (``CallState.ENQUEUED``); without one, all of them (``CallState.QUEUED``): NCCL returns
    once a collective is queued, so its record alone cannot say it completed."""
    if dump is not None:
        return [replace(c, enqueued=True) if c.channel is None and (c.pg, c.seq) in dump.unfinished
                and c.state is CallState.COMPLETED else c for c in cs]
    nccl = _nccl_groups(record)
    return [replace(c, unconfirmed=True) if c.channel is None and c.pg in nccl
            and c.state is CallState.COMPLETED else c for c in cs]


def _nccl_groups(record: Mapping[str, Any]) -> frozenset[str]:
    """The process groups of a rank's record that run on NCCL (a group without its own
    backend: the record's)."""
    default = record.get("backend")
    return frozenset(str(g.get("name")) for g in record.get("process_groups") or []
                     if "nccl" in str(g.get("backend") or default or "").lower())


def _queued_behind(inc: Incident, state: dict[int, RankState]) -> None:
    """A collective every member made alike, not completed: the members whose part is queued
    behind an earlier collective of theirs that never completed hold it up."""
    if inc.channel is None and not inc.missing and len(inc.sides) == 1 and inc.splits is None:
        inc.behind = tuple(r for r, c in sorted(inc.calls.items())
                           if c.state is CallState.ENQUEUED and state[r].blocked not in (None, c))


def _split_at_timeout(cs: list[Call], timed_out_ns: int | None) -> tuple[list[Call], list[Call]]:
    """A rank's calls made before NCCL's watchdog timed out one of its collectives, and those
    made after (set aside: the module's docstring says why)."""
    before: list[Call] = []
    after: list[Call] = []
    for c in cs:
        late = timed_out_ns is not None and c.begin_ns is not None and c.begin_ns >= timed_out_ns
        (after if late else before).append(c)
    return before, after


def _stacks(run_dir: Path, rank: int) -> st.Stacks | None:
    return (st.read_stacks(st.stacks_path(run_dir, rank))
            or st.read_stacks(st.stacks_path(run_dir, rank, live=True)))


# -- lining up ------------------------------------------------------------------------------

def _incidents(calls: dict[int, list[Call]], members: dict[str, tuple[int, ...]]
               ) -> list[Incident]:
    by_pg: dict[str, dict[int, dict[int, Call]]] = defaultdict(lambda: defaultdict(dict))
    for rank, cs in calls.items():
        for c in cs:
            if c.channel is None:
                by_pg[c.pg][rank].setdefault(c.seq, c)
    out = []
    for pg, ranks_calls in by_pg.items():
        ranks = tuple(r for r in members.get(pg, tuple(ranks_calls)) if r in calls)
        seqs = [set(ranks_calls.get(r, {})) for r in ranks]
        lo = max((min(s) for s in seqs if s), default=None)  # what every ring still holds
        hi = max((max(s) for s in seqs if s), default=None)
        if lo is None or hi is None:
            continue
        found = 0
        for seq in range(lo, hi + 1):
            at = {r: ranks_calls[r][seq] for r in ranks if seq in ranks_calls.get(r, {})}
            missing = tuple(r for r in ranks if r not in at)
            sides: dict[Signature, list[int]] = defaultdict(list)
            for r, c in at.items():
                sides[c.signature].append(r)
            done = all(c.returned for c in at.values())
            splits = None if missing or len(sides) > 1 else split_mismatch(
                {r: c.signature for r, c in at.items()}, members.get(pg, ranks))
            if not missing and len(sides) == 1 and done and splits is None:
                continue
            ordered = tuple(sorted(((s, tuple(rs)) for s, rs in sides.items()),
                                   key=lambda x: (-len(x[1]), x[1])))
            named = next(iter(at.values()), None)
            out.append(Incident(pg=pg, pg_desc=named.pg_desc if named else "",
                                group=named.group if named else
                                md.group_label(None, members.get(pg, ranks)), seq=seq,
                                members=members.get(pg, ranks),
                                calls=at, missing=missing, sides=ordered, splits=splits))
            found += 1
            if found >= MAX_PER_GROUP:
                break
    return out


class _Transfers(NamedTuple):
    """A channel's transfers by number: the sender's sends, the receiver's receives."""

    sends: dict[int, Call]
    recvs: dict[int, Call]

    def numbers(self) -> range:
        """From the first number both sides still hold (a ring drops its oldest) to the last
        either posted."""
        held = [s for s in (self.sends, self.recvs) if s]
        return range(max(min(s) for s in held), max(max(s) for s in held) + 1)


def _channels(calls: dict[int, list[Call]]) -> dict[Channel, _Transfers]:
    """Every channel between two ranks that both left a record, with its transfers. Channels
    into a rank that received from any source are left out: which send such a receive took
    is not recorded."""
    any_source = {(c.pg, c.rank) for cs in calls.values() for c in cs
                  if c.channel is not None and c.channel.src is None}
    out: dict[Channel, _Transfers] = {}
    for cs in calls.values():
        for c in cs:
            ch = c.channel
            if ch is None or ch.src is None or ch.src == ch.dst or ch.src not in calls \
                    or ch.dst not in calls or (ch.pg, ch.dst) in any_source:
                continue
            transfers = out.setdefault(ch, _Transfers({}, {}))
            (transfers.sends if c.signature.op == "send" else transfers.recvs).setdefault(c.seq, c)
    return out


def _settle_unmatched(calls: dict[int, list[Call]], state: dict[int, RankState]) -> None:
    """A transfer whose peer never posted the other side cannot have completed, though its
    record returned (it covers the posting): it is marked so, in ``calls`` and as a rank's
    last call."""
    marked: dict[int, Call] = {}
    for transfers in _channels(calls).values():
        for n in transfers.numbers():
            send, recv = transfers.sends.get(n), transfers.recvs.get(n)
            if (send is None) != (recv is None):
                posted = send or recv
                marked[id(posted)] = replace(posted, unmatched=True)
    for r, cs in calls.items():
        calls[r] = [marked.get(id(c), c) for c in cs]
        last = state[r].last
        if last is not None:
            state[r].last = marked.get(id(last), last)


def _payload(c: Call) -> tuple[int | None, str | None]:
    return c.signature.in_nelems, c.signature.dtype


def _p2p_incidents(calls: dict[int, list[Call]]) -> list[Incident]:
    """Each transfer one side never posted, whose sides differ in size or dtype, or that did
    not return on a side: a send and its receive, lined up by their number on the channel."""
    out = []
    for ch, transfers in _channels(calls).items():
        found = 0
        for n in transfers.numbers():
            send, recv = transfers.sends.get(n), transfers.recvs.get(n)
            at = {c.rank: c for c in (send, recv) if c is not None}
            if not at:
                continue
            alike = send is None or recv is None or _payload(send) == _payload(recv)
            if len(at) == 2 and alike and all(c.returned for c in at.values()):
                continue
            first = next(iter(at.values()))
            sides = tuple((c.signature, (r,)) for r, c in at.items()) if not alike else \
                ((first.signature, tuple(sorted(at))),)
            members = (ch.src, ch.dst)
            out.append(Incident(pg=ch.pg, pg_desc=first.pg_desc, group=first.group, seq=n,
                                members=members,
                                calls=at, missing=tuple(r for r in members if r not in at),
                                sides=sides, channel=ch))
            found += 1
            if found >= MAX_PER_GROUP:
                break
    return out


def _next_groups(groups: list[str]) -> list[str]:
    """The groups the next collectives go to, by the repeating order of ``groups`` (a rank's
    groups, in the order it called them: tp, dp, tp, dp -> tp, dp); [] where none repeats."""
    groups = groups[-2 * PATTERN_SPAN:]
    for period in range(1, PATTERN_SPAN + 1):
        if len(groups) < 2 * period:
            break
        if all(groups[i] == groups[i - period] for i in range(period, len(groups))):
            return groups[-period:]
    return []


def _broke_pattern(cs: list[Call]) -> bool:
    """Whether a rank's last collective is in another group than its repeating order of
    groups says (sub, world, sub, world, ..., world: it skipped one)."""
    groups = [c.pg for c in cs if c.channel is None]
    if len(groups) < 3:
        return False
    *before, last = groups
    order = _next_groups(before)
    return len(set(order)) > 1 and last != order[0]


def _follow_own_order(incidents: list[Incident], calls: dict[int, list[Call]]) -> None:
    """Collectives of several groups the same ranks are missing from (held up in their own
    code, or gone): they would have made them in their own order of groups, so the one that
    comes first in it is where they were held up, and the others follow from it (rank 1 never
    reached tp#5, so it never reached dp#5 either: dp#5's ranks wait on it through tp#5)."""
    alike: dict[tuple[int, ...], list[Incident]] = defaultdict(list)
    for inc in incidents:
        if inc.cause is None and inc.channel is None and inc.missing and len(inc.sides) <= 1:
            alike[inc.missing].append(inc)
    for missing, incs in alike.items():
        mine = [c for c in calls[missing[0]] if c.channel is None]
        order = _next_groups([c.pg for c in mine])
        if len(incs) < 2 or any(i.pg not in order for i in incs):
            continue
        last = {c.pg: c.seq for c in mine}

        def reached(i: Incident) -> int:     # how many calls on the rank would make it
            return (i.seq - last.get(i.pg, i.seq - 1) - 1) * len(order) + order.index(i.pg)
        first, *rest = sorted(incs, key=reached)
        for inc in rest:
            inc.cause, inc.before = first, True


def _judge(inc: Incident, state: dict[int, RankState], calls: dict[int, list[Call]]) -> None:
    """Kind, culprits and why of one incident, on its own."""
    if len(inc.sides) > 1 and inc.channel is not None:
        _judge_transfer_mismatch(inc, calls)
        return
    if inc.splits is not None:
        inc.culprits, inc.kind = inc.splits.culprits, FailureKind.SIZE_MISMATCH
        inc.why = f"its splits do not pair up: {inc.splits.detail}"
        return
    if len(inc.sides) > 1:
        (top, big), *rest = inc.sides
        tied = [rs for _, rs in rest if len(rs) == len(big)]
        inc.culprits = tuple(sorted({r for _, rs in rest for r in rs} | {r for rs in tied for r in big}))
        kind = first_diff(top, rest[0][0])
        inc.kind = _MISMATCH[kind]
        inc.why = "; ".join(f"rank{'s' if len(rs) > 1 else ''} {format_ranks(rs)} called {sig}"
                            for sig, rs in inc.sides)
        return
    if inc.missing:
        inc.culprits = inc.missing
        inc.kind = _missing_kind(inc, state, calls)
        return
    if inc.behind:       # everyone arrived; some ranks' part waits on their earlier collective
        inc.culprits, inc.kind = inc.behind, FailureKind.HANG
        inc.why = "; ".join(f"rank {r}'s part is queued behind its {state[r].at.label()}, which "
                            "never completed" for r in inc.behind if state[r].at is not None)
        return
    # everyone arrived with the same call, and it failed or never returned on some
    waiting = [r for r, c in inc.calls.items() if c.state is CallState.WAITING]
    died = [r for r in inc.calls if state[r].killed
            or state[r].stacks is not None and state[r].stacks.fatal]
    inc.culprits = tuple(sorted(died or waiting or inc.calls))
    inc.kind = (FailureKind.KILLED if died and all(state[r].killed for r in died)
                else FailureKind.CRASH if died else FailureKind.FAILED)
    inc.why = "; ".join(f"rank {r} {state[r].how()}" for r in inc.culprits)


def _judge_transfer_mismatch(inc: Incident, calls: dict[int, list[Call]]) -> None:
    """A send and its receive that differ (in bytes: size; else in dtype): the side whose size
    or dtype changed since the channel's transfer before (where both agreed) is the culprit;
    else both are."""
    send, recv = (inc.calls[r] for r in inc.members)          # members: (sender, receiver)
    same_bytes = send.nbytes is not None and send.nbytes == recv.nbytes
    inc.kind = FailureKind.DTYPE_MISMATCH if same_bytes else FailureKind.SIZE_MISMATCH
    changed = []
    for c in (send, recv):
        before = next((b for b in calls[c.rank] if b.channel == c.channel
                       and b.seq == c.seq - 1), None)
        if before is not None and _payload(before) != _payload(c):
            changed.append((c.rank, before))
    inc.culprits = (changed[0][0],) if len(changed) == 1 else (send.rank, recv.rank)
    inc.why = f"rank {send.rank} sends {send.size()}, rank {recv.rank} receives {recv.size()}"
    if len(changed) == 1:
        r, before = changed[0]
        inc.why += f"; rank {r} changed it since #{before.seq} ({before.size()})"


def _counterpart(inc: Incident) -> str:
    """What the missing side of a transfer never posted: "send→0 #5"."""
    (posted,) = inc.calls.values()
    op = "recv" if posted.signature.op == "send" else "send"
    return f"{md.p2p_op(op, posted.rank)} #{inc.seq}"


def _missing_kind(inc: Incident, state: dict[int, RankState], calls: dict[int, list[Call]]
                  ) -> FailureKind:
    why, kinds = [], []
    for r in inc.missing:
        s = state[r]
        cs = [c for c in calls[r] if c.channel is None]
        here = [i for i, c in enumerate(cs) if c.pg == inc.pg]
        later = cs[here[-1] + 1:] if here else cs
        outside = s.last is None or s.last.left
        if s.killed:
            kinds.append(FailureKind.KILLED)
            why.append(f"rank {r} {s.how()}")
        elif s.raised and outside:
            kinds.append(FailureKind.CRASH)
            why.append(f"rank {r} {s.how()}")
        elif inc.channel is None and later and _broke_pattern(cs):
            kinds.append(FailureKind.NEVER_ARRIVED)
            why.append(f"rank {r} skipped it: went on to {cs[-1].label()}")
        else:
            kinds.append(FailureKind.HANG)
            why.append(f"rank {r} never posted {_counterpart(inc)}" if inc.channel is not None
                       else f"rank {r} never called it")
    inc.why = "; ".join(why)
    order = list(FailureKind)
    return min(kinds, key=order.index)


def _cycle(inc: Incident) -> list[Incident] | None:
    """The incidents ``inc`` waits on, round a circle back to it (None: no circle)."""
    seen, cause = [inc], inc.cause
    while cause is not None and all(cause is not i for i in seen):
        seen.append(cause)
        cause = cause.cause
    return seen if cause is inc else None


def _deadlock(cycle: list[Incident]) -> None:
    """Ranks that wait on each other round a circle: none can go on, so every rank an incident
    of it waits on is a culprit; the earliest incident is the root."""
    root = min(cycle, key=lambda i: i.first_begin_ns or 0)
    root.cause = None
    root.kind = FailureKind.DEADLOCK
    root.culprits = tuple(sorted({r for i in cycle for r in i.waits_on}))
    root.why = "; ".join(
        f"rank(s) {format_ranks(i.calls)} wait in {next(iter(i.calls.values())).label()} "
        f"for rank(s) {format_ranks(i.waits_on)}" for i in cycle)


def _follow_group_order(incidents: list[Incident]) -> None:
    """A group's communicator runs its collectives in order: none after one that never
    completed can complete. So a later collective of the group the same ranks agree on (one
    side) follows from the group's first such incident. On NCCL a call returns as soon as it
    is queued: a rank goes on queueing the next steps' collectives behind the one that hangs,
    and, where it left no Flight Recorder dump (whose timeouts set them aside), those it makes
    after the watchdog's abort."""
    first: dict[str, Incident] = {}
    for inc in sorted((i for i in incidents if i.channel is None), key=lambda i: i.seq):
        root = first.setdefault(inc.pg, inc)
        if root is not inc and inc.cause is None and len(inc.sides) <= 1:
            inc.cause = root


def _link(incidents: list[Incident], state: dict[int, RankState], calls: dict[int, list[Call]]
          ) -> list[Incident]:
    """Set each incident's cause; return the roots, the one that held the job up first."""
    waiting_in: dict[int, Incident] = {}
    for inc in incidents:
        for r, c in inc.calls.items():
            # a transfer's record ends at its posting: a rank whose last call it is, is in it
            if state[r].at == c and (inc.channel is not None or not c.returned):
                waiting_in[r] = inc
    for inc in incidents:
        on = inc.waits_on
        if not on or len(inc.sides) > 1:
            continue
        causes = {id(waiting_in[r]): waiting_in[r] for r in on
                  if r in waiting_in and waiting_in[r] is not inc}
        # each rank it waits on waits in that one incident, or is missing from it too (stuck
        # in its own code, it holds up both: the other is the one its partners wait in)
        cause = next(iter(causes.values())) if len(causes) == 1 else None
        if cause is not None and all(r in waiting_in or r in cause.waits_on for r in on):
            inc.cause = cause
    _follow_group_order(incidents)
    _follow_own_order(incidents, calls)
    for inc in incidents:
        cycle = _cycle(inc)
        if cycle is None:
            continue
        if len(cycle) > 2 or any(i.channel is not None for i in cycle):
            _deadlock(cycle)
            continue
        # two collectives waiting on each other: the pattern-breaker's is root
        cause = cycle[1]
        mine = any(_broke_pattern(calls[r]) for r in inc.missing)
        theirs = any(_broke_pattern(calls[r]) for r in cause.missing)
        if mine and not theirs:
            inc.cause = None
        elif theirs and not mine:
            cause.cause = None
        else:                            # no pattern: the earlier one
            first = min((inc, cause), key=lambda i: i.first_begin_ns or 0)
            first.cause = None
    roots = [i for i in incidents if i.cause is None]

    def rank(i: Incident) -> tuple[int, bool, int, int]:
        # a crash or a kill explains the rest: before a mismatch or a deadlock, before a hang;
        # then where a rank is stuck (its last call) before what it posted and went on from;
        # then by time
        order = {FailureKind.KILLED: 0, FailureKind.CRASH: 1, FailureKind.TYPE_MISMATCH: 2,
                 FailureKind.SIZE_MISMATCH: 2, FailureKind.DTYPE_MISMATCH: 2,
                 FailureKind.ARGS_MISMATCH: 2, FailureKind.DEADLOCK: 2,
                 FailureKind.NEVER_ARRIVED: 3}
        stuck = any(state[r].at == c for r, c in i.calls.items())
        return (order.get(i.kind, 4), not stuck, i.first_begin_ns or 0, i.seq)
    return sorted(roots, key=rank)


def _failed_ranks(state: dict[int, RankState]) -> list[int]:
    """Ranks that ended badly on their own: raised or died outside a collective."""
    return [r for r, s in state.items() if (s.raised or s.killed)
            and (s.last is None or s.last.left)]


def _settle_journal_lag(calls: dict[int, list[Call]], state: dict[int, RankState]) -> None:
    """A journal stores the times of the calls Python records (transfers, annotated ones) up
    to 0.1 s late (``journal.TICK_S``): a rank that died meanwhile, its record rebuilt from its
    journal, reads "never returned" for each call it made since. Each but its last did return:
    the rank went on to another. Its last collective is taken as completed when the peers'
    was (ending with the last of theirs)."""
    for r, s in state.items():
        if s.exit != JOURNAL_EXIT or not calls[r]:
            continue
        *before, last = calls[r]
        calls[r] = [replace(c, end_ns=None, error=None, went_on=True)
                    if c.end_ns is None or c.error == NEVER_RETURNED else c for c in before]
        peers = [c for q, cs in calls.items() if q != r for c in cs
                 if c.channel is None and (c.pg, c.seq) == (last.pg, last.seq)]
        if last.channel is None and not last.returned and peers \
                and all(c.returned for c in peers):
            last = replace(last, end_ns=max(c.end_ns or 0 for c in peers), error=None)
        calls[r].append(last)
        s.last = last


def build_verdict(run_dir: str | Path, launch_exits: Mapping[int, Exit] | None = None, *,
                  live: bool = False, run: Run | None = None) -> Verdict | None:
    """The verdict on ``run_dir``; None when every rank completed every collective it began,
    every transfer met its peer's and none died (``launch_exits``: rank -> how its launch saw
    it end, for failed ranks: ``commviz.review.analyses.exits``). ``live``: the job still runs (its
    records are its journals: no rank was killed); ``run``: the run dir already loaded."""
    run_dir = Path(run_dir)
    run = run if run is not None else load_run(run_dir)
    calls: dict[int, list[Call]] = {}
    members: dict[str, tuple[int, ...]] = {}
    state: dict[int, RankState] = {}
    dumps = flightrec.read(run_dir)
    for rank, ri in sorted(run.ranks.items()):
        if ri.record is None:
            continue
        timed_out = dumps[rank].timed_out_ns if rank in dumps else None
        if timed_out is not None:
            timed_out += _offset_ns(ri.record)
        calls[rank], after = _split_at_timeout(
            _mark_gpu_state(_calls(rank, ri.record), dumps.get(rank), ri.record), timed_out)
        for g in ri.record.get("process_groups") or []:
            if g.get("desc") != md.SIDE_GROUP_DESC:
                members.setdefault(str(g["name"]), tuple(int(x) for x in g.get("ranks") or []))
        seen = (ri.record.get("clock") or {}).get("wall_ns")
        exit_ = "running" if live else ri.record.get("exit")
        state[rank] = RankState(rank=rank, last=calls[rank][-1] if calls[rank] else None,
                                exit=exit_, stacks=_stacks(run_dir, rank),
                                launch_exit=(launch_exits or {}).get(rank),
                                seen_ns=None if exit_ == JOURNAL_EXIT else seen,
                                timed_out_ns=timed_out, after_timeout=after)
    _settle_journal_lag(calls, state)
    _settle_unmatched(calls, state)
    for rank, s in state.items():
        s.blocked = next((c for c in calls[rank] if c.state is CallState.ENQUEUED), None)
    incidents = _incidents(calls, members) + _p2p_incidents(calls)
    for inc in incidents:
        _queued_behind(inc, state)
        _judge(inc, state, calls)
    roots = _link(incidents, state, calls)
    if roots:
        root, *others = roots
        return Verdict(kind=root.kind, culprits=root.culprits, root=root,
                       consequences=[i for i in incidents if i.cause is not None],
                       ranks=state, run_dir=run_dir, others=others,
                       flight={r: d.states for r, d in dumps.items()})
    failed = _failed_ranks(state)
    replays = None if failed else _replays(run, calls)
    if replays is not None:
        return Verdict(kind=FailureKind.HANG, culprits=replays.behind, root=None,
                       consequences=[], ranks=state, run_dir=run_dir, replays=replays)
    if not failed:
        return None
    kind = FailureKind.KILLED if all(state[r].killed for r in failed) else FailureKind.CRASH
    return Verdict(kind=kind, culprits=tuple(failed), root=None, consequences=[], ranks=state,
                   run_dir=run_dir)


def _replays(run: Run, calls: dict[int, list[Call]]) -> Replays | None:
    """The first graph (in capture order) whose ranks launched it unequally often."""
    counts: dict[int, dict[int, int]] = defaultdict(dict)
    for rank, ri in run.ranks.items():
        for g in (ri.record or {}).get("graphs") or []:
            if isinstance(g.get("graph"), int) and isinstance(g.get("replays"), int):
                counts[g["graph"]][rank] = g["replays"]
    for graph, by_rank in sorted(counts.items()):
        if len(by_rank) > 1 and len(set(by_rank.values())) > 1:
            holds = {c.label(): None for r in sorted(by_rank) for c in calls.get(r, ())
                     if c.graph == graph}
            return Replays(graph, dict(sorted(by_rank.items())), tuple(holds))
    return None
