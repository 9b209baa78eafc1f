"""Capture records: one per CUDA graph capture, saying which node is which collective or mark.

A capture gets a small commviz graph id (``commviz.graph``, 1, 2, ... per process). Its regions
(one annotated collective, one ``commviz.mark`` block) find their nodes in one of two ways:

- a synchronous collective notes the capturing stream's frontier at entry and at exit
  (``defer``); when the capture ends its kernels are the nodes the exit frontier depends on
  that were created after the entry frontier, read from the whole graph in one pass;
- other regions snapshot the frontier on entry and, on exit, walk only the dependent edges
  added since (``Region``): the cost is proportional to the nodes the region added.

When the capture ends (``capture_end`` of ``torch.cuda.CUDAGraph``, still inside the capture),
``finalize`` reads the whole graph once: it resolves the deferred collectives, names every
kernel (the replay fingerprint), orders the kernels the matcher has to tell apart with the
nearest such kernels each one depends on, and gives each its CUPTI node id. After
instantiation the exec graph's CUPTI id is added: replayed kernels carry it (torch >= 2.12).

The record (``RECORDER.graphs``) is a plain dict::

    {"graph": 1, "capture_id": int|None, "cupti_graph_id": int|None, "exec_ids": [int],
     "tools_exec_ids": [int], "t_begin_ns": int, "t_end_ns": int|None,
     "complete": bool,                  # finalize ran: "after", "kernel_names" are whole-graph
                                        # (it does not for graphs without collectives or marks)
     "kernel_count": int|None, "kernel_names": {kernel key: count},
     "replays": int,                    # replays seen by the replay hook so far
     "unresolved": int,                 # collectives whose kernels could not be told apart
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
    """One capture: its record dict, its known kernel nodes, per-lane ordinals, and the regions
    whose nodes are resolved when the capture ends."""

    def __init__(self, capture_id: int | None, graph: int | None) -> None:
        self.gid = next(_gids)
        self.capture_id = capture_id
        self.graph = graph
        self.nodes: dict[int, Node] = {}
        self.others: set[int] = set()          # nodes seen that are not kernels
        self.ordinals: Counter = Counter()
        # synchronous collectives: (compact record, frontier at entry, frontier at exit)
        self.pending: list[tuple[list[Any], list[int], list[int]]] = []
        # who gets which nodes' ids once they are known: a compact record or a mark's dict
        self.claims: list[tuple[Any, list[Node]]] = []
        self.replays = 0
        self.exec_pending = True
        self.record: dict[str, Any] = {
            "graph": self.gid, "capture_id": capture_id,
            "cupti_graph_id": cupti.graph_id(graph) if graph else None,
            "exec_ids": [], "tools_exec_ids": [], "t_begin_ns": time.time_ns(), "t_end_ns": None,
            "complete": False, "kernel_count": None, "kernel_names": {}, "replays": 0,
            "unresolved": 0, "nodes": [],
        }
        _rec.RECORDER.graphs.append(self.record)

    def next_ordinal(self, lane: Any) -> int:
        self.ordinals[lane] += 1
        return self.ordinals[lane]

    def defer(self, rec: list[Any], entry: list[int], exit: list[int]) -> None:  # noqa: A002
        """A synchronous collective's frontiers: its nodes are found when the capture ends."""
        self.pending.append((rec, entry, exit))

    def claim(self, holder: Any, nodes: list[Node]) -> None:
        """``holder`` (a compact record or a mark's dict) gets these nodes' ids at the end."""
        self.claims.append((holder, nodes))

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
        entry = {"index": len(self.record["nodes"]), "node": None, "local": None,
                 "tools": None, "kernel": key, "dims": dims, "after": [], "lane": None,
                 "ordinal": None, "op": None, "marks": [], "mark_lane": None}
        self.record["nodes"].append(entry)
        self.nodes[handle] = entry
        return entry

    # -- end of capture -----------------------------------------------------------------------
    def finalize(self) -> None:
        """Read the whole graph once (still capturing): the synchronous collectives' nodes, the
        fingerprint, the dependency order and the CUPTI ids of every listed node."""
        if self.graph is None or not cb.available() or self.record["complete"]:
            return
        if not self.pending and not any(n["ordinal"] is not None or n["marks"]
                                        for n in self.nodes.values()):
            return                  # nothing to match in this graph: spare its capture the scan
        graph = _Graph(cb.nodes(self.graph), cb.edges(self.graph))
        names: Counter = Counter()
        keys: dict[int, tuple[str, list[int]]] = {}
        known, others = self.nodes, self.others
        for handle in graph.nodes:
            if handle in others:
                continue
            entry = known.get(handle)
            desc = (entry["kernel"], entry["dims"]) if entry is not None else _describe(handle)
            if desc is not None:
                keys[handle] = desc
                names[desc[0]] += 1
        if self.pending:
            self._resolve(graph, keys)
        labelled = {n["kernel"] for n in known.values() if n["ordinal"] is not None or n["marks"]}
        relevant = {h for h, (key, _) in keys.items() if key in labelled}
        for h in relevant:
            if h not in known:
                self._add(h, *keys[h])
        listed, after = graph.dependency_order(relevant)
        entries = []
        for i, h in enumerate(listed):
            entry = known[h]
            entry["index"] = i
            entry["after"] = after[h]
            entries.append(entry)
        self._identify(listed, graph.position)
        self.record["nodes"] = entries
        self.record["kernel_count"] = sum(names.values())
        self.record["kernel_names"] = dict(names)
        self.record["complete"] = True
        for holder, nodes in self.claims:
            _publish(holder, [n["node"] for n in nodes if n["node"] is not None])

    def _resolve(self, graph: "_Graph", keys: dict[int, tuple[str, list[int]]]) -> None:
        """Label each synchronous collective's kernels: the nodes its exit frontier depends on
        that were created after its entry frontier (walked back from the exit frontier, so the
        cost is the region's own nodes). Several NCCL kernels in one region (work another path
        launched on the same communicator meanwhile) leave all but the last one unlabelled."""
        pending, self.pending = self.pending, []
        if not graph.creation:
            self.record["unresolved"] += len(pending)
            self.claims.extend((rec, []) for rec, _, _ in pending)
            warn_once("the graph lists its nodes out of creation order: synchronous "
                      "collectives were left unlabelled")
            return
        position, preds = graph.position, graph.preds
        claimed = {h for h, n in self.nodes.items() if n["ordinal"] is not None}
        for rec, entry, exit_ in pending:
            floor = max(position.get(f, -1) for f in entry)
            stack = [n for n in exit_ if position.get(n, -1) > floor]
            seen = set(stack)
            nccl, other = [], []
            while stack:
                n = stack.pop()
                desc = keys.get(n)
                if desc is not None and n not in claimed:
                    (nccl if parse_nccl(desc[0]) is not None else other).append(n)
                for p in preds.get(n, ()):
                    if p not in seen and position[p] > floor:
                        seen.add(p)
                        stack.append(p)
            info = rec[md.R_INFO]
            if not rec[md.R_IN] and not rec[md.R_OUT]:
                chosen = []                            # nothing to move: no kernel of its own
            elif nccl:
                chosen = [max(nccl, key=position.__getitem__)]
                if len(nccl) > 1:
                    self.record["unresolved"] += 1
                    warn_once("a collective's region held several NCCL kernels: only the last "
                              "was labelled")
            elif "nccl" in info.backend:
                chosen = []
            else:                                      # another backend's kernels
                chosen = [n for n in other if not self.nodes.get(n, {}).get("marks")]
            nodes = []
            for h in chosen:
                node = self.nodes.get(h) or self._add(h, *keys[h])
                node["lane"], node["ordinal"], node["op"] = \
                    info.lane, rec[md.R_ORDINAL], rec[md.R_OP]
                claimed.add(h)
                nodes.append(node)
            self.claims.append((rec, nodes))

    def _identify(self, listed: list[int], position: dict[int, int]) -> None:
        """CUPTI ids of the listed nodes. CUPTI numbers a graph's nodes in creation order, the
        order the graph lists them in: when a few real queries agree, the rest are computed."""
        base = self.record["cupti_graph_id"]
        computed = base is not None and bool(listed) and all(
            cupti.node_id(h) == (base << 32) | position[h]
            for h in {listed[0], listed[len(listed) // 2], listed[-1]})
        for h in listed:
            cid = (base << 32) | position[h] if computed else cupti.node_id(h)
            entry = self.nodes[h]
            entry["node"] = cid
            entry["local"] = cid & 0xFFFFFFFF if cid is not None else None
            entry["tools"] = cb.tools_id(h)

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


def _publish(holder: Any, ids: list[int]) -> None:
    """Give a collective's record (and its metadata dict, if built) or a mark its node ids."""
    if isinstance(holder, list):
        holder[md.R_GRAPH_NODES] = ids
        meta = holder[md.R_META]
        if meta is not None:
            meta[md.GRAPH_NODES] = ids
    else:
        holder["nodes"] = ids


def _describe(handle: int) -> tuple[str, list[int]] | None:
    """(kernel key, launch dims) of a kernel node; None for any other node."""
    desc = cb.kernel(handle)
    return None if desc is None else (kernel_key(desc[0]), desc[1])


class _Graph:
    """A whole graph as read once at the end of capture: its nodes in listing order, each
    node's position there, its dependencies, and whether the listing is a creation order
    (every edge points forward: the driver appends nodes as they are captured)."""

    def __init__(self, nodes: list[int], edges: list[tuple[int, int]]) -> None:
        self.nodes = nodes
        self.position = position = {h: i for i, h in enumerate(nodes)}
        self.preds: dict[int, list[int]] = {}
        creation = True
        for a, b in edges:
            if a in position and b in position:
                self.preds.setdefault(b, []).append(a)
                if position[a] > position[b]:
                    creation = False
        self.creation = creation

    def topological(self) -> list[int]:
        """The nodes in a topological order (ties: listing order)."""
        if self.creation:
            return self.nodes
        rank, preds = self.position, self.preds
        succs: dict[int, list[int]] = {}
        waiting = {}
        for h in self.nodes:
            ps = preds.get(h, ())
            waiting[h] = len(ps)
            for p in ps:
                succs.setdefault(p, []).append(h)
        heap = [(rank[h], h) for h in self.nodes if not waiting[h]]
        heapq.heapify(heap)
        order = []
        while heap:
            _, h = heapq.heappop(heap)
            order.append(h)
            for s in succs.get(h, ()):
                waiting[s] -= 1
                if not waiting[s]:
                    heapq.heappush(heap, (rank[s], s))
        return order

    def dependency_order(self, listed: set[int]) -> tuple[list[int], dict[int, list[int]]]:
        """The ``listed`` nodes in topological order, and for each the positions (in that
        list) of the nearest listed nodes it depends on, through any number of unlisted ones."""
        preds = self.preds
        nearest: dict[int, frozenset[int]] = {}
        empty: frozenset[int] = frozenset()
        order: list[int] = []
        for h in self.topological():
            ps = preds.get(h)
            if not ps:
                nearest[h] = empty
            elif len(ps) == 1:                 # the common case: share the set, build nothing
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
        position = {h: i for i, h in enumerate(order)}
        return order, {h: sorted(position[p] for p in nearest[h]) for h in order}


def dependency_order(all_nodes: list[int], edges: list[tuple[int, int]], listed: set[int]
                     ) -> tuple[list[int], dict[int, list[int]]]:
    """``_Graph.dependency_order`` of the graph ``all_nodes`` / ``edges``."""
    return _Graph(all_nodes, edges).dependency_order(listed)


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


def label_collective(region: Region, rec: list[Any]) -> list[Node]:
    """Label the region's NCCL kernels (all its kernels when it has none) as the collective
    ``rec`` (a compact record)."""
    kernels = region.new_kernels()
    nccl = [n for n in kernels if parse_nccl(n["kernel"]) is not None]
    chosen = nccl or kernels
    lane, ordinal, op = rec[md.R_INFO].lane, rec[md.R_ORDINAL], rec[md.R_OP]
    for n in chosen:
        n["lane"] = lane
        n["ordinal"] = ordinal
        n["op"] = op
    return chosen


def label_mark(region: Region, name: str, lane: Any) -> list[Node]:
    kernels = region.new_kernels()
    for n in kernels:
        n["marks"].insert(0, name)               # outer marks close last: they go first
        if lane is not None and n["mark_lane"] is None:         # the innermost lane wins
            n["mark_lane"] = lane
    return kernels
