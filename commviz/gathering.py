"""Step 2 of the flow: bring every rank's record and traces to rank 0's run dir.

``gather(run_dir)`` is collective: every rank calls it. It measures clock offsets, writes each
rank's record, and then checks whether rank 0 can already see each rank's files (a shared file
system): those ranks send nothing. The others send their files' bytes to rank 0 over a gloo side
group, so NCCL streams and CUDA graphs are never touched. Bytes travel as uint8 tensors, never as
pickled objects. A rank whose record is missing at the end is named in a warning.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import os
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from commviz import metadata as md
from commviz.errors import cannot_write
from commviz.record.calls import unrecorded
from commviz.record import clock, journal, schema, store
from commviz.record import recorder as _rec

_side_group: Any = None


@dataclass
class GatherResult:
    """What rank 0 holds after a gather (other ranks get an empty result)."""

    run_dir: Path
    world_size: int
    shared: list[int] = field(default_factory=list)      # ranks whose files were already visible
    sent: dict[int, list[str]] = field(default_factory=dict)  # rank -> files it sent over gloo
    missing: list[int] = field(default_factory=list)     # ranks with no record in the run dir


def side_group(timeout_s: float = 600.0) -> Any:
    """A gloo group over the whole world, made once (collective on first use)."""
    global _side_group
    if _side_group is None:
        _side_group = dist.new_group(backend="gloo",
                                     timeout=datetime.timedelta(seconds=timeout_s),
                                     group_desc=md.SIDE_GROUP_DESC)
    return _side_group


def _send_bytes(data: bytes, dst: int, group: Any) -> None:
    dist.send(torch.tensor([len(data)], dtype=torch.int64), dst, group=group)
    if data:
        dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), dst, group=group)


def _recv_bytes(src: int, group: Any) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    if int(size.item()) == 0:
        return b""
    buf = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.recv(buf, src, group=group)
    return buf.numpy().tobytes()


def rank_files(run_dir: Path, rank: int, patterns: Iterable[str] = (), traces: bool = True
               ) -> list[Path]:
    """This rank's files in the run dir: its record, its journal (left only when the record
    could not be written: rank 0 rebuilds the record from it), its traces (unless ``traces``
    is False), and any extra ``patterns``."""
    names = [schema.record_name(rank)]
    for path in journal.journal_paths(run_dir, rank) if run_dir.is_dir() else ():
        names += [path.name, journal.calls_path(path).name]
    found = []
    for p in sorted(run_dir.iterdir()) if run_dir.is_dir() else []:
        if not p.is_file():
            continue
        if p.name in names or (traces and schema.rank_of_trace(p.name) == rank) or any(
                fnmatch.fnmatch(p.name, pat.format(rank=rank)) for pat in patterns):
            found.append(p)
    return found


def missing_ranks(run_dir: Path, world_size: int) -> list[int]:
    return [r for r in range(world_size) if not (run_dir / schema.record_name(r)).is_file()]


def gather(run_dir: str | os.PathLike[str] | None = None, *, extra_patterns: Iterable[str] = (),
           measure_clock: bool = True, traces: bool = True) -> GatherResult:
    """Collective: gather records and traces into rank 0's ``run_dir`` (default: the recorder's).

    ``extra_patterns`` adds per-rank files to move, e.g. ``"shard_rank{rank}.pftrace"``.
    ``traces=False`` leaves this rank's profiler traces on its node (a rank that made its own
    Perfetto shard sends only that: big jobs must not funnel every trace through rank 0).
    The gather's own collectives are not recorded.
    """
    with unrecorded():
        return _gather(run_dir, extra_patterns, measure_clock, traces)


def _gather(run_dir: str | os.PathLike[str] | None, extra_patterns: Iterable[str],
            measure_clock: bool, traces: bool) -> GatherResult:
    target = Path(run_dir) if run_dir is not None else _rec.RECORDER.run_dir
    if target is None:
        raise ValueError("commviz.gather: no run dir (pass one or call commviz.start)")
    target.mkdir(parents=True, exist_ok=True)
    if not (dist.is_available() and dist.is_initialized()):
        _rec.RECORDER.flush("gathered", target)
        return GatherResult(target, 1, shared=[0], missing=missing_ranks(target, 1))

    group = side_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if measure_clock:
        _rec.RECORDER.clock = clock.measure_offsets(group)
    try:
        _rec.RECORDER.flush("gathered", target)
    except OSError as exc:  # keep taking part, so the other ranks' files still reach rank 0
        warnings.warn(f"commviz.gather: rank {rank} could not write its record in {target}: {exc}",
                      stacklevel=2)

    token = torch.tensor([uuid.uuid4().int >> 65 if rank == 0 else 0], dtype=torch.int64)
    dist.broadcast(token, 0, group=group)
    marker = target / f".commviz-gather-{int(token.item()):x}"
    if rank == 0:
        try:
            marker.write_text("commviz gather marker\n")
        except OSError as exc:   # a full or read-only dir: every rank sends; each file is tried
            warnings.warn(f"commviz.gather: {cannot_write(exc, marker)}", stacklevel=3)
    dist.barrier(group=group)
    sees_rank0 = torch.tensor([1 if marker.exists() else 0], dtype=torch.int64)
    flags = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(flags, sees_rank0, group=group)
    shared = [r for r in range(world) if int(flags[r].item())]

    result = GatherResult(target, world, shared=shared)
    if rank != 0 and rank not in shared:
        files = rank_files(target, rank, extra_patterns, traces)
        _send_bytes(json.dumps([p.name for p in files]).encode(), 0, group)
        for p in files:
            _send_bytes(p.read_bytes(), 0, group)
    elif rank == 0:
        for src in range(1, world):
            if src in shared:
                continue
            names = json.loads(_recv_bytes(src, group).decode())
            for name in names:
                data = _recv_bytes(src, group)
                if os.path.basename(name) != name or not name:
                    warnings.warn(f"commviz.gather: rank {src} sent a bad file name {name!r}; skipped")
                    continue
                try:
                    store.write_atomic(target / name, data)
                except OSError as exc:      # keep receiving: the other files may still fit
                    warnings.warn(f"commviz.gather: rank {src}'s "
                                  f"{cannot_write(exc, target / name)}", stacklevel=3)
            result.sent[src] = names
    dist.barrier(group=group)
    if rank == 0:
        marker.unlink(missing_ok=True)
        result.missing = missing_ranks(target, world)
        if result.missing:
            warnings.warn(f"commviz.gather: no record from rank(s) {result.missing} in {target}; "
                          "the other ranks' records are kept", stacklevel=2)
    return result
