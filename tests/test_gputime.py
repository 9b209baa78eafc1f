"""GPU times of NCCL ops: the plugin's file, read back and matched to commviz's records.

CPU: the compiled plugin (``commviz/record/nccl_profiler.c``) driven as NCCL drives it
(``gputime_driver.py``: its API struct through ctypes, task events on the calling thread,
kernel-channel events on a second thread, then SIGKILL); the reader must give back exactly what
the driver fed in. The matcher runs on a real 2 x H200 run kept in
``tests/fixtures/gpu/gputime-2xh200`` (this file's job), against the job's own hand counts and
its CUDA events.

GPU (``-m gpu``): the job itself, run by torchrun on 2 GPUs (this file as a script): commviz
started, NCCL loads the plugin; 256 MiB all_reduces timed by CUDA events, a subgroup's
all_gather and broadcast, send/recv, all_to_all_single, a coalesced block and a CUDA graph's
replays. ``COMMVIZ_GPU_KEEP=dir`` keeps its files.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import pytest

from harness import c_compiler

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "gpu" / "gputime-2xh200"
DRIVER = Path(__file__).with_name("gputime_driver.py")
BIG = 64 << 20                   # float32 elements of the timed all_reduce: 256 MiB
TIMED = 10                       # timed 256 MiB all_reduces
SMALL = 1 << 18                  # float32 elements of the others: 1 MiB
MID = 1 << 22                    # 16 MiB
REPEAT = 3                       # all_gather, broadcast, send/recv of the subgroup
COALESCED = 3                    # all_reduces inside one coalescing block (one c10d call)
REPLAYS = 5                      # CUDA graph replays of one captured all_reduce
STEADY = 120                     # 16 MiB all_reduces in a row: windows, every op vs sampled
WINDOW = 20
EVERY = 4


def _needs_cc() -> None:
    if c_compiler() is None:
        pytest.skip("no C compiler")


# ---------------------------------------------------------------------------------------------
# the plugin, driven as NCCL drives it
# ---------------------------------------------------------------------------------------------
def drive(out: Path, every: int) -> tuple[Path, dict[str, Any]]:
    """The driver's file (the driver SIGKILLed after its last op) and what it fed in."""
    _needs_cc()
    from commviz.record import nccl_plugin

    library = nccl_plugin.build()
    path, fed = out / "commviz_rank0.gputime", out / "fed.json"
    env = dict(os.environ, COMMVIZ_GPUTIME_FILE=str(path), COMMVIZ_GPUTIME_EVERY=str(every))
    proc = subprocess.run([sys.executable, str(DRIVER), str(library), str(fed)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    return path, json.loads(fed.read_text())


@pytest.fixture(scope="module")
def driven(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    return drive(tmp_path_factory.mktemp("gputime"), 1)


def test_reader_gives_back_what_nccl_fed_in(driven: tuple[Path, dict[str, Any]]) -> None:
    from commviz.live import gputime

    path, fed = driven
    times = gputime.read(path)
    assert {c.comm: (c.rank, c.nranks, c.nnodes, c.name) for c in times.comms.values()} == {
        int(k): tuple(v) for k, v in fed["comms"].items()}
    got = [(o.comm, o.func, o.p2p, o.seq, o.bytes, o.peer, o.tid, o.gpu_start, o.gpu_end,
            o.channels, o.expected, o.partial, o.replay) for o in times.ops]
    want = [tuple(op["entry"]) for op in fed["ops"] if op["written"]]
    assert sorted(got) == sorted(want)
    for op, fed_op in zip(sorted(times.ops, key=lambda o: o.t_enqueue),
                          sorted((o for o in fed["ops"] if o["written"]),
                                 key=lambda o: o["before"])):
        assert fed_op["before"] <= op.t_enqueue <= fed_op["after"]
    # the GPU timer the driver made up runs LAG ns behind the wall clock, and the plugin saw
    # each stamp right after it was made
    assert fed["lag"] <= times.offset_ns <= fed["lag"] + 50_000_000


def test_an_op_not_ended_is_not_written_and_the_switch_sets_ncclss_mask(
        driven: tuple[Path, dict[str, Any]]) -> None:
    _, fed = driven
    assert [op["written"] for op in fed["ops"]].count(False) == 1
    # commviz_gputime_enable(0) cleared NCCL's activation mask, (1) set it again; every call
    # keeps the whole mask
    assert fed["masks"] == [0x46, 0, 0x46]
    assert fed["calls"] == [0x46] * 8


def test_sampled_one_call_in_four_gets_the_whole_mask(tmp_path: Path) -> None:
    from commviz.live import gputime

    path, fed = drive(tmp_path, 4)
    # the group event of call n sets the mask call n + 1 starts with: 0x146 (tasks, kernel
    # channels, group events) for calls 4 and 8, the group event alone (0x100) for the others
    assert fed["masks"] == [0x146, 0, 0x146]
    assert fed["calls"] == [0x100, 0x100, 0x146, 0x100, 0x100, 0x100, 0x146, 0x100]
    assert gputime.read(path).every == 4


def test_a_file_read_as_it_grows_gives_each_op_once(driven: tuple[Path, dict[str, Any]],
                                                     tmp_path: Path) -> None:
    from commviz.live import gputime
    from commviz.record import nccl_plugin as layout

    path, _ = driven
    data = path.read_bytes()
    whole = gputime.read(path).ops
    grown = tmp_path / path.name
    follow = gputime.GpuTimes(grown)
    seen = []
    # grow the file an entry at a time, one entry written late (a writer a moment behind)
    cut = layout.HEADER_SIZE + 3 * layout.ENTRY_SIZE
    late = bytearray(data[:cut + 2 * layout.ENTRY_SIZE])
    late[cut:cut + layout.ENTRY_SIZE] = bytes(layout.ENTRY_SIZE)
    grown.write_bytes(bytes(late))
    seen += follow.poll()
    grown.write_bytes(data)
    seen += follow.poll()
    seen += follow.poll()
    assert sorted(seen) == sorted(whole)


def test_a_file_that_is_not_one_is_one_clear_error(tmp_path: Path) -> None:
    from commviz.errors import RecordError
    from commviz.live import gputime

    bad = tmp_path / "commviz_rank3.gputime"
    bad.write_bytes(b"\x89PNG" + bytes(5000))
    with pytest.raises(RecordError, match="commviz_rank3.gputime: not a commviz GPU-time file"):
        gputime.read(bad)


# ---------------------------------------------------------------------------------------------
# the matcher on a real run (the fixture, or the GPU test's own run)
# ---------------------------------------------------------------------------------------------
def check_run(run: Path) -> dict[str, Any]:
    """Every NCCL call of the job has its GPU time, as the job's hand counts and CUDA events say."""
    from commviz import metadata as md
    from commviz.live import gputime
    from commviz.record.store import load_record

    out: dict[str, Any] = {}
    for rank in (0, 1):
        record = load_record(run / f"commviz_rank{rank}.pkl")
        truth = json.loads((run / f"truth_rank{rank}.json").read_text())
        times = gputime.read(run / f"commviz_rank{rank}.gputime")
        recs = record["collectives"]
        got = gputime.match(recs, times)
        tp = truth["tp_name"]
        # the 256 MiB all_reduces: each timed, as long as CUDA events say (within 5 %)
        big = [i for i, r in enumerate(recs) if r.get(md.OP) == "all_reduce"
               and r.get(md.BYTES_IN) == BIG * 4]
        assert len(big) == TIMED
        spans = [got.spans[i] for i in big]
        events = truth["events_ms"]
        for span, ms in zip(spans, events):      # the kernel lies inside its event pair
            assert span.bytes == BIG * 4
            assert (span.end_ns - span.start_ns) / 1e6 <= ms * 1.01, (span, ms)
        busbw = [BIG * 4 / (s.end_ns - s.start_ns) for s in spans]      # 2 ranks: busbw = algbw
        events_bw = [BIG * 4 / (ms * 1e6) for ms in events]
        assert abs(median(busbw) - median(events_bw)) <= 0.05 * median(events_bw)
        # each span lies after its call began and its kernel started before the next call's did
        for i in big:
            assert got.spans[i].start_ns >= recs[i][md.T_BEGIN] - 50_000
        # the subgroup's ops: all timed, and its communicator is the subgroup's
        for op, count in (("all_gather_into_tensor", REPEAT), ("broadcast", REPEAT),
                          ("send" if rank == 0 else "recv", REPEAT), ("all_to_all_single", 1)):
            calls = [i for i, r in enumerate(recs) if r.get(md.OP) == op
                     and r.get(md.PG_NAME) == tp]
            assert len(calls) == count, op
            assert all(i in got.spans for i in calls), op
        assert tp in got.groups.values()
        # NCCL numbers each communicator's AllReduces 0, 1, 2, ... in the order they were called
        default = next(c for c, g in got.groups.items() if g == truth["default_name"])
        seqs = [o.seq for o in times.ops if o.comm == default and o.func == "AllReduce"
                and o.t_enqueue < truth["graph_ns"]]
        assert len(seqs) == 3 + TIMED + STEADY
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        # a coalesced block is one c10d call, one kernel: NCCL 2.28 stamps only its last op
        (block,) = [i for i, r in enumerate(recs) if r.get(md.OP) == "all_reduce_coalesced"]
        assert got.spans[block].ops == 1
        assert got.unmatched[gputime.STALE] == COALESCED - 1
        # the graph's replays: NCCL starts their ops from CUDA's host-callback thread; each
        # goes to the captured call, inside its replay's event pair (the ops after the flush,
        # the closing barrier's, left out)
        kept = gputime.match(recs, times, [o for o in times.ops
                                           if o.t_enqueue < truth["flush_ns"]])
        assert kept.unmatched[gputime.OUTSIDE] == 0
        (captured,) = [i for i, r in enumerate(recs) if r.get(md.CAPTURED)]
        replays = kept.replays[captured]
        assert len(replays) == REPLAYS * truth["graph_ops"]
        for span, ms in zip(replays, truth["replays_ms"]):
            assert span.bytes == SMALL * 4
            assert (span.end_ns - span.start_ns) / 1e6 <= ms * 1.01, (span, ms)
        # sampling one call in EVERY keeps each window's bus bandwidth within 5 %
        steady = [got.spans[i] for i, r in enumerate(recs) if r.get(md.OP) == "all_reduce"
                  and r.get(md.BYTES_IN) == MID * 4]
        assert len(steady) == STEADY
        worst = 0.0
        for w in range(0, STEADY, WINDOW):
            bw = [MID * 4 / (s.end_ns - s.start_ns) for s in steady[w:w + WINDOW]]
            every, sampled = median(bw), median(bw[::EVERY])
            worst = max(worst, abs(sampled - every) / every)
        assert worst <= 0.05
        out[rank] = {"spans": len(got.spans), "unmatched": dict(got.unmatched),
                     "replays_us": [(s.end_ns - s.start_ns) / 1e3 for s in replays],
                     "offset_ns": times.offset_ns, "busbw": busbw, "events_bw": events_bw,
                     "sampled_window_worst": worst}
    return out


def test_matched_on_a_real_2xh200_run() -> None:
    check_run(FIXTURE)


# ---------------------------------------------------------------------------------------------
# the GPU job
# ---------------------------------------------------------------------------------------------
def job(out: Path) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    import commviz

    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120))
    commviz.start(out)                 # before the first collective makes NCCL's communicator
    tp = dist.new_group([0, 1], group_desc="tp")
    dev = torch.device("cuda")
    x = torch.ones(BIG, device=dev)
    small = torch.ones(SMALL, device=dev)
    for _ in range(3):
        dist.all_reduce(small)
    torch.cuda.synchronize()
    events = []
    for _ in range(TIMED):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dist.all_reduce(x)
        b.record()
        events.append((a, b))
    gathered = torch.empty(SMALL * 2, device=dev)
    for _ in range(REPEAT):
        dist.all_gather_into_tensor(gathered, small, group=tp)
        dist.broadcast(small, 0, group=tp)
        if rank == 0:
            dist.send(small, 1, group=tp)
        else:
            dist.recv(small, 0, group=tp)
    dist.all_to_all_single(gathered, gathered.clone(), group=tp)
    with dist._coalescing_manager(group=tp):       # one c10d call, COALESCED NCCL ops
        for _ in range(COALESCED):
            dist.all_reduce(small, group=tp)
    mid = torch.ones(MID, device=dev)
    for _ in range(STEADY):
        dist.all_reduce(mid)
    torch.cuda.synchronize()
    graph_ns = time.time_ns()             # (a captured graph can move eager ops' task events
                                          # to CUDA's host-callback thread: none after it)
    side = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        dist.all_reduce(small)             # warm up on the side stream
        side.synchronize()
        with torch.cuda.graph(g, stream=side):
            dist.all_reduce(small)
    torch.cuda.synchronize()
    replays = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        replays.append((a, b))
    torch.cuda.synchronize()
    time.sleep(1.0)                        # NCCL's proxy thread reports the last stamps
    flush_ns = time.time_ns()
    commviz.flush()
    groups = {getattr(pg, "group_desc", ""): name
              for pg, name in dist.distributed_c10d._world.pg_names.items()}
    (out / f"truth_rank{rank}.json").write_text(json.dumps({
        "events_ms": [a.elapsed_time(b) for a, b in events],
        "replays_ms": [a.elapsed_time(b) for a, b in replays],
        "graph_ns": graph_ns, "graph_ops": 1, "flush_ns": flush_ns,
        "tp_name": tp.group_name, "default_name": dist.group.WORLD.group_name,
        "groups": groups, "nccl": list(torch.cuda.nccl.version()), "torch": torch.__version__}))
    dist.barrier()
    torch.cuda.synchronize()
    os._exit(0)


def keep_small(run: Path, dest: Path) -> None:
    """The run's files a fixture keeps: records, truths, GPU-time files without their unused
    reserved tail (all zeros: a reader reads the file as it is)."""
    from commviz.record import nccl_plugin as layout

    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(run.iterdir()):
        if path.name.startswith("truth_rank") or path.name.endswith(".pkl"):
            shutil.copy(path, dest / path.name)
        elif path.suffix == ".gputime":
            data = path.read_bytes()
            end = len(data)
            while end > layout.HEADER_SIZE and not any(data[end - layout.ENTRY_SIZE:end]):
                end -= layout.ENTRY_SIZE
            (dest / path.name).write_bytes(data[:end])


@pytest.fixture(scope="module")
def gpu_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from harness import torchrun

    out = tmp_path_factory.mktemp("gputime_run")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
           "COMMVIZ_GPUTIME_EVERY": "1"}               # every call timed: the checks count them
    proc = torchrun([str(Path(__file__).resolve()), str(out)], nproc=2, timeout=300, env=env)
    keep = os.environ.get("COMMVIZ_GPU_KEEP")
    if keep:
        keep_small(out, Path(keep) / "gputime")
        Path(keep, "gputime", "torchrun.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return out


@pytest.mark.gpu(count=2)
def test_every_nccl_op_of_a_real_job_has_its_gpu_time(gpu_run: Path) -> None:
    print(json.dumps(check_run(gpu_run), indent=1))


if __name__ == "__main__":
    job(Path(sys.argv[1]))
