"""Reading profiler traces: one rank's trace (``load``) and a run dir filed by rank (``run``);
what a GPU kernel's name says is the ground floor's ``commviz.kernels``."""

from commviz.trace.load import Trace, TraceHeader, load_trace, read_header
from commviz.trace.run import RankInput, Run, load_run

__all__ = ["RankInput", "Run", "Trace", "TraceHeader", "load_run", "load_trace", "read_header"]
