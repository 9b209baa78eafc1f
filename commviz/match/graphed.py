"""Graphed collectives: give every NCCL kernel of every CUDA graph replay its collective's metadata.

A replay is one ``cudaGraphLaunch``: every kernel it ran carries that launch's ``correlation``.
Which graph it replayed comes from, in order: the ``commviz::graph_replay`` range around the
launch (its ``commviz.graph`` arg), the recorded replay whose time window holds the launch, or
the replay's kernel fingerprint (the multiset of its kernels equals exactly one captured graph's,
and every captured graph has one).

Which kernel is which captured node:

- exact, when the trace carries ``"graph node id"`` (torch >= 2.12): CUPTI's node id of the
  instantiated graph, ``(exec graph id << 32) | node index``; the record holds the capture ids, so
  they are mapped through the exec ids noted at instantiation (capture ids are accepted too);
- otherwise by order: a replayed kernel can only start once every kernel it depends on has run,
  so the replay's kernels, taken by start time, are assigned to captured nodes of the same kernel
  and launch dims whose recorded predecessors are all assigned. When several such nodes would
  give different labels, the stream the same node ran on in other replays decides; failing that
  the kernel is reported, not guessed.

Coalesced point-to-point calls (``batch_isend_irecv``, pipelining) captured into a graph have no
node of their own: NCCL adds their one ``SendRecv`` kernel when the group ends, after every call
of it returned. The record still holds each call, numbered as NCCL numbers its p2p groups
(``commviz.fr_p2p_seq``: one number a group). So a replay's SendRecv kernels that no call's
node names are the graph's node-less p2p groups. Where the graph read at the end of the capture
holds their nodes (SendRecv nodes no call claimed), the k-th such node, in the order the capture
made nodes, ran the k-th group in call order (``_Graph.claim_blocks``), whatever its process
group; SendRecv nodes of other calls beside them (an ``all_to_all``, a lone ``send``) keep
their own labels. Otherwise the replay's node-less SendRecv kernels, taken by start time (one
communicator runs its kernels one after another), are the groups in call order where the counts
agree and the groups all belong to one process group (``coalesced``); else they are reported.

Each assignment is then checked against the collective: the kernel's type must be able to carry
the recorded collective, and its reduction and dtype must agree. Anything uncertain becomes an
``Unmatched`` with the reason; nothing is mislabelled.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from commviz import metadata as md
from commviz.capture.names import kernel_key
from commviz.match.coalesced import batch_args, with_ops
from commviz.match.index import Intervals
from commviz.match.model import CommEvent, Source, instance_key
from commviz.match.result import Unmatched
from commviz.kernels import graph_node_id, incompatibility, is_sendrecv, parse_nccl
from commviz.trace.load import json_list

REPLAY = md.REPLAY                      # "commviz.replay": the replay's number, per graph
MATCHED_BY = md.MATCHED_BY
NODE = md.GRAPH_NODE
_DROP = frozenset({md.T_BEGIN, md.T_END, md.GRAPH_NODES})
# recorded reduction -> reductions an NCCL kernel may run it with (avg: PreMulSum for floats,
# SumPostDiv for integers)


@dataclass
class GraphMatch:
    """The graph matcher's share of a ``RankMatch`` (same fields, minus the rank)."""

    events: list[CommEvent] = field(default_factory=list)
    kernel_args: dict[int, dict] = field(default_factory=dict)
    marks: dict[int, dict] = field(default_factory=dict)
    unmatched: list[Unmatched] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)
    graphed: set[int] = field(default_factory=set)    # trace indices of all replayed GPU work

    def bump(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n


@dataclass(slots=True)
class _Kernel:
    index: int
    ts: float
    dur: float
    name: str
    key: str
    dims: tuple | None
    stream: Any
    node_id: int | None


@dataclass
class _Replay:
    """One graph launch in the trace and the kernels it ran."""

    thread: tuple[Any, Any]           # (pid, tid) of the launching CPU thread
    ts: float
    kernels: list[_Kernel] = field(default_factory=list)
    graph: int | None = None
    number: int | None = None
    how: str = ""


@dataclass(frozen=True, slots=True)
class _Number:
    """A replay's number: the hook's count when tagged (same on every rank), else its place
    among this trace's replays of the graph, which only goes into the instance key."""

    number: int | None
    in_trace: int | None

    @property
    def key(self) -> Any:
        return self.number if self.number is not None else ("in trace", self.in_trace)


class _Graph:
    """A captured graph from the record, indexed for matching."""

    def __init__(self, rec: dict[str, Any]) -> None:
        self.gid = rec["graph"]
        self.rec = rec
        self.nodes: list[dict[str, Any]] = list(rec.get("nodes") or [])
        self.complete = bool(rec.get("complete"))
        self.by_key: dict[str, list[int]] = defaultdict(list)
        for i, n in enumerate(self.nodes):
            self.by_key[n["kernel"]].append(i)
        self.after = [tuple(n.get("after") or ()) for n in self.nodes]
        # each node's count of distinct predecessors, and who waits on each node: a replay's
        # matching releases a node when its last predecessor is assigned, never rescans
        self.waiting = [len(set(a)) for a in self.after]
        self.dependents: dict[Any, list[int]] = defaultdict(list)
        for i, after in enumerate(self.after):
            for pred in set(after):
                self.dependents[pred].append(i)
        self.roots: dict[str, list[int]] = defaultdict(list)   # kernel -> nodes due at once
        for i, n in enumerate(self.nodes):
            if not self.waiting[i]:
                self.roots[n["kernel"]].append(i)
        self.counts = Counter(n["kernel"] for n in self.nodes)
        self.fingerprint = Counter(rec.get("kernel_names") or {}) if self.complete else None
        self.blocks: dict[int, list[dict]] = {}     # node -> the coalesced p2p group it ran

    def label(self, i: int) -> tuple:
        n = self.nodes[i]
        block = self.blocks.get(i)
        return (n.get("lane"), n.get("ordinal"), tuple(n.get("marks") or ()), n.get("mark_lane"),
                id(block) if block is not None else None)

    def claim_blocks(self, blocks: list[list[dict]]) -> None:
        """Give each SendRecv node no call claimed its coalesced p2p group: the capture made
        nodes in call order (node index), and NCCL made each group's node as the group ended,
        before the next call began; so the k-th such node is the k-th group by call time.
        Counts that differ leave the nodes unclaimed (``coalesced`` decides by replay order)."""
        free = sorted((i for i, n in enumerate(self.nodes) if n.get("ordinal") is None
                       and is_sendrecv(n["kernel"])),
                      key=lambda i: _int(self.nodes[i].get("local")) or i)
        if len(free) == len(blocks):
            order = sorted(blocks, key=lambda b: min(m.get(md.T_BEGIN) or 0 for m in b))
            self.blocks = dict(zip(free, order))


def _int(value: Any) -> int | None:
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


def _fingerprint(counts: Counter) -> frozenset:
    """A kernel multiset as a dict key (equal as Counters compare: zero counts left out)."""
    return frozenset((key, n) for key, n in counts.items() if n)


def _dims(args: dict[str, Any]) -> tuple | None:
    grid, block = json_list(args.get("grid")), json_list(args.get("block"))
    if not (isinstance(grid, list) and isinstance(block, list)):
        return None
    dims = tuple(_int(v) for v in grid + block)
    return None if None in dims else dims


def _p2p_blocks(metas: dict[tuple, dict], graphs: dict[int, "_Graph"]) -> dict[int, list[list]]:
    """Per graph, its captured p2p calls that no node names, grouped as NCCL ran them (one
    group a ``commviz.fr_p2p_seq``; a call without one alone), in call order."""
    listed = {(g.gid, n.get("lane"), n.get("ordinal")) for g in graphs.values() for n in g.nodes}
    blocks: dict[int, dict[tuple, list]] = defaultdict(dict)
    for (gid, lane, ordinal), meta in sorted(metas.items(), key=lambda kv: (
            kv[0][0], str(kv[0][1]), kv[0][2])):
        if meta.get(md.KIND) != "p2p" or (gid, lane, ordinal) in listed:
            continue
        fr = meta.get(md.FR_P2P_SEQ)
        group = (str(meta.get(md.PG_NAME)), fr) if fr is not None else ("call", lane, ordinal)
        blocks[gid].setdefault(group, []).append(meta)
    return {gid: list(groups.values()) for gid, groups in blocks.items()}


def check_kernel(name: str, meta: dict[str, Any]) -> str | None:
    """Why an NCCL kernel named ``name`` cannot be the collective ``meta`` (None: it can)."""
    nk = parse_nccl(name)
    return None if nk is None else incompatibility(nk, meta)


class _Index:
    """The parts of a trace the graph matcher needs: graph launches and their kernels from the
    trace's ``GpuIndex`` (``Trace.gpu``), replay tags and marks from its other joinable events."""

    def __init__(self, trace: Any) -> None:
        events, gpu = trace.events, trace.gpu
        self.events, self.gpu = events, gpu
        self.replays: dict[Any, _Replay] = {}
        self.tags: dict[tuple, list[tuple[float, float, dict]]] = defaultdict(list)
        self.mark_ranges: dict[tuple, list[tuple[float, float, str, Any]]] = defaultdict(list)
        self.node_kernels: list[_Kernel] = []                      # kernels with graph node ids
        for corr, i in gpu.launches.items():
            if corr in gpu.graph:
                at = _at(events[i])
                if at is not None:
                    self.replays[corr] = _Replay(at[0], at[1])
        for i in gpu.other:
            ev = events[i]
            name = str(ev.get("name", ""))
            if name != md.REPLAY_RANGE and not name.startswith(md.MARK_RANGE_PREFIX):
                continue                    # most CPU ops: nothing here joins on them
            at = _at(ev)
            if at is None:
                continue
            (thread, ts), dur = at, float(ev.get("dur") or 0)
            args = ev.get("args")
            args = args if args.__class__ is dict else {}
            if name == md.REPLAY_RANGE:
                self.tags[thread].append((ts, ts + dur, args))
            else:
                self.mark_ranges[thread].append((ts, ts + dur, name[len(md.MARK_RANGE_PREFIX):],
                                                 args.get(md.MARK_LANE)))
        for i in sorted(gpu.graphed):
            ev = events[i]
            if ev.get("cat") != "kernel":
                continue
            try:
                ts, dur = float(ev["ts"]), float(ev.get("dur") or 0)
            except (KeyError, TypeError, ValueError):
                continue
            args = ev["args"]                       # graphed: a dict (GpuIndex)
            name = str(ev.get("name", ""))
            k = _Kernel(i, ts, dur, name, kernel_key(name), _dims(args),
                        args.get("stream", ev.get("tid")), graph_node_id(args) or None)
            corr = args.get("correlation")
            if corr in self.replays:
                self.replays[corr].kernels.append(k)
            elif k.node_id:
                self.node_kernels.append(k)
        for rep in self.replays.values():
            rep.kernels.sort(key=lambda k: (k.ts, k.index))
        self.tag_spans = _by_thread(self.tags)
        self.mark_spans = _by_thread(self.mark_ranges)

    def eager_launches(self) -> dict[Any, tuple[tuple, float]]:
        """Launches that are not graph launches: correlation -> (thread, ts)."""
        out = {}
        for corr, i in self.gpu.launches.items():
            at = _at(self.events[i]) if corr not in self.gpu.graph else None
            if at is not None:
                out[corr] = at
        return out

    def eager_work(self) -> dict[Any, list[int]]:
        """GPU work outside graph replays, by correlation."""
        out: dict[Any, list[int]] = defaultdict(list)
        for i in self.gpu.work:
            if i not in self.gpu.graphed:
                args = self.events[i].get("args")
                corr = args.get("correlation") if args.__class__ is dict else None
                if corr is not None:
                    out[corr].append(i)
        return out


def _at(ev: dict) -> tuple[tuple, float] | None:
    """(thread, ts) of an event; None where its time or duration is not a number."""
    try:
        ts = float(ev["ts"])
        float(ev.get("dur") or 0)
    except (KeyError, TypeError, ValueError):
        return None
    return (ev.get("pid"), ev.get("tid")), ts


def _by_thread(spans: dict[tuple, list[tuple]]) -> dict[tuple, Intervals]:
    return {thread: Intervals([(s[0], s[1], s) for s in items]) for thread, items in spans.items()}


class _Matcher:
    def __init__(self, trace: Any, record: dict[str, Any], idx: _Index, out: GraphMatch) -> None:
        self.trace = trace
        self.idx = idx
        self.out = out
        self.rank = int(record.get("rank", getattr(trace, "rank", 0)))
        self.graphs = {g["graph"]: _Graph(g) for g in record.get("graphs") or []
                       if isinstance(g, dict) and "graph" in g}
        self.metas: dict[tuple, dict] = {}
        for meta in record.get("collectives") or []:
            gid = meta.get(md.GRAPH)
            if gid is not None and meta.get(md.ORDINAL) is not None:
                self.metas[(gid, meta.get(md.LANE), meta[md.ORDINAL])] = meta
        self.windows = Intervals([(r["t_begin_ns"], r["t_end_ns"], r)
                                  for r in record.get("replays") or []
                                  if isinstance(r, dict) and "t_begin_ns" in r
                                  and "t_end_ns" in r])
        self.by_node_id: dict[int, tuple[_Graph, int]] = {}
        for g in self.graphs.values():
            execs = list(g.rec.get("exec_ids") or [])
            for i, n in enumerate(g.nodes):
                if n.get("node") is None:
                    continue
                self.by_node_id[int(n["node"])] = (g, i)
                for e in execs:
                    self.by_node_id[(int(e) << 32) | int(n["local"])] = (g, i)
        self.evidence: dict[tuple[int, int], set] = defaultdict(set)   # (gid, node) -> streams
        self.p2p_blocks = _p2p_blocks(self.metas, self.graphs)
        for gid, blocks in self.p2p_blocks.items():
            if gid in self.graphs:
                self.graphs[gid].claim_blocks(blocks)
        self.with_collectives = {gid for (gid, _, _), m in self.metas.items()
                                 if m.get(md.KIND) != "p2p"}     # graphs with other calls
        # graphs by kernel fingerprint; none when a graph without one could be any replay
        self.by_fingerprint: dict[frozenset, list[int]] | None = None
        if all(g.fingerprint is not None for g in self.graphs.values()):
            self.by_fingerprint = defaultdict(list)
            for g in self.graphs.values():
                self.by_fingerprint[_fingerprint(g.fingerprint)].append(g.gid)

    # -- which graph ----------------------------------------------------------------------------
    def identify(self, rep: _Replay) -> None:
        spans = self.idx.tag_spans.get(rep.thread)
        for _, _, args in spans.holding(rep.ts) if spans is not None else ():
            if args.get(md.GRAPH) in self.graphs:
                rep.graph, rep.number, rep.how = args[md.GRAPH], args.get(md.REPLAY), "tag"
                return
        hits = [r for r in self.windows.holding(self.trace.ns(rep.ts))
                if r.get("graph") in self.graphs]
        if len(hits) == 1:
            rep.graph, rep.number, rep.how = hits[0]["graph"], hits[0].get("replay"), "time"
            return
        if self.by_fingerprint is None:
            return                  # a graph without a fingerprint could be this one too
        fits = self.by_fingerprint.get(_fingerprint(Counter(k.key for k in rep.kernels)), ())
        if len(fits) == 1:
            rep.graph, rep.how = fits[0], "fingerprint"

    # -- which node ---------------------------------------------------------------------------
    def by_order(self, g: _Graph, rep: _Replay, use_evidence: bool
                 ) -> tuple[dict[int, int], dict[int, str]]:
        """kernel trace index -> node position, and kernel trace index -> why it is unmatched."""
        tainted: set[int] = set()
        got: dict[int, int] = {}
        why: dict[int, str] = {}
        waiting = list(g.waiting)      # per node, its predecessors not assigned yet
        due = {key: list(nodes) for key, nodes in g.roots.items()}  # per kernel, node order

        def assign(i: int) -> None:
            due[g.nodes[i]["kernel"]].remove(i)
            for j in g.dependents.get(i, ()):
                waiting[j] -= 1
                if not waiting[j]:
                    bisect.insort(due.setdefault(g.nodes[j]["kernel"], []), j)

        for k in rep.kernels:
            if not g.by_key.get(k.key):
                continue
            cands = [i for i in due.get(k.key, ())
                     if k.dims is None or not g.nodes[i].get("dims")
                     or tuple(g.nodes[i]["dims"]) == k.dims]
            if not cands:
                why[k.index] = ("its kernel and launch dims fit no captured node due at this "
                                "point of the replay")
                continue
            choice = cands[0]
            if len({g.label(i) for i in cands}) > 1:
                decided = None
                if use_evidence:
                    seen = [self.evidence.get((g.gid, i), set()) for i in cands]
                    yes = [i for i, s in zip(cands, seen) if k.stream in s]
                    if len(yes) == 1 and all(s and k.stream not in s
                                             for i, s in zip(cands, seen) if i != yes[0]):
                        decided = yes[0]
                if decided is None:
                    tainted.update(cands)
                    assign(choice)
                    why[k.index] = (f"{len(cands)} captured nodes running this kernel were due "
                                    "at once and nothing tells them apart")
                    continue
                choice = decided
            assign(choice)
            if choice in tainted:
                why[k.index] = "an earlier ambiguous kernel may have taken its node"
                continue
            got[k.index] = choice
        return got, why

    def by_ids(self, kernels: list[_Kernel], number: _Number,
               graph: int | None = None) -> None:
        """Exact matching by CUPTI graph node id (traces of torch >= 2.12); the SendRecv
        kernels of no recorded node go to the coalesced p2p rule of the replay's ``graph``."""
        nodeless = []
        for k in kernels:
            hit = self.by_node_id.get(k.node_id) if k.node_id else None
            if hit is None:
                if graph in self.p2p_blocks and is_sendrecv(k.name):
                    nodeless.append(k)
                elif parse_nccl(k.name) is not None:
                    self.unmatched(k, f"graph node id {k.node_id} is not in the record")
                continue
            g, i = hit
            node = g.nodes[i]
            if i in g.blocks:
                self.label_block(k, g, g.blocks[i], number, "graph node id")
                continue
            if self.coalesced_node(g, i, k):
                nodeless.append(k)
                continue
            if node["kernel"] != k.key or (k.dims is not None and node.get("dims")
                                          and tuple(node["dims"]) != k.dims):
                if parse_nccl(k.name) is not None:
                    self.unmatched(k, f"graph node id {k.node_id} is kernel {node['kernel']} "
                                      f"in the record, not {k.key}")
                continue
            self.apply(k, g, i, number, "graph node id")
        if nodeless:
            self.coalesced(self.graphs[graph], nodeless, number)

    def coalesced_node(self, g: _Graph, i: int, k: _Kernel) -> bool:
        """Node ``i`` is a SendRecv node no call claimed, in a graph with coalesced p2p groups:
        NCCL's kernel for one of them (added when the group ended, after its calls returned).
        Its kernel goes to the ``coalesced`` rule with the graph's other node-less ones."""
        return (g.nodes[i].get("ordinal") is None and g.gid in self.p2p_blocks
                and is_sendrecv(k.name))

    # -- labels -------------------------------------------------------------------------------
    def apply(self, k: _Kernel, g: _Graph, i: int, number: _Number, how: str) -> None:
        node = g.nodes[i]
        if node.get("marks"):
            mark = {md.MARK: "/".join(node["marks"]), md.GRAPH: g.gid, REPLAY: number.number,
                    NODE: node.get("node")}
            if node.get("mark_lane") is not None:
                mark[md.MARK_LANE] = node["mark_lane"]
            self.out.marks[k.index] = mark
            self.out.bump("graph_marked_kernels")
        if node.get("ordinal") is None:
            if parse_nccl(k.name) is not None:
                self.unmatched(k, "its captured node belongs to no annotated collective "
                                  "(issued without commviz?)")
            return
        meta = self.metas.get((g.gid, node.get("lane"), node["ordinal"]))
        if meta is None:
            self.unmatched(k, f"collective {node.get('op')} (graph {g.gid}, ordinal "
                              f"{node['ordinal']}) is missing from the record (dropped from "
                              "its ring buffer?)")
            return
        bad = check_kernel(k.name, meta)
        if bad is not None:
            self.unmatched(k, f"matched by {how}, but {bad}")
            return
        args = {key: v for key, v in with_ops(meta).items() if key not in _DROP}
        args[REPLAY] = number.number
        args[MATCHED_BY] = how
        args[NODE] = node.get("node")
        self.out.kernel_args[k.index] = args
        self.event(k, g, args, number)
        self.out.bump("graph_matched")
        self.out.bump("graph_matched_by_node_id" if how == "graph node id"
                      else "graph_matched_by_order")

    def event(self, k: _Kernel, g: _Graph, args: dict[str, Any], number: _Number) -> None:
        """The CommEvent of one call a replayed kernel carried out (its key: the replay's)."""
        start = self.trace.ns(k.ts)
        base = instance_key(args)
        self.out.events.append(CommEvent(
            rank=self.rank, pg=str(args.get(md.PG_NAME)), op=str(args.get(md.OP)),
            start_ns=start, end_ns=start + round(k.dur * 1000), args=args,
            key=base._replace(replay=number.key) if base is not None else None,
            source=Source.KERNEL,
            stream=k.stream if isinstance(k.stream, int) else None, graphed=True,
            extra={"trace_index": k.index, "graph": g.gid, "replay": number.number}))

    def coalesced(self, g: _Graph, kernels: list[_Kernel], number: _Number) -> None:
        """One replay's SendRecv kernels of no node: the graph's node-less p2p groups, in
        call order (module docstring)."""
        blocks = self.p2p_blocks.get(g.gid, [])
        kernels = sorted(kernels, key=lambda k: (k.ts, k.index))
        why = None
        if len(blocks) != len(kernels):
            why = (f"{len(kernels)} SendRecv kernels of no captured node in this replay, but "
                   f"graph {g.gid} captured {len(blocks)} groups of p2p calls without one")
        elif len({str(m.get(md.PG_NAME)) for b in blocks for m in b}) > 1:
            why = (f"graph {g.gid}'s p2p groups belong to several process groups: the order "
                   "of their kernels does not say which is which")
        for k, metas in zip(kernels, blocks) if why is None else ():
            self.label_block(k, g, metas, number, "coalesced order")
        for k in kernels if why is not None else ():
            self.unmatched(k, why)

    def label_block(self, k: _Kernel, g: _Graph, metas: list[dict], number: _Number,
                    how: str) -> None:
        """Kernel ``k`` ran the coalesced p2p group ``metas``: it carries every op of it."""
        bad = next((b for b in (check_kernel(k.name, m) for m in metas) if b), None)
        if bad is not None:
            self.unmatched(k, f"matched by {how}, but {bad}")
            return
        label = {key: v for key, v in batch_args(metas).items() if key not in _DROP}
        label.update({REPLAY: number.number, MATCHED_BY: how})
        self.out.kernel_args[k.index] = label
        self.out.bump("graph_matched")
        self.out.bump("graph_matched_coalesced_p2p", len(metas))
        for meta in metas:
            args = {key: v for key, v in meta.items() if key not in _DROP}
            args.update({REPLAY: number.number, MATCHED_BY: how, md.P2P_OPS: label[md.P2P_OPS]})
            self.event(k, g, args, number)

    def unmatched(self, k: _Kernel, reason: str) -> None:
        self.out.unmatched.append(Unmatched(f"graphed kernel {k.name}", k.index, reason))
        self.out.bump("graph_unmatched")

    # -- driver -------------------------------------------------------------------------------
    def run(self) -> None:
        per_graph: Counter = Counter()
        ordered: list[tuple[_Replay, _Graph, _Number]] = []
        for rep in sorted(self.idx.replays.values(), key=lambda r: r.ts):
            if not rep.kernels:
                continue
            self.out.bump("graph_replays")
            self.identify(rep)
            if rep.graph is not None:
                per_graph[rep.graph] += 1
                self.out.bump(f"graph_replays_by_{rep.how}")
            number = _Number(rep.number, per_graph[rep.graph] if rep.graph is not None else None)
            if any(k.node_id for k in rep.kernels):
                self.by_ids(rep.kernels, number, rep.graph)
                continue
            if rep.graph is None:
                self.out.bump("graph_replays_unidentified")
                for k in rep.kernels:
                    if parse_nccl(k.name) is not None:
                        self.unmatched(k, "its replay matches no captured graph (no replay tag, "
                                          "no recorded replay at that time, and its kernels fit "
                                          "no single graph's fingerprint)")
                continue
            g = self.graphs[rep.graph]
            if not g.complete:            # no dependency order: kernel order proves nothing
                # ... but for a graph of p2p calls alone (commviz reads graphs that hold
                # collectives or marks), the SendRecv kernels are its p2p groups, in call order
                alone = g.gid in self.p2p_blocks and g.gid not in self.with_collectives
                nodeless = [k for k in rep.kernels if alone and is_sendrecv(k.name)]
                for k in rep.kernels:
                    if parse_nccl(k.name) is not None and not (alone and is_sendrecv(k.name)):
                        self.unmatched(k, f"graph {g.gid} was not read at the end of its capture "
                                          "(no dependency order to match by)")
                if nodeless:
                    self.coalesced(g, nodeless, number)
                continue
            seen = Counter(k.key for k in rep.kernels if k.key in g.by_key)
            if seen != g.counts:          # a kernel missing would shift every later label
                why = (f"the trace shows {sum(seen.values())} of the {sum(g.counts.values())} "
                       f"kernels graph {g.gid} has to match: replay incomplete in the trace")
                for k in rep.kernels:
                    if parse_nccl(k.name) is not None:
                        self.unmatched(k, why)
                continue
            ordered.append((rep, g, number))
        for rep, g, _ in ordered:                        # pass 1: each node's stream
            got, _ = self.by_order(g, rep, use_evidence=False)
            streams = {k.index: k.stream for k in rep.kernels}
            for kidx, i in got.items():
                self.evidence[(g.gid, i)].add(streams[kidx])
        for rep, g, number in ordered:                   # pass 2: label, with that evidence
            got, why = self.by_order(g, rep, use_evidence=True)
            nodeless = []
            for k in rep.kernels:
                if k.index in got and got[k.index] in g.blocks:
                    self.label_block(k, g, g.blocks[got[k.index]], number, "order")
                elif k.index in got and self.coalesced_node(g, got[k.index], k):
                    nodeless.append(k)
                elif k.index in got:
                    self.apply(k, g, got[k.index], number, "order")
                elif g.gid in self.p2p_blocks and k.key not in g.by_key and is_sendrecv(k.name):
                    nodeless.append(k)
                elif parse_nccl(k.name) is not None:
                    self.unmatched(k, why.get(k.index, "no annotated collective of graph "
                                                       f"{g.gid} ran this kernel"))
            if nodeless:
                self.coalesced(g, nodeless, number)
        if self.idx.node_kernels:                         # node ids without a launch in view
            self.by_ids(self.idx.node_kernels, _Number(None, None))


def _eager_marks(idx: _Index, out: GraphMatch) -> None:
    """Kernels launched inside ``commviz::mark::<name>`` ranges (eager marks)."""
    if not idx.mark_spans:
        return
    work = idx.eager_work()
    for corr, (thread, ts) in idx.eager_launches().items():
        spans = idx.mark_spans.get(thread)
        held = sorted(spans.holding(ts), key=lambda s: (s[0], -s[1])) if spans else None
        if not held:
            continue
        label = {md.MARK: "/".join(s[2] for s in held)}
        lane = next((s[3] for s in reversed(held) if s[3] is not None), None)
        if lane is not None:
            label[md.MARK_LANE] = lane
        for k in work.get(corr, ()):
            out.marks[k] = dict(label)
            out.bump("eager_marked_kernels")


def match_graphed(trace: Any, record: dict[str, Any] | None) -> GraphMatch:
    """Label one rank's graphed kernels (and marked kernels) from its commviz record."""
    out = GraphMatch()
    idx = _Index(trace)
    out.graphed = set(trace.gpu.graphed)
    _eager_marks(idx, out)
    if record is None:
        for rep in idx.replays.values():
            for k in rep.kernels:
                if parse_nccl(k.name) is not None:
                    out.unmatched.append(Unmatched(f"graphed kernel {k.name}", k.index,
                                                   "no commviz record for this rank"))
        return out
    matcher = _Matcher(trace, record, idx, out)
    matcher.run()
    out.bump("graphs_recorded", len(matcher.graphs))
    return out
