"""What the terminal shows of torchrun's output while a launch runs.

``launch.log`` keeps every line; the terminal gets the job's own output without two kinds of
noise: the profiler's ``USDT ... profiler_start/stop`` lines (one per rank per profiled window)
and tracebacks and torchrun's failure logging (a failing job prints one per rank and one from torchrun, 100+ lines before
commviz can say which rank failed and why). Tracebacks are counted, and the launch points at
the per-rank log files after its verdict.
"""

from __future__ import annotations

import re
from typing import TextIO

NOISE = re.compile(r"USDT:.*\bprofiler_(start|stop)\b")
# torchrun's own log lines about a failed worker ("E1124 05:15:42.8 ... elastic/..."): the
# launch's verdict says the same in one line.
ELASTIC = re.compile(r"^[IWE]\d{4} [\d:.]+ +\d+ torch/distributed/elastic/")
PREFIX = re.compile(r"^(\[[^\]]+\]:)?(.*)$", re.DOTALL)        # torchrun --tee: "[default0]:"
EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit|Failure)\b")


class Echo:
    """A file-like sink for torchrun's lines: writes the ones a person needs to ``out``."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.held = 0                          # failure lines kept out of the terminal
        self._in_traceback: set[str] = set()   # prefixes ("" for torchrun itself) inside one
        self._torchrun_failed = False

    def write(self, line: str) -> None:
        if NOISE.search(line):
            return
        prefix, body = PREFIX.match(line).groups()       # type: ignore[union-attr]
        prefix = prefix or ""
        if not prefix and ELASTIC.match(body):
            self.held += 1
            return
        if self._torchrun_failed or body.startswith("Traceback (most recent call last)"):
            self._in_traceback.add(prefix)
            self._torchrun_failed = self._torchrun_failed or not prefix
            self.held += 1
            return
        if prefix in self._in_traceback:
            self.held += 1
            if EXCEPTION_LINE.match(body):
                self._in_traceback.discard(prefix)
            return
        self.out.write(line)

    def flush(self) -> None:
        self.out.flush()

