"""Capture records: one per CUDA graph capture, saying which node is which collective or mark.

A capture gets a small commviz graph id (``commviz.graph``, 1, 2, ... per process). Each region
(one annotated collective, one ``commviz.mark`` block) snapshots the capturing stream's frontier
on entry and, on exit, walks only the dependent edges added since: the cost is proportional to
the nodes the region added, never to the graph. Every kernel node found is described by its
CUPTI node id, its toolsId where the driver has one, its kernel and launch dims.

When the capture ends (``capture_end`` of ``torch.cuda.CUDAGraph``, still inside the capture),
``finalize`` reads the whole graph once: every kernel's name (the replay fingerprint) and, for
the kernels the matcher has to tell apart, the nearest such kernels each one depends on. After
instantiation the exec graph's CUPTI id is added: replayed kernels carry it (torch >= 2.12).

The record (``RECORDER.graphs``) is a plain dict::

    {"graph": 1, "capture_id": int|None, "cupti_graph_id": int|None, "exec_ids": [int],
     "tools_exec_ids": [int], "t_begin_ns": int, "t_end_ns": int|None,
     "complete": bool,                  # finalize ran: "after", "kernel_names" are whole-graph
                                        # (it does not for graphs without collectives or marks)
     "kernel_count": int|None, "kernel_names": {kernel key: count},
     "replays": int,                    # replays seen by the replay hook so far
     "nodes": [{"index": i,             # position in this list (topological order once complete)
                "node": int|None,       # CUPTI node id (capture graph id << 32 | node index)
                "local": int|None,      # the node's index in its graph (low 32 bits)
                "tools": int|None,      # cudaGraphNodeGetToolsId, CUDA >= 13.1 drivers
                "kernel": str,          # commviz.capture.names.kernel_key of the kernel
                "dims": [gx, gy, gz, bx, by, bz],
                "after": [i, ...],      # nearest listed nodes it depends on
                "lane": int|None, "ordinal": int|None, "op": str|None,   # a collective's kernel
                "marks": [str], "mark_lane": int|str|None}]}             # commviz.mark labels
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import Counter
from typing import Any

import torch

from commviz import metadata as md
from commviz.capture import bindings as cb
from commviz.capture import cupti
from commviz.capture.names import kernel_key
from commviz.record import recorder as _rec
from commviz.trace.kernels import parse_nccl

log = logging.getLogger("commviz.capture")

_lock = threading.Lock()
_gids = itertools.count(1)
_by_capture: dict[int, "GraphState"] = {}
_local = threading.local()          # .current: the capture this thread began (no cuda-bindings)
_warned: set[str] = set()


def warn_once(what: str, exc: BaseException | None = None) -> None:
    """Capture problems must never break the user's capture: say it once, carry on."""
    if what not in _warned:
        _warned.add(what)
        log.warning("commviz capture: %s%s", what, f" ({exc!r})" if exc else "")


_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_device = getattr(torch._C, "_cuda_getDevice", None)


def _current_stream() -> int:
    """The current CUDA stream as an int handle (without building a torch Stream object)."""
    if _raw_stream is not None and _device is not None:
        return _raw_stream(_device())
    return torch.cuda.current_stream().cuda_stream


Node = dict[str, Any]   # a kernel node's entry in the record (the dict documented above)


class GraphState:
    """One capture: its record dict, its known kernel nodes, per-lane ordinals."""

    def __init__(self, capture_id: int | None, graph: int | None) -> None:
        self.gid = next(_gids)
        self.capture_id = capture_id
        self.graph = graph
        self.nodes: dict[int, Node] = {}
        self.others: set[int] = set()          # nodes seen that are not kernels
        self.ordinals: Counter = Counter()
        self.replays = 0
        self.exec_pending = True
        self.record: dict[str, Any] = {
            "graph": self.gid, "capture_id": capture_id,
            "cupti_graph_id": cupti.graph_id(graph) if graph else None,
            "exec_ids": [], "tools_exec_ids": [], "t_begin_ns": time.time_ns(), "t_end_ns": None,
            "complete": False, "kernel_count": None, "kernel_names": {}, "replays": 0,
            "nodes": [],
        }
        _rec.RECORDER.graphs.append(self.record)

    def next_ordinal(self, lane: Any) -> int:
        self.ordinals[lane] += 1
        return self.ordinals[lane]

    # -- nodes --------------------------------------------------------------------------------
    def node(self, handle: int) -> Node | None:
        """The kernel node ``handle`` (described and listed on first sight), None if no kernel."""
        known = self.nodes.get(handle)
        if known is not None or handle in self.others:
            return known
        desc = _describe(handle)
        if desc is None:
            self.others.add(handle)
            return None
        return self._add(handle, *desc)

    def _add(self, handle: int, key: str, dims: list[int]) -> Node:
        cid = cupti.node_id(handle)
        entry = {"index": len(self.record["nodes"]), "node": cid,
                 "local": cid & 0xFFFFFFFF if cid is not None else None,
                 "tools": cb.tools_id(handle), "kernel": key, "dims": dims,
                 "after": [], "lane": None, "ordinal": None, "op": None, "marks": [],
                 "mark_lane": None}
        self.record["nodes"].append(entry)
        self.nodes[handle] = entry
        return entry

    # -- end of capture -----------------------------------------------------------------------
    def finalize(self) -> None:
        """Read the whole graph once (still capturing): fingerprint and dependency order."""
        if self.graph is None or not cb.available() or self.record["complete"]:
            return
        if not any(n["ordinal"] is not None or n["marks"] for n in self.nodes.values()):
            return                  # nothing to match in this graph: spare its capture the scan
        all_nodes = cb.nodes(self.graph)
        names: Counter = Counter()
        keys: dict[int, tuple[str, list[int]]] = {}
        others = self.others
        for handle in all_nodes:
            if handle in others:
                continue
            known = self.nodes.get(handle)
            desc = (known["kernel"], known["dims"]) if known else _describe(handle)
            if desc is not None:
                keys[handle] = desc
                names[desc[0]] += 1
        labelled = {n["kernel"] for n in self.nodes.values()
                    if n["ordinal"] is not None or n["marks"]}
        relevant = {h for h, (key, _) in keys.items() if key in labelled}
        for h in relevant:
            if h not in self.nodes:
                self._add(h, *keys[h])
        listed, after = dependency_order(all_nodes, cb.edges(self.graph), relevant)
        entries = []
        for i, h in enumerate(listed):
            entry = self.nodes[h]
            entry["index"] = i
            entry["after"] = after[h]
            entries.append(entry)
        self.record["nodes"] = entries
        self.record["kernel_count"] = sum(names.values())
        self.record["kernel_names"] = dict(names)
        self.record["complete"] = True

    def note_exec(self, cuda_graph: Any) -> None:
        """Add the exec graph's ids once ``cuda_graph`` is instantiated."""
        try:
            handle = int(cuda_graph.raw_cuda_graph_exec())
        except Exception:  # not instantiated yet (keep_graph=True), or an older torch
            return
        if not handle:
            return
        self.exec_pending = False
        eid = cupti.exec_id(handle)
        if eid is not None and eid not in self.record["exec_ids"]:
            self.record["exec_ids"].append(eid)
        if cb.available():
            tid = cb.exec_tools_id(handle)
            if tid is not None and tid not in self.record["tools_exec_ids"]:
                self.record["tools_exec_ids"].append(tid)


def _describe(handle: int) -> tuple[str, list[int]] | None:
    """(kernel key, launch dims) of a kernel node; None for any other node."""
    desc = cb.kernel(handle)
    return None if desc is None else (kernel_key(desc[0]), desc[1])


def dependency_order(all_nodes: list[int], edges: list[tuple[int, int]], listed: set[int]
                     ) -> tuple[list[int], dict[int, list[int]]]:
    """The ``listed`` nodes in a topological order of the graph (ties: the graph's own node
    order), and for each the positions (in that list) of the nearest listed nodes it depends on,
    through any number of unlisted nodes."""
    preds: dict[int, list[int]] = {h: [] for h in all_nodes}
    succs: dict[int, list[int]] = {h: [] for h in all_nodes}
    for a, b in edges:
        if a in preds and b in preds:
            preds[b].append(a)
            succs[a].append(b)
    waiting = {h: len(preds[h]) for h in all_nodes}
    heap = [(i, h) for i, h in enumerate(all_nodes) if not waiting[h]]
    heapq.heapify(heap)
    rank = {h: i for i, h in enumerate(all_nodes)}
    nearest: dict[int, frozenset[int]] = {}
    order: list[int] = []
    while heap:
        _, h = heapq.heappop(heap)
        ps = preds[h]
        if len(ps) == 1:                       # the common case: share the set, build nothing
            p = ps[0]
            nearest[h] = frozenset((p,)) if p in listed else nearest[p]
        else:
            acc: set[int] = set()
            for p in ps:
                if p in listed:
                    acc.add(p)
                else:
                    acc |= nearest[p]
            nearest[h] = frozenset(acc)
        if h in listed:
            order.append(h)
        for s in succs[h]:
            waiting[s] -= 1
            if not waiting[s]:
                heapq.heappush(heap, (rank[s], s))
    position = {h: i for i, h in enumerate(order)}
    return order, {h: sorted(position[p] for p in nearest[h]) for h in order}


# -- which capture is this? -------------------------------------------------------------------
def state_for(info: cb.CaptureInfo | None) -> GraphState:
    """The state of the capture ``info`` describes (created on first sight)."""
    if info is None:                       # no cuda-bindings: the capture this thread began
        state = getattr(_local, "current", None)
        if state is None:
            state = _local.current = GraphState(None, None)
        return state
    state = _by_capture.get(info.capture_id)
    if state is not None:
        return state
    with _lock:
        state = _by_capture.get(info.capture_id)
        if state is None:
            state = _by_capture[info.capture_id] = GraphState(info.capture_id, info.graph)
        return state


def current_capture() -> tuple[GraphState, cb.CaptureInfo | None]:
    info = cb.capture_info(_current_stream()) if cb.available() else None
    return state_for(info), info


def forget(state: GraphState) -> None:
    with _lock:
        if state.capture_id is not None:
            _by_capture.pop(state.capture_id, None)
    if getattr(_local, "current", None) is state:
        _local.current = None


# -- regions: the frontier walk ---------------------------------------------------------------
class Region:
    """A frontier snapshot: the capturing stream's last nodes and their dependents at entry."""

    __slots__ = ("state", "frontier", "known", "roots")

    def __init__(self, state: GraphState, info: cb.CaptureInfo | None) -> None:
        self.state = state
        self.frontier = info.frontier if info is not None else []
        self.known = {n: set(cb.dependents(n)) for n in self.frontier}
        # first work of the capture: nothing to walk from, new roots are the new nodes
        self.roots = set(cb.roots(state.graph)) if info is not None and not self.frontier \
            else None

    def new_kernels(self) -> list[Node]:
        """Kernel nodes added since the snapshot, in discovery order."""
        state = self.state
        if state.graph is None:
            return []
        if self.roots is not None:
            start = [n for n in cb.roots(state.graph) if n not in self.roots]
            seen = set(start)
            stack = list(start)
            found = list(start)
        else:
            seen = set(self.frontier)
            stack = list(self.frontier)
            found = []
        known = self.known
        while stack:
            n = stack.pop()
            old = known.get(n)
            for d in cb.dependents(n):
                if d in seen or (old is not None and d in old):
                    continue
                seen.add(d)
                found.append(d)
                stack.append(d)
        out = []
        for handle in found:
            node = state.node(handle)
            if node is not None:
                out.append(node)
        return out


def open_region() -> Region:
    state, info = current_capture()
    return Region(state, info)


def label_collective(region: Region, meta: dict[str, Any], lane: Any, ordinal: int
                     ) -> list[Node]:
    """Label the region's NCCL kernels (all its kernels when it has none) as this collective."""
    kernels = region.new_kernels()
    nccl = [n for n in kernels if parse_nccl(n["kernel"]) is not None]
    chosen = nccl or kernels
    for n in chosen:
        n["lane"] = lane
        n["ordinal"] = ordinal
        n["op"] = meta.get(md.OP)
    return chosen


def label_mark(region: Region, name: str, lane: Any) -> list[Node]:
    kernels = region.new_kernels()
    for n in kernels:
        n["marks"].insert(0, name)               # outer marks close last: they go first
        if lane is not None and n["mark_lane"] is None:         # the innermost lane wins
            n["mark_lane"] = lane
    return kernels
