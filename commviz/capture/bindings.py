"""The few CUDA graph calls capture needs: read-only, legal while a graph is being captured.

Two interchangeable backends with the same functions: ``driver`` calls the CUDA driver
(``libcuda.so.1``) through ctypes, the cheap one (capture time counts: these run once or twice
per collective); ``bindings`` goes through ``cuda.bindings`` (shipped with torch's CUDA wheels).
``COMMVIZ_CAPTURE_BACKEND=driver|bindings`` picks one; by default the driver, else bindings.
Handles are plain ints throughout.

``read`` takes a whole graph as its capture ends (``GraphRead``). With the driver backend and
the boundary kernel built, that is one C++ call on the same driver (``read_graph`` in
``commviz/record/boundary.cpp``, about 0.1 us a node); otherwise node by node here.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
from typing import Any, NamedTuple, Sequence

from commviz.record import recorder as _rec

_BUF = 16                      # first guess of a node's dependents: one call in the common case
_func_names: dict[int, str] = {}


class CaptureInfo:
    """A stream's active capture: its process-unique id, the graph, the stream's frontier
    (``capture_id`` and ``graph`` None: capturing, but no backend to read the capture with)."""

    __slots__ = ("capture_id", "graph", "frontier", "stream")

    def __init__(self, capture_id: int | None, graph: int | None, frontier: list[int],
                 stream: int = 0) -> None:
        self.capture_id = capture_id
        self.graph = graph
        self.frontier = frontier
        self.stream = stream


class GraphRead(NamedTuple):
    """A whole graph as read at the end of its capture (the graph itself is gone after that)."""

    nodes: Sequence[int]              # node handles in the driver's listing order
    sources: Sequence[int]            # edge i runs from sources[i] to targets[i]
    targets: Sequence[int]
    kernels: Sequence[int]            # positions in ``nodes`` of the (named) kernel nodes
    names: list[str]                  # the distinct kernel function names (mangled)
    params: Sequence[int]             # per kernel: its name's index in ``names``, then dims
    tools: Sequence[int] | None       # per kernel: its toolsId (CUDA >= 13.1 drivers)

    @classmethod
    def native(cls, got: tuple) -> GraphRead:
        """From the boundary kernel's ``read_graph`` (packed arrays, read in place)."""
        nodes, sources, targets, kernels, names, params, tools = got
        return cls(memoryview(nodes).cast("Q"), memoryview(sources).cast("Q"),
                   memoryview(targets).cast("Q"), memoryview(kernels).cast("I"), names,
                   memoryview(params).cast("I"),
                   memoryview(tools).cast("Q") if tools is not None else None)

    def edges(self) -> list[tuple[int, int]]:
        return list(zip(self.sources, self.targets))

    def descs(self) -> dict[int, tuple[str, list[int]]]:
        """Each kernel node's (name, launch dims ``[gx, gy, gz, bx, by, bz]``)."""
        nodes, names, p = self.nodes, self.names, list(self.params)
        return {nodes[k]: (names[p[7 * i]], p[7 * i + 1:7 * i + 7])
                for i, k in enumerate(self.kernels)}


# ---------------------------------------------------------------------------------------------
class _Scratch:
    """ctypes out-parameters and their pointers, made once: building them is most of a call."""

    def __init__(self, params: type) -> None:
        c = ctypes
        self.status, self.id, self.graph = c.c_int(), c.c_uint64(), c.c_void_p()
        self.deps, self.edges, self.num = c.POINTER(c.c_void_p)(), c.c_void_p(), c.c_size_t()
        self.status_p, self.id_p, self.graph_p = c.byref(self.status), c.byref(self.id), \
            c.byref(self.graph)
        self.deps_p, self.edges_p, self.num_p = c.byref(self.deps), c.byref(self.edges), \
            c.byref(self.num)
        self.buf, self.edata = (c.c_void_p * _BUF)(), (c.c_uint64 * _BUF)()
        self.type = c.c_int()
        self.type_p = c.byref(self.type)
        self.params = params()
        self.params_p = c.byref(self.params)


# CUDA_KERNEL_NODE_PARAMS_v2 as read: func, grid and block dims, (sharedMemBytes, padding),
# kernelParams, extra, kern, ctx
_PARAMS = struct.Struct("P6I4xPPPP")


class _Driver:
    """ctypes on libcuda.so.1 (versioned entry points of CUDA >= 12.3 drivers)."""

    name = "driver"
    _ACTIVE = 1                     # CU_STREAM_CAPTURE_STATUS_ACTIVE
    _KERNEL = 0                     # CU_GRAPH_NODE_TYPE_KERNEL

    class Params(ctypes.Structure):  # CUDA_KERNEL_NODE_PARAMS_v2
        _fields_ = [("func", ctypes.c_void_p), ("gridDimX", ctypes.c_uint),
                    ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                    ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint),
                    ("blockDimZ", ctypes.c_uint), ("sharedMemBytes", ctypes.c_uint),
                    ("kernelParams", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                    ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]

    def __init__(self) -> None:
        self._local = threading.local()
        lib = ctypes.CDLL("libcuda.so.1")
        vp, sz, u64, u32 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_uint
        P = ctypes.POINTER

        def fn(name: str, *argtypes: Any) -> Any:
            f = getattr(lib, name)
            f.argtypes = list(argtypes)
            f.restype = ctypes.c_int
            return f

        # called once or twice per captured collective: without argtypes, on argument objects
        # made once (a stream handle per stream), ctypes converts nothing per call
        self._info_raw = lib["cuStreamGetCaptureInfo_v3"]
        self._info_raw.restype = ctypes.c_int
        self._streams: dict[int, ctypes.c_void_p] = {}
        self._deps = fn("cuGraphNodeGetDependentNodes_v2", vp, P(vp), P(u64), P(sz))
        self._params = fn("cuGraphKernelNodeGetParams_v2", vp, P(self.Params))
        self._type = fn("cuGraphNodeGetType", vp, P(ctypes.c_int))
        self._fname = fn("cuFuncGetName", P(ctypes.c_char_p), vp)
        self._kname = fn("cuKernelGetName", P(ctypes.c_char_p), vp)
        self._nodes = fn("cuGraphGetNodes", vp, P(vp), P(sz))
        self._roots = fn("cuGraphGetRootNodes", vp, P(vp), P(sz))
        self._edges = fn("cuGraphGetEdges_v2", vp, P(vp), P(vp), P(u64), P(sz))
        try:                        # CUDA >= 13.1 drivers only
            self._tools = fn("cuGraphNodeGetToolsId", vp, P(ctypes.c_ulonglong))
            self._exec_id = fn("cuGraphExecGetId", vp, P(u32))
        except AttributeError:
            self._tools = self._exec_id = None

    def _scratch(self) -> "_Scratch":
        """Out-parameters reused call after call (one set per thread)."""
        scratch = getattr(self._local, "s", None)
        if scratch is None:
            scratch = self._local.s = _Scratch(self.Params)
        return scratch

    def capture_info(self, stream: int) -> CaptureInfo | None:
        try:
            s = self._local.s
        except AttributeError:
            s = self._scratch()
        handle = self._streams.get(stream)
        if handle is None:
            if len(self._streams) > 4096:
                self._streams.clear()
            handle = self._streams[stream] = ctypes.c_void_p(stream)
        if self._info_raw(handle, s.status_p, s.id_p, s.graph_p, s.deps_p, s.edges_p,
                          s.num_p) != 0 or s.status.value != self._ACTIVE:
            return None
        return CaptureInfo(s.id.value, s.graph.value or 0, s.deps[:s.num.value], stream)

    def dependents(self, node: int) -> list[int]:
        s = self._scratch()
        s.num.value = _BUF
        if self._deps(node, s.buf, s.edata, s.num_p) != 0:
            return []
        n = s.num.value
        if n < _BUF:
            return s.buf[:n]
        if self._deps(node, None, None, s.num_p) != 0:    # maybe truncated: how many are there?
            return []
        size = s.num.value
        buf, edata = (ctypes.c_void_p * size)(), (ctypes.c_uint64 * size)()
        if self._deps(node, buf, edata, s.num_p) != 0:
            return []
        return buf[:s.num.value]

    def _listing(self, fn: Any, handle: int) -> list[int]:
        count = ctypes.c_size_t()
        if fn(handle, None, ctypes.byref(count)) != 0 or count.value == 0:
            return []
        buf = (ctypes.c_void_p * count.value)()
        if fn(handle, buf, ctypes.byref(count)) != 0:
            return []
        return list(buf[:count.value])

    def roots(self, graph: int) -> list[int]:
        return self._listing(self._roots, graph)

    def nodes(self, graph: int) -> list[int]:
        return self._listing(self._nodes, graph)

    def edges(self, graph: int) -> list[tuple[int, int]]:
        count = ctypes.c_size_t()
        if self._edges(graph, None, None, None, ctypes.byref(count)) != 0 or not count.value:
            return []
        n = count.value
        a, b, e = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (ctypes.c_uint64 * n)()
        if self._edges(graph, a, b, e, ctypes.byref(count)) != 0:
            return []
        return list(zip(a[:count.value], b[:count.value]))

    def kernel(self, node: int) -> tuple[str, list[int]] | None:
        s = self._scratch()
        return self._read_kernel(s.params) if self._params(node, s.params_p) == 0 else None

    def _read_kernel(self, p: Any) -> tuple[str, list[int]] | None:
        """(name, dims) from the kernel parameters just read into ``p`` (unpacked in one go:
        this runs for every kernel of a graph at the end of its capture)."""
        func, gx, gy, gz, bx, by, bz, _, _, kern, _ = _PARAMS.unpack_from(p)
        key = func or kern
        name = _func_names.get(key)
        if name is None:
            raw = ctypes.c_char_p()
            err = self._fname(ctypes.byref(raw), func) if func else \
                self._kname(ctypes.byref(raw), kern)
            if err != 0 or raw.value is None:
                return None
            name = _func_names[key] = raw.value.decode(errors="replace")
        return name, [gx, gy, gz, bx, by, bz]

    def kernels(self, nodes: list[int], likely: frozenset[int] | set[int] = frozenset()
                ) -> list[tuple[str, list[int]] | None]:
        s = self._scratch()
        kind, kind_p, node_type, params, read = s.type, s.type_p, self._type, self._params, \
            self._read_kernel
        p, p_ref, kernel_type = s.params, s.params_p, self._KERNEL
        return [read(p) if (n in likely or node_type(n, kind_p) == 0 and kind.value == kernel_type)
                and params(n, p_ref) == 0 else None for n in nodes]

    def tools_id(self, node: int) -> int | None:
        if self._tools is None:
            return None
        out = ctypes.c_ulonglong()
        if self._tools(node, ctypes.byref(out)) != 0:
            self._tools = None            # not supported by this driver: stop asking
            return None
        return out.value

    def exec_tools_id(self, graph_exec: int) -> int | None:
        if self._exec_id is None or not graph_exec:
            return None
        out = ctypes.c_uint()
        return out.value if self._exec_id(graph_exec, ctypes.byref(out)) == 0 else None


# ---------------------------------------------------------------------------------------------
class _Bindings:
    """cuda.bindings (Python objects per call: simpler, several times slower)."""

    name = "bindings"

    def __init__(self) -> None:
        from cuda.bindings import driver, runtime

        self._rt, self._drv = runtime, driver
        self._OK = runtime.cudaError_t.cudaSuccess
        self._DRV_OK = driver.CUresult.CUDA_SUCCESS
        self._ACTIVE = runtime.cudaStreamCaptureStatus.cudaStreamCaptureStatusActive
        self._tools_ok = hasattr(runtime, "cudaGraphNodeGetToolsId")

    def capture_info(self, stream: int) -> CaptureInfo | None:
        res = self._rt.cudaStreamGetCaptureInfo(stream)
        # 13.x: (err, status, id, graph, deps, edge_data, n)
        # 12.x: (err, status, id, graph, deps, n)
        if res[0] != self._OK or res[1] != self._ACTIVE:
            return None
        num = int(res[-1])
        return CaptureInfo(int(res[2]), int(res[3]), [int(d) for d in (res[4] or [])[:num]],
                           stream)

    def dependents(self, node: int) -> list[int]:
        fn = self._rt.cudaGraphNodeGetDependentNodes
        res = fn(node, _BUF)
        if res[0] != self._OK:
            return []
        num = int(res[-1])
        if num >= _BUF:
            num = int(fn(node, 0)[-1])
            res = fn(node, num)
            if res[0] != self._OK:
                return []
            num = int(res[-1])
        return [int(d) for d in (res[1] or [])[:num]]

    def _listing(self, fn: Any, handle: int) -> list[Any]:
        res = fn(handle, 0)
        if res[0] != self._OK or not int(res[-1]):
            return []
        res = fn(handle, int(res[-1]))
        return list(res[1:-1]) if res[0] == self._OK else []

    def roots(self, graph: int) -> list[int]:
        got = self._listing(self._rt.cudaGraphGetRootNodes, graph)
        return [int(n) for n in got[0]] if got else []

    def nodes(self, graph: int) -> list[int]:
        got = self._listing(self._rt.cudaGraphGetNodes, graph)
        return [int(n) for n in got[0]] if got else []

    def edges(self, graph: int) -> list[tuple[int, int]]:
        got = self._listing(self._rt.cudaGraphGetEdges, graph)
        return [(int(a), int(b)) for a, b in zip(got[0], got[1])] if got else []

    def kernel(self, node: int) -> tuple[str, list[int]] | None:
        drv = self._drv
        err, p = drv.cuGraphKernelNodeGetParams(node)
        if err != self._DRV_OK:
            return None
        func = int(p.func)
        key = func or int(p.kern)
        name = _func_names.get(key)
        if name is None:
            err, raw = drv.cuFuncGetName(p.func) if func else drv.cuKernelGetName(p.kern)
            if err != self._DRV_OK:
                return None
            name = _func_names[key] = raw.decode(errors="replace") if isinstance(raw, bytes) \
                else str(raw)
        return name, [p.gridDimX, p.gridDimY, p.gridDimZ, p.blockDimX, p.blockDimY, p.blockDimZ]

    def kernels(self, nodes: list[int], likely: frozenset[int] | set[int] = frozenset()
                ) -> list[tuple[str, list[int]] | None]:
        drv, kernel_type = self._drv, self._drv.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL
        out: list[tuple[str, list[int]] | None] = []
        for n in nodes:
            if n not in likely:
                err, kind = drv.cuGraphNodeGetType(n)
                if err != self._DRV_OK or kind != kernel_type:
                    out.append(None)
                    continue
            out.append(self.kernel(n))
        return out

    def tools_id(self, node: int) -> int | None:
        if not self._tools_ok:
            return None
        err, value = self._rt.cudaGraphNodeGetToolsId(node)
        if err != self._OK:
            self._tools_ok = False
            return None
        return int(value)

    def exec_tools_id(self, graph_exec: int) -> int | None:
        fn = getattr(self._rt, "cudaGraphExecGetId", None)
        if fn is None or not graph_exec:
            return None
        err, value = fn(graph_exec)
        return int(value) if err == self._OK else None


# ---------------------------------------------------------------------------------------------
def _pick() -> Any:
    wanted = os.environ.get("COMMVIZ_CAPTURE_BACKEND", "").strip().lower()
    order = {"bindings": (_Bindings,), "driver": (_Driver,)}.get(wanted, (_Driver, _Bindings))
    for kind in order:
        try:
            return kind()
        except (OSError, AttributeError, ImportError):
            continue
    return None


_backend: Any = None
_picked = False


def backend() -> Any:
    """The backend in use, or None (no CUDA driver, no cuda-bindings)."""
    global _backend, _picked
    if not _picked:
        _backend, _picked = _pick(), True
    return _backend


def use(name: str | None) -> None:
    """Switch backends (benchmarks, tests); ``None`` picks again from the environment."""
    global _backend, _picked
    _backend = {"driver": _Driver, "bindings": _Bindings}[name]() if name else _pick()
    _picked = True


def available() -> bool:
    return backend() is not None


def capture_info(stream: int) -> CaptureInfo | None:
    return _backend.capture_info(stream)


def dependents(node: int) -> list[int]:
    return _backend.dependents(node)


def roots(graph: int) -> list[int]:
    return _backend.roots(graph)


def nodes(graph: int) -> list[int]:
    return _backend.nodes(graph)


def edges(graph: int) -> list[tuple[int, int]]:
    """Every (from, to) dependency edge of ``graph``."""
    return _backend.edges(graph)


def read(graph: int, likely: frozenset[int] | set[int] = frozenset()) -> GraphRead:
    """The whole live ``graph`` (``GraphRead``; empty where it cannot be read). ``likely``: nodes
    most probably kernels (see ``kernels``), for the node-by-node read."""
    if isinstance(_backend, _Driver):
        native = getattr(_rec.RECORDER.native, "read_graph", None)
        got = native(graph) if native is not None else None
        if got is not None:
            return GraphRead.native(got)
    nodes = _backend.nodes(graph)
    edges = _backend.edges(graph)
    positions, names, params = [], {}, []
    for i, desc in enumerate(_backend.kernels(nodes, likely)):
        if desc is not None:
            positions.append(i)
            params.append(names.setdefault(desc[0], len(names)))
            params.extend(desc[1])
    kernels = [nodes[i] for i in positions]
    tools = [_backend.tools_id(h) for h in kernels] \
        if kernels and _backend.tools_id(kernels[0]) is not None else None
    return GraphRead(nodes, [a for a, _ in edges], [b for _, b in edges], positions,
                     list(names), params, tools)


def kernel(node: int) -> tuple[str, list[int]] | None:
    """A kernel node's (mangled) function name and launch dims ``[gx, gy, gz, bx, by, bz]``;
    None for any other kind of node (its parameters cannot be read as a kernel's)."""
    return _backend.kernel(node)


def kernels(nodes: list[int], likely: frozenset[int] | set[int] = frozenset()
            ) -> list[tuple[str, list[int]] | None]:
    """``kernel`` of each node. The node's type is asked first (reading a kernel's parameters
    off another kind of node fails, and failing is the driver's slow path), except for the
    nodes in ``likely``, which are most probably kernels: one call each instead of two."""
    return _backend.kernels(nodes, likely)


def tools_id(node: int) -> int | None:
    """``cudaGraphNodeGetToolsId`` where the driver has it (CUDA >= 13.1), else None."""
    return _backend.tools_id(node)


def exec_tools_id(graph_exec: int) -> int | None:
    """The exec graph id toolsIds carry, where the driver has it."""
    return _backend.exec_tools_id(graph_exec)
