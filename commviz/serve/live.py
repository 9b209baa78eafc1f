"""The live panel's data, refreshed by a thread of its own: never by a request.

Every ``interval`` seconds ``LiveView`` closes a window of ``commviz watch``'s own ``Watcher``
(the ranks' journals, read from where it was: the same windows, no new path into the ranks;
``keep=False``: the launch's watch, when on, keeps the run dir's ``windows.jsonl``) and keeps
the last ``HISTORY`` of them for the plots. When no collective has completed for
``hang_after_s`` while the journals are there, it builds ``commviz status``'s verdict from the
journals and whatever stacks the ranks last left (it asks no rank for new ones: the page only
reads). Each refresh renders the panel once; every request is then answered with those bytes,
so a page loaded a thousand times a second costs the same reads as one loaded never.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path

from commviz.errors import CommvizError
from commviz.live import series
from commviz.live.watch import Watcher
from commviz.record.journal import journal_ranks
from commviz.review.analyses.judge import build_verdict
from commviz.review.render.verdict_text import verdict_text
from commviz.serve.page import Links, Panel, live_html

DEFAULT_INTERVAL_S = 2.0
HANG_AFTER_S = 10.0
HISTORY = 60                      # windows kept for the plots (2 minutes at 2 s)
NICENESS = 10


class LiveView:
    """``run_dir``'s live panel (``html``: the last rendering); ``start`` runs ``refresh``
    every ``interval`` s in a daemon thread, at a lower priority than the ranks."""

    def __init__(self, run_dir: Path, interval: float = DEFAULT_INTERVAL_S,
                 hang_after_s: float = HANG_AFTER_S, links: Links | None = None) -> None:
        self.run_dir, self.interval, self.hang_after_s = run_dir, interval, hang_after_s
        self.links = links
        self.watcher = Watcher(run_dir, keep=False)
        self.windows: deque[series.WindowFile] = deque(maxlen=HISTORY)
        self.problems: list[str] = []
        self.quiet_since: float | None = None
        self.panel = Panel(str(run_dir), "waiting", [], None, 0.0, [])
        self.html = live_html(self.panel, links)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def state(self) -> str:
        if journal_ranks(self.run_dir):
            return "running"
        return "ended" if any(self.run_dir.glob("commviz_rank*.pkl")) else "waiting"

    def refresh(self, first: bool = False) -> None:
        """Close a window and render the panel (``first``: the window is the last
        ``interval``, what came before counts for the run so far alone, as ``watch --once``)."""
        state = self.state()
        verdict, still = None, 0.0
        if state == "running":
            try:
                since = time.time_ns() - int(self.interval * 1e9) if first else None
                w = self.watcher.step(since_ns=since)
            except (CommvizError, OSError) as exc:
                self._problem(str(exc))
            else:
                for p in w.problems:
                    self._problem(p)
                if w.groups:
                    self.windows.append(series.to_file(w))
                    self.quiet_since = None
                elif self.quiet_since is None:
                    self.quiet_since = time.monotonic()
            still = 0.0 if self.quiet_since is None else time.monotonic() - self.quiet_since
            if self.quiet_since is not None and still >= self.hang_after_s:
                verdict = self._verdict()
        else:                           # the first window starts when the journals do
            self.watcher.last_ns = time.time_ns()
        self.panel = Panel(str(self.run_dir), state, list(self.windows), verdict, still,
                           list(self.problems))
        self.html = live_html(self.panel, self.links)

    def _verdict(self) -> str | None:
        try:
            v = build_verdict(self.run_dir, live=True)
        except (CommvizError, OSError, ValueError):
            return None                     # a journal mid-write: the next refresh
        return None if v is None else verdict_text(v)

    def _problem(self, line: str) -> None:
        if line not in self.problems:
            self.problems.append(line)

    def start(self) -> None:
        """Refresh once now (the first page shows the job, not "waiting"), then every
        ``interval`` in a thread (once only)."""
        if self._thread is not None:
            return
        self._refresh(first=True)
        self._thread = threading.Thread(target=self._follow, name="commviz-serve-live",
                                        daemon=True)
        self._thread.start()

    def _refresh(self, first: bool = False) -> None:
        try:
            self.refresh(first)
        except Exception as exc:             # the page must outlive a bad read; say it there
            self._problem(f"refresh failed: {type(exc).__name__}: {exc}")

    def _follow(self) -> None:
        os.nice(NICENESS)                    # this thread's own priority (Linux: per thread)
        while not self._stop.wait(self.interval):
            self._refresh()

    def stop(self) -> None:
        self._stop.set()
