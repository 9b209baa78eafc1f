"""``merge_run`` and ``write_shard``: every rank's trace and record into one multi-rank trace.

Ranks are converted in parallel worker processes, each writing its piece to a file; the merged
trace is the cross-rank piece followed by the rank pieces, concatenated (a Perfetto trace is a
stream of packets, and pieces never share sequence ids, track uuids, pids or flow ids). Memory
therefore grows with the largest rank, not with the number of ranks. A rank that converted its
own trace at the end of the job (``write_shard``, on its own node) is not converted again when
its shard matches its inputs.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import tempfile
import time
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from commviz.errors import WRITE_ERRNOS, CommvizError, SourceError, cannot_write
from commviz.match import artifact
from commviz.match import merged_clock as clk
from commviz.match.artifact import PgInfo
from commviz.match.matched import fingerprints
from commviz.merge.cross import copy_piece, lone_flows, write_cross
from commviz.match.model import CommEvent
from commviz.merge.piece import (Matched, RankJob, RankResult, build_artifact, convert_rank,
                                 hold_last_rank, load_traces, no_gc, read_early, result_of)
from commviz.merge.keep import Keep, run_start_ns
from commviz.merge.select import detail_name, load_selected
from commviz.merge.shard import fingerprint, shard_path
from commviz.merge.stops import stops
from commviz.trace.run import RankInput, Run, load_rank, load_run
from commviz.write.chrome import join as join_json, write_rank_trace

FORMATS = ("pftrace", "json")
PROGRESS_MIN_RANKS = 4
PROGRESS_MIN_BYTES = 64 << 20


@dataclass
class MergeResult:
    out: Path | None
    problems: list[str]
    stats: dict[str, Any] = field(default_factory=dict)   # totals, per rank and per lane
    skipped: list[Path] = field(default_factory=list)     # run dir files that are no trace


MERGED_NAME = "merged.pftrace"          # a run's merged trace, where the review looks for it


def _default_out(run_dir: Path, fmt: str, per_rank: bool = False) -> Path:
    if per_rank:
        return run_dir / "merged_ranks"
    return run_dir / (MERGED_NAME if fmt == "pftrace" else "merged.json")


def _job(run: Run, rank: int, inp: RankInput, plan: clk.ClockPlan, tmp: Path, fmt: str,
         json_base_ns: int = 0, matched_dir: Path | None = None, keep: Keep | None = None,
         early: bool = False, keep_matched: bool = True) -> RankJob:
    """``matched_dir``: where the rank's matched run is read and saved (default: the run
    dir); ``keep_matched`` False: neither."""
    clock = plan.clock(rank)
    shard = shard_path(run.run_dir, rank)
    inputs, record_inputs = fingerprints(inp)
    return RankJob(rank=rank, out=tmp / f"rank{rank}.{'pftrace' if fmt == 'pftrace' else 'json'}",
                   record=inp.record, trace_paths=list(inp.trace_paths),
                   matched=artifact.matched_path(matched_dir or run.run_dir, rank)
                   if keep_matched else None,
                   inputs=inputs, record_inputs=record_inputs, clock=clock, host=inp.host,
                   fmt=fmt, fingerprint=fingerprint(inputs, clock.offset_ns)
                   if fmt == "pftrace" else None, json_base_ns=json_base_ns,
                   shard=shard if fmt == "pftrace" and shard.exists() and keep is None else None,
                   keep=keep, early=tmp / f"matched{rank}.early" if early else None)


def _fresh(job: RankJob, problems: list[str]) -> artifact.RankArtifact | None:
    """The rank's saved matched run on this job's clock, when built from the same inputs."""
    if job.matched is None:
        return None
    art = artifact.load_fresh(job.matched, job.inputs, job.record_inputs,
                              bool(job.trace_paths), problems)
    return art.aligned(job.clock) if art is not None else None


def _run_job(job: RankJob) -> RankResult:
    """A worker's task: the rank's piece, from its shard when that is still valid.

    A shard is valid when the rank's fresh matched run names it and it was made on this clock
    (the matched run is fresh for the same inputs or, when this rank's traces are not in the
    run dir, ``gather(..., traces=False)``, for the same record).
    """
    try:
        problems: list[str] = []
        art = _fresh(job, problems)
        if (art is not None and job.shard is not None and art.shard is not None
                and art.shard == fingerprint(art.inputs, job.offset_ns)):
            result = result_of(job, art, job.shard)
            result.stats["reused_shard"] = job.shard.name
            return result
        result = convert_rank(job, art)
        result.problems[:0] = [p for p in problems if p not in result.problems]
        return result
    except CommvizError as exc:
        return RankResult(rank=job.rank, out=None, problems=[str(exc)])
    except Exception as exc:  # a malformed trace must not stop the other ranks
        where = ", ".join(str(p) for p in job.trace_paths) or f"rank {job.rank}"
        return RankResult(rank=job.rank, out=None, problems=[
            f"{where}: conversion failed ({type(exc).__name__}: {exc}); rank left out"])


def _match_only(job: RankJob) -> RankResult:
    """A rank whose clock is still to be derived: matched (on its own clock) and saved, so the
    conversion after the derivation reads it instead of matching again."""
    problems: list[str] = []
    art = _fresh(job, problems)
    if art is None:
        with no_gc():
            art = build_artifact(job, load_traces(job, problems), problems)
    result = result_of(job, art, None)
    result.problems[:0] = [p for p in problems if p not in result.problems]
    return result


class _Pool:
    """Runs per-rank tasks in worker processes (inline for one worker), with a progress bar.
    A map returns once its results are in, while its workers end; leaving the pool's ``with``
    waits for them (their CPU time is then the merge's own, as a parent's rusage counts it)."""

    def __init__(self, workers: int | None, tasks: int, progress: bool) -> None:
        self.workers = max(1, min(workers or os.cpu_count() or 1, tasks))
        self.progress = progress
        self._ending: set[Any] = set()      # workers of maps that returned: still ending

    def __enter__(self) -> _Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        for worker in self._ending:
            worker.join()

    def map(self, fn: Callable[[RankJob], Any], jobs: list[RankJob], label: str,
            early: Callable[[list[Matched]], None] | None = None) -> list[Any]:
        """``fn`` over ``jobs``; ``early`` gets every job's ``Matched`` (``RankJob.early``), in
        job order, as soon as the workers sent them all, while they go on (never when some job
        sent none)."""
        bar = progress_bar(label, len(jobs)) if self.progress else None
        try:
            if self.workers == 1:
                out = []
                for job in jobs:
                    out.append(fn(job))
                    if bar:
                        bar.advance()
                return out
            ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
            others = set(mp.active_children())
            pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=hold_last_rank)
            try:
                futures: list[Future] = [pool.submit(fn, job) for job in jobs]
                if bar:
                    for fut in futures:
                        fut.add_done_callback(lambda _: bar.advance())
                if early is not None:
                    sent = _sent_early(jobs, futures)
                    if sent is not None:
                        early(sent)
                return [fut.result() for fut in futures]
            finally:        # the workers end on their own: their results are all in
                self._ending |= set(mp.active_children()) - others
                pool.shutdown(wait=False, cancel_futures=True)
        finally:
            if bar:
                bar.close()


def _sent_early(jobs: list[RankJob], futures: list[Future]) -> list[Matched] | None:
    """Every job's ``Matched``, in job order, read as each appears; None once every job is done
    without all of them (a rank that failed first, a shard reused) or when a job has no
    ``early`` path. A job leaves its file before its future completes, so none is missed; a
    worker that dies leaves none, and nothing waits on it. One listing of the scratch dir a
    poll, however many ranks."""
    waiting = {job.early: i for i, job in enumerate(jobs) if job.early is not None}
    if len(waiting) < len(jobs):
        return None
    folders = {path.parent for path in waiting}
    sent: dict[int, Matched] = {}
    pending = set(futures)
    while True:
        there = {name for folder in folders for name in os.listdir(folder)}
        for path in [p for p in waiting if p.name in there]:
            sent[waiting.pop(path)] = read_early(path)
        if not waiting:
            return [sent[i] for i in range(len(jobs))]
        if not pending:
            return None
        _, pending = wait(pending, timeout=0.01, return_when=FIRST_COMPLETED)


class _Bar:
    def __init__(self, progress: Any, task: Any) -> None:
        self._progress, self._task = progress, task

    def advance(self) -> None:
        self._progress.advance(self._task)

    def close(self) -> None:
        self._progress.stop()


def progress_bar(label: str, total: int) -> _Bar | None:
    if not sys.stderr.isatty():
        return None
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    progress = Progress("[progress.description]{task.description}", BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    progress.start()
    return _Bar(progress, progress.add_task(label, total=total))


def _input_bytes(run: Run) -> int:
    return sum(p.stat().st_size for inp in run.ranks.values() for p in inp.trace_paths
               if p.exists())


def merge_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
              fmt: str = "pftrace", strict: bool = False, workers: int | None = None,
              progress: bool = True, per_rank: bool = False,
              ranks: list[int] | None = None, keep: Keep | None = None,
              run: Run | None = None) -> MergeResult:
    """Merge a run dir (or a plain directory of profiler traces) into one trace.

    Every bad input is one problem naming its file, and the other ranks are still merged;
    ``strict`` raises on the first problem instead, and then nothing is written.
    ``per_rank`` (JSON only): ``out`` is a directory that gets one ``trace_rank{R}.json`` per
    rank, all on the merged clock (HTA reads one file per rank). ``ranks``: merge only these
    (``merge.select``; default output ``RUN_DIR/merged_ranks0-7,512.pftrace``). ``keep``: only
    the events of some profiler steps or of a time window (``merge.keep``; pftrace only, each
    rank converted from its traces, never from its shard). An output that
    cannot be written (full or read-only disk) is one ``WriteError`` naming the path and the
    errno. ``run``: the run dir already loaded (``trace.run.load_run``: a launch loads it once
    for the merge, the report and its summary).
    """
    try:
        with no_gc():       # the ranks' events come back as many small objects, none cyclic
            return _merge_run(run_dir, out, fmt=fmt, strict=strict, workers=workers,
                              progress=progress, per_rank=per_rank, ranks=ranks, keep=keep,
                              run=run)
    except OSError as exc:
        if exc.errno not in WRITE_ERRNOS:
            raise
        raise cannot_write(exc, out if out is not None else run_dir) from None


def _merge_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None, *,
               fmt: str, strict: bool, workers: int | None, progress: bool,
               per_rank: bool, ranks: list[int] | None, keep: Keep | None,
               run: Run | None) -> MergeResult:
    started = time.perf_counter()
    if fmt not in FORMATS:
        raise CommvizError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    if per_rank and fmt != "json":
        raise CommvizError("per-rank output is JSON only: add --format json")
    if keep is not None and fmt != "pftrace":
        raise CommvizError("--steps and --window write a .pftrace only: leave out --format json")
    if ranks is not None:
        run = load_selected(run_dir, ranks)
    elif run is None or strict:
        run = load_run(run_dir, strict=strict)
    if not run.ranks:
        raise SourceError(str(run.run_dir), "no profiler traces and no commviz records found")
    if keep is not None and keep.window_ms is not None:
        keep = replace(keep, start_ns=run_start_ns(run.run_dir))
    target = Path(out) if out is not None else (
        _default_out(run.run_dir, fmt, per_rank) if (ranks is None and keep is None)
        or fmt != "pftrace" else run.run_dir / detail_name(ranks, keep.label if keep else None))
    (target if per_rank else target.parent).mkdir(parents=True, exist_ok=True)
    problems = list(run.problems)
    show = progress and (len(run.ranks) >= PROGRESS_MIN_RANKS
                         or _input_bytes(run) >= PROGRESS_MIN_BYTES)
    plan = clk.plan_clock(run)
    with (tempfile.TemporaryDirectory(prefix=".commviz-merge-", dir=target.parent) as tmp_name,
          _Pool(workers, len(run.ranks), show) as pool):    # workers gone before their dir
        tmp = Path(tmp_name)
        # matched runs go beside the records when the merge writes into the run dir; a merge
        # written elsewhere (a read-only or shared input dir) keeps them in its scratch dir
        inside = target.resolve().is_relative_to(run.run_dir.resolve())
        matched_dir = run.run_dir if inside and os.access(run.run_dir, os.W_OK) else tmp
        derived = bool(plan.pending)
        if derived:
            jobs = [_job(run, r, run.ranks[r], plan, tmp, fmt, matched_dir=matched_dir)
                    for r in sorted(run.ranks)]
            ends = {res.rank: {ev.key: ev.end_ns for ev in res.events if ev.key is not None}
                    for res in pool.map(_match_only, jobs, "matching")}
            problems.extend(clk.derive(plan, ends))
        base = _json_base(run, plan) if fmt == "json" else 0
        early = fmt == "pftrace" and not per_rank and pool.workers > 1
        # in the scratch dir, a matched run is read only by the conversion after a derived
        # clock's matching pass: otherwise it is deleted unread, so it is not written
        kept = matched_dir != tmp or derived
        jobs = [_job(run, r, run.ranks[r], plan, tmp, fmt, base, matched_dir, keep, early,
                     keep_matched=kept) for r in sorted(run.ranks)]
        cross = _CrossPiece(tmp / "cross.pftrace", run.run_dir)
        results = pool.map(_run_job, jobs, f"merging {len(jobs)} ranks",
                           early=cross.write if early else None)
        cross.give_back(results, jobs)
        converted = time.perf_counter()
        for res in results:
            problems.extend(p for p in res.problems if p not in problems)
        if strict and problems:
            raise SourceError(str(run.run_dir), "; ".join(problems))
        stats = _stats(run, plan, results)
        if per_rank:
            _write_ranks(target, run, results, base, plan)
            stats["bytes"] = sum(p.stat().st_size for p in target.glob("trace_rank*.json"))
            stats["seconds"] = round(time.perf_counter() - started, 3)
            return MergeResult(out=target, problems=problems, stats=stats, skipped=run.skipped)
        partial = target.with_name(f".{target.name}.partial")
        try:
            with open(partial, "wb") as f:
                if fmt == "pftrace":
                    stats.update(cross.written(results))
                    copy_piece(cross.path, f, set())
                    stats["lone_flow_ends_dropped"] = sum(
                        copy_piece(res.out, f, cross.lone.get(res.rank, set()))
                        for res in results if res.out is not None)
                else:
                    join_json(f, [res.out for res in results if res.out is not None],
                              base_ns=base, meta={"commviz": {"ranks": sorted(run.ranks),
                                                              "clock": plan.describe()}})
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
    stats["phases"] = {"ranks": round(converted - started, 3),     # converting, in the pool
                       "cross": round(time.perf_counter() - converted, 3)}  # cross piece, copy
    stats["bytes"] = target.stat().st_size
    stats["seconds"] = round(time.perf_counter() - started, 3)
    return MergeResult(out=target, problems=problems, stats=stats, skipped=run.skipped)


def _write_ranks(out_dir: Path, run: Run, results: list[RankResult], base_ns: int,
                 plan: clk.ClockPlan) -> None:
    """Each rank's fragment as ``out_dir/trace_rank{R}.json``, written whole or not at all."""
    for res in results:
        if res.out is None:
            continue
        paths = run.ranks[res.rank].trace_paths
        header = run.headers.get(paths[0]) if paths else None
        target = out_dir / f"trace_rank{res.rank}.json"
        partial = target.with_name(f".{target.name}.partial")
        try:
            with open(partial, "wb") as f:
                write_rank_trace(f, res.out, rank=res.rank, base_ns=base_ns,
                                 distributed_info=header.distributed_info if header else None,
                                 meta={"commviz": {"rank": res.rank, "clock": plan.describe()}})
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)


class _CrossPiece:
    """The cross-rank piece and each rank's lone flow ids, from the ranks' matched
    collectives: while the ranks' pieces are still being written when every rank sent its
    ``Matched`` early (``write``, in the pool's wait), else once they are all back
    (``written``)."""

    def __init__(self, path: Path, run_dir: Path) -> None:
        self.path, self.run_dir = path, run_dir
        self.sent: dict[int, Matched] = {}
        self.stats: dict[str, int] | None = None
        self.lone: dict[int, set[int]] = {}     # rank -> its lone flow ids (``lone_flows``)

    def write(self, sent: list[Matched]) -> None:
        self.sent = {m.rank: m for m in sent}
        self._write([ev for m in sent for ev in m.events], [m.pgs for m in sent])

    def give_back(self, results: list[RankResult], jobs: list[RankJob]) -> None:
        """Each result given back the events it sent: read here where the pool read none,
        because some rank sent nothing (its shard reused, or it failed first)."""
        paths = {job.rank: job.early for job in jobs}
        for res in results:
            if res.sent_early:
                sent = self.sent.get(res.rank)
                res.events = (sent if sent is not None else read_early(paths[res.rank])).events

    def written(self, results: list[RankResult]) -> dict[str, int]:
        """The piece's counts (``cross_piece_early``: 1 when it was written early). Written
        again now unless every rank gave back what it sent (one that failed after sending
        gives back no events)."""
        early = self.stats is not None and all(res.sent_early for res in results)
        if not early:
            self._write([ev for res in results for ev in res.events], [res.pgs for res in results])
        assert self.stats is not None
        return {**self.stats, "cross_piece_early": int(early)}

    def _write(self, events: list[CommEvent], pgs: list[dict[str, PgInfo]]) -> None:
        self.stats = write_cross(self.path, events, _pg_table(pgs), stops(events, self.run_dir))
        self.lone = lone_flows(events)      # instances on one rank: no cross-rank flow


def _pg_table(ranks_pgs: list[dict[str, PgInfo]]) -> dict[str, PgInfo]:
    """pg name -> desc and ranks, from the ranks' matched runs (the first rank that knows)."""
    pgs: dict[str, PgInfo] = {}
    for rank_pgs in ranks_pgs:
        for pg, info in rank_pgs.items():
            pgs.setdefault(pg, info)
    return pgs


def _json_base(run: Run, plan: clk.ClockPlan) -> int:
    """The wall time the merged JSON's ``ts`` count from: the earliest trace base (0 when a
    trace has absolute times)."""
    bases = []
    for rank, inp in run.ranks.items():
        for path in inp.trace_paths:
            header = run.headers.get(path)
            if header is None or header.base_ns is None:
                return 0
            bases.append(header.base_ns + plan.offsets.get(rank, 0))
    return min(bases) if bases else 0


def _stats(run: Run, plan: clk.ClockPlan, results: list[RankResult]) -> dict[str, Any]:
    per_rank = {res.rank: res.stats for res in results}
    lanes: dict[str, int] = {}
    for res in results:
        for pg, n in (res.stats.get("lanes") or {}).items():
            lanes[pg] = lanes.get(pg, 0) + n
    return {
        "ranks": len(results), "world_size": run.world_size,
        "merged_ranks": sum(res.out is not None for res in results),
        "reused_shards": sum("reused_shard" in res.stats for res in results),
        "profiler_events": sum(res.stats.get("profiler_events", 0) for res in results),
        "comm_events": sum(res.stats.get("comm_events", 0) for res in results),
        "slices": sum(res.stats.get("slices", 0) for res in results),
        "lanes": lanes, "clock": plan.describe(),
        "clock_sources": dict(plan.sources), "per_rank": per_rank,
    }


def write_shard(run_dir: str | os.PathLike[str], rank: int,
                out: str | os.PathLike[str] | None = None) -> Path:
    """Convert one rank's trace into ``RUN_DIR/shard_rank{R}.pftrace`` (on the rank's own node).

    The rank's matched run is saved beside it (``RUN_DIR/matched_rank{R}.json``, gathered with
    the shard). The clock offset is the one in the rank's record (measured by
    ``commviz.gather``: call it first). Problems are warned about; the shard holds whatever
    could be read.
    """
    inp, problems = load_rank(run_dir, rank)
    plan = clk.ClockPlan()
    clock = (inp.record or {}).get("clock") or {}
    plan.offsets[rank] = int(clock.get("offset_ns") or 0)
    plan.sources[rank] = str(clock.get("offset_source") or clk.NONE)
    run = Run(run_dir=Path(run_dir), ranks={rank: inp}, world_size=None, problems=problems)
    target = Path(out) if out is not None else shard_path(run.run_dir, rank)
    with tempfile.TemporaryDirectory(prefix=".commviz-shard-", dir=target.parent) as tmp:
        job = _job(run, rank, inp, plan, Path(tmp), "pftrace")
        result = convert_rank(job)
        os.replace(job.out, target)
    if problems or result.problems:
        warnings.warn(f"commviz shard of rank {rank}: " + "; ".join(problems + result.problems),
                      stacklevel=2)
    return target
