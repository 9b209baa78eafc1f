"""Launch flows reach the call that launched the work, by correlation id.

The input is the real 2 x H200 eager trace of rank 0 (tests/fixtures/gpu), with what real
traces also hold: a 0-µs ``cudaPeekAtLastError`` (its own correlation id) at the very
timestamp of every runtime call that launched GPU work. Expected links come from the raw input
(each GPU event's ``args.correlation`` and the runtime call carrying the same id); the merged
.pftrace is parsed back with Perfetto's protos. Older Kineto wrote the same launch flows with
category ``async_cpu_to_gpu`` and name ``async_gpu`` (libkineto's ``output_json.cpp``,
``handleGenericLink``); the fixture's flows spelled that way must reach the same launches.
"""

from __future__ import annotations

import gzip
import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from commviz.merge import merge_run
from commviz.merge import flows as flows_mod
from commviz.trace.run import load_run
from commviz.verify import read_slices, verify_pftrace

FIXTURE = Path(__file__).parent / "fixtures" / "gpu" / "eager"
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
PEEK_CORRELATION = 10_000_000        # above every id in the fixture
OLD_KINETO_FLOW = ("async_cpu_to_gpu", "async_gpu")     # (cat, name) of older Kineto's flows


def _with_peeks(out_dir: Path, *, keep_flows: bool,
                spelling: tuple[str, str] | None = None) -> dict[int, str]:
    """The fixture with a 0-µs peek beside each launch (its launch flows' category and name
    rewritten to ``spelling`` when given); returns correlation -> launch name."""
    doc = json.loads(gzip.decompress((FIXTURE / "trace_rank0.json.gz").read_bytes()))
    events = doc["traceEvents"]
    gpu_corr = {e["args"]["correlation"] for e in events
                if e.get("cat") in GPU_CATS and "correlation" in (e.get("args") or {})}
    launches = {e["args"]["correlation"]: e for e in events if e.get("ph") == "X"
                and e.get("cat") in ("cuda_runtime", "cuda_driver")
                and (e.get("args") or {}).get("correlation") in gpu_corr}
    peeks = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaPeekAtLastError", "pid": e["pid"],
              "tid": e["tid"], "ts": e["ts"], "dur": 0,
              "args": {"cbid": 187, "correlation": PEEK_CORRELATION + n}}
             for n, e in enumerate(launches.values())]
    if not keep_flows:
        events = [e for e in events if e.get("ph") not in ("s", "t", "f")]
    elif spelling is not None:
        flows = [e for e in events if e.get("ph") in ("s", "f") and e.get("cat") == "ac2g"]
        assert flows
        for e in flows:
            e["cat"], e["name"] = spelling
    doc["traceEvents"] = events + peeks
    out_dir.mkdir()
    (out_dir / "trace_rank0.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    for name in ("commviz_rank0.pkl", "commviz_rank1.pkl", "trace_rank1.json.gz"):
        shutil.copy(FIXTURE / name, out_dir)      # rank 1 as recorded: its lanes' flows end there
    return {c: e["name"] for c, e in launches.items()}


def _links(out: Path) -> dict[int, list]:
    """Rank 0's GPU slice correlation -> (name, correlation) of the slices its flows reach."""
    slices, report = read_slices(out)
    assert report.ok, [str(e) for e in report.errors[:5]]
    by_flow: dict[int, list] = defaultdict(list)
    for s in slices:
        for fid in s.flow_ids:
            by_flow[fid].append(s)
    reached: dict[int, list] = {}
    for s in slices:
        if (not s.process.startswith("rank 0 ") or "correlation" not in s.args
                or not any(c in GPU_CATS for c in s.categories)):
            continue
        reached[s.args["correlation"]] = [
            (o.name, o.args.get("correlation")) for fid in s.flow_ids for o in by_flow[fid]
            if o is not s]
    return reached


@pytest.mark.parametrize("keep_flows,spelling", [(True, None), (True, OLD_KINETO_FLOW),
                                                (False, None)],
                         ids=["profiler-flows", "older-kineto-flows", "no-flow-events"])
def test_each_flow_reaches_the_launch_with_its_correlation(tmp_path: Path, keep_flows: bool,
                                                           spelling: tuple | None) -> None:
    run = tmp_path / "run"
    launches = _with_peeks(run, keep_flows=keep_flows, spelling=spelling)
    assert len(launches) >= 20
    result = merge_run(run, tmp_path / "m.pftrace", workers=1, progress=False)
    reached = _links(result.out)
    assert set(launches) <= set(reached)
    for corr, name in launches.items():
        assert reached[corr] == [(name, corr)], corr
    report = verify_pftrace(result.out, inputs=load_run(run))
    assert report.ok, [str(e) for e in report.errors[:5]]
    assert report.inputs[0]["launch_flows"] >= len(launches)


def test_verify_catches_flows_bound_by_time_alone(tmp_path: Path, monkeypatch) -> None:
    """Binding by timestamp only (the old way) links launches to the peeks; verify says so."""
    run = tmp_path / "run"
    launches = _with_peeks(run, keep_flows=True)
    monkeypatch.setattr(flows_mod.Binder, "by_correlation", lambda self, p: None)
    result = merge_run(run, tmp_path / "m.pftrace", workers=1, progress=False)
    reached = _links(result.out)
    wrong = [c for c, name in launches.items() if reached.get(c) != [(name, c)]]
    assert wrong
    report = verify_pftrace(result.out, inputs=load_run(run))
    assert report.error_counts["launch-flow"] >= len(wrong)
