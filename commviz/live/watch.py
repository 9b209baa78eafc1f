"""``commviz watch RUN_DIR``: the job's communication health while it runs, window by window.

Every ``--interval`` seconds the ranks' journals are read on from where they were
(``commviz.live.tail``), the calls joined across ranks (``commviz.live.window``) and shown: per
process group and per origin, calls, comm time, bus bandwidth, arrival skew (p50, p99) and the
wait, for the window beside the run so far, and the ranks late persistently, each with the
origin of the collective it was late to and what that cost the others. Each window is also
appended to ``RUN_DIR/windows.jsonl`` (``commviz.live.series``), what ``commviz report`` reads
after the job. ``--once``: one window (the calls that ended in the last ``--interval``
seconds) and exit; with ``--format json`` as one JSON object whose top-level ``"stragglers"``
lists the late ranks.

The watcher is a separate process that only reads the ranks' files: killed, hung or slow, it
never touches a rank. It sees the ranks whose journals are in the run dir it reads: on a node
with a node-local run dir, that node's ranks (docs/watch.md says what that means for groups
spanning nodes). On NCCL, calls get their ops' GPU times from the ranks' GPU-time files
(``commviz.live.gpujoin``): those rows' comm time, bus bandwidth, skew, wait and late rank are
the GPU's, over the timed calls (the plugin samples 1 call in 4 by default; each row says how
many of its instances were timed). gloo/CPU calls keep their CPU times; each row says which
(untimed NCCL calls cover their launch: they get no comm time or late rank).

Exit status: 0 (--once: also with late ranks named; 2 when the run dir cannot be read).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Collection

import orjson
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from commviz.errors import CommvizError
from commviz.live import series
from commviz.live.cause import said
from commviz.live.gpujoin import GpuJoin
from commviz.live.tail import RunTail
from commviz.live.window import Figures, Row, Window, Windows
from commviz.merge.select import format_ranks
from commviz.metadata import fmt_gbps, fmt_ns

DEFAULT_INTERVAL_S = 5.0
ROWS_SHOWN = 12
TIMES_NOTE = {"cpu": "CPU times of the calls", "gpu": "GPU times of the NCCL ops (timed: "
              "instances with them, of all)", "mixed": "GPU times where a row says gpu, else CPU"}


class Watcher:
    """A run dir's tail and its windows; ``step`` closes one window (``keep``: append it to
    the run dir's series)."""

    def __init__(self, run_dir: Path, keep: bool,
                 ranks: Callable[[], Collection[int]] | None = None) -> None:
        self.run_dir, self.keep, self.ranks = run_dir, keep, ranks
        self.tail = RunTail(run_dir)
        self.gpu = GpuJoin(run_dir)
        self.windows = Windows()
        self.last_ns = time.time_ns()
        self.kept_error: str | None = None

    def step(self, since_ns: int | None = None, final: bool = False) -> Window:
        """``final``: hold no call back for GPU times still to come (a last or only window)."""
        if self.ranks is not None:
            self.tail.only = frozenset(self.ranks()) or None
        calls = self.tail.poll()
        now = time.time_ns()
        self.windows.add(self.gpu.timed(calls, now, final))
        start = self.last_ns if since_ns is None else since_ns
        window = self.windows.close(self.tail.readable, start, now, since_ns)
        window.missed, window.problems = self.tail.missed, self.tail.problems + self.gpu.problems
        self.last_ns = now
        if self.keep and window.groups:
            try:
                series.append(self.run_dir, window)
            except OSError as exc:
                if self.kept_error is None:
                    self.kept_error = f"{series.path_of(self.run_dir)}: {exc.strerror or exc}"
                    window.problems.append(f"windows are not kept: {self.kept_error}")
        return window


# -- rendering ---------------------------------------------------------------------------------

NO_NAME = ("named: none (no rank was late, slow to transfer, paused or on a slow link in this "
           "window)")


def straggler_lines(w: Window) -> list[str]:
    return [said(s._asdict(), fmt_ns) for s in w.stragglers] or [NO_NAME]


def _vs(now: str, run: str) -> str:
    return now if now == run else f"{now} ({run})"


def _table(title: str, rows: list[Row], by_origin: bool) -> Table:
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    table.add_column("group")
    if by_origin:
        table.add_column("origin")
    for head in ("ranks", "times", "calls", "comm", "busbw GB/s (run)", "skew p50 (run)",
                 "skew p99 (run)", "wait (per instance: window vs run)"):
        table.add_column(head, justify="right")
    for r in rows[:ROWS_SHOWN]:
        w, run = r.window, r.run
        table.add_row(r.label, *([r.origin or "-"] if by_origin else []),
                      f"{r.seen}/{r.size}", _times(r), str(w.calls), fmt_ns(w.comm_ns),
                      _vs(fmt_gbps(w.busbw_gbps), fmt_gbps(run.busbw_gbps)),
                      _vs(fmt_ns(w.skew_p50_ns), fmt_ns(run.skew_p50_ns)),
                      _vs(fmt_ns(w.skew_p99_ns), fmt_ns(run.skew_p99_ns)),
                      f"{fmt_ns(w.wait_ns)} ({_per(w)} vs {_per(run)})")
    if len(rows) > ROWS_SHOWN:
        table.caption = f"{len(rows) - ROWS_SHOWN} more rows (--format json has them all)"
    return table


def _times(r: Row) -> str:
    """"cpu", or "gpu timed/all" (instances)."""
    return f"gpu {r.window.timed}/{r.window.instances}" if r.times == "gpu" else "cpu"


def _per(f: Figures) -> str:
    return fmt_ns(f.wait_ns / f.instances) if f.instances else "-"


def render(run_dir: Path, w: Window) -> Group:
    seconds = (w.end_ns - w.start_ns) / 1e9
    head = Text(f"commviz watch {run_dir}: window {w.index} ({seconds:.1f} s), ranks "
                f"{format_ranks(w.ranks) or 'none yet'}; {TIMES_NOTE[series.times_of(w)]}")
    parts: list = [head]
    if w.groups:
        parts += [_table("per process group", w.groups, False),
                  _table("per origin", w.origins, True)]
    else:
        parts.append(Text("no collective completed by its ranks in this window"))
    if w.links:
        parts.append(_table("point-to-point, per origin (send matched to receive; comm: "
                            "delivery)", w.links, True))
    parts += [Text(line, style="" if not w.stragglers else "bold red")
              for line in straggler_lines(w)]
    if w.incomplete:
        parts.append(Text(f"{w.incomplete} instance(s) given up: some rank's call never came"))
    if w.missed:
        parts.append(Text("calls not read (running when their journal generation was dropped): "
                          + ", ".join(f"rank {r}: {n}" for r, n in w.missed.items())))
    parts += [Text(f"problem: {p}", style="yellow") for p in w.problems]
    return Group(*parts)


def as_json(w: Window) -> bytes:
    return orjson.dumps(series.to_file(w), option=orjson.OPT_INDENT_2)


# -- while a launch runs -------------------------------------------------------------------------

class WatchThread(threading.Thread):
    """``commviz launch``'s watch (``live.watch: true``): a window every ``interval`` s, said
    in a few lines (a rich table would tear the ranks' echoed output) and kept in the run dir.
    Its own thread in the launch, reading files only: the ranks never wait for it. ``ranks``:
    the ranks to read (a multi-node launch: its own, as placed; None: every journal there)."""

    def __init__(self, run_dir: Path, interval: float, say: Callable[[str], None],
                 ranks: Callable[[], Collection[int]] | None = None) -> None:
        super().__init__(name="commviz-watch", daemon=True)
        self.interval, self.say = interval, say
        self.watcher = Watcher(run_dir, keep=True, ranks=ranks)
        self._stop_event = threading.Event()
        self._told: set[str] = set()

    def run(self) -> None:
        stopping = False
        while not stopping:
            stopping = self._stop_event.wait(self.interval)
            try:            # once more when stopped: the job's last calls, in the files still open
                w = self.watcher.step(final=stopping)
            except (CommvizError, OSError) as exc:
                self._once(f"commviz watch: {exc}")
                continue
            if w.groups:
                self.say("".join(f"watch #{w.index}: {line}\n" for line in summary_lines(w)))
            for p in w.problems:
                self._once(f"commviz watch: problem: {p}")

    def _once(self, line: str) -> None:
        if line not in self._told:
            self._told.add(line)
            self.say(line + "\n")

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)


def summary_lines(w: Window) -> list[str]:
    """A window in a few lines: its busiest group, then the late ranks."""
    top = w.groups[0]
    f = top.window
    return [f"{top.label} ({top.seen}/{top.size} ranks): {f.calls} calls, skew p50 "
            f"{fmt_ns(f.skew_p50_ns)} p99 {fmt_ns(f.skew_p99_ns)} (run "
            f"{fmt_ns(top.run.skew_p50_ns)}), busbw {fmt_gbps(f.busbw_gbps)} GB/s, wait "
            f"{fmt_ns(f.wait_ns)}; {_times(top)} times",
            *straggler_lines(w)]


# -- the command ---------------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise CommvizError(f"{run_dir}: no such run dir")
    interval_ns = int(args.interval * 1e9)
    watcher = Watcher(run_dir, keep=not args.once)
    if args.once:
        w = watcher.step(since_ns=time.time_ns() - interval_ns, final=True)
        if args.format == "json":
            sys.stdout.buffer.write(as_json(w) + b"\n")
        else:
            Console().print(render(run_dir, w))
        if not watcher.tail.ranks:
            print(f"commviz watch: no journal in {run_dir}: the job has not started recording, "
                  "or it ended (after the job: commviz report)", file=sys.stderr)
        return 0
    if args.format == "json":
        while True:
            time.sleep(args.interval)
            sys.stdout.buffer.write(orjson.dumps(series.to_file(watcher.step())) + b"\n")
            sys.stdout.flush()
    console = Console()
    if not console.is_terminal:                  # a pipe or a file: each window in turn
        while True:
            time.sleep(args.interval)
            console.print(render(run_dir, watcher.step()))
            console.file.flush()
    with Live(console=console, auto_refresh=False) as live:
        while True:
            time.sleep(args.interval)
            live.update(render(run_dir, watcher.step()), refresh=True)


def register(p: argparse.ArgumentParser) -> None:
    p.description = ("While a job runs: per process group and origin, calls, comm time, bus "
                     "bandwidth, arrival skew and wait, window by window, and the ranks late "
                     "persistently, with the origin they were late to and what it cost the "
                     "others (from the always-on record: CPU times; on NCCL, the ops' GPU times "
                     "where the profiler plugin timed them). Windows are kept in "
                     "RUN_DIR/windows.jsonl for commviz report.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run dir the job records into")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S",
                   help=f"seconds a window lasts (default {DEFAULT_INTERVAL_S:g})")
    p.add_argument("--once", action="store_true",
                   help="show one window (the calls that ended in the last S seconds) and exit")
    p.add_argument("--format", choices=("table", "json"), default="table",
                   help="table (rich) or json (one object a window, top-level 'stragglers')")
    p.set_defaults(func=run)
