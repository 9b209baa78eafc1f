"""Step 1 of the flow: record each rank's collectives (and its profiler trace) into the run dir."""

from commviz.record.profiler import profile, trace_handler
from commviz.record.recorder import RECORDER, Recorder, enable, flush, start
from commviz.record.store import load_record

__all__ = ["RECORDER", "Recorder", "enable", "flush", "load_record", "profile", "start",
           "trace_handler"]
