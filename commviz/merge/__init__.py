"""Step 4 of the flow: every rank's trace and record into one multi-rank Perfetto trace
(``merge_run``), or one rank's piece on its own node (``write_shard``)."""

from commviz.merge.core import MergeResult, merge_run, write_shard

__all__ = ["MergeResult", "merge_run", "write_shard"]
