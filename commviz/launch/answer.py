"""Answering ``commviz status`` run on another node: this node's ranks' stacks, on request.

A signal reaches only this host's processes, so ``commviz status`` elsewhere asks through the
run dir (``commviz.record.asking``). ``StackAnswers`` polls the request file every half second;
on a new request it signals this launch's own ranks (``commviz.launch.placement``, less those
the asker signalled itself), waits for their dumps, flushes them to the disk (a shared file
system shows another node a file's pages once they are written back) and answers.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable

from commviz.errors import SourceError
from commviz.launch import placement
from commviz.merge.select import format_ranks
from commviz.record import asking, stacks
from commviz.review.analyses.exits import log_dir

DUMP_WAIT_S = 1.0              # how long the ranks get to write their dumps before the answer


def _flush(path: Path) -> None:
    """Write a file's cached pages back, whoever wrote them (fsync acts on the file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class StackAnswers(threading.Thread):
    """Its own thread, not the hang watch's: it answers with the watch off too, and looks every
    half second where the watch reads every journal every few seconds."""

    def __init__(self, run_dir: Path, node: int, launch_id: str,
                 say: Callable[[str], None]) -> None:
        super().__init__(name="commviz-stack-answers", daemon=True)
        self.run_dir, self.node, self.launch_id, self.say = run_dir, node, launch_id, say
        self._stop_event = threading.Event()

    def _ranks(self) -> list[int]:
        return [p.rank for p in placement.of_launch(log_dir(self.run_dir), self.launch_id)]

    def run(self) -> None:
        try:
            asking.listen(self.run_dir, self.node)
            first = asking.read_request(self.run_dir)
        except (OSError, SourceError) as exc:
            self.say(f"commviz launch: stack requests from other nodes will not be answered: "
                     f"{exc}\n")
            return
        seen = first["token"] if first is not None else None    # asked before this launch
        told = None
        while not self._stop_event.wait(asking.POLL_S):
            try:
                request = asking.read_request(self.run_dir)
            except SourceError as exc:
                if str(exc) != told:
                    told = str(exc)
                    self.say(f"commviz launch: a stack request cannot be read: {exc}\n")
                continue
            if request is None or request["token"] in (None, seen):
                continue
            seen = request["token"]
            try:
                self._answer(request)
            except OSError as exc:
                self.say(f"commviz launch: a stack request could not be answered: {exc}\n")

    def _answer(self, request: asking.RequestFile) -> None:
        ranks = self._ranks()
        todo = [r for r in ranks if r not in request["signalled"]]
        dumps = stacks.Dumps(self.run_dir, todo)
        signalled = stacks.signal_here(self.run_dir, todo)
        written = sorted(dumps.wait(signalled, DUMP_WAIT_S))
        for rank in written:
            _flush(stacks.stacks_path(self.run_dir, rank, live=True))
        asking.answer(self.run_dir, self.node, request["token"], ranks, signalled, written)
        if signalled:
            self.say(f"stacks asked from {request['host']} "
                     f"(pid {request['pid']}):"
                     f" ranks {format_ranks(signalled)} signalled, {len(written)} wrote them\n")

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)
        asking.tidy(self.run_dir, self.node)
