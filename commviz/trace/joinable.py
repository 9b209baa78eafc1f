"""Which profiler events a matcher may join on, found once when a trace is loaded.

Of a training step's events, only a few kinds can tie a recorded call to the trace: the CPU
calls that launch GPU work (their ``correlation``), the GPU work itself, and the CPU ops named by
commviz (``commviz::<op>`` ranges, graph replay tags, ``commviz.mark`` blocks) or by c10d and
ProcessGroupNCCL (``c10d::<op>``, ``record_param_comms``, ``nccl:coalesced``). ``load_trace``
lists their indices in the same pass that reads digit-string ids, so the eager, graph and GPU
passes each walk that list, not every CPU op of the trace. Each pass still checks what it takes.
Where commviz's C extension is built, its port of the pass (``_scan.c``) does it.
"""

from __future__ import annotations

from commviz.kernels import GPU_WORK_CATS, LAUNCH_CATS

try:    # the C passes over every event (_scan.c); one import, for load, joinable and the merge
    import commviz.trace._scan as native     # not "from commviz.trace": that is this package
except ImportError:                 # built by pip install where a C compiler is
    native = None

RANGE_PREFIX = "commviz::"          # commviz::<op>: one annotated call (and commviz's other ranges)
OP_PREFIX = "c10d::"                # c10d::<op>: the profiler's event of a c10d op call
PARAM_COMMS = "record_param_comms"
COALESCED_RANGE = "nccl:coalesced"  # ProcessGroupNCCL's endCoalescing: a coalesced group's launch
JOIN_CATS = LAUNCH_CATS | GPU_WORK_CATS
NAMED = (RANGE_PREFIX, OP_PREFIX, PARAM_COMMS, COALESCED_RANGE)


def index_events(events: list) -> list[int]:
    """In one pass over a loaded trace: digit-string ids read as numbers, in place, and the
    indices of the complete events a matcher may join on (``python_index_events``)."""
    if native is not None and events.__class__ is list:
        return native.index_events(events, JOIN_CATS, NAMED)
    return python_index_events(events)


def python_index_events(events: list) -> list[int]:
    """In one pass over a loaded trace: read a pid or tid written as a string of digits as its
    number, in place, and return the indices of the complete events a matcher may join on.

    The ids: one thread is one track whichever way an event spells it (Perfetto's JSON importer
    parses such strings too), so early Kineto's flows, which wrote the number, land on their
    slices' thread. The reference for ``_scan.index_events`` and its fallback.
    """
    joinable: list[int] = []
    add = joinable.append
    for i, e in enumerate(events):      # unrolled: a third faster than a loop over the keys
        if e.__class__ is not dict:
            continue
        pid, tid = e.get("pid"), e.get("tid")
        if pid.__class__ is str and pid.isascii() and pid.isdigit():
            e["pid"] = int(pid)
        if tid.__class__ is str and tid.isascii() and tid.isdigit():
            e["tid"] = int(tid)
        if e.get("ph") == "X":
            if e.get("cat") in JOIN_CATS:
                add(i)
            else:
                name = e.get("name")
                if name.__class__ is str and name.startswith(NAMED):
                    add(i)
    return joinable
