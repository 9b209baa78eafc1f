"""After torchrun returns: which rank failed and why, and what the run dir now holds.

Two sources say why ranks failed: the worker's own ``logs/failed_rank{R}.json`` (written for
every Python-level failure, with a nanosecond timestamp) and the elastic agent's per-rank
results (``commviz.launch.elastic``: torch's ``ProcessFailure`` of every failed rank, also of
ranks that died without running Python's handlers: a signal, a crash). The root cause is
chosen here, as torchrun's is, by failure time: a rank that died
without a word (SIGKILL, a crash: its peers only saw it vanish) first, else the earliest
failure file, whatever its kind: a rank stopped by a SIGTERM that did not come from torchrun
(which stops the others only after the first failure) is the culprit, not the peer that then
lost its connection. Every other rank stopped because of it.

``judge`` then says why, from the records and stacks in the run dir
(``commviz.review.verdict``), with these failures as each rank's exit; its culprits are named
first (``culprits_first``), before a rank that failed earlier only because it waited for them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from commviz.errors import CommvizError
from commviz.launch.elastic import results_of
from commviz.record import schema
from commviz.record.store import load_record
from commviz.review.verdict import Exit, Verdict, build_verdict
from commviz.trace.run import Run

_WORD = re.compile(r"\[commviz\] rank (\d+) failed(?: at (\d+))?: (.+)$")  # worker.py's verdict


@dataclass
class Failure:
    """One rank that did not finish."""

    rank: int
    reason: str                      # one line: "RuntimeError: ..." or "exit code -9 (SIGKILL ...)"
    host: str | None = None
    stopped: bool = False            # it was told to stop (SIGTERM) rather than failing itself
    time_ns: int | None = None       # from the worker's file; None when it left none
    detail: Path | None = None       # the worker's failure file (full traceback)


def _first_line(text: str, limit: int = 240) -> str:
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
            reason = f"exit code {f['exitcode']}" + (f" ({_first_line(why)})" if why else "")
            out.setdefault(f["rank"], Failure(f["rank"], reason, results["host"]))
    return out


def worker_failures(log_dir: Path) -> dict[int, Failure]:
    """The failure files the workers wrote (unreadable ones are skipped: torchrun names them)."""
    out: dict[int, Failure] = {}
    for path in sorted(log_dir.glob("failed_rank*.json")):
        try:
            data = json.loads(path.read_text())
            rank = int(data["rank"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        out[rank] = Failure(rank, _first_line(str(data.get("error", "unknown error"))),
                            data.get("host"), bool(data.get("stopped")),
                            data.get("time_ns"), path)
    return out


def worded_failures(output: str) -> dict[int, tuple[int, int | None, str]]:
    """rank -> (line number, failure time in ns if given, reason) of the ``[commviz] rank R
    failed at NS: ...`` lines: what a rank said when it could not write its failure file (a
    full or read-only disk)."""
    out: dict[int, tuple[int, int | None, str]] = {}
    for n, line in enumerate(output.splitlines()):
        m = _WORD.search(line)
        if m:
            at = int(m.group(2)) if m.group(2) else None
            out.setdefault(int(m.group(1)), (n, at, _first_line(m.group(3))))
    return out


def failures(log_dir: Path, torchrun_output: str) -> list[Failure]:
    """Every failed rank, the root cause first: a rank that died without a word, then by the
    time each rank failed (its failure file, or its stderr verdict), then by output order."""
    files = worker_failures(log_dir)
    listed = elastic_failures(log_dir)
    words = worded_failures(torchrun_output)
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
            return (2, words[f.rank][0], f.rank)
        return (3, 0, f.rank)
    return sorted(merged.values(), key=order)


def _traceback(f: Failure) -> str | None:
    if f.detail is None:
        return None
    try:
        return str(json.loads(f.detail.read_text()).get("traceback") or "") or None
    except (OSError, ValueError, AttributeError):
        return None


def judge(run_dir: Path, found: list[Failure], run: Run | None = None) -> Verdict | None:
    """The verdict on the failed job (``commviz.review.verdict``), these failures as each
    rank's exit; None when the run dir holds nothing to judge."""
    exits = {f.rank: Exit(f.reason, f.stopped, _traceback(f)) for f in found}
    try:
        return build_verdict(run_dir, exits, run=run)
    except CommvizError:
        return None


def culprits_first(found: list[Failure], judged: Verdict | None) -> list[Failure]:
    """The verdict's culprits first: the rank whose failure came first may only have waited
    for one that held it up (a rank stuck in its own code is stopped last)."""
    if judged is None:
        return found
    return sorted(found, key=lambda f: f.rank not in judged.culprits)


@dataclass
class RunContents:
    """What the run dir holds after the job: per rank, its record's collectives and traces."""

    records: dict[int, int] = field(default_factory=dict)   # rank -> collectives recorded
    traces: dict[int, int] = field(default_factory=dict)    # rank -> trace files
    unreadable: list[str] = field(default_factory=list)


def contents(run_dir: Path, run: Run | None = None) -> RunContents:
    """``run``: the run dir as the launch loaded it once (its records are not read again)."""
    out = RunContents()
    loaded = {inp.record_path: inp.record for inp in run.ranks.values()} if run else {}
    for path in sorted(run_dir.glob(schema.RECORD_GLOB)):
        rank = schema.rank_of_record(path.name)
        if rank is None:
            continue
        record = loaded.get(path)
        if record is not None:
            out.records[rank] = len(record.get("collectives", []))
            continue
        said = [p for p in (run.problems if run else ()) if path.name in p]
        if said:                 # load_run named why it could not read it
            out.unreadable.append(said[0])
            continue
        try:
            out.records[rank] = len(load_record(path).get("collectives", []))
        except Exception as exc:  # a bad record is named, the others still count
            out.unreadable.append(f"{path.name}: {exc}")
    for path in sorted(run_dir.glob(schema.TRACE_GLOB)):
        rank = schema.rank_of_trace(path.name)
        if rank is not None:
            out.traces[rank] = out.traces.get(rank, 0) + 1
    return out
