"""Real 2- and 4-GPU NCCL runs, checked without a GPU: every NCCL kernel named, rightly.

``fixtures/gpu/proof-2xh100/`` and ``proof-4x/``: the inputs (profiler traces, commviz
records, torch's Flight Recorder dumps, resolved config) of every ``configs/gpu-2x-*.yaml``
launched on 2 x H100 by ``scripts/gpu_proof.sh``, and of every 4-GPU config
(``configs/gpu-4x-*.yaml``, ``tp-dp-4gpu.yaml``) launched on 4 x H100 by ``gpu_proof.sh 4x``
(READMEs there); ``stacks-2xh200/``: ``gpu-2x-fsdp2.yaml`` profiled with Python stacks
(``python_function`` events around every op) on 2 x H200. Each is merged here as a user would
(``commviz merge``)
and proven by ``scripts/gpu_proof.py``: the NCCL kernels counted in the profiler's own traces
all carry commviz's metadata in the merged trace; no eager kernel's metadata disagrees with the
profiler's keys; graphed kernels read as the same config's eager run (``cuda_graphs: false``)
does; every record agrees with the Flight Recorder dump (numbers, ops, sizes, dtype, ranks;
p2p numbers with ``p2p_seq_id``); every record has an origin; each rank has one comm lane per
group it is in, showing the group's ranks as torch's dumps have them, and cross-rank links join
ranks of one group only.

``fixtures/gpu/graphs-2xh100/``: ``test_gpu_graphs.py``'s own job (every collective kind and a
``batch_isend_irecv`` on three groups, two graphs) kept from the same machine; its graphed
kernels are matched and compared with the eager step as the GPU test does.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import script_module

# the module's first test waits for every kept run's merge (22 runs, up to 4 ranks each)
pytestmark = pytest.mark.timeout(900)

HERE = Path(__file__).parent
GPU = HERE / "fixtures" / "gpu"
PROOFS = ("proof-2xh100", "proof-4x", "stacks-2xh200")
GRAPHS = GPU / "graphs-2xh100"
EAGER_TWIN = {"graphs": "graphs-eager", "p2p-graphed": "p2p-graphed-eager", "tp-dp": "tp-dp-eager"}
RUNS = [f"{proof}/{p.name}" for proof in PROOFS for p in sorted((GPU / proof).iterdir())
        if p.is_dir()]


def _world(run: Path) -> int:
    import yaml

    return int(yaml.safe_load((run / "config.yaml").read_text())["job"]["nproc_per_node"])


@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every run copied and merged with the real CLI, once."""
    root = tmp_path_factory.mktemp("proof")
    procs = []
    for name in RUNS:
        shutil.copytree(GPU / name, root / name)
        procs.append((name, subprocess.Popen(
            [sys.executable, "-m", "commviz", "merge", str(root / name)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for name, proc in procs:
        out, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, out[-3000:])
    return root


@pytest.mark.parametrize("name", RUNS)
def test_every_nccl_kernel_named_and_agreeing_with_torch(merged: Path, name: str) -> None:
    proof = script_module("gpu_proof")
    twin = EAGER_TWIN.get(Path(name).name)
    row = proof.prove(merged / name, merged / Path(name).parent / twin if twin else None)
    assert row["kernels"] > 0 and row["named"] == row["kernels"], row
    assert row["sendrecv_named"] == row["sendrecv"], row
    for key in proof.MUST_BE_ZERO:
        assert row.get(key, 0) == 0, (key, row)
    assert row["verify"] == "OK" and row["fr_dumps"] == _world(merged / name), row
    assert row["lanes"] > 0 and row["links"] > 0, row
    if twin:
        assert row["graphed"] == row["kernels"] and "graph_diff" in row, row
    # NCCL's Flight Recorder keeps every p2p call (captured ones too): each one compared
    assert row["p2p_checked"] == row["p2p_records"], row


@pytest.mark.parametrize("rank", [0, 1])
def test_graphed_kernels_of_mixed_sendrecv_graphs_match_the_eager_step(rank: int) -> None:
    """all_to_all, list all_to_all and coalesced batch_isend_irecv SendRecv kernels in one
    graph, on three process groups: each named as the eager step's calls."""
    sys.path.insert(0, str(HERE))
    import test_gpu_graphs as gpu

    report = gpu.check_rank(*gpu.load_rank(GRAPHS, rank))
    gpu.assert_rank(report)
    assert report["vs_profiler"] == [], report["format_differences"]
    assert report["stats"].get("graph_matched_coalesced_p2p", 0) > 0, report["stats"]


@pytest.mark.parametrize("name", RUNS)
def test_a_healthy_run_gets_no_verdict_and_no_desync(name: str, tmp_path: Path) -> None:
    """Every proof run completed (torch's Flight Recorder has each collective completed on
    every rank): nothing to explain, no rank out of step. A scatter's input and a gather's
    output are the root's alone (TP's scatter); all_to_all's uneven splits differ by design."""
    from commviz.review.analyses.flightrec import read
    from commviz.review.analyses.reviewing import review_run
    from commviz.review.render.verdict_text import verdict_text

    run = shutil.copytree(GPU / name, tmp_path / Path(name).name)
    fr = read(run)
    assert sorted(fr) == list(range(_world(run))) and all(s == "completed" for dump in fr.values()
                                        for s in dump.states.values()), fr
    review = review_run(run)
    assert review.verdict is None, verdict_text(review.verdict)
    assert review.desyncs == []
