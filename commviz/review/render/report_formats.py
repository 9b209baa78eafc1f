"""``commviz report``'s formats: the review of a run dir (``review.analyses.reviewing``) as a
terminal table, Markdown or JSON, and ``write_report``, which reviews a run dir, renders it, writes
it into the run dir (or ``out``) and draws the plots. Tables list what costs the most time first
and stop at ``top`` rows; the JSON holds everything, times in ns, sizes in bytes, bandwidth in
GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from commviz.kernels import KERNEL_CLASSES
from commviz.merge.instances import LAUNCH_ONLY_WHY, Instance, LaunchOnly
from commviz.merge.select import format_ranks, suggestion
from commviz.metadata import fmt_bytes, fmt_gbps, fmt_ns
from commviz.review.analyses.desync import Desync
from commviz.review.analyses.origins import event_origin, instance_origin
from commviz.review.analyses.pipeline import SLOW_FACTOR, ordered, slowest
from commviz.review.analyses.reviewing import Review, review_run
from commviz.review.analyses.rollups import CollectiveSummary, GroupSummary
from commviz.review.render import wholerun
from commviz.review.render.verdict_text import roles, verdict_json, verdict_text
from commviz.trace.run import Run, skipped_note

FORMATS = ("table", "markdown", "json")
REPORT_NAMES = {"table": "report.txt", "markdown": "report.md", "json": "report.json"}
TOP = 20
TABLE_WIDTH = 160


@dataclass
class ReportResult:
    text: str                      # the report as rendered in ``fmt``
    out: Path                      # where it was written
    plots: list[Path]
    review: Review
    problems: list[str] = field(default_factory=list)



def instance_comm(i: Instance) -> str:
    """An instance's comm time, or why it has none: a failed call moved no data, one some rank
    never joined never ran whole, and a span that covers only the launch (async, or an
    enqueued GPU collective) measured no transfer."""
    if i.failed:
        return "failed"
    if i.missing:
        return "incomplete"
    return "launch only" if i.launch_only else fmt_ns(i.comm_ns)


def collective_comm(c: CollectiveSummary) -> str:
    """A (group, op, size) row's comm time, saying how many instances measured none and why."""
    measured = c.count - c.launch_only - c.failed - c.incomplete
    notes = [f"{n} {what}" for n, what in ((c.launch_only, "launch only"), (c.failed, "failed"),
                                           (c.incomplete, "incomplete")) if n]
    if not measured:
        return "launch only" if notes == [f"{c.launch_only} launch only"] else ", ".join(notes)
    return fmt_ns(c.comm_ns) + (f" (+{', '.join(notes)})" if notes else "")


def group_measured(g: GroupSummary) -> str:
    """How many of a group's instances have a measured comm time, and why the others have none."""
    if not g.unmeasured:
        return f"all {g.count}"
    pct = f" ({100 * g.measured / g.count:.0f} %)" if g.measured else ""
    why = ", ".join(f"{n} {reason}" for reason, n in sorted(g.launch_only.items()))
    other = g.unmeasured - sum(g.launch_only.values())
    parts = ([f"launch only: {why}"] if why else []) + ([f"{other} failed or incomplete"]
                                                        if other else [])
    return f"{g.measured} of {g.count}{pct}; " + "; ".join(parts)


def launch_reasons(review: Review) -> dict[str, str]:
    """The reasons some instance of the run is launch only, each with what it means."""
    seen = {reason for g in review.groups for reason in g.launch_only}
    return {str(r): LAUNCH_ONLY_WHY[r] for r in LaunchOnly if str(r) in seen}


def _groups_note(review: Review) -> str:
    notes = ["comm time: of the measured instances only (a GPU kernel, or a CPU call that "
             "returned when the transfer was done)"]
    notes += [f"launch only ({reason}): {why}" for reason, why in launch_reasons(review).items()]
    if any(g.pipeline for g in review.groups):
        notes.append("wait time, skew: of collectives and transfers other than a pipeline "
                     "schedule's (its bubbles: the pipeline section)")
    return "; ".join(notes)


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


def _ranks_section(review: Review, top: int) -> Section:
    """The ranks, the one that held the others up most first; after a failure the verdict's
    culprits first and each rank as the verdict tells it (the tables tell its story)."""
    said = roles(review.verdict) if review.verdict is not None else {}
    order = {r: i for i, r in enumerate(said)}
    rows = sorted(review.rank_rows, key=lambda r: order.get(r.rank, len(order)))
    columns = ["rank", "collectives", "time in calls", "of which waiting", "times straggler",
               "held others up", "missing"]
    note = ("held others up: the skew of the collectives it was late to, the longest wait in "
            "those it never joined (unless it was stuck in another call then), and the other "
            "stages' waits for the pipeline's slowest stage")
    if said:
        columns.insert(1, "in the verdict")
    return Section(
        "Ranks (" + ("the verdict's culprits first" if said else
                     "the rank that held others up most first") + ")", columns,
        [[str(r.rank) + ("" if r.slow_stage is None else f" (slowest stage {r.slow_stage})"),
          *([said.get(r.rank, "-")] if said else []), str(r.count),
          fmt_ns(r.busy_ns), fmt_ns(r.wait_ns), str(r.late), fmt_ns(r.caused_ns),
          str(r.missing)] for r in rows[:top]], note)


def _pipeline_section(review: Review) -> Section:
    """Each pipeline stage's waits for its neighbours, the slowest stage first."""
    def action(a: Any) -> str:
        warm = f" (+{a.warmup} in the first step)" if a.warmup else ""
        if not a.measured:
            return f"{a.action} x{a.transfers}{warm}: not measured"
        on = ", ".join(f"stage {s}" for s in sorted(a.on, key=lambda s: -a.on[s]))
        return (f"{a.action} x{a.transfers}{warm}: {fmt_ns(a.wait_ns)} (longest "
                f"{fmt_ns(a.max_wait_ns)}" + (f", for {on})" if on else ")"))
    return Section(
        "Pipeline stages (the schedule's bubbles, not stragglers; the slowest stage first)",
        ["stage", "rank", "waited", "others waited for it", "per action"],
        [[str(s.stage) + (" (slowest)" if s.slowest else ""), str(s.rank), fmt_ns(s.wait_ns),
          fmt_ns(s.waited_on_ns), "; ".join(action(a) for a in ordered(s.actions))]
         for s in review.pipeline],
        ("waited: from a transfer's start until its peer's side started (a receive: the "
         "send; on GPUs also a send: its receive), after the first step (the warm-up); on CPU "
         "(gloo) a record covers the posting, so a send's wait is not measured; the slowest "
         f"stage: every other stage waited at least {SLOW_FACTOR:g} times as long as it did"))


def sections(review: Review, top: int = TOP) -> list[Section]:
    """The report's tables, most costly rows first, each cut at ``top`` rows."""
    titles = {g.pg: g.title for g in review.groups}    # "3 (ranks [0, 2])": md.group_title

    def group(pg: str) -> str:
        return titles.get(pg, pg)

    out = []
    if review.desyncs:
        out.append(Section("Desyncs (first mismatch per process group)",
                           ["group", "seq", "kind", "sides", "origin", "why"],
                           [[f"{d.pg} ({d.group})", str(d.seq), d.kind,
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
        ["group", "ranks", "collectives", "comm time", "measured", "wait time", "median skew",
         "max skew", "stragglers (rank: times, skew caused)"],
        [[g.title, ",".join(map(str, g.ranks)),
          str(g.count) + (f" ({g.pipeline} pipeline transfers)" if g.pipeline else ""),
          fmt_ns(g.comm_ns), group_measured(g), fmt_ns(g.wait_ns), fmt_ns(g.median_skew_ns),
          fmt_ns(g.max_skew_ns),
          ", ".join(f"r{r}: {c}x {fmt_ns(s)}" for r, (c, s) in list(g.stragglers.items())[:4])
          or "-"] for g in review.groups[:top]],
        _groups_note(review)))
    out.append(_ranks_section(review, top))
    if review.pipeline:
        out.append(_pipeline_section(review))
    late = sorted((i for i in review.instances if i.straggler is not None),
                  key=lambda i: (-i.skew_ns, i.pg))[:top]
    if late:
        out.append(Section(
            "Stragglers (the longest late arrivals first)",
            ["late rank", "group", "collective", "origin", "skew", "total wait"],
            [[str(i.straggler), group(i.pg), i.label, instance_origin(i),
              fmt_ns(i.skew_ns), fmt_ns(i.total_wait_ns)] for i in late],
            "origin: the code or framework unit that issued the collective; total wait: what "
            "the other ranks spent waiting for the late one"))
    out.append(Section(
        "Collectives by group, type and size (most time first)",
        ["group", "op", "size", "count", "comm time", "wait time", "median time",
         "algbw GB/s", "busbw GB/s"],
        [[group(c.pg), c.op, fmt_bytes(c.size_bytes), str(c.count), collective_comm(c),
          fmt_ns(c.wait_ns), fmt_ns(c.median_comm_ns), fmt_gbps(c.median_algbw),
          fmt_gbps(c.median_busbw)] for c in review.collectives[:top]],
        "comm time: last start to last end, all ranks present; launch only: the spans cover "
        "only the launch (async op, or a GPU collective enqueued), so no transfer time was "
        "measured; bandwidth: nccl-tests formulas"))
    worst = sorted((i for i in review.instances if not i.pipeline),
                   key=lambda i: (not i.failed, not i.missing, -i.total_wait_ns, -i.skew_ns))
    out.append(Section(
        "Collective instances (failed or missing a rank, then most waiting first)",
        ["group", "collective", "origin", "size", "skew", "late rank", "straggler",
         "total wait", "comm time", "busbw GB/s", "missing ranks"],
        [[group(i.pg), i.label + (" (FAILED)" if i.failed else ""), instance_origin(i),
          fmt_bytes(i.size_bytes), fmt_ns(i.skew_ns),
          f"{format_ranks(i.missing)} (never came)" if i.missing else str(i.late_rank),
          "warm-up" if i.warmup else "-" if i.straggler is None else f"rank {i.straggler}",
          fmt_ns(i.total_wait_ns),
          instance_comm(i), fmt_gbps(i.bandwidth.busbw_gbps if i.bandwidth else None),
          ",".join(map(str, i.missing)) or "-"] for i in worst[:top]],
        "a pipeline schedule's transfers are in the pipeline section" if review.pipeline
        else ""))
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
    out += [Section(*t) for t in wholerun.tables(review.run_dir, top)]
    return out


def _headline(review: Review) -> str:
    strag = sum(1 for i in review.instances if i.straggler is not None)
    line = (f"commviz report: {review.run_dir}: {len(review.ranks)} ranks, {review.events} "
            f"collective calls, {len(review.instances)} instances in {len(review.groups)} "
            f"groups, {strag} with a straggler, {len(review.desyncs)} desync(s)")
    slow = slowest(review.pipeline)
    if slow is not None:
        line += (f"\nslowest pipeline stage: {slow.stage} (rank {slow.rank}): it waited "
                 f"{fmt_ns(slow.wait_ns)}, the other stages {fmt_ns(slow.waited_on_ns)} for it")
    unmeasured = [g for g in review.groups if g.launch_only]
    if unmeasured:
        launch = sum(sum(g.launch_only.values()) for g in unmeasured)
        line += (f"\ncomm time not measured (launch only) for {launch} of "
                 f"{len(review.instances)} instances: " + ", ".join(
                     f"{g.title}: {sum(g.launch_only.values())} of {g.count}" for g in unmeasured)
                 + " (why: the process groups' note)")
    if review.verdict is not None:        # the same story: the verdict's ranks, not a straggler
        return line + f"\ndetail of the verdict's ranks: {review.verdict.open_next()}"
    detail = suggestion(review.run_dir, review.instances)
    return line + (f"\ndetail of the worst straggler and its group: {detail}" if detail else "")


def render_table(review: Review, top: int = TOP, width: int = TABLE_WIDTH) -> str:
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False)
    if review.verdict is not None:
        console.print(verdict_text(review.verdict), markup=False, highlight=False, soft_wrap=True)
    console.print(_headline(review))
    for problem in review.problems:
        console.print(f"problem: {problem}")
    if review.skipped:
        console.print(skipped_note(review.skipped))
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
        lines = ["# Verdict", "", "```", verdict_text(review.verdict).rstrip("\n"), "```",
                 ""] + lines
    if review.problems:
        lines += ["## Problems", "", *[f"- {_md_cell(p)}" for p in review.problems], ""]
    if review.skipped:
        lines += [f"_{_md_cell(skipped_note(review.skipped) or '')}_", ""]
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
        "kind": i.kind, "origin": instance_origin(i), "pipeline": i.pipeline,
        "ranks": sorted(i.events), "missing": list(i.missing),
        "start_ns": {str(r): e.start_ns for r, e in sorted(i.events.items())},
        "end_ns": {str(r): e.end_ns for r, e in sorted(i.events.items())},
        "first_start_ns": i.first_start_ns, "last_start_ns": i.last_start_ns,
        "last_end_ns": i.last_end_ns, "skew_ns": i.skew_ns, "late_rank": i.late_rank,
        "straggler": i.straggler, "warmup": i.warmup, "wait_ns": {str(r): w for r, w in sorted(i.wait_ns.items())},
        "comm_ns": i.comm_ns, "launch_only": i.launch_only,
        "launch_reason": None if i.launch_reason is None else str(i.launch_reason),
        "failed": i.failed,
        "size_bytes": i.size_bytes,
        "algbw_GBps": i.bandwidth.algbw_gbps if i.bandwidth else None,
        "busbw_GBps": i.bandwidth.busbw_gbps if i.bandwidth else None,
    }


def to_json(review: Review, plots: list[Path] | None = None) -> dict[str, Any]:
    def rows(items: list[Any]) -> list[dict[str, Any]]:
        return [dataclasses.asdict(x) for x in items]

    desyncs = [{"pg": d.pg, "pg_desc": d.pg_desc, "group": d.group, "seq": d.seq,
                "kind": d.kind,
                "origin": desync_origins(review, d),
                "sides": [{"ranks": list(s.ranks),
                           "collective": None if s.signature is None else
                           dataclasses.asdict(s.signature)} for s in d.sides],
                "detail": d.detail, "message": d.message} for d in review.desyncs]
    groups = [{**dataclasses.asdict(g), "title": g.title, "ranks": list(g.ranks),
               "unmeasured": g.unmeasured,
               "stragglers": {str(r): {"times": c, "skew_caused_ns": s}
                              for r, (c, s) in g.stragglers.items()}} for g in review.groups]
    streams = [{"rank": s.rank, "stream": s.stream, "count": s.count, "time_ns": s.time_ns,
                "graphed": s.graphed} for s in review.streams]
    overlap = [{**dataclasses.asdict(o), "overlap_pct": o.overlap_pct} for o in review.overlap]
    said = roles(review.verdict) if review.verdict is not None else {}
    return {"run_dir": str(review.run_dir), "ranks": review.ranks, "events": review.events,
            "verdict": None if review.verdict is None else verdict_json(review.verdict),
            "problems": review.problems, "desyncs": desyncs, "groups": groups,
            "launch_only_why": launch_reasons(review),
            "skipped": [p.name for p in review.skipped],
            "rank_summaries": [{**dataclasses.asdict(r), "verdict": said.get(r.rank)}
                               for r in review.rank_rows],
            "pipeline": [{"stage": s.stage, "rank": s.rank, "wait_ns": s.wait_ns,
                          "waited_on_ns": s.waited_on_ns, "slowest": s.slowest,
                          "actions": {a.action: {**dataclasses.asdict(a),
                                                 "on": {str(k): v for k, v in a.on.items()}}
                                      for a in ordered(s.actions)}}
                         for s in review.pipeline],
            "collectives": rows(review.collectives),
            "streams": streams, "overlap": overlap,
            "instances": [_instance_json(i) for i in review.instances],
            "whole_run": wholerun.to_json(review.run_dir),
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
    return write_review(review_run(run_dir, by=by, run=run, **thresholds), fmt=fmt,
                        plots_dir=plots_dir, out=out, plots=plots, top=top)


def write_review(review: Review, *, fmt: str = "table", plots_dir: str | Path | None = None,
                 out: str | Path | None = None, plots: bool = True, top: int = TOP
                 ) -> ReportResult:
    """Write a review already made, as ``write_report`` does (its problems grow by the plots')."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown report format {fmt!r} (one of {', '.join(FORMATS)})")
    run_dir = review.run_dir
    written: list[Path] = []
    if plots:
        from commviz.review.render.plots import write_plots
        from commviz.review.render.timeline import report_timeline

        plots_dir = Path(plots_dir) if plots_dir is not None else run_dir / "plots"
        timeline, problems = report_timeline(run_dir, plots_dir)   # merged.pftrace drawn
        review.problems += problems
        written = timeline + write_plots(review.instances, plots_dir)
        written += wholerun.plot_windows(run_dir, plots_dir)
    target = Path(out) if out is not None else run_dir / REPORT_NAMES[fmt]
    target.parent.mkdir(parents=True, exist_ok=True)
    text = render(review, fmt, top=top, plots=written, base=target.parent)
    target.write_text(text, encoding="utf-8")
    return ReportResult(text=text, out=target, plots=written, review=review,
                        problems=review.problems)
