"""What a person sees of a launch: the job's output without the profiler's USDT lines, and a
failing launch's verdict before any traceback, with the per-rank logs named. A real torchrun
job on 2 gloo ranks whose rank 1 raises; launch.log keeps every line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness import REPO

FAILING = '''
import torch
import torch.distributed as dist


def build(ctx):
    def step():
        dist.all_reduce(torch.ones(4))
        if dist.get_rank() == 1:
            raise RuntimeError("boom on rank 1")
    return step
'''


@pytest.mark.slow
def test_failing_launch_shows_the_verdict_first_and_names_rank_logs(tmp_path: Path) -> None:
    (tmp_path / "failmod.py").write_text(FAILING)
    proc = subprocess.run(
        [sys.executable, "-m", "commviz.cli", "launch", "--set", "workload.entrypoint=failmod:build",
         "--set", f"workload.pythonpath=[{tmp_path}]", "--set", f"output.dir={tmp_path / 'runs'}"],
        capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 1
    out = proc.stdout + proc.stderr
    lines = out.splitlines()
    verdict = next(i for i, ln in enumerate(lines) if ln.startswith("FAILED: rank 1"))
    assert "boom on rank 1" in lines[verdict]
    assert "Traceback" not in out
    assert len(lines[:verdict]) < 10
    logs = [Path(ln.split(" log: ", 1)[1]) for ln in lines if " log: " in ln]
    assert len(logs) == 2 and all(p.is_file() for p in logs)
    assert "boom on rank 1" in logs[1].read_text()
    (run_dir,) = (tmp_path / "runs").iterdir()
    log = (run_dir / "launch.log").read_text()
    assert "Traceback" in log and "boom on rank 1" in log


# lines of a real `commviz launch` (torch 2.13 CPU, --tee 3), as torchrun printed them
REAL = [
    "[default1]:USDT:2026-11-24 05:00:19 3555:3555 SyncActivityProfilerHandler.cpp:52] "
    "profiler_start\n",
    "[default0]:step 1 done\n",
    "[default0]:USDT:2026-11-24 05:00:19 3554:3554 SyncActivityProfilerHandler.cpp:59] "
    "profiler_stop\n",
]


def test_profiler_usdt_lines_stay_off_the_terminal() -> None:
    import io

    from commviz.launch.echo import Echo

    out = io.StringIO()
    echo = Echo(out)
    for line in REAL:
        echo.write(line)
    assert out.getvalue() == "[default0]:step 1 done\n" and echo.held == 0
