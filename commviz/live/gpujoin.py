"""The calls a live view reads, given their NCCL ops' GPU times while the job runs.

``RunTail`` gives calls with CPU times only; on NCCL a call covers the kernel's launch. Each
rank's NCCL profiler plugin writes its ops' GPU start and end to ``commviz_rank{R}.gputime``
(``commviz.live.gputime``), an op once its kernel ended: often after its call was read, as the
GPU runs behind the CPU. So ``GpuJoin.timed`` holds a rank's CUDA calls until their ops are
matched (``gputime.match``: the calling thread and the call's span) or ``hold_ns`` has passed
since they ended, then hands them on, ``Call.gpu_begin_ns``/``gpu_end_ns`` set where matched.
A call the plugin did not sample (``COMMVIZ_GPUTIME_EVERY``: 1 in 4 by default) never gets an
op and goes on untimed after the hold. CPU calls (gloo), and every call of a rank without a
GPU-time file, go on at once, unchanged. CUDA graph replays are not calls of the record: their
ops are not in the live views.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from commviz import metadata as md
from commviz.errors import RecordError
from commviz.live.gputime import GpuOp, GpuTimes, match
from commviz.live.tail import Call

HOLD_NS = 2_000_000_000          # how long a CUDA call waits for its op's GPU times


@dataclass
class _Rank:
    times: GpuTimes
    held: list[tuple[int, Call]] = field(default_factory=list)   # (when read, call)
    ops: list[GpuOp] = field(default_factory=list)               # not matched yet


class GpuJoin:
    """Every rank's GPU-time file in ``run_dir``, followed; ``timed`` gives calls their times."""

    def __init__(self, run_dir: str | os.PathLike[str], hold_ns: int = HOLD_NS) -> None:
        self.run_dir, self.hold_ns = Path(run_dir), hold_ns
        self._ranks: dict[int, _Rank] = {}
        self._broken: dict[int, str] = {}      # rank -> why its GPU-time file is not read

    @property
    def problems(self) -> list[str]:
        """One line per GPU-time file given up on (its rank's calls go on with CPU times)."""
        return list(self._broken.values())

    @property
    def every(self) -> dict[int, int]:
        """Per rank with a GPU-time file: one NCCL call in this many is timed."""
        return {r: t.times.every for r, t in sorted(self._ranks.items())}

    def follows(self, rank: int) -> bool:
        """Whether ``rank`` has a GPU-time file: its CUDA calls without GPU times were not
        sampled (or their ops were lost), not merely launched with the plugin off."""
        return rank in self._ranks

    def timed(self, calls: Iterable[Call], now_ns: int, final: bool = False) -> list[Call]:
        """``calls`` and those held before, each handed on once: matched, past the hold, or
        ``final`` (the last read: nothing is held back). A GPU-time file that cannot be read
        is one line in ``problems`` naming it; its rank's calls go on untimed from then on."""
        out: list[Call] = []
        for call in calls:
            rank = self._rank(call.rank) if call.shape.device == "cuda" else None
            if rank is None:
                out.append(call)
            else:
                rank.held.append((now_ns, call))
        for number, rank in list(self._ranks.items()):
            if not rank.held:
                continue
            try:
                out += self._match(rank, now_ns, final)
            except RecordError as exc:
                self._broken[number] = str(exc)
                del self._ranks[number]
                out += [call for _, call in rank.held]
        return out

    def _rank(self, number: int) -> _Rank | None:
        rank = self._ranks.get(number)
        if rank is None and number not in self._broken:
            path = self.run_dir / f"commviz_rank{number}.gputime"
            if not path.exists():
                return None
            rank = self._ranks[number] = _Rank(GpuTimes(path))
        return rank

    def _match(self, rank: _Rank, now_ns: int, final: bool) -> list[Call]:
        rank.ops += rank.times.poll()
        views = [{md.TID: c.shape.meta.get(md.TID), md.T_BEGIN: c.t_begin_ns,
                  md.T_END: c.t_end_ns, md.PG_NAME: c.shape.group} for _, c in rank.held]
        spans = match(views, rank.times, rank.ops).spans
        out, held = [], []
        for i, (read_ns, call) in enumerate(rank.held):
            span = spans.get(i)
            if span is not None:
                out.append(call._replace(gpu_begin_ns=span.start_ns, gpu_end_ns=span.end_ns))
            elif final or now_ns - read_ns >= self.hold_ns:
                out.append(call)
            else:
                held.append((read_ns, call))
        rank.held = held
        # an op is kept while a call of it may still be read (a call is read within about
        # 0.1 s of its end): those older than the hold are of calls handed on already
        oldest = now_ns - self.hold_ns
        rank.ops = [] if final else [o for o in rank.ops if o.t_enqueue >= oldest]
        return out
