"""Megatron-core's own GPTModel, 1F1B and interleaved schedules, sequence parallelism, DDP,
distributed optimizer and MoE token dispatcher under commviz on 4 gloo ranks
(``tests/jobs/megatron_job.py``, one launch, four layouts): every collective recorded, each
named as Megatron's users know it.

What is expected comes from torch and from Megatron, never from commviz: torch's Flight
Recorder (every entry has its record, by group and sequence number), the job's marks of where
each layout's records start, Megatron's own account of the model on each rank (module names
and classes, ``TransformerLayer.layer_number``, the pipeline stage, its DDP's buckets) and its
documented design: a ``RowParallelLinear`` all-reduces its output in forward (and again when
activation recomputation reruns it), a ``ColumnParallelLinear`` all-reduces its input's
gradient in backward, once per micro-batch; 1F1B sends and receives the micro-batches of a
step in order; with the distributed optimizer each bucket is reduce-scattered once a step and
its parameters all-gathered after the step.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import re
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from fr_compare import FR_ENV, compare
from harness import REPO, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None,
    reason="megatron-core not installed (scripts/setup_tests.sh installs it)")]

WORLD = 4
ORIGIN, KIND, UNIT, PHASE = ("commviz.origin", "commviz.origin_kind", "commviz.origin_unit",
                             "commviz.origin_phase")
MODULE, LAYER, PARALLELISM = ("commviz.megatron_module", "commviz.megatron_layer",
                              "commviz.megatron_parallelism")
MB, CHUNK, GROUP = ("commviz.origin_microbatch", "commviz.megatron_chunk",
                    "Process Group Description")


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    base = tmp_path_factory.mktemp("megatron")
    got = torchrun([str(REPO / "tests/jobs/megatron_job.py"), str(base / "run"),
                    str(base / "out")], nproc=WORLD, timeout=400, env=FR_ENV)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-6000:]
    return base / "run", [pickle.loads((base / "out" / f"rank{r}.pkl").read_bytes())
                          for r in range(WORLD)]


@pytest.fixture(scope="module")
def ranks(job: tuple[Path, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return job[1]


def _layout(rank: dict[str, Any], name: str) -> list[dict[str, Any]]:
    """The records ``rank`` made while the job ran layout ``name``."""
    marks = rank["marks"]
    starts = [start for layout, start in marks]
    i = [layout for layout, _ in marks].index(name)
    return rank["records"][starts[i]:starts[i + 1]]


def _global(facts: dict[str, Any]) -> dict[str, tuple[str, str, int | None]]:
    """Each module of a rank's model chunks, by Megatron's account: local name -> (name with
    the global layer index, class, layer). A transformer layer's ``layer_number`` counts from 1
    over the whole model."""
    out = {}
    for modules, layers in zip(facts["modules"], facts["layers"]):
        for name, cls in modules.items():
            hit = [(local, number) for local, number in layers.items()
                   if name == local or name.startswith(local + ".")]
            if hit:
                local, number = hit[0]
                prefix = local.rpartition(".")[0]
                out[name] = (f"{prefix}.{number - 1}{name[len(local):]}", cls, number - 1)
            else:
                out.setdefault(name, (name, cls, None))
    return out


def test_every_collective_recorded_against_flight_recorder(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        counts = compare(rank)
        assert sum(sum(c.values()) for c in counts.values()) == len(rank["fr"]) > 0


def test_every_record_named_by_megatron(ranks: list[dict[str, Any]]) -> None:
    """The job issues no collective of its own, and the CPU shim's torch function mode is
    never an origin: each record names Megatron's unit, none a line (``file.py:N``)."""
    for rank in ranks:
        assert rank["records"]
        for r in rank["records"]:
            assert r.get(KIND) == "Megatron", (r.get(ORIGIN), r.get(KIND))
            assert not re.search(r"\.py:\d+", r[ORIGIN]), r[ORIGIN]
            assert "megatron_job.py" not in r["commviz.callsite"], r["commviz.callsite"]


def test_tensor_parallel_by_module_layer_and_phase(ranks: list[dict[str, Any]]) -> None:
    """TP 2 x PP 2, 1F1B, full recomputation: per micro-batch each row-parallel linear
    all-reduces in forward and in recompute, each column-parallel one in backward; named with
    Megatron's global layer index (stage 1's ``layers.0`` is the model's ``layers.2``)."""
    from jobs.megatron_job import MICROBATCHES, STEPS

    calls = MICROBATCHES * STEPS
    for r, rank in enumerate(ranks):
        facts = rank["facts"]["pp"]
        assert facts["stage"] == r // 2
        modules = _global(facts)
        layers = {layer for _, _, layer in modules.values() if layer is not None}
        assert layers == {2 * facts["stage"], 2 * facts["stage"] + 1}
        tp = [x for x in _layout(rank, "pp") if x.get(PARALLELISM) == "TP"
              and x.get(LAYER) is not None]
        assert all(x[GROUP] == "TENSOR_MODEL_PARALLEL_GROUP" for x in tp)
        got = Counter((x[MODULE], x[LAYER], x[PHASE], x["commviz.op"]) for x in tp)
        want = Counter()
        for name, cls, layer in modules.values():
            if layer is None:
                continue
            if cls == "RowParallelLinear":
                want[(name, layer, "forward", "all_reduce")] = calls
                want[(name, layer, "recompute", "all_reduce")] = calls
            elif cls == "ColumnParallelLinear":
                want[(name, layer, "backward", "all_reduce")] = calls
        assert got == want
        for x in tp:
            assert x[ORIGIN] == f"{x[MODULE]}: TP all-reduce ({x[PHASE]})"
            assert x[UNIT] == f"layer {x[LAYER]} TP"


def test_sequence_parallel_gathers_and_scatters(ranks: list[dict[str, Any]]) -> None:
    """TP 2 with sequence parallelism (the DDP layout): per micro-batch a column-parallel
    linear all-gathers its input in forward, gathers it again and reduce-scatters its input's
    gradient in backward; a row-parallel one reduce-scatters its output in forward and
    all-gathers its output's gradient in backward. The embedding's output is split over the
    sequence in forward (no communication) and its gradient all-gathered in backward: no
    module runs then, and the split's forward said nothing, so Megatron's function names it."""
    from jobs.megatron_job import MICROBATCHES, STEPS

    calls = MICROBATCHES * STEPS
    plan = {"ColumnParallelLinear": (("all-gather", "forward"), ("all-gather", "backward"),
                                     ("reduce-scatter", "backward")),
            "RowParallelLinear": (("reduce-scatter", "forward"), ("all-gather", "backward"))}
    for rank in ranks:
        modules = _global(rank["facts"]["ddp"])
        sp = [x for x in _layout(rank, "ddp") if x[ORIGIN].split(": ")[-1].startswith(
            "TP sequence-parallel")]
        assert all(x[GROUP] == "TENSOR_MODEL_PARALLEL_GROUP" for x in sp)
        assert Counter(x[ORIGIN] for x in sp) == {
            f"{name}: TP sequence-parallel {op} ({phase})": calls
            for name, cls, _ in modules.values() for op, phase in plan.get(cls, ())} | {
            "scatter_to_sequence_parallel_region: TP sequence-parallel all-gather (backward)":
                calls}


def test_pipeline_transfers_by_stage_direction_and_microbatch(
        ranks: list[dict[str, Any]]) -> None:
    """1F1B sends and receives a step's micro-batches in order: the first stage sends each
    forward and receives its gradient, the last the other way round."""
    from jobs.megatron_job import MICROBATCHES, STEPS

    for r, rank in enumerate(ranks):
        stage = rank["facts"]["pp"]["stage"]
        pp = [x for x in _layout(rank, "pp") if x.get(PARALLELISM) == "PP"]
        assert all(x[GROUP] == "PIPELINE_MODEL_PARALLEL_GROUP" for x in pp)
        directions = (("send forward", "recv backward") if stage == 0 else
                      ("recv forward", "send backward"))
        for direction in directions:
            got = [x for x in pp if x[PHASE] == direction]
            assert [x[MB] for x in got] == list(range(MICROBATCHES)) * STEPS
            assert [x[ORIGIN] for x in got] == [
                f"PP stage {stage} {direction}, microbatch {m}" for m in
                list(range(MICROBATCHES)) * STEPS]
            assert {x["commviz.op"] for x in got} == {direction.split(" ")[0]}
        assert {x[PHASE] for x in pp} == set(directions)


def test_interleaved_schedule_transfers(ranks: list[dict[str, Any]]) -> None:
    """Two model chunks a stage (layers 0 and 2 on stage 0, 1 and 3 on stage 1): activations
    go s0c0 -> s1c0 -> s0c1 -> s1c1, so per micro-batch stage 0 sends forward twice and
    receives once, stage 1 the other way round; gradients go back the same way."""
    from jobs.megatron_job import MICROBATCHES, STEPS

    for rank in ranks:
        facts = rank["facts"]["interleaved"]
        stage = facts["stage"]
        assert [sorted(n - 1 for n in chunk.values()) for chunk in facts["layers"]] == [
            [stage], [2 + stage]]
        pp = Counter(x[PHASE] for x in _layout(rank, "interleaved") if x.get(PARALLELISM) == "PP")
        twice, once = ((("send forward", "recv backward"), ("recv forward", "send backward"))
                       if stage == 0 else
                       (("recv forward", "send backward"), ("send forward", "recv backward")))
        assert pp == {**{d: 2 * MICROBATCHES * STEPS for d in twice},
                      **{d: MICROBATCHES * STEPS for d in once}}


def test_interleaved_transfers_by_microbatch_and_model_chunk(
        ranks: list[dict[str, Any]]) -> None:
    """Each interleaved transfer names its micro-batch and model chunk, by Megatron's account:
    the forward steps its schedule ran (the job's ``forward_step_func`` saw them) follow its
    ``get_schedule_table``; a stage sends each forward's output on (not the last stage's last
    chunk) and, backward, each chunk's input gradients in the order of its forwards
    (``input_tensors[chunk].pop(0)``), the chunks taken in reverse
    (``get_model_chunk_id(k, forward=False)``), not the first stage's chunk 0; a stage receives
    what its neighbour sent, in order, one chunk on where the pipeline wraps round."""
    from megatron.core.pipeline_parallel.schedules import get_schedule_table

    from jobs.megatron_job import LAYOUTS, MICROBATCHES, STEPS

    layout = LAYOUTS["interleaved"]
    chunks, stages, last = layout.vp, layout.pp, layout.vp - 1
    table = get_schedule_table(MICROBATCHES, chunks, stages)   # group size: PP by default
    sends: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for rank in ranks:
        facts = rank["facts"]["interleaved"]
        stage = facts["stage"]
        assert facts["forwards"] == table * STEPS
        forwards = facts["forwards"][:len(table)]
        sends[stage, "forward"] = [(m, c) for m, c in forwards
                                   if not (stage == stages - 1 and c == last)]
        queues = {c: [m for m, c2 in forwards if c2 == c] for c in range(chunks)}
        backwards = [(queues[last - c].pop(0), last - c) for _, c in table]
        sends[stage, "backward"] = [(m, c) for m, c in backwards if not (stage == 0 and c == 0)]
    for rank in ranks:
        stage = rank["facts"]["interleaved"]["stage"]
        expected = {
            "send forward": sends[stage, "forward"],
            "send backward": sends[stage, "backward"],
            "recv forward": [(m, c + (stage == 0))
                             for m, c in sends[(stage - 1) % stages, "forward"]],
            "recv backward": [(m, c - (stage == stages - 1))
                              for m, c in sends[(stage + 1) % stages, "backward"]]}
        pp = [x for x in _layout(rank, "interleaved") if x.get(PARALLELISM) == "PP"]
        for direction, want in expected.items():
            got = [x for x in pp if x[PHASE] == direction]
            assert [(x[MB], x[CHUNK]) for x in got] == want * STEPS, (stage, direction)
            assert [x[ORIGIN] for x in got] == [
                f"PP stage {stage} {direction}, microbatch {m}, model chunk {c}"
                for m, c in want * STEPS]


def test_ddp_buckets_and_distributed_optimizer(ranks: list[dict[str, Any]]) -> None:
    """TP 2 (sequence-parallel) x DP 2, Megatron's DDP with overlapped gradient reduction and the distributed
    optimizer: each of its buckets reduce-scattered once a step and its parameters all-gathered
    after the step. From the second step on (the first learns the order in which gradients
    become ready: ``is_first_batch``) the first bucket is reduced while backward still runs,
    before the step's last TP backward all-reduce."""
    from jobs.megatron_job import STEPS

    for rank in ranks:
        [buckets] = rank["facts"]["ddp"]["buckets"]
        records = _layout(rank, "ddp")
        reduced = [(i, x) for i, x in enumerate(records) if x[UNIT].startswith("DDP bucket")]
        gathered = [x for x in records if x[UNIT] == "distributed optimizer"]
        assert [x[ORIGIN] for _, x in reduced] == [
            f"DDP bucket {b} reduce-scatter" for b in range(buckets)] * STEPS
        assert [x[ORIGIN] for x in gathered] == [
            f"distributed optimizer param all-gather (bucket {b})"
            for b in range(buckets)] * STEPS
        assert {x[GROUP] for _, x in reduced} == {"DATA_PARALLEL_GROUP_WITH_CP"}
        backward = [i for i, x in enumerate(records) if x[PHASE] == "backward"]
        per_step = len(backward) // STEPS
        for step in range(1, STEPS):
            first = reduced[step * buckets][0]
            assert first < backward[(step + 1) * per_step - 1]


def test_moe_expert_parallel_token_all_to_all(ranks: list[dict[str, Any]]) -> None:
    """One MoE layer a transformer layer, expert parallelism 2: per micro-batch the token
    dispatcher sends the tokens and their routing probabilities all-to-all (dispatch) and the
    experts' outputs back (combine), on the expert-parallel group, named by the layer's MLP;
    their gradients go the same ways in backward."""
    from jobs.megatron_job import MICROBATCHES, STEPS

    calls = MICROBATCHES * STEPS
    for rank in ranks:
        modules = _global(rank["facts"]["moe"])
        moe = {name for name, cls, _ in modules.values() if cls == "MoELayer"}
        assert moe == {"decoder.layers.0.mlp", "decoder.layers.1.mlp"}
        ep = [x for x in _layout(rank, "moe") if x.get(PARALLELISM) == "EP"]
        assert {x[GROUP] for x in ep if x["commviz.op"] == "all_to_all_single"} == {
            "EXPERT_MODEL_PARALLEL_GROUP"}
        got = Counter(x[ORIGIN] for x in ep if x["commviz.op"] == "all_to_all_single")
        assert got == {f"{module}: EP token {step} all-to-all ({phase})": n * calls
                       for module in moe for step, n in (("dispatch", 2), ("combine", 1))
                       for phase in ("forward", "backward")}


def test_report_by_unit_per_layer_and_parallelism(job: tuple[Path, list[dict[str, Any]]],
                                                   tmp_path: Path) -> None:
    """``commviz report --by unit`` rolls Megatron's records up per layer and parallelism,
    per pipeline stage and per DDP bucket."""
    from commviz.review.render.report_formats import write_report

    run_dir, snaps = job
    report = json.loads(write_report(run_dir, fmt="json", plots=False, by="unit",
                                     out=tmp_path / "r.json").text)
    units = {row["origin"] for row in report["by_unit"]}
    [buckets] = snaps[0]["facts"]["ddp"]["buckets"]
    assert {f"Megatron layer {i} TP" for i in range(4)} | {
        f"Megatron layer {i} EP" for i in range(2)} | {
        f"Megatron PP stage {s}" for s in range(2)} | {
        f"Megatron DDP bucket {b}" for b in range(buckets)} <= units, units
