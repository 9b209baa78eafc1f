"""What a rank converts on its own node at the end of a job: its shard, matched run and comm table.

The conversion is the expensive per-rank step of the review (parsing the rank's trace, matching
its records onto its kernels); run on every rank's own node it spreads over the whole job, and
what it leaves (``shard_rank{R}.pftrace``, ``matched_rank{R}.json``, ``comm_rank{R}.json``) is
what the merge reuses and what a tables-only gather sends (the comm table alone).
"""

from __future__ import annotations

import os


def convert_here(run_dir: str | os.PathLike[str], rank: int) -> str | None:
    """Write rank R's shard, matched run and comm table; None, or why it could not (the merge
    then converts the rank itself from whatever reaches it)."""
    from commviz.merge import write_shard
    from commviz.merge.table import write_table

    try:
        write_shard(run_dir, rank)
        write_table(run_dir, rank)
    except Exception as exc:  # the job itself succeeded: never fail it over its review
        return f"{type(exc).__name__}: {exc}"
    return None
