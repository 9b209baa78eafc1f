"""One rule for "this kernel ran in a CUDA graph", read the same by the matcher and the review.

torch >= 2.12 writes ``"graph node id": 0`` on eager kernels and CUPTI's node id on graphed
ones. A real eager H200 trace (tests/fixtures/gpu/eager) given that key, as torch 2.12 writes
it, must stay eager everywhere; the same trace with non-zero ids must be graphed everywhere.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from commviz.match import match_rank
from commviz.record.store import load_record
from commviz.trace.gpu import gpu_ops
from commviz.trace.load import load_trace

EAGER = Path(__file__).parent / "fixtures" / "gpu" / "eager"


def _with_node_ids(tmp_path: Path, value_of: callable) -> Path:
    doc = json.load(gzip.open(EAGER / "trace_rank0.json.gz"))
    kernels = 0
    for i, ev in enumerate(doc["traceEvents"]):
        if ev.get("cat") == "kernel":
            ev.setdefault("args", {})["graph node id"] = value_of(i)
            kernels += 1
    assert kernels > 10
    out = tmp_path / "trace_rank0.json.gz"
    with gzip.open(out, "wt") as f:
        json.dump(doc, f)
    return out


@pytest.mark.parametrize("node_id, graphed", [(lambda i: 0, False),
                                              (lambda i: (2 << 32) | i, True)],
                         ids=["eager-0", "graphed"])
def test_matcher_and_review_agree_on_graph_node_ids(tmp_path: Path, node_id, graphed) -> None:
    trace = load_trace(_with_node_ids(tmp_path, node_id), rank=0)
    ops = gpu_ops(trace)
    kernels = [op for op in ops if op.cat == "kernel"]
    assert kernels and {op.graphed for op in kernels} == {graphed}
    record = load_record(EAGER / "commviz_rank0.pkl")
    match = match_rank(trace, record, rank=0)
    kernel_events = [e for e in match.events if e.source == "kernel"]
    if graphed:       # ids the record never captured: not claimed as eager kernels
        assert not any(not e.graphed for e in kernel_events)
    else:
        assert kernel_events and not any(e.graphed for e in kernel_events)
        assert match.stats["eager_matched"] == len(kernel_events)
