"""Each worker's placement file, written first thing (the file and what it says:
``commviz.review.analyses.placed``, which ``commviz status`` reads too), and a launch's own workers.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Mapping

from commviz.review.analyses.placed import NAME, Placement, process_started_ns, read_all

LAUNCH_ENV = "COMMVIZ_LAUNCH_ID"       # set by the launch for its torchrun and so its workers


def from_env(environ: Mapping[str, str]) -> Placement:
    """This worker's placement, from the environment torchrun gave it."""
    error_file = environ.get("TORCHELASTIC_ERROR_FILE")
    world = environ.get("WORLD_SIZE")
    return Placement(rank=int(environ["RANK"]), local_rank=int(environ.get("LOCAL_RANK", 0)),
                     group_rank=int(environ.get("GROUP_RANK", 0)), host=socket.gethostname(),
                     master_addr=environ.get("MASTER_ADDR", ""),
                     launch=environ.get(LAUNCH_ENV, ""),
                     log_dir=os.path.dirname(error_file) if error_file else None,
                     pid=os.getpid(), started_ns=process_started_ns() or time.time_ns(),
                     world_size=int(world) if world else None)


def write(log_dir: Path, placement: Placement) -> None:
    from commviz.record.store import write_atomic

    log_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(log_dir / NAME.format(rank=placement.rank),
                 json.dumps(asdict(placement), indent=1).encode())


def of_launch(log_dir: Path, launch: str) -> list[Placement]:
    """The placements of ``launch``'s workers, by rank (unreadable files are skipped)."""
    return [p for p in read_all(log_dir) if p.launch == launch]
