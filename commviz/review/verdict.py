"""Why a job hung or died, on one screen: the failure's kind, the culprit ranks, where each
rank stopped and how long the others waited.

Read from what a run dir holds after the job, without torch: every rank's record (a killed
rank's rebuilt from its journal), and the stacks each rank left when it was torn down
(``commviz.record.stacks``). Each process group's collectives are lined up by sequence number
as Flight Recorder's analyzer does, but

- every disagreement of a group is kept, not only its first (``Incident``);
- blame goes to the rank that did not arrive, or whose call differs from the others', never
  to the ranks that waited; any rank can be the culprit, the first one included;
- an incident is a *consequence* of another when a rank missing from it is waiting in that
  other one (rank 0 stuck in the subgroup's collective never reaches the world's): the root
  comes first, its consequences under it. When two incidents wait on each other (a rank
  skipped a subgroup's collective and went on to the world's), the root is the one whose
  missing rank broke the order of groups it had kept until then;
- the kind says why the culprit was missing (``FailureKind``): it raised, was killed, skipped
  the collective and went on, or hung in its own code (its stack says where).

``Verdict.render()`` is what ``commviz report`` opens with and ``commviz launch`` prints.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping, NamedTuple

from commviz import metadata as md
from commviz.merge.select import format_ranks
from commviz.metadata import StrEnum
from commviz.record import stacks as st
from commviz.record.journal import EXIT as JOURNAL_EXIT, NEVER_RETURNED
from commviz.review import flightrec
from commviz.review.desync import DesyncKind, Signature, first_diff, signature_of
from commviz.trace.run import Run, load_run

# incidents kept per group, from its first: enough to see a pattern, never a flood
MAX_PER_GROUP = 10
# how far back a rank's order of groups is checked for a repeating pattern
PATTERN_SPAN = 8


class FailureKind(StrEnum):
    """What went wrong, as the root incident's culprits show it."""

    HANG = "hang"                        # a rank stayed in its own code; the others waited
    CRASH = "crash"                      # a rank raised or died of a fatal signal
    KILLED = "killed"                    # a rank vanished without a word (SIGKILL, OOM killer)
    NEVER_ARRIVED = "never arrived"      # a rank skipped the collective and went on
    TYPE_MISMATCH = "collective mismatch"  # the ranks called different collectives
    SIZE_MISMATCH = "size mismatch"
    DTYPE_MISMATCH = "dtype mismatch"
    ARGS_MISMATCH = "argument mismatch"  # root or reduction differ
    FAILED = "failed"                    # a collective failed on every rank it reached


_MISMATCH = {DesyncKind.TYPE: FailureKind.TYPE_MISMATCH, DesyncKind.SIZE: FailureKind.SIZE_MISMATCH,
             DesyncKind.DTYPE: FailureKind.DTYPE_MISMATCH, DesyncKind.ARGS: FailureKind.ARGS_MISMATCH}


class CallState(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"                    # it raised
    WAITING = "never returned"           # still inside when the rank was torn down or last seen


@dataclass(frozen=True, slots=True)
class Call:
    """One rank's numbered collective, as its record has it."""

    rank: int
    pg: str
    pg_desc: str
    seq: int
    signature: Signature
    callsite: str | None
    begin_ns: int | None
    end_ns: int | None
    error: str | None

    @property
    def state(self) -> CallState:
        if self.error is not None and self.end_ns is not None and self.error != NEVER_RETURNED:
            return CallState.FAILED
        return CallState.WAITING if self.end_ns is None or self.error else CallState.COMPLETED

    def label(self) -> str:
        return f"{self.pg_desc or self.pg}#{self.seq} {self.signature}"


class Exit(NamedTuple):
    """How the launcher saw a rank end (``commviz launch``: torchrun's and the worker's word)."""

    reason: str                          # "RuntimeError: ...", "exit code -9", ...
    stopped: bool = False                # told to stop after another rank failed
    traceback: str | None = None


@dataclass
class RankState:
    """Where one rank stopped."""

    rank: int
    last: Call | None                    # its last numbered collective
    exit: str | None                     # its record's exit ("journal": rebuilt, it was killed)
    stacks: st.Stacks | None
    launch_exit: Exit | None = None      # what the launcher saw, if it ran the job
    seen_ns: int | None = None           # the last time it was known alive (record written)

    @property
    def stopped_at(self) -> st.Frame | None:
        """The line of the program's own code it was on when its stacks were taken."""
        raised = self.launch_exit.traceback if self.launch_exit is not None else None
        return ((self.stacks.raised_at() if self.stacks is not None else None)
                or (st.raised_at(raised) if raised else None)
                or (self.stacks.user_frame() if self.stacks is not None else None))

    @property
    def raised(self) -> bool:
        """It raised or died of a fatal signal (not: was told to stop)."""
        s, e = self.stacks, self.launch_exit
        return bool(s is not None and (s.fatal or s.exception)) or (e is not None and not e.stopped)

    @property
    def killed(self) -> bool:
        """It vanished without running any handler (its record rebuilt from its journal)."""
        return self.exit == JOURNAL_EXIT and (self.stacks is None or not self.stacks.threads)

    def waited_ns(self, call: Call) -> int | None:
        """How long it was inside ``call`` (to its end, or to its last sign of life)."""
        if call.begin_ns is None:
            return None
        end = call.end_ns if call.end_ns is not None else self.seen_ns
        return None if end is None else max(0, end - call.begin_ns)

    def how(self) -> str:
        """How it ended, in a few words."""
        s = self.stacks
        if s is not None and s.fatal:
            return f"died: {s.fatal}"
        if s is not None and s.exception:
            return f"raised {s.exception}"
        if self.launch_exit is not None:
            return self.launch_exit.reason
        if self.exit == JOURNAL_EXIT:
            return "killed without a word (its record rebuilt from its journal)"
        if s is not None and s.threads:
            live = s.path.name.endswith(st.LIVE_SUFFIX)
            return "alive (its stacks taken while it runs)" if live else "torn down (signal)"
        return f"exit: {self.exit}" if self.exit else "no record"


@dataclass
class Incident:
    """One collective the ranks of a group did not all complete the same way."""

    pg: str
    pg_desc: str
    seq: int
    members: tuple[int, ...]
    calls: dict[int, Call]               # rank -> its call at this number
    missing: tuple[int, ...]             # members with data and nothing at this number
    sides: tuple[tuple[Signature, tuple[int, ...]], ...]   # largest first
    kind: FailureKind = FailureKind.FAILED
    culprits: tuple[int, ...] = ()
    why: str = ""
    cause: "Incident | None" = None      # the incident this one follows from

    @property
    def first_begin_ns(self) -> int | None:
        times = [c.begin_ns for c in self.calls.values() if c.begin_ns is not None]
        return min(times) if times else None

    def title(self) -> str:
        sig = self.sides[0][0] if self.sides else None
        return f"group {self.pg} ({self.pg_desc}) seq {self.seq}" + (f" {sig}" if sig else "")


@dataclass
class Verdict:
    kind: FailureKind
    culprits: tuple[int, ...]
    root: Incident | None                # None: a rank failed outside any collective of a group
    consequences: list[Incident]
    ranks: dict[int, RankState]
    run_dir: Path
    others: list[Incident] = field(default_factory=list)   # further roots, later in time
    # torch's own Flight Recorder, per rank that left a dump (``flightrec``)
    flight: dict[int, flightrec.States] = field(default_factory=dict)

    def flight_states(self, inc: Incident) -> dict[int, str | None]:
        """Per member with a Flight Recorder dump: the state torch gave its call at ``inc``
        (None: no entry, it never made the call)."""
        return {r: self.flight[r].get((inc.pg, inc.seq)) for r in inc.members
                if r in self.flight}

    def open_next(self) -> str:
        ranks = set(self.culprits)
        if self.root is not None:
            ranks |= set(self.root.calls)
        return f"commviz merge {self.run_dir} --ranks {format_ranks(ranks or self.ranks)}"

    def render(self) -> str:
        return "\n".join(render_lines(self)) + "\n"


# -- reading the run dir ---------------------------------------------------------------------

def _calls(rank: int, record: Mapping[str, Any]) -> list[Call]:
    offset = int((record.get("clock") or {}).get("offset_ns") or 0)
    out = []
    for meta in record.get("collectives") or []:
        if meta.get(md.KIND, "collective") != "collective" or meta.get(md.SEQ) is None:
            continue
        if meta.get(md.PG_DESC) == md.SIDE_GROUP_DESC:
            continue
        begin, end = meta.get(md.T_BEGIN), meta.get(md.T_END)
        out.append(Call(rank=rank, pg=str(meta.get(md.PG_NAME)),
                        pg_desc=str(meta.get(md.PG_DESC) or ""), seq=int(meta[md.SEQ]),
                        signature=signature_of(str(meta.get(md.OP)), meta),
                        callsite=meta.get(md.CALLSITE),
                        begin_ns=None if begin is None else begin + offset,
                        end_ns=None if end is None else end + offset,
                        error=meta.get(md.ERROR)))
    return out


def _stacks(run_dir: Path, rank: int) -> st.Stacks | None:
    return (st.read_stacks(st.stacks_path(run_dir, rank))
            or st.read_stacks(st.stacks_path(run_dir, rank, live=True)))


# -- lining up ------------------------------------------------------------------------------

def _incidents(calls: dict[int, list[Call]], members: dict[str, tuple[int, ...]]
               ) -> list[Incident]:
    by_pg: dict[str, dict[int, dict[int, Call]]] = defaultdict(lambda: defaultdict(dict))
    for rank, cs in calls.items():
        for c in cs:
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
            done = all(c.state is CallState.COMPLETED for c in at.values())
            if not missing and len(sides) == 1 and done:
                continue
            ordered = tuple(sorted(((s, tuple(rs)) for s, rs in sides.items()),
                                   key=lambda x: (-len(x[1]), x[1])))
            desc = next(iter(at.values())).pg_desc if at else ""
            out.append(Incident(pg=pg, pg_desc=desc, seq=seq, members=members.get(pg, ranks),
                                calls=at, missing=missing, sides=ordered))
            found += 1
            if found >= MAX_PER_GROUP:
                break
    return out


def _broke_pattern(cs: list[Call]) -> bool:
    """Whether a rank's last call is in another group than its repeating order of groups
    says (sub, world, sub, world, ..., world: it skipped one)."""
    groups = [c.pg for c in cs][-(2 * PATTERN_SPAN + 1):]
    if len(groups) < 3:
        return False
    *before, last = groups
    for period in range(1, PATTERN_SPAN + 1):
        if len(before) < 2 * period:
            break
        if all(before[i] == before[i - period] for i in range(period, len(before))):
            return len(set(before)) > 1 and last != before[-period]
    return False


def _judge(inc: Incident, state: dict[int, RankState], calls: dict[int, list[Call]]) -> None:
    """Kind, culprits and why of one incident, on its own."""
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
    # everyone arrived with the same call, and it failed or never returned on some
    waiting = [r for r, c in inc.calls.items() if c.state is CallState.WAITING]
    died = [r for r in inc.calls if state[r].killed
            or state[r].stacks is not None and state[r].stacks.fatal]
    inc.culprits = tuple(sorted(died or waiting or inc.calls))
    inc.kind = (FailureKind.KILLED if died and all(state[r].killed for r in died)
                else FailureKind.CRASH if died else FailureKind.FAILED)
    inc.why = "; ".join(f"rank {r} {state[r].how()}" for r in inc.culprits)


def _missing_kind(inc: Incident, state: dict[int, RankState], calls: dict[int, list[Call]]
                  ) -> FailureKind:
    why, kinds = [], []
    for r in inc.missing:
        s = state[r]
        here = [i for i, c in enumerate(calls[r]) if c.pg == inc.pg]
        later = calls[r][here[-1] + 1:] if here else calls[r]
        outside = s.last is None or s.last.state is CallState.COMPLETED
        if s.killed:
            kinds.append(FailureKind.KILLED)
            why.append(f"rank {r} {s.how()}")
        elif s.raised and outside:
            kinds.append(FailureKind.CRASH)
            why.append(f"rank {r} {s.how()}")
        elif later and _broke_pattern(calls[r]):
            kinds.append(FailureKind.NEVER_ARRIVED)
            why.append(f"rank {r} skipped it: went on to {calls[r][-1].label()}")
        else:
            kinds.append(FailureKind.HANG)
            why.append(f"rank {r} never called it")
    inc.why = "; ".join(why)
    order = list(FailureKind)
    return min(kinds, key=order.index)


def _link(incidents: list[Incident], state: dict[int, RankState], calls: dict[int, list[Call]]
          ) -> list[Incident]:
    """Set each incident's cause; return the roots, the one that held the job up first."""
    waiting_in: dict[int, Incident] = {}
    for inc in incidents:
        for r, c in inc.calls.items():
            last = state[r].last
            if last is not None and last.pg == c.pg and last.seq == c.seq \
                    and c.state is not CallState.COMPLETED:
                waiting_in[r] = inc
    for inc in incidents:
        if not inc.missing or len(inc.sides) > 1:
            continue
        causes = {id(waiting_in[r]): waiting_in[r] for r in inc.missing
                  if r in waiting_in and waiting_in[r] is not inc}
        if len(causes) == 1 and len(inc.missing) == sum(r in waiting_in for r in inc.missing):
            inc.cause = next(iter(causes.values()))
    for inc in incidents:                # waiting on each other: the pattern-breaker's is root
        cause = inc.cause
        if cause is not None and cause.cause is inc:
            mine = any(_broke_pattern(calls[r]) for r in inc.missing)
            theirs = any(_broke_pattern(calls[r]) for r in cause.missing)
            if mine and not theirs:
                inc.cause = None
            elif theirs and not mine:
                cause.cause = None
            else:                        # no pattern: the earlier one
                first = min((inc, cause), key=lambda i: i.first_begin_ns or 0)
                first.cause = None
    roots = [i for i in incidents if i.cause is None]

    def rank(i: Incident) -> tuple[int, int, int]:
        # a crash or a kill explains the rest: before a mismatch, before a hang; then by time
        order = {FailureKind.KILLED: 0, FailureKind.CRASH: 1, FailureKind.TYPE_MISMATCH: 2,
                 FailureKind.SIZE_MISMATCH: 2, FailureKind.DTYPE_MISMATCH: 2,
                 FailureKind.ARGS_MISMATCH: 2, FailureKind.NEVER_ARRIVED: 3}
        return (order.get(i.kind, 4), i.first_begin_ns or 0, i.seq)
    return sorted(roots, key=rank)


def _failed_ranks(state: dict[int, RankState]) -> list[int]:
    """Ranks that ended badly on their own: raised or died outside a collective."""
    return [r for r, s in state.items() if (s.raised or s.killed)
            and (s.last is None or s.last.state is CallState.COMPLETED)]


def _settle_journal_lag(calls: dict[int, list[Call]], state: dict[int, RankState]) -> None:
    """A killed rank's journal stores a call's end up to 0.1 s late (``journal.TICK_S``): its
    last call reads "never returned" though every peer completed it. Such a call is taken
    as completed when the peers' was (ending with the last of theirs)."""
    for r, s in state.items():
        last = s.last
        if not s.killed or last is None or last.state is CallState.COMPLETED:
            continue
        peers = [c for q, cs in calls.items() if q != r for c in cs
                 if (c.pg, c.seq) == (last.pg, last.seq)]
        if peers and all(c.state is CallState.COMPLETED for c in peers):
            done = replace(last, end_ns=max(c.end_ns or 0 for c in peers), error=None)
            calls[r][-1] = s.last = done


def build_verdict(run_dir: str | Path, launch_exits: Mapping[int, Exit] | None = None, *,
                  live: bool = False, run: Run | None = None) -> Verdict | None:
    """The verdict on ``run_dir``; None when every rank completed every collective it began
    and none died (``launch_exits``: rank -> how the launcher saw it end, for failed ranks).
    ``live``: the job still runs (its records are its journals: no rank was killed); ``run``:
    the run dir already loaded."""
    run_dir = Path(run_dir)
    run = run if run is not None else load_run(run_dir)
    calls: dict[int, list[Call]] = {}
    members: dict[str, tuple[int, ...]] = {}
    state: dict[int, RankState] = {}
    for rank, ri in sorted(run.ranks.items()):
        if ri.record is None:
            continue
        calls[rank] = _calls(rank, ri.record)
        for g in ri.record.get("process_groups") or []:
            if g.get("desc") != md.SIDE_GROUP_DESC:
                members.setdefault(str(g["name"]), tuple(int(x) for x in g.get("ranks") or []))
        seen = (ri.record.get("clock") or {}).get("wall_ns")
        exit_ = "running" if live else ri.record.get("exit")
        state[rank] = RankState(rank=rank, last=calls[rank][-1] if calls[rank] else None,
                                exit=exit_, stacks=_stacks(run_dir, rank),
                                launch_exit=(launch_exits or {}).get(rank),
                                seen_ns=None if exit_ == JOURNAL_EXIT else seen)
    _settle_journal_lag(calls, state)
    incidents = _incidents(calls, members)
    for inc in incidents:
        _judge(inc, state, calls)
    roots = _link(incidents, state, calls)
    if roots:
        root, *others = roots
        return Verdict(kind=root.kind, culprits=root.culprits, root=root,
                       consequences=[i for i in incidents if i.cause is not None],
                       ranks=state, run_dir=run_dir, others=others,
                       flight=flightrec.states(run_dir))
    failed = _failed_ranks(state)
    if not failed:
        return None
    kind = FailureKind.KILLED if all(state[r].killed for r in failed) else FailureKind.CRASH
    return Verdict(kind=kind, culprits=tuple(failed), root=None, consequences=[], ranks=state,
                   run_dir=run_dir)


# -- rendering --------------------------------------------------------------------------------

def _secs(ns: int | None) -> str:
    return "?" if ns is None else f"{ns / 1e9:.3g} s"


def _where(c: Call | None) -> str:
    if c is None:
        return "no collective recorded"
    site = f" at {c.callsite}" if c.callsite else ""
    return f"{c.label()}{site}: {c.state}"


def render_lines(v: Verdict) -> list[str]:
    culprits = format_ranks(v.culprits) if v.culprits else "?"
    lines = [f"VERDICT: {v.kind} - culprit rank(s) {culprits}"]
    root = v.root
    if root is not None:
        lines.append(f"  at {root.title()}: {root.why}")
        waiters = [r for r, c in sorted(root.calls.items())
                   if r not in root.culprits and c.state is not CallState.COMPLETED]
        for r in waiters:
            c = root.calls[r]
            lines.append(f"  rank {r} waited {_secs(v.ranks[r].waited_ns(c))} in it ({c.state}"
                         + (f": {_short(c.error)}" if c.error else "") + ")")
    if root is not None and v.flight:
        said = v.flight_states(root)
        lines.append("  Flight Recorder there: " + ", ".join(
            f"rank {r} {state or 'no entry'}" for r, state in sorted(said.items())))
    for r in v.culprits:
        s = v.ranks.get(r)
        if s is None:
            lines.append(f"  rank {r}: no record")
            continue
        lines.append(f"  rank {r}: {s.how()}; last collective {_where(s.last)}")
        where = s.stopped_at
        if where is not None:
            lines.append(f"    stopped at {where}")
    lines.append("  each rank's last collective:")
    for r, s in sorted(v.ranks.items()):
        lines.append(f"    rank {r}: {_where(s.last)}")
    for inc in v.consequences:
        cause = inc.cause
        lines.append(f"  then {inc.title()}: rank(s) {format_ranks(inc.missing)} missing, "
                     f"waiting in {cause.title() if cause else '?'}")
    for inc in v.others:
        lines.append(f"  also {inc.kind} at {inc.title()}: culprit rank(s) "
                     f"{format_ranks(inc.culprits)}: {inc.why}")
    lines.append(f"  open next: {v.open_next()}")
    return lines


def _short(text: str | None, limit: int = 120) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[:limit - 1] + "…"



def _call_json(c: Call | None) -> dict[str, Any] | None:
    if c is None:
        return None
    return {"pg": c.pg, "pg_desc": c.pg_desc, "seq": c.seq, "op": c.signature.op,
            "in_nelems": c.signature.in_nelems, "out_nelems": c.signature.out_nelems,
            "dtype": c.signature.dtype, "callsite": c.callsite, "state": str(c.state),
            "begin_ns": c.begin_ns, "end_ns": c.end_ns, "error": c.error}


def _incident_json(i: Incident, v: Verdict) -> dict[str, Any]:
    return {"kind": str(i.kind), "pg": i.pg, "pg_desc": i.pg_desc, "seq": i.seq,
            "culprits": list(i.culprits), "missing": list(i.missing), "why": i.why,
            "ranks": sorted(i.calls),
            "waited_ns": {str(r): v.ranks[r].waited_ns(c) for r, c in sorted(i.calls.items())},
            "cause": None if i.cause is None else {"pg": i.cause.pg, "seq": i.cause.seq}}


def verdict_json(v: Verdict) -> dict[str, Any]:
    """The verdict as plain data (times in ns): ``commviz report --format json``."""
    def where(s: RankState) -> str | None:
        return None if s.stopped_at is None else str(s.stopped_at)
    root = None if v.root is None else _incident_json(v.root, v)
    if root is not None and v.flight:
        root["flight_recorder"] = {str(r): state for r, state in v.flight_states(v.root).items()}
    return {"kind": str(v.kind), "culprits": list(v.culprits),
            "root": root,
            "consequences": [_incident_json(i, v) for i in v.consequences],
            "others": [_incident_json(i, v) for i in v.others],
            "ranks": {str(r): {"last": _call_json(s.last), "how": s.how(), "stopped_at": where(s)}
                      for r, s in sorted(v.ranks.items())},
            "open_next": v.open_next()}
