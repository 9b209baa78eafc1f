"""Where torch put each rank, as torch says it: written by every worker, read by its launch.

With the c10d rendezvous, torch (not ``--node-rank``) decides which node holds which ranks: the
node whose address sorts first gets rank 0. So each worker writes what torchrun told it (``RANK``,
``LOCAL_RANK``, ``GROUP_RANK``, ``MASTER_ADDR``, its ``TORCHELASTIC_ERROR_FILE``'s directory,
where torchrun keeps its stderr) to ``RUN_DIR/logs/placement_rank{RANK}.json``, tagged with the
id of the launch that started it (``COMMVIZ_LAUNCH_ID``: run dirs may be one shared dir). After
the job each launch reads the files of its own workers: whether rank 0 ran here (then this node
merges), which ranks ran here, and where each rank's log is. At the end of a finished job rank
0's host and run dir are added (sent over the job's side group), so the other nodes can say
where the run is.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Mapping

LAUNCH_ENV = "COMMVIZ_LAUNCH_ID"       # set by the launch for its torchrun and so its workers
NAME = "placement_rank{rank}.json"
GLOB = "placement_rank*.json"


@dataclass
class Placement:
    """One rank, as torch placed it."""

    rank: int                     # RANK
    local_rank: int               # LOCAL_RANK
    group_rank: int               # GROUP_RANK: the node's rank in the rendezvous
    host: str                     # socket.gethostname() of the worker
    master_addr: str              # MASTER_ADDR: the address of rank 0's node
    launch: str                   # COMMVIZ_LAUNCH_ID of the launch that started this worker
    log_dir: str | None           # torchrun's per-rank log dir (stderr.log, error.json)
    rank0_host: str | None = None       # filled at the end of a finished job
    rank0_run_dir: str | None = None

    @property
    def stderr(self) -> Path | None:
        return Path(self.log_dir) / "stderr.log" if self.log_dir else None


def from_env(environ: Mapping[str, str]) -> Placement:
    """This worker's placement, from the environment torchrun gave it."""
    error_file = environ.get("TORCHELASTIC_ERROR_FILE")
    return Placement(rank=int(environ["RANK"]), local_rank=int(environ.get("LOCAL_RANK", 0)),
                     group_rank=int(environ.get("GROUP_RANK", 0)), host=socket.gethostname(),
                     master_addr=environ.get("MASTER_ADDR", ""),
                     launch=environ.get(LAUNCH_ENV, ""),
                     log_dir=os.path.dirname(error_file) if error_file else None)


def write(log_dir: Path, placement: Placement) -> None:
    from commviz.record.store import write_atomic

    log_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(log_dir / NAME.format(rank=placement.rank),
                 json.dumps(asdict(placement), indent=1).encode())


def of_launch(log_dir: Path, launch: str) -> list[Placement]:
    """The placements of ``launch``'s workers, by rank (unreadable files are skipped)."""
    found = []
    for path in log_dir.glob(GLOB):
        try:
            data = json.loads(path.read_text())
            placement = Placement(**data)
        except (OSError, ValueError, TypeError):
            continue
        if placement.launch == launch:
            found.append(placement)
    return sorted(found, key=lambda p: p.rank)
