"""Algorithm and bus bandwidth of one collective, with the definitions nccl-tests uses.

nccl-tests reports two figures per collective (its ``doc/PERFORMANCE.md`` and the
``*GetBw`` function of each ``src/*.cu``), both in GB/s with 1 GB = 1e9 bytes:

- ``algbw = S / t``: ``S`` the collective's size in bytes as defined below, ``t`` its time;
- ``busbw = algbw * factor``: the bandwidth each rank's links must sustain, comparable
  across collective types and rank counts, so it is the figure to hold against the hardware.

``S`` and ``factor`` per type, ``n`` the number of ranks in the group:

===================  ===========================================  ===============
type                 S (bytes)                                    factor
===================  ===========================================  ===============
all_reduce           the buffer (input = output)                  2(n-1)/n
all_gather           the gathered output (n x each rank's input)  (n-1)/n
reduce_scatter       the input (n x each rank's output)           (n-1)/n
all_to_all           a rank's whole send buffer                   (n-1)/n
gather, scatter      the gathered / scattered total (n x part)    (n-1)/n
broadcast, reduce    the buffer                                   1
p2p (send/recv)      the message                                  1
barrier              0: no bandwidth                              -
===================  ===========================================  ===============

In commviz terms ``S`` is the larger of ``commviz.bytes_in`` / ``commviz.bytes_out`` for every
type above (the wrappers record totals that way); a trace without commviz's keys falls back
on the profiler's ``In/Out msg nelems`` times the size of its ``dtype``. With uneven splits
(``all_to_allv``) the ranks' sizes differ; an instance takes the largest, the rank that
bounds the transfer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from commviz import metadata as md

GB = 1e9

# torch.distributed function names and the profiler's "Collective name"s -> nccl-tests type.
COLLECTIVE_TYPES = {
    "all_reduce": "all_reduce", "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
    "_allgather_base": "all_gather", "allgather": "all_gather", "all_gather_single": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "allgather_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all", "all_to_allv": "all_to_all",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all",
    "gather": "gather", "scatter": "scatter",
    "broadcast": "broadcast", "reduce": "reduce",
    "send": "p2p", "recv": "p2p", "isend": "p2p", "irecv": "p2p",
    "batch_isend_irecv": "p2p",
    "barrier": "barrier",
}


def bus_factor(ctype: str, n: int) -> float | None:
    """nccl-tests' busbw / algbw ratio for ``ctype`` on ``n`` ranks; None where it has none."""
    if n < 1:
        return None
    if ctype == "all_reduce":
        return 2 * (n - 1) / n
    if ctype in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    if ctype in ("broadcast", "reduce", "p2p"):
        return 1.0
    return None




def collective_type(args: dict[str, Any]) -> str:
    """The nccl-tests type of a collective's metadata ("other" when unknown)."""
    for key in (md.OP, md.COLLECTIVE_NAME):
        name = args.get(key)
        if name in COLLECTIVE_TYPES:
            return COLLECTIVE_TYPES[name]
    return "other"


def size_bytes(args: dict[str, Any]) -> int | None:
    """``S`` of the table above for one rank's metadata; None when it cannot be told."""
    b_in, b_out = args.get(md.BYTES_IN), args.get(md.BYTES_OUT)
    if b_in is not None or b_out is not None:
        return max(int(b_in or 0), int(b_out or 0))
    esize = md.DTYPE_BYTES.get(str(args.get(md.DTYPE)))
    n_in, n_out = args.get(md.IN_NELEMS), args.get(md.OUT_NELEMS)
    if esize is None or (n_in is None and n_out is None):
        return None
    return max(int(n_in or 0), int(n_out or 0)) * esize


@dataclass(frozen=True, slots=True)
class Bandwidth:
    size_bytes: int
    time_ns: int
    algbw_gbps: float      # GB/s, 1e9 bytes
    busbw_gbps: float


def bandwidth(ctype: str, size: int | None, time_ns: int | None, n: int) -> Bandwidth | None:
    """algbw and busbw of ``size`` bytes moved in ``time_ns`` by ``n`` ranks (None if undefined)."""
    factor = bus_factor(ctype, n)
    if factor is None or not size or not time_ns or time_ns <= 0:
        return None
    algbw = size / (time_ns / 1e9) / GB
    return Bandwidth(int(size), int(time_ns), algbw, algbw * factor)
