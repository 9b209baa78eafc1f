"""Step 4 of the flow: every rank's trace and record into one multi-rank Perfetto trace
(``merge_run``), or one rank's piece on its own node (``write_shard``). Loaded on first use, so
that a submodule (the comm tables, the CLI's registration) does not bring in the writer."""

from commviz.lazy import lazy_api

_API = {"MergeResult": "commviz.merge.core", "merge_run": "commviz.merge.core",
        "write_shard": "commviz.merge.core"}
__all__ = sorted(_API)

__getattr__ = lazy_api(__name__, _API)
