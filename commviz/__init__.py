"""commviz: make collective communication visible in multi-GPU PyTorch jobs.

The flow, one subpackage a step: ``record`` (wrappers + per-rank records) -> ``gather`` ->
``match`` (records onto profiler kernels, graphed ones included) -> ``write`` (one multi-rank
Perfetto trace) -> ``review`` (skew, stragglers, bandwidth, desyncs).
"""

__version__ = "0.1.0"

# The API, loaded on first use: importing commviz (the after-the-job CLI does) imports no torch
# and installs nothing; ``start``, ``patch`` and ``graph`` install what they need; ``Run`` is the
# after-the-job front over a run dir (``commviz.review.front``).
from commviz.lazy import lazy_api

_API = {
    "RECORDER": "commviz.record.recorder", "enable": "commviz.record.recorder",
    "annotate_collective": "commviz.collective_annotation", "graph": "commviz.capture",
    "mark": "commviz.capture", "debug_handler": "commviz.serve.debug", "gather": "commviz.gathering", "patch": "commviz.patching",
    "unpatch": "commviz.patching", "flush": "commviz.record", "load_record": "commviz.record",
    "profile": "commviz.record", "start": "commviz.patching", "trace_handler": "commviz.record",
    "unrecorded": "commviz.record.calls", "Run": "commviz.review.front",
}

__all__ = sorted(_API) + ["__version__"]

__getattr__ = lazy_api(__name__, _API)
