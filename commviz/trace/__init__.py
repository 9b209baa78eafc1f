"""Reading profiler traces: one rank's trace (``load``), a run dir filed by rank (``run``), and
what a GPU kernel's name says (``kernels``)."""

from commviz.trace.load import Trace, TraceHeader, load_trace, read_header
from commviz.trace.run import RankInput, Run, load_run

__all__ = ["RankInput", "Run", "Trace", "TraceHeader", "load_run", "load_trace", "read_header"]
