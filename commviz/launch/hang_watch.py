"""Noticing a hang while the job runs, long before a collective's timeout ends it.

NCCL's watchdog waits 10 minutes by default. ``HangWatch`` reads the run dir's journals every
few seconds; when the ranks disagree (some rank waits in a collective that another has not
joined: ``review.analyses.judge``) and nothing has moved for ``after_s`` seconds, it asks every
rank on this host for its stacks (they go on running) and prints the verdict, once per hang.
In a multi-node job the launch that runs rank 0 asks every node's ranks, as ``commviz status``
does (through the shared run dir, which the other launches answer): one launch prints the
verdict with every rank's stacks, and only one writes requests.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

from commviz.errors import CommvizError
from commviz.merge.select import format_ranks
from commviz.record import stacks
from commviz.review.analyses.asked import DEFAULT_WAIT_S, ask_every_rank
from commviz.review.model.verdict import Verdict
from commviz.review.analyses.judge import build_verdict
from commviz.review.render.verdict_text import verdict_text
from commviz.review.render.asked_text import asked_lines
from commviz.trace.run import load_run

DEFAULT_AFTER_S = 60.0


def _progress(v: Verdict) -> tuple[Any, ...]:
    """What changes while the job moves: each rank's last collective or transfer and its
    state, and the replays of a graph the ranks replayed unequally often (a job that only
    replays graphs makes no other call)."""
    replays = None if v.replays is None else tuple(v.replays.counts.items())
    return tuple((r, s.last and (s.last.label(), s.last.state))
                 for r, s in sorted(v.ranks.items())) + (replays,)


class HangWatch(threading.Thread):
    """``everywhere``: whether this launch asks every node's ranks (it runs rank 0 of a
    multi-node job), looked at when a hang is seen (ranks are placed after the launch starts);
    None: this node's only."""

    def __init__(self, run_dir: Path, after_s: float, say: Callable[[str], None],
                 everywhere: Callable[[], bool] | None = None) -> None:
        super().__init__(name="commviz-hang-watch", daemon=True)
        self.run_dir, self.after_s, self.say, self.everywhere = run_dir, after_s, say, everywhere
        self.interval = min(5.0, max(0.5, after_s / 4))
        self._stop_event = threading.Event()
        self.reported: list[Verdict] = []

    def run(self) -> None:
        since: float | None = None
        key: tuple[Any, ...] | None = None
        told: tuple[Any, ...] | None = None
        while not self._stop_event.wait(self.interval):
            try:
                v = build_verdict(self.run_dir, live=True)
            except (CommvizError, OSError, ValueError):
                continue                 # records not there yet, or a journal mid-write
            now = time.monotonic()
            new = None if v is None else _progress(v)
            if new is None or new != key:
                key, since = new, now
                continue
            if since is not None and now - since >= self.after_s and key != told:
                told = key
                self._report(now - since)

    def _report(self, still_s: float) -> None:
        if self.everywhere is not None and self.everywhere():
            asked = ask_every_rank(self.run_dir, load_run(self.run_dir), DEFAULT_WAIT_S)
            ranks, detail = asked.ranks, "".join(f"{line}\n" for line in asked_lines(asked))
        else:
            ranks, detail = stacks.request_all(self.run_dir), ""
        v = build_verdict(self.run_dir, live=True)
        if v is None:
            return
        self.reported.append(v)
        self.say(f"HANG? nothing has moved for {still_s:.0f} s while the ranks disagree "
                 f"(stacks asked of ranks {format_ranks(ranks) or 'none'}; the job goes on):\n"
                 f"{detail}{verdict_text(v)}")

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)
