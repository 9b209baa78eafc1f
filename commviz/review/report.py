"""``commviz report``: the whole review of a run dir as a terminal table, Markdown or JSON.

``review_run`` loads a run's matched ranks (``commviz.match.matched``: the per-rank artifacts the
merge also reads, on the same clock) and runs every analysis;
``write_report`` renders it, writes it into the run dir (or ``out``) and draws the plots. Its
verdict is the launch's: how each rank ended is read from the logs ``commviz launch`` left in
the run dir (``commviz.review.exits``). Tables list what costs the most time first and stop at
``top`` rows; the JSON holds everything, times in ns, sizes in bytes, bandwidth in GB/s (1e9
bytes/s).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commviz.errors import SourceError
from commviz.metadata import fmt_bytes
from commviz.match.model import CommEvent
from commviz.merge import instances as inst_mod
from commviz.merge.instances import Instance, build_instances
from commviz.merge.select import suggestion
from commviz.review.desync import Desync, find_desyncs
from commviz.review.exits import read_exits
from commviz.review.origins import OriginRow, event_origin, instance_origin, rollup
from commviz.review.summary import (CollectiveSummary, GroupSummary, RankSummary,
                                    collective_summaries, group_summaries, rank_summaries)
from commviz.review.overlap import RankOverlap, overlap_table
from commviz.review.verdict import Verdict, build_verdict, verdict_json
from commviz.review.streams import StreamRow, stream_table
from commviz.trace.gpu import GpuOp
from commviz.trace.run import Run
from commviz.trace.kernels import KERNEL_CLASSES

FORMATS = ("table", "markdown", "json")
REPORT_NAMES = {"table": "report.txt", "markdown": "report.md", "json": "report.json"}
TOP = 20
TABLE_WIDTH = 160


@dataclass
class Review:
    """Every analysis of one run."""

    run_dir: Path
    ranks: list[int]
    events: int
    instances: list[Instance]
    groups: list[GroupSummary]
    rank_rows: list[RankSummary]
    collectives: list[CollectiveSummary]
    desyncs: list[Desync]
    streams: list[StreamRow]
    overlap: list[RankOverlap]
    problems: list[str]
    by: str | None = None            # the rollup asked for (``origins.BY``), if any
    origins: list[OriginRow] = field(default_factory=list)
    verdict: Verdict | None = None   # why the job hung or died; None when it did not


@dataclass
class ReportResult:
    text: str                      # the report as rendered in ``fmt``
    out: Path                      # where it was written
    plots: list[Path]
    review: Review
    problems: list[str] = field(default_factory=list)


def load_inputs(run_dir: str | Path, run: Run | None = None
                ) -> tuple[list[CommEvent], list[GpuOp], set[int], list[str]]:
    """A run's collectives and GPU ops on the merged clock (its matched ranks, the same the
    merged trace is made of), the ranks with data, and the problems (``run``: the run dir
    already loaded)."""
    from commviz.match.matched import matched_run

    matched = matched_run(run_dir, run)
    if not matched.ranks:
        why = "; ".join(matched.problems) or "no commviz records and no profiler traces"
        raise SourceError(str(run_dir), f"nothing to review: {why}")
    ranks = [matched.ranks[r] for r in sorted(matched.ranks)]
    events = [ev for art in ranks for ev in art.events]
    ops = [op for art in ranks for op in art.gpu_ops]
    return events, ops, set(matched.ranks), matched.problems


def analyse(events: list[CommEvent], ops: list[GpuOp], *, present: set[int] | None = None,
            run_dir: Path = Path("."), problems: list[str] | None = None,
            straggler_min_ns: int = inst_mod.STRAGGLER_MIN_NS,
            straggler_factor: float = inst_mod.STRAGGLER_FACTOR) -> Review:
    """Run every analysis on already loaded events and GPU ops."""
    present = present if present is not None else {e.rank for e in events}
    instances = build_instances(events, present=present, straggler_min_ns=straggler_min_ns,
                                straggler_factor=straggler_factor)
    return Review(
        run_dir=Path(run_dir), ranks=sorted(present), events=len(events), instances=instances,
        groups=group_summaries(instances), rank_rows=rank_summaries(instances),
        collectives=collective_summaries(instances),
        desyncs=find_desyncs(events, present=present), streams=stream_table(ops),
        overlap=overlap_table(ops), problems=list(problems or []))


def review_run(run_dir: str | Path, by: str | None = None, run: Run | None = None,
               **thresholds: Any) -> Review:
    """Load ``run_dir`` and analyse it (``thresholds``: ``straggler_min_ns``, ``straggler_factor``;
    ``by``: also roll communication up per origin or unit, ``origins.BY``; ``run``: the run dir
    already loaded)."""
    events, ops, present, problems = load_inputs(run_dir, run)
    review = analyse(events, ops, present=present, run_dir=Path(run_dir), problems=problems,
                     **thresholds)
    if by is not None:
        review.by, review.origins = by, rollup(review.instances, by)
    review.verdict = build_verdict(run_dir, read_exits(Path(run_dir)), run=run)
    return review


# -- rendering ---------------------------------------------------------------------------------

def fmt_ns(ns: int | float | None) -> str:
    if ns is None:
        return "-"
    ns = float(ns)
    for unit, scale in (("s", 1e9), ("ms", 1e6), ("µs", 1e3)):
        if abs(ns) >= scale:
            return f"{ns / scale:.3g} {unit}" if abs(ns) < 100 * scale else f"{ns / scale:.0f} {unit}"
    return f"{ns:.0f} ns"


def fmt_gbps(v: float | None) -> str:
    return "-" if v is None else f"{v:.3g}"


def instance_comm(i: Instance) -> str:
    """An instance's comm time, or why it has none: a failed call moved no data, and a span
    that covers only the launch (async, or an enqueued GPU collective) measured no transfer."""
    if i.failed:
        return "failed"
    return "launch only" if i.launch_only else fmt_ns(i.comm_ns)


def collective_comm(c: CollectiveSummary) -> str:
    """A (group, op, size) row's comm time, saying how many instances measured none and why."""
    measured = c.count - c.launch_only - c.failed
    notes = [f"{n} {what}" for n, what in ((c.launch_only, "launch only"), (c.failed, "failed"))
             if n]
    if not measured:
        return "launch only" if not c.failed else ", ".join(notes)
    return fmt_ns(c.comm_ns) + (f" (+{', '.join(notes)})" if notes else "")


@dataclass
class Section:
    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""


def desync_origins(review: Review, d: Desync) -> str:
    """Where each side of a desync made its call at that sequence number."""
    at = {r: o for i in review.instances if i.pg == d.pg and i.seq == d.seq
          for r, ev in i.events.items() if (o := event_origin(ev)) is not None}
    return "; ".join(f"{list(s.ranks)}: {at.get(s.ranks[0], '-')}" for s in d.sides)


def sections(review: Review, top: int = TOP) -> list[Section]:
    """The report's tables, most costly rows first, each cut at ``top`` rows."""
    out = []
    if review.desyncs:
        out.append(Section("Desyncs (first mismatch per process group)",
                           ["group", "seq", "kind", "sides", "origin", "why"],
                           [[f"{d.pg} ({d.pg_desc})", str(d.seq), d.kind,
                             "; ".join(f"{list(s.ranks)}: {s.signature or 'nothing'}"
                                       for s in d.sides), desync_origins(review, d), d.detail]
                            for d in review.desyncs]))
    if review.by is not None:
        out.append(Section(
            f"Communication by {review.by} (most time first)",
            [review.by, "instances", "comm time", "wait time", "ops"],
            [[r.origin, str(r.count), fmt_ns(r.comm_ns), fmt_ns(r.wait_ns),
              ", ".join(f"{op} x{n}" for op, n in r.ops.most_common())]
             for r in review.origins[:top]],
            "comm time: sum over instances (launch-only ones add none); wait time: the time "
            "ranks waited for the last one to arrive"))
    out.append(Section(
        "Process groups (most waiting first)",
        ["group", "ranks", "collectives", "comm time", "wait time", "median skew", "max skew",
         "stragglers (rank: times, skew caused)"],
        [[f"{g.pg} ({g.desc})", ",".join(map(str, g.ranks)), str(g.count), fmt_ns(g.comm_ns),
          fmt_ns(g.wait_ns), fmt_ns(g.median_skew_ns), fmt_ns(g.max_skew_ns),
          ", ".join(f"r{r}: {c}x {fmt_ns(s)}" for r, (c, s) in list(g.stragglers.items())[:4])
          or "-"] for g in review.groups[:top]]))
    out.append(Section(
        "Ranks (the rank that held others up most first)",
        ["rank", "collectives", "time in calls", "of which waiting", "times straggler",
         "skew caused", "missing"],
        [[str(r.rank), str(r.count), fmt_ns(r.busy_ns), fmt_ns(r.wait_ns), str(r.late),
          fmt_ns(r.caused_ns), str(r.missing)] for r in review.rank_rows[:top]]))
    late = sorted((i for i in review.instances if i.straggler is not None),
                  key=lambda i: (-i.skew_ns, i.pg))[:top]
    if late:
        out.append(Section(
            "Stragglers (the longest late arrivals first)",
            ["late rank", "group", "collective", "origin", "skew", "total wait"],
            [[str(i.straggler), i.pg, i.label, instance_origin(i), fmt_ns(i.skew_ns),
              fmt_ns(i.total_wait_ns)] for i in late],
            "origin: the code or framework unit that issued the collective; total wait: what "
            "the other ranks spent waiting for the late one"))
    out.append(Section(
        "Collectives by group, type and size (most time first)",
        ["group", "op", "size", "count", "comm time", "wait time", "median time",
         "algbw GB/s", "busbw GB/s"],
        [[c.pg, c.op, fmt_bytes(c.size_bytes), str(c.count), collective_comm(c), fmt_ns(c.wait_ns),
          fmt_ns(c.median_comm_ns), fmt_gbps(c.median_algbw), fmt_gbps(c.median_busbw)]
         for c in review.collectives[:top]],
        "comm time: last start to last end, all ranks present; launch only: the spans cover "
        "only the launch (async op, or a GPU collective enqueued), so no transfer time was "
        "measured; bandwidth: nccl-tests formulas"))
    worst = sorted(review.instances,
                   key=lambda i: (not i.failed, -i.total_wait_ns, -i.skew_ns))[:top]
    out.append(Section(
        "Collective instances (failed, then most waiting first)",
        ["group", "collective", "origin", "size", "skew", "late rank", "straggler",
         "total wait", "comm time", "busbw GB/s", "missing ranks"],
        [[i.pg, i.label + (" (FAILED)" if i.failed else ""), instance_origin(i),
          fmt_bytes(i.size_bytes),
          fmt_ns(i.skew_ns), str(i.late_rank),
          "warm-up" if i.warmup else "-" if i.straggler is None else f"rank {i.straggler}",
          fmt_ns(i.total_wait_ns),
          instance_comm(i), fmt_gbps(i.bandwidth.busbw_gbps if i.bandwidth else None),
          ",".join(map(str, i.missing)) or "-"] for i in worst]))
    if review.streams:
        out.append(Section(
            "GPU streams (busiest first)",
            ["rank", "stream", *[f"{c} n/time" for c in KERNEL_CLASSES], "graphed", "total"],
            [[str(s.rank), str(s.stream),
              *[f"{s.count[c]} / {fmt_ns(s.time_ns[c])}" for c in KERNEL_CLASSES],
              str(s.graphed), fmt_ns(s.total_ns)] for s in review.streams[:top]]))
    if review.overlap:
        out.append(Section(
            "Communication vs computation per rank (HTA definitions)",
            ["rank", "comm", "compute", "comm overlapped", "overlap %", "idle", "non-compute",
             "kernel span"],
            [[str(o.rank), fmt_ns(o.comm_ns), fmt_ns(o.compute_ns), fmt_ns(o.overlap_ns),
              "-" if o.overlap_pct is None else f"{o.overlap_pct:.1f}", fmt_ns(o.idle_ns),
              fmt_ns(o.non_compute_ns), fmt_ns(o.kernel_ns)] for o in review.overlap]))
    return out


def _headline(review: Review) -> str:
    strag = sum(1 for i in review.instances if i.straggler is not None)
    line = (f"commviz report: {review.run_dir}: {len(review.ranks)} ranks, {review.events} "
            f"collective calls, {len(review.instances)} instances in {len(review.groups)} "
            f"groups, {strag} with a straggler, {len(review.desyncs)} desync(s)")
    detail = suggestion(review.run_dir, review.instances)
    return line + (f"\ndetail of the worst straggler and its group: {detail}" if detail else "")


def render_table(review: Review, top: int = TOP, width: int = TABLE_WIDTH) -> str:
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False)
    if review.verdict is not None:
        console.print(review.verdict.render(), markup=False, highlight=False, soft_wrap=True)
    console.print(_headline(review))
    for problem in review.problems:
        console.print(f"problem: {problem}")
    for sec in sections(review, top):
        table = Table(title=sec.title, caption=sec.note or None, title_justify="left")
        for col in sec.columns:
            table.add_column(col, overflow="fold")
        for row in sec.rows:
            table.add_row(*row)
        console.print(table)
    return buf.getvalue()


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(review: Review, top: int = TOP, plots: list[Path] | None = None,
                    base: Path | None = None) -> str:
    """Markdown; plot links are relative to ``base`` (the report's folder) when given."""
    lines = [f"# {_headline(review)}", ""]
    if review.verdict is not None:
        lines = ["# Verdict", "", "```", review.verdict.render().rstrip("\n"), "```", ""] + lines
    if review.problems:
        lines += ["## Problems", "", *[f"- {_md_cell(p)}" for p in review.problems], ""]
    for sec in sections(review, top):
        lines += [f"## {sec.title}", ""]
        if sec.note:
            lines += [f"_{sec.note}_", ""]
        lines.append("| " + " | ".join(sec.columns) + " |")
        lines.append("|" + "---|" * len(sec.columns))
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in sec.rows]
        lines.append("")
    for path in plots or []:
        link = Path(os.path.relpath(path, base)).as_posix() if base is not None else str(path)
        lines += [f"![{path.stem}]({link})", ""]
    return "\n".join(lines)


def _instance_json(i: Instance) -> dict[str, Any]:
    return {
        "pg": i.pg, "seq": i.seq, "key": list(i.key.wire()), "op": i.op, "type": i.ctype,
        "kind": i.kind, "origin": instance_origin(i),
        "ranks": sorted(i.events), "missing": list(i.missing),
        "start_ns": {str(r): e.start_ns for r, e in sorted(i.events.items())},
        "end_ns": {str(r): e.end_ns for r, e in sorted(i.events.items())},
        "first_start_ns": i.first_start_ns, "last_start_ns": i.last_start_ns,
        "last_end_ns": i.last_end_ns, "skew_ns": i.skew_ns, "late_rank": i.late_rank,
        "straggler": i.straggler, "warmup": i.warmup, "wait_ns": {str(r): w for r, w in sorted(i.wait_ns.items())},
        "comm_ns": i.comm_ns, "launch_only": i.launch_only, "failed": i.failed,
        "size_bytes": i.size_bytes,
        "algbw_GBps": i.bandwidth.algbw_gbps if i.bandwidth else None,
        "busbw_GBps": i.bandwidth.busbw_gbps if i.bandwidth else None,
    }


def to_json(review: Review, plots: list[Path] | None = None) -> dict[str, Any]:
    def rows(items: list[Any]) -> list[dict[str, Any]]:
        return [dataclasses.asdict(x) for x in items]

    desyncs = [{"pg": d.pg, "pg_desc": d.pg_desc, "seq": d.seq, "kind": d.kind,
                "origin": desync_origins(review, d),
                "sides": [{"ranks": list(s.ranks),
                           "collective": None if s.signature is None else
                           dataclasses.asdict(s.signature)} for s in d.sides],
                "detail": d.detail, "message": d.message} for d in review.desyncs]
    groups = [{**dataclasses.asdict(g), "ranks": list(g.ranks),
               "stragglers": {str(r): {"times": c, "skew_caused_ns": s}
                              for r, (c, s) in g.stragglers.items()}} for g in review.groups]
    streams = [{"rank": s.rank, "stream": s.stream, "count": s.count, "time_ns": s.time_ns,
                "graphed": s.graphed} for s in review.streams]
    overlap = [{**dataclasses.asdict(o), "overlap_pct": o.overlap_pct} for o in review.overlap]
    return {"run_dir": str(review.run_dir), "ranks": review.ranks, "events": review.events,
            "verdict": None if review.verdict is None else verdict_json(review.verdict),
            "problems": review.problems, "desyncs": desyncs, "groups": groups,
            "rank_summaries": rows(review.rank_rows), "collectives": rows(review.collectives),
            "streams": streams, "overlap": overlap,
            "instances": [_instance_json(i) for i in review.instances],
            **({"by_" + review.by: [{**dataclasses.asdict(r), "ops": dict(r.ops)}
                                    for r in review.origins]} if review.by else {}),
            "plots": [str(p) for p in plots or []]}


def render(review: Review, fmt: str, *, top: int = TOP, plots: list[Path] | None = None,
           base: Path | None = None) -> str:
    if fmt == "table":
        return render_table(review, top)
    if fmt == "markdown":
        return render_markdown(review, top, plots, base)
    if fmt == "json":
        return json.dumps(to_json(review, plots), indent=1) + "\n"
    raise ValueError(f"unknown report format {fmt!r} (one of {', '.join(FORMATS)})")


def write_report(run_dir: str | Path, *, fmt: str = "table", plots_dir: str | Path | None = None,
                 out: str | Path | None = None, plots: bool = True, top: int = TOP,
                 by: str | None = None, run: Run | None = None,
                 **thresholds: Any) -> ReportResult:
    """Review ``run_dir`` and write the report (default ``RUN_DIR/report.{txt,md,json}``) and,
    unless ``plots`` is False, the PNGs (default ``RUN_DIR/plots``)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown report format {fmt!r} (one of {', '.join(FORMATS)})")
    run_dir = Path(run_dir)
    review = review_run(run_dir, by=by, run=run, **thresholds)
    written: list[Path] = []
    if plots:
        from commviz.review.plots import write_plots
        from commviz.review.preview import report_timeline

        plots_dir = Path(plots_dir) if plots_dir is not None else run_dir / "plots"
        timeline, problems = report_timeline(run_dir, plots_dir)   # merged.pftrace drawn
        review.problems += problems
        written = timeline + write_plots(review.instances, plots_dir)
    target = Path(out) if out is not None else run_dir / REPORT_NAMES[fmt]
    target.parent.mkdir(parents=True, exist_ok=True)
    text = render(review, fmt, top=top, plots=written, base=target.parent)
    target.write_text(text, encoding="utf-8")
    return ReportResult(text=text, out=target, plots=written, review=review,
                        problems=review.problems)
