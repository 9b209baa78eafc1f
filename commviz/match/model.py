"""What matching produces: one ``CommEvent`` per collective (or p2p op) per rank.

Everything downstream (the merged trace's lanes and flows, the review) works on these. A
``CommEvent`` says where a collective ran on a rank (its GPU kernel, or its CPU span for gloo
or when no kernel is known) and carries the metadata (eager keys + commviz keys).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

from commviz import metadata as md
from commviz.metadata import StrEnum

class KeyKind(StrEnum):
    """What numbers an instance: the first element of its key as written (``InstanceKey.wire``)."""

    COLLECTIVE = "c"            # commviz.seq: the backend's number per process group
    USER = "u"                  # an annotate_collective block's own number per group
    P2P = "p"                   # commviz.p2p_seq per (group, src, dst)
    BATCH = "b"                 # batch_isend_irecv: its member transfers
    PROFILER = "nccl"           # no record: the profiler's Seq, else the order in the trace
    PROFILER_P2P = "nccl-p2p"   # the same for a p2p kernel whose peers the profiler names

    @property
    def p2p(self) -> bool:
        """Whether the instance is a transfer between two ranks (not a group collective)."""
        return self in _TRANSFERS


# (a set built once: Python 3.11 reads an enum member off its class ten times slower than a
# global, and merges ask this of every instance)
_TRANSFERS = frozenset({KeyKind.P2P, KeyKind.PROFILER_P2P, KeyKind.BATCH})


class Pair(NamedTuple):
    """One transfer of a p2p batch."""

    src: int
    dst: int
    seq: str


class InstanceKey(NamedTuple):
    """The name of one collective instance, the same on every rank that took part.

    In files and trace args it is written in its compact tagged form (``wire``): ``[kind, pg,
    seq]``; p2p ``[kind, pg, src, dst, seq]``; a batch ``[kind, pg, pairs]``; a graph replay's
    copy adds ``"replay", number``."""

    kind: KeyKind
    pg: str
    seq: int | None = None
    src: int | None = None
    dst: int | None = None
    pairs: tuple[Pair, ...] = ()
    replay: Any = None          # a CUDA graph replay: its number, or ("in trace", n)

    def wire(self) -> tuple:
        """The compact form written to matched runs, comm tables, reports and trace args."""
        if self.kind is KeyKind.BATCH:
            out: tuple = (self.kind.value, self.pg, tuple(tuple(p) for p in self.pairs))
        elif self.kind in (KeyKind.P2P, KeyKind.PROFILER_P2P):
            out = (self.kind.value, self.pg, self.src, self.dst, self.seq)
        else:
            out = (self.kind.value, self.pg, self.seq)
        return out if self.replay is None else (*out, "replay", self.replay)

    @classmethod
    def from_wire(cls, value: Any) -> InstanceKey:
        """A key from its compact form (JSON lists or tuples); ValueError when it is none."""
        item = _tuples(value)
        if not isinstance(item, tuple) or len(item) < 3:
            raise ValueError(f"not an instance key: {value!r}")
        replay = None
        if len(item) >= 5 and item[-2] == "replay":
            item, replay = item[:-2], item[-1]
        kind = KeyKind(item[0])
        if kind is KeyKind.BATCH and len(item) == 3:
            return cls(kind, item[1], pairs=tuple(Pair(*p) for p in item[2]), replay=replay)
        if kind in (KeyKind.P2P, KeyKind.PROFILER_P2P) and len(item) == 5:
            return cls(kind, item[1], item[4], item[2], item[3], replay=replay)
        if len(item) == 3 and kind not in (KeyKind.BATCH, KeyKind.P2P, KeyKind.PROFILER_P2P):
            return cls(kind, item[1], item[2], replay=replay)
        raise ValueError(f"not an instance key: {value!r}")


def _tuples(value: Any) -> Any:
    return tuple(_tuples(x) for x in value) if isinstance(value, (list, tuple)) else value


def instance_key(args: dict[str, Any]) -> InstanceKey | None:
    """The key that names the same collective instance on every rank that took part.

    Collectives: (process group, sequence number); annotations of communication outside c10d:
    (group, their own number). p2p: (group, src, dst, p2p sequence).
    Batches of p2p ops: (group, sorted member pairs), identical on both peers.
    """
    pg = args.get(md.PG_NAME)
    kind = args.get(md.KIND, "collective")
    if kind == "collective" and args.get(md.SEQ) is not None:
        return InstanceKey(KeyKind.COLLECTIVE, pg, int(args[md.SEQ]))
    if kind == "collective" and args.get(md.USER_SEQ) is not None:
        return InstanceKey(KeyKind.USER, pg, int(args[md.USER_SEQ]))
    if kind == "p2p" and args.get(md.P2P_SEQ) is not None:
        return InstanceKey(KeyKind.P2P, pg, int(args[md.P2P_SEQ]), args.get(md.SRC),
                           args.get(md.DST))
    if kind == "batch" and args.get(md.PEERS):
        me = args.get(md.RANK)
        pairs = []
        for item, seq in zip(str(args[md.PEERS]).split(","), str(args.get(md.P2P_SEQ, "")).split(",")):
            direction, peer = item.split(":")
            src, dst = (me, int(peer)) if direction == "send" else (int(peer), me)
            pairs.append(Pair(src, dst, seq))
        return InstanceKey(KeyKind.BATCH, pg, pairs=tuple(sorted(pairs)))
    return None


class Source(StrEnum):
    """Where a CommEvent's times come from."""

    KERNEL = "kernel"           # its GPU kernel(s)
    CPU = "cpu"                 # its CPU span in the profiler trace
    RECORD = "record"           # commviz's record alone (outside the profiled window)


@dataclass(slots=True)
class CommEvent:
    """One collective on one rank. Times are wall ns: the rank's own clock as the matcher
    makes them, the merged clock (rank 0's) once ``commviz.match.artifact`` aligned them."""

    rank: int
    pg: str
    op: str
    start_ns: int
    end_ns: int
    args: dict[str, Any]
    key: InstanceKey | None = None
    source: Source = Source.RECORD
    stream: int | None = None     # GPU stream of the kernel, when there is one
    graphed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def seq(self) -> int | None:
        return self.args.get(md.SEQ)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns

    def __reduce__(self) -> tuple:
        """Pickled as its fields in order: a merge worker sends its rank's events back to the
        main process, and a slotted dataclass's default state takes twice as long each way."""
        return CommEvent, _comm_fields(self)


_FIELDS = tuple(f.name for f in fields(CommEvent))
_comm_fields = operator.attrgetter(*_FIELDS)
_KEY = _FIELDS.index("key")


def comm_columns(events: list[CommEvent]) -> list[list]:
    """The events as one list per field, their keys as plain tuples: how a merge worker
    sends a rank's events to the main process (``comm_events`` reads them back). Pickled so, a
    rank's 6k events take half the time to write and a fifth to read, against a reduce call
    and a key object an event."""
    columns = [list(c) for c in zip(*map(_comm_fields, events))] or [[] for _ in _FIELDS]
    columns[_KEY] = [None if k is None else tuple(k) for k in columns[_KEY]]
    return columns


def comm_events(columns: list[list]) -> list[CommEvent]:
    """The events ``comm_columns`` gave."""
    columns = list(columns)
    columns[_KEY] = [None if k is None else InstanceKey._make(k) for k in columns[_KEY]]
    return list(map(CommEvent, *columns))


def events_from_record(record: dict[str, Any]) -> list[CommEvent]:
    """Records alone (no trace): each call's CPU span, on the rank's own clock.

    For gloo the call is synchronous (unless async_op), so its CPU span is the collective. A
    call that began and never returned (its rank was inside it when its record was written:
    torn down in a collective its peers broke) is an instant at its start, which
    ``merge.instances.held`` tells from a call that completed: the rank made it, so it lines
    up with its peers' (a desync of sizes stays one, not a "missing" rank).
    """
    out = []
    for args in record["collectives"]:
        t0, t1 = args.get(md.T_BEGIN), args.get(md.T_END)
        if t0 is None:
            continue
        out.append(CommEvent(rank=int(record["rank"]), pg=str(args.get(md.PG_NAME)),
                             op=str(args.get(md.OP)), start_ns=int(t0),
                             end_ns=int(t0 if t1 is None else t1), args=args,
                             key=instance_key(args), source=Source.RECORD,
                             graphed=bool(args.get(md.CAPTURED))))
    return out
