"""commviz's JSON beside Holistic Trace Analysis (``holistictraceanalysis``, a test dependency).

On the real 2 x H200 traces of tests/fixtures/gpu (NCCL 2.28: kernels are ``ncclDevKernel_*``):
HTA reads commviz's per-rank JSON (``merge --format json --per-rank`` and ``annotate``) as the
same ranks with the same comm/compute overlap as the profiler's own files, and the merged file
with every kernel; and where HTA's own analysis finds nothing (its straggler analysis knows
only ``ncclKernel*``) or rounds to whole µs, commviz's figures equal ones computed here from the
raw trace events.
"""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from commviz.cli import main as cli_main
from commviz.review.analyses.reviewing import review_run

hta_analysis = pytest.importorskip("hta.trace_analysis")
FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@pytest.fixture(autouse=True)
def _quiet_hta():
    logging.disable(logging.WARNING)           # HTA logs every file it parses
    yield
    logging.disable(logging.NOTSET)


def _hta(trace_dir: Path):
    return hta_analysis.TraceAnalysis(trace_dir=str(trace_dir))


def _overlap(trace_dir: Path) -> dict[int, float]:
    df = _hta(trace_dir).get_comm_comp_overlap(visualize=False)
    return dict(zip(df["rank"].tolist(), df["comp_comm_overlap_pctg"].tolist()))


def _raw(src: Path, rank: int) -> dict:
    return json.loads(gzip.decompress((src / f"trace_rank{rank}.json.gz").read_bytes()))


def _inputs(src: Path, dest: Path) -> Path:
    dest.mkdir()
    for rank in (0, 1):
        shutil.copy(src / f"trace_rank{rank}.json.gz", dest)
    return dest


@pytest.mark.parametrize("name", ["eager", "graphed"])
def test_hta_reads_commviz_json_per_rank(name: str, tmp_path: Path, capsys) -> None:
    src = FIXTURES / name
    expected = _overlap(_inputs(src, tmp_path / "in"))
    assert sorted(expected) == [0, 1]

    merged = tmp_path / "per_rank"
    assert cli_main(["merge", str(src), "--format", "json", "--per-rank", "-o", str(merged)]) == 0
    assert sorted(p.name for p in merged.iterdir()) == ["trace_rank0.json", "trace_rank1.json"]
    assert _overlap(merged) == expected

    annotated = tmp_path / "annotated"
    annotated.mkdir()
    for rank in (0, 1):
        assert cli_main(["annotate", str(src / f"trace_rank{rank}.json.gz"),
                         str(src / f"commviz_rank{rank}.pkl"),
                         "-o", str(annotated / f"a{rank}.json")]) == 0
    assert _overlap(annotated) == expected
    capsys.readouterr()


def test_hta_reads_the_merged_file_with_every_kernel(tmp_path: Path) -> None:
    src = FIXTURES / "graphed"
    out = tmp_path / "merged" / "merged.json"
    assert cli_main(["merge", str(src), "--format", "json", "-o", str(out)]) == 0
    analysis = _hta(out.parent)
    (df,) = analysis.t.traces.values()                   # one file: HTA reads it as one trace
    raw = sum(1 for r in (0, 1) for e in _raw(src, r)["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in GPU_CATS)
    assert int(df["stream"].ne(-1).sum()) == raw


def test_null_args_stay_null(tmp_path: Path, capsys) -> None:
    run = _inputs(FIXTURES / "eager", tmp_path / "run")
    doc = _raw(run, 0)
    kernel = next(e for e in doc["traceEvents"] if e.get("cat") == "kernel")
    kernel["args"]["commviz.test_null"] = None
    (run / "trace_rank0.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    out = tmp_path / "ranks"
    assert cli_main(["merge", str(run), "--format", "json", "--per-rank", "-o", str(out)]) == 0
    assert cli_main(["annotate", str(run / "trace_rank0.json.gz"), "-o",
                     str(tmp_path / "a.json")]) == 0
    for path in (out / "trace_rank0.json", tmp_path / "a.json"):
        events = json.loads(path.read_text())["traceEvents"]
        (same,) = [e for e in events if "commviz.test_null" in (e.get("args") or {})]
        assert same["args"]["commviz.test_null"] is None, path
    capsys.readouterr()


# -- where commviz goes further than HTA ---------------------------------------------------------

def _raw_collectives(src: Path) -> dict[str, list[tuple[int, int, int, int]]]:
    """Per process group (the profiler's own key), the k-th NCCL kernel of rank 0 and rank 1:
    (start 0, end 0, start 1, end 1) in ns, from the raw events (baseTimeNanoseconds + ts)."""
    spans: dict[int, dict[str, list]] = {}
    for rank in (0, 1):
        doc = _raw(src, rank)
        base = doc["baseTimeNanoseconds"]
        per_pg: dict[str, list] = defaultdict(list)
        for e in doc["traceEvents"]:
            pg = (e.get("args") or {}).get("Process Group Name")
            if e.get("cat") == "kernel" and e["name"].startswith("ncclDevKernel") and pg:
                start = base + round(e["ts"] * 1000)
                per_pg[pg].append((start, start + round(e["dur"] * 1000)))
        spans[rank] = {pg: sorted(v) for pg, v in per_pg.items()}
    return {pg: [(*a, *b) for a, b in zip(spans[0][pg], spans[1][pg])] for pg in spans[0]}


def _with_step(src: Path, dest: Path) -> Path:
    """The traces with one ProfilerStep around everything (HTA analyses steps)."""
    run = _inputs(src, dest)
    for rank in (0, 1):
        doc = _raw(run, rank)
        xs = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
        t0, t1 = min(e["ts"] for e in xs), max(e["ts"] + e["dur"] for e in xs)
        cpu = next(e for e in xs if e.get("cat") == "cpu_op")
        doc["traceEvents"].append({"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1",
                                   "pid": cpu["pid"], "tid": cpu["tid"], "ts": t0 - 1,
                                   "dur": t1 - t0 + 2, "args": {}})
        (run / f"trace_rank{rank}.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    return run


def test_hta_finds_no_nccl_dev_kernel_stragglers_commviz_times_every_instance(tmp_path: Path
                                                                              ) -> None:
    src = FIXTURES / "eager"
    analysis = _hta(_with_step(src, tmp_path / "run"))
    names = analysis.t.symbol_table.get_sym_table()
    assert any(n.startswith("ncclDevKernel") for n in names)
    assert not any(n.startswith("ncclKernel") for n in names)   # all HTA's analysis looks for
    with pytest.raises(ValueError):       # no candidate kernel: argmax of an empty sequence
        analysis.get_potential_stragglers(visualize=False)

    expected = _raw_collectives(src)
    review = review_run(src)
    got: dict[str, list] = defaultdict(list)
    for inst in sorted(review.instances, key=lambda i: i.first_start_ns):
        if inst.kind == "collective" and all(e.source == "kernel" for e in inst.events.values()):
            got[inst.pg].append(inst)
    assert sorted(got) == sorted(expected) and sum(map(len, expected.values())) >= 20
    for pg, rows in expected.items():
        assert [(i.events[0].start_ns, i.events[0].end_ns, i.events[1].start_ns,
                 i.events[1].end_ns) for i in got[pg]] == rows
        assert [i.skew_ns for i in got[pg]] == [abs(s0 - s1) for s0, _, s1, _ in rows]
        assert [i.comm_ns for i in got[pg]] == [max(e0, e1) - max(s0, s1)
                                                for s0, e0, s1, e1 in rows]


@pytest.mark.parametrize("name", ["eager", "graphed"])
def test_kernel_time_to_the_ns_where_hta_rounds_to_us(name: str, tmp_path: Path) -> None:
    src = FIXTURES / name
    analysis = _hta(_inputs(src, tmp_path / "in"))
    review = review_run(src)
    for rank in (0, 1):
        raw_ns = sum(round(e["dur"] * 1000) for e in _raw(src, rank)["traceEvents"]
                     if e.get("ph") == "X" and e.get("cat") in GPU_CATS)
        commviz_ns = sum(s.total_ns for s in review.streams if s.rank == rank)
        df = analysis.t.traces[rank]
        hta_ns = int(df.loc[df["stream"].ne(-1), "dur"].sum()) * 1000
        assert commviz_ns == raw_ns
        assert hta_ns < raw_ns                  # whole µs, rounded down
