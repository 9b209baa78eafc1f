"""What a gather leaves in rank 0's run dir, and which gather a launch runs (no torch here).

``commviz.gathering.gather`` (collective, torch) moves the files; this module says what moved:
the ``Mode``, per rank the files and bytes rank 0 received (``RUN_DIR/gather.json``), which
ranks rank 0 has nothing of, and which sent their inputs instead of a comm table (rank 0
converts those itself).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Literal

from typing_extensions import TypedDict

from commviz.errors import SourceError, cannot_write
from commviz.filetype import STRICT, FileType
from commviz.record import journal, schema, store
from commviz.merge.table import table_path

SUMMARY_NAME = "gather.json"
# ``auto``: a full gather (and one merged trace) up to this many ranks, comm tables above. A
# merged trace of 32 GPU-shaped ranks (50k events each) was already 128 MB, and a Perfetto UI
# tab holds 1-2 GB: 16 ranks keep the merged trace well inside it whatever the trace sizes.
AUTO_FULL_MAX_RANKS = 16


class Mode(str, Enum):
    """What travels to rank 0."""

    FULL = "full"          # records, traces and the per-rank files asked for: one merged trace
    TABLES = "tables"      # comm tables only: the overview; detail stays on each rank's node

    @classmethod
    def resolve(cls, setting: str, world_size: int) -> Mode:
        """A config's ``output.gather`` (``auto``, ``full`` or ``tables``) for this world."""
        if setting == "auto":
            return cls.FULL if world_size <= AUTO_FULL_MAX_RANKS else cls.TABLES
        return cls(setting)


class GatherFile(TypedDict):
    """``RUN_DIR/gather.json``: a ``GatherResult`` in JSON (ranks as object keys are strings)."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    schema: Literal["commviz.gather"]
    version: Literal[1]
    run_dir: str
    world_size: int
    mode: Literal["full", "tables"]
    shared: list[int]
    sent: dict[str, list[str]]
    received: dict[str, int]
    unconverted: list[int]
    missing: list[int]


SUMMARY = FileType(GatherFile, "gather summary")


@dataclass
class GatherResult:
    """What rank 0 holds after a gather (other ranks get an empty result)."""

    run_dir: Path
    world_size: int
    mode: Mode = Mode.FULL
    shared: list[int] = field(default_factory=list)      # ranks whose files were already visible
    sent: dict[int, list[str]] = field(default_factory=dict)  # rank -> files it sent over gloo
    received: dict[int, int] = field(default_factory=dict)   # rank -> bytes rank 0 got from it
    unconverted: list[int] = field(default_factory=list)  # tables: ranks that sent no table
    missing: list[int] = field(default_factory=list)     # ranks with nothing in the run dir

    def summary(self) -> GatherFile:
        """What ``gather.json`` holds."""
        return GatherFile(schema=SUMMARY.schema, version=SUMMARY.version,
                          run_dir=str(self.run_dir), world_size=self.world_size,
                          mode=self.mode.value, shared=self.shared,
                          sent={str(r): v for r, v in self.sent.items()},
                          received={str(r): v for r, v in self.received.items()},
                          unconverted=self.unconverted, missing=self.missing)


def load_summary(run_dir: str | os.PathLike[str]) -> GatherFile | None:
    """``RUN_DIR/gather.json`` as written by rank 0, or None when there is none; one that does
    not fit its type is a warning naming it and the key (the run's other files still count)."""
    path = Path(run_dir) / SUMMARY_NAME
    if not path.is_file():
        return None
    try:
        return SUMMARY.load(path)
    except SourceError as exc:
        warnings.warn(f"commviz: {exc}", stacklevel=2)
        return None


def _has_record(run_dir: Path, rank: int) -> bool:
    return (run_dir / schema.record_name(rank)).is_file() or bool(
        journal.journal_paths(run_dir, rank))


def missing_ranks(run_dir: Path, world_size: int, mode: Mode = Mode.FULL) -> list[int]:
    """Ranks with no record in the run dir; for a tables gather, those with no comm table, no
    record and no journal to rebuild one from (rank 0 has nothing of them)."""
    if mode is Mode.FULL:
        return [r for r in range(world_size) if not (run_dir / schema.record_name(r)).is_file()]
    return [r for r in range(world_size)
            if not table_path(run_dir, r).is_file() and not _has_record(run_dir, r)]


def conclude(result: GatherResult) -> GatherResult:
    """Rank 0, at the end: who is missing, who sent no table, and ``gather.json``."""
    target, world = result.run_dir, result.world_size
    result.missing = missing_ranks(target, world, result.mode)
    if result.mode is Mode.TABLES:
        result.unconverted = [r for r in range(world) if r not in result.missing
                              and not table_path(target, r).is_file()]
    if result.missing:
        what = "no record" if result.mode is Mode.FULL else "no comm table and no record"
        warnings.warn(f"commviz.gather: {what} from rank(s) {result.missing} in {target}; "
                      "the other ranks' files are kept", stacklevel=3)
    try:
        store.write_atomic(target / SUMMARY_NAME, SUMMARY.dump_json(result.summary(), indent=1))
    except OSError as exc:
        warnings.warn(f"commviz.gather: {cannot_write(exc, target / SUMMARY_NAME)}", stacklevel=3)
    return result
