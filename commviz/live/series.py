"""The windows a watcher saw, kept in the run dir: ``RUN_DIR/windows.jsonl``, one line a window.

The journals a watcher reads are gone once the job ends (each rank's pickle holds the records),
and so would be what the watcher said while it ran: who was late where, window by window. So
each window is appended as one JSON line (one ``write`` with ``O_APPEND``: a watcher killed
mid-line leaves a torn last line, which ``read`` skips and names; every earlier line stays
whole). ``commviz report`` reads it back ("over the whole run"). ``commviz watch --once
--format json`` prints the same object. Declared once (``WindowFile``); schema, version::

    {"schema": "commviz.window", "version": 2, "watcher": "host:pid", "index": int,
     "start_ns": int, "end_ns": int, "times": "cpu" | "gpu" | "mixed", "ranks": [int],
     "groups": [Row], "origins": [Row],        # the ROWS_KEPT with the most wait, + stragglers'
     "stragglers": [{"rank", "origin", "group", "group_label", "instances", "late_in",
                     "skew_ns", "cost_ns", "cause", "peer", "waited"}],
     "incomplete": int, "missed": [[rank, calls]], "problems": [str],
     "links": [Row]}                           # p2p transfers per origin (group "p2p")
    Row: {"group", "label", "origin" (null: the group's row), "seen", "size",
          "times": "cpu" | "gpu", "window": Figures, "run": Figures}
    Figures: {"instances", "timed", "calls", "comm_ns", "busbw_gbps", "skew_p50_ns", "skew_p99_ns",
              "wait_ns"}

``times``, per row: "gpu" when the window's figures of the row are its NCCL ops' GPU times
(from the ``timed`` instances among ``instances``: with sampling, the timed ones alone), "cpu"
when they are the calls' CPU times; the line's: "gpu", "cpu" or "mixed" over its group rows.
Version 2 added ``times`` per row and ``timed``; a straggler's ``cause`` ("late", "transfer",
"pause", "p2p_link": ``commviz.live.cause``), ``peer`` (a link's receiver) and ``waited`` (the
ranks it held up), and ``links``, came later in version 2 (a line without them: all "late").
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from typing_extensions import NotRequired, TypedDict

from commviz.errors import SourceError
from commviz.filetype import STRICT, FileType
from commviz.live.window import Figures, Row, Window

NAME = "windows.jsonl"
ROWS_KEPT = 32                   # rows per kind a line keeps (by wait), besides the stragglers'


class FiguresFile(TypedDict):
    __pydantic_config__ = STRICT  # type: ignore[misc]
    instances: int
    timed: int
    calls: int
    comm_ns: int
    busbw_gbps: float | None
    skew_p50_ns: int | None
    skew_p99_ns: int | None
    wait_ns: int


class RowFile(TypedDict):
    __pydantic_config__ = STRICT  # type: ignore[misc]
    group: str
    label: str
    origin: str | None
    seen: int
    size: int
    times: Literal["cpu", "gpu"]
    window: FiguresFile
    run: FiguresFile


class StragglerFile(TypedDict):
    __pydantic_config__ = STRICT  # type: ignore[misc]
    rank: int
    origin: str
    group: str
    group_label: str
    instances: int
    late_in: int
    skew_ns: int
    cost_ns: int
    cause: NotRequired[Literal["late", "transfer", "pause", "p2p_link"]]
    peer: NotRequired[int | None]
    waited: NotRequired[list[int]]


class WindowFile(TypedDict):
    """One line of ``windows.jsonl`` (the module docstring shows it)."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    schema: Literal["commviz.window"]
    version: Literal[2]
    watcher: str
    index: int
    start_ns: int
    end_ns: int
    times: Literal["cpu", "gpu", "mixed"]
    ranks: list[int]
    groups: list[RowFile]
    origins: list[RowFile]
    stragglers: list[StragglerFile]
    incomplete: int
    missed: list[tuple[int, int]]
    problems: list[str]
    links: NotRequired[list[RowFile]]


FILE = FileType(WindowFile, "windows series line")
SCHEMA, VERSION = FILE.schema, FILE.version


def path_of(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / NAME


def watcher_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _figures(f: Figures) -> FiguresFile:
    return FiguresFile(**f._asdict())    # type: ignore[typeddict-item]


def _rows(rows: list[Row], keep: set[tuple[str, str | None]]) -> list[RowFile]:
    return [RowFile(group=r.group, label=r.label, origin=r.origin, seen=r.seen, size=r.size,
                    times="gpu" if r.times == "gpu" else "cpu", window=_figures(r.window),
                    run=_figures(r.run))
            for n, r in enumerate(rows) if n < ROWS_KEPT or (r.group, r.origin) in keep]


def times_of(w: Window) -> Literal["cpu", "gpu", "mixed"]:
    """Which times the window's group rows used: all CPU, all GPU, or some of each."""
    used = {r.times for r in w.groups}
    return "mixed" if len(used) > 1 else "gpu" if used == {"gpu"} else "cpu"


def to_file(w: Window) -> WindowFile:
    keep = {(s.group, s.origin) for s in w.stragglers} | {(s.group, None) for s in w.stragglers}
    return WindowFile(
        schema=SCHEMA, version=VERSION, watcher=watcher_name(), index=w.index,
        start_ns=w.start_ns, end_ns=w.end_ns, times=times_of(w), ranks=w.ranks,
        groups=_rows(w.groups, keep), origins=_rows(w.origins, keep),
        stragglers=[StragglerFile(**{**s._asdict(), "cause": str(s.cause),  # type: ignore
                                     "waited": list(s.waited)}) for s in w.stragglers],
        incomplete=w.incomplete, missed=sorted(w.missed.items()), problems=w.problems,
        links=_rows(w.links, set()))


def dumps(w: Window) -> bytes:
    return FILE.dump_json(to_file(w))


def append(run_dir: str | os.PathLike[str], w: Window) -> None:
    """Add one window as one line (raises OSError: the caller says it once and goes on)."""
    fd = os.open(path_of(run_dir), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, dumps(w) + b"\n")
    finally:
        os.close(fd)


def read(path: str | os.PathLike[str]) -> tuple[list[WindowFile], list[str]]:
    """Every whole line, and what was skipped (a torn last line); a line that is whole but not
    a window is one ``SourceError`` naming ``file:line``."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise SourceError(str(path), f"cannot read: {exc.strerror or exc}") from None
    lines = data.split(b"\n")
    torn = lines.pop()                   # after the last newline: empty, or a torn line
    out = [FILE.parse_json(line, f"{path}:{n}") for n, line in enumerate(lines, 1) if line]
    notes = [f"{path}:{len(lines) + 1}: a torn last line (its watcher stopped mid-write) was "
             "skipped"] if torn.strip() else []
    return out, notes


def one_watcher(lines: list[WindowFile]) -> list[WindowFile]:
    """The lines of the watcher that wrote the most (two watchers of one run dir each keep
    their own windows: a launch's and a ``commviz watch`` by hand)."""
    counts: dict[str, int] = {}
    for line in lines:
        counts[line["watcher"]] = counts.get(line["watcher"], 0) + 1
    if not counts:
        return []
    best = max(counts, key=lambda w: counts[w])
    return [line for line in lines if line["watcher"] == best]
