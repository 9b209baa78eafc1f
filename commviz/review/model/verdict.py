"""The verdict's model: what the judge (``review.analyses.judge``) returns and the wording
(``review.render.verdict_text``) tells: each rank's calls and state, the incidents where a
group's or a transfer's ranks disagree, and the verdict over them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from commviz import metadata as md
from commviz.merge.select import format_ranks
from commviz.metadata import StrEnum
from commviz.record import stacks as st
from commviz.record.journal import EXIT as JOURNAL_EXIT, NEVER_RETURNED
from commviz.review.analyses import flightrec
from commviz.review.analyses.desync import Signature, SplitMismatch
from commviz.review.analyses.exits import Exit


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
    DEADLOCK = "deadlock"                # ranks wait on each other in a circle (a transfer in it)
    FAILED = "failed"                    # a collective failed on every rank it reached



class CallState(StrEnum):
    COMPLETED = "completed"
    POSTED = "posted"                    # a transfer its peer matched (its record: the posting)
    UNMATCHED = "never matched"          # a transfer whose peer never posted the other side
    FAILED = "failed"                    # it raised
    WAITING = "never returned"           # still inside when the rank was torn down or last seen
    # an NCCL collective that returned once queued, whose GPU work never completed (Flight
    # Recorder's entry: scheduled or started)
    ENQUEUED = "enqueued, never completed on the GPU per Flight Recorder"
    # an NCCL collective that returned once queued, on a rank that left no Flight Recorder dump
    # (killed, or the recorder was off): whether its GPU work completed, nothing says
    QUEUED = "returned once queued; no Flight Recorder dump of this rank says whether it ran"


class Channel(NamedTuple):
    """One direction of point-to-point traffic in a group; its transfers are numbered 1, 2, ...
    on both sides (``commviz.p2p_seq``)."""

    pg: str
    src: int | None                      # None: a receive from any source (not lined up)
    dst: int


@dataclass(frozen=True, slots=True)
class Call:
    """One rank's numbered collective or point-to-point op, as its record has it."""

    rank: int
    pg: str
    pg_desc: str
    group: str                           # how people name the group (``md.group_label``)
    seq: int                             # a transfer's: its number on its channel
    signature: Signature
    callsite: str | None
    origin: str | None
    begin_ns: int | None
    end_ns: int | None
    error: str | None
    channel: Channel | None = None       # a point-to-point op's; None: a collective
    unmatched: bool = False              # a transfer whose peer never posted the other side
    went_on: bool = False                # no end recorded, but its rank made later calls
    graph: int | None = None             # the CUDA graph it was captured into
    enqueued: bool = False               # returned, its GPU work never completed (``ENQUEUED``)
    unconfirmed: bool = False            # returned, its GPU work's end unknown (``QUEUED``)

    @property
    def state(self) -> CallState:
        if self.error is not None and self.end_ns is not None and self.error != NEVER_RETURNED:
            return CallState.FAILED
        if (self.end_ns is None and not self.went_on) or self.error:
            return CallState.WAITING
        if self.channel is None:
            return (CallState.ENQUEUED if self.enqueued else CallState.QUEUED if self.unconfirmed
                    else CallState.COMPLETED)
        return CallState.UNMATCHED if self.unmatched else CallState.POSTED

    @property
    def returned(self) -> bool:
        """It returned without an error (a transfer: was posted, and its peer posted the other
        side; an NCCL collective: its GPU work completed, where Flight Recorder says)."""
        return self.state in (CallState.COMPLETED, CallState.QUEUED, CallState.POSTED)

    @property
    def left(self) -> bool:
        """Its rank's Python went on from it: it returned, or was queued on the GPU."""
        return self.returned or self.state is CallState.ENQUEUED

    @property
    def peer(self) -> int | None:
        ch = self.channel
        return None if ch is None else ch.dst if ch.src == self.rank else ch.src

    @property
    def nbytes(self) -> int | None:
        sig = self.signature
        item = md.DTYPE_BYTES.get(str(sig.dtype))
        return None if item is None or sig.in_nelems is None else item * sig.in_nelems

    def size(self) -> str:
        """A transfer's size as people read it: "4 KiB Float"."""
        return f"{md.fmt_bytes(self.nbytes)} {self.signature.dtype}"

    def transfer(self) -> str:
        """A point-to-point op as people read it: "send→1 #3 4 KiB Float"."""
        number = f" #{self.seq}" if self.seq else ""      # 0: a receive from any source
        return f"{md.p2p_op(self.signature.op, self.peer)}{number} {self.size()}"

    def label(self) -> str:
        if self.channel is not None:
            return f"{self.group} {self.transfer()}"
        return f"{self.group}#{self.seq} {self.signature}"

    def frame(self) -> st.Frame | None:
        """Its call site as a stack frame (the function is not recorded)."""
        file, _, line = (self.callsite or "").rpartition(":")
        return st.Frame(file, int(line), "") if file and line.isdigit() else None


@dataclass
class RankState:
    """Where one rank stopped."""

    rank: int
    last: Call | None                    # its last numbered collective or transfer
    exit: str | None                     # its record's exit ("journal": rebuilt, it was killed)
    stacks: st.Stacks | None
    launch_exit: Exit | None = None      # how its launch saw it end (``review.analyses.exits``)
    seen_ns: int | None = None           # the last time it was known alive (record written)
    timed_out_ns: int | None = None      # when NCCL's watchdog timed out a collective of it
    after_timeout: list[Call] = field(default_factory=list)   # the calls it made since, set aside
    # its first collective whose GPU work never completed (Flight Recorder): the rest of its
    # GPU work is queued behind it, so there it waits, whatever it queued since
    blocked: Call | None = None

    @property
    def at(self) -> Call | None:
        """Where it waits: the collective its GPU is held up in, else its last call."""
        return self.blocked or self.last

    @property
    def stopped_at(self) -> st.Frame | None:
        """The line of the program's own code it was on when its stacks were taken; where
        they show none (its Python waits in a library, on the GPU), the call site of the
        collective it waits in."""
        raised = self.launch_exit.traceback if self.launch_exit is not None else None
        at = self.at
        return ((self.stacks.raised_at() if self.stacks is not None else None)
                or (st.raised_at(raised) if raised else None)
                or (self.stacks.user_frame() if self.stacks is not None else None)
                or (at.frame() if at is not None and at.state in (
                    CallState.ENQUEUED, CallState.WAITING, CallState.FAILED) else None))

    @property
    def aborted(self) -> bool:
        """It ended after NCCL's watchdog timed out one of its collectives (it made calls
        since, or was seen alive since): what took it down (the watchdog's SIGABRT, an aborted
        communicator's error) followed from that."""
        return self.timed_out_ns is not None and (bool(self.after_timeout) or (
            self.seen_ns is not None and self.seen_ns >= self.timed_out_ns))

    @property
    def raised(self) -> bool:
        """It raised or died of a fatal signal on its own (not: was told to stop, nor taken
        down after NCCL's watchdog timed out its collective)."""
        s, e = self.stacks, self.launch_exit
        return not self.aborted and (bool(s is not None and (s.fatal or s.exception))
                                     or (e is not None and not e.stopped))

    @property
    def killed(self) -> bool:
        """It vanished without running any handler (its record rebuilt from its journal)."""
        return self.exit == JOURNAL_EXIT and (self.stacks is None or not self.stacks.threads)

    def waited_ns(self, call: Call) -> int | None:
        """How long it was inside ``call`` (to its end, or to its last sign of life; a matched
        transfer: not known, its record ends at the posting)."""
        state = call.state
        if call.begin_ns is None or state is CallState.POSTED:
            return None
        end = self.seen_ns if call.end_ns is None or state is CallState.UNMATCHED else call.end_ns
        if state is CallState.ENQUEUED:  # its GPU waited until the watchdog gave up, or the end
            end = self.timed_out_ns or self.seen_ns
        return None if end is None else max(0, end - call.begin_ns)

    def how(self) -> str:
        """How it ended, in a few words."""
        said = self._how()
        return f"{said}, after NCCL's watchdog timed out its collective" if self.aborted else said

    def _how(self) -> str:
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
    """One collective the ranks of a group did not all complete the same way, or one transfer
    (a send and its receive: ``channel``) that was not posted, not alike or not completed on
    both sides."""

    pg: str
    pg_desc: str
    group: str                           # how people name the group (``md.group_label``)
    seq: int                             # a transfer's: its number on its channel
    members: tuple[int, ...]             # a transfer's: (sender, receiver)
    calls: dict[int, Call]               # rank -> its call at this number
    missing: tuple[int, ...]             # members with data and nothing at this number
    sides: tuple[tuple[Signature, tuple[int, ...]], ...]   # largest first
    kind: FailureKind = FailureKind.FAILED
    culprits: tuple[int, ...] = ()
    why: str = ""
    cause: "Incident | None" = None      # the incident this one follows from
    channel: Channel | None = None       # a transfer's; None: a collective
    splits: SplitMismatch | None = None  # an all_to_all whose splits do not pair up
    # members whose GPU work for it is queued behind an earlier collective of theirs that never
    # completed (``RankState.blocked``): its other members wait on them
    behind: tuple[int, ...] = ()
    # its missing ranks reach ``cause`` first, in their own order of groups, and never did
    before: bool = False

    @property
    def waits_on(self) -> tuple[int, ...]:
        """The ranks it waits on: those missing from it, or whose part is queued behind
        another collective; of a transfer both sides posted, the side that returned while the
        other failed or never returned."""
        if self.missing or self.channel is None:
            return self.missing or self.behind
        if all(c.returned for c in self.calls.values()):
            return ()
        return tuple(r for r, c in sorted(self.calls.items()) if c.returned)

    @property
    def first_begin_ns(self) -> int | None:
        times = [c.begin_ns for c in self.calls.values() if c.begin_ns is not None]
        return min(times) if times else None

    def title(self) -> str:
        group = f"group {md.pg_shown(self.pg)} ({self.group})"
        if self.channel is not None:     # each side that posted: "rank 0 send→1 #5 64 B Float"
            return f"{group} " + ", ".join(f"rank {r} {c.transfer()}"
                                           for r, c in sorted(self.calls.items()))
        sig = self.sides[0][0].shared() if self.sides else None
        return f"{group} seq {self.seq}" + (f" {sig}" if sig else "")


class Replays(NamedTuple):
    """A CUDA graph its ranks replayed unequally often. A replayed collective makes no record
    and no Flight Recorder entry (NCCL's watchdog does not see it either): the counts of
    commviz's replay hook are what show a hang inside replays. Graphs are numbered per rank
    in capture order, the same on every rank of a program that captures the same graphs."""

    graph: int
    counts: dict[int, int]               # rank -> replays it launched
    holds: tuple[str, ...]               # the captured collectives ("default_pg#2 all_reduce(...)")

    @property
    def behind(self) -> tuple[int, ...]:
        low = min(self.counts.values())
        return tuple(r for r, n in sorted(self.counts.items()) if n == low)

    def describe(self) -> str:
        low, high = min(self.counts.values()), max(self.counts.values())
        counts = ", ".join(f"rank {r} {n}" for r, n in sorted(self.counts.items()))
        return (f"CUDA graph {self.graph} ({', '.join(self.holds) or 'no collective recorded'}):"
                f" replays launched {counts}; rank(s) {format_ranks(self.behind)} never launched"
                f" replay #{low + 1}, which the others' replay #{high} waits on")


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
    replays: Replays | None = None       # the root when it is a hang inside graph replays

    def flight_states(self, inc: Incident) -> dict[int, str | None]:
        """Per member with a Flight Recorder dump: the state torch gave its call at ``inc``
        (None: no entry, it never made the call; a transfer: none, ``flightrec`` reads
        collectives only)."""
        if inc.channel is not None:
            return {}
        return {r: self.flight[r].get((inc.pg, inc.seq)) for r in inc.members
                if r in self.flight}

    def open_next(self) -> str:
        ranks = set(self.culprits)
        if self.root is not None:
            ranks |= set(self.root.calls)
        return f"commviz merge {self.run_dir} --ranks {format_ranks(ranks or self.ranks)}"
