"""Step 1 of the flow: record each rank's collectives (and its profiler trace) into the run dir.

Loaded on first use, so that reading record files (``schema``, ``store``) needs no torch.
"""

_API = {
    "RECORDER": "commviz.record.recorder", "Recorder": "commviz.record.recorder",
    "enable": "commviz.record.recorder", "flush": "commviz.record.recorder",
    "start": "commviz.record.recorder", "load_record": "commviz.record.store",
    "profile": "commviz.record.profiler", "trace_handler": "commviz.record.profiler",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> object:
    if name not in _API:
        raise AttributeError(f"module 'commviz.record' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_API[name]), name)
    globals()[name] = value
    return value
