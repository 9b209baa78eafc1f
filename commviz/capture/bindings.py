"""The few CUDA graph calls capture needs, through ``cuda.bindings`` (shipped with torch's CUDA wheels).

Handles are plain ints everywhere (cuda.bindings accepts them), which keeps the hot path free of
wrapper objects. Everything here may only be called when ``available()``; the queries are read-only
and legal on a graph while it is being captured.
"""

from __future__ import annotations

from typing import Any

try:  # pragma: no cover - depends on the machine
    from cuda.bindings import driver as _drv
    from cuda.bindings import runtime as _rt
except ImportError:  # CPU machines, or a torch build without cuda-bindings
    _drv = _rt = None

if _rt is not None:
    _OK = _rt.cudaError_t.cudaSuccess
    _ACTIVE = _rt.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive
    _KERNEL = _rt.cudaGraphNodeType.cudaGraphNodeTypeKernel
    _NEWER_DRIVER = getattr(_rt.cudaError_t, "cudaErrorCallRequiresNewerDriver", None)
    _DRV_OK = _drv.CUresult.CUDA_SUCCESS

_BUF = 16                      # first guess of a node's dependents: one call in the common case
_func_names: dict[int, str] = {}
_tools_ok: bool | None = None


def available() -> bool:
    return _rt is not None


class CaptureInfo:
    """A stream's active capture: its process-unique id, the graph, the stream's frontier."""

    __slots__ = ("capture_id", "graph", "frontier")

    def __init__(self, capture_id: int, graph: int, frontier: list[int]) -> None:
        self.capture_id = capture_id
        self.graph = graph
        self.frontier = frontier


def capture_info(stream: int) -> CaptureInfo | None:
    """The active capture on ``stream`` (a ``cudaStream_t`` as int), or None."""
    res = _rt.cudaStreamGetCaptureInfo(stream)
    # cuda-bindings 13: (err, status, id, graph, deps, edge_data, n); 12: (err, status, id, graph, deps, n)
    if res[0] != _OK or res[1] != _ACTIVE:
        return None
    num = int(res[-1])
    deps = res[4] or []
    return CaptureInfo(int(res[2]), int(res[3]), [int(d) for d in deps[:num]])


def dependents(node: int) -> list[int]:
    """The nodes that depend directly on ``node``."""
    res = _rt.cudaGraphNodeGetDependentNodes(node, _BUF)
    if res[0] != _OK:
        return []
    num = int(res[-1])
    if num >= _BUF:                        # maybe truncated: ask for the count, then all of them
        num = int(_rt.cudaGraphNodeGetDependentNodes(node, 0)[-1])
        res = _rt.cudaGraphNodeGetDependentNodes(node, num)
        if res[0] != _OK:
            return []
        num = int(res[-1])
    return [int(d) for d in (res[1] or [])[:num]]


def _listing(fn: Any, handle: int) -> list[Any]:
    res = fn(handle, 0)
    if res[0] != _OK:
        return []
    num = int(res[-1])
    if num == 0:
        return []
    res = fn(handle, num)
    if res[0] != _OK:
        return []
    return list(res[1:-1])


def roots(graph: int) -> list[int]:
    got = _listing(_rt.cudaGraphGetRootNodes, graph)
    return [int(n) for n in got[0]] if got else []


def nodes(graph: int) -> list[int]:
    got = _listing(_rt.cudaGraphGetNodes, graph)
    return [int(n) for n in got[0]] if got else []


def edges(graph: int) -> list[tuple[int, int]]:
    """Every (from, to) dependency edge of ``graph``."""
    got = _listing(_rt.cudaGraphGetEdges, graph)
    if not got:
        return []
    return [(int(a), int(b)) for a, b in zip(got[0], got[1])]


def is_kernel(node: int) -> bool:
    err, kind = _rt.cudaGraphNodeGetType(node)
    return err == _OK and kind == _KERNEL


def kernel(node: int) -> tuple[str, list[int]] | None:
    """A kernel node's (mangled) function name and launch dims ``[gx, gy, gz, bx, by, bz]``."""
    err, params = _drv.cuGraphKernelNodeGetParams(node)
    if err != _DRV_OK:
        return None
    func = int(params.func)
    key = func or int(params.kern)
    name = _func_names.get(key)
    if name is None:
        if func:
            err, raw = _drv.cuFuncGetName(params.func)
        else:
            err, raw = _drv.cuKernelGetName(params.kern)
        if err != _DRV_OK:
            return None
        name = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
        _func_names[key] = name
    return name, [params.gridDimX, params.gridDimY, params.gridDimZ,
                  params.blockDimX, params.blockDimY, params.blockDimZ]


def tools_id(node: int) -> int | None:
    """``cudaGraphNodeGetToolsId`` where the driver has it (CUDA >= 13.1), else None."""
    global _tools_ok
    if _tools_ok is False:
        return None
    fn = getattr(_rt, "cudaGraphNodeGetToolsId", None)
    if fn is None:
        _tools_ok = False
        return None
    err, value = fn(node)
    if err != _OK:
        if _tools_ok is None and (err == _NEWER_DRIVER or _NEWER_DRIVER is None):
            _tools_ok = False
        return None
    _tools_ok = True
    return int(value)


def exec_tools_id(graph_exec: int) -> int | None:
    """``cudaGraphExecGetId`` (the exec id toolsIds carry) where the driver has it."""
    fn = getattr(_rt, "cudaGraphExecGetId", None)
    if fn is None or not graph_exec or _tools_ok is False:
        return None
    err, value = fn(graph_exec)
    return int(value) if err == _OK else None
