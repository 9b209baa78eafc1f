"""GPU: point-to-point kernels named, eager and graphed, and NCCL's p2p numbers recorded.

One torchrun job (this file run as a script, NCCL, Flight Recorder on, any number of ranks:
on one GPU every op goes to the rank itself, which NCCL runs inside a group) issues
``batch_isend_irecv`` rings (each rank sends to the next and receives from the previous one)
and an ``all_to_all_single``; with several ranks also a lone ``isend``/``irecv`` pair. It runs
that step eagerly under the profiler, then captures the rings into a CUDA graph and replays it
under the profiler (a graph that also holds SendRecv kernels of other calls, an all_to_all or a
lone send, is reported by the matcher, not labelled: which kernel is which is not known there). Expectations come from torch: Flight Recorder's ``p2p_seq_id`` of every p2p op
(``fr_compare``), and the profiler's own ``record_param_comms`` op of every send and receive
(``independent.p2p_truth``). ``COMMVIZ_GPU_KEEP=dir`` keeps the job's files (the fixture
``tests/fixtures/gpu/p2p-1xh100`` is such a copy).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from fr_compare import FR_ENV

REPO = Path(__file__).resolve().parents[1]
N = 1024                                # elements a buffer (4 KiB of floats)
RING_SIZES = (N, N // 4)
REPLAYS = 3


def rings(dist: Any, b: dict[str, Any], rank: int, world: int) -> None:
    """Two coalesced rings of different sizes: each rank sends to the next, receives from the
    previous one (on one rank: itself)."""
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    for size in RING_SIZES:
        ops = [dist.P2POp(dist.isend, b["send"][:size], nxt),
               dist.P2POp(dist.irecv, b["recv"][:size], prev)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def step(dist: Any, b: dict[str, Any], rank: int, world: int) -> None:
    """The rings, an all_to_all, and (several ranks) a lone isend/irecv pair."""
    rings(dist, b, rank, world)
    dist.all_to_all_single(b["a2a_out"], b["a2a_in"])
    if world > 1:                                     # uncoalesced: one kernel an op
        nxt, prev = (rank + 1) % world, (rank - 1) % world
        if rank % 2 == 0:
            dist.isend(b["send"], nxt).wait()
            dist.irecv(b["recv"], prev).wait()
        else:
            dist.irecv(b["recv"], prev).wait()
            dist.isend(b["send"], nxt).wait()


def job(out: Path) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(Path(__file__).parent))
    import commviz
    from commviz import capture
    from fr_compare import snapshot

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local),
                            timeout=datetime.timedelta(seconds=120))
    world = dist.get_world_size()
    commviz.start(out / "eager")
    dev = torch.device("cuda")
    b = {"send": torch.full((N,), float(rank + 1), device=dev), "recv": torch.zeros(N, device=dev),
         "a2a_in": torch.full((N * world,), float(rank), device=dev),
         "a2a_out": torch.zeros(N * world, device=dev)}
    step(dist, b, rank, world)                        # warm up: communicators
    torch.cuda.synchronize()
    with commviz.profile(out / "eager"):
        step(dist, b, rank, world)
        torch.cuda.synchronize()
    expected = float((rank - 1) % world + 1)
    assert torch.all(b["recv"] == expected).item(), "the ring delivered the wrong data"
    snap = snapshot()                                 # the eager calls, before the capture
    g = torch.cuda.CUDAGraph()
    with capture.graph(g):                            # the rings alone (module docstring)
        rings(dist, b, rank, world)
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    with commviz.profile(out / "graphed"):
        for _ in range(REPLAYS):
            g.replay()
        torch.cuda.synchronize()
    (out / f"snap_rank{rank}.json").write_text(json.dumps(
        {"fr": snap["fr"], "records": snap["records"], "world": world,
         "nccl": list(torch.cuda.nccl.version()), "torch": torch.__version__}, default=str))
    commviz.RECORDER.flush("explicit", run_dir=out / "eager")
    commviz.flush()
    dist.barrier()
    torch.cuda.synchronize()
    os._exit(0)


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from harness import torchrun

    out = tmp_path_factory.mktemp("gpu_p2p")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", **FR_ENV}
    nproc = min(torch.cuda.device_count(), 2)
    proc = torchrun([str(Path(__file__).resolve()), str(out)], nproc=nproc, timeout=300, env=env)
    keep = os.environ.get("COMMVIZ_GPU_KEEP")
    if keep:
        shutil.copytree(out, Path(keep) / "gpu_p2p", dirs_exist_ok=True)
        Path(keep, "gpu_p2p", "torchrun.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


# ---------------------------------------------------------------------------------------------
# the checks (also run by test_match_p2p.py on the copy kept in tests/fixtures/gpu/p2p-1xh100)
# ---------------------------------------------------------------------------------------------
def check_fr(snap: dict[str, Any]) -> int:
    """Per group, the k-th p2p op Flight Recorder kept has commviz's k-th p2p record's
    ``commviz.fr_p2p_seq`` as its ``p2p_seq_id`` (same direction and size). Returns the count."""
    from fr_compare import p2p_pairs

    pairs = p2p_pairs(snap)
    assert pairs, "no p2p op in Flight Recorder"
    for entry, rec in pairs:
        assert rec["commviz.fr_p2p_seq"] == entry["p2p_seq"], (entry, rec)
    return len(pairs)


def check_named(run: Path, rank: int) -> dict[str, int]:
    """Every SendRecv kernel of the eager step that carried sends and receives carries the ops
    the profiler recorded for it (``independent.p2p_truth``); in every replay of the captured
    rings, the k-th SendRecv kernel carries the same ops as the k-th eager one, with its
    replay's number. Returns counts."""
    from commviz import metadata as md
    from commviz.match import match_rank
    from commviz.record.store import load_record
    from commviz.trace.load import load_trace
    from independent import ops_text, p2p_truth

    record = load_record(run / "eager" / f"commviz_rank{rank}.pkl")
    truth = [t for t in p2p_truth(run / "eager" / f"trace_rank{rank}.json.gz") if t["ops"]]
    expected = [ops_text(t["ops"]) for t in truth]
    assert len(expected) >= len(RING_SIZES), truth
    counts = {"eager": 0, "graphed": 0, "replays": 0}
    for part in ("eager", "graphed"):
        trace = load_trace(run / part / f"trace_rank{rank}.json.gz")
        result = match_rank(trace, record, rank=rank)
        assert not [u for u in result.unmatched if "SendRecv" in u.what], result.unmatched
        replays: dict[Any, list] = {}
        for i, ev in enumerate(trace.events):
            if ev.get("cat") == "kernel" and ev["name"].startswith("ncclDevKernel_SendRecv"):
                replays.setdefault(ev["args"]["correlation"], []).append((ev["ts"], i))
        if part == "eager":
            labels = [result.kernel_args[i][md.P2P_OPS]
                      for c in (t["correlation"] for t in truth) for _, i in replays[c]]
            assert labels == expected
            counts["eager"] = len(labels)
            continue
        assert replays, "no replayed SendRecv kernel"
        for corr, ks in replays.items():
            args = [result.kernel_args[i] for _, i in sorted(ks)]
            assert [a[md.P2P_OPS] for a in args] == expected[:len(RING_SIZES)], corr
            assert len({a[md.REPLAY] for a in args}) == 1
            counts["graphed"] += len(args)
        counts["replays"] = len(replays)
    return counts


def _ranks(run: Path) -> list[int]:
    return sorted(int(p.stem.split("rank")[1]) for p in run.glob("snap_rank*.json"))


@pytest.mark.gpu(count=1)
def test_fr_p2p_seq_is_flight_recorders_p2p_seq_id(gpu_run: Path) -> None:
    for rank in _ranks(gpu_run):
        check_fr(json.loads((gpu_run / f"snap_rank{rank}.json").read_text()))


@pytest.mark.gpu(count=1)
def test_every_p2p_kernel_is_named_eager_and_graphed(gpu_run: Path) -> None:
    for rank in _ranks(gpu_run):
        counts = check_named(gpu_run, rank)
        assert counts["replays"] == REPLAYS, counts


if __name__ == "__main__":
    job(Path(sys.argv[1]))
