"""DTensor redistributes keep their module in every step, whatever else shares their shape.

Tensor-parallel blocks called in a loop issue the same all_reduce (call site, group, size) in
each block's forward; the backward of each block's ``to_local`` issues it once more, with no
module around it. A shape's origin cached from that backward call must not stand in for the
forward calls of the next step: each forward all_reduce names its block's row-parallel linear
(``named_modules()``'s name), in every step. Outside any module, ``clip_grad_norm_`` makes the
gradients' partial norm whole: named as that function, at the line that called it. Real gloo
ranks (``harness.run_ranks``).
"""

from __future__ import annotations

import inspect
import os
from collections import Counter
from typing import Any

import pytest

from harness import run_ranks

pytestmark = pytest.mark.slow

BLOCKS, STEPS = 3, 4


def _job(rank: int, world: int, run_dir: str) -> dict[str, Any]:
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    import commviz

    commviz.RECORDER.clear()
    commviz.start(run_dir, flush_interval=None)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        for _ in range(BLOCKS)])
    for block in model:
        parallelize_module(block, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    steps = []
    for _ in range(STEPS):
        mark = len(commviz.RECORDER.records())
        model(torch.randn(4, 16, requires_grad=True)).sum().backward()
        steps.append([{k: r.get(k) for k in ("commviz.origin_kind", "commviz.origin_unit",
                                             "commviz.origin_phase")}
                      for r in commviz.RECORDER.records()[mark:]])
    rowwise = [name for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.endswith(".2")]
    mark = len(commviz.RECORDER.records())
    site = f"{os.path.basename(__file__)}:{inspect.currentframe().f_lineno + 1}"
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    clip = [{k: r.get(k) for k in ("commviz.origin", "commviz.origin_kind",
                                   "commviz.origin_unit", "commviz.origin_phase")}
            for r in commviz.RECORDER.records()[mark:]]
    commviz.flush()
    return {"steps": steps, "rowwise": rowwise, "clip": clip, "clip_site": site}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_job, 2, str(tmp_path_factory.mktemp("dtensor")), timeout=180)


def test_each_forward_all_reduce_names_its_block_in_every_step(
        ranks: list[dict[str, Any]]) -> None:
    """RowwiseParallel turns each block's partial output whole (P(sum) -> R) in the forward:
    one all_reduce per block and step, named after that block's linear."""
    for out in ranks:
        assert len(out["rowwise"]) == BLOCKS
        for step in out["steps"]:
            forward = Counter(r["commviz.origin_unit"] for r in step
                              if r["commviz.origin_kind"] == "DTensor"
                              and r["commviz.origin_phase"] == "P(sum) -> R"
                              and r["commviz.origin_unit"] is not None)
            assert forward == {name: 1 for name in out["rowwise"]}, forward


def test_clip_grad_norm_names_the_gradient_norm(ranks: list[dict[str, Any]]) -> None:
    """The sharded weights' gradient norm is partial over the TP mesh (``_NormP``): each
    redistribute ``clip_grad_norm_`` makes is DTensor's, its unit the function, its line the
    test's call."""
    for out in ranks:
        assert out["clip"], "clip_grad_norm_ recorded nothing"
        for r in out["clip"]:
            assert (r["commviz.origin_kind"], r["commviz.origin_unit"]) == (
                "DTensor", "clip_grad_norm_"), r
            assert r["commviz.origin_phase"].startswith("_NormP"), r
            assert r["commviz.origin"].startswith(
                f"DTensor clip_grad_norm_ ({out['clip_site']}): _NormP"), r
