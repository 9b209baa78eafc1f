"""torch's own Flight Recorder dumps in a run dir, read without torch.

``RUN_DIR/flight_recorder/rank_{R}``: written by torch itself (NCCL's dump on a timeout: a
``commviz launch`` points ``TORCH_FR_DUMP_TEMP_FILE`` there) or by the rank when its workload
ends or fails (``commviz.launch.flight``), when the job turned the recorder on. The names are
torch's (``python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/flight_recorder``
reads them as they are). What the verdict takes from them: the state torch's recorder gave each
rank's collective (``scheduled``, ``started``, ``completed``), per group and sequence number.
A dump is a pickle of plain data, read as such (``commviz.record.store.loads_plain``): nothing
in it is run.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from commviz.errors import CommvizError
from commviz.record.store import loads_plain

FOLDER = "flight_recorder"
PREFIX = "rank_"                 # torch's dump names: the prefix, then the rank

States = dict[tuple[str, int], str]          # (group name, collective_seq_id) -> state


def folder(run_dir: str | Path) -> Path:
    return Path(run_dir) / FOLDER


def dump_path(run_dir: str | Path, rank: int) -> Path:
    return folder(run_dir) / f"{PREFIX}{rank}"


def states(run_dir: str | Path) -> dict[int, States]:
    """Per rank with a dump: the state of each of its collectives (p2p calls, numbered apart,
    left out). An unreadable dump is a warning naming it; the others still count."""
    out: dict[int, States] = {}
    for path in sorted(folder(run_dir).glob(f"{PREFIX}*")):
        rank = path.name.removeprefix(PREFIX)
        if not rank.isdigit():
            continue
        try:
            dump = loads_plain(path.read_bytes(), str(path))
            out[int(rank)] = {
                (str(e["process_group"][0]), int(e["collective_seq_id"])): str(e["state"])
                for e in dump["entries"] if not e.get("is_p2p")}
        except (OSError, CommvizError, KeyError, TypeError, ValueError, IndexError) as exc:
            warnings.warn(f"{path}: not a Flight Recorder dump ({exc})", stacklevel=2)
    return out
