"""commviz: make collective communication visible in multi-GPU PyTorch jobs.

The flow, one subpackage a step: ``record`` (wrappers + per-rank records) -> ``gather`` ->
``match`` (records onto profiler kernels, graphed ones included) -> ``write`` (one multi-rank
Perfetto trace) -> ``review`` (skew, stragglers, bandwidth, desyncs).
"""

from pathlib import Path as _Path

# launch/ at the repository root is the package commviz.launch (pyproject maps it there); let a
# plain source checkout on PYTHONPATH resolve it the same way an install does.
if (_Path(__file__).resolve().parent.parent / "launch" / "__init__.py").is_file():
    __path__.append(str(_Path(__file__).resolve().parent.parent))  # noqa: F821 - package __path__

from commviz.annotate import annotate_collective  # noqa: E402
from commviz.capture import graph, mark  # noqa: E402
from commviz.gather import gather
from commviz.patching import patch, unpatch
from commviz.record import flush, load_record, profile, start, trace_handler
from commviz.record.calls import unrecorded
from commviz.record.recorder import RECORDER, enable

__version__ = "0.1.0"

__all__ = [
    "RECORDER", "annotate_collective", "enable", "flush", "gather", "graph", "load_record",
    "mark", "patch", "profile", "start", "trace_handler", "unpatch", "unrecorded",
    "__version__",
]
