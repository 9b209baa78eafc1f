"""Run real torch.distributed jobs from tests: spawned gloo ranks, or torchrun itself."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parents[1]


def c_compiler() -> str | None:
    """The C compiler pip builds commviz's extensions with, where there is one."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple,
           queue: Any, env: dict[str, str]) -> None:
    os.environ.update(env)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})
    import datetime

    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        result = fn(rank, world, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # report every failure to the parent, then exit non-zero
        queue.put((rank, "error", traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    ``fn`` must be a module-level function (processes are spawned). A failure on any rank
    fails the caller with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, queue, env or {}))
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        for _ in range(world):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]


def torchrun(args: list[str], *, nproc: int = 2, timeout: float = 180,
             env: dict[str, str] | None = None, cwd: Path | None = None
             ) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc_per_node N ARGS`` on a free port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", *args]
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=cwd or REPO)


def script_module(name: str) -> ModuleType:
    """``scripts/NAME.py`` loaded as a module (the scripts are no package): the GPU proofs'
    checks run on CI's fixtures as they run on the GPU machine."""
    path = Path(__file__).resolve().parent.parent / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
