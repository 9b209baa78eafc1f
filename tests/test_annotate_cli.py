"""``commviz annotate TRACE RECORD -o OUT`` on a real gloo run's files and on a synthetic GPU trace.

The gloo run is real (``test_match_cpu.job``); the GPU trace is the synthetic one of
``test_match_eager`` (no GPU here), built around real records.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from commviz import metadata as md
from commviz.cli import main
from commviz.record.store import dump_record, load_record
from harness import run_ranks
from independent import flow_ends
from test_match_cpu import job as gloo_job
from test_match_eager import GpuTrace
from test_match_eager import job as records_job


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("annotate")
    run_ranks(gloo_job, 2, str(run_dir), True, timeout=300)
    return run_dir


def _read(path: Path) -> dict:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_gloo_trace_gets_the_record_on_every_call(gloo_run, tmp_path, capsys, suffix) -> None:
    trace_path = sorted(gloo_run.glob("trace_rank1_*.json.gz"))[0]
    record = load_record(gloo_run / "commviz_rank1.pkl")
    out = tmp_path / f"annotated{suffix}"
    assert main(["annotate", str(trace_path), str(gloo_run / "commviz_rank1.pkl"),
                 "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    original, written = _read(trace_path), _read(out)
    assert {k: v for k, v in written.items() if k != "traceEvents"} == \
        {k: v for k, v in original.items() if k != "traceEvents"}
    assert len(written["traceEvents"]) == len(original["traceEvents"])
    by_begin = {c[md.T_BEGIN]: c for c in record["collectives"]}
    labelled = 0
    for before, after in zip(original["traceEvents"], written["traceEvents"]):
        if not before.get("name", "").startswith("c10d::"):
            assert after == before, "only the calls' c10d op events change in a gloo trace"
            continue
        args = after["args"]
        assert before["args"].items() <= args.items()
        call = by_begin[args[md.T_BEGIN]]
        assert {k: v for k, v in call.items() if v is not None}.items() <= args.items()
        labelled += 1
    assert labelled == len(record["collectives"]) // 3      # one of the job's three steps
    assert f"{labelled} cpu" in printed and "unmatched" in printed
    assert "rank 1:" in printed


def test_gpu_trace_counts_and_reasons(tmp_path, capsys) -> None:
    record = run_ranks(records_job, 2, timeout=240)[0]
    builder = GpuTrace(record)
    ddp = builder.unrecorded_allreduce()
    bare = builder.bare_kernel()
    graphed = builder.graph_replay()
    trace_path = builder.write(tmp_path / "trace_rank0.json.gz")
    record_path = tmp_path / "commviz_rank0.pkl"
    dump_record(record_path, record)
    out = tmp_path / "out.json"
    assert main(["annotate", str(trace_path), str(record_path), "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    n = len(record["collectives"])
    assert f"{n + 2} eager and 2 graphed NCCL kernels" in printed
    assert f"kernels: {n + 1} matched, 3 unmatched ({n + 1} collectives on a kernel)" in printed
    assert "unmatched 2 (e.g. graphed kernel ncclDevKernel_AllReduce" in printed
    assert "its replay matches no captured graph" in printed    # the record captured none
    events = _read(out)["traceEvents"]
    for i in (bare, *graphed):
        assert events[i] == builder.events[i]
    assert events[ddp]["args"][md.OP] == "all_reduce" and md.SEQ not in events[ddp]["args"]
    for pos, k in builder.kernel_of.items():
        assert events[k]["args"][md.SEQ if md.SEQ in record["collectives"][pos]
                                 else md.P2P_SEQ] is not None
        assert events[k]["args"][md.CALLSITE] == record["collectives"][pos][md.CALLSITE]


def test_bad_inputs_are_one_clear_error(gloo_run, tmp_path, capsys) -> None:
    trace = sorted(gloo_run.glob("trace_rank0_*.json.gz"))[0]
    assert main(["annotate", str(trace), str(gloo_run / "commviz_rank1.pkl"),
                 "-o", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert str(trace) in err and "rank" in err and "Traceback" not in err
    broken = tmp_path / "trace_rank0.json"
    broken.write_text('{"traceEvents": [{"ph": "X", "name": "a"')
    assert main(["annotate", str(broken), "-o", str(tmp_path / "y.json")]) == 2
    assert str(broken) in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists() and not (tmp_path / "y.json").exists()


def test_pftrace_output(gloo_run, tmp_path, capsys) -> None:
    """One rank annotated on its own: the trace verifies, and read with perfetto's own protos
    (not commviz's reader) no flow has a single end: the peers this file lacks get none."""
    from commviz.verify import verify_pftrace

    trace = sorted(gloo_run.glob("trace_rank0_*.json.gz"))[0]
    out = tmp_path / "rank0.pftrace"
    code = main(["annotate", str(trace), str(gloo_run / "commviz_rank0.pkl"), "-o", str(out)])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "rank 0:" in printed.out
    report = verify_pftrace(out)
    assert report.ok, [str(e) for e in report.errors]
    assert report.counts["slices"] > 0 and report.ranks == {0: report.ranks[0]}
    _two_ended(out, report)


def _two_ended(out: Path, report) -> None:
    """Read with perfetto's own protos, not commviz's reader: every flow id verify counted is
    there, on two events or more."""
    ends = flow_ends(out)
    assert len(ends) == report.counts.get("flows", 0)
    assert all(n >= 2 for n in ends.values()), {f: n for f, n in ends.items() if n < 2}


def test_pftrace_output_of_a_gpu_trace_links_launches(tmp_path, capsys) -> None:
    """The synthetic GPU trace's launches reach their kernels by flows with two ends, and its
    collectives get no flow to the peer rank this file lacks."""
    from commviz.verify import verify_pftrace

    record = run_ranks(records_job, 2, timeout=240)[0]
    builder = GpuTrace(record)
    trace_path = builder.write(tmp_path / "trace_rank0.json.gz")
    record_path = tmp_path / "commviz_rank0.pkl"
    dump_record(record_path, record)
    out = tmp_path / "rank0.pftrace"
    assert main(["annotate", str(trace_path), str(record_path), "-o", str(out)]) == 0
    capsys.readouterr()
    report = verify_pftrace(out)
    assert report.ok, [str(e) for e in report.errors]
    assert report.counts["flows"] >= len(record["collectives"])    # one launch flow per call
    _two_ended(out, report)
