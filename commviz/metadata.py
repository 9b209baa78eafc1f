"""The metadata commviz attaches to a collective: the eager profiler's keys plus commviz's own.

Eager NCCL kernels carry ten keys in the profiler trace (``EAGER_KEYS``). commviz emits exactly
those keys with the profiler's value formats (``"dtype": "Float"``, ``"Process Group Ranks":
"[0, 1]"``, ``"In split size": "[]"``), so a graphed or gloo collective reads like an eager NCCL
one, and adds its own keys under the ``commviz.`` prefix (the Perfetto UI groups dotted args).

The house's ground floor: the keys, the compact record's layout, the dtype table and how names,
sizes and times are shown to people. It imports no torch (``tests/test_layering.py`` holds
this), so every reader shares one vocabulary with the job; the job's own registry of process
groups, which asks torch.distributed, is ``commviz.record.process_groups``.
"""

from __future__ import annotations

import functools
import sys
import zlib
from array import array
from dataclasses import InitVar, dataclass, field
from enum import Enum
from typing import Any, Iterable

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:
    class StrEnum(str, Enum):
        """A str-valued Enum that prints and formats as its value (Python 3.11's StrEnum)."""

        __str__ = str.__str__
        __format__ = str.__format__

# --- the eager profiler's keys (record_param_comms / NCCL kernel args) -------------------------
COLLECTIVE_NAME = "Collective name"
IN_NELEMS = "In msg nelems"
OUT_NELEMS = "Out msg nelems"
GROUP_SIZE = "Group size"
DTYPE = "dtype"
IN_SPLIT = "In split size"
OUT_SPLIT = "Out split size"
PG_NAME = "Process Group Name"
PG_DESC = "Process Group Description"
PG_RANKS = "Process Group Ranks"
EAGER_KEYS = (
    COLLECTIVE_NAME, IN_NELEMS, OUT_NELEMS, GROUP_SIZE, DTYPE,
    IN_SPLIT, OUT_SPLIT, PG_NAME, PG_DESC, PG_RANKS,
)

# --- commviz's own keys -------------------------------------------------------------------------
OP = "commviz.op"                # torch.distributed function name: "all_reduce", "isend", ...
KIND = "commviz.kind"            # "collective" | "p2p" | "batch"
SEQ = "commviz.seq"              # collectives: per-process-group sequence number (1-based)
P2P_SEQ = "commviz.p2p_seq"      # p2p: per (group, src, dst) sequence number (1-based)
FR_P2P_SEQ = "commviz.fr_p2p_seq"  # p2p: NCCL's number, Flight Recorder's p2p_seq_id (per group)
P2P_OPS = "commviz.p2p_ops"      # a SendRecv kernel's p2p ops: "send→1 4 KiB, recv←1 4 KiB"
USER_SEQ = "commviz.user_seq"    # annotate_collective blocks with no c10d call inside, per group
RANK = "commviz.rank"            # global rank of the caller
ROOT = "commviz.root"            # global rank of the root (broadcast/reduce/gather/scatter)
PEER = "commviz.peer"            # global rank of the peer (send/recv/isend/irecv)
SRC = "commviz.src"              # global source rank of a p2p transfer
DST = "commviz.dst"              # global destination rank of a p2p transfer
PEERS = "commviz.peers"          # batch_isend_irecv: "send:1,recv:1" in op order
REDUCE_OP = "commviz.reduce_op"  # "sum", "max", ... or absent
ASYNC = "commviz.async_op"       # bool
BYTES_IN = "commviz.bytes_in"
BYTES_OUT = "commviz.bytes_out"
CALLSITE = "commviz.callsite"    # "path/to/file.py:123" of the user's call
LANE = "commviz.lane"            # stable comm-lane id of the process group
T_BEGIN = "commviz.t_begin_ns"   # wall clock (time.time_ns) when the call began
T_END = "commviz.t_end_ns"       # wall clock when the call returned (launch, not completion)
CAPTURED = "commviz.captured"    # bool: issued under CUDA graph capture
GRAPH = "commviz.graph"          # commviz capture id of the graph it was captured into
GRAPH_NODES = "commviz.graph_nodes"  # CUPTI graph node ids of its kernel nodes
ORDINAL = "commviz.ordinal"      # ordinal of the collective within its graph, per lane
REPLAY = "commviz.replay"        # graphed kernels: the replay's number, per graph
MATCHED_BY = "commviz.matched_by"  # graphed kernels: "graph node id" | "order" | "fingerprint"
GRAPH_NODE = "commviz.graph_node"  # graphed kernels: CUPTI id of the captured node
MARK = "commviz.mark"            # commviz.mark label of a compute kernel ("outer/inner")
MARK_LANE = "commviz.mark_lane"  # the display lane a commviz.mark asked for
DEVICE = "commviz.device"        # "cuda" | "cpu": where the tensors live (cuda: the CPU span is launch only)
TID = "commviz.tid"              # the calling thread's OS id (the profiler trace's "tid")
ERROR = "commviz.error"          # repr of the exception the call raised, if it raised
# where a call comes from (commviz.record.origins): one short string, its kind and unit
ORIGIN = "commviz.origin"                # "FSDP forward all-gather (layers.0)", "train.py:88"
ORIGIN_KIND = "commviz.origin_kind"      # an OriginKind value
ORIGIN_UNIT = "commviz.origin_unit"      # FSDP module fqn, "bucket 2", "stage 0", function
ORIGIN_PHASE = "commviz.origin_phase"    # FSDP phase, pipeline action, DTensor placements
ORIGIN_MICROBATCH = "commviz.origin_microbatch"  # pipelining: the micro-batch
BACKWARD_CALLSITE = "commviz.backward_callsite"  # "file:line" that called backward()
COMPILED_AT = "commviz.compiled_at"      # compiled code: the compiled function's "file:line"
DDP_BUCKET = "commviz.ddp_bucket"        # DDP: the reducer's bucket (GradBucket.index())
DDP_BUCKET_PARAMS = "commviz.ddp_bucket_params"    # its parameter count
DDP_BUCKET_BYTES = "commviz.ddp_bucket_bytes"      # its gradient bytes
DDP_BUCKET_NUMEL = "commviz.ddp_bucket_numel"      # its elements (no hook: the call's)
DDP_BUCKET_FIRST = "commviz.ddp_bucket_first"      # its first parameter's name
DDP_BUCKET_LAST = "commviz.ddp_bucket_last"        # its last parameter's name
ZERO_BUCKET = "commviz.zero_bucket"      # DeepSpeed ZeRO: the gradient bucket, in its backward
ZERO_PARAMS = "commviz.zero_params"      # the parameters its bucket (or all-gather) holds
ZERO_BUCKET_FIRST = "commviz.zero_bucket_first"    # its first parameter's name
ZERO_BUCKET_LAST = "commviz.zero_bucket_last"      # its last parameter's name
MEGATRON_PARALLELISM = "commviz.megatron_parallelism"  # Megatron-core: "TP", "PP", "EP", "DP"
MEGATRON_MODULE = "commviz.megatron_module"  # its module, global layer index: decoder.layers.3.mlp
MEGATRON_LAYER = "commviz.megatron_layer"    # its transformer layer (layer_number - 1)
MEGATRON_BUCKET = "commviz.megatron_bucket"  # its DDP's bucket (bucket_id)
MEGATRON_CHUNK = "commviz.megatron_chunk"    # its model chunk (virtual pipeline stage)
ORIGIN_KEYS = (ORIGIN, ORIGIN_KIND, ORIGIN_UNIT, ORIGIN_PHASE, ORIGIN_MICROBATCH,
               BACKWARD_CALLSITE, COMPILED_AT, DDP_BUCKET, DDP_BUCKET_PARAMS, DDP_BUCKET_BYTES,
               DDP_BUCKET_NUMEL, DDP_BUCKET_FIRST, DDP_BUCKET_LAST, ZERO_BUCKET, ZERO_PARAMS,
               ZERO_BUCKET_FIRST, ZERO_BUCKET_LAST, MEGATRON_PARALLELISM, MEGATRON_MODULE,
               MEGATRON_LAYER, MEGATRON_BUCKET, MEGATRON_CHUNK)


class OriginKind(StrEnum):
    """What kind of unit ``ORIGIN`` names (records keep the plain string)."""

    USER = "user"              # the user's call site
    FSDP = "FSDP"
    DDP = "DDP"
    DTENSOR = "DTensor"
    PIPELINE = "pipelining"
    COMPILED = "compiled"
    DEEPSPEED = "DeepSpeed"    # its engine and ZeRO optimizers (record/origins/deepspeed.py)
    MEGATRON = "Megatron"      # Megatron-core's parallelisms (record/origins/megatron.py)
    BACKWARD = "backward"      # an autograd thread's call: the line that called backward()
    UNKNOWN = "unknown"        # no Python caller and no framework range


# Eager "Collective name" per wrapped function, as ProcessGroupNCCL records it.
COLLECTIVE_NAMES = {
    "all_reduce": "allreduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_gather": "all_gather",
    "all_gather_into_tensor": "_allgather_base",
    "all_gather_single": "_allgather_base",
    "all_reduce_coalesced": "allreduce_coalesced",
    "reduce_scatter_single": "_reduce_scatter_base",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "_reduce_scatter_base",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_allv",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "send": "send",
    "recv": "recv",
    "isend": "send",
    "irecv": "recv",
    "batch_isend_irecv": "batch_isend_irecv",
    "all_gather_coalesced": "allgather_coalesced",
    "all_gather_into_tensor_coalesced": "allgather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "monitored_barrier": "monitored_barrier",
}

# Profiler ranges commviz opens (their names are read back by the matchers)
REPLAY_RANGE = "commviz::graph_replay"    # a CUDA graph replay, args GRAPH and REPLAY
MARK_RANGE_PREFIX = "commviz::mark::"     # a commviz.mark block

LANE_BASE = 1_000_000
SIDE_GROUP_DESC = "commviz_side"   # commviz's own gloo group (gather, clocks): not the job's

# A compact record: what the hot path stores (a list, so the end time can be set later). It is
# expanded into the metadata dict only when something reads it: a flush, a profiler range, a
# capture region, annotate_collective's caller. Building the 20-key dict on every call would
# cost more than the rest of the wrapper.
# Under CUDA graph capture the capture fields are kept here too (the graph nodes are filled in
# when the capture ends), so a captured collective does not need its dict either.
(R_OP, R_KIND, R_INFO, R_IN, R_OUT, R_DTYPE, R_ESIZE, R_IN_SPLIT, R_OUT_SPLIT, R_ASYNC, R_FILE,
 R_LINE, R_RANK, R_DEVICE, R_SEQ, R_EXTRA, R_T_BEGIN, R_T_END, R_ERROR, R_GRAPH, R_ORDINAL,
 R_GRAPH_NODES) = range(22)
# Runtime-only slots after the fields (never read by ``expand``): the expanded metadata when
# something needed it at the start, the open profiler range, the capture region's token.
R_META, R_RANGE, R_REGION = range(22, 25)


def expand(rec: list[Any] | dict[str, Any]) -> dict[str, Any]:
    """The metadata dict of a compact record (a dict is returned as it is)."""
    if isinstance(rec, dict):
        return rec
    info, op, esize = rec[R_INFO], rec[R_OP], rec[R_ESIZE]
    meta: dict[str, Any] = {
        COLLECTIVE_NAME: COLLECTIVE_NAMES.get(op, op),
        IN_NELEMS: rec[R_IN],
        OUT_NELEMS: rec[R_OUT],
        GROUP_SIZE: len(info.ranks),
        DTYPE: rec[R_DTYPE],
        IN_SPLIT: rec[R_IN_SPLIT],
        OUT_SPLIT: rec[R_OUT_SPLIT],
        PG_NAME: info.name,
        PG_DESC: info.desc,
        PG_RANKS: info.ranks_str,
        OP: op,
        KIND: rec[R_KIND],
        RANK: rec[R_RANK],
        LANE: info.lane,
        ASYNC: rec[R_ASYNC],
        BYTES_IN: rec[R_IN] * esize,
        BYTES_OUT: rec[R_OUT] * esize,
        CALLSITE: None if rec[R_FILE] is None else f"{rec[R_FILE]}:{rec[R_LINE]}",
        DEVICE: rec[R_DEVICE],
    }
    if rec[R_SEQ] is not None:
        meta[SEQ] = rec[R_SEQ]
    if rec[R_EXTRA]:
        meta.update(rec[R_EXTRA])
    for key, pos in ((T_BEGIN, R_T_BEGIN), (T_END, R_T_END), (ERROR, R_ERROR)):
        if rec[pos] is not None:
            meta[key] = rec[pos]
    if rec[R_GRAPH] is not None:                # captured; graph 0: its capture was not read
        meta[CAPTURED] = True
        if rec[R_GRAPH]:
            meta[GRAPH] = rec[R_GRAPH]
            meta[ORDINAL] = rec[R_ORDINAL]
        if rec[R_GRAPH_NODES] is not None:
            meta[GRAPH_NODES] = rec[R_GRAPH_NODES]
    return meta


def lane_id(pg_name: str) -> int:
    """A stable comm-lane id for a process group: the same on every rank and in every run."""
    return LANE_BASE + zlib.crc32(pg_name.encode()) % LANE_BASE


UNDESCRIBED = "undefined"   # torch's group_desc of a group made without one: new_group(ranks)
SHOWN_RANKS = 8             # a longer rank list is shown by its ends and its length


def group_ranks(value: object) -> tuple[int, ...]:
    """A group's ranks as records and the profiler write them (a list, or the profiler's
    "Process Group Ranks" text "[0, 1]"), or as ``ranks_text`` writes a large group's runs
    ("0-4, 6-16381 step 8"); () when there are none or they cannot be read."""
    if isinstance(value, (list, tuple)):
        return tuple(int(r) for r in value)
    return _ranks_of_text(str(value or ""))


@functools.lru_cache(maxsize=1024)
def _ranks_of_text(text: str) -> tuple[int, ...]:
    """``group_ranks`` of a text, read once per text: every instance of a group names its ranks
    with the same text, and a merge asks for them once per instance."""
    out: list[int] = []
    try:
        for part in text.strip().strip("[]").split(","):
            span, _, step = part.strip().partition(" step ")
            first, dash, last = span.partition("-")
            if dash:
                out.extend(range(int(first), int(last) + 1, int(step or 1)))
            elif span:
                out.append(int(span))
    except ValueError:
        return ()
    return tuple(out)


def ranks_text(ranks: Iterable[int]) -> str:
    """Ranks as runs, the way a person reads a large group and ``group_ranks`` reads back:
    ``0-4095``, ``13-16381 step 8``, ``0-4, 6-16381, 16383`` (a run of three or more with one
    step, as torch's "global rank start" and "stride" describe a group; ``a-b`` has step 1)."""
    t = sorted(set(ranks))
    out, i = [], 0
    while i < len(t):
        if i + 2 < len(t) and t[i + 1] - t[i] == t[i + 2] - t[i + 1]:
            step, j = t[i + 1] - t[i], i + 2
            while j + 1 < len(t) and t[j + 1] - t[j] == step:
                j += 1
            out.append(f"{t[i]}-{t[j]}" + (f" step {step}" if step != 1 else ""))
            i = j + 1
        elif i + 1 < len(t) and t[i + 1] == t[i] + 1:
            out.append(f"{t[i]}-{t[i + 1]}")
            i += 2
        else:
            out.append(str(t[i]))
            i += 1
    return ", ".join(out)


def group_label(desc: object, ranks: object) -> str:
    """How a process group is named to people: its description ("tp", "default_pg"), or, for a
    group made without one (``dist.new_group(ranks)``: torch says "undefined"), its ranks as
    torch lists them: "ranks [0, 2]" (a long list: "ranks [0, 8, 16, ..., 504] (64 ranks)")."""
    if desc and str(desc) != UNDESCRIBED:
        return str(desc)
    ranks = group_ranks(ranks)
    if not ranks:
        return str(desc or UNDESCRIBED)
    if len(ranks) <= SHOWN_RANKS:
        return f"ranks {list(ranks)}"
    head = ", ".join(map(str, ranks[:3]))
    return f"ranks [{head}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def origin_unit(args: dict[str, Any]) -> str | None:
    """The unit a call serves, from its metadata: "FSDP layers.0", "DDP bucket 2",
    "pipelining stage 0"; its origin where it names no unit."""
    kind, unit = args.get(ORIGIN_KIND), args.get(ORIGIN_UNIT)
    if kind is not None and unit is not None:
        return f"{kind} {unit or '<root>'}"
    return args.get(ORIGIN)


def group_title(pg: object, desc: object, ranks: object) -> str:
    """A process group as tables and the verdict name it: "3 (ranks [0, 2])", "0 (default_pg)",
    "d876ba23… (mesh_dp)"."""
    return f"{pg_shown(pg)} ({group_label(desc, ranks)})"


def pg_shown(pg: object) -> str:
    """A process group's name as people read it: torch's own, but a DeviceMesh group's, a
    40-digit hash of its ranks, cut to its first 8 digits (enough to tell a mesh's groups
    apart, and to find the whole name in a log)."""
    name = str(pg)
    if len(name) >= HASHED_PG_DIGITS and all(c in _HEX for c in name):
        return name[:8] + "…"
    return name


HASHED_PG_DIGITS = 32           # a group name this long, all hex digits: a hash, not a number
_HEX = frozenset("0123456789abcdef")


def fmt_bytes(n: int | None) -> str:
    """A size as people read it: "512 B", "8 KiB", "1.5 MiB"."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} B"


def fmt_ns(ns: int | float | None) -> str:
    """A duration as people read it: "850 ns", "12.5 µs", "3.2 ms", "120 s"."""
    if ns is None:
        return "-"
    ns = float(ns)
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if abs(ns) >= scale:
            digits = ".3g" if abs(ns) < 100 * scale else ".0f"
            return f"{ns / scale:{digits}} {unit}"
    return f"{ns:.0f} ns"


def fmt_gbps(v: float | None) -> str:
    """A bandwidth in GB/s, three digits."""
    return "-" if v is None else f"{v:.3g}"


def p2p_op(op: str | None, peer: int | None) -> str:
    """A point-to-point op's direction and peer as people read it: "send→1", "recv←0",
    "recv←any" (a receive from any source)."""
    name, arrow = ("send", "→") if op in ("send", "isend") else ("recv", "←")
    return f"{name}{arrow}{'any' if peer is None else peer}"


# Bytes per element of the c10 ScalarType names the profiler writes in "dtype".
DTYPE_BYTES = {
    "Bool": 1, "Byte": 1, "Char": 1, "UInt8": 1, "Int8": 1, "Short": 2, "UInt16": 2,
    "Half": 2, "BFloat16": 2, "Int": 4, "UInt32": 4, "Float": 4, "Long": 8, "UInt64": 8,
    "Double": 8, "ComplexHalf": 4, "ComplexFloat": 8, "ComplexDouble": 16,
    "Float8_e4m3fn": 1, "Float8_e5m2": 1, "Float8_e4m3fnuz": 1, "Float8_e5m2fnuz": 1,
}
# (the one table of element sizes: the matchers and the review read it, torch is not needed)


@dataclass
class GroupInfo:
    """What commviz needs of a process group, computed once per group (in the job, by
    ``commviz.record.process_groups``); a compact record's ``R_INFO`` holds it."""

    pg: Any
    name: str
    desc: str
    ranks: list[int]
    backend: str
    lane: int
    my_rank: int = 0                 # this process's global rank (the same for every group)
    member: bool = True              # False: this rank is not in the group (torch skips the call)
    ranks_str: str = ""
    first_seq: InitVar[int] = 0      # the group's last number before commviz saw it
    last_user_seq: int = 0           # annotations of communication outside c10d
    # The group's last collective sequence number taken, in a cell commviz's C++ kernel
    # numbers from in place too (one int64, never resized).
    seq_cell: array = field(init=False, repr=False)

    def __post_init__(self, first_seq: int) -> None:
        self.ranks_str = str(self.ranks)
        self.seq_cell = array("q", [first_seq])

    @property
    def last_seq(self) -> int:
        return self.seq_cell[0]

    @last_seq.setter
    def last_seq(self, value: int) -> None:
        self.seq_cell[0] = value

    @property
    def size(self) -> int:
        return len(self.ranks)

    def take_seq(self, slots: int = 1) -> int:
        """The next collective sequence number (a call may take several, as the backend's)."""
        cell = self.seq_cell
        seq = cell[0] + 1
        cell[0] += slots
        return seq

    def next_user_seq(self) -> int:
        self.last_user_seq += 1
        return self.last_user_seq

    def global_rank(self, group_rank: int) -> int:
        """A rank of this group as a global rank."""
        ranks = self.ranks
        return ranks[group_rank] if 0 <= group_rank < len(ranks) else group_rank

    def table_row(self) -> dict[str, Any]:
        return {"name": self.name, "desc": self.desc, "ranks": list(self.ranks),
                "backend": self.backend, "lane": self.lane}
