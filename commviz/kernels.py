"""What a GPU kernel's name says: its class, and for NCCL kernels the collective, reduction, dtype.

Handles both NCCL naming schemes, old (``ncclKernel_AllReduce_RING_LL_Sum_float``) and new
(``ncclDevKernel_AllReduce_Sum_f32_RING_LL(...)``), and mangled names from ``cuFuncGetName``
(``_Z39ncclDevKernel_...``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

COMM, GEMM, MEMORY, OTHER = "communication", "gemm", "memcpy/memset", "other"
KERNEL_CLASSES = (COMM, GEMM, MEMORY, OTHER)

SENDRECV = "SendRecv"          # p2p, all_to_all and coalesced groups: NCCL's one kernel for them
_NCCL_COLLS = ("AllReduce", "AllGather", "ReduceScatter", "Broadcast", "Reduce", SENDRECV,
               "Generic")
_REDUCTIONS = {"Sum": "sum", "Prod": "product", "Max": "max", "Min": "min",
               "PreMulSum": "premul_sum", "SumPostDiv": "avg", "MinMax": "minmax"}
# NCCL dtype tokens (new and old schemes) -> c10 ScalarType names, the profiler's "dtype".
_DTYPES = {
    "f32": "Float", "float": "Float", "f16": "Half", "half": "Half", "bf16": "BFloat16",
    "__nv_bfloat16": "BFloat16", "f64": "Double", "double": "Double", "i8": "Char",
    "int8_t": "Char", "u8": "Byte", "uint8_t": "Byte", "i32": "Int", "int32_t": "Int",
    "u32": "UInt32", "uint32_t": "UInt32", "i64": "Long", "int64_t": "Long", "u64": "UInt64",
    "uint64_t": "UInt64", "f8e4m3": "Float8_e4m3fn", "f8e5m2": "Float8_e5m2",
}
# Which eager "Collective name"s each NCCL kernel type can carry out.
COLLECTIVES_FOR_KERNEL = {
    "AllReduce": {"allreduce", "allreduce_coalesced", "barrier"},
    "AllGather": {"_allgather_base", "all_gather", "allgather_into_tensor_coalesced",
                  "allgather_coalesced"},
    "ReduceScatter": {"_reduce_scatter_base", "reduce_scatter",
                      "reduce_scatter_tensor_coalesced"},
    "Broadcast": {"broadcast"},
    "Reduce": {"reduce"},
    "SendRecv": {"all_to_all", "all_to_allv", "send", "recv", "batch_isend_irecv", "gather",
                 "scatter"},
}
_GEMM_RE = re.compile(r"gemm|nvjet|cutlass|xmma|matmul|cublas|wgmma|sm\d+_.*_tn|_nt_|_tt_",
                      re.IGNORECASE)
_MANGLED = re.compile(r"^_Z\d+")


@dataclass(frozen=True, slots=True)
class NcclKernel:
    """The parts of an NCCL kernel name."""

    collective: str            # "AllReduce", "SendRecv", ...
    reduction: str | None      # "sum", ... (None where the kernel does not reduce)
    dtype: str | None          # c10 name ("Float"), None where the name has none
    algorithm: str | None      # "RING", "TREE", ...
    protocol: str | None       # "LL", "LL128", "SIMPLE"

    def can_run(self, collective_name: str) -> bool:
        """Whether an eager "Collective name" can be carried out by this kernel type."""
        return collective_name in COLLECTIVES_FOR_KERNEL.get(self.collective, ())


@lru_cache(maxsize=4096)
def parse_nccl(name: str) -> NcclKernel | None:
    """Parse an NCCL kernel name; ``None`` if it is not one."""
    base = _MANGLED.sub("", name).split("(", 1)[0]
    if not (base.startswith("ncclDevKernel_") or base.startswith("ncclKernel_")):
        return None
    parts = base.split("_")[1:]
    if not parts or parts[0] not in _NCCL_COLLS:
        # names like ncclDevKernel_Generic_4 or unknown future kinds
        return NcclKernel(parts[0] if parts else "Unknown", None, None, None, None)
    coll, rest = parts[0], parts[1:]
    reduction = dtype = algorithm = protocol = None
    i = 0
    while i < len(rest):
        tok = rest[i]
        two = f"{tok}_{rest[i + 1]}" if i + 1 < len(rest) else None
        if tok in _REDUCTIONS:
            reduction = _REDUCTIONS[tok]
        elif tok in _DTYPES:
            dtype = _DTYPES[tok]
        elif two in _DTYPES:
            dtype = _DTYPES[two]
            i += 1
        elif tok in ("RING", "TREE", "NVLS", "PAT", "COLLNET", "COLLNETDIRECT", "COLLNETCHAIN"):
            algorithm = tok
        elif tok in ("LL", "LL128", "SIMPLE"):
            protocol = tok
        elif tok in ("t", "nv") and algorithm is None:
            pass
        i += 1
    return NcclKernel(coll, reduction, dtype, algorithm, protocol)


_KNOWN_COLLECTIVES = frozenset().union(*COLLECTIVES_FOR_KERNEL.values())
# The NCCL dtype ProcessGroupNCCL hands a tensor of this dtype to (bytes, or the real part).
_SENT_AS = {"Bool": "Byte", "ComplexFloat": "Float", "ComplexDouble": "Double",
            "ComplexHalf": "Half", "Float8_e4m3fn": "Byte", "Float8_e5m2": "Byte"}
# NCCL builds its reductions' kernels for unsigned integers only and runs a signed integer's
# reduction in the unsigned twin (src/device/generate.py, ``equivalent_primary``: an int64 sum
# is ``ncclDevKernel_AllReduce_Sum_u64_...``; seen on 4 x H200, NCCL 2.28.9, where the
# profiler's own keys on that kernel say dtype Long).
_REDUCED_AS = {"Char": "Byte", "Int": "UInt32", "Long": "UInt64"}
# Kernel reductions that can carry out a recorded reduce op other than their own name.
_REDUCTION_FITS = {"avg": {"avg", "premul_sum", "sum"}, "premul_sum": {"premul_sum"}}


def is_sendrecv(name: str) -> bool:
    """Whether ``name`` (a kernel name or key) is NCCL's SendRecv kernel."""
    nk = parse_nccl(name)
    return nk is not None and nk.collective == SENDRECV


def incompatibility(kernel: NcclKernel, meta: dict[str, Any]) -> str | None:
    """Why ``kernel`` cannot be the collective whose metadata is ``meta`` (None: it can).

    NCCL 2.28 runs max, min and product in the kernel named ``..._Sum_...`` (seen on the
    H200s, eager and graphed alike), so a sum kernel fits any reduction; a signed integer's
    reduction runs in the unsigned type's kernel (``_REDUCED_AS``).
    """
    coll = meta.get("Collective name")
    if coll in _KNOWN_COLLECTIVES and not kernel.can_run(str(coll)):
        return f"a {kernel.collective} kernel cannot carry out {coll!r}"
    # a barrier records no tensor (dtype Byte, as the profiler's keys): NCCL all-reduces one
    # Float zero for it (ProcessGroupNCCL::barrier)
    dtype = meta.get("dtype") if coll != "barrier" else None
    reduced = _REDUCED_AS.get(dtype) if kernel.reduction is not None else None
    if kernel.dtype is not None and dtype is not None and kernel.dtype not in (
            dtype, _SENT_AS.get(dtype), reduced):
        return f"kernel dtype {kernel.dtype} but the call's dtype is {dtype}"
    op, red = meta.get("commviz.reduce_op"), kernel.reduction
    if op and red and red != "sum" and red != op and red not in _REDUCTION_FITS.get(op, ()):
        return f"kernel reduction {red} but the call reduces by {op}"
    return None


@lru_cache(maxsize=65536)
def classify(name: str, category: str = "kernel") -> str:
    """communication | gemm | memcpy/memset | other, for a GPU event's name and category."""
    if category in ("gpu_memcpy", "gpu_memset") or name.startswith(("Memcpy", "Memset")):
        return MEMORY
    if "nccl" in name.lower():
        return COMM
    if _GEMM_RE.search(name):
        return GEMM
    return OTHER


# Profiler event categories, for every stage that reads traces. Kineto's first releases
# (PyTorch 1.8 era, 2021) spelled them "Kernel", "Memcpy", "Memset" and "Runtime".
GPU_WORK_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset",       # work a GPU stream ran
                           "Kernel", "Memcpy", "Memset"})
GPU_CATS = GPU_WORK_CATS | {"gpu_user_annotation"}                    # on the GPU's timeline
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver", "Runtime"})   # calls that launch GPU work
LAUNCH_CAT = "ac2g"                   # Kineto's launch flows (id: the launch's correlation)
GRAPH_LAUNCH_CBIDS = frozenset({311, 312})    # runtime API: cudaGraphLaunch(_ptsz)_v10000
GRAPH_LAUNCH_NAMES = ("cudaGraphLaunch", "cuGraphLaunch")


def is_graph_launch(name: str, category: str, args: dict[str, Any]) -> bool:
    """Whether a CPU-side launch event (``cuda_runtime``/``cuda_driver``) launched a CUDA graph:
    every kernel of that replay then shares its ``correlation``. The callback ids are runtime
    API numbers, so they count only on runtime events."""
    return category in LAUNCH_CATS and (name.startswith(GRAPH_LAUNCH_NAMES) or (
        category == "cuda_runtime" and args.get("cbid") in GRAPH_LAUNCH_CBIDS))


GRAPH_NODE_ID = "graph node id"   # torch >= 2.12: CUPTI's node id of a graphed kernel, 0 if eager


def graph_node_id(args: dict[str, Any]) -> int:
    """A kernel's CUPTI graph node id, 0 when it has none (eager kernels of torch >= 2.12)."""
    try:
        return int(args.get(GRAPH_NODE_ID) or 0)
    except (TypeError, ValueError):
        return 0


def is_graphed(args: dict[str, Any], graph_launches: set[Any] | dict[Any, Any]) -> bool:
    """The one rule for "did this GPU kernel run in a CUDA graph replay": it carries a non-zero
    graph node id, or its ``correlation`` is that of a graph launch (``is_graph_launch``)."""
    return graph_node_id(args) != 0 or args.get("correlation") in graph_launches
