"""Drive commviz's compiled NCCL profiler plugin as NCCL 2.28 drives it, then die by SIGKILL.

``python gputime_driver.py LIBRARY FED_JSON`` (``COMMVIZ_GPUTIME_FILE`` set): the plugin's
``ncclProfiler_v5`` struct is called through ctypes with NCCL's descriptor layout: ``init`` for
two communicators, then per op a task event (Coll or P2p) started and stopped on this thread,
and its kernel-channel events (start stamp, stop stamp through ``recordEventState``, stop) on
a second thread, as NCCL's proxy thread calls them. An eager op's task event follows its API
event (``ncclAllReduce``...); a CUDA graph replay's has none (NCCL starts it from CUDA's
host-callback thread), and the API event of a call under capture says so. The GPU timer is
made up: the wall clock less LAG. FED_JSON gets what was fed in (the expected entries), written before the SIGKILL.
"""

from __future__ import annotations

import ctypes as C
import json
import os
import signal
import sys
import threading
import time

LAG = 1_000_000_000
COLL, P2P, KERNEL_CH, GROUP_API, COLL_API, P2P_API = 1 << 1, 1 << 2, 1 << 6, 1 << 8, 1 << 9, 1 << 10
KERNEL_CH_STOP = 22


class _Coll(C.Structure):
    _fields_ = [("seqNumber", C.c_uint64), ("func", C.c_char_p), ("sendBuff", C.c_void_p),
                ("recvBuff", C.c_void_p), ("count", C.c_size_t), ("root", C.c_int),
                ("datatype", C.c_char_p), ("nChannels", C.c_uint8), ("nWarps", C.c_uint8),
                ("algo", C.c_char_p), ("proto", C.c_char_p), ("parentGroup", C.c_void_p)]


class _P2p(C.Structure):
    _fields_ = [("func", C.c_char_p), ("buff", C.c_void_p), ("datatype", C.c_char_p),
                ("count", C.c_size_t), ("peer", C.c_int), ("nChannels", C.c_uint8),
                ("parentGroup", C.c_void_p)]


class _KernelCh(C.Structure):
    _fields_ = [("channelId", C.c_uint8), ("pTimer", C.c_uint64)]


class _CollApi(C.Structure):
    _fields_ = [("func", C.c_char_p), ("count", C.c_size_t), ("datatype", C.c_char_p),
                ("root", C.c_int), ("stream", C.c_void_p), ("graphCaptured", C.c_bool)]


class _P2pApi(C.Structure):
    _fields_ = [("func", C.c_char_p), ("count", C.c_size_t), ("datatype", C.c_char_p),
                ("stream", C.c_void_p), ("graphCaptured", C.c_bool)]


class _U(C.Union):
    _fields_ = [("coll", _Coll), ("p2p", _P2p), ("kernelCh", _KernelCh),
                ("collApi", _CollApi), ("p2pApi", _P2pApi)]


class Descr(C.Structure):
    _anonymous_ = ("u",)
    _fields_ = [("type", C.c_uint64), ("parentObj", C.c_void_p), ("rank", C.c_int), ("u", _U)]


class StateArgs(C.Union):
    _fields_ = [("pTimer", C.c_uint64), ("pad", C.c_uint64)]


class Profiler(C.Structure):
    _fields_ = [
        ("name", C.c_char_p),
        ("init", C.CFUNCTYPE(C.c_int, C.POINTER(C.c_void_p), C.c_uint64, C.POINTER(C.c_int),
                             C.c_char_p, C.c_int, C.c_int, C.c_int, C.c_void_p)),
        ("startEvent", C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(C.c_void_p),
                                   C.POINTER(Descr))),
        ("stopEvent", C.CFUNCTYPE(C.c_int, C.c_void_p)),
        ("recordEventState", C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int, C.POINTER(StateArgs))),
        ("finalize", C.CFUNCTYPE(C.c_int, C.c_void_p)),
    ]


# NCCL's names are static strings: kept alive here for the plugin, which keeps their addresses
NAMES = {n: C.c_char_p(n.encode()) for n in ("AllReduce", "AllGather", "Send", "Recv",
                                             "ncclFloat32", "ncclBfloat16", "ncclInt64")}


def main(library: str, fed_path: str) -> None:
    lib = C.CDLL(library)
    prof = Profiler.in_dll(lib, "ncclProfiler_v5")
    mask = C.c_int(0)
    comms = {0xA1A1: (0, 2, 1, "default_pg"), 0xB2B2: (1, 4, 2, "tp")}
    ctx = {}
    for comm, (rank, nranks, nnodes, name) in comms.items():
        c = C.c_void_p()
        assert prof.init(C.byref(c), comm, C.byref(mask), name.encode(), nnodes, nranks, rank,
                         None) == 0
        ctx[comm] = c
    masks = [mask.value]
    lib.commviz_gputime_enable(0)
    masks.append(mask.value)
    lib.commviz_gputime_enable(1)
    masks.append(mask.value)

    tid = threading.get_native_id()
    ops = []

    def api(comm: int, p2p: bool, func: str, captured: bool) -> None:
        a = Descr(type=P2P_API if p2p else COLL_API)
        if p2p:
            a.p2pApi.func, a.p2pApi.graphCaptured = NAMES[func], captured
        else:
            a.collApi.func, a.collApi.graphCaptured = NAMES[func], captured
        h = C.c_void_p()
        prof.startEvent(ctx[comm], C.byref(h), C.byref(a))

    def enqueue(comm: int, p2p: bool, func: str, dtype: str, count: int, size: int, seq: int,
                peer: int, channels: int, ending: int, replay: bool = False) -> None:
        if not replay:
            api(comm, p2p, func, False)
        d = Descr(type=P2P if p2p else COLL, rank=comms[comm][0])
        if p2p:
            d.p2p.func, d.p2p.datatype = NAMES[func], NAMES[dtype]
            d.p2p.count, d.p2p.peer, d.p2p.nChannels = count, peer, channels
        else:
            d.coll.func, d.coll.datatype = NAMES[func], NAMES[dtype]
            d.coll.count, d.coll.root, d.coll.nChannels, d.coll.seqNumber = \
                count, peer, channels, seq
        handle = C.c_void_p()
        before = time.time_ns()
        prof.startEvent(ctx[comm], C.byref(handle), C.byref(d))
        after = time.time_ns()
        prof.stopEvent(handle)                   # enqueued: NCCL stops the task event now
        stamps: list[int] = []

        def proxy() -> None:                     # NCCL's proxy thread: the channels' stamps
            for ch in range(ending):
                start = time.time_ns() - LAG
                k = Descr(type=KERNEL_CH, parentObj=handle.value)
                k.kernelCh.channelId, k.kernelCh.pTimer = ch, start
                h = C.c_void_p()
                prof.startEvent(ctx[comm], C.byref(h), C.byref(k))
                time.sleep(0.001)
                end = time.time_ns() - LAG
                prof.recordEventState(h, KERNEL_CH_STOP, C.byref(StateArgs(pTimer=end)))
                prof.stopEvent(h)
                stamps.extend((start, end))

        t = threading.Thread(target=proxy)
        t.start()
        t.join()
        written = ending == channels
        ops.append({"written": written, "before": before, "after": after,
                    "entry": [comm, func, p2p, seq, count * size, peer, tid,
                              min(stamps[0::2]) if stamps else 0, max(stamps[1::2], default=0),
                              ending, channels, False, replay]})

    for k in range(4):
        enqueue(0xA1A1, False, "AllReduce", "ncclFloat32", 1024, 4, 10 + k, 0, 2, 2)
    enqueue(0xB2B2, False, "AllGather", "ncclInt64", 300, 8, 0, 0, 3, 3)
    for k in range(2):
        enqueue(0xB2B2, True, "Send", "ncclBfloat16", 256, 2, k, 3, 1, 1)
    enqueue(0xB2B2, True, "Recv", "ncclFloat32", 64, 4, 2, 2, 1, 1)
    api(0xA1A1, False, "AllReduce", True)          # captured: its op begins at each replay
    enqueue(0xA1A1, False, "AllReduce", "ncclFloat32", 16, 4, 20, 0, 1, 1, replay=True)
    enqueue(0xA1A1, False, "AllReduce", "ncclFloat32", 16, 4, 21, 0, 1, 1, replay=True)
    enqueue(0xA1A1, False, "AllReduce", "ncclFloat32", 8, 4, 14, 0, 2, 1)   # one channel short
    calls = []                                    # NCCL's mask after each call's group event
    for _ in range(8):
        h = C.c_void_p()
        prof.startEvent(ctx[0xA1A1], C.byref(h), C.byref(Descr(type=GROUP_API)))
        calls.append(mask.value)
    with open(fed_path, "w") as f:
        json.dump({"comms": {str(c): v for c, v in comms.items()}, "ops": ops, "masks": masks,
                   "calls": calls, "lag": LAG}, f)
    os.kill(os.getpid(), signal.SIGKILL)          # no finalize, no exit handler


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
