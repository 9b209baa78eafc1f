"""DeepSpeed's own engine and ZeRO optimizers (stages 3, 2, 1, and 0: none) under commviz on 2
gloo ranks
(``tests/jobs/deepspeed_job.py``): every collective recorded, each named as DeepSpeed's users
know it.

What is expected comes from torch and from the model, never from commviz: torch's Flight
Recorder (every entry has its record, by group and sequence number), the job's hand marks of
when each phase ran (init, forward, backward, step), and ``Net``'s own modules and parameters
with DeepSpeed's documented rules: ZeRO-3 partitions each parameter evenly over the ranks
(padded), a backward reduces each gradient once in buckets of at most ``reduce_bucket_size``
elements (a larger parameter alone), ``gradient_clipping`` takes one norm a step.
"""

from __future__ import annotations

import importlib.util
import math
import pickle
import re
from typing import Any

import pytest

from fr_compare import FR_ENV, compare
from harness import REPO, torchrun

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None,
    reason="deepspeed not installed (scripts/setup.sh installs it)")]

WORLD = 2
ORIGIN, KIND, UNIT = "commviz.origin", "commviz.origin_kind", "commviz.origin_unit"
BUCKET, PARAMS = "commviz.zero_bucket", "commviz.zero_params"
FIRST, LAST = "commviz.zero_bucket_first", "commviz.zero_bucket_last"
IN, OUT = "In msg nelems", "Out msg nelems"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    base = tmp_path_factory.mktemp("deepspeed")
    got = torchrun([str(REPO / "tests/jobs/deepspeed_job.py"), str(base / "run"),
                    str(base / "out")], nproc=WORLD, timeout=240,
                   env={**FR_ENV, "DS_ACCELERATOR": "cpu"})
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-6000:]
    return [pickle.loads((base / "out" / f"rank{r}.pkl").read_bytes()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def model() -> dict[str, Any]:
    """What the job's model is, by torch: its modules holding parameters (in order), each
    parameter's elements, and DeepSpeed's settings the job used."""
    from jobs import deepspeed_job as job

    net = job.Net()
    modules = {name: [p.numel() for p in m.parameters(recurse=False)]
               for name, m in net.named_modules() if list(m.parameters(recurse=False))}
    return {"modules": modules, "params": dict((n, p.numel()) for n, p in net.named_parameters()),
            "bytes": [p.numel() * p.element_size() for p in net.parameters()],
            "bucket": job.ZERO["reduce_bucket_size"], "stages": job.STAGES, "steps": job.STEPS}


def _phases(rank: dict[str, Any], stage: int) -> list[tuple[str, list[dict[str, Any]]]]:
    """The records of each phase the job marked for ``stage``, in order."""
    marks = rank["marks"][stage]
    return [(phase, rank["records"][start:end])
            for (phase, start), (_, end) in zip(marks, marks[1:])]


def _padded(numel: int) -> int:
    return math.ceil(numel / WORLD) * WORLD


def _gathered_modules(unit: str, order: list[str]) -> list[str]:
    """The modules a ZeRO-3 all-gather names: "layers.0, head", or "layers.0 … head, 4 modules"
    (those between, in the model's order)."""
    m = re.fullmatch(r"(\S+) … (\S+), (\d+) modules", unit)
    if m is None:
        return unit.split(", ")
    names = order[order.index(m[1]):order.index(m[2]) + 1]
    assert len(names) == int(m[3]), unit
    return names


def test_every_collective_recorded_against_flight_recorder(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        counts = compare(rank)
        assert sum(sum(c.values()) for c in counts.values()) == len(rank["fr"]) > 0


def test_every_record_has_a_deepspeed_origin(ranks: list[dict[str, Any]]) -> None:
    """The job issues no collective of its own: each one is DeepSpeed's."""
    for rank in ranks:
        assert rank["records"]
        for r in rank["records"]:
            assert r.get(ORIGIN) and r.get(KIND) == "DeepSpeed", (r.get(ORIGIN), r.get(KIND))


def test_init_broadcasts_each_parameter(ranks: list[dict[str, Any]], model: dict) -> None:
    """``deepspeed.initialize`` broadcasts every parameter from rank 0 (as bytes), in the
    model's order; ZeRO-3 also partitions each, broadcasting it first."""
    sizes = model["bytes"]
    for rank in ranks:
        for stage in model["stages"]:
            (phase, init), *_ = _phases(rank, stage)
            assert phase == "init"
            engine = [r[IN] for r in init if r[ORIGIN] == "DeepSpeed engine broadcast model"]
            assert engine == sizes
            partition = [r[IN] for r in init if r[ORIGIN] == "ZeRO-3 partition params"]
            assert partition == (sizes if stage == 3 else [])
            assert all(r[UNIT] == "initialize" for r in init
                       if r[ORIGIN].startswith("DeepSpeed ") and r[ORIGIN].endswith(
                           "(in initialize)"))


def test_zero3_allgathers_name_the_modules_they_gather(ranks: list[dict[str, Any]],
                                                        model: dict) -> None:
    """Each all-gather in forward or backward names the modules whose parameters it gathers:
    its output is their partitions' sum; every module is gathered in each forward."""
    modules, order = model["modules"], list(model["modules"])
    for rank in ranks:
        forwards = 0
        for phase, recs in _phases(rank, 3)[1:]:
            gathers = [r for r in recs if r["commviz.op"] == "all_gather_into_tensor"]
            if phase == "step":
                assert not gathers
                continue
            seen: set[str] = set()
            for r in gathers:
                m = re.fullmatch(rf"ZeRO-3 {phase} allgather params \((.+)\)", r[ORIGIN])
                assert m is not None and m[1] == r[UNIT], (phase, r[ORIGIN])
                names = _gathered_modules(m[1], order)
                assert r[OUT] == sum(_padded(n) for name in names for n in modules[name])
                assert r[PARAMS] == sum(len(modules[name]) for name in names)
                seen.update(names)
            if phase == "forward":
                forwards += 1
                assert seen == set(modules), seen
            others = {r[ORIGIN] for r in recs if r not in gathers and
                      not r[ORIGIN].startswith("ZeRO-3 reduce bucket ")}
            assert others <= {"ZeRO-3 module trace check"}, others
        assert forwards == model["steps"]


def test_reduce_buckets_in_each_backward(ranks: list[dict[str, Any]], model: dict) -> None:
    """Each backward reduces every gradient once, in buckets numbered 0, 1, ... of at most
    ``reduce_bucket_size`` elements (a larger parameter alone); ZeRO-1 and 2 as well."""
    params = model["params"]
    for rank in ranks:
        for stage in (s for s in model["stages"] if s):
            backwards = 0
            for phase, recs in _phases(rank, stage):
                buckets = [r for r in recs if r[ORIGIN].startswith(f"ZeRO-{stage} reduce bucket ")]
                if phase != "backward":
                    assert not buckets, (stage, phase)
                    continue
                backwards += 1
                assert buckets
                op = "reduce_scatter_tensor" if stage == 3 else "all_reduce"
                assert {r["commviz.op"] for r in buckets} == {op}
                by_index: dict[int, list[dict[str, Any]]] = {}
                for r in buckets:
                    assert r[ORIGIN] == f"ZeRO-{stage} reduce bucket {r[BUCKET]}"
                    by_index.setdefault(r[BUCKET], []).append(r)
                assert [r[BUCKET] for r in buckets] == sorted(r[BUCKET] for r in buckets)
                assert list(by_index) == list(range(len(by_index)))
                assert sum(r[IN] for r in buckets) == sum(params.values())
                assert sum(rs[0][PARAMS] for rs in by_index.values()) == len(params)
                for rs in by_index.values():
                    first, last, count = rs[0][FIRST], rs[0][LAST], rs[0][PARAMS]
                    assert first in params and last in params
                    elements = sum(r[IN] for r in rs)
                    if count == 1:
                        assert first == last and elements == params[first]
                    else:
                        assert elements <= model["bucket"]
                if stage != 3:
                    assert {r[ORIGIN] for r in recs} - {r[ORIGIN] for r in buckets} == set()
            assert backwards == model["steps"]


def test_engine_without_zero(ranks: list[dict[str, Any]], model: dict) -> None:
    """Without ZeRO the engine all-reduces every gradient after the backward, once each."""
    for rank in ranks:
        backwards = [recs for phase, recs in _phases(rank, 0) if phase == "backward"]
        assert len(backwards) == model["steps"]
        for recs in backwards:
            assert {(r[ORIGIN], r["commviz.op"]) for r in recs} == {
                ("DeepSpeed engine gradient allreduce", "all_reduce")}
            assert sum(r[IN] for r in recs) == sum(model["params"].values())


def test_optimizer_step(ranks: list[dict[str, Any]], model: dict) -> None:
    """Each step takes one gradient norm (``gradient_clipping``); ZeRO-1 and 2 then gather
    the updated partitions (every parameter, padded); without ZeRO the engine takes it."""
    total = sum(model["params"].values())
    for rank in ranks:
        for stage in model["stages"]:
            steps = [recs for phase, recs in _phases(rank, stage) if phase == "step"]
            assert len(steps) == model["steps"]
            for recs in steps:
                owner = f"ZeRO-{stage}" if stage else "DeepSpeed engine"
                expected = [(f"{owner} step gradient norm", "all_reduce", 1)]
                if stage in (1, 2):
                    expected.append((f"ZeRO-{stage} step allgather params",
                                     "all_gather_into_tensor", _padded(total)))
                assert [(r[ORIGIN], r["commviz.op"], r[OUT]) for r in recs] == expected
