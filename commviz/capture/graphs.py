"""Capture records: one per CUDA graph capture, saying which node is which collective or mark.

A capture gets a small commviz graph id (``commviz.graph``, 1, 2, ... per process). Its regions
(one annotated collective, one ``commviz.mark`` block) find their nodes in one of two ways:

- a synchronous collective notes the capturing stream's frontier as it returns (``pending``);
  its kernel is the newest NCCL kernel that frontier depends on, created since the previous
  such return on the stream, worked out from the whole graph after the capture;
- other regions snapshot the frontier on entry and, on exit, walk only the dependent edges
  added since (``Region``): the cost is proportional to the nodes the region added.

Capture time is what users wait for, so the end of capture (``capture_end`` of
``torch.cuda.CUDAGraph``, still inside the capture) only reads what the live graph alone can
tell (``read``: nodes, edges, kernel names and dims, node ids that cannot be computed; one C++
call, ``bindings.read``); even the boundary kernel's calls stay where it noted them. The
record is finished later (``resolve``, run before records are written): those calls placed in
their graph, the deferred collectives' kernels, every kernel's name (the replay fingerprint),
the order of the kernels the matcher has to tell apart with the nearest such kernels each one
depends on, and their CUPTI node ids. After instantiation the exec graph's CUPTI id is added:
replayed kernels carry it (torch >= 2.12).

The record (``RECORDER.graphs``) is a plain dict::

    {"graph": 1, "capture_id": int|None, "cupti_graph_id": int|None, "exec_ids": [int],
     "tools_exec_ids": [int], "t_begin_ns": int, "t_end_ns": int|None,
     "complete": bool,                  # resolved: "after", "kernel_names" are whole-graph
                                        # (never for graphs without collectives or marks)
     "kernel_count": int|None, "kernel_names": {kernel key: count},
     "replays": int,                    # replays seen by the replay hook so far
     "unresolved": int,                 # collectives among whose kernels were NCCL kernels
                                        # no annotated call launched (left unlabelled), or
                                        # whose graph could not be read in creation order
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
from commviz.kernels import incompatibility, is_sendrecv, parse_nccl

log = logging.getLogger("commviz.capture")


class Captures:
    """The process's capture state in one place: the captures open (by capture id, or the one
    this thread began where no backend can read capture ids), the ones read at capture end
    whose records are not finished yet (``ended`` by capture id: the boundary kernel's calls
    are handed to them later), and the capture problems already reported."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.gids = itertools.count(1)
        self.open: dict[int, "GraphState"] = {}
        self.ended: dict[int, "GraphState"] = {}
        self.local = threading.local()      # .current: the capture this thread began
        self.unresolved: list["GraphState"] = []
        self.warned: set[str] = set()


CAPTURES = Captures()


def warn_once(what: str, exc: BaseException | None = None) -> None:
    """Capture problems must never break the user's capture: say it once, carry on."""
    if what not in CAPTURES.warned:
        CAPTURES.warned.add(what)
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
        self.gid = next(CAPTURES.gids)
        self.capture_id = capture_id
        self.graph = graph
        self.nodes: dict[int, Node] = {}
        self.others: set[int] = set()          # nodes seen that are not kernels
        self.ordinals: Counter = Counter()
        self.p2p_calls = 0                      # p2p calls placed: coalesced ones own no node
        # synchronous collectives: (compact record, the previous such exit frontier on its
        # stream, its own exit frontier); ``last_exit``: that previous frontier, per stream
        self.pending: list[tuple[list[Any], list[int], list[int]]] = []
        self.last_exit: dict[int, list[int]] = {}
        # synchronous collectives the boundary kernel recorded, not placed yet: its notes
        # (``Recorder.take_captured``), all later than every call in ``pending``
        self.native: list[tuple[Any, ...]] = []
        # what ``read`` took off the graph, and the CUPTI ids and toolsIds of its kernels
        self.raw: tuple[cb.GraphRead, dict[int, int] | None] | None = None
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

    def place(self, rec: list[Any]) -> None:
        """Give the collective ``rec`` this graph and its ordinal in it on its lane."""
        ordinals, lane = self.ordinals, rec[md.R_INFO].lane
        ordinals[lane] += 1
        rec[md.R_GRAPH] = self.gid
        rec[md.R_ORDINAL] = ordinals[lane]
        if rec[md.R_KIND] == "p2p":
            self.p2p_calls += 1

    def returned(self, rec: list[Any], stream: int, frontier: list[int]) -> None:
        """A synchronous collective returned with its stream waiting on ``frontier``: its
        kernels are found after the capture, among those created since the previous such
        return on the stream."""
        if self.graph is not None:
            last = self.last_exit
            self.pending.append((rec, last.get(stream, ()), frontier))
            last[stream] = frontier

    def place_native(self) -> None:
        """Place the kernel's notes (``native``) as records, after everything placed before."""
        notes, self.native = self.native, []
        record = _rec.RECORDER.captured_record
        for note in notes:
            rec = record(note[:6])
            self.place(rec)
            self.returned(rec, note[8], note[9])

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
    def read(self) -> None:
        """At capture end (still capturing), read what only the live graph can tell: its nodes
        and edges, each kernel's name and dims, and node ids where they cannot be computed.
        The rest is plain Python on these lists and waits for ``resolve`` (records are resolved
        before they are written), so the capture does not pay for it, nor for handing it the
        boundary kernel's calls (``adopt_native``)."""
        native = self._native_waiting()
        if self.raw is None and self._worth_reading(native):
            # what a synchronous collective's stream waited on is nearly always its kernel
            likely = {h for _, _, after in self.pending for h in after}
            likely.update(h for note in self.native for h in note[9])
            got = cb.read(self.graph, likely)
            self.raw = (got, self._read_ids(got))
        if self.raw is not None or self.native or native:   # the calls are placed then too
            with CAPTURES.lock:
                if self not in CAPTURES.unresolved:
                    CAPTURES.unresolved.append(self)

    def _native_waiting(self) -> bool:
        """Whether the boundary kernel holds calls of this capture, not handed over yet."""
        native = _rec.RECORDER.native
        return self.capture_id is not None and native is not None and \
            native.has_captured(self.capture_id)

    def _worth_reading(self, native: bool) -> bool:
        """A graph to read: readable, and with collectives or marks in it to match."""
        if self.graph is None or not cb.available() or self.record["complete"]:
            return False
        return bool(native or self.pending or self.native) or any(
            n["ordinal"] is not None or n["marks"] for n in self.nodes.values())

    def _read_ids(self, got: cb.GraphRead) -> dict[int, int] | None:
        """The CUPTI ids of the kernel nodes; None when they can be computed: CUPTI numbers a
        graph's nodes in creation order, the order the graph lists them in, so when a few real
        queries agree the rest follow from the node's place in the list."""
        base, nodes, kernels = self.record["cupti_graph_id"], got.nodes, got.kernels
        samples = {kernels[0], kernels[len(kernels) // 2], kernels[-1]} if kernels else set()
        if base is not None and all(cupti.node_id(nodes[i]) == (base << 32) | i
                                    for i in samples):
            return None
        return {nodes[i]: cupti.node_id(nodes[i]) for i in kernels}

    def resolve(self) -> None:
        """Finish the record from what ``read`` took off the graph: the synchronous
        collectives' kernels, the fingerprint, the dependency order, every listed node's ids."""
        self.place_native()
        raw, self.raw = self.raw, None
        if raw is None:
            return
        got, ids = raw
        nodes = got.nodes.tolist() if isinstance(got.nodes, memoryview) else list(got.nodes)
        graph = _Graph(nodes, got.edges())
        descs = got.descs()
        tools = dict(zip((nodes[i] for i in got.kernels), got.tools)) \
            if got.tools is not None else None
        known = self.nodes
        keys = {h: (n["kernel"], n["dims"]) for h, n in known.items()}
        for handle, (name, dims) in descs.items():
            if handle not in keys:
                keys[handle] = (kernel_key(name), dims)
        names = Counter(key for key, _ in keys.values())
        if self.pending:
            self._label_pending(graph, keys)
        labelled = {n["kernel"] for n in known.values() if n["ordinal"] is not None or n["marks"]}
        relevant = {h for h, (key, _) in keys.items() if key in labelled}
        for h in relevant:
            if h not in known:
                self._add(h, *keys[h])
        listed, after = graph.dependency_order(relevant)
        base, position = self.record["cupti_graph_id"], graph.position
        entries = []
        for i, h in enumerate(listed):
            entry = known[h]
            cid = ids.get(h) if ids is not None else (base << 32) | position[h]
            entry.update(index=i, after=after[h], node=cid, tools=tools.get(h) if tools else None,
                         local=cid & 0xFFFFFFFF if cid is not None else None)
            entries.append(entry)
        self.record["nodes"] = entries
        self.record["kernel_count"] = sum(names.values())
        self.record["kernel_names"] = dict(names)
        self.record["complete"] = True
        for holder, claimed in self.claims:
            _publish(holder, [n["node"] for n in claimed if n["node"] is not None])
        self.claims = []

    def _label_pending(self, graph: "_Graph", keys: dict[int, tuple[str, list[int]]]) -> None:
        """Label each synchronous collective's kernels: the NCCL kernels its exit frontier
        depends on that were created after the previous such exit on its stream (walked back
        from the exit frontier, so the cost is the nodes since then). The collective's own
        kernel is the newest of those whose type, dtype and reduction fit it: it was launched
        after everything before its call. Others (work another path launched on the
        communicator meanwhile) stay unlabelled, as does everything of a call for which NCCL
        launches no kernel (zero elements, a one-rank group)."""
        pending, self.pending = self.pending, []
        if not graph.creation:
            self.record["unresolved"] += len(pending)
            self.claims.extend((item[0], []) for item in pending)
            warn_once("the graph lists its nodes out of creation order: synchronous "
                      "collectives were left unlabelled")
            return
        position, preds = graph.position, graph.preds
        claimed = {h for h, n in self.nodes.items() if n["ordinal"] is not None}
        for rec, before, exit_ in pending:
            floor = max((position.get(f, -1) for f in before), default=-1)
            launches = _launches_kernel(rec)
            if len(exit_) == 1 and launches:
                # the common case: the stream now waits on one new NCCL kernel, the newest of
                # the region's kernels, so the one the rule below would pick
                last = exit_[0]
                desc = keys.get(last)
                if desc is not None and position.get(last, -1) > floor and \
                        last not in claimed and _fits_call(desc[0], rec):
                    claimed.add(last)
                    self.claims.append((rec, [self._label(last, desc, rec)]))
                    continue
            stack = [n for n in exit_ if position.get(n, -1) > floor]
            seen = set(stack)
            nccl, other = [], []
            while stack:
                n = stack.pop()
                desc = keys.get(n)
                if desc is not None and n not in claimed:
                    (nccl if _is_nccl(desc[0]) else other).append(n)
                for p in preds.get(n, ()):
                    if p not in seen and position[p] > floor:
                        seen.add(p)
                        stack.append(p)
            fitting = [n for n in nccl if _fits_call(keys[n][0], rec)]
            # a coalesced p2p group's SendRecv kernel (NCCL launches it as the group ends, for
            # no call) is expected where the capture holds p2p calls: the matcher names it
            strays = [n for n in nccl if not (self.p2p_calls and is_sendrecv(keys[n][0]))]
            if len(strays) > (1 if fitting and launches else 0):
                self.record["unresolved"] += 1
                warn_once("NCCL kernels that no annotated call launched were found among a "
                          "collective's: they stay unlabelled")
            if not launches:
                chosen = []                            # no NCCL kernel of its own to find
            elif fitting:
                chosen = [max(fitting, key=position.__getitem__)]
            elif "nccl" in rec[md.R_INFO].backend:
                chosen = []
            else:                                      # another backend's kernels
                chosen = [n for n in other if not self.nodes.get(n, {}).get("marks")]
            claimed.update(chosen)
            self.claims.append((rec, [self._label(h, keys[h], rec) for h in chosen]))

    def _label(self, handle: int, desc: tuple[str, list[int]], rec: list[Any]) -> Node:
        """The node ``handle`` labelled as the collective ``rec``."""
        node = self.nodes.get(handle) or self._add(handle, *desc)
        node["lane"], node["ordinal"], node["op"] = \
            rec[md.R_INFO].lane, rec[md.R_ORDINAL], rec[md.R_OP]
        return node

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


_nccl_keys: dict[str, bool] = {}
_fits: dict[tuple[str, str, str, Any], bool] = {}


def _is_nccl(key: str) -> bool:
    """Whether a kernel key names an NCCL kernel (a graph repeats a few keys many times)."""
    known = _nccl_keys.get(key)
    if known is None:
        known = _nccl_keys[key] = parse_nccl(key) is not None
    return known


def _fits_call(key: str, rec: list[Any]) -> bool:
    """Whether the NCCL kernel ``key`` can be the collective ``rec``: its collective type,
    dtype and reduction agree (``incompatibility``, as the matcher checks them)."""
    extra = rec[md.R_EXTRA]
    sig = (key, rec[md.R_OP], rec[md.R_DTYPE], extra.get(md.REDUCE_OP) if extra else None)
    fits = _fits.get(sig)
    if fits is None:
        kernel = parse_nccl(key)
        fits = _fits[sig] = kernel is not None and incompatibility(kernel, {
            md.COLLECTIVE_NAME: md.COLLECTIVE_NAMES.get(sig[1], sig[1]), md.DTYPE: sig[2],
            md.REDUCE_OP: sig[3]}) is None
    return fits


def _launches_kernel(rec: list[Any]) -> bool:
    """Whether NCCL launches a kernel of its own for ``rec``: not for zero elements, and not
    in a one-rank group (NCCL copies locally, outside its collective kernels)."""
    return bool(rec[md.R_IN] or rec[md.R_OUT]) and len(rec[md.R_INFO].ranks) > 1


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
        nearest: dict[int, tuple[int, ...]] = {}
        order: list[int] = []
        for h in self.topological():
            ps = preds.get(h)
            if not ps:
                nearest[h] = ()
            elif len(ps) == 1:                 # the common case: share the tuple
                p = ps[0]
                nearest[h] = (p,) if p in listed else nearest[p]
            else:
                acc: dict[int, None] = {}
                for p in ps:
                    if p in listed:
                        acc[p] = None
                    else:
                        acc.update(dict.fromkeys(nearest[p]))
                nearest[h] = tuple(acc)
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
    if info is None or info.capture_id is None:   # no backend: the capture this thread began
        state = getattr(CAPTURES.local, "current", None)
        if state is None:
            state = CAPTURES.local.current = GraphState(None, None)
        return state
    state = CAPTURES.open.get(info.capture_id) or CAPTURES.ended.get(info.capture_id)
    if state is not None:
        return state
    with CAPTURES.lock:
        state = CAPTURES.open.get(info.capture_id) or CAPTURES.ended.get(info.capture_id)
        if state is None:
            state = CAPTURES.open[info.capture_id] = GraphState(info.capture_id, info.graph)
        return state


def adopt_native() -> None:
    """Hand each capture the synchronous collectives the boundary kernel recorded in it since
    the last call (the kernel read each one's frontier as it returned), in call order: before
    the records are resolved, or before a call is placed in its graph by Python (``region``).
    They are placed later (``place_native``)."""
    last_id, state = None, None
    for note in _rec.RECORDER.take_captured():
        capture_id = note[6]
        if not capture_id:          # the capture was over: the record says "captured" only
            continue
        if capture_id != last_id:
            last_id = capture_id
            state = state_for(cb.CaptureInfo(capture_id, note[7], note[9], note[8]))
        state.native.append(note)


def current_capture() -> tuple[GraphState, cb.CaptureInfo | None]:
    info = cb.capture_info(_current_stream()) if cb.available() else None
    return state_for(info), info


def resolve_all() -> None:
    """Finish every capture record still waiting (before records are written or read)."""
    adopt_native()
    with CAPTURES.lock:
        waiting = list(CAPTURES.unresolved)
        CAPTURES.unresolved.clear()
        for state in waiting:
            if state.capture_id is not None:
                CAPTURES.ended.pop(state.capture_id, None)
    for state in waiting:
        try:
            state.resolve()
        except Exception as exc:  # a broken record must not stop the others being written
            warn_once("could not resolve a captured graph's record", exc)


_rec.RECORDER.before_payload.append(resolve_all)


def forget(state: GraphState) -> None:
    """The capture ``state`` ended: no longer open, but found by its id until it is resolved
    (the boundary kernel's calls in it are handed to it then)."""
    with CAPTURES.lock:
        if state.capture_id is not None:
            CAPTURES.open.pop(state.capture_id, None)
            if state in CAPTURES.unresolved:
                CAPTURES.ended[state.capture_id] = state
    if getattr(CAPTURES.local, "current", None) is state:
        CAPTURES.local.current = None


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
    nccl = [n for n in kernels if _is_nccl(n["kernel"])]
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
