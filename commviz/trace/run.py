"""A run dir's inputs, filed by rank: each rank's record and its profiler traces.

Works on a commviz run dir (records + ``trace_rank{R}*.json.gz``) and on a plain directory of
profiler traces (the rank from ``distributedInfo``, else the file name). Only the start of each
trace is read here (``read_header``); traces are parsed later, one rank at a time, so memory
never holds more than one rank. Every bad, missing, duplicate or contradicting file becomes one
problem naming the file, and the other ranks still load (``strict`` raises on the first one).

A run dir may hold anything else. The JSON files read as traces are those commviz was told of
(a record lists them, or they carry commviz's trace name) and those whose start is a profiler
trace (``load.looks_like_trace``: no file name decides it, ``titan_rank0.json`` included); the
files commviz wrote are known by name or by their declared schema. Any other ``.json[.gz]`` is
left out and named once (``Run.skipped``, ``skipped_note``), never a problem.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Mapping

from commviz import metadata as md
from commviz.errors import RecordError, SourceError, TraceError
from commviz.record import journal, schema
from commviz.record.store import load_record
from commviz.trace.load import (Trace, TraceHeader, far_traces, load_trace, rank_from_name,
                                read_header)

TRACE_SUFFIXES = (".json", ".json.gz")
# what commviz writes into a run dir after the job: merged traces, shards, matched runs, comm
# tables, the JSON report (its other JSON files declare a "commviz.*" schema: TraceHeader)
OWN_OUTPUT_PREFIXES = ("merged", "shard_rank", "matched_rank", "comm_rank", "report.json")
SKIPPED_SHOWN = 8                 # skipped files named in full; the rest counted


@dataclass
class RankInput:
    rank: int
    record: dict | None               # from commviz.record.store.load_record, None if no record
    record_path: Path | None
    trace_paths: list[Path]           # possibly several (profiler steps); loaded lazily
    host: str | None = None           # from the record, else the trace's host_name

    def load_traces(self, problems: list[str] | None = None) -> Iterator[Trace]:
        """Each of this rank's traces, parsed one at a time. With ``problems``, a trace that
        cannot be read is named there and skipped (the rank's others still load); without,
        its TraceError is raised."""
        for path in self.trace_paths:
            try:
                trace = load_trace(path, rank=self.rank)
            except TraceError as exc:
                if problems is None:
                    raise
                problems.append(str(exc))
                continue
            if problems is not None:
                problems.extend(trace.problems)
            yield trace


@dataclass
class Run:
    run_dir: Path
    ranks: dict[int, RankInput]
    world_size: int | None
    problems: list[str]               # one clear message per bad/missing file
    headers: dict[Path, TraceHeader] = field(default_factory=dict)
    skipped: list[Path] = field(default_factory=list)   # JSON files that are no trace: left out


class _Problems(list):
    """Problem messages; in strict mode the first one is raised instead."""

    def __init__(self, strict: bool) -> None:
        super().__init__()
        self.strict = strict

    def add(self, error: SourceError) -> None:
        if self.strict:
            raise error
        if str(error) not in self:
            self.append(str(error))


def _is_trace_name(name: str) -> bool:
    return name.endswith(TRACE_SUFFIXES) and not name.startswith(OWN_OUTPUT_PREFIXES)


def _commviz_trace_name(name: str) -> bool:
    """Whether a file carries the name commviz gives the traces it exports."""
    return fnmatch.fnmatch(name, schema.TRACE_GLOB) and schema.rank_of_trace(name) is not None


def skipped_note(skipped: list[Path]) -> str | None:
    """The one line that names what a run dir's reading left out (None: nothing)."""
    if not skipped:
        return None
    names = ", ".join(p.name for p in skipped[:SKIPPED_SHOWN])
    more = f" and {len(skipped) - SKIPPED_SHOWN} more" if len(skipped) > SKIPPED_SHOWN else ""
    return (f"skipped {len(skipped)} file(s) that are neither commviz's nor profiler traces: "
            f"{names}{more}")


def load_run(run_dir: str | os.PathLike[str], *, strict: bool = False,
             known: Mapping[Path, dict] | None = None) -> Run:
    """File a run dir's records and traces by rank; list every problem (``strict``: raise).
    ``known``: records already loaded, by path (not read again)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SourceError(str(run_dir), "not a directory")
    problems = _Problems(strict)
    files = sorted(p for p in run_dir.iterdir() if p.is_file())

    records: dict[int, tuple[Path, dict]] = {}
    record_files: set[int] = set()          # ranks with a record file, usable or not
    for path in files:
        rank = schema.rank_of_record(path.name)
        if rank is None:
            continue
        record_files.add(rank)
        try:
            record = (known or {}).get(path) or load_record(path)
        except RecordError as exc:
            problems.add(exc)
            continue
        if record["rank"] != rank:
            problems.add(RecordError(str(path), f"holds rank {record['rank']} but its name says "
                                                f"rank {rank}; record ignored"))
            continue
        records[rank] = (path, record)
    _add_journals(run_dir, records, record_files, problems)

    headers: dict[Path, TraceHeader] = {}
    claims: dict[int, list[Path]] = {}
    listed = {name for _, record in records.values() for name in record.get("traces") or []}
    skipped: list[Path] = []
    for path in files:
        if not _is_trace_name(path.name):
            continue
        header = read_header(path)
        if header.merged or header.commviz_file:
            continue                              # commviz's own output
        if not (header.is_trace or path.name in listed or _commviz_trace_name(path.name)):
            skipped.append(path)                  # the user's own JSON: not a trace
            continue
        named = rank_from_name(path)
        headers[path] = header
        if header.rank is not None and named is not None and header.rank != named:
            problems.add(TraceError(str(path), f"distributedInfo says rank {header.rank} but the "
                                               f"file name says rank {named}; file ignored"))
            continue
        rank = header.rank if header.rank is not None else named
        if rank is None:
            problems.add(TraceError(str(path), "cannot tell the rank: no distributedInfo.rank and "
                                               "no rank in the file name; file ignored"))
            continue
        claims.setdefault(rank, []).append(path)

    traces = {rank: _drop_duplicates(rank, paths, headers, records.get(rank), problems)
              for rank, paths in claims.items()}
    _drop_far(traces, headers, records, problems)

    world_size = _world_size(run_dir, records, headers, problems)
    ranks: dict[int, RankInput] = {}
    for rank in sorted(set(records) | set(traces)):
        if world_size is not None and not 0 <= rank < world_size:
            where = records[rank][0] if rank in records else traces[rank][0]
            problems.add(SourceError(str(where), f"rank {rank} is outside the world size "
                                                 f"{world_size}; ignored"))
            continue
        record_path, record = records.get(rank, (None, None))
        paths = traces.get(rank, [])
        if record is not None:
            record = _check_record(record_path, record, paths, headers, problems)
            if record is None:
                record_path = None
        host = (record or {}).get("host") or next(
            (headers[p].host for p in paths if headers[p].host), None)
        ranks[rank] = RankInput(rank=rank, record=record, record_path=record_path,
                                trace_paths=paths, host=host)
    if world_size is not None:
        for rank in range(world_size):
            if rank not in ranks and rank not in record_files:
                problems.add(SourceError(str(run_dir), f"rank {rank} is missing: no record and "
                                                       f"no trace (world size {world_size})"))
    if records:
        for rank, inp in ranks.items():
            if rank not in record_files and inp.trace_paths:
                problems.add(RecordError(str(run_dir / schema.record_name(rank)),
                                         "missing: this rank's trace is merged without commviz's "
                                         "metadata"))
    return Run(run_dir=run_dir, ranks=ranks, world_size=world_size, problems=list(problems),
               headers=headers, skipped=skipped)


def _add_journals(run_dir: Path, records: dict[int, tuple[Path, dict]], record_files: set[int],
                  problems: _Problems) -> None:
    """Ranks that never wrote their final record (killed) get it rebuilt from their journal."""
    for rank in journal.journal_ranks(run_dir):
        base = records.get(rank, (None, None))[1]
        if base is not None and base.get("exit") != "running":
            continue
        try:
            got = journal.recover(run_dir, rank, base)
        except RecordError as exc:
            problems.add(exc)
            continue
        if got is None:
            continue
        record, added = got
        where = journal.journal_paths(run_dir, rank)[-1]
        records[rank] = (run_dir / schema.record_name(rank), record)
        record_files.add(rank)
        problems.add(RecordError(str(where), f"rank {rank} did not write its final record (killed?); "
                                             f"{added} collectives rebuilt from its journal"))


def _drop_duplicates(rank: int, paths: list[Path], headers: dict[Path, TraceHeader],
                     record: tuple[Path, dict] | None, problems: _Problems) -> list[Path]:
    """Several files of one rank are profiler steps only if one process wrote them all.

    Two files that are the same trace (``x.json`` and ``x.json.gz``, or a copy: same trace_id)
    or that come from different processes (host, pid) both claim the rank: keep the one the
    record lists (else the one named after the rank, else the first) and name both in a problem.
    """
    listed = set(record[1].get("traces") or []) if record else set()
    order = sorted(paths, key=lambda p: (p.name not in listed, rank_from_name(p) is None, p.name))
    kept: list[Path] = []
    for path in order:
        clash = next((k for k in kept if _clash_kind(k, path, headers)), None)
        if clash is None:
            kept.append(path)
            continue
        problems.add(TraceError(str(path), f"claims rank {rank}, as does {clash} "
                                           f"({_clash_kind(clash, path, headers)}); using "
                                           f"{clash.name}, ignoring this file"))
    return sorted(kept, key=lambda p: p.name)


def _drop_far(traces: dict[int, list[Path]], headers: dict[Path, TraceHeader],
              records: dict[int, tuple[Path, dict]], problems: _Problems) -> None:
    """Traces hours or days away from the rest of the job (a wrong clock, a shifted
    ``baseTimeNanoseconds``), though plausible on their own: named and left out."""
    starts = {p: (rank, headers[p].start_ns) for rank, paths in traces.items() for p in paths
              if headers[p].start_ns is not None}
    spans: dict[int, tuple[int, int]] = {}
    for rank, (_, record) in records.items():
        times = [c[md.T_BEGIN] for c in record.get("collectives") or ()
                 if isinstance(c, dict) and isinstance(c.get(md.T_BEGIN), int) and c[md.T_BEGIN] > 0]
        if times:
            spans[rank] = (min(times), max(times))
    for path, rank, why in far_traces(starts, spans):
        problems.add(TraceError(str(path), f"rank {rank}: {why}: its times are not believed; "
                                           "trace left out"))
        traces[rank].remove(path)


def _stem(path: Path) -> str:
    return path.name.removesuffix(".gz").removesuffix(".json")


def _clash_kind(a: Path, b: Path, headers: dict[Path, TraceHeader]) -> str | None:
    """Why ``a`` and ``b`` cannot both be steps of one rank, or None when they can."""
    ha, hb = headers[a], headers[b]
    if _stem(a) == _stem(b) or (ha.identity is not None and ha.identity == hb.identity):
        return "copy of the same trace"
    if ha.pid is not None and hb.pid is not None and (ha.pid, ha.host) != (hb.pid, hb.host):
        return f"trace from another process: pid {hb.pid} on {hb.host}, not {ha.pid} on {ha.host}"
    return None


def _world_size(run_dir: Path, records: dict[int, tuple[Path, dict]],
                headers: dict[Path, TraceHeader], problems: _Problems) -> int | None:
    sizes: dict[int, Path] = {}
    for path, record in records.values():
        sizes.setdefault(int(record["world_size"]), path)
    if not sizes:
        for path, header in headers.items():
            if header.world_size is not None:
                sizes.setdefault(header.world_size, path)
    if len(sizes) > 1:
        listing = ", ".join(f"{size} ({path.name})" for size, path in sorted(sizes.items()))
        problems.add(SourceError(str(run_dir), f"files disagree on the world size: {listing}; "
                                               f"using the largest"))
    return max(sizes) if sizes else None


def _check_record(path: Path, record: dict, traces: list[Path],
                  headers: dict[Path, TraceHeader], problems: _Problems) -> dict | None:
    """The record, or None when it contradicts its rank's trace (the trace is kept)."""
    run_dir = path.parent
    shard_only = (run_dir / schema.shard_name(int(record["rank"]))).exists()
    for name in record.get("traces") or []:
        if not (run_dir / name).exists() and not shard_only:  # a shard stands in for its traces
            problems.add(RecordError(str(path), f"lists trace {name}, which is not in the run dir"))
    mine = {str(g.get("name")): g for g in record["process_groups"] if isinstance(g, dict)}
    for trace in traces:
        info = headers[trace].distributed_info or {}
        size = info.get("world_size")
        if size is not None and int(size) != record["world_size"]:
            problems.add(RecordError(str(path), f"says world size {record['world_size']}, its "
                                                f"trace {trace.name} says {size}; record ignored"))
            return None
        for pg in info.get("pg_config") or []:
            if not isinstance(pg, dict):
                continue
            ours = mine.get(str(pg.get("pg_name")))
            if ours is None or pg.get("ranks") is None:
                continue
            if list(ours.get("ranks") or []) != list(pg["ranks"]):
                problems.add(RecordError(
                    str(path), f"process group {pg.get('pg_name')!r} has ranks "
                               f"{ours.get('ranks')} but trace {trace.name} says {pg['ranks']}: "
                               f"record and trace come from different runs; record ignored"))
                return None
    return record



def load_rank(run_dir: str | os.PathLike[str], rank: int) -> tuple[RankInput, list[str]]:
    """One rank's inputs only, without looking at the other ranks' files (what a rank needs
    to convert its own trace at the end of a job, when thousands of ranks share the dir).

    Its traces are those its record lists, else the files named ``trace_rank{R}*.json[.gz]``.
    """
    run_dir = Path(run_dir)
    problems: list[str] = []
    record_path = run_dir / schema.record_name(rank)
    record = None
    if record_path.exists():
        try:
            record = load_record(record_path)
        except RecordError as exc:
            problems.append(str(exc))
    listed = [run_dir / name for name in (record or {}).get("traces") or []
              if (run_dir / name).exists()]
    traces = listed or sorted(p for p in run_dir.glob(schema.TRACE_GLOB)
                              if schema.rank_of_trace(p.name) == rank)
    if record is None and not traces:
        raise SourceError(str(run_dir), f"no record and no trace of rank {rank}")
    host = (record or {}).get("host") or next(
        (h.host for h in map(read_header, traces) if h.host), None)
    return RankInput(rank=rank, record=record, record_path=record_path if record else None,
                     trace_paths=traces, host=host), problems
