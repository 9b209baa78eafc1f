"""Step 2 of the flow: bring what the review needs of every rank to rank 0's run dir.

``gather(run_dir)`` is collective: every rank calls it. It measures clock offsets, writes each
rank's record, and then checks whether rank 0 can already see each rank's files (a shared file
system): those ranks send nothing. The others send their files' bytes to rank 0 over a gloo side
group, so NCCL streams and CUDA graphs are never touched. Bytes travel as uint8 tensors, never as
pickled objects. Two modes (``Mode``):

- ``full``: each rank's record and traces (and ``extra_patterns``), so rank 0 can merge them all;
- ``tables``: each rank converts its own trace on its node (``commviz.convert``) and sends only
  its comm table, tens of kB whatever its trace size: what ``commviz overview`` needs. A rank
  whose record could not be written or that has no table sends what ``full`` sends instead (its
  journal among it), so nothing it recorded is lost.

Rank 0 counts the bytes it received from each rank and writes them, with who sent what, to
``RUN_DIR/gather.json`` (``SUMMARY_NAME``). A rank with nothing in the run dir at the end is
named in a warning.
"""

from __future__ import annotations

import datetime
import fnmatch
import json
import os
import uuid
import warnings
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from commviz import metadata as md
from commviz.errors import cannot_write
from commviz.gathered import GatherResult, Mode, conclude
from commviz.record import clock, journal, schema, store
from commviz.record.calls import unrecorded
from commviz.record import recorder as _rec

_side_group: Any = None
_HEADER_BYTES = 8                     # each message's int64 length, sent before its bytes


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


def _recv_bytes(src: int, group: Any, counted: dict[int, int]) -> bytes:
    """One message from ``src``; its bytes (length header included) are added to ``counted``."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    n = int(size.item())
    counted[src] = counted.get(src, 0) + _HEADER_BYTES + n
    if n == 0:
        return b""
    buf = torch.empty(n, dtype=torch.uint8)
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


def gather(run_dir: str | os.PathLike[str] | None = None, *, extra_patterns: Iterable[str] = (),
           measure_clock: bool = True, traces: bool = True,
           mode: Mode | str = Mode.FULL) -> GatherResult:
    """Collective: gather into rank 0's ``run_dir`` (default: the recorder's).

    ``mode="full"``: records and traces; ``extra_patterns`` adds per-rank files to move, e.g.
    ``"shard_rank{rank}.pftrace"``; ``traces=False`` leaves this rank's profiler traces on its
    node. ``mode="tables"``: only each rank's comm table, converted here first when it has none
    (``commviz.convert.convert_here``). The gather's own collectives are not recorded.
    """
    with unrecorded():
        return _gather(run_dir, extra_patterns, measure_clock, traces, Mode(mode))


def _outgoing(target: Path, rank: int, mode: Mode, recorded: bool,
              extra_patterns: Iterable[str], traces: bool) -> list[Path]:
    """The files this rank sends: its comm table alone for a tables gather (when its record was
    written and its table made), else its record or journal, traces and extra files."""
    if mode is Mode.TABLES:
        from commviz.convert import convert_here
        from commviz.merge.table import table_path

        table = table_path(target, rank)
        if recorded and not table.is_file():
            problem = convert_here(target, rank)
            if problem is not None:
                warnings.warn(f"commviz.gather: rank {rank} could not make its comm table "
                              f"({problem}); it sends its record and traces instead", stacklevel=4)
        if recorded and table.is_file():
            return [table]
        return rank_files(target, rank, extra_patterns, traces=True)
    return rank_files(target, rank, extra_patterns, traces)


def _gather(run_dir: str | os.PathLike[str] | None, extra_patterns: Iterable[str],
            measure_clock: bool, traces: bool, mode: Mode) -> GatherResult:
    target = Path(run_dir) if run_dir is not None else _rec.RECORDER.run_dir
    if target is None:
        raise ValueError("commviz.gather: no run dir (pass one or call commviz.start)")
    target.mkdir(parents=True, exist_ok=True)
    if not (dist.is_available() and dist.is_initialized()):
        _rec.RECORDER.flush("gathered", target)
        if mode is Mode.TABLES:
            _outgoing(target, 0, mode, True, (), traces)
        result = GatherResult(target, 1, mode, shared=[0], received={0: 0})
        return conclude(result)

    group = side_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    if measure_clock:
        _rec.RECORDER.clock = clock.measure_offsets(group)
    recorded = True
    try:
        _rec.RECORDER.flush("gathered", target)
    except OSError as exc:  # keep taking part, so the other ranks' files still reach rank 0
        recorded = False
        warnings.warn(f"commviz.gather: rank {rank} could not write its record in {target}: {exc}",
                      stacklevel=3)
    files = _outgoing(target, rank, mode, recorded, extra_patterns, traces)

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

    result = GatherResult(target, world, mode, shared=shared,
                          received={r: 0 for r in shared} if rank == 0 else {})
    if rank != 0 and rank not in shared:
        _send_bytes(json.dumps([p.name for p in files]).encode(), 0, group)
        for p in files:
            _send_bytes(p.read_bytes(), 0, group)
    elif rank == 0:
        for src in range(1, world):
            if src in shared:
                continue
            names = json.loads(_recv_bytes(src, group, result.received).decode())
            for name in names:
                data = _recv_bytes(src, group, result.received)
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
        conclude(result)
    return result
