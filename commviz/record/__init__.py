"""Step 1 of the flow: record each rank's collectives (and its profiler trace) into the run dir.

Loaded on first use, so that reading record files (``schema``, ``store``) needs no torch.
"""

from commviz.lazy import lazy_api

_API = {
    "RECORDER": "commviz.record.recorder", "Recorder": "commviz.record.recorder",
    "enable": "commviz.record.recorder", "flush": "commviz.record.recorder",
    "start": "commviz.patching", "load_record": "commviz.record.store",
    "profile": "commviz.record.profiler", "trace_handler": "commviz.record.profiler",
}

__all__ = sorted(_API)

__getattr__ = lazy_api(__name__, _API)
