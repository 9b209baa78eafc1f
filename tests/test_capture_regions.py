"""The capture side on a graph built in Python: which graph nodes each collective and mark owns.

Only the CUDA calls are faked (``FakeCapture`` keeps a graph the way the driver does under
stream capture); the region, graph-record and resolution code is commviz's own. The same code
runs on the H200s in ``test_gpu_graphs.py``.
"""

from __future__ import annotations

import logging
import struct
import sys
from typing import Any, Iterator

import pytest

from commviz import metadata as md
from commviz.capture import bindings, graphs, hooks, region
from commviz.capture.graphs import dependency_order
from commviz.capture.marks import mark
from commviz.capture.names import kernel_key
from commviz.record.recorder import RECORDER


class FakeCapture:
    """A graph under stream capture as the driver keeps it: each stream has a frontier, a new
    node depends on its stream's frontier and replaces it, a wait merges another stream's."""

    def __init__(self) -> None:
        self.order: list[int] = []
        self.preds: dict[int, list[int]] = {}
        self.succs: dict[int, list[int]] = {}
        self.functions: dict[int, tuple[str, list[int]]] = {}
        self.frontier_of: dict[int, list[int]] = {}
        self.current = 1
        self.capture_id = 77
        self.listing = lambda order: list(order)     # how cuGraphGetNodes lists them

    def add(self, stream: int, kernel: str | None = None) -> int:
        node = 0x1000 + 16 * len(self.order)
        self.order.append(node)
        self.preds[node] = list(self.frontier_of.get(stream, []))
        self.succs[node] = []
        for p in self.preds[node]:
            self.succs[p].append(node)
        if kernel is not None:
            self.functions[node] = (kernel, [2, 1, 1, 512, 1, 1])
        self.frontier_of[stream] = [node]
        return node

    def wait(self, stream: int, other: int) -> None:
        """Join ``other``'s work: like the driver, keep only nodes nothing else here follows."""
        merged = list(dict.fromkeys(self.frontier_of.get(stream, []) + self.frontier_of.get(other, [])))
        covered: set[int] = set()
        stack = [p for n in merged for p in self.preds[n]]
        while stack:
            n = stack.pop()
            if n not in covered:
                covered.add(n)
                stack.extend(self.preds[n])
        self.frontier_of[stream] = [n for n in merged if n not in covered]

    # the backend interface of commviz.capture.bindings
    def capture_info(self, stream: int) -> bindings.CaptureInfo:
        return bindings.CaptureInfo(self.capture_id, 0xABC, list(self.frontier_of.get(stream, [])),
                                    stream)

    def dependents(self, node: int) -> list[int]:
        return list(self.succs[node])

    def roots(self, graph: int) -> list[int]:
        return [n for n in self.order if not self.preds[n]]

    def nodes(self, graph: int) -> list[int]:
        return self.listing(self.order)

    def edges(self, graph: int) -> list[tuple[int, int]]:
        return [(p, n) for n in self.order for p in self.preds[n]]

    def kernel(self, node: int) -> tuple[str, list[int]] | None:
        return self.functions.get(node)

    def kernels(self, nodes: list[int], likely: frozenset[int] | set[int] = frozenset()
                ) -> list[tuple[str, list[int]] | None]:
        return [self.kernel(n) for n in nodes]

    def tools_id(self, node: int) -> None:
        return None


AR = "_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE"
BC = "_Z31ncclDevKernel_Broadcast_RING_LL24ncclDevKernelArgsStorageILm4096EE"
AG = "_Z31ncclDevKernel_AllGather_RING_LL24ncclDevKernelArgsStorageILm4096EE"
GEMM = "_ZN2at6native4gemmIfEEvv"
COPY = "_ZN2at6native18elementwise_kernelILi128ELi2EEEviT1_"
S, N_WORLD, N_TP = 1, 2, 3                    # the capture stream, two groups' NCCL streams


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCapture]:
    graph = FakeCapture()
    monkeypatch.setattr(bindings, "_backend", graph)
    monkeypatch.setattr(bindings, "_picked", True)
    monkeypatch.setattr(graphs, "_current_stream", lambda: graph.current)
    monkeypatch.setattr(region, "_capturing", lambda: True)
    monkeypatch.setattr(graphs.cupti, "node_id", lambda h: (1 << 32) | graph.order.index(h))
    monkeypatch.setattr(graphs.cupti, "graph_id", lambda g: 1)
    monkeypatch.setattr(RECORDER, "native", None)     # the boundary kernel: see KernelNotes
    # (the package exports the class ``mark``, which hides the module of the same name)
    monkeypatch.setattr(sys.modules["commviz.capture.marks"], "_capturing", lambda: True)
    was_installed = hooks.installed()
    records = list(RECORDER.graphs)
    yield graph
    if not was_installed:
        hooks.uninstall()
    graphs.CAPTURES.unresolved.clear()
    graphs.CAPTURES.ended.clear()
    for state in list(graphs.CAPTURES.open.values()):
        graphs.forget(state)
    RECORDER.graphs[:] = records


def record(op: str, lane: int, nelems: int = 4096, ranks: int = 2) -> list[Any]:
    """A wrapper's compact record, as ``commviz.collective_annotation.begin`` builds it."""
    rec: list[Any] = [None] * (md.R_REGION + 1)
    rec[md.R_OP], rec[md.R_IN], rec[md.R_OUT] = op, nelems, nelems
    rec[md.R_INFO] = md.GroupInfo(pg=None, name=f"pg{lane}", desc="",
                                  ranks=list(range(ranks)), backend="nccl", lane=lane)
    return rec


def collective(fake: FakeCapture, op: str, lane: int, kernel: str | None, nccl: int, *,
               join: bool = True, tail: str | None = None, nelems: int = 4096,
               ranks: int = 2) -> list[Any]:
    """What ProcessGroupNCCL captures: the NCCL stream waits for the capture stream, runs the
    kernel, and (synchronous ops) the capture stream waits for it; ``tail``: a kernel after
    it on the capture stream (a list all_gather's copies)."""
    rec = record(op, lane, nelems, ranks)
    token = region.enter(rec, walk=not join)
    fake.wait(nccl, S)
    if kernel is not None:
        fake.add(nccl, kernel)
    fake.add(nccl)                               # the work's end event
    if join:
        fake.wait(S, nccl)
    if tail is not None:
        fake.add(S, tail)
    region.exit(token, rec)
    return rec


def end_capture(fake: FakeCapture) -> graphs.GraphState:
    state = graphs.state_for(fake.capture_info(S))
    state.read()                                 # at capture end
    graphs.resolve_all()                         # before records are written
    return state


def kernel_of(fake: FakeCapture, rec: list[Any]) -> list[str]:
    names = {(1 << 32) | fake.order.index(n): k[0] for n, k in fake.functions.items()}
    return [names[n] for n in rec[md.R_GRAPH_NODES]]


def test_regions_find_each_collectives_own_kernels(fake: FakeCapture) -> None:
    """Sync, async and first-in-capture collectives, nested marks, then the end of capture."""
    first = collective(fake, "all_reduce", 10, AR, N_WORLD)      # nothing captured before it
    with mark("outer"):
        fake.add(S, GEMM)
        with mark("inner", stream=61):
            fake.add(S, GEMM)
    pending = collective(fake, "all_reduce", 20, AR, N_TP, join=False)   # async: joined later
    bcast = collective(fake, "broadcast", 10, BC, N_WORLD)
    fake.wait(S, N_TP)                           # work.wait() of the async one
    last = collective(fake, "all_reduce", 20, AR, N_TP)
    state = end_capture(fake)
    for rec, kernel, ordinal in ((first, AR, 1), (pending, AR, 1), (bcast, BC, 2),
                                 (last, AR, 2)):
        assert rec[md.R_GRAPH] == state.gid and rec[md.R_ORDINAL] == ordinal
        assert kernel_of(fake, rec) == [kernel]
    record_ = state.record
    assert record_["complete"] and record_["kernel_count"] == 6 and record_["unresolved"] == 0
    assert record_["kernel_names"] == {"ncclDevKernel_AllReduce_Sum_f32_RING_LL": 3,
                                       "ncclDevKernel_Broadcast_RING_LL": 1,
                                       "at::native::gemm": 2}
    nodes = record_["nodes"]
    assert [n["index"] for n in nodes] == list(range(len(nodes)))
    for n in nodes:                               # each id names the node it describes
        assert n["local"] == n["node"] & 0xFFFFFFFF
        assert kernel_key(fake.functions[fake.order[n["local"]]][0]) == n["kernel"]
    assert [n["node"] for n in nodes] == sorted(n["node"] for n in nodes)   # creation order
    by_label = {(n["lane"], n["ordinal"]): n for n in nodes if n["ordinal"] is not None}
    assert [n["marks"] for n in nodes if n["marks"]] == [["outer"], ["outer", "inner"]]
    assert [n["mark_lane"] for n in nodes if n["marks"]] == [None, 61]
    assert [m["nodes"] for m in RECORDER.marks[-2:]] == [           # inner ends first
        [nodes[2]["node"]], [nodes[1]["node"], nodes[2]["node"]]]
    # the dependency order the matcher relies on: the async all_reduce is not after the
    # broadcast, the last all_reduce is after both
    pos = {key: n["index"] for key, n in by_label.items()}
    assert pos[(10, 2)] not in by_label[(20, 1)]["after"]
    assert {pos[(20, 1)], pos[(10, 2)]} <= set(by_label[(20, 2)]["after"])


def test_copies_after_the_collective_are_not_its_kernel(fake: FakeCapture) -> None:
    fake.add(S, GEMM)
    gather = collective(fake, "all_gather", 10, AG, N_WORLD, tail=COPY)
    end_capture(fake)
    assert kernel_of(fake, gather) == [AG]


def test_foreign_kernel_on_the_same_communicator_is_never_taken(
        fake: FakeCapture, caplog: pytest.LogCaptureFixture) -> None:
    """A kernel launched on the collective's NCCL stream by code commviz does not see (torch's
    C++ callers, an unpatched call) lies between the frontiers: it is never labelled. A call
    for which NCCL launches no kernel (zero elements, a one-rank group) takes nothing, and no
    call takes a kernel of another collective type, even one its stream waited on."""
    caplog.set_level(logging.WARNING, logger="commviz.capture")
    graphs.CAPTURES.warned.clear()

    def foreign_kernel() -> int:
        fake.add(S, GEMM)
        fake.wait(N_WORLD, S)
        return fake.add(N_WORLD, AR)             # not annotated, not waited for

    collective(fake, "all_reduce", 10, AR, N_WORLD)
    foreign = [foreign_kernel()]
    after = collective(fake, "all_reduce", 10, AR, N_WORLD)
    foreign.append(foreign_kernel())
    empty = collective(fake, "all_reduce", 10, None, N_WORLD, nelems=0)
    foreign.append(foreign_kernel())
    alone = collective(fake, "all_reduce", 10, None, N_WORLD, ranks=1)
    foreign.append(foreign_kernel())
    bcast = record("broadcast", 10)              # launches nothing: its stream then waits on
    token = region.enter(bcast, walk=False)      # the all_reduce NCCL's stream ran last
    fake.wait(N_WORLD, S)
    fake.wait(S, N_WORLD)
    assert fake.frontier_of[S] == [foreign[-1]]
    region.exit(token, bcast)
    state = end_capture(fake)
    assert kernel_of(fake, after) == [AR]
    assert empty[md.R_GRAPH_NODES] == alone[md.R_GRAPH_NODES] == bcast[md.R_GRAPH_NODES] == []
    listed = {n["local"]: n for n in state.record["nodes"]}
    for handle in foreign:                       # listed (same kernel), never labelled
        assert listed[fake.order.index(handle)]["ordinal"] is None
    assert state.record["unresolved"] == 4
    assert "no annotated call launched" in caplog.text


def test_records_are_finished_before_they_are_written(fake: FakeCapture) -> None:
    """The capture pays only for reading the graph; the record is finished on its way out."""
    rec = collective(fake, "all_reduce", 10, AR, N_WORLD)
    state = graphs.state_for(fake.capture_info(S))
    state.read()
    assert not state.record["complete"] and rec[md.R_GRAPH_NODES] is None
    payload = RECORDER.payload("explicit")
    assert state.record in payload["graphs"] and state.record["complete"]
    assert kernel_of(fake, rec) == [AR]


def test_listing_out_of_creation_order_labels_nothing(fake: FakeCapture) -> None:
    fake.listing = lambda order: list(reversed(order))
    fake.add(S, GEMM)
    rec = collective(fake, "all_reduce", 10, AR, N_WORLD)
    state = end_capture(fake)
    assert rec[md.R_GRAPH_NODES] == [] and state.record["unresolved"] == 1


def test_dependency_order_keeps_nearest_listed_ancestors() -> None:
    # 1 -> 2 -> 3 -> 5 and 1 -> 4 -> 5; only 1, 3, 5 are listed (2, 4 are other nodes)
    order, after = dependency_order([5, 4, 3, 2, 1], [(1, 2), (2, 3), (1, 4), (4, 5), (3, 5)],
                                    {1, 3, 5})
    assert order == [1, 3, 5]
    assert after == {1: [], 3: [0], 5: [0, 1]}
    assert dependency_order([1, 2, 3, 4, 5], [(1, 2), (2, 3), (1, 4), (4, 5), (3, 5)],
                            {1, 3, 5}) == (order, after)
    assert dependency_order([7, 8], [], {7, 8}) == ([7, 8], {7: [], 8: []})


def test_kernel_parameters_unpack_as_the_driver_lays_them_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The end-of-capture read unpacks CUDA_KERNEL_NODE_PARAMS_v2 in one go: same fields as
    ctypes reads them one by one, for a function handle and for a library kernel handle."""
    params = bindings._Driver.Params(gridDimX=3, gridDimY=2, gridDimZ=1, blockDimX=512,
                                     blockDimY=1, blockDimZ=1, sharedMemBytes=99)
    driver = object.__new__(bindings._Driver)          # no libcuda here: names come cached
    for field, handle in (("func", 0x7F00DEAD0000), ("kern", 0x7F00BEEF0000)):
        setattr(params, field, handle)
        monkeypatch.setitem(bindings._func_names, handle, f"kernel_via_{field}")
        assert driver._read_kernel(params) == (f"kernel_via_{field}", [3, 2, 1, 512, 1, 1])
        setattr(params, field, 0)


class KernelNotes:
    """The boundary kernel's side of a synchronous collective under capture, as the capture code
    sees it: the note each call leaves as it returns (``take_captured``'s tuples: the call's
    entry, capture id, graph, stream and the stream's frontier), kept until they are taken."""

    def __init__(self) -> None:
        self.notes: list[tuple[Any, ...]] = []
        self.ordinal = 0

    def call(self, fake: FakeCapture, shape: int, kernel: str, nccl: int) -> None:
        """A call the kernel records natively: ProcessGroupNCCL's nodes, then its note."""
        fake.wait(nccl, S)
        fake.add(nccl, kernel)
        fake.add(nccl)
        fake.wait(S, nccl)
        self.ordinal += 1
        info = fake.capture_info(S)
        self.notes.append((shape, 2, self.ordinal, 0, 1, self.ordinal, info.capture_id,
                           info.graph, S, info.frontier))

    def has_captured(self, capture_id: int) -> bool:
        return any(note[6] == capture_id for note in self.notes)

    def take_captured(self) -> list[tuple[Any, ...]]:
        notes, self.notes = self.notes, []
        return notes


def test_kernel_calls_are_handed_to_their_capture_after_it_ends(
        fake: FakeCapture, monkeypatch: pytest.MonkeyPatch) -> None:
    """The end of a capture takes none of the boundary kernel's notes (capture time is what
    users wait for); they still find their capture by its id afterwards, even once another
    capture has placed a call of its own, and each call gets its own kernel."""
    kernel = KernelNotes()
    monkeypatch.setattr(RECORDER, "native", kernel)
    monkeypatch.setattr(RECORDER, "journal", None)
    monkeypatch.setattr(RECORDER, "shapes", [])
    monkeypatch.setattr(RECORDER, "_shape_ids", {})
    monkeypatch.setattr(RECORDER, "_captured", {})
    shape = RECORDER.add_shape(record("all_reduce", 10)[:md.R_SEQ], None)
    kernel.call(fake, shape, AR, N_WORLD)
    kernel.call(fake, shape, AR, N_WORLD)
    first = graphs.state_for(fake.capture_info(S))
    first.read()                                 # the capture hooks, as the capture ends
    graphs.forget(first)
    assert len(kernel.notes) == 2 and first.raw is not None
    assert graphs.CAPTURES.ended[77] is first

    fake.capture_id = 78                         # the next capture, one call placed by Python
    later = collective(fake, "all_gather", 10, AG, N_WORLD)
    assert not kernel.notes and len(first.native) == 2
    second = graphs.state_for(fake.capture_info(S))
    assert later[md.R_GRAPH] == second.gid and later[md.R_ORDINAL] == 1
    second.read()
    graphs.resolve_all()
    assert not graphs.CAPTURES.ended and first.record["complete"]
    placed = [RECORDER._captured[ordinal] for ordinal in (1, 2)]
    assert [rec[md.R_GRAPH] for rec in placed] == [first.gid] * 2
    assert [rec[md.R_ORDINAL] for rec in placed] == [1, 2]
    ars = [h for h in fake.order if fake.functions.get(h, ("",))[0] == AR]
    assert [rec[md.R_GRAPH_NODES] for rec in placed] == \
        [[(1 << 32) | fake.order.index(h)] for h in ars]


def test_the_kernels_packed_read_is_the_node_by_node_read(fake: FakeCapture) -> None:
    """``read_graph`` in boundary.cpp packs a graph as its comment there lays it out; unpacked
    (``GraphRead.native``), it says what the read through a backend says."""
    fake.add(S, GEMM)
    collective(fake, "all_reduce", 10, AR, N_WORLD)
    collective(fake, "broadcast", 11, BC, N_TP)
    python = bindings.read(0xABC)
    names = sorted({name for name, _ in python.descs().values()})
    kernels = [i for i, h in enumerate(fake.order) if h in fake.functions]
    params = [v for i in kernels for v in (names.index(fake.functions[fake.order[i]][0]),
                                           *fake.functions[fake.order[i]][1])]
    packed = (struct.pack(f"{len(fake.order)}Q", *fake.order),
              struct.pack(f"{len(python.sources)}Q", *python.sources),
              struct.pack(f"{len(python.targets)}Q", *python.targets),
              struct.pack(f"{len(kernels)}I", *kernels), names,
              struct.pack(f"{len(params)}I", *params), struct.pack(f"{len(kernels)}Q", *kernels))
    native = bindings.GraphRead.native(packed)
    assert list(native.nodes) == list(python.nodes) == fake.order
    assert native.edges() == python.edges() == fake.edges(0xABC)
    assert list(native.kernels) == list(python.kernels) == kernels
    assert native.descs() == python.descs() == {h: fake.functions[h] for h in fake.functions}
    assert python.tools is None and list(native.tools) == kernels
