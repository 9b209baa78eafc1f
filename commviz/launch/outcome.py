"""After torchrun returns: which rank failed and why, and what the run dir now holds.

Why ranks failed, and which one is the root cause, is read from the run dir's logs as
``commviz report`` reads it (``review.analyses.exits``: the worker's failure files, the elastic
agent's results); the launch adds what a rank said on torchrun's output when it could not
write its failure file (``worded_failures``).

``judge`` then says why, from the records and stacks in the run dir
(``commviz.review.analyses.judge``), with these failures as each rank's exit; its culprits are named
first (``culprits_first``), before a rank that failed earlier only because it waited for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from commviz.errors import CommvizError
from commviz.record import schema
from commviz.record.store import load_record
from commviz.review.analyses import exits
from commviz.review.analyses.exits import Failure, Said
from commviz.review.model.verdict import Verdict
from commviz.review.analyses.judge import build_verdict
from commviz.trace.run import Run

_WORD = re.compile(r"\[commviz\] rank (\d+) failed(?: at (\d+))?: (.+)$")  # worker.py's verdict


def worded_failures(output: str) -> dict[int, Said]:
    """What each rank said in the ``[commviz] rank R failed at NS: ...`` lines of torchrun's
    output: its word when it could not write its failure file (a full or read-only disk)."""
    out: dict[int, Said] = {}
    for n, line in enumerate(output.splitlines()):
        m = _WORD.search(line)
        if m:
            at = int(m.group(2)) if m.group(2) else None
            out.setdefault(int(m.group(1)), Said(n, at, exits.first_line(m.group(3))))
    return out


def failures(log_dir: Path, torchrun_output: str) -> list[Failure]:
    """Every failed rank, the root cause first (``review.analyses.exits.failures``), with what
    the ranks said on torchrun's output."""
    return exits.failures(log_dir, worded_failures(torchrun_output))


def judge(run_dir: Path, found: list[Failure], run: Run | None = None) -> Verdict | None:
    """The verdict on the failed job (``commviz.review.analyses.judge``), these failures as each
    rank's exit; None when the run dir holds nothing to judge."""
    try:
        return build_verdict(run_dir, {f.rank: f.exit() for f in found}, run=run)
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
