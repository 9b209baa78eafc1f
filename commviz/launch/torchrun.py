"""The torchrun command and environment of each node, and running it as a subprocess.

Nothing home-made spawns processes: every node runs torchrun (``torch.distributed.run``, through
``commviz.launch.elastic``, which keeps the elastic agent's per-rank results in the run dir) with
the c10d rendezvous, which starts ``commviz.launch.worker`` on each of its ranks. The launcher
tees torchrun's output into ``RUN_DIR/launch.log``.
"""

from __future__ import annotations

import os
import random
import shlex
import socket
import subprocess
import sys
from pathlib import Path
from typing import TextIO

from commviz.launch.config import MULTICAST_OFF
from commviz.launch.elastic import RESULTS_ENV
from commviz.launch.placement import LAUNCH_ENV
from commviz.launch.config_schema import Config
from commviz.review.analyses.exits import LOG_DIR, results_name

WORKER = "commviz.launch.worker"


EPHEMERAL_LOW = 32768           # where Linux's ephemeral range starts by default
BELOW = 12768                   # ports tried: this many just below that range (20000-32767)


def free_endpoint(tries: int = 64) -> str:
    """A free local port for a single-node rendezvous, below the kernel's ephemeral range.

    The port is free when chosen, and torchrun binds it a moment later. A port from the
    ephemeral range (what binding port 0 gives) may be taken in that moment by any socket that
    binds port 0, such as NCCL's and gloo's sockets in a job beside this one. torchrun then meets
    a stranger and times out as its client. No socket of that kind takes a port below the range.
    """
    low = _ephemeral_low()
    first = max(1024, low - BELOW)
    rng = random.SystemRandom()
    for _ in range(tries if low - first >= 1000 else 0):   # no room below: the kernel's choice
        port = rng.randrange(first, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return f"127.0.0.1:{port}"
    with socket.socket() as s:          # every try taken: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; elsewhere its usual start)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_LOW


def command(config: Config, node_rank: int, config_path: Path, run_dir: Path) -> list[str]:
    """The exact torchrun command line for ``node_rank`` (``rdzv_endpoint`` already resolved)."""
    job = config.job
    return [
        sys.executable, "-m", "commviz.launch.elastic",      # torchrun, its results kept
        "--nnodes", str(job.nnodes),
        "--nproc_per_node", str(job.nproc_per_node),
        "--node_rank", str(node_rank),
        "--rdzv_backend", "c10d",
        "--rdzv_endpoint", str(job.rdzv_endpoint),
        "--rdzv_id", job.rdzv_id,
        "--rdzv_conf", f"join_timeout={job.join_timeout_s}",
        *(["--local_addr", job.local_addr] if job.local_addr else []),
        "--max_restarts", "0",
        "--log_dir", str(run_dir / LOG_DIR),
        "--tee", "3",
        "-m", WORKER, "--config", str(config_path),
    ]


def environment(config: Config) -> dict[str, str]:
    """What the launcher adds to torchrun's environment (and so to every rank's)."""
    env = {"OMP_NUM_THREADS": "1", **config.job.env, "PYTHONUNBUFFERED": "1"}
    env.update(MULTICAST_OFF)   # NVLink multicast stays off, whatever else is set
    return env


def shell_line(config: Config, node_rank: int, config_path: Path, run_dir: Path) -> str:
    """One node's command as a shell line, its environment in front."""
    env = environment(config)
    return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in env.items()),
                     shlex.join(command(config, node_rank, config_path, run_dir))])


def run(config: Config, node_rank: int, config_path: Path, run_dir: Path, log: TextIO,
        launch_id: str, echo: TextIO | None = None) -> int:
    """Run torchrun for this node; its output goes to ``log`` and ``echo``. Returns its exit code.

    ``launch_id`` tags this launch's workers (``commviz.launch.placement``). Ctrl-C reaches
    torchrun too (same process group); we wait for it to stop its workers.
    """
    cmd = command(config, node_rank, config_path, run_dir)
    env = dict(os.environ, **environment(config), **{
        LAUNCH_ENV: launch_id,
        RESULTS_ENV: str(run_dir / LOG_DIR / results_name(node_rank))})
    log.write("$ " + shell_line(config, node_rank, config_path, run_dir) + "\n")
    log.flush()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, errors="replace")
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            log.write(line)
            if echo is not None:
                echo.write(line)
                echo.flush()
    except KeyboardInterrupt:
        proc.wait()
        raise
    return proc.wait()
