"""Loading traces and run dirs: every input shape real jobs write, and every bad input reported
once, naming its file, while the other ranks still load. Inputs come from one real 2-rank gloo
job recorded with commviz (the other shapes are rewritten from its traces) and from an early
public Kineto trace (tests/fixtures/kineto-old, PyTorch 1.8 era, 2021)."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import orjson
import pytest

from commviz.errors import SourceError, TraceError
from commviz.trace.load import load_trace, rank_from_name, read_header
from commviz.trace.run import load_rank, load_run
from harness import run_ranks


def _job(rank: int, world: int, run_dir: str) -> None:
    import torch

    import commviz
    import commviz.distributed as cvd

    commviz.start(run_dir)
    tp = cvd.new_group([0, 1], group_desc="tp")
    with commviz.profile(run_dir):
        t = torch.ones(16) * (rank + 1)
        cvd.all_reduce(t)
        cvd.broadcast(t, src=0)
        out = [torch.zeros(16) for _ in range(world)]
        cvd.all_gather(out, t, group=tp)
        cvd.barrier()
    commviz.gather(run_dir)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("recorded") / "run"
    run_ranks(_job, 2, str(run_dir))
    return run_dir


@pytest.fixture
def copy(recorded: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(recorded, target)
    return target


def _doc(path: Path) -> dict:
    return orjson.loads(gzip.decompress(path.read_bytes()))


def _wall_ns(trace) -> dict[tuple, int]:
    """(name, tid, ordinal) -> wall ns of every complete event: what every shape must agree on."""
    seen: dict[tuple, int] = {}
    out = {}
    for e in trace.events:
        if e.get("ph") == "X":
            key = (e["name"], e["tid"])
            seen[key] = seen.get(key, 0) + 1
            out[key + (seen[key],)] = trace.ns(e["ts"])
    return out


def test_run_dir_files_every_rank(recorded: Path) -> None:
    run = load_run(recorded)
    assert run.problems == []
    assert run.world_size == 2 and sorted(run.ranks) == [0, 1]
    for rank, inp in run.ranks.items():
        assert inp.record["rank"] == rank and inp.record_path.name == f"commviz_rank{rank}.pkl"
        assert [p.name for p in inp.trace_paths] == [f"trace_rank{rank}.json.gz"]
        (trace,) = list(inp.load_traces())
        assert trace.rank == rank and trace.base_ns > 0
        assert trace.distributed_info["world_size"] == 2
        # the profiler's own event of each call's c10d op holds the call as the record times
        # it (same wall clock), on the thread the record names: the op is entered before the
        # record's begin is read and returns after its end is
        spans = [e for e in trace.events if e.get("name", "").startswith("c10d::")]
        calls = inp.record["collectives"]
        assert len(spans) == len(calls) == 4
        slack = 200_000                 # the profiler's clock, converted to wall time
        for span, call in zip(sorted(spans, key=lambda e: e["ts"]), calls):
            assert span["tid"] == call["commviz.tid"]
            start, end = trace.ns(span["ts"]), trace.ns(span["ts"] + span["dur"])
            assert start - slack <= call["commviz.t_begin_ns"] <= call["commviz.t_end_ns"] \
                <= end + slack, (start, end, call["commviz.t_begin_ns"], call["commviz.t_end_ns"])


def test_every_json_shape_gives_the_same_times(recorded: Path, tmp_path: Path) -> None:
    source = recorded / "trace_rank1.json.gz"
    reference = _wall_ns(load_trace(source))
    doc = _doc(source)
    base = doc["baseTimeNanoseconds"]
    absolute = json.loads(json.dumps(doc))
    del absolute["baseTimeNanoseconds"]
    for e in absolute["traceEvents"]:
        if "ts" in e:
            e["ts"] = e["ts"] + base / 1000
    no_info = dict(doc)
    del no_info["distributedInfo"]
    partial = dict(doc, distributedInfo={"backend": "gloo"})
    shapes = {
        "pretty.json": json.dumps(doc, indent=2).encode(),
        "compact_rank1.json": orjson.dumps(doc),
        "compact.json.gz": gzip.compress(orjson.dumps(doc)),
        "absolute.json": json.dumps(absolute, indent=1).encode(),
        "job-rank-1.json": orjson.dumps(no_info),
        "worker_rank_1.json.gz": gzip.compress(orjson.dumps(partial)),
        "array_rank1.json": orjson.dumps(absolute["traceEvents"]),   # a bare array: absolute
    }
    for name, data in shapes.items():
        path = tmp_path / name
        path.write_bytes(data)
        trace = load_trace(path)
        assert trace.rank == 1, name
        got = _wall_ns(trace)
        assert got.keys() == reference.keys(), name
        # absolute microsecond floats near 1.8e15 keep a quarter-microsecond
        tolerance = 1000 if name.startswith(("absolute", "array")) else 0
        assert all(abs(got[k] - reference[k]) <= tolerance for k in reference), name
    header = read_header(tmp_path / "worker_rank_1.json.gz")
    assert header.rank is None and header.is_trace and header.pid is not None


def test_early_kineto_thread_ids_load_as_numbers() -> None:
    """Kineto's first releases wrote a CPU thread as "24572" on its slices and as 24572 on the
    launch flows starting there; both load as the number (Perfetto's JSON importer parses such
    strings too), so each flow starts on its launch's thread. "stream 7" stays a name."""
    path = Path(__file__).parent / "fixtures" / "kineto-old" / "gpu_metrics_input.json"
    raw = json.loads(path.read_bytes())["traceEvents"]
    with pytest.raises(TraceError, match="cannot tell the rank"):
        load_trace(path)                       # no distributedInfo, no rank in the name
    trace = load_trace(path, rank=0)
    assert trace.problems == [] and len(trace.events) == len(raw)
    by_corr = {(e["args"]["correlation"], e["pid"], e["ts"]): i for i, e in enumerate(raw)
               if e.get("ph") == "X" and "correlation" in e["args"]}
    starts = [(i, by_corr[(e["id"], e["pid"], e["ts"])]) for i, e in enumerate(raw)
              if e.get("ph") == "s"]
    assert len(starts) == 32
    for flow, launch in starts:
        assert raw[flow]["tid"] == int(raw[launch]["tid"]) and isinstance(raw[launch]["tid"], str)
        assert trace.events[flow]["tid"] == trace.events[launch]["tid"] == int(raw[flow]["tid"])
    gpu = {e["tid"] for e in trace.events if e.get("ph") in ("X", "f") and e["pid"] == 0}
    assert gpu == {"stream 7"}


def test_rank_from_file_name() -> None:
    assert rank_from_name("trace_rank3_step2.json.gz") == 3
    assert rank_from_name("rank_4.json") == 4
    assert rank_from_name("job-rank-12.pt.trace.json") == 12
    assert rank_from_name("worker_RANK5.json") == 5
    assert rank_from_name("crank3.json") is None
    assert rank_from_name("rank1_rank2.json") is None          # two ranks: refuse to guess
    assert rank_from_name("host_123.1700000000.pt.trace.json") is None


@pytest.mark.parametrize("name, data, says", [
    ("truncated.json.gz", None, "truncated or corrupt gzip"),
    ("cut_rank0.json", b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1', "not valid JSON"),
    ("garbage_rank0.json", b"\x00\x01 not json at all", "not valid JSON"),
    ("empty_rank0.json", b"", "empty file"),
    ("blank_rank0.json", b"  \n ", "empty file"),
    ("nothing_rank0.json", b"{}", "no traceEvents"),
    ("events_rank0.json", b'{"traceEvents": []}', "empty trace"),
    ("meta_rank0.json", b'{"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1}]}',
     "empty trace"),
    ("norank.json", b'{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": 1}]}',
     "cannot tell the rank"),
    ("latin1_rank0.json", b'{"traceEvents": [{"ph": "X", "name": "caf\xe9", "ts": 1}]}',
     "not valid JSON"),
    ("object_rank0.json", b'{"traceEvents": {"ph": "X", "name": "a", "ts": 1}}',
     "no traceEvents list"),
    ("base_rank0.json", b'{"baseTimeNanoseconds": "soon", "traceEvents": [{"ph": "X", "ts": 1}]}',
     "baseTimeNanoseconds is not an integer"),
])
def test_bad_traces_raise_naming_the_file(recorded: Path, tmp_path: Path, name: str,
                                          data: bytes | None, says: str) -> None:
    path = tmp_path / name
    if data is None:
        whole = (recorded / "trace_rank0.json.gz").read_bytes()
        data = whole[: len(whole) // 2]
    path.write_bytes(data)
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert str(path) in str(err.value) and says in str(err.value)


def test_corrupt_gzip_raises_naming_the_file(recorded: Path, tmp_path: Path) -> None:
    """Damage inside the deflate stream (not a cut): the inflater's own error, named."""
    whole = bytearray((recorded / "trace_rank0.json.gz").read_bytes())
    whole[40:80] = b"\xff" * 40
    path = tmp_path / "corrupt_rank0.json.gz"
    path.write_bytes(bytes(whole))
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert str(path) in str(err.value) and "truncated or corrupt gzip" in str(err.value)


@pytest.mark.parametrize("tail", [b"", b"\0" * 7], ids=["two members", "zero padding"])
def test_a_gzip_of_several_members_reads_whole(recorded: Path, tmp_path: Path,
                                               tail: bytes) -> None:
    """gzip allows members one after another (``cat a.gz b.gz``) and zeros after the last: the
    events are those the standard library's gzip reads."""
    text = gzip.decompress((recorded / "trace_rank0.json.gz").read_bytes())
    cut = len(text) // 3
    path = tmp_path / "members_rank0.json.gz"
    path.write_bytes(gzip.compress(text[:cut]) + gzip.compress(text[cut:]) + tail)
    assert gzip.decompress(path.read_bytes()) == text
    assert load_trace(path).events == json.loads(text)["traceEvents"]


def test_a_gzip_of_many_small_members_reads_whole(recorded: Path, tmp_path: Path) -> None:
    """Each member is read where it starts in the file (none copied out of it): 2,000 members,
    each a few hundred bytes, as the standard library's gzip reads them."""
    text = gzip.decompress((recorded / "trace_rank0.json.gz").read_bytes())
    step = -(-len(text) // 2000)
    path = tmp_path / "many_rank0.json.gz"
    path.write_bytes(b"".join(gzip.compress(text[i:i + step]) for i in range(0, len(text), step)))
    assert load_trace(path).events == json.loads(text)["traceEvents"]


def test_bytes_after_zero_padding_are_refused_naming_the_file(recorded: Path,
                                                               tmp_path: Path) -> None:
    path = tmp_path / "padded_rank0.json.gz"
    path.write_bytes((recorded / "trace_rank0.json.gz").read_bytes() + b"\0\0\0junk")
    with pytest.raises(gzip.BadGzipFile):
        gzip.decompress(path.read_bytes())
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert str(path) in str(err.value) and "truncated or corrupt gzip" in str(err.value)


def test_trace_filed_under_another_rank_is_refused(recorded: Path) -> None:
    with pytest.raises(TraceError, match="distributedInfo says rank 0"):
        load_trace(recorded / "trace_rank0.json.gz", rank=1)


def test_corrupt_record_is_one_problem_and_the_rest_loads(copy: Path) -> None:
    (copy / "commviz_rank1.pkl").write_bytes(b"\x80\x04garbage")
    run = load_run(copy)
    assert len(run.problems) == 1 and "commviz_rank1.pkl" in run.problems[0]
    assert run.ranks[0].record is not None
    assert run.ranks[1].record is None and run.ranks[1].trace_paths   # its trace still merges
    with pytest.raises(SourceError, match="commviz_rank1.pkl"):
        load_run(copy, strict=True)


def test_missing_rank(copy: Path) -> None:
    for name in ("commviz_rank1.pkl", "trace_rank1.json.gz"):
        (copy / name).unlink()
    run = load_run(copy)
    assert sorted(run.ranks) == [0]
    assert len(run.problems) == 1 and "rank 1 is missing" in run.problems[0]


def test_trace_without_record_in_a_recorded_run(copy: Path) -> None:
    (copy / "commviz_rank1.pkl").unlink()
    run = load_run(copy)
    assert run.ranks[1].trace_paths and run.ranks[1].record is None
    assert len(run.problems) == 1 and "commviz_rank1.pkl" in run.problems[0]


def test_duplicate_rank_names_both_files(copy: Path) -> None:
    # the same trace twice (gz and plain)
    (copy / "trace_rank0.json").write_bytes(gzip.decompress((copy / "trace_rank0.json.gz")
                                                            .read_bytes()))
    # rank 1's trace, relabelled as rank 0: a different process claims rank 0
    doc = _doc(copy / "trace_rank1.json.gz")
    doc["distributedInfo"]["rank"] = 0
    (copy / "other.json").write_bytes(orjson.dumps(doc))
    run = load_run(copy)
    assert [p.name for p in run.ranks[0].trace_paths] == ["trace_rank0.json.gz"]
    assert len(run.problems) == 2
    copy_msg = next(p for p in run.problems if "trace_rank0.json:" in p)
    other_msg = next(p for p in run.problems if "other.json" in p)
    assert "trace_rank0.json.gz" in copy_msg and "copy of the same trace" in copy_msg
    assert "trace_rank0.json.gz" in other_msg and "another process" in other_msg
    with pytest.raises(TraceError):
        load_run(copy, strict=True)


def test_trace_whose_name_and_content_disagree(copy: Path) -> None:
    doc = _doc(copy / "trace_rank1.json.gz")
    doc["distributedInfo"]["rank"] = 0
    (copy / "trace_rank1.json.gz").write_bytes(gzip.compress(orjson.dumps(doc)))
    run = load_run(copy)
    assert run.ranks[1].trace_paths == []
    assert len(run.problems) == 1
    assert "trace_rank1.json.gz" in run.problems[0] and "says rank 0" in run.problems[0]


def test_record_and_trace_from_different_runs(copy: Path) -> None:
    doc = _doc(copy / "trace_rank1.json.gz")
    doc["distributedInfo"]["pg_config"][1]["ranks"] = [1]
    (copy / "trace_rank1.json.gz").write_bytes(gzip.compress(orjson.dumps(doc)))
    run = load_run(copy)
    assert len(run.problems) == 1
    assert "commviz_rank1.pkl" in run.problems[0] and "trace_rank1.json.gz" in run.problems[0]
    assert run.ranks[1].record is None and run.ranks[1].trace_paths
    assert run.ranks[0].record is not None


def test_several_steps_of_one_rank(copy: Path) -> None:
    doc = _doc(copy / "trace_rank0.json.gz")
    for step in (1, 2):
        doc["trace_id"] = f"STEP{step}"
        (copy / f"trace_rank0_step{step}.json.gz").write_bytes(gzip.compress(orjson.dumps(doc)))
    (copy / "trace_rank0.json.gz").unlink()
    run = load_run(copy)
    assert [p.name for p in run.ranks[0].trace_paths] == ["trace_rank0_step1.json.gz",
                                                          "trace_rank0_step2.json.gz"]
    # the record still lists trace_rank0.json.gz, which is gone
    assert len(run.problems) == 1 and "lists trace trace_rank0.json.gz" in run.problems[0]


def test_plain_profiler_directory(recorded: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    for rank in (0, 1):
        data = gzip.decompress((recorded / f"trace_rank{rank}.json.gz").read_bytes())
        (plain / f"host_{100 + rank}.1700000000{rank}.pt.trace.json").write_bytes(data)
    (plain / "metrics.json").write_text('{"loss": 1.0}')            # not a trace: ignored
    run = load_run(plain)
    assert run.problems == [] and run.world_size == 2
    assert sorted(run.ranks) == [0, 1]
    assert all(inp.record is None and len(inp.trace_paths) == 1 for inp in run.ranks.values())
    assert run.ranks[1].trace_paths[0].name.startswith("host_101")


def test_one_rank_alone(copy: Path) -> None:
    (copy / "commviz_rank1.pkl").write_bytes(b"garbage")     # another rank's problem
    inp, problems = load_rank(copy, 0)
    assert problems == [] and inp.record["rank"] == 0 and inp.host
    assert [p.name for p in inp.trace_paths] == ["trace_rank0.json.gz"]
    inp, problems = load_rank(copy, 1)
    assert inp.record is None and len(problems) == 1 and "commviz_rank1.pkl" in problems[0]
    assert [p.name for p in inp.trace_paths] == ["trace_rank1.json.gz"]
    with pytest.raises(SourceError, match="rank 5"):
        load_rank(copy, 5)


@pytest.mark.parametrize("field,value,why", [
    ("ts", float("nan"), "ts is not a finite number"),
    ("ts", "soon", "ts is not a finite number"),
    ("ts", 1e30, "wall time overflows int64 nanoseconds"),
    ("ts", 10 ** 400, "ts is not a finite number"),           # an integer no float holds
    ("ts", -1e18, "wall time overflows int64 nanoseconds"),
    ("dur", -5.0, "negative duration"),
    ("dur", 1e30, "lasts far longer than the trace's own span"),
    ("ts_shift_s", 1e7, "far outside the trace's own span"),   # 116 days after a 1-s trace
])
def test_unbelievable_times_are_named_and_skipped(copy: Path, field: str, value, why: str
                                                  ) -> None:
    path = next(copy.glob("trace_rank1*.json.gz"))
    doc = json.loads(gzip.decompress(path.read_bytes()))
    victim = [e for e in doc["traceEvents"] if e.get("ph") == "X"][3]
    if field == "ts_shift_s":
        victim["ts"] += value * 1e6
    else:
        victim[field] = value
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    trace = load_trace(path)
    assert len(trace.events) == len(doc["traceEvents"]) - 1 and not any(
        e is victim or e == victim for e in trace.events)
    assert trace.problems == [f"{path}: rank 1: 1 events with unbelievable times skipped: event "
                              f"#{doc['traceEvents'].index(victim)} {victim['name'][:60]!r} "
                              f"ts={victim['ts']!r} dur={victim.get('dur')!r}: {why}"]
    problems: list[str] = []
    run = load_run(copy)
    list(run.ranks[1].load_traces(problems))
    assert problems == trace.problems


def test_trace_with_no_believable_time_is_left_out(copy: Path) -> None:
    path = next(copy.glob("trace_rank1*.json.gz"))
    doc = json.loads(gzip.decompress(path.read_bytes()))
    for e in doc["traceEvents"]:
        if "ts" in e and e.get("ph") != "M":
            e["ts"] = 1e30
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    with pytest.raises(TraceError, match="rank 1: no profiler event has a believable time"):
        load_trace(path)
