"""CUPTI's graph and node ids through ctypes on the CUPTI library the process already uses.

``cuptiGetGraphNodeId`` / ``cuptiGetGraphId`` / ``cuptiGetGraphExecId`` give the ids the
profiler's CUPTI activity records carry (Kineto writes them as ``"graph id"`` /
``"graph node id"`` from torch 2.12 on). They work on CUDA 13.0 drivers, where
``cudaGraphNodeGetToolsId`` does not. The library is the copy already mapped into the process
when there is one (the one Kineto uses: one id space), else the one torch's wheel ships
(``nvidia/cu13/lib``, ``nvidia/cuda_cupti/lib``), else whatever the dynamic linker finds.
Everything degrades to ``None`` when CUPTI is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
path: str | None = None            # the library in use, for the record and for error messages


def _mapped() -> list[str]:
    try:
        with open("/proc/self/maps") as f:
            found = {line.split()[-1] for line in f if "libcupti.so" in line}
    except OSError:
        return []
    return sorted(p for p in found if os.path.isabs(p))


def _shipped() -> list[str]:
    out: list[str] = []
    for entry in sys.path:
        for pattern in ("nvidia/cu*/lib/libcupti.so*", "nvidia/cuda_cupti/lib/libcupti.so*"):
            out.extend(sorted(glob.glob(os.path.join(entry or ".", pattern)), reverse=True))
    return out


def _candidates() -> list[str]:
    found = _mapped() + _shipped()
    linker = ctypes.util.find_library("cupti")
    if linker:
        found.append(linker)
    found.extend(["libcupti.so.13", "libcupti.so.12", "libcupti.so"])
    return found


def _load() -> ctypes.CDLL | None:
    global _lib, _tried, path
    with _lock:
        if _tried:
            return _lib
        _tried = True
        for candidate in _candidates():
            try:
                lib = ctypes.CDLL(candidate)
                for name, out in (("cuptiGetGraphNodeId", ctypes.c_uint64),
                                  ("cuptiGetGraphId", ctypes.c_uint32),
                                  ("cuptiGetGraphExecId", ctypes.c_uint32)):
                    fn = getattr(lib, name)
                    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(out)]
                    fn.restype = ctypes.c_int
            except (OSError, AttributeError):
                continue
            _lib, path = lib, candidate
            break
        return _lib


def available() -> bool:
    return _load() is not None


_u64 = ctypes.c_uint64
_u32 = ctypes.c_uint32


def _query(fn: str, handle: int, out_type: type) -> int | None:
    """One CUPTI id query: ``fn(handle, &out)``; None without CUPTI or on failure."""
    lib = _lib if _tried else _load()
    if lib is None or not handle:
        return None
    out = out_type()
    if getattr(lib, fn)(handle, ctypes.byref(out)) != 0:
        return None
    return out.value


def node_id(node: int) -> int | None:
    """CUPTI's id of a graph node: ``(graph id << 32) | node index``; None without CUPTI."""
    return _query("cuptiGetGraphNodeId", node, _u64)


def graph_id(graph: int) -> int | None:
    """CUPTI's id of a (capture) graph."""
    return _query("cuptiGetGraphId", graph, _u32)


def exec_id(graph_exec: int) -> int | None:
    """CUPTI's id of an instantiated graph: the ``"graph id"`` its replayed kernels carry."""
    return _query("cuptiGetGraphExecId", graph_exec, _u32)
