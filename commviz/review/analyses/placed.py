"""Where torch put each rank of a ``commviz launch`` job and when its process started: the
placement file every worker writes first thing (``commviz.launch.placement`` writes it), read
without torch by its launch and by ``commviz status``.

With the c10d rendezvous, torch (not ``--node-rank``) decides which node holds which ranks: the
node whose address sorts first gets rank 0. So each worker writes what torchrun told it (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``GROUP_RANK``, ``MASTER_ADDR``, its ``TORCHELASTIC_ERROR_FILE``'s
directory, where torchrun keeps its stderr), its pid and when its process started to
``RUN_DIR/logs/placement_rank{RANK}.json``, tagged with the id of the launch that started it
(``COMMVIZ_LAUNCH_ID``: run dirs may be one shared dir), before it imports torch. After the job
each launch reads the files of its own workers: whether rank 0 ran here (then this node merges),
which ranks ran here, and where each rank's log is. At the end of a finished job rank 0's host
and run dir are added (sent over the job's side group), so the other nodes can say where the
run is. While the job starts, they say which ranks started, and since when, before any of them
records (importing torch, joining the process group, building the c10d boundary kernel).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

NAME = "placement_rank{rank}.json"
GLOB = "placement_rank*.json"
CLOCK_SLACK_NS = 2_000_000_000    # a process's start read twice: boot time is whole seconds


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
    pid: int | None = None        # the worker's process
    started_ns: int | None = None       # when that process started (wall clock)
    world_size: int | None = None       # WORLD_SIZE
    rank0_host: str | None = None       # filled at the end of a finished job
    rank0_run_dir: str | None = None

    @property
    def stderr(self) -> Path | None:
        return Path(self.log_dir) / "stderr.log" if self.log_dir else None


def read_all(log_dir: Path) -> list[Placement]:
    """Every placement file under ``log_dir``, by rank (unreadable files are skipped: one
    being written, or another program's)."""
    found = []
    for path in log_dir.glob(GLOB):
        try:
            found.append(Placement(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(found, key=lambda p: p.rank)


def process_started_ns(pid: int | None = None) -> int | None:
    """When process ``pid`` (default: this one) on this host started, on the wall clock
    (Linux's ``/proc/PID/stat`` start time after boot); None: no such process, or no
    ``/proc``. Good to the second the kernel gives boot time in."""
    try:
        stat = Path(f"/proc/{pid or os.getpid()}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])    # starttime: field 22 of stat(5)
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot * 1_000_000_000 + ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def alive(p: Placement) -> bool:
    """Whether the rank's process still runs (on this host: its pid, started when it says;
    a pid reused by a later process does not count)."""
    started = process_started_ns(p.pid) if p.pid else None
    return started is not None and p.started_ns is not None and \
        abs(started - p.started_ns) <= CLOCK_SLACK_NS
