"""The per-rank record file: its name, version and layout.

A record is a pickle of plain containers and scalars only (``store.load_record`` refuses
anything else), written atomically as ``RUN_DIR/commviz_rank{R}.pkl``::

    {
      "schema": "commviz.record", "version": 1,
      "rank": int, "world_size": int, "local_rank": int, "host": str, "pid": int,
      "device": "cpu" | "cuda:N", "backend": str, "torch_version": str,
      "nccl_version": str | None,
      "exit": "running" | "normal" | "SIGTERM" | "SIGINT" | "explicit",
      "clock": {"wall_ns": int,            # time.time_ns() when the record was written
                "offset_ns": int,          # add to this rank's times to land on rank 0's clock
                "offset_source": str},     # "same-host" | "measured" | "none"
      "process_groups": [{"name", "desc", "ranks": [int], "backend", "lane"}],
      "collectives": [meta dict, ...],     # keys: commviz.metadata EAGER_KEYS and its commviz.* keys
      "capacity": int, "recorded": int, "dropped": int,   # ring buffer bookkeeping
      "graphs": [graph dict, ...],         # CUDA graph captures (commviz.capture)
      "replays": [replay dict, ...],       # tagged graph replays
      "marks": [mark dict, ...],           # commviz.mark compute regions under capture
      "traces": [file name, ...],          # profiler traces this rank exported, beside it
    }

Times are wall-clock nanoseconds (``time.time_ns``), the clock the profiler's JSON uses once
``baseTimeNanoseconds`` is added to its microsecond ``ts``.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import InstanceOf
from typing_extensions import NotRequired, TypedDict

from commviz.errors import RecordError
from commviz.filetype import OPEN, FileType


# A collective's (graph's, replay's, mark's) metadata: checked to be a dict, not copied (a
# record holds one per call; their keys are ``commviz.metadata``'s, read where they are used).
Meta = InstanceOf[dict]


class GroupRow(TypedDict):
    """One process group as the rank saw it (``GroupInfo.table_row``)."""

    __pydantic_config__ = OPEN  # type: ignore[misc]
    name: str
    desc: NotRequired[str | None]
    ranks: NotRequired[list[int] | None]
    backend: NotRequired[str | None]
    lane: NotRequired[int | None]


class RecordClock(TypedDict):
    __pydantic_config__ = OPEN  # type: ignore[misc]
    offset_ns: int
    offset_source: NotRequired[str]
    wall_ns: NotRequired[int]


class RecordFile(TypedDict):
    """``commviz_rank{R}.pkl`` as declared (the docstring above shows it). Keys this reader does
    not know are kept (a newer writer may add some); a rebuilt record (``journal.recover``) may
    lack what only a living process knows (host, versions)."""

    __pydantic_config__ = OPEN  # type: ignore[misc]
    schema: Literal["commviz.record"]
    version: Literal[1]
    rank: int
    world_size: int
    process_groups: list[GroupRow]
    collectives: list[Meta]
    local_rank: NotRequired[int]
    host: NotRequired[str | None]
    pid: NotRequired[int | None]
    device: NotRequired[str]
    backend: NotRequired[str | None]
    torch_version: NotRequired[str | None]
    nccl_version: NotRequired[str | None]
    exit: NotRequired[str]
    clock: NotRequired[RecordClock]
    capacity: NotRequired[int]
    recorded: NotRequired[int]
    dropped: NotRequired[int]
    graphs: NotRequired[list[Meta]]
    replays: NotRequired[list[Meta]]
    marks: NotRequired[list[Meta]]
    traces: NotRequired[list[str]]


FILE = FileType(RecordFile, "record", RecordError)
SCHEMA, VERSION = FILE.schema, FILE.version
RECORD_GLOB = "commviz_rank*.pkl"
TRACE_GLOB = "trace_rank*.json*"
_RECORD_RE = re.compile(r"commviz_rank(\d+)\.pkl$")
_TRACE_RE = re.compile(r"trace_rank(\d+)(?:_[^.]*)?\.json(?:\.gz)?$")


def record_name(rank: int) -> str:
    return f"commviz_rank{rank}.pkl"


def trace_name(rank: int, step: int | None = None, *, end: bool = False) -> str:
    """``end``: the profile block's closing partial cycle, exported at the same step number."""
    suffix = ("" if step is None else f"_step{step}") + ("_end" if end else "")
    return f"trace_rank{rank}{suffix}.json.gz"


def shard_name(rank: int) -> str:
    """Rank R's Perfetto shard, converted on its own node (``commviz.merge.write_shard``)."""
    return f"shard_rank{rank}.pftrace"


def rank_of_record(file_name: str) -> int | None:
    m = _RECORD_RE.search(file_name)
    return int(m.group(1)) if m else None


def rank_of_trace(file_name: str) -> int | None:
    m = _TRACE_RE.search(file_name)
    return int(m.group(1)) if m else None
