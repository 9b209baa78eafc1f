"""Which parameters a DDP reducer's bucket holds when no comm hook runs.

With a comm hook, torch hands the hook each ``GradBucket``. Without one, nobody sees it, and
the reducer's own account of its buckets (``Reducer._get_zeros_like_grad_buckets``: the
``GradBucket`` s a hook would get) locks the reducer's mutex, which the reducer holds while it
issues a bucket's all_reduce: it cannot be read on the recording path. So it is read when a
DDP forward ends (the boundary kernel calls ``learn`` as a ``DistributedDataParallel.forward``
range exits), where nothing holds that mutex, once per layout of the buckets: the reducer lays
them out when DDP is built, and once more (``_has_rebuilt_buckets``), in the order the
gradients became ready, in the second forward. Once a layout is known, ``learn`` costs a frame
walk per forward.

That call would also allocate a zeroed copy of every bucket, on its device. Under ``_NoCopies``
(a ``TorchDispatchMode``) the copies are meta tensors: no memory, no kernel (a profiler running
then sees the two ops). Each bucket's parameters are listed in the reducer's order
(``GradBucket.parameters()``'s). With ``find_unused_parameters``, the reducer's last all_reduce
of a backward is not a bucket but its map of the parameters used (``used_map``).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, NamedTuple


class Bucket(NamedTuple):
    params: int
    nbytes: int
    first: str | None
    last: str | None


class _Layout(NamedTuple):
    rebuilt: bool                   # the reducer's ``_has_rebuilt_buckets`` it was read at
    buckets: tuple[Bucket, ...]
    params: int                     # parameters the reducer reduces


_layouts: "weakref.WeakKeyDictionary[Any, _Layout]" = weakref.WeakKeyDictionary()
# the same, as the recording path reads it (autograd threads, while a forward may write):
# replaced whole at each write, never changed in place
_known: tuple[tuple[Any, _Layout], ...] = ()
_forward_code: Any = None


def _rebuilt(ddp: Any) -> bool:
    return bool(getattr(ddp, "_has_rebuilt_buckets", False))


def _no_copies() -> Any:
    """A dispatch mode under which the reducer's zeroed bucket copies are meta tensors."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    copies = (torch.ops.aten.zeros_like.default, torch.ops.aten.empty_like.default)

    class _NoCopies(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                               kwargs: Any = None) -> Any:
            if func in copies:
                return torch.empty_like(args[0], device="meta")
            return func(*args, **(kwargs or {}))

    return _NoCopies()


def _read(ddp: Any) -> _Layout:
    names = {id(p): n for n, p in ddp.module.named_parameters()}
    with _no_copies():
        grad_buckets = ddp.reducer._get_zeros_like_grad_buckets()
    buckets = []
    for b in grad_buckets:
        params = b.parameters()
        buffer = b.buffer()
        buckets.append(Bucket(len(params), buffer.numel() * buffer.element_size(),
                              names.get(id(params[0])) if params else None,
                              names.get(id(params[-1])) if params else None))
    return _Layout(_rebuilt(ddp), tuple(buckets), sum(b.params for b in buckets))


def _note(ddp: Any) -> None:
    global _known
    try:
        _layouts[ddp] = _read(ddp)
    except Exception:   # noqa: BLE001 - a reducer unlike torch's: its buckets go unnamed
        _layouts[ddp] = _Layout(_rebuilt(ddp), (), 0)
    _known = tuple((weakref.ref(d), layout) for d, layout in list(_layouts.items()))


def learn() -> None:
    """At a DDP forward's end (called by the boundary kernel): read the buckets of the DDP
    whose forward it was, if their layout is new."""
    global _forward_code
    if _forward_code is None:
        from torch.nn.parallel import DistributedDataParallel

        _forward_code = DistributedDataParallel.forward.__code__
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return
        if frame.f_code is _forward_code:
            ddp = frame.f_locals["self"]
            known = _layouts.get(ddp)
            if known is None or known.rebuilt != _rebuilt(ddp):
                _note(ddp)
            return
        frame = frame.f_back


def _now(ddp: Any, layout: _Layout) -> tuple[Bucket, ...]:
    """The buckets ``ddp``'s reducer holds now, where known."""
    return layout.buckets if layout.rebuilt == _rebuilt(ddp) else ()


def lookup(index: int, nbytes: int) -> Bucket | None:
    """Bucket ``index`` (of ``nbytes``) of the known DDP reducer it fits (None when no known
    DDP's fits, or several do)."""
    found = [buckets[index] for ref, layout in _known if (ddp := ref()) is not None
             and index < len(buckets := _now(ddp, layout)) and buckets[index].nbytes == nbytes]
    return found[0] if len(found) == 1 else None


def used_map(index: int, numel: int) -> bool:
    """Whether the reducer's all_reduce ``index`` is a known DDP's map of the parameters used
    (one element per parameter, right after its last bucket)."""
    return any((ddp := ref()) is not None and getattr(ddp, "find_unused_parameters", False)
               and numel == layout.params and 0 < index == len(_now(ddp, layout))
               for ref, layout in _known)
