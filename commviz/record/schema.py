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

SCHEMA = "commviz.record"
VERSION = 1
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
