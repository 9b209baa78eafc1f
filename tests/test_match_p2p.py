"""Coalesced point-to-point kernels on real NCCL runs, on CPU.

Also, on one real H100 run kept by ``tests/test_gpu_p2p.py`` (``p2p-1xh100``, and
``p2p-1xh100-a2a`` where the graph was read at its capture's end), that test's own checks:
commviz's ``commviz.fr_p2p_seq`` equals NCCL Flight Recorder's ``p2p_seq_id`` of every p2p op,
and the coalesced SendRecv kernels are named eagerly and in every CUDA graph replay.

The fixture (``tests/fixtures/gpu/gpipe-2xh200``) is a GPipe job (2 stages, 4 micro-batches,
2 steps) recorded with commviz on NCCL: every send and receive of the schedule went through
``batch_isend_irecv``, so NCCL ran each batch as one ``ncclDevKernel_SendRecv`` kernel launched
when the group ended, outside every recorded call. Expectations come from the raw profiler
traces, read with the stdlib: the SendRecv kernels, their launches (``correlation``), and the
profiler's own ``record_param_comms`` op of each send/recv ProcessGroupNCCL enqueued (its
``Collective name``, ``Dst Rank`` / ``Src Rank``, ``In msg nelems`` and ``dtype``). The merged
.pftrace is read back with Perfetto's protos (``independent.slices``).
"""

from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from commviz import metadata as md
from commviz.match import match_rank
from commviz.merge import merge_run
from commviz.record.store import load_record
from commviz.trace.load import load_trace
from commviz.trace.run import load_run
from commviz.verify import verify_pftrace
from independent import LAUNCH_CATS, ops_text, p2p_truth, slices

FIX = Path(__file__).parent / "fixtures" / "gpu" / "gpipe-2xh200"
ONE_GPU = Path(__file__).parent / "fixtures" / "gpu" / "p2p-1xh100"
RANKS = (0, 1)


def raw_truth(rank: int) -> list[dict]:
    return p2p_truth(FIX / f"trace_rank{rank}.json.gz")


@pytest.fixture(scope="module")
def matched() -> dict:
    return {r: (load_trace(FIX / f"trace_rank{r}.json.gz"),
                match_rank(load_trace(FIX / f"trace_rank{r}.json.gz"),
                           load_record(FIX / f"commviz_rank{r}.pkl"), rank=r)) for r in RANKS}


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    run = tmp_path_factory.mktemp("gpipe") / "run"
    shutil.copytree(FIX, run)
    result = merge_run(run, run / "merged.pftrace", workers=1, progress=False)
    return run, result.out


@pytest.mark.parametrize("rank", RANKS)
def test_every_sendrecv_kernel_carries_the_ops_the_profiler_saw(matched: dict, rank: int
                                                                ) -> None:
    truth = raw_truth(rank)
    assert len(truth) == 18                        # the fixture's README: 18 a rank
    trace, result = matched[rank]
    by_corr = {trace.events[i]["args"]["correlation"]: a for i, a in result.kernel_args.items()
               if trace.events[i].get("cat") == "kernel"}
    assert not [u for u in result.unmatched if "SendRecv" in u.what]
    for item in truth:
        label = by_corr[item["correlation"]]          # every SendRecv kernel is named
        assert item["ops"], item
        assert label[md.P2P_OPS] == ops_text(item["ops"])
        assert label[md.PG_NAME] == "0" and label[md.PG_RANKS] == "[0, 1]"
        assert label[md.DTYPE] == "Float"
        if len(item["ops"]) == 1:
            direction, peer, size = item["ops"][0]
            assert label[md.COLLECTIVE_NAME] == direction and label[md.PEER] == peer
            assert label[md.BYTES_IN] == size
        else:
            assert label[md.KIND] == "batch"
            assert label[md.PEERS] == ",".join(f"{d}:{p}" for d, p, _ in item["ops"])
    # every recorded p2p call found its kernel: none left as a bare CPU span
    assert result.stats["coalesced_p2p_ops"] == sum(len(t["ops"]) for t in truth)
    assert all(ev.source.value == "kernel" for ev in result.events)


def test_a_send_and_its_receive_share_the_instance_key(matched: dict) -> None:
    """Per (src, dst): the k-th send on one rank and the k-th receive on the other are one
    instance, with the same size (the profiler's own order of the ops)."""
    keys = {r: {ev.key: ev for ev in matched[r][1].events} for r in RANKS}
    assert keys[0].keys() == keys[1].keys() and len(keys[0]) == 20
    for key, ev in keys[0].items():
        peer = keys[1][key]
        assert {ev.op, peer.op} == {"send", "recv"}
        assert ev.args[md.BYTES_IN] == peer.args[md.BYTES_IN]
        assert (key.src, key.dst) == ((0, 1) if ev.op == "send" else (1, 0))


def test_each_send_kernel_flows_to_its_receive_kernel_on_the_peer(merged: tuple) -> None:
    run, out = merged
    report = verify_pftrace(out, inputs=load_run(run))
    assert report.ok, [str(e) for e in report.errors[:5]]
    every = slices(out)
    kernels = {(s.process.split(" ")[1], s.ts, s.dur) for s in every
               if s.name.startswith("ncclDevKernel_SendRecv")}
    assert len(kernels) == 36
    lanes = [s for s in every if s.track.startswith("PG ") and s.process]
    by_flow: dict[int, list] = defaultdict(list)
    for s in lanes:
        for fid in s.flow_ids:
            by_flow[fid].append(s)
    sends = [s for s in lanes if s.name == "send"]
    assert len(sends) == 20
    for s in sends:
        rank = s.process.split(" ")[1]
        assert (rank, s.ts, s.dur) in kernels            # at its SendRecv kernel's time
        (fid,) = s.flow_ids
        (other,) = [o for o in by_flow[fid] if o is not s]
        peer = other.process.split(" ")[1]
        assert peer != rank and other.name == "recv"
        assert (peer, other.ts, other.dur) in kernels     # ... and so is the receive
        assert other.args[md.BYTES_IN] == s.args[md.BYTES_IN]
        assert int(peer) == s.args[md.DST] and int(rank) == other.args[md.SRC]


def test_a_kernel_whose_launch_is_lost_keeps_its_calls_to_itself() -> None:
    """Drop one SendRecv kernel's launch event (as a lost CUPTI record would): that kernel is
    reported, its calls stay CPU spans, and the next kernel's label is unchanged (the group's
    ``nccl:coalesced`` range still bounds it)."""
    rank = 0
    trace = load_trace(FIX / f"trace_rank{rank}.json.gz")
    record = load_record(FIX / f"commviz_rank{rank}.pkl")
    full = match_rank(trace, record, rank=rank)
    truth = raw_truth(rank)
    victim, after = truth[3]["correlation"], truth[4]["correlation"]
    trace = load_trace(FIX / f"trace_rank{rank}.json.gz")
    trace.events = [e for e in trace.events if not (
        e.get("cat") in LAUNCH_CATS and (e.get("args") or {}).get("correlation") == victim)]
    result = match_rank(trace, record, rank=rank)
    by_corr = {trace.events[i]["args"]["correlation"]: a for i, a in result.kernel_args.items()
               if trace.events[i].get("cat") == "kernel"}
    full_corr = {e["args"]["correlation"]: full.kernel_args[i] for i, e in
                 enumerate(load_trace(FIX / f"trace_rank{rank}.json.gz").events)
                 if i in full.kernel_args and e.get("cat") == "kernel"}
    assert victim not in by_corr and by_corr[after] == full_corr[after]
    assert [u.what for u in result.unmatched] == [
        "kernel ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"]
    cpu = [ev for ev in result.events if ev.source.value == "cpu"]
    assert len(cpu) == len(truth[3]["ops"]) == 1


def test_fr_p2p_seq_is_nccl_flight_recorders_p2p_seq_id() -> None:
    import json

    from test_gpu_p2p import check_fr

    assert check_fr(json.loads((ONE_GPU / "snap_rank0.json").read_text())) == 8


@pytest.mark.parametrize("run", [ONE_GPU, ONE_GPU.with_name("p2p-1xh100-a2a")],
                         ids=["graph-of-p2p-alone", "graph-read-at-capture-end"])
def test_coalesced_kernels_named_eager_and_in_every_replay(run: Path) -> None:
    from test_gpu_p2p import REPLAYS, check_named

    assert check_named(run, 0) == {"eager": 2, "graphed": 2 * REPLAYS, "replays": REPLAYS}


def test_replayed_p2p_kernels_keep_their_names_in_the_merged_file(tmp_path: Path) -> None:
    """The graphed run merged: verify accepts it, and each replayed SendRecv kernel slice (read
    back with Perfetto's protos) carries its ops and its replay's number."""
    from test_gpu_p2p import REPLAYS

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(ONE_GPU / "eager" / "commviz_rank0.pkl", run)
    shutil.copy(ONE_GPU / "graphed" / "trace_rank0.json.gz", run)
    out = merge_run(run, run / "merged.pftrace", workers=1, progress=False).out
    report = verify_pftrace(out, inputs=load_run(run))
    assert report.ok, [str(e) for e in report.errors[:5]]
    expected = [ops_text(t["ops"]) for t in p2p_truth(ONE_GPU / "eager" / "trace_rank0.json.gz")]
    kernels = sorted((s for s in slices(out) if s.name.startswith("ncclDevKernel_SendRecv")),
                     key=lambda s: s.ts)
    assert [s.args[md.P2P_OPS] for s in kernels] == expected * REPLAYS
    assert len({s.args[md.REPLAY] for s in kernels}) == REPLAYS
