"""commviz: make collective communication visible in multi-GPU PyTorch jobs.

The flow, one subpackage a step: ``record`` (wrappers + per-rank records) -> ``gather`` ->
``match`` (records onto profiler kernels, graphed ones included) -> ``write`` (one multi-rank
Perfetto trace) -> ``review`` (skew, stragglers, bandwidth, desyncs).
"""

from commviz.annotate import annotate_collective
from commviz.gather import gather
from commviz.patching import patch, unpatch
from commviz.record import flush, load_record, profile, start, trace_handler
from commviz.record.recorder import RECORDER, enable

__version__ = "0.1.0"

__all__ = [
    "RECORDER", "annotate_collective", "enable", "flush", "gather", "load_record", "patch",
    "profile", "start", "trace_handler", "unpatch", "__version__",
]
