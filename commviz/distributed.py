"""Drop-in torch.distributed: ``import commviz.distributed as dist``.

Every collective and point-to-point function has torch.distributed's signature and returns what
torch returns (``async_op=True`` gives the real ``Work``). Each call is annotated
(``commviz.annotate``); everything else is torch.distributed itself, re-exported.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as _td
import torch.distributed.distributed_c10d as _c10d
from torch.distributed import *  # noqa: F401,F403 - the rest of the API, unchanged

from commviz import metadata as md
from commviz.annotate import NESTING, begin, invoke, _profiler_enabled
from commviz.record import recorder as _rec

ReduceOp = _td.ReduceOp
GroupMember = _td.GroupMember

# Newer torch spells two of them *_single (2.13+); wrap whichever this torch has.
WRAPPED = tuple(n for n in (
    "all_reduce", "all_reduce_coalesced", "broadcast", "all_gather", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "send", "recv", "isend",
    "irecv", "batch_isend_irecv", "barrier",
) if hasattr(_c10d, n))
# The real functions, taken before any patching.
RAW: dict[str, Callable[..., Any]] = {name: getattr(_c10d, name) for name in WRAPPED}
_raw_isend, _raw_irecv = RAW["isend"], RAW["irecv"]


def _quiet() -> bool:
    """Nothing to do: recording off and no profiler running, or inside ``unrecorded()``."""
    return NESTING.depth > 0 or (not _rec.RECORDER.enabled and not _profiler_enabled())


def _mirrors(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Give the wrapper torch's name, docs and (through ``__wrapped__``) signature."""
    return functools.wraps(RAW[name], assigned=("__module__", "__name__", "__qualname__",
                                                "__doc__", "__annotations__"))


def _global(group: Any, group_rank: int | None, global_rank: int | None) -> int | None:
    """A peer/root as a global rank, whichever way the caller gave it."""
    if global_rank is not None or group_rank is None:
        return global_rank
    try:
        return _c10d.get_global_rank(_c10d.GroupMember.WORLD if group is None else group,
                                     group_rank)
    except (ValueError, RuntimeError):  # a group this rank is not in: torch skips the call
        return None


def _group_size(group: Any) -> int:
    return md.group_info(group).size


_REDUCTIONS: dict[Any, dict[str, str]] = {}


def _reduction(op: Any) -> dict[str, str]:
    """A reduction's record extra: one shared dict per op (records only ever read it)."""
    try:
        return _REDUCTIONS[op]
    except KeyError:
        extra = _REDUCTIONS[op] = {md.REDUCE_OP: md.reduce_op_name(op)}
        return extra
    except TypeError:  # an op object that cannot be a key (a premul_sum with its factor)
        return {md.REDUCE_OP: md.reduce_op_name(op)}


def _splits(sizes: Any) -> str:
    return "[]" if not sizes else str(list(sizes))


@_mirrors("all_reduce")
def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    if _quiet():
        return RAW["all_reduce"](tensor, op, group, async_op)
    n = tensor.numel()
    return invoke(begin("all_reduce", group, tensor, n, n, async_op=async_op,
                        extra=_reduction(op)),
                  RAW["all_reduce"], tensor, op, group, async_op)


@_mirrors("broadcast")
def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    if _quiet():
        return RAW["broadcast"](tensor, src, group, async_op, group_src)
    n = tensor.numel()
    return invoke(begin("broadcast", group, tensor, n, n, async_op=async_op,
                        extra={md.ROOT: _global(group, group_src, src)}),
                  RAW["broadcast"], tensor, src, group, async_op, group_src)


@_mirrors("reduce")
def reduce(tensor, dst=None, op=ReduceOp.SUM, group=None, async_op=False, group_dst=None):
    if _quiet():
        return RAW["reduce"](tensor, dst, op, group, async_op, group_dst)
    n = tensor.numel()
    return invoke(begin("reduce", group, tensor, n, n, async_op=async_op,
                        extra={md.ROOT: _global(group, group_dst, dst),
                               md.REDUCE_OP: md.reduce_op_name(op)}),
                  RAW["reduce"], tensor, dst, op, group, async_op, group_dst)


@_mirrors("all_gather")
def all_gather(tensor_list, tensor, group=None, async_op=False):
    if _quiet():
        return RAW["all_gather"](tensor_list, tensor, group, async_op)
    n = tensor.numel()
    return invoke(begin("all_gather", group, tensor, n, n * _group_size(group), async_op=async_op),
                  RAW["all_gather"], tensor_list, tensor, group, async_op)


# torch >= 2.13 implements the older names through the *_single ones (module globals, so the
# patched wrapper would run twice): call the implementation directly.
_IMPL = {"all_gather_into_tensor": RAW.get("all_gather_single", RAW["all_gather_into_tensor"]),
         "reduce_scatter_tensor": RAW.get("reduce_scatter_single", RAW["reduce_scatter_tensor"])}


def _gather_into(op: str, output_tensor, input_tensor, group, async_op):
    fn = _IMPL.get(op) or RAW[op]
    if _quiet():
        return fn(output_tensor, input_tensor, group, async_op)
    return invoke(begin(op, group, input_tensor, input_tensor.numel(), output_tensor.numel(),
                        async_op=async_op, depth=3),
                  fn, output_tensor, input_tensor, group, async_op)


@_mirrors("all_gather_into_tensor")
def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    return _gather_into("all_gather_into_tensor", output_tensor, input_tensor, group, async_op)


if "all_gather_single" in RAW:
    @_mirrors("all_gather_single")
    def all_gather_single(output_tensor, input_tensor, group=None, async_op=False):
        return _gather_into("all_gather_single", output_tensor, input_tensor, group, async_op)


@_mirrors("reduce_scatter")
def reduce_scatter(output, input_list, op=ReduceOp.SUM, group=None, async_op=False):
    if _quiet():
        return RAW["reduce_scatter"](output, input_list, op, group, async_op)
    n = output.numel()
    return invoke(begin("reduce_scatter", group, output, n * _group_size(group), n,
                        async_op=async_op, extra=_reduction(op)),
                  RAW["reduce_scatter"], output, input_list, op, group, async_op)


def _scatter_from(name: str, output, input, op, group, async_op):
    fn = _IMPL.get(name) or RAW[name]
    if _quiet():
        return fn(output, input, op, group, async_op)
    return invoke(begin(name, group, input, input.numel(), output.numel(), async_op=async_op,
                        extra=_reduction(op), depth=3),
                  fn, output, input, op, group, async_op)


@_mirrors("reduce_scatter_tensor")
def reduce_scatter_tensor(output, input, op=ReduceOp.SUM, group=None, async_op=False):
    return _scatter_from("reduce_scatter_tensor", output, input, op, group, async_op)


if "reduce_scatter_single" in RAW:
    @_mirrors("reduce_scatter_single")
    def reduce_scatter_single(output, input, op=ReduceOp.SUM, group=None, async_op=False):
        return _scatter_from("reduce_scatter_single", output, input, op, group, async_op)


@_mirrors("all_reduce_coalesced")
def all_reduce_coalesced(tensors, op=ReduceOp.SUM, group=None, async_op=False):
    if _quiet() or not tensors:
        return RAW["all_reduce_coalesced"](tensors, op, group, async_op)
    n = sum(t.numel() for t in tensors)
    return invoke(begin("all_reduce_coalesced", group, tensors[0], n, n, async_op=async_op,
                        extra=_reduction(op)),
                  RAW["all_reduce_coalesced"], tensors, op, group, async_op)


@_mirrors("all_to_all")
def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    if _quiet():
        return RAW["all_to_all"](output_tensor_list, input_tensor_list, group, async_op)
    ins = [t.numel() for t in input_tensor_list]
    outs = [t.numel() for t in output_tensor_list]
    return invoke(begin("all_to_all", group, input_tensor_list[0] if input_tensor_list else None,
                        sum(ins), sum(ins), in_split=str(ins), out_split=str(outs),
                        async_op=async_op),
                  RAW["all_to_all"], output_tensor_list, input_tensor_list, group, async_op)


@_mirrors("all_to_all_single")
def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    if _quiet():
        return RAW["all_to_all_single"](output, input, output_split_sizes, input_split_sizes,
                                        group, async_op)
    call = begin("all_to_all_single", group, input, input.numel(), output.numel(),
                 in_split=_splits(input_split_sizes), out_split=_splits(output_split_sizes),
                 async_op=async_op)
    return invoke(call, RAW["all_to_all_single"], output, input, output_split_sizes,
                  input_split_sizes, group, async_op)


@_mirrors("gather")
def gather(tensor, gather_list=None, dst=None, group=None, async_op=False, group_dst=None):
    if _quiet():
        return RAW["gather"](tensor, gather_list, dst, group, async_op, group_dst)
    n = tensor.numel()
    return invoke(begin("gather", group, tensor, n, n * _group_size(group), async_op=async_op,
                        extra={md.ROOT: _global(group, group_dst, dst)}),
                  RAW["gather"], tensor, gather_list, dst, group, async_op, group_dst)


@_mirrors("scatter")
def scatter(tensor, scatter_list=None, src=None, group=None, async_op=False, group_src=None):
    if _quiet():
        return RAW["scatter"](tensor, scatter_list, src, group, async_op, group_src)
    n = tensor.numel()
    return invoke(begin("scatter", group, tensor, n * _group_size(group), n, async_op=async_op,
                        extra={md.ROOT: _global(group, group_src, src)}),
                  RAW["scatter"], tensor, scatter_list, src, group, async_op, group_src)


def _p2p(op: str, tensor: torch.Tensor, peer: int | None, group: Any, sending: bool,
         async_op: bool) -> Any:
    """Start a point-to-point call: its (group, src, dst) sequence number pairs it with the peer."""
    info = md.group_info(group)
    if not info.member:
        return None
    me = _c10d.get_rank()
    src, dst = (me, peer) if sending else (peer, me)
    n = tensor.numel()
    return begin(op, group, tensor, n, n, kind="p2p", async_op=async_op, depth=3,
                 extra={md.PEER: peer, md.SRC: src, md.DST: dst,
                        md.P2P_SEQ: info.next_p2p_seq(src, dst)})


@_mirrors("send")
def send(tensor, dst=None, group=None, tag=0, group_dst=None):
    if _quiet():
        return RAW["send"](tensor, dst, group, tag, group_dst)
    return invoke(_p2p("send", tensor, _global(group, group_dst, dst), group, True, False),
                  RAW["send"], tensor, dst, group, tag, group_dst)


@_mirrors("recv")
def recv(tensor, src=None, group=None, tag=0, group_src=None):
    if _quiet() or (src is None and group_src is None):  # recv-from-any: peer unknown up front
        return RAW["recv"](tensor, src, group, tag, group_src)
    return invoke(_p2p("recv", tensor, _global(group, group_src, src), group, False, False),
                  RAW["recv"], tensor, src, group, tag, group_src)


@_mirrors("isend")
def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    if _quiet():
        return _raw_isend(tensor, dst, group, tag, group_dst)
    return invoke(_p2p("isend", tensor, _global(group, group_dst, dst), group, True, True),
                  _raw_isend, tensor, dst, group, tag, group_dst)


@_mirrors("irecv")
def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    if _quiet() or (src is None and group_src is None):
        return _raw_irecv(tensor, src, group, tag, group_src)
    return invoke(_p2p("irecv", tensor, _global(group, group_src, src), group, False, True),
                  _raw_irecv, tensor, src, group, tag, group_src)


_TO_RAW = {isend: _raw_isend, irecv: _raw_irecv}


class P2POp(_td.P2POp):
    """torch's ``P2POp`` that also accepts commviz's ``isend``/``irecv``."""

    def __new__(cls, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        return super().__new__(cls, _TO_RAW.get(op, op), tensor, peer, group, tag, group_peer)

    def __init__(self, op, tensor, peer=None, group=None, tag=0, group_peer=None):
        super().__init__(_TO_RAW.get(op, op), tensor, peer, group, tag, group_peer)


@_mirrors("batch_isend_irecv")
def batch_isend_irecv(p2p_op_list):
    if _quiet() or not p2p_op_list:
        return RAW["batch_isend_irecv"](p2p_op_list)
    first = p2p_op_list[0]
    group = first.group
    info = md.group_info(group)
    if not info.member:
        return RAW["batch_isend_irecv"](p2p_op_list)
    me = _c10d.get_rank()
    peers, seqs, in_n, out_n = [], [], 0, 0
    for p in p2p_op_list:
        sending = _TO_RAW.get(p.op, p.op) is _raw_isend
        peer = _global(p.group, getattr(p, "group_peer", None), p.peer)
        src, dst = (me, peer) if sending else (peer, me)
        peers.append(f"{'send' if sending else 'recv'}:{peer}")
        seqs.append(str(info.next_p2p_seq(src, dst)))
        if sending:
            in_n += p.tensor.numel()
        else:
            out_n += p.tensor.numel()
    call = begin("batch_isend_irecv", group, first.tensor, in_n, out_n, kind="batch",
                 async_op=True, extra={md.PEERS: ",".join(peers), md.P2P_SEQ: ",".join(seqs)})
    return invoke(call, RAW["batch_isend_irecv"], p2p_op_list)


@_mirrors("barrier")
def barrier(group=None, async_op=False, device_ids=None, **kwargs):
    if _quiet():
        return RAW["barrier"](group, async_op, device_ids, **kwargs)
    return invoke(begin("barrier", group, None, 0, 0, async_op=async_op),
                  functools.partial(RAW["barrier"], **kwargs) if kwargs else RAW["barrier"],
                  group, async_op, device_ids)


WRAPPERS: dict[str, Callable[..., Any]] = {name: globals()[name] for name in WRAPPED}
