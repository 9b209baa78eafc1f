"""commviz.profile keeps every profiled cycle's trace: torch's schedule with ``repeat=0`` hands a
last, partial cycle to ``on_trace_ready`` when the profile block closes, under the step number
of the trace before it; that must not replace the trace that holds the profiled step."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import torch
from torch.profiler import record_function, schedule

import commviz


def test_closing_a_repeating_schedule_keeps_the_profiled_step(tmp_path: Path) -> None:
    with commviz.profile(tmp_path, schedule=schedule(wait=0, warmup=0, active=1, repeat=0)) as prof:
        with record_function("the_profiled_step"):
            torch.ones(4).sum()
        prof.step()
    traces = sorted(tmp_path.glob("trace_rank0*.json.gz"))
    names = [{e.get("name") for e in json.loads(gzip.decompress(p.read_bytes()))["traceEvents"]}
             for p in traces]
    assert any("the_profiled_step" in n for n in names), [p.name for p in traces]
