"""What matching produces: one ``CommEvent`` per collective (or p2p op) per rank.

Everything downstream (the merged trace's lanes and flows, the review) works on these. A
``CommEvent`` says where a collective ran on a rank (its GPU kernel, or its CPU span for gloo
or when no kernel is known) and carries the metadata (eager keys + commviz keys).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from commviz import metadata as md

InstanceKey = tuple


def instance_key(args: dict[str, Any]) -> InstanceKey | None:
    """The key that names the same collective instance on every rank that took part.

    Collectives: (process group, sequence number); annotations of communication outside c10d:
    (group, their own number). p2p: (group, src, dst, p2p sequence).
    Batches of p2p ops: (group, "batch", sorted member pairs), identical on both peers.
    """
    pg = args.get(md.PG_NAME)
    kind = args.get(md.KIND, "collective")
    if kind == "collective" and args.get(md.SEQ) is not None:
        return ("c", pg, int(args[md.SEQ]))
    if kind == "collective" and args.get(md.USER_SEQ) is not None:
        return ("u", pg, int(args[md.USER_SEQ]))
    if kind == "p2p" and args.get(md.P2P_SEQ) is not None:
        return ("p", pg, args.get(md.SRC), args.get(md.DST), int(args[md.P2P_SEQ]))
    if kind == "batch" and args.get(md.PEERS):
        me = args.get(md.RANK)
        pairs = []
        for item, seq in zip(str(args[md.PEERS]).split(","), str(args.get(md.P2P_SEQ, "")).split(",")):
            direction, peer = item.split(":")
            src, dst = (me, int(peer)) if direction == "send" else (int(peer), me)
            pairs.append((src, dst, seq))
        return ("b", pg, tuple(sorted(pairs)))
    return None


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
    source: str = "record"        # "kernel" (GPU kernel), "cpu" (trace CPU span), "record"
    stream: int | None = None     # GPU stream of the kernel, when there is one
    graphed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def seq(self) -> int | None:
        return self.args.get(md.SEQ)

    @property
    def duration_ns(self) -> int:
        return self.end_ns - self.start_ns


def events_from_record(record: dict[str, Any]) -> list[CommEvent]:
    """Records alone (no trace): each call's CPU span, on the rank's own clock.

    For gloo the call is synchronous (unless async_op), so its CPU span is the collective.
    """
    out = []
    for args in record["collectives"]:
        t0, t1 = args.get(md.T_BEGIN), args.get(md.T_END)
        if t0 is None or t1 is None:
            continue
        out.append(CommEvent(rank=int(record["rank"]), pg=str(args.get(md.PG_NAME)),
                             op=str(args.get(md.OP)), start_ns=int(t0),
                             end_ns=int(t1), args=args, key=instance_key(args),
                             source="record", graphed=bool(args.get(md.CAPTURED))))
    return out
