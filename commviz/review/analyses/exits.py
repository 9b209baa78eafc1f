"""How each rank of a failed job ended, as the files its launch leaves in ``RUN_DIR/logs`` say:
read without torch, by ``commviz launch`` for its verdict and by ``commviz report`` for the same.

Two sources say why ranks failed:

- the worker's own ``failed_rank{R}.json`` (``commviz.launch.worker``; ``FailedFile``), written
  for every Python-level failure, with a nanosecond timestamp and the traceback: the line it
  raised on, where the rank left no stacks of its raise (on NCCL, only its live ones), and, of
  an exception a framework wrapped (``raise ... from``), the original one;
- the elastic agent's per-rank results, one ``elastic_node{N}.json`` per node
  (``commviz.launch.elastic``: torch's ``ProcessFailure`` of every failed rank, also of ranks
  that died without running Python's handlers: a signal, a crash), declared once
  (``ResultsFile``)::

    {"schema": "commviz.elastic", "version": 1, "host": str,
     "failures": [{"rank": int, "local_rank": int, "pid": int, "exitcode": int,
                   "signal": str | null, "message": str, "error_file": str | null,
                   "timestamp": int}]}

The root cause is chosen here, as torchrun's is, by failure time (``failures``): a rank that
died without a word (SIGKILL, a crash: its peers only saw it vanish) first, else the earliest
failure file, whatever its kind: a rank stopped by a SIGTERM that did not come from torchrun
(which stops the others only after the first failure) is the culprit, not the peer that then
lost its connection. Every other rank stopped because of it. Each failure is one ``Exit`` of
the verdict (``commviz.review.analyses.judge``).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping, NamedTuple

from typing_extensions import TypedDict

from commviz.errors import SourceError
from commviz.filetype import STRICT, FileType
from commviz.record import stacks as st

LOG_DIR = "logs"    # under the run dir: torchrun's per-rank logs, the failure and results files
FAILED = "failed_rank{rank}.json"
FAILED_GLOB = "failed_rank*.json"
RESULTS_GLOB = "elastic_node*.json"


def log_dir(run_dir: Path) -> Path:
    return run_dir / LOG_DIR


def results_name(node_rank: int) -> str:
    return f"elastic_node{node_rank}.json"


class FailedFile(TypedDict):
    """``logs/failed_rank{R}.json``: what one rank said of its own failure."""

    rank: int
    local_rank: int
    group_rank: int
    host: str
    pid: int
    time_ns: int                # when it failed (``time.time_ns()``)
    stopped: bool               # it was told to stop (SIGTERM/SIGINT), rather than failing
    error: str                  # "RuntimeError: ...", with what could not be written
    traceback: str


class FailureFile(TypedDict):
    __pydantic_config__ = STRICT  # type: ignore[misc]
    rank: int                   # torch's global rank
    local_rank: int
    pid: int
    exitcode: int               # negative: killed by that signal
    signal: str | None          # "SIGKILL" where a signal ended it
    message: str                # the rank's error file's message, or the agent's
    error_file: str | None      # the rank's error file (None: it wrote none)
    timestamp: int              # seconds since the epoch


class ResultsFile(TypedDict):
    """What one node's elastic agent said of its failed ranks."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    schema: Literal["commviz.elastic"]
    version: Literal[1]
    host: str
    failures: list[FailureFile]


RESULTS = FileType(ResultsFile, "elastic results")


def results_of(log_dir: Path) -> list[ResultsFile]:
    """Every node's results in ``log_dir`` (one per node on a shared disk); an unreadable one
    is skipped with a warning naming it."""
    out = []
    for path in sorted(log_dir.glob(RESULTS_GLOB)):
        try:
            out.append(RESULTS.load(path))
        except SourceError as exc:
            warnings.warn(str(exc), stacklevel=2)
    return out


class Exit(NamedTuple):
    """How a rank ended, as its launch saw it (its failure file, torch's elastic results,
    torchrun's output)."""

    reason: str                          # "RuntimeError: ...", "exit code -9", ...
    stopped: bool = False                # told to stop after another rank failed
    traceback: str | None = None


@dataclass
class Failure:
    """One rank that did not finish."""

    rank: int
    reason: str                      # one line: "RuntimeError: ..." or "exit code -9 (SIGKILL ...)"
    host: str | None = None
    stopped: bool = False            # it was told to stop (SIGTERM) rather than failing itself
    time_ns: int | None = None       # from the worker's file; None when it left none
    detail: Path | None = None       # the worker's failure file (full traceback)

    def exit(self) -> Exit:
        """The verdict's ``Exit``, with the traceback its failure file holds."""
        return Exit(self.reason, self.stopped, self._traceback())

    def _traceback(self) -> str | None:
        if self.detail is None:
            return None
        try:
            return str(json.loads(self.detail.read_text()).get("traceback") or "") or None
        except (OSError, ValueError, AttributeError):
            return None


class Said(NamedTuple):
    """What a rank said of its failure on its output (``[commviz] rank R failed at NS: ...``):
    its word when it could not write its failure file (a full or read-only disk)."""

    line: int                        # its line in the output: the order the ranks spoke in
    time_ns: int | None              # when it failed, if it said
    reason: str


def first_line(text: str, limit: int = 240) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 1] + "…"


def elastic_failures(log_dir: Path) -> dict[int, Failure]:
    """The failed ranks as torch.distributed.elastic's agent reported them (every node's
    results in ``log_dir``): exit code, the signal that ended it, its message."""
    out: dict[int, Failure] = {}
    for results in results_of(log_dir):
        for f in results["failures"]:
            # no error file and no signal: torch's message is only a pointer to its docs
            silent = f["error_file"] is None and f["signal"] is None
            why = "" if silent else f["message"]
            reason = f"exit code {f['exitcode']}" + (f" ({first_line(why)})" if why else "")
            out.setdefault(f["rank"], Failure(f["rank"], reason, results["host"]))
    return out


def worker_failures(log_dir: Path) -> dict[int, Failure]:
    """The failure files the workers wrote (unreadable ones are skipped: torchrun names them)."""
    out: dict[int, Failure] = {}
    for path in sorted(log_dir.glob(FAILED_GLOB)):
        try:
            data = json.loads(path.read_text())
            rank = int(data["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out[rank] = Failure(rank, _reason(data), data.get("host"), bool(data.get("stopped")),
                            data.get("time_ns"), path)
    return out


def _reason(data: Mapping[str, object]) -> str:
    """A failure file's error on one line. A chained exception (a framework that wraps the
    error it caught, ``raise ... from``: torch.distributed.pipelining's "[Stage 1] failed to
    run forward") is told by the first one raised, the root cause, and what it became."""
    error = str(data.get("error") or "unknown error")
    traceback = str(data.get("traceback") or "")
    if len(st.chain(traceback)) > 1 and (chained := st.raised(traceback)) is not None:
        return first_line(chained)
    return first_line(st.exception_line(error) or error)


def failures(log_dir: Path, said: Mapping[int, Said] | None = None) -> list[Failure]:
    """Every failed rank, the root cause first: a rank that died without a word, then by the
    time each rank failed (its failure file, or what it ``said``), then by output order."""
    files = worker_failures(log_dir)
    listed = elastic_failures(log_dir)
    words = dict(said or {})
    for rank, (_, at, reason) in words.items():
        if rank not in files:
            host = listed[rank].host if rank in listed else None
            listed[rank] = Failure(rank, reason, host, time_ns=at)
    silent = sorted(r for r in listed if r not in files and r not in words)
    merged = {**listed, **files}

    def order(f: Failure) -> tuple[int, int, int]:
        if f.rank in silent:
            return (0, 0, f.rank)
        if f.time_ns is not None:
            return (1, f.time_ns, f.rank)
        if f.rank in words:
            return (2, words[f.rank].line, f.rank)
        return (3, 0, f.rank)
    return sorted(merged.values(), key=order)


def read_exits(run_dir: Path) -> dict[int, Exit]:
    """rank -> how it ended, for each failed rank the run dir's logs name (none: the job
    finished, or was not started by ``commviz launch``)."""
    return {f.rank: f.exit() for f in failures(log_dir(run_dir))}
