"""``annotate_collective``: metadata for communication the user issues outside c10d.

Collectives that reach c10d are recorded where they enter it (``commviz.record.boundary``),
whoever issues them. ``annotate_collective`` is for the rest: a custom kernel, a library that
talks to the network itself. Its block gets one record (``commviz.record.calls``), a profiler
range while a profiler runs (``commviz::<name>``, given the record's metadata after the job by
``commviz annotate`` and the merge), and under CUDA graph capture the graph nodes it added. A
c10d collective issued inside the block is that same call: it is not recorded again, and takes
the annotation's sequence number.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from commviz import metadata as md
from commviz.capture import region  # noqa: F401 - connects the capture hand-off (its graph nodes)
from commviz.record import calls, capturing, process_groups
from commviz.record.recorder import RECORDER

# Keyword names of annotate_collective's **extra that map onto commviz keys.
_EXTRA_KEYS = {
    "root": md.ROOT, "src": md.SRC, "dst": md.DST, "peer": md.PEER, "reduce_op": md.REDUCE_OP,
    "async_op": md.ASYNC, "in_split": md.IN_SPLIT, "out_split": md.OUT_SPLIT, "kind": md.KIND,
}
_P2P = frozenset({"send", "recv", "isend", "irecv"})
_Tensor = torch.Tensor


def _nelems(tensors: torch.Tensor | Iterable[torch.Tensor] | None) -> tuple[int, torch.Tensor | None]:
    if tensors is None:
        return 0, None
    if isinstance(tensors, _Tensor):
        return tensors.numel(), tensors
    items: Sequence[torch.Tensor] = list(tensors)
    return sum(t.numel() for t in items), (items[0] if items else None)


def _mapped(name: str, extra: dict[str, Any]) -> tuple[str, str, str, bool, dict[str, Any]]:
    """The block's kind, split sizes, async flag and other extras under commviz's keys."""
    mapped: dict[str, Any] = {}
    for key, value in extra.items():
        target = _EXTRA_KEYS.get(key, key)
        if target == md.REDUCE_OP and not isinstance(value, str):
            value = process_groups.reduce_op_name(value)
        if target in (md.IN_SPLIT, md.OUT_SPLIT) and not isinstance(value, str):
            value = str(list(value))
        mapped[target] = value
    kind = mapped.pop(md.KIND, "p2p" if name in _P2P else "collective")
    return (kind, mapped.pop(md.IN_SPLIT, "[]"), mapped.pop(md.OUT_SPLIT, "[]"),
            bool(mapped.pop(md.ASYNC, False)), mapped)


class annotate_collective(calls.Claim):  # noqa: N801 - used like a function, as record_function is
    """Annotate a collective (or any communication) issued inside the ``with`` block.

    ``name`` is a torch.distributed function name ("all_reduce") or any label; ``input`` and
    ``output`` are tensors or lists of tensors; ``group`` is the process group (``None``: world).
    Keyword extras ``root``, ``src``, ``dst``, ``peer``, ``reduce_op``, ``async_op``,
    ``in_split``, ``out_split`` map onto commviz's keys; any other extra is kept as given.
    The ``with`` statement yields the metadata dict. The block is its own ``calls.Claim``
    (one object a block: it costs less than ``torch.profiler.record_function``).
    """

    __slots__ = ("_name", "_input", "_output", "_group", "_extra")

    def __init__(self, name: str, input: Any, output: Any, group: Any = None,
                 **extra: Any) -> None:
        self._name = name
        self._input = input
        self._output = output
        self._group = group
        self._extra = extra

    def __enter__(self) -> dict[str, Any]:
        name, inp, out = self._name, self._input, self._output
        in_n, tensor = (inp.numel(), inp) if isinstance(inp, _Tensor) else _nelems(inp)
        out_n, out_tensor = ((in_n, tensor) if out is inp else
                             (out.numel(), out) if isinstance(out, _Tensor) else _nelems(out))
        info = process_groups.group_info(self._group)
        if not info.member:               # torch skips calls on groups this rank is not in
            self.rec, self.open = None, False
            calls.push_scope(self)
            return {}
        first = tensor if tensor is not None else out_tensor
        if first is None:
            torch_dtype, device = None, "cpu"
        else:
            torch_dtype = first.dtype
            device = "cpu" if first.is_cpu else "cuda" if first.is_cuda else first.device.type
        site = calls.callsite()
        if self._extra:
            rec = self._open(name, info, in_n, out_n, torch_dtype, device, site)
        else:
            rec = key = None
            seq = None if name in _P2P else info.last_seq + 1     # as ``_open`` numbers it
            # a CUDA block is captured only where its stream is (without commviz's capture
            # hooks in, any capture may be open: ask the stream, not the long path)
            if not (device == "cuda" and capturing.capture_possible()
                    and capturing.capturing_here()):
                native = RECORDER.origins.native
                key = (site, native.current_origin() if native is not None else 0, name,
                       id(info), in_n, out_n, torch_dtype, device, seq is None)
                rec = calls.open_repeated(key, info, seq)
            if rec is None:
                rec = self._open(name, info, in_n, out_n, torch_dtype, device, site)
                if key is not None:
                    calls.remember(key, rec)
        self.rec, self.open = rec, True
        calls.push_scope(self)
        return rec[md.R_META]

    def _open(self, name: str, info: md.GroupInfo, in_n: int, out_n: int, torch_dtype: Any,
              device: str, site: tuple[str | None, int | None]) -> list[Any]:
        """The block's record the long way: its extras mapped, its shape worked out."""
        if self._extra:
            kind, in_split, out_split, async_op, mapped = _mapped(name, self._extra)
        else:
            kind, in_split, out_split, async_op, mapped = (
                "p2p" if name in _P2P else "collective", "[]", "[]", False, None)
        dtype, esize = (("Byte", 0) if torch_dtype is None
                        else process_groups.dtype_info(torch_dtype))
        # the number torch gives the next collective on the group; taken only if one runs
        seq = info.last_seq + 1 if kind == "collective" else None
        return calls.open_record(name, kind, info, in_n, out_n, dtype, esize, device, in_split,
                                 out_split, async_op, mapped, site, seq, want_meta=True)

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        calls.pop_scope()
        rec = self.rec
        if rec is not None:
            if self.open:                 # no c10d collective inside took it
                self.close()
            calls.finish_record(rec, None if exc is None else repr(exc))
        self.rec, self.open = None, False
