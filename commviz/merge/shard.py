"""Per-rank shards: a rank's piece written on its own node, reused by the merge when still valid.

A shard's process descriptor says which inputs it was converted from (the fingerprint of its
matched run's inputs, its clock offset and the writer version), and the rank's matched run
(``commviz.match.artifact``), saved beside it, says the same: ``merge_run`` reuses the shard
when the matched run is fresh and names this shard, and takes the rank's collectives from the
matched run, never from the shard's own bytes.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from commviz.record import schema

WRITER_VERSION = "commviz-pftrace-2"


def shard_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / schema.shard_name(rank)


def fingerprint(inputs: str, offset_ns: int) -> str:
    """Which shard a rank's inputs (``artifact.inputs_fingerprint``) and clock make."""
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{WRITER_VERSION}:{offset_ns}:{inputs}".encode())
    return h.hexdigest()
