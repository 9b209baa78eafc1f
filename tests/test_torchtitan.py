"""torchtitan's own Trainer under commviz: every record Flight Recorder's, every origin the unit
that issued the op.

``tests/jobs/titan_job.py`` trains torchtitan's llama3 debugmodel (its model, parallelize,
pipeline split, loss, optimizer and LR schedule untouched; random tokens) on 4 gloo ranks, one
run per layout: FSDP2 x TP with full activation checkpointing, PP x TP with torch's ``1F1B``
and with ``Interleaved1F1B``. What each record should say comes from elsewhere: torch's Flight
Recorder dump of each rank (which ops, groups and numbers), torchtitan's own module tree (the
unit names: its config built on the meta device, no wrapper around any module), the layers and
stages torchtitan gave each rank, the times the trainer started each step, and hand counts of
what the program does per step (below, at each test).
"""

from __future__ import annotations

import json
import pickle
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from fr_compare import FR_ENV, compare, from_dump
from harness import REPO, torchrun

pytestmark = pytest.mark.slow

JOB = REPO / "tests" / "jobs" / "titan_job.py"
STEPS, MICROBATCHES, WORLD = 2, 4, 4     # titan_job's MICROBATCHES: a pipeline step's
ORIGIN, KIND, UNIT, PHASE, MB = ("commviz.origin", "commviz.origin_kind", "commviz.origin_unit",
                                 "commviz.origin_phase", "commviz.origin_microbatch")
SETUP = ("shape inference", "p2p warm-up")


class Titan(NamedTuple):
    """One run: per rank its records, its Flight Recorder dump, and what torchtitan says
    (``modules``: its module tree's names; ``layers``: the layers of each model part this
    rank holds; ``stages``: its pipeline stages; ``steps``: when each step started, ns)."""

    records: dict[int, list[dict[str, Any]]]
    fr: dict[int, dict[str, Any]]
    titan: dict[int, dict[str, Any]]

    def step(self, rank: int, record: dict[str, Any]) -> int:
        """The trainer's step (1, 2, ...) a record was made in; 0 before the first."""
        return sum(record["commviz.t_begin_ns"] >= t for t in self.titan[rank]["steps"])


def _run(base: Path, layout: str) -> Titan:
    from commviz.trace.run import load_run

    run_dir = base / "run"
    proc = torchrun([str(JOB), str(run_dir), layout, str(STEPS)], nproc=WORLD, timeout=420,
                    env=FR_ENV)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    run = load_run(run_dir)
    return Titan({r: run.ranks[r].record["collectives"] for r in range(WORLD)},
                 {r: pickle.loads((run_dir / "fr" / f"fr_rank{r}").read_bytes())
                  for r in range(WORLD)},
                 {r: json.loads((base / f"titan_{layout}_rank{r}.json").read_text())
                  for r in range(WORLD)})


@pytest.fixture(scope="module")
def fsdp_tp(tmp_path_factory: pytest.TempPathFactory) -> Titan:
    return _run(tmp_path_factory.mktemp("titan_fsdp_tp"), "fsdp_tp")


@pytest.fixture(scope="module")
def pp_1f1b(tmp_path_factory: pytest.TempPathFactory) -> Titan:
    return _run(tmp_path_factory.mktemp("titan_pp_1f1b"), "pp_1f1b")


@pytest.fixture(scope="module")
def pp_interleaved(tmp_path_factory: pytest.TempPathFactory) -> Titan:
    return _run(tmp_path_factory.mktemp("titan_pp_interleaved"), "pp_interleaved")


LAYOUTS = ("fsdp_tp", "pp_1f1b", "pp_interleaved")
PIPELINES = ("pp_1f1b", "pp_interleaved")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_record_is_flight_recorders_and_has_an_origin(request: pytest.FixtureRequest,
                                                             layout: str) -> None:
    """Each collective record has Flight Recorder's group and sequence number (and its op,
    sizes, dtype and ranks), each Flight Recorder entry a record. gloo's Flight Recorder keeps
    no p2p entry (torch 2.13): the pipelines' p2p records are counted by hand
    (``test_pipeline_transfers_by_the_schedule``)."""
    run: Titan = request.getfixturevalue(layout)
    for rank in range(WORLD):
        counts = compare(from_dump(run.fr[rank], run.records[rank]))
        assert sum(sum(c.values()) for c in counts.values()) > 100, counts
        assert all(r.get(ORIGIN) for r in run.records[rank])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_dtensor_names_torchtitans_module(request: pytest.FixtureRequest, layout: str) -> None:
    """Every DTensor redistribute names a module of torchtitan's tree, as it is written there
    (no ``_checkpoint_wrapped_module``), and one of the layers this rank holds, whatever range
    it was issued in (a pipeline action, FSDP's post-backward): forward, backward and
    recompute alike. The only ones outside a module are ``clip_grad_norm_``'s (torchtitan's,
    by its name): once a step on each mesh dimension the gradients' norm is partial over (FSDP
    and TP; TP alone with pipelining), at the trainer's line that calls it."""
    run: Titan = request.getfixturevalue(layout)
    for rank in range(WORLD):
        titan = run.titan[rank]
        modules = set(titan["modules"])
        held = {f"layers.{n}" for part in titan["layers"] for n in part}
        dtensor = [r for r in run.records[rank] if r[KIND] == "DTensor"]
        assert all(r.get(UNIT) is not None for r in dtensor)
        norm = [r for r in dtensor if r[UNIT] == "clip_grad_norm_"]
        assert len(norm) == STEPS * (2 if layout == "fsdp_tp" else 1), Counter(
            r[ORIGIN] for r in norm)
        assert all(r[PHASE].startswith("_NormP") and "(trainer.py:" in r[ORIGIN] for r in norm)
        named = [r for r in dtensor if r[UNIT] != "clip_grad_norm_"]
        assert {r[UNIT] for r in named} <= modules, {r[UNIT] for r in named} - modules
        layers = {".".join(r[UNIT].split(".")[:2]) for r in named
                  if r[UNIT].startswith("layers.")}
        assert layers == held, (layers, held)


def test_fsdp_tp_units_by_hand(fsdp_tp: Titan) -> None:
    """FSDP2 x TP with full activation checkpointing, per step and rank, as torchtitan's TP
    plan and FSDP wrapping make them: layers.3's attention all-gathers its sequence-sharded
    input (S(1) -> R) in the forward and again in the recompute, and reduce-scatters that
    input's gradient (P(sum) -> S(1)) in the backward (its output projection, ``wo``, the
    other way round); each layer's two norm weights are
    TP-replicated, their gradients all-reduced over TP (P(sum) -> R) inside FSDP's
    post-backward, named after the norm; FSDP reduce-scatters each layer's gradients once,
    on its own group."""
    for rank in range(WORLD):
        recs = fsdp_tp.records[rank]
        groups = {name: g["desc"] for name, g in from_dump(fsdp_tp.fr[rank], [])["groups"].items()}
        def dtensor(unit: str) -> Counter:
            return Counter((r["commviz.op"], r[PHASE]) for r in recs
                           if r[KIND] == "DTensor" and r.get(UNIT) == unit)
        assert dtensor("layers.3.attention") == {
            ("all_gather_into_tensor_coalesced", "S(1) -> R"): 2 * STEPS,
            ("reduce_scatter_tensor_coalesced", "P(sum) -> S(1)"): STEPS}
        # its output projection the other way round: its partial output reduce-scattered back
        # to sequence shards (forward, recompute), that gradient all-gathered (backward)
        assert dtensor("layers.3.attention.wo") == {
            ("reduce_scatter_tensor_coalesced", "P(sum) -> S(1)"): 2 * STEPS,
            ("all_gather_into_tensor_coalesced", "S(1) -> R"): STEPS}
        assert all(fsdp_tp.step(rank, r) >= 1 for r in recs if r.get(UNIT) == "layers.3.attention")
        for n in range(6):
            for norm in ("attention_norm", "ffn_norm"):
                grads = [r for r in recs if r.get(UNIT) == f"layers.{n}.{norm}"]
                assert [(r[KIND], r["commviz.op"], r[PHASE], groups[r["Process Group Name"]])
                        for r in grads] == [("DTensor", "all_reduce", "P(sum) -> R",
                                             "mesh_tp")] * STEPS
            scattered = [r for r in recs if r[KIND] == "FSDP" and r[PHASE] == "reduce-scatter"
                         and r[UNIT] == f"layers.{n}"]
            assert len(scattered) == STEPS
        assert {groups[r["Process Group Name"]] for r in recs if r[KIND] == "FSDP"} == {
            "mesh_fsdp"}


@pytest.mark.parametrize("layout", PIPELINES)
def test_pipeline_transfers_by_the_schedule(request: pytest.FixtureRequest, layout: str) -> None:
    """The schedule's set-up (its p2p warm-up, its shape inference) in the first step alone;
    every later p2p transfer its stage's action and micro-batch: per step, each stage this
    rank holds receives each micro-batch's input and sends its output (first and last stage
    excepted) and, backwards, the gradients. Collectives are never the schedule's: DTensor's,
    FSDP's and the loss's are named by what issued them."""
    run: Titan = request.getfixturevalue(layout)
    n_stages = 1 + max(s for titan in run.titan.values() for s in titan["stages"])
    for rank in range(WORLD):
        recs = run.records[rank]
        stages = run.titan[rank]["stages"]
        setup = [r for r in recs if r.get(PHASE) in SETUP]
        assert setup and {run.step(rank, r) for r in setup} == {1}
        assert all(r[KIND] == "pipelining" and r["commviz.kind"] == "p2p" for r in setup)
        assert all(r["commviz.kind"] == "p2p" for r in recs if r[KIND] == "pipelining")
        p2p = [r for r in recs if r["commviz.kind"] == "p2p"]
        assert all(r[KIND] == "pipelining" for r in p2p), Counter(r[ORIGIN] for r in p2p)
        later = Counter((r[UNIT], r[PHASE], r.get(MB)) for r in p2p if run.step(rank, r) == 2)
        want: Counter = Counter()
        for s in stages:
            for action, there in (("RECV_F", s > 0), ("SEND_F", s < n_stages - 1),
                                  ("RECV_B", s < n_stages - 1), ("SEND_B", s > 0)):
                want.update({(f"stage {s}", action, mb): 1 for mb in range(MICROBATCHES)}
                            if there else {})
        assert later == want
