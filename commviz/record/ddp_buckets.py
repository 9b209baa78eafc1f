"""Which parameters a DDP reducer's bucket holds when no comm hook runs.

With a comm hook, torch hands the hook each ``GradBucket``. Without one, nobody sees it, and
the reducer's own accounts of its buckets (``Reducer._get_zeros_like_grad_buckets``, the DDP
logger) lock the reducer's mutex, which the reducer holds while it issues a bucket's
all_reduce: they cannot be read on the recording path. So they are read when a DDP forward
ends (the boundary kernel calls ``learn`` as a ``DistributedDataParallel.forward`` range
exits; once a DDP's buckets are known that costs a frame walk per forward), where nothing
holds that mutex:

- before the reducer rebuilds its buckets (the first iteration, and every iteration of a DDP
  with ``find_unused_parameters`` and no static graph): torch's own
  ``_compute_bucket_assignment_by_size`` over the reducer's parameters, with the logger's
  construction-time bucket sizes as the limits; kept only if it gives the logger's sizes;
- after the rebuild: the logger's ``rebuilt_per_bucket_param_indices``. The logger writes
  them at the forward after the rebuild's, so the first rebuilt iteration's buckets are
  named by index and size only.

Each bucket's parameters are listed in the reducer's order (``GradBucket.parameters()``'s).
With ``find_unused_parameters``, the reducer's last all_reduce of a backward is not a bucket
but its map of the parameters used (``used_map``).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, NamedTuple


class Bucket(NamedTuple):
    params: int
    nbytes: int
    first: str
    last: str


class _Tables(NamedTuple):
    names: tuple[str, ...]          # the reducer's parameters, by its variable index
    nbytes: tuple[int, ...]
    buckets: dict[bool, tuple[Bucket, ...]]   # rebuilt? -> buckets in the reducer's order


_tables: "weakref.WeakKeyDictionary[Any, _Tables]" = weakref.WeakKeyDictionary()
_forward_code: Any = None


def _reducer_params(ddp: Any) -> list[tuple[str, Any]]:
    """The parameters the reducer was given, in its order (DDP's ``_build_params_for_reducer``:
    the module's parameters that need a gradient, less those DDP was told to ignore)."""
    ignored = getattr(ddp, "parameters_to_ignore", set())
    return [(n, p) for n, p in ddp.module.named_parameters()
            if p.requires_grad and n not in ignored]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def _buckets(tables: _Tables, indices: list[list[int]], sizes: list[int]) -> tuple[Bucket, ...]:
    buckets = tuple(Bucket(len(ix), sum(tables.nbytes[i] for i in ix),
                           tables.names[ix[0]], tables.names[ix[-1]]) for ix in indices if ix)
    return buckets if [b.nbytes for b in buckets] == sizes else ()


def _initial(tables: _Tables, params: list[Any], sizes: list[int]) -> tuple[Bucket, ...]:
    import torch.distributed as dist

    if not sizes:
        return ()
    limits = list(reversed(sizes))          # the logger lists them in the reducer's order
    indices, _ = dist._compute_bucket_assignment_by_size(params, limits, [False] * len(params))
    return _buckets(tables, list(reversed(indices)), sizes)


def _update(ddp: Any) -> None:
    tables = _tables.get(ddp)
    rebuilt = bool(getattr(ddp, "_has_rebuilt_buckets", False))
    if tables is not None and (rebuilt in tables.buckets or not rebuilt):
        return
    data = ddp._get_ddp_logging_data()      # locks the reducer's mutex: free at a forward's end
    if tables is None:
        named = _reducer_params(ddp)
        tables = _tables[ddp] = _Tables(tuple(n for n, _ in named),
                                        tuple(p.numel() * p.element_size() for _, p in named), {})
        if len(named) != data.get("num_parameter_tensors"):     # not the reducer's: name none
            tables.buckets.update({False: (), True: ()})
            return
        tables.buckets[False] = _initial(tables, [p for _, p in named],
                                         _ints(str(data.get("bucket_sizes", ""))))
    if rebuilt and data.get("has_rebuilt_buckets"):
        indices = [_ints(part) for part in
                   str(data.get("rebuilt_per_bucket_param_indices", "")).split(",")]
        tables.buckets[True] = _buckets(tables, indices,
                                        _ints(str(data.get("rebuilt_bucket_sizes", ""))))


def learn() -> None:
    """At a DDP forward's end (called by the boundary kernel): note the buckets of the DDP
    whose forward it was, if they are not known yet."""
    global _forward_code
    if _forward_code is None:
        from torch.nn.parallel import DistributedDataParallel

        _forward_code = DistributedDataParallel.forward.__code__
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return
        if frame.f_code is _forward_code:
            _update(frame.f_locals["self"])
            return
        frame = frame.f_back


def _now(ddp: Any, tables: _Tables) -> tuple[Bucket, ...]:
    """The buckets ``ddp``'s reducer holds now, where known."""
    return tables.buckets.get(bool(getattr(ddp, "_has_rebuilt_buckets", False)), ())


def lookup(index: int, nbytes: int) -> Bucket | None:
    """Bucket ``index`` (of ``nbytes``) of the known DDP reducer it fits (None when no known
    DDP's fits, or several do)."""
    found = [buckets[index] for ddp, t in list(_tables.items())
             if index < len(buckets := _now(ddp, t)) and buckets[index].nbytes == nbytes]
    return found[0] if len(found) == 1 else None


def used_map(index: int, numel: int) -> bool:
    """Whether the reducer's all_reduce ``index`` is a known DDP's map of the parameters used
    (one element per parameter, right after its last bucket)."""
    return any(getattr(ddp, "find_unused_parameters", False) and numel == len(t.names)
               and 0 < index == len(_now(ddp, t)) for ddp, t in list(_tables.items()))
