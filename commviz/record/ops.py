"""c10d's collective and point-to-point ops, as the boundary recorder sees them.

One table (``OPS``) says, per dispatcher op, what commviz calls it, which arguments hold the
tensors sent and received, what kind of call it is and how many of its group's sequence
numbers it takes; the boundary kernel (``boundary``) and the record builder (``calls``) both
read it. An op's code is its index here.
"""

from __future__ import annotations

from typing import NamedTuple


class OpSpec(NamedTuple):
    """A c10d op: commviz's name for it, where its tensors are, what kind of call it is."""

    op: str          # commviz.op, named after the torch.distributed function that issues it
    sent: str        # argument with the tensors sent
    received: str    # argument with the tensors received ("" : the same as ``sent``)
    kind: str = "collective"   # "collective" | "p2p"
    slots: int = 1   # sequence numbers it takes (gloo's monitored_barrier uses two tags)
    slots_per_rank: bool = False  # gloo runs it as one all_reduce per rank of the group
    barrier: bool = False      # its tensor is a placeholder: nothing is sent
    any_source: bool = False   # a receive whose peer is known only when it completes
    split_by_tensor: bool = False  # no split sizes: each rank's tensor of the lists is its split


# Every c10d collective and point-to-point op, by its dispatcher name. The code passed to the
# callbacks is an op's index here. Other argument positions come from the op's schema.
OPS: dict[str, OpSpec] = {
    "allreduce_": OpSpec("all_reduce", "tensors", ""),
    "allreduce_coalesced_": OpSpec("all_reduce_coalesced", "tensors", ""),
    "broadcast_": OpSpec("broadcast", "tensors", ""),
    "reduce_": OpSpec("reduce", "tensors", ""),
    "allgather_": OpSpec("all_gather", "input_tensors", "output_tensors"),
    "_allgather_base_": OpSpec("all_gather_into_tensor", "input_tensor", "output_tensor"),
    "allgather_coalesced_": OpSpec("all_gather_coalesced", "input_list", "output_lists"),
    "allgather_into_tensor_coalesced_": OpSpec("all_gather_into_tensor_coalesced", "inputs",
                                               "outputs"),
    "reduce_scatter_": OpSpec("reduce_scatter", "input_tensors", "output_tensors",
                              slots_per_rank=True),
    "_reduce_scatter_base_": OpSpec("reduce_scatter_tensor", "input_tensor", "output_tensor"),
    "reduce_scatter_tensor_coalesced_": OpSpec("reduce_scatter_tensor_coalesced", "inputs",
                                               "outputs"),
    "alltoall_": OpSpec("all_to_all", "input_tensors", "output_tensors", split_by_tensor=True),
    "alltoall_base_": OpSpec("all_to_all_single", "input", "output"),
    "gather_": OpSpec("gather", "input_tensors", "output_tensors"),
    "scatter_": OpSpec("scatter", "input_tensors", "output_tensors"),
    "barrier": OpSpec("barrier", "tensor", "", barrier=True),
    "monitored_barrier_": OpSpec("monitored_barrier", "tensor", "", slots=2, barrier=True),
    "send": OpSpec("send", "tensors", "", kind="p2p"),
    "recv_": OpSpec("recv", "tensors", "", kind="p2p"),
    "recv_any_source_": OpSpec("recv", "tensors", "", kind="p2p", any_source=True),
}
CODES: tuple[str, ...] = tuple(OPS)
