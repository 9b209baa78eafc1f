"""FSDP2: the module's fully qualified name and the phase, from the ``FSDP::...`` profiler
ranges FSDP2 opens whether or not a profiler runs (``FSDP::all_gather (layers.0)`` inside
``FSDP::pre_forward`` / ``FSDP::pre_backward``, ``FSDP::post_backward_reduce``)."""

from __future__ import annotations

import re

from commviz import metadata as md
from commviz.record.origins.base import Call, Origin, Resolver
from commviz.record.origins.user_names import as_written

PREFIX = "FSDP::"
_RANGE = re.compile(r"FSDP::(\w+)(?: \((.*)\)| for (.*))?$")


def _resolve(call: Call, _: None) -> Origin | None:
    parsed = [m.groups() for n in call.ranges if (m := _RANGE.match(n))]
    if not parsed:
        return None
    op = call.op
    labels = [label for label, _, _ in parsed]
    backward = any("backward" in label for label in labels)
    for label, fqn, target in reversed(parsed):
        if label in ("post_backward_reduce", "post_backward_rs_wait"):
            phase = "reduce-scatter" if op.startswith("reduce_scatter") else op.replace("_", "-")
            break
        if label == "all_gather":
            phase = ("backward" if backward else "forward") + " all-gather"
            break
    else:
        label, fqn, target = parsed[-1]
        phase = label.replace("_", " ")
    unit = as_written(fqn if fqn is not None else (target or ""))
    return Origin(f"FSDP {phase} ({unit or '<root>'})", md.OriginKind.FSDP, unit, phase)


RESOLVER = Resolver("FSDP", _resolve, prefixes=(PREFIX,))
