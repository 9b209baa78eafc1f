"""The windows a watcher kept, read back after the job: ``commviz watch`` (or ``commviz launch``
with ``live.watch``) appends each window to ``RUN_DIR/windows.jsonl`` (``commviz.live.series``)
while the job runs; here they are read (the watcher that wrote most) and each slowdown named in
them is followed over the windows that named it. The report tells them
(``review.render.wholerun``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from commviz.live import series


@dataclass
class Slowdown:
    """One rank late to one origin of one group, over the windows that named it."""

    rank: int
    origin: str
    group_label: str
    cause: str
    peer: int | None
    began: int                        # the first window that named it
    began_s: tuple[float, float]      # its start and end, seconds after the first window began
    windows: list[int] = field(default_factory=list)
    skews: list[int] = field(default_factory=list)
    cost_ns: int = 0


@dataclass
class WholeRun:
    path: Path
    windows: list[series.WindowFile]
    notes: list[str]

    @property
    def t0(self) -> int:
        return self.windows[0]["start_ns"]

    def slowdowns(self) -> list[Slowdown]:
        found: dict[tuple[int, str, str, str], Slowdown] = {}
        for w in self.windows:
            for s in w["stragglers"]:
                cause = s.get("cause", "late")
                key = (s["rank"], s["group"], s["origin"], cause)
                if key not in found:
                    found[key] = Slowdown(s["rank"], s["origin"], s["group_label"], cause,
                                          s.get("peer"), w["index"],
                                          ((w["start_ns"] - self.t0) / 1e9,
                                           (w["end_ns"] - self.t0) / 1e9))
                d = found[key]
                d.windows.append(w["index"])
                d.skews.append(s["skew_ns"])
                d.cost_ns += s["cost_ns"]
        return sorted(found.values(), key=lambda d: (d.began, -d.cost_ns))


def read_whole_run(run_dir: Path) -> WholeRun | None:
    """The windows of the watcher that wrote most (None: no watcher kept any)."""
    path = series.path_of(run_dir)
    if not path.is_file():
        return None
    lines, notes = series.read(path)
    windows = series.one_watcher(lines)
    return WholeRun(path, windows, notes) if windows else None


def times_of(whole: WholeRun) -> str:
    """Which times the windows used: "cpu", "gpu" or "mixed" (``series.times_of``, run-wide)."""
    used = {w["times"] for w in whole.windows}
    return used.pop() if len(used) == 1 else "mixed"
