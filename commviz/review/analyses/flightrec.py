"""torch's own Flight Recorder dumps in a run dir, read without torch.

``RUN_DIR/flight_recorder/rank_{R}``: written by torch itself (NCCL's dump on a timeout: a
``commviz launch`` points ``TORCH_FR_DUMP_TEMP_FILE`` there) or by the rank when its workload
ends or fails (``commviz.launch.flight``), when the job turned the recorder on. The names are
torch's (``python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/flight_recorder``
reads them as they are). What the verdict takes from them: the state torch's recorder gave each
rank's collective (``scheduled``, ``started``, ``completed``), per group and sequence number,
which of its NCCL collectives never completed on the GPU, and when NCCL's watchdog timed out
the first of those. A dump is a pickle of plain data, read as such
(``commviz.record.store.loads_plain``): nothing in it is run.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, NamedTuple

from commviz.errors import CommvizError
from commviz.record.store import loads_plain

FOLDER = "flight_recorder"
PREFIX = "rank_"                 # torch's dump names: the prefix, then the rank

States = dict[tuple[str, int], str]          # (group name, collective_seq_id) -> state
# the entries whose state NCCL's watchdog keeps (their profiling name's prefix) and whose
# timeout it enforces: its collectives'. gloo's recorder leaves every entry "scheduled" (torch
# 2.13), and so does NCCL's every transfer entry, completed or not (torch 2.11, 2 x H100)
WATCHED = "nccl:"


class Dump(NamedTuple):
    """What the verdict takes from one rank's dump."""

    states: States
    # its NCCL collectives whose GPU work the dump shows unfinished (enqueued, never
    # completed): an NCCL call returns once it is queued, so its record alone says "completed"
    unfinished: frozenset[tuple[str, int]]
    # when the first of its NCCL collectives that the dump shows unfinished passed its timeout
    # (its creation + timeout_ms, the rank's wall clock): NCCL's watchdog times it out then,
    # and tears the rank's communicators down
    timed_out_ns: int | None


def folder(run_dir: str | Path) -> Path:
    return Path(run_dir) / FOLDER


def dump_path(run_dir: str | Path, rank: int) -> Path:
    return folder(run_dir) / f"{PREFIX}{rank}"


def read(run_dir: str | Path) -> dict[int, Dump]:
    """Per rank with a dump: the state of each of its collectives (p2p calls, numbered apart,
    left out) and when its first unfinished NCCL collective timed out. An unreadable dump is a
    warning naming it; the others still count."""
    out: dict[int, Dump] = {}
    for path in sorted(folder(run_dir).glob(f"{PREFIX}*")):
        rank = path.name.removeprefix(PREFIX)
        if not rank.isdigit():
            continue
        try:
            entries = loads_plain(path.read_bytes(), str(path))["entries"]
            collectives = {(str(e["process_group"][0]), int(e["collective_seq_id"])): e
                           for e in entries if not e.get("is_p2p")}
            out[int(rank)] = Dump(
                {key: str(e["state"]) for key, e in collectives.items()},
                frozenset(key for key, e in collectives.items() if _watched(e)
                          and e.get("state") != "completed"), _timed_out_ns(entries))
        except (OSError, CommvizError, KeyError, TypeError, ValueError, IndexError) as exc:
            warnings.warn(f"{path}: not a Flight Recorder dump ({exc})", stacklevel=2)
    return out


def _watched(entry: dict[str, Any]) -> bool:
    """An NCCL collective's entry: its state is the GPU work's."""
    return str(entry.get("profiling_name", "")).startswith(WATCHED) and not entry.get("is_p2p")


def _timed_out_ns(entries: list[dict[str, Any]]) -> int | None:
    """The earliest timeout (creation + ``timeout_ms``) of an NCCL collective not completed."""
    ends = [int(e["time_created_ns"]) + int(e["timeout_ms"]) * 1_000_000 for e in entries
            if _watched(e) and e.get("state") != "completed" and e.get("time_created_ns")
            and e.get("timeout_ms")]
    return min(ends, default=None)
