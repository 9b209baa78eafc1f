"""commviz verify: hand-built traces that are valid and ones that break each rule Perfetto
relies on, and real runs checked against their input traces."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

import commviz
from commviz.write import read
from commviz.cli import main as cli_main
from commviz.errors import SourceError
from commviz.trace.run import load_run
from commviz.verify import read_slices, verify_pftrace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_merge  # noqa: E402
import gen_traces  # noqa: E402
from harness import run_ranks  # noqa: E402

BEGIN, END, INSTANT, COUNTER = (pb.TrackEvent.TYPE_SLICE_BEGIN, pb.TrackEvent.TYPE_SLICE_END,
                                pb.TrackEvent.TYPE_INSTANT, pb.TrackEvent.TYPE_COUNTER)
CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
NEEDS = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
PROC, STREAM, STREAM_B, LANE, COUNTER_T, THREAD = 10, 11, 12, 13, 14, 15


class Builder:
    """A trace written packet by packet with Perfetto's protos, as a writer would."""

    def __init__(self) -> None:
        self.trace = pb.Trace()

    def packet(self, *, seq: int = 1, flags: int = 0, ts: int | None = None) -> pb.TracePacket:
        p = self.trace.packet.add()
        if seq:
            p.trusted_packet_sequence_id = seq
        if flags:
            p.sequence_flags = flags
        if ts is not None:
            p.timestamp = ts
        return p

    def process(self, uuid: int, pid: int, name: str) -> None:
        d = self.packet().track_descriptor
        d.uuid = uuid
        d.process.pid = pid
        d.process.process_name = name

    def thread(self, uuid: int, pid: int, tid: int, name: str) -> None:
        d = self.packet().track_descriptor
        d.uuid = uuid
        d.thread.pid, d.thread.tid, d.thread.thread_name = pid, tid, name

    def track(self, uuid: int, parent: int | None, name: str, *, merge_key: str | None = None,
              counter: bool = False) -> pb.TrackDescriptor:
        d = self.packet().track_descriptor
        d.uuid = uuid
        if parent is not None:
            d.parent_uuid = parent
        d.name = name
        if merge_key:
            d.sibling_merge_behavior = d.SIBLING_MERGE_BEHAVIOR_BY_SIBLING_MERGE_KEY
            d.sibling_merge_key = merge_key
        if counter:
            d.counter.unit = pb.CounterDescriptor.UNIT_COUNT
        return d

    def intern(self, *, seq: int = 1, flags: int = CLEARED | NEEDS, names: dict | None = None,
               keys: dict | None = None, strings: dict | None = None) -> pb.TracePacket:
        p = self.packet(seq=seq, flags=flags)
        for iid, name in (names or {}).items():
            p.interned_data.event_names.add(iid=iid, name=name)
        for iid, name in (keys or {}).items():
            p.interned_data.debug_annotation_names.add(iid=iid, name=name)
        for iid, value in (strings or {}).items():
            p.interned_data.debug_annotation_string_values.add(iid=iid, str=value.encode())
        return p

    def event(self, typ: int, track: int | None, ts: int, name: str | None = None, *,
              seq: int = 1, flags: int = 0, name_iid: int | None = None,
              args: dict | None = None, flows: tuple[int, ...] = (),
              counter: int | None = None, cat: str | None = None) -> pb.TrackEvent:
        p = self.packet(seq=seq, flags=flags, ts=ts)
        te = p.track_event
        te.type = typ
        if track is not None:
            te.track_uuid = track
        if name is not None:
            te.name = name
        if name_iid is not None:
            te.name_iid = name_iid
        if cat is not None:
            te.categories.append(cat)
        for key, value in (args or {}).items():
            a = te.debug_annotations.add(name=key)
            if isinstance(value, int):
                a.int_value = value
            else:
                a.string_value = value
        te.flow_ids.extend(flows)
        if counter is not None:
            te.counter_value = counter
        return te

    def save(self, path: Path) -> Path:
        path.write_bytes(self.trace.SerializeToString())
        return path


def good_trace() -> Builder:
    """One rank: a thread with nested CPU ops and a launch, a stream whose two overlapping
    kernels sit on two backing tracks, a comm lane with an interned collective, a counter."""
    b = Builder()
    b.process(PROC, 1000, "rank 0 · host · cuda:0")
    b.thread(THREAD, 1000, 7, "python3")
    b.track(STREAM, PROC, "stream 7", merge_key="s7")
    b.track(STREAM_B, PROC, "stream 7", merge_key="s7")
    b.track(LANE, PROC, "PG tp · ranks [0, 1]")
    b.track(COUNTER_T, PROC, "busbw", counter=True)
    b.event(BEGIN, THREAD, 100, "aten::linear")
    b.event(BEGIN, THREAD, 110, "aten::addmm", args={"External id": 3})
    b.event(BEGIN, THREAD, 120, "cudaLaunchKernel", flows=(77,))
    b.event(END, THREAD, 130)
    b.event(END, THREAD, 180)
    b.event(INSTANT, THREAD, 185, "marker")
    b.event(END, THREAD, 200)
    b.event(BEGIN, STREAM, 150, "gemm", flows=(77,))
    b.event(BEGIN, STREAM_B, 250, "gelu")       # overlaps gemm: its own backing track
    b.event(END, STREAM, 300)
    b.event(END, STREAM_B, 320)
    b.intern(names={1: "ncclDevKernel_AllReduce"}, keys={1: "Collective name", 2: "Group size"},
             strings={1: "allreduce"})
    te = b.event(BEGIN, LANE, 400, name_iid=1, flags=NEEDS)
    te.debug_annotations.add(name_iid=1, string_value_iid=1)
    te.debug_annotations.add(name_iid=2, int_value=2)
    te.debug_annotations.add(name="Process Group Ranks", legacy_json_value="[0, 1]")
    nested = te.debug_annotations.add(name="shape")
    nested.array_values.add(int_value=4)
    nested.array_values.add(int_value=8)
    b.event(END, LANE, 500)
    b.event(COUNTER, COUNTER_T, 400, counter=3)
    return b


def kinds(report) -> set[str]:
    return set(report.error_counts)


def test_valid_trace_passes_with_counts(tmp_path):
    report = verify_pftrace(good_trace().save(tmp_path / "t.pftrace"))
    assert report.ok, [str(e) for e in report.errors]
    assert report.counts["slices"] == 6 and report.counts["instants"] == 1
    assert report.counts["flows"] == 1 and report.counts["counter_values"] == 1
    assert report.ranks == {0: "rank 0 · host · cuda:0"}
    assert report.per_process == {"rank 0 · host · cuda:0": 7}
    assert report.per_lane["rank 0 · host · cuda:0"] == {
        "python3": 4, "stream 7": 2, "PG tp · ranks [0, 1]": 1, "busbw": 0}


def test_read_slices_resolves_interning_and_typed_args(tmp_path):
    slices, report = read_slices(good_trace().save(tmp_path / "t.pftrace"))
    assert report.ok
    by_name = {s.name: s for s in slices}
    coll = by_name["ncclDevKernel_AllReduce"]
    assert (coll.track, coll.ts, coll.dur) == ("PG tp · ranks [0, 1]", 400, 100)
    assert coll.args == {"Collective name": "allreduce", "Group size": 2,
                         "Process Group Ranks": [0, 1], "shape": [4, 8]}
    assert by_name["aten::addmm"].dur == 70 and by_name["aten::addmm"].args == {"External id": 3}
    assert by_name["gemm"].flow_ids == by_name["cudaLaunchKernel"].flow_ids == (77,)
    assert by_name["marker"].instant and by_name["marker"].dur == 0


def test_unclosed_slice(tmp_path):
    b = good_trace()
    b.event(BEGIN, STREAM, 600, "never ends")
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"unclosed-slice"}
    (err,) = report.errors
    assert err.name == "never ends" and err.ts == 600
    assert err.track == "rank 0 · host · cuda:0 / stream 7"


def test_end_on_wrong_track(tmp_path):
    b = good_trace()
    b.event(BEGIN, STREAM, 600, "k")
    b.event(END, LANE, 700)
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"unclosed-slice", "misplaced-end"}
    assert {e.track for e in report.errors} == {"rank 0 · host · cuda:0 / stream 7",
                                               "rank 0 · host · cuda:0 / PG tp · ranks [0, 1]"}


def test_crossing_slices_named_ends(tmp_path):
    b = good_trace()
    b.event(BEGIN, STREAM, 600, "a")
    b.event(BEGIN, STREAM, 650, "b")
    b.event(END, STREAM, 700, "a")           # a ends while b, begun inside it, is still open
    b.event(END, STREAM, 750, "b")
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"crossing-slices"}
    assert report.errors[0].name == "a" and report.errors[0].ts == 700


def test_equal_timestamps_keep_file_order(tmp_path):
    """Perfetto sorts by timestamp but keeps file order on ties: the next BEGIN written before
    the previous END at one instant nests inside it, and the named END then crosses."""
    ok, bad = good_trace(), good_trace()
    for b, order in ((ok, "end-first"), (bad, "begin-first")):
        b.event(BEGIN, STREAM, 600, "a")
        if order == "end-first":
            b.event(END, STREAM, 700, "a")
            b.event(BEGIN, STREAM, 700, "b")
        else:
            b.event(BEGIN, STREAM, 700, "b")
            b.event(END, STREAM, 700, "a")
        b.event(END, STREAM, 800, "b")
    assert verify_pftrace(ok.save(tmp_path / "ok.pftrace")).ok
    assert kinds(verify_pftrace(bad.save(tmp_path / "bad.pftrace"))) == {"crossing-slices"}


def test_packets_out_of_timestamp_order_are_fine(tmp_path):
    b = good_trace()
    b.event(END, STREAM, 900)                # written first, but later in time
    b.event(BEGIN, STREAM, 800, "late")
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert report.ok, [str(e) for e in report.errors]


def test_undeclared_track(tmp_path):
    b = good_trace()
    b.event(BEGIN, 999, 600, "orphan")
    b.event(END, 999, 700)
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"undeclared-track"}
    assert report.errors[0].name == "orphan" and "999" in report.errors[0].message


def test_undeclared_parent_and_conflicting_redeclaration(tmp_path):
    b = good_trace()
    b.track(20, 4242, "child of nobody")
    b.track(LANE, PROC, "PG tp · ranks [0, 1]")      # identical again: fine
    b.track(STREAM, PROC, "stream 8", merge_key="s7")  # same uuid, other name: conflict
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"undeclared-parent", "conflicting-track"}
    conflict = next(e for e in report.errors if e.kind == "conflicting-track")
    assert "name" in conflict.message and str(STREAM) in conflict.message


def test_pid_reuse(tmp_path):
    b = good_trace()
    b.process(30, 1000, "rank 1 · host · cuda:1")
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"pid-reuse"}


@pytest.mark.parametrize("where", ["event name", "annotation name", "string value", "category"])
def test_bad_interning_reference(tmp_path, where):
    b = good_trace()
    te = b.event(BEGIN, STREAM, 600, None if where == "event name" else "x", flags=NEEDS,
                 name_iid=99 if where == "event name" else None)
    if where == "annotation name":
        te.debug_annotations.add(name_iid=99, int_value=1)
    elif where == "string value":
        te.debug_annotations.add(name="k", string_value_iid=99)
    elif where == "category":
        te.category_iids.append(99)
    b.event(END, STREAM, 700)
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"bad-interning"}
    assert "iid 99" in report.errors[0].message


def test_cleared_state_forgets_earlier_iids(tmp_path):
    b = good_trace()
    b.intern(names={2: "other"})             # CLEARED again: iid 1 of the first generation is gone
    b.event(BEGIN, STREAM, 600, name_iid=1, flags=NEEDS)
    b.event(END, STREAM, 700)
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"bad-interning"}


def test_interning_is_per_sequence(tmp_path):
    b = good_trace()
    b.event(BEGIN, STREAM, 600, name_iid=1, seq=2, flags=NEEDS)   # seq 2 never cleared
    b.event(END, STREAM, 700, seq=2)
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"skipped-packet", "misplaced-end"}


def test_needs_state_before_cleared_is_dropped(tmp_path):
    b = Builder()
    b.process(PROC, 1, "rank 0")
    b.track(STREAM, PROC, "s")
    b.intern(names={1: "k"}, flags=NEEDS)      # defines iids but never cleared
    b.event(BEGIN, STREAM, 10, "k")
    b.event(END, STREAM, 20)
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"skipped-packet", "bad-interning"}
    assert report.error_counts["skipped-packet"] == 1


def test_dangling_flow(tmp_path):
    b = good_trace()
    b.event(BEGIN, STREAM, 600, "alone", flows=(5,))
    b.event(END, STREAM, 700)
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"dangling-flow"}
    assert report.errors[0].name == "alone"


def test_flow_on_begin_and_end_of_one_slice_links_one_slice(tmp_path):
    b = good_trace()
    b.event(BEGIN, STREAM, 600, "x", flows=(6,))
    b.event(END, STREAM, 700).flow_ids.append(6)
    assert kinds(verify_pftrace(b.save(tmp_path / "t.pftrace"))) == {"dangling-flow"}


def test_counter_and_slice_track_kinds(tmp_path):
    b = good_trace()
    b.event(COUNTER, STREAM, 600, counter=1)
    b.event(BEGIN, COUNTER_T, 600, "on a counter")
    b.event(END, COUNTER_T, 700)
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"counter-on-slice-track", "slice-on-counter-track"}


def test_streamed_in_small_chunks_and_gzip(tmp_path, monkeypatch):
    path = good_trace().save(tmp_path / "t.pftrace")
    whole = verify_pftrace(path)
    gz = tmp_path / "t.pftrace.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    monkeypatch.setattr(read, "_CHUNK", 7)            # packets straddle every read
    for p in (path, gz):
        small = verify_pftrace(p)
        assert small.ok and small.counts == whole.counts and small.per_lane == whole.per_lane


def test_unreadable_files(tmp_path):
    path = good_trace().save(tmp_path / "t.pftrace")
    cut = tmp_path / "cut.pftrace"
    cut.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(SourceError, match="truncated"):
        verify_pftrace(cut)
    js = tmp_path / "trace.json"
    js.write_text('{"traceEvents": []}')
    with pytest.raises(SourceError, match="not a Perfetto trace"):
        verify_pftrace(js)
    with pytest.raises(SourceError, match="no such file"):
        verify_pftrace(tmp_path / "missing.pftrace")
    empty = tmp_path / "empty.pftrace"
    empty.write_bytes(b"")
    assert kinds(verify_pftrace(empty)) == {"empty"}


# --- against the input traces -----------------------------------------------------------------

def _kernel(name: str, ts: float, dur: float, corr: int) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": ts, "dur": dur,
            "args": {"stream": 7, "correlation": corr}}


def test_crossing_slices_caught_against_inputs(tmp_path, run_dir):
    """Two overlapping kernels written onto ONE track with anonymous ENDs parse as a valid
    nesting; only the input's durations show that the slices cross."""
    doc = {"distributedInfo": {"rank": 0, "world_size": 1}, "baseTimeNanoseconds": 1000,
           "traceEvents": [_kernel("k1", 1.0, 2.0, 1), _kernel("k2", 2.0, 2.0, 2)]}
    (run_dir / "trace_rank0.json").write_text(json.dumps(doc))
    b = Builder()
    b.process(PROC, 1, "rank 0")
    b.track(STREAM, PROC, "stream 7")
    for k, ts in (("k1", 2000), ("k2", 3000)):
        b.event(BEGIN, STREAM, ts, k, args={"stream": 7, "correlation": int(k[1])}, cat="kernel")
    b.event(END, STREAM, 4000)
    b.event(END, STREAM, 5000)
    path = b.save(tmp_path / "t.pftrace")
    assert verify_pftrace(path).ok
    report = verify_pftrace(path, inputs=load_run(run_dir))
    assert kinds(report) == {"duration"}
    assert {e.name for e in report.errors} == {"k1", "k2"}


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Two ranks of generated GPU traces and the baseline writer's .pftrace of them."""
    root = tmp_path_factory.mktemp("gen")
    run = root / "run"
    gen_traces.write_run(run, 2, 3000, layers=4)
    out = root / "baseline.pftrace"
    bench_merge.baseline_merge({r: gen_traces.trace_path(run, r, True) for r in range(2)}, out)
    return run, out


def test_generated_run_verifies_against_inputs(generated):
    run, out = generated
    report = verify_pftrace(out, inputs=load_run(run))
    assert report.ok, [str(e) for e in report.errors]
    for rank in (0, 1):
        events = json.loads(gzip.decompress(gen_traces.trace_path(run, rank, True).read_bytes()))
        slices = [e for e in events["traceEvents"] if e["ph"] == "X" and e["cat"] != "Trace"]
        launches = [e for e in events["traceEvents"] if e["ph"] == "f"]
        assert report.inputs[rank]["matched"] == len(slices)
        assert report.inputs[rank]["launch_flows"] == len(launches)
    assert report.per_process["rank 0"] == report.inputs[0]["matched"]


def _rewrite(path: Path, out: Path, edit) -> Path:
    trace = pb.Trace.FromString(path.read_bytes())
    edit(trace)
    out.write_bytes(trace.SerializeToString())
    return out


def test_inputs_catch_lost_events_args_and_flows(generated, tmp_path):
    run, out = generated
    packets = pb.Trace.FromString(out.read_bytes()).packet
    first_nccl = next(i for i, p in enumerate(packets)
                      if p.track_event.name.startswith("ncclDevKernel_AllReduce"))
    first_flow = next(i for i, p in enumerate(packets)
                      if p.track_event.name == "cudaLaunchKernel" and p.track_event.flow_ids)

    def drop_arg(trace):
        anns = trace.packet[first_nccl].track_event.debug_annotations
        key = next(i for i, a in enumerate(anns) if a.name == "Collective name")
        anns[key].string_value = "broadcast"

    def drop_flow(trace):
        del trace.packet[first_flow].track_event.flow_ids[:]

    inputs = load_run(run)
    bad_args = verify_pftrace(_rewrite(out, tmp_path / "a.pftrace", drop_arg), inputs=inputs)
    assert kinds(bad_args) == {"args"}
    assert "Collective name: 'allreduce' -> 'broadcast'" in bad_args.errors[0].message
    no_flow = verify_pftrace(_rewrite(out, tmp_path / "f.pftrace", drop_flow), inputs=inputs)
    assert kinds(no_flow) == {"launch-flow", "dangling-flow"}

    # an input event the output never saw, and one it has twice
    run = Path(shutil.copytree(run, tmp_path / "run"))
    doc = json.loads(gzip.decompress(gen_traces.trace_path(run, 1, True).read_bytes()))
    extra = dict(next(e for e in doc["traceEvents"] if e.get("cat") == "cpu_op"))
    doc["traceEvents"].append(dict(extra, name="aten::never_merged"))
    doc["traceEvents"].append(extra)
    gen_traces.trace_path(run, 1, True).write_bytes(gzip.compress(json.dumps(doc).encode()))
    report = verify_pftrace(out, inputs=load_run(run))
    assert kinds(report) == {"missing-event", "count-mismatch"}
    assert report.inputs[1]["missing"] == 2

    gen_traces.trace_path(run, 1, True).write_bytes(b"\x1f\x8b broken")
    report = verify_pftrace(out, inputs=load_run(run))
    assert kinds(report) == {"input-unreadable"} and report.inputs[0]["matched"] > 0


def test_cli_exit_codes(generated, tmp_path, capsys):
    run, out = generated
    assert cli_main(["verify", str(out), "--run", str(run)]) == 0
    assert "OK" in capsys.readouterr().out
    b = good_trace()
    b.event(BEGIN, STREAM, 600, "never ends")
    assert cli_main(["verify", str(b.save(tmp_path / "bad.pftrace"))]) == 1
    printed = capsys.readouterr().out
    assert "[unclosed-slice]" in printed and "never ends" in printed
    assert cli_main(["verify", str(tmp_path / "missing.pftrace")]) == 2


def test_clock_shifted_ranks_still_match(generated, tmp_path):
    """A merge that aligns hosts moves a rank's timestamps; verify finds the shift and checks
    the events at their moved times."""
    run, out = generated

    def shift(trace):
        for p in trace.packet:
            if p.HasField("timestamp"):
                p.timestamp += 5_000

    report = verify_pftrace(_rewrite(out, tmp_path / "s.pftrace", shift), inputs=load_run(run))
    assert report.ok, [str(e) for e in report.errors]
    assert report.clock_offsets == {0: 5_000, 1: 5_000}


def test_two_processes_claiming_one_rank(tmp_path):
    b = good_trace()
    b.process(31, 2000, "rank 0 · otherhost · cuda:0")
    assert kinds(verify_pftrace(b.save(tmp_path / "t.pftrace"))) == {"duplicate-rank"}


def _incremental(b: Builder, *, snapshot: bool) -> None:
    """A sequence in the SDK's style: default track and a delta-encoded sequence clock."""
    p = b.packet(seq=5, flags=CLEARED | NEEDS, ts=1_000_000)
    p.timestamp_clock_id = 6
    p.trace_packet_defaults.timestamp_clock_id = 64
    p.trace_packet_defaults.track_event_defaults.track_uuid = STREAM
    if snapshot:
        p.clock_snapshot.clocks.add(clock_id=6, timestamp=1_000_000)
        p.clock_snapshot.clocks.add(clock_id=64, timestamp=1_000_000, is_incremental=True)
    for typ, delta, name in ((BEGIN, 100, "a"), (BEGIN, 50, "b"), (END, 25, None),
                             (END, 25, None)):
        b.event(typ, None, delta, name, seq=5, flags=NEEDS)


def test_incremental_sequence_clock_and_default_track(tmp_path):
    b = Builder()
    b.process(PROC, 1, "rank 0")
    b.track(STREAM, PROC, "stream 7")
    _incremental(b, snapshot=True)
    slices, report = read_slices(b.save(tmp_path / "t.pftrace"))
    assert report.ok, [str(e) for e in report.errors]
    assert sorted((s.name, s.track, s.ts, s.dur) for s in slices) == [
        ("a", "stream 7", 1_000_100, 100), ("b", "stream 7", 1_000_150, 25)]


def test_sequence_clock_without_snapshot(tmp_path):
    b = Builder()
    b.process(PROC, 1, "rank 0")
    b.track(STREAM, PROC, "stream 7")
    _incremental(b, snapshot=False)
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"bad-clock"} and report.error_counts["bad-clock"] == 4


# --- a real merged trace ----------------------------------------------------------------------

def _gloo_job(rank: int, world: int, run_dir: str) -> None:
    import commviz.distributed as dist

    commviz.RECORDER.clear()
    commviz.start(run_dir, flush_interval=None)
    pair = dist.new_group([0, 1], group_desc="tp")
    with commviz.profile(run_dir):
        t = torch.ones(4, 8) * (rank + 1)
        for _ in range(2):
            dist.all_reduce(t)
        if rank < 2:
            out = [torch.zeros(4, 8) for _ in range(2)]
            dist.all_gather(out, t, group=pair)
        dist.broadcast(t, src=0)
        dist.barrier()
    commviz.gather(run_dir)


@pytest.mark.slow
def test_merged_gloo_run_verifies(tmp_path):
    merge = pytest.importorskip("commviz.merge")
    if not hasattr(merge, "merge_run"):
        pytest.skip("commviz.merge.merge_run is not written yet")
    run_ranks(_gloo_job, 3, str(tmp_path))
    result = merge.merge_run(tmp_path, progress=False)
    report = verify_pftrace(result.out, inputs=load_run(tmp_path))
    assert report.ok, [str(e) for e in report.errors]
    assert sorted(report.ranks) == [0, 1, 2]
    for rank, label in report.ranks.items():
        trace = json.loads(gzip.decompress((tmp_path / f"trace_rank{rank}.json.gz").read_bytes()))
        slices = [e for e in trace["traceEvents"]
                  if e["ph"] == "X" and isinstance(e["pid"], int) and e.get("cat") != "Trace"]
        assert report.inputs[rank]["matched"] == len(slices) > 0
        lanes = {k: n for k, n in report.per_lane[label].items() if k.startswith("PG ")}
        world = next(n for k, n in lanes.items() if "ranks [0, 1, 2]" in k)
        assert world == 4                     # 2 all_reduce, broadcast, barrier
        assert sum(lanes.values()) == world + (1 if rank < 2 else 0)
    assert report.counts["flows"] > 0


def test_timestamps_past_int64_are_a_problem_not_a_crash(tmp_path):
    b = good_trace()
    b.event(BEGIN, STREAM, (1 << 64) - 1, "far")       # a uint64 trace processor cannot hold
    b.event(END, STREAM, (1 << 64) - 1)
    report = verify_pftrace(b.save(tmp_path / "t.pftrace"))
    assert kinds(report) == {"bad-timestamp"} and report.error_counts["bad-timestamp"] == 2


def test_absurd_input_times_are_named_not_a_crash(tmp_path, run_dir):
    """A ``dur`` of 1e30 µs and a ``ts`` of -1e18 µs: the merge leaves them out and says so,
    and verify, reading the inputs the same way, passes."""
    ok = _kernel("k1", 1.0, 2.0, 1)
    doc = {"distributedInfo": {"rank": 0, "world_size": 1}, "baseTimeNanoseconds": 1000,
           "traceEvents": [ok, _kernel("huge", 5.0, 1e30, 2), _kernel("early", -1e18, 1.0, 3)]}
    (run_dir / "trace_rank0.json").write_text(json.dumps(doc))
    from commviz.merge import merge_run

    result = merge_run(run_dir, tmp_path / "m.pftrace", workers=1, progress=False)
    assert any("2 events with unbelievable times skipped" in p for p in result.problems), \
        result.problems
    # verify reads the inputs through the same loader, which does not believe those two
    # either: the merged trace holds every believable event, and nothing else
    report = verify_pftrace(result.out, inputs=load_run(run_dir))
    assert kinds(report) == set()
    assert report.inputs[0]["matched"] == 1


def test_same_name_and_time_on_two_threads_pair_per_thread(tmp_path, run_dir):
    """Two threads each run an op of one name at one time with different args: pairing by
    name and time alone crosses them (false arg errors); per thread it does not."""
    ops = [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 9, "tid": tid, "ts": 1.0,
            "dur": 2.0, "args": {"External id": tid}} for tid in (2, 1)]
    doc = {"distributedInfo": {"rank": 0, "world_size": 1}, "baseTimeNanoseconds": 1000,
           "traceEvents": ops}
    (run_dir / "trace_rank0.json").write_text(json.dumps(doc))
    from commviz.merge import merge_run

    result = merge_run(run_dir, tmp_path / "m.pftrace", workers=1, progress=False)
    report = verify_pftrace(result.out, inputs=load_run(run_dir))
    assert report.ok, [str(e) for e in report.errors]
    assert report.inputs[0]["matched"] == 2


def test_no_input_makes_verify_die_with_a_traceback(tmp_path, capsys):
    """Bytes flipped at random in a valid trace (and in its gzip), and names that are not
    UTF-8: ``commviz verify`` answers 0, 1 or 2, never with an exception."""
    import random

    good = good_trace().save(tmp_path / "g.pftrace").read_bytes()
    rng = random.Random(13)
    path = tmp_path / "f.pftrace"
    for i in range(400):
        data = bytearray(good)
        for _ in range(rng.randint(1, 6)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        path.write_bytes(gzip.compress(bytes(data))[: -rng.randint(0, 20)] if i % 5 == 0
                         else bytes(data))
        assert cli_main(["verify", str(path)]) in (0, 1, 2)
    b = good_trace()
    b.event(BEGIN, STREAM, 600, "x")
    raw = b.trace.SerializeToString().replace(b"\x01x", b"\x01\xff")   # the name: not UTF-8
    path.write_bytes(raw)
    slices, report = read_slices(path)
    assert report.ok is False and kinds(report) == {"unclosed-slice"}
    assert report.errors[0].name == "\ufffd"
    capsys.readouterr()
