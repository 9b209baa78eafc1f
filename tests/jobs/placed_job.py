"""A workload that writes down where torch ran it: each rank's ``RANK``, ``GROUP_RANK`` and
``LOCAL_RANK`` from torchrun's environment, with the test's own label for the launch that started
it (``TEST_NODE``), into ``args.where_dir``. The multi-node tests' account of which ranks ran
where, independent of commviz. ``args.fail_rank``: that rank raises at its second step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

KEYS = ("RANK", "GROUP_RANK", "LOCAL_RANK", "TEST_NODE")


def build(ctx: Any) -> Callable[[], None]:
    where = Path(ctx.args["where_dir"])
    where.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["RANK"])
    (where / f"rank{rank}.json").write_text(json.dumps({k: os.environ[k] for k in KEYS}))
    fail = ctx.args.get("fail_rank")
    t = torch.ones(64)
    steps = [0]

    def step() -> None:
        steps[0] += 1
        if rank == fail and steps[0] == 2:
            raise RuntimeError(f"planned failure on rank {rank}")
        ctx.dist.all_reduce(t)
    return step
