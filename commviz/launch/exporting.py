"""The job's Prometheus exporter (config ``live.exporter``): ``commviz exporter`` as a process of
its own beside torchrun, for as long as the job runs.

A separate process, not a thread of the launch: whatever happens to it (a crash, a hang, a
flood of scrapes) happens outside the ranks and outside the launch that waits for them. In a
multi-node job each node's launch starts one for the ranks running on its host (``--local``:
the run dir may be shared). It is told the launch's pid (``--parent``) and leaves when the launch
is gone, also when the launch itself was killed and could not stop it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

STOP_WAIT_S = 5.0


def start(address: str | None, run_dir: Path, multi: bool) -> subprocess.Popen | None:
    """Start the exporter on ``address`` (None: none); it says where it serves on stdout."""
    if address is None:
        return None
    command = [sys.executable, "-m", "commviz", "exporter", str(run_dir), "--address", address,
               "--parent", str(os.getpid())]
    return subprocess.Popen(command + (["--local"] if multi else []), stdin=subprocess.DEVNULL)


def stop(proc: subprocess.Popen | None) -> None:
    """Stop it once the job has ended (killed if it does not stop within ``STOP_WAIT_S``)."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
