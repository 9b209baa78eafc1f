"""``commviz launch [CONFIG.yaml] [--set key.path=value ...] [--dry-run] [--node-rank N]``.

Loads and checks the config (one clear error before any process starts), writes the resolved
config to ``RUN_DIR/config.yaml``, runs this node's torchrun, then on the node that holds
rank 0's files merges the run (``commviz.merge.merge_run``) and writes the report
(``review.render.report_formats.write_report``), and prints a short summary. In a multi-node job torch
decides which node holds rank 0; each launch learns it from its own workers
(``commviz.launch.placement``), shows the rendezvous while it waits
(``commviz.launch.rendezvous``) and under srun takes the job's shape from Slurm
(``commviz.launch.slurm``); the nodes without rank 0 say where the run is and merge nothing. After a tables-only
gather (``output.gather``) it writes the overview (``commviz.review.overview``) instead of the
merge, and the report only where every rank's matched run is visible (a shared run dir). A failed rank makes the
launch exit 1 naming the rank and why, after merging what the other ranks recorded.
While torchrun runs, the launch watches for a hang (``commviz.launch.hang_watch``) and answers
``commviz status`` run on another node with its own ranks' stacks (``commviz.launch.answer``).
With ``live.exporter`` set it serves the job's metrics to Prometheus meanwhile, from a process of
its own (``commviz.launch.exporting``); with ``live.watch`` it says each window of ``commviz
watch`` (``commviz.live.watch``) and keeps the windows in the run dir for the report.

Without CONFIG the embedded default runs: ``commviz/launch/default.yaml``, shipped inside the package
(``configs/default.yaml`` is the same text for people browsing the repo; a test keeps the two
identical). It is package data rather than a path into the repo so a plain, non-editable
install still has it.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import uuid
from pathlib import Path
from typing import TextIO

from commviz.errors import CommvizError, ConfigError, cannot_write
from commviz.gathered import SUMMARY_NAME, Mode, load_summary
from commviz.launch import config as C
from commviz.launch import exporting, groups, outcome, placement, rendezvous, slurm, torchrun
from commviz.launch.answer import StackAnswers
from commviz.live.watch import WatchThread
from commviz.launch.echo import Echo
from commviz.launch.hang_watch import DEFAULT_AFTER_S, HangWatch
from commviz.launch.config_schema import Config
from commviz.record import journal, schema
from commviz.record.schema import RECORD_GLOB
from commviz.record.store import write_atomic
from commviz.review.analyses.exits import log_dir
from commviz.review.render.verdict_text import verdict_text
from commviz.trace.run import Run, load_run, skipped_note

CONFIG_NAME = "config.yaml"


def log_name(cfg: Config, node_rank: int) -> str:
    """``launch.log``; one per node in a multi-node job (their run dirs may be one shared dir)."""
    return "launch.log" if cfg.job.nnodes == 1 else f"launch_node{node_rank}.log"


def register(p: argparse.ArgumentParser) -> None:
    p.description = ("Run an experiment described by a YAML config through torchrun, record it "
                     "with commviz, gather, merge and report. Without CONFIG: the embedded "
                     "default (CPU, gloo, 2 ranks).")
    p.add_argument("config", nargs="?", metavar="CONFIG.yaml", help="the experiment config")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="KEY.PATH=VALUE",
                   help="override a key, value read as YAML (e.g. --set job.nproc_per_node=4 "
                        "--set workload.collectives[0].size=1MiB); repeatable")
    p.add_argument("--dry-run", action="store_true",
                   help="check the config and print each node's torchrun command; run nothing")
    p.add_argument("--node-rank", type=int, default=None, metavar="N",
                   help="this node's launch in a multi-node job, 0 to nnodes-1 (run one launch "
                        "per node; under srun: SLURM_NODEID). With the c10d rendezvous torch, "
                        "not N, decides which node gets rank 0: that node merges")
    p.add_argument("--hang-after", type=float, default=DEFAULT_AFTER_S, metavar="S",
                   help="while the job runs, print the verdict when its ranks disagree and "
                        "nothing moved for S seconds (default 60; 0: off)")
    p.set_defaults(func=run)


def resolve(loaded: C.Loaded, now: datetime.datetime | None = None) -> Config:
    """The config the ranks run: absolute paths, the run name filled, a rendezvous endpoint."""
    cfg = loaded.config.model_copy(deep=True)
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    cfg.output.run_name = C.render_run_name(cfg, time=stamp)
    cfg.output.dir = str(Path(cfg.output.dir).expanduser().resolve())
    cfg.workload.pythonpath = [str((loaded.base_dir / p).resolve()) for p in cfg.workload.pythonpath]
    if cfg.job.rdzv_endpoint is None:
        cfg.job.rdzv_endpoint = torchrun.free_endpoint()
    return cfg


def _plan(loaded: C.Loaded, cfg: Config, out: TextIO) -> None:
    """What --dry-run prints: the layout, then each node's launch and torchrun command."""
    job, run_dir = cfg.job, C.run_dir(cfg)
    out.write(f"commviz launch (dry run): {cfg.name}: {cfg.world_size} ranks = {job.nnodes} "
              f"node(s) × {job.nproc_per_node}, backend {job.backend}, rendezvous c10d at "
              f"{job.rdzv_endpoint} (id {job.rdzv_id})\n")
    out.write(f"run dir: {run_dir}\n")
    for name, lists in groups.layouts(cfg).items():
        out.write(f"group {name}: {lists}\n")
    again = ["commviz", "launch"] + ([loaded.source] if loaded.source != C.DEFAULT_SOURCE else [])
    for o in loaded.overrides:
        again += ["--set", o]
    for node in range(job.nnodes):
        out.write(f"# node {node}: {shlex.join(again + ['--node-rank', str(node)])}\n")
        out.write(torchrun.shell_line(cfg, node, run_dir / CONFIG_NAME, run_dir) + "\n")


def _merge(run_dir: Path, cfg: Config, out: TextIO, run: Run | None
           ) -> tuple[Path | None, bool]:
    """Merge the run (``commviz.merge.merge_run``); (merged path, ok)."""
    from commviz.merge import merge_run

    try:
        result = merge_run(run_dir, fmt=cfg.output.format, progress=sys.stderr.isatty(),
                           run=run)
    except CommvizError as exc:
        out.write(f"merge: failed: {exc}\n")
        return None, False
    for problem in result.problems:
        out.write(f"merge: problem: {problem}\n")
    note = skipped_note(result.skipped)
    if note:
        out.write(f"merge: {note}\n")
    return result.out, result.out is not None


def _overview(run_dir: Path, world: int, out: TextIO) -> tuple[Path | None, bool]:
    """After a tables gather: ranks that sent their inputs instead of a table are converted
    here, then every rank's table becomes ``RUN_DIR/overview.pftrace``; (its path, ok)."""
    from commviz.convert import convert_here
    from commviz.review.overview import write_overview
    from commviz.merge.table import table_path

    for rank in range(world):
        if (not table_path(run_dir, rank).is_file()
                and (run_dir / schema.record_name(rank)).is_file()):
            problem = convert_here(run_dir, rank)
            out.write(f"rank {rank} sent its record instead of a comm table: "
                      f"{'converted here' if problem is None else 'not converted: ' + problem}\n")
    try:
        result = write_overview(run_dir, progress=sys.stderr.isatty())
    except CommvizError as exc:
        out.write(f"overview: failed: {exc}\n")
        return None, False
    except OSError as exc:
        out.write(f"overview: failed: {cannot_write(exc, run_dir)}\n")
        return None, False
    for problem in result.problems:
        out.write(f"overview: problem: {problem}\n")
    if result.stragglers:
        worst = sorted(result.stragglers.items(), key=lambda kv: (-kv[1], kv[0]))[:8]
        out.write("stragglers (rank: instances): " + ", ".join(f"{r}: {n}" for r, n in worst)
                  + "\n")
    out.write(f"overview: {result.out}  ({result.ranks} ranks, {result.instances} collective "
              f"instances; open it in https://ui.perfetto.dev, then `commviz merge {run_dir} "
              f"--ranks ...` for detail)\n")
    return result.out, True


def _all_matched(run_dir: Path, world: int) -> bool:
    from commviz.match.artifact import matched_path

    return all(matched_path(run_dir, r).is_file() for r in range(world))


def _report(run_dir: Path, out: TextIO, run: Run | None) -> bool:
    """The review (``review.render.report_formats.write_report``), as RUN_DIR/report.md."""
    from commviz.review.render.report_formats import write_report

    try:
        result = write_report(run_dir, fmt="markdown", run=run)
    except CommvizError as exc:
        out.write(f"report: failed: {exc}\n")
        return False
    except OSError as exc:                  # report.md or a plot on a full/read-only disk
        out.write(f"report: failed: {cannot_write(exc, run_dir)}\n")
        return False
    for problem in result.problems:
        out.write(f"report: problem: {problem}\n")
    out.write(f"report:  {result.out}\n")
    return True


class LaunchLog:
    """``launch.log``, with every line also kept in memory: a full or read-only disk must not
    cost the launch its verdict (which rank failed, and why, is read from these lines)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines: list[str] = []
        self.error: CommvizError | None = None
        try:
            self._file: TextIO | None = open(path, "a")
        except OSError as exc:
            self._file, self.error = None, cannot_write(exc, path)

    def write(self, text: str) -> None:
        self.lines.append(text)
        if self._file is not None:
            try:
                self._file.write(text)
            except OSError as exc:
                self.error = cannot_write(exc, self.path)
                self.close()

    def flush(self) -> None:
        if self._file is not None:
            try:
                self._file.flush()
            except OSError as exc:
                self.error = cannot_write(exc, self.path)
                self.close()

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            try:
                file.close()
            except OSError as exc:
                self.error = self.error or cannot_write(exc, self.path)

    def text(self) -> str:
        return "".join(self.lines)


class _Say:
    """Where the launch's own progress lines go while torchrun runs: the log and the terminal."""

    def __init__(self, *sinks: TextIO) -> None:
        self.sinks = sinks

    def write(self, text: str) -> None:
        for sink in self.sinks:
            sink.write(text)

    def flush(self) -> None:
        for sink in self.sinks:
            sink.flush()


def _recover_journals(run_dir: Path, out: TextIO) -> dict[Path, dict]:
    """Killed ranks' records, rebuilt from their journals into the run dir; the final records
    it had to read on the way, by path."""
    read: dict[Path, dict] = {}
    try:
        rebuilt = journal.write_recovered(run_dir, read)
    except OSError as exc:
        out.write(f"journal: {cannot_write(exc)}; the merge reads the journals directly\n")
        return read
    for rank, added in sorted(rebuilt.items()):
        out.write(f"rank {rank} never wrote its record: rebuilt from its journal "
                  f"({added} collectives)\n")
    return read


def _report_failures(run_dir: Path, code: int, log_path: Path, log_text: str,
                     out: TextIO, run: Run | None) -> None:
    found = outcome.failures(log_dir(run_dir), log_text)
    judged = outcome.judge(run_dir, found, run)
    found = outcome.culprits_first(found, judged)
    if not found:
        out.write(f"FAILED: torchrun exited with code {code} and no rank reported why; see "
                  f"{log_path}\n")
    else:
        first, *rest = found
        where = f" on {first.host}" if first.host else ""
        out.write(f"FAILED: rank {first.rank}{where}: {first.reason}\n")
        if first.detail is not None:
            out.write(f"  traceback: {first.detail}\n")
        for f in rest:
            out.write(f"  rank {f.rank} stopped because rank {first.rank} failed: {f.reason}\n")
    out.write(verdict_text(judged) if judged is not None else "")


def _point_at_logs(placed: list[placement.Placement], log_path: Path, held: int,
                   out: TextIO) -> None:
    """After the verdict: where the tracebacks kept off the terminal are (torch's ranks)."""
    for p in placed:
        if p.stderr is not None and p.stderr.exists():
            out.write(f"  rank {p.rank} log: {p.stderr}\n")
    if held:
        out.write(f"  ({held} lines of tracebacks and torchrun errors not shown here: they are "
                  f"in {log_path})\n")


def _rendezvous_failed(log_text: str, watch: rendezvous.Watch | None, cfg: Config,
                       out: TextIO) -> bool:
    """One line for a rendezvous that never completed (no rank ran); False: it completed."""
    if rendezvous.TIMEOUT_ERROR in log_text and watch is not None:
        out.write(f"FAILED: {watch.timed_out(cfg.job.join_timeout_s)}\n")
        return True
    if rendezvous.CONNECTION_ERROR in log_text:
        out.write(f"FAILED: the rendezvous store at {cfg.job.rdzv_endpoint} could not be reached "
                  f"(it runs in the torchrun of the node at that address: is its launch "
                  f"started, and the address right?)\n")
        return True
    return False


def _elsewhere(placed: list[placement.Placement], run_dir: Path, out: TextIO) -> None:
    """On a node without rank 0: where the run is gathered, merged and reported."""
    p = next((p for p in placed if p.rank0_host), None)
    if p is not None:
        out.write(f"rank 0 ran on {p.rank0_host}: the run is gathered, merged and reported "
                  f"there, in {p.rank0_host}:{p.rank0_run_dir}\n")
    elif placed:
        out.write(f"rank 0 ran on the node at {placed[0].master_addr}: it merges and reports "
                  "what was gathered\n")
    out.write(f"this node's files: {run_dir}\n")


def gather_line(summary: dict) -> str:
    """What travelled to rank 0, from ``gather.json``: bytes per rank, whatever the traces."""
    shared = set(summary["shared"])
    sent = {int(r): n for r, n in summary["received"].items() if int(r) not in shared}
    line = f"gather:  {summary['mode']}, "
    if not sent:
        return line + f"nothing travelled (all {summary['world_size']} ranks share the run dir)"
    return line + (f"{len(sent)} rank(s) sent {min(sent.values())}-{max(sent.values())} bytes "
                   f"each ({sum(sent.values())} in all; {len(shared)} shared the run dir), "
                   f"per rank in {Path(summary['run_dir']) / SUMMARY_NAME}")


def _summary(run_dir: Path, cfg: Config, merged: Path | None, out: TextIO,
             run: Run | None) -> None:
    have = outcome.contents(run_dir, run)
    world = cfg.world_size
    gathered = load_summary(run_dir)
    tables = gathered is not None and gathered["mode"] == Mode.TABLES.value
    out.write(f"run dir: {run_dir}\n")
    if gathered is not None:
        out.write(gather_line(gathered) + "\n")
    out.write(f"records: {len(have.records)}/{world} ranks"
              f"{' in this run dir' if tables else ''}, {sum(have.records.values())} "
              f"collectives; traces: {sum(have.traces.values())} from {len(have.traces)} "
              "rank(s)\n")
    missing = gathered["missing"] if tables else sorted(set(range(world)) - set(have.records))
    if missing:
        out.write(f"missing {'ranks' if tables else 'records: ranks'} {missing}\n")
    for bad in have.unreadable:
        out.write(f"unreadable: {bad}\n")
    if merged is not None:
        out.write(f"merged:  {merged}  (open it in https://ui.perfetto.dev)\n")


def _node_rank(args: argparse.Namespace, step: slurm.Step | None) -> int:
    if args.node_rank is not None:
        return args.node_rank
    return step.node_rank[0] if step is not None else 0


def _slurm_step() -> slurm.Step | None:
    try:
        step = slurm.step(os.environ)
    except ValueError as exc:
        raise ConfigError("Slurm environment", str(exc)) from None
    if step is not None and step.tasks is not None and step.tasks != step.nnodes[0]:
        raise ConfigError("Slurm environment", f"srun started {step.tasks} tasks on "
                          f"{step.nnodes[0]} nodes: run one `commviz launch` per node (srun "
                          "--ntasks-per-node=1); torchrun starts the ranks")
    return step


def _placed_line(placed: list[placement.Placement], out: TextIO) -> None:
    """Which ranks ran here, as torch numbered them."""
    if placed:
        out.write(f"this node ({placed[0].host}, torch's node rank {placed[0].group_rank}) ran "
                  f"ranks {[p.rank for p in placed]}\n")


def run(args: argparse.Namespace) -> int:
    step = _slurm_step()
    loaded = C.load(args.config, args.overrides,
                    slurm.defaults(step) if step is not None else None)
    cfg = resolve(loaded)
    node_rank = _node_rank(args, step)
    if not 0 <= node_rank < cfg.job.nnodes:
        raise ConfigError("--node-rank", f"{node_rank} is not a node of this job (job.nnodes is "
                          f"{cfg.job.nnodes}: 0-{cfg.job.nnodes - 1})")
    out = sys.stdout
    if args.dry_run:
        _plan(loaded, cfg, out)
        return 0
    C.check_environment(loaded)
    run_dir = C.run_dir(cfg)
    if any(run_dir.glob(RECORD_GLOB)):
        raise ConfigError(loaded.where(("output", "run_name")),
                          f"{run_dir} already holds a run; choose another run_name (or remove it)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(run_dir / CONFIG_NAME, C.dump(cfg).encode())
    except OSError as exc:       # read-only or full: nothing can run without the config file
        raise cannot_write(exc, run_dir) from None
    multi = cfg.job.nnodes > 1
    out.write(f"commviz launch: {cfg.name}: {cfg.world_size} ranks ({cfg.job.nnodes} × "
              f"{cfg.job.nproc_per_node}, {cfg.job.backend}), "
              f"{f'launch {node_rank}, ' if multi else ''}run dir {run_dir}\n")
    out.flush()
    from commviz.record import boundary   # torch: only a launch that runs something needs it

    problem = boundary.prebuild()     # once here, not by every rank at its first collective
    if problem is not None:
        out.write(f"commviz launch: warning: the c10d boundary recorder cannot be built, so "
                  f"collectives will not be recorded ({problem})\n")
    log_path = run_dir / log_name(cfg, node_rank)
    echo = Echo(out)
    log = LaunchLog(log_path)
    launch_id = uuid.uuid4().hex
    watch = None
    if multi:
        watch = rendezvous.Watch(str(cfg.job.rdzv_endpoint), cfg.job.rdzv_id, cfg.job.nnodes,
                                 node_rank, _Say(log, echo))
        watch.start()
    def say(text: str) -> None:
        out.write(text)
        out.flush()
        log.write(text)
    def runs_rank_0() -> bool:
        return any(p.rank == 0 for p in placement.of_launch(log_dir(run_dir), launch_id))
    hangs = HangWatch(run_dir, args.hang_after, say, runs_rank_0 if multi else None
                      ) if args.hang_after else None
    if hangs is not None:
        hangs.start()
    metrics = exporting.start(cfg.live.exporter, run_dir, multi)
    seer = WatchThread(run_dir, cfg.live.watch_interval_s, say, (lambda: [
        p.rank for p in placement.of_launch(log_dir(run_dir), launch_id)]) if multi else None
                       ) if cfg.live.watch else None
    if seer is not None:
        seer.start()
    # only other nodes need asking through the run dir: on one node status signals the ranks
    answers = StackAnswers(run_dir, node_rank, launch_id, say) if multi else None
    if answers is not None:
        answers.start()
    try:
        code = torchrun.run(cfg, node_rank, run_dir / CONFIG_NAME, run_dir, log, launch_id,
                            echo=echo)
    finally:
        if watch is not None:
            watch.stop()
        if hangs is not None:
            hangs.stop()
        if answers is not None:
            answers.stop()
        exporting.stop(metrics)
        if seer is not None:
            seer.stop()
        log.close()
    log_text = log.text()
    if log.error is not None:
        out.write(f"launch.log: {log.error}; torchrun's output was kept in memory\n")
    placed = placement.of_launch(log_dir(run_dir), launch_id)
    if multi:
        _placed_line(placed, out)
    if code != 0 and multi and not placed and _rendezvous_failed(log_text, watch, cfg, out):
        out.write(f"  (torchrun's own account: {log_path})\n")
        return 1
    run = _load_once(run_dir, _recover_journals(run_dir, out))
    if code != 0:
        _report_failures(run_dir, code, log_path, log_text, out, run)
        _point_at_logs(placed, log_path, echo.held, out)
    here = not multi or any(p.rank == 0 for p in placed)
    if not here:
        _elsewhere(placed, run_dir, out)
        return 1 if code != 0 else 0
    merged, ok = None, True
    tables = Mode.resolve(cfg.output.gather, cfg.world_size) is Mode.TABLES
    if tables:
        ok = _overview(run_dir, cfg.world_size, out)[1]
    elif cfg.output.merge:
        merged, ok = _merge(run_dir, cfg, out, run)
    if cfg.output.report:
        if not tables or _all_matched(run_dir, cfg.world_size):
            ok = _report(run_dir, out, run) and ok
        else:
            out.write("report:  skipped: the other ranks' matched runs stayed on their nodes "
                      "(tables-only gather); the overview names the stragglers\n")
    _summary(run_dir, cfg, merged, out, run)
    return 1 if code != 0 or not ok else 0


def _load_once(run_dir: Path, known: dict[Path, dict]) -> Run | None:
    """The run dir's records and trace list, read once for the verdict, the merge, the report
    and the summary (None: each reads for itself, and names what it cannot); ``known``: the
    records the journal recovery already read."""
    try:
        return load_run(run_dir, known=known)
    except CommvizError:
        return None
