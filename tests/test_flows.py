"""Launch flows reach the call that launched the work, by correlation id, whatever Kineto
called them.

Inputs are real traces of both kinds: rank 0 of the 2 x H200 eager fixture (tests/fixtures/gpu,
torch 2.11, ``ac2g`` flows) and an early Kineto trace (tests/fixtures/kineto-old, PyTorch 1.8
era, V100, 2021: ``async``/``launch`` flows, ``Runtime``/``Kernel``/``Memcpy`` categories, each
flow's start thread written as a number where its slices write it as a string). To each is
added what real traces also hold: a 0-µs call (its own correlation id) at the very timestamp,
on the thread, of every runtime call that launched GPU work. Expected links come from the raw
input: a flow's id is the ``correlation`` of the complete event at its start (its pid, thread
and time) and of those at its ends; the merged .pftrace is parsed back with Perfetto's protos.
No public trace with the 2021-22 spelling (``async_cpu_to_gpu`` / ``async_gpu``, libkineto's
``output_json.cpp``, ``handleGenericLink``) could be read, so the eager fixture's flows are also
tested renamed to it.
"""

from __future__ import annotations

import gzip
import json
import shutil
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from commviz.merge import merge_run
from commviz.merge import flows as flows_mod
from commviz.trace.run import load_run
from commviz.verify import read_slices, verify_pftrace

FIXTURES = Path(__file__).parent / "fixtures"
EAGER = FIXTURES / "gpu" / "eager"                                   # torch 2.11, 2 x H200
TORCH_2_11 = EAGER / "trace_rank0.json.gz"
KINETO_2021 = FIXTURES / "kineto-old" / "gpu_metrics_input.json"    # 2021, V100
PEEK_CORRELATION = 10_000_000        # above every id in both fixtures
ASYNC_CPU_TO_GPU = ("async_cpu_to_gpu", "async_gpu")     # (cat, name) of 2021-22 Kineto's flows


def _doc(source: Path) -> dict:
    raw = source.read_bytes()
    return json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)


def _thread(e: dict) -> tuple[str, str]:
    """An event's (pid, tid) as Perfetto's JSON importer reads it: "24572" and 24572 alike."""
    return str(e.get("pid")), str(e.get("tid"))


@dataclass
class Link:
    """One launch flow of the input: the call that launched the work and the work itself."""

    launch: dict
    ends: list[dict]


def _links(events: list[dict]) -> dict[Any, Link]:
    """correlation -> Link, for every flow of the input with a start and an end, each on the
    complete event that carries the flow's id as its ``correlation``."""
    by_point: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("ph") == "X" and corr is not None:
            by_point[(corr, *_thread(e), e["ts"])].append(e)
    points: dict[Any, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for e in events:
        if e.get("ph") in ("s", "f"):
            points[e["id"]][e["ph"]] += by_point.get((e["id"], *_thread(e), e["ts"]), [])
    return {fid: Link(ends["s"][0], ends["f"]) for fid, ends in points.items()
            if len(ends["s"]) == 1 and ends["f"]}


def _with_peeks(run: Path, source: Path, *, keep_flows: bool,
                spelling: tuple[str, str] | None = None) -> dict[Any, Link]:
    """Rank 0 of a run dir from ``source`` with a 0-µs call beside each launch (its flows
    renamed to ``spelling``, or dropped); returns the input's launch links."""
    doc = _doc(source)
    events = doc["traceEvents"]
    links = _links(events)
    peeks = [{"ph": "X", "cat": link.launch["cat"], "name": "cudaPeekAtLastError",
              "pid": link.launch["pid"], "tid": link.launch["tid"], "ts": link.launch["ts"],
              "dur": 0, "args": {"cbid": 187, "correlation": PEEK_CORRELATION + n}}
             for n, link in enumerate(links.values())]
    if not keep_flows:
        events = [e for e in events if e.get("ph") not in ("s", "t", "f")]
    elif spelling is not None:
        for e in events:
            if e.get("ph") in ("s", "t", "f"):
                e["cat"], e["name"] = spelling
    doc["traceEvents"] = events + peeks
    run.mkdir()
    (run / "trace_rank0.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    if source.parent == EAGER:
        for name in ("commviz_rank0.pkl", "commviz_rank1.pkl", "trace_rank1.json.gz"):
            shutil.copy(EAGER / name, run)      # rank 1 as recorded: its lanes' flows end there
    return links


def _reached(out: Path, links: dict[Any, Link]) -> dict[Any, list]:
    """correlation -> (name, correlation, end's track) of each slice rank 0's flows link one
    of the input's flow ends (its GPU work) to."""
    slices, report = read_slices(out)
    assert report.ok, [str(e) for e in report.errors[:5]]
    by_flow: dict[int, list] = defaultdict(list)
    for s in slices:
        for fid in s.flow_ids:
            by_flow[fid].append(s)
    ends = {corr: {e["name"] for e in link.ends} for corr, link in links.items()}
    reached: dict[Any, list] = defaultdict(list)
    for s in slices:
        corr = s.args.get("correlation")
        if s.process.startswith("rank 0 ") and s.name in ends.get(corr, ()):
            reached[corr] += [(o.name, o.args.get("correlation"), s.track)
                              for fid in s.flow_ids for o in by_flow[fid] if o is not s]
    return reached


def _stream_tracks(source: Path) -> dict[tuple, str]:
    """(pid, tid) of each GPU stream -> the track name the input gives it: its process label
    and its thread name, or the tid itself (early Kineto wrote "stream 7" there)."""
    events = _doc(source)["traceEvents"]
    labels = {str(e["pid"]): e["args"]["labels"] for e in events
              if e.get("ph") == "M" and e.get("name") == "process_labels"}
    names = {_thread(e): e["args"]["name"].strip() for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return {_thread(e): f"{labels[str(e['pid'])]} · {names.get(_thread(e), e['tid'])}"
            for e in events if e.get("ph") == "X" and str(e.get("pid")) in labels
            and labels[str(e["pid"])].startswith("GPU")}


@pytest.mark.parametrize("source,keep_flows,spelling", [
    pytest.param(TORCH_2_11, True, None, id="torch2.11-ac2g"),
    pytest.param(TORCH_2_11, True, ASYNC_CPU_TO_GPU, id="torch2.11-renamed-async_cpu_to_gpu"),
    pytest.param(TORCH_2_11, False, None, id="torch2.11-no-flow-events"),
    pytest.param(KINETO_2021, True, None, id="kineto2021-async-launch"),
    pytest.param(KINETO_2021, False, None, id="kineto2021-no-flow-events"),
])
def test_each_flow_reaches_the_launch_with_its_correlation(tmp_path: Path, source: Path,
                                                           keep_flows: bool,
                                                           spelling: tuple | None) -> None:
    run = tmp_path / "run"
    links = _with_peeks(run, source, keep_flows=keep_flows, spelling=spelling)
    assert len(links) >= 30
    result = merge_run(run, tmp_path / "m.pftrace", workers=1, progress=False)
    if keep_flows:                # the profiler's own flows are bound, none drawn in their stead
        assert result.stats["per_rank"][0]["flows_from_correlation"] == 0
    reached = _reached(result.out, links)
    tracks = _stream_tracks(source)
    for corr, link in links.items():
        want = [(link.launch["name"], corr, tracks[_thread(e)]) for e in link.ends]
        assert reached[corr] == want, corr
    report = verify_pftrace(result.out, inputs=load_run(run))
    assert report.ok, [str(e) for e in report.errors[:5]]
    assert report.inputs[0]["launch_flows"] >= len(links)


@pytest.mark.parametrize("source", [TORCH_2_11, KINETO_2021], ids=["torch2.11", "kineto2021"])
def test_verify_catches_flows_bound_by_time_alone(tmp_path: Path, monkeypatch,
                                                  source: Path) -> None:
    """Binding by timestamp only (the old way) links launches to the peeks; verify says so."""
    run = tmp_path / "run"
    links = _with_peeks(run, source, keep_flows=True)
    monkeypatch.setattr(flows_mod.Binder, "by_correlation", lambda self, p: None)
    monkeypatch.setattr(flows_mod, "native", None)      # the C loop binds without it
    result = merge_run(run, tmp_path / "m.pftrace", workers=1, progress=False)
    reached = _reached(result.out, links)
    wrong = [c for c, link in links.items()
             if [r[:2] for r in reached.get(c, [])] != [(link.launch["name"], c)]]
    assert wrong
    report = verify_pftrace(result.out, inputs=load_run(run))
    assert report.error_counts["launch-flow"] >= len(wrong)
