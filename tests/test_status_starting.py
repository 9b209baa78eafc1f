"""Issue 33: ``commviz status`` while a job's ranks are still starting, before any records.

On a fresh node each rank's first ``import torch`` (and the boundary kernel's build) takes tens
of seconds before anything is recorded. A real 4-rank gloo ``commviz launch`` is held there
(``tests/jobs/hold_torch``: each rank's first import of torch waits), and ``commviz status``
runs meanwhile. What is expected comes from the operating system: the worker processes torchrun
started (``/proc``: the launch's descendants running ``commviz.launch.worker``, their ``RANK``
and start time), never from commviz's own files.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from harness import REPO

HOLD_S = 25
WORLD = 4
HOLD_DIR = Path(__file__).parent / "jobs" / "hold_torch"


def _children(pid: int) -> dict[int, int]:
    """pid -> parent pid of every process below ``pid`` (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    below, todo = {}, [pid]
    while todo:
        p = todo.pop()
        for child, parent in parents.items():
            if parent == p and child not in below:
                below[child] = parent
                todo.append(child)
    return below


def _workers(launch_pid: int) -> dict[int, int]:
    """RANK -> pid of each worker process below the launch (its command line and environment,
    as the kernel has them)."""
    out = {}
    for pid in _children(launch_pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            env = dict(item.split(b"=", 1) for item in
                       Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if b"commviz.launch.worker" in cmd and b"RANK" in env:
            out[int(env[b"RANK"])] = pid
    return out


def test_status_says_which_ranks_started_and_are_not_recording_yet(tmp_path: Path) -> None:
    run_dir = tmp_path / "out" / "run"
    path = os.pathsep.join([str(HOLD_DIR), str(REPO), os.environ.get("PYTHONPATH", "")])
    (tmp_path / "job.yaml").write_text(textwrap.dedent(f"""
        name: starting
        job:
          nproc_per_node: {WORLD}
          env: {{PYTHONPATH: "{path}", HOLD_TORCH_IMPORT_S: "{HOLD_S}"}}
        workload:
          steps: 1
          warmup_steps: 0
          collectives: [{{op: all_reduce, group: world, size: 1KiB}}]
        profile: {{enabled: false}}
        output: {{dir: "{tmp_path / 'out'}", run_name: run, merge: false, report: false}}
        """))
    began = time.time()
    launch = subprocess.Popen([sys.executable, "-m", "commviz", "launch",
                               str(tmp_path / "job.yaml")], cwd=tmp_path, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              start_new_session=True)
    workers: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 120
        while len(workers) < WORLD and time.monotonic() < deadline and launch.poll() is None:
            time.sleep(0.5)
            workers = _workers(launch.pid)
        assert len(workers) == WORLD, launch.stdout.read() if launch.poll() is not None else ""
        time.sleep(3)                 # the workers are past their start, held in import torch
        assert all("torch" not in Path(f"/proc/{pid}/maps").read_text() for pid in
                   workers.values())                         # torch is not loaded yet
        got = subprocess.run([sys.executable, "-m", "commviz", "status", str(run_dir),
                              "--wait", "1"], capture_output=True, text=True, timeout=60)
        assert launch.poll() is None                         # still starting when it was asked
        out = got.stdout
        assert got.returncode == 0, out + got.stderr
        assert "no rank of it runs on this host" not in out, out
        line = next(ln for ln in out.splitlines() if "started" in ln)
        m = re.match(r"  ranks (\S+) on (\S+), pid\(s\) ([\d, ]+): started (\d+) s ago .*"
                     r"not recording yet", line)
        assert m, out
        assert m.group(1) == f"0-{WORLD - 1}" and m.group(2) == socket.gethostname(), out
        assert sorted(int(p) for p in m.group(3).split(", ")) == sorted(workers.values()), out
        assert 0 <= int(m.group(4)) <= time.time() - began + 1, out
        assert "no rank records yet" in out, out
        rest, _ = launch.communicate(timeout=300)
        assert launch.returncode == 0, rest
    finally:
        _stop(launch, workers, run_dir / "config.yaml")


def _stop(launch: subprocess.Popen, workers: dict[int, int], config: Path) -> None:
    """A failed test leaves nothing running: the launch and torchrun (the session the test
    started), then those of its workers still running this job's config."""
    if launch.poll() is not None:
        return
    os.killpg(launch.pid, signal.SIGTERM)
    try:
        launch.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(launch.pid, signal.SIGKILL)
        launch.wait()
    for pid in workers.values():
        try:
            if str(config).encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
