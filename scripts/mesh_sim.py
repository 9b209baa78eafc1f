"""A TP x PP x DP job's calls, simulated in columns, with slowdowns planted at their root.

Each step runs the pipeline forward stage by stage (a stage after the first receives its
activations from the stage before, every stage computes, all-reduces in its TP group and sends
on), then every rank all-reduces in its DP group. Ranks are numbered TP fastest: rank =
(dp * PP + stage) * TP + tp. Times follow from the plan: a collective starts when its last
rank arrives and takes its comm time; a receive is posted, and the receiver goes on once the
send was posted and the link delivered.

A planted ``Plant`` is the root the watcher must name; every other rank it holds up is a
victim that must not be:

- ``late``: the rank computes ``LATE_NS`` longer before its TP all_reduce from ``step`` on;
- ``transfer``: the rank's groups (its TP and DP group) take ``SLOW`` times their comm time;
- ``pause``: the rank stops for ``PAUSE_NS`` before its TP all_reduce at ``step``;
- ``p2p_link``: the link from ``rank`` to ``peer`` (the next stage) delivers ``SLOW`` times
  slower;
- ``whole`` (a negative): every group's comm ``WHOLE`` times slower from ``step`` on.

``async_op``: the collectives are launched asynchronously (DDP's buckets on gloo): each call
covers its launch, the rank waits for it outside the record.

``scripts/bench_watch.py`` runs it at 131,072 ranks; ``tests/test_cause.py`` at a few dozen.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

import numpy as np

from commviz import metadata as md
from commviz.live.tail import Call, Shape

T0 = 1_700_000_000_000_000_000
COMPUTE, JITTER = 10_000_000, 200_000
TP_COMM, DP_COMM, POST, DELIVER = 2_000_000, 5_000_000, 20_000, 1_000_000
LATE_NS, PAUSE_NS = 20_000_000, 300_000_000
SLOW, WHOLE = 30, 4
TP_LINE, DP_LINE = "train.py:41", "train.py:57"


class Plant(NamedTuple):
    cause: str                       # a ``commviz.live.cause.Cause``, or "whole"
    rank: int = -1
    peer: int = -1                   # p2p_link: the receiver
    step: int = 3                    # the first step it slows (pause: the one)


class Mesh(NamedTuple):
    tp: int
    pp: int
    dp: int

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def _meta(group: str, desc: str, ranks: tuple[int, ...], op: str, kind: str, origin: str,
          nbytes: int, src: int | None = None, dst: int | None = None,
          async_op: bool = False) -> Shape:
    meta = {md.PG_NAME: group, md.PG_DESC: desc, md.PG_RANKS: list(ranks), md.OP: op,
            md.KIND: kind, md.ORIGIN: origin, md.DEVICE: "cpu", md.BYTES_IN: nbytes,
            md.BYTES_OUT: nbytes, md.ASYNC: async_op}
    if kind == "p2p":
        meta.update({md.SRC: src, md.DST: dst, md.ASYNC: True})
    return Shape.of(meta)


class Job:
    """The simulated job's shapes (one per call site and group or link) and its calls."""

    def __init__(self, mesh: Mesh, steps: int, plants: list[Plant], seed: int = 0,
                 async_op: bool = False) -> None:
        self.mesh, self.steps, self.plants, self.async_op = mesh, steps, plants, async_op
        tp, pp, dp = mesh
        grid = np.arange(mesh.world).reshape(dp, pp, tp)
        self.shapes: list[Shape] = []
        self.tp_shape = np.empty(mesh.world // tp, np.int64)
        for g, ranks in enumerate(grid.reshape(-1, tp)):
            self.tp_shape[g] = self._add(_meta(f"tp{g}", "tp", tuple(ranks.tolist()),
                                               "all_reduce", "collective", TP_LINE, 1 << 20,
                                               async_op=async_op))
        self.dp_shape = np.empty(pp * tp, np.int64)
        for g in range(pp * tp):
            ranks = tuple(grid.reshape(dp, -1)[:, g].tolist())
            self.dp_shape[g] = self._add(_meta(f"dp{g}", "dp", ranks, "all_reduce",
                                               "collective", DP_LINE, 4 << 20,
                                               async_op=async_op))
        self.send_shape = np.full(mesh.world, -1, np.int64)   # by sender
        self.recv_shape = np.full(mesh.world, -1, np.int64)   # by receiver
        for r in range(mesh.world):
            stage = (r // tp) % pp
            if stage + 1 < pp:
                pipe = f"pp{(r // (tp * pp)) * tp + r % tp}"
                ranks = tuple(grid[r // (tp * pp), :, r % tp].tolist())
                dst = r + tp
                self.send_shape[r] = self._add(_meta(pipe, "pp", ranks, "send", "p2p",
                                                     f"PP:{stage}SEND_F0", 1 << 20, r, dst))
                self.recv_shape[dst] = self._add(_meta(pipe, "pp", ranks, "recv", "p2p",
                                                       f"PP:{stage + 1}RECV_F0", 1 << 20, r, dst))
        self.columns = self._run(np.random.default_rng(seed))

    def _add(self, shape: Shape) -> int:
        self.shapes.append(shape)
        return len(self.shapes) - 1

    def _run(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        tp, pp, dp = self.mesh
        world = self.mesh.world
        grid = np.arange(world).reshape(dp, pp, tp)
        t = np.full(world, T0, np.int64)
        send_post = np.zeros(world, np.int64)
        parts: list[tuple[np.ndarray, ...]] = []

        def emit(ranks, shape, seq, pair, begin, end) -> None:
            n = len(ranks)
            parts.append((ranks, shape, np.full(n, seq, np.int64), np.full(n, pair, np.int64),
                          begin.copy(), end.copy()))

        for step in range(1, self.steps + 1):
            whole = WHOLE if any(p.cause == "whole" and step >= p.step for p in self.plants) \
                else 1
            for s in range(pp):
                idx = grid[:, s, :].reshape(-1)
                if s > 0:
                    src = idx - tp
                    post = t[idx].copy()
                    emit(idx, self.recv_shape[idx], -1, step, post, post + POST)
                    deliver = np.full(len(idx), DELIVER, np.int64)
                    for p in self.plants:
                        if p.cause == "p2p_link" and step >= p.step:
                            deliver[idx == p.peer] *= SLOW
                    t[idx] = np.maximum(post + POST, np.maximum(send_post[src], post) + deliver)
                compute = COMPUTE + rng.integers(0, JITTER, len(idx))
                for p in self.plants:
                    if (p.cause == "late" and step >= p.step) or (p.cause == "pause"
                                                                 and step == p.step):
                        compute[idx == p.rank] += LATE_NS if p.cause == "late" else PAUSE_NS
                t[idx] += compute
                arrive = t[idx].reshape(dp, tp)
                comm = np.full(dp, TP_COMM * whole, np.int64)
                for p in self.plants:
                    if p.cause == "transfer" and step >= p.step and (p.rank // tp) % pp == s:
                        comm[p.rank // (tp * pp)] *= SLOW
                end = np.repeat(arrive.max(axis=1) + comm, tp)
                emit(idx, self.tp_shape[idx // tp], step, -1, t[idx],
                     t[idx] + POST if self.async_op else end)
                t[idx] = end
                if s + 1 < pp:
                    emit(idx, self.send_shape[idx], -1, step, t[idx], t[idx] + POST)
                    send_post[idx] = t[idx]
                    t[idx] += POST
            arrive = t.reshape(dp, pp * tp)
            comm = np.full(pp * tp, DP_COMM * whole, np.int64)
            for p in self.plants:
                if p.cause == "transfer" and step >= p.step:
                    comm[p.rank % (pp * tp)] *= SLOW
            end = np.tile(arrive.max(axis=0) + comm, dp)
            every = np.arange(world)
            emit(every, self.dp_shape[every % (pp * tp)], step, -1, t,
                 t + POST if self.async_op else end)
            t = end
        cols = [np.concatenate(c) for c in zip(*parts)]
        order = np.lexsort((cols[4], cols[0]))          # each rank's calls in order, as polled
        return dict(zip(("rank", "shape", "seq", "pair", "begin", "end"),
                        (c[order] for c in cols)))

    def calls(self, chunk: int = 1 << 16, steps: range | None = None) -> Iterator[list[Call]]:
        """The calls as the journal tail hands them over, ``chunk`` at a time (``steps``:
        only those of these steps)."""
        c = self.columns
        if steps is not None:
            step = np.maximum(c["seq"], c["pair"])
            keep = (step >= steps.start) & (step < steps.stop)
            c = {k: v[keep] for k, v in c.items()}
        for a in range(0, len(c["rank"]), chunk):
            cols = [c[k][a:a + chunk].tolist() for k in ("rank", "shape", "seq", "pair",
                                                         "begin", "end")]
            shapes = self.shapes
            yield [Call(r, 0, None if q < 0 else q, None if p < 0 else p, b, e, False,
                        shapes[s])
                   for r, s, q, p, b, e in zip(*cols)]


def expected(plants: list[Plant]) -> set[tuple[int, str, int | None]]:
    """The roots a window must name: (rank, cause, peer)."""
    return {(p.rank, p.cause, p.peer if p.cause == "p2p_link" else None)
            for p in plants if p.cause != "whole"}
