"""``commviz verify``: read a .pftrace back as Perfetto will and check what the UI shows.

Built on the one ``.pftrace`` reader (``commviz.write.read``): ``structure`` checks the trace on
its own (nesting, tracks, interning, clocks, flows), ``inputs`` checks it against the run it was
merged from, ``command`` is the CLI. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commviz.errors import SourceError
from commviz.verify.structure import TraceCheck, VerifyReport
from commviz.write.read import Problem, read_pftrace, slices

__all__ = ["Problem", "Slice", "VerifyReport", "read_slices", "verify_pftrace"]


@dataclass(frozen=True)
class Slice:
    """One slice as Perfetto shows it, labelled (instants have ``dur == 0`` and ``instant``)."""

    process: str
    track: str
    name: str | None
    ts: int
    dur: int
    args: dict[str, Any]
    flow_ids: tuple[int, ...]
    categories: tuple[str, ...]
    instant: bool = False


def _check_path(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise SourceError(str(path), "no such file" if not path.exists() else "not a file")
    return path


def verify_pftrace(path: str | Path, *, inputs: Any = None) -> VerifyReport:
    """Check a .pftrace as Perfetto will read it; with ``inputs`` (a ``commviz.trace.run.Run``)
    also check that every slice of its traces is there once, with its args and launch flow.

    Raises ``SourceError`` only when the file cannot be read as a trace at all; everything else
    is reported in the returned ``VerifyReport``.
    """
    v = TraceCheck(_check_path(path))
    report = v.run()
    if inputs is not None:
        from commviz.verify.inputs import InputCheck    # reads traces: only with a run

        try:
            InputCheck(v, inputs).check()
        except (ArithmeticError, ValueError, TypeError, KeyError) as exc:
            # an input no profiler writes (a ts of 1e30, a string duration): say so, don't crash
            v.problem("input-unreadable", f"comparing with the inputs stopped: "
                      f"{type(exc).__name__}: {exc}")
        report.inputs = {r: dict(c) for r, c in report.inputs.items()}
    return report


def read_slices(path: str | Path) -> tuple[list[Slice], VerifyReport]:
    """Every slice and instant of a (small) trace with its args, flows and categories, labelled
    as Perfetto shows them, and the verify report. For tests and inspection: every record is
    kept, so memory grows with the trace."""
    report = verify_pftrace(path)
    contents = read_pftrace(path)
    check = TraceCheck(Path(path))
    check.decoder.tracks = contents.tracks
    check.pid_track = {t.pid: u for u, t in contents.tracks.items() if t.pid is not None}
    out = []
    for s in slices(contents)[0]:
        proc = check.process_of(s.track)
        out.append(Slice(process=check.track_name(proc) if proc is not None else "",
                         track=check.track_name(s.track), name=s.name, ts=s.start,
                         dur=s.end - s.start, args=s.args, flow_ids=tuple(sorted(set(s.flow_ids))),
                         categories=s.categories, instant=s.instant))
    return out, report
