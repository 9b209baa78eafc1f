"""``commviz diff``'s output: a terminal table, Markdown for a pull request, JSON, and a PNG.

Every format says first what the runs are and which noise rule decided, then the regressions
(worst first, each with what grew: transfer time, or waiting and for which late rank), the
improvements, the keys found in one run only, and what stayed inside the noise. Times are per
rank in the median profiler step; the JSON holds them in ns, bandwidth in GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from commviz import metadata as md
from commviz.metadata import fmt_gbps, fmt_ns
from commviz.review.diff import BY, ORIGIN, Change, Diff, NoiseRule, Row, RunSide, Side, diff_runs
from commviz.review.render.report_formats import _md_cell

FORMATS = ("table", "markdown", "json")
PLOT_NAME = "diff.png"
PLOTTED = 30                    # bars drawn at most (the regressions first)
COLOURS = {Change.REGRESSION: "#d62728", Change.IMPROVEMENT: "#2ca02c"}
A_COLOUR, B_COLOUR = "#b0b0b0", "#606060"
TITLES = {Change.REGRESSION: "Regressions (worst first)", Change.IMPROVEMENT: "Improvements",
          Change.ONLY_B: "Only in B", Change.ONLY_A: "Only in A",
          Change.UNCHANGED: "Unchanged (inside the noise)"}


def _run_text(run: RunSide) -> str:
    steps = (f"{len(run.steps)} profiler steps (#{md.ranks_text(run.steps)})" if run.steps
             else "no profiler steps (compared whole)")
    outside = (f", {run.outside} collectives left out (outside the steps, or a group's first)"
               if run.outside else "")
    return f"{run.run_dir} · {run.ranks} ranks · {steps}{outside}"


def why(row: Row) -> str:
    """What the change is made of: "+3.1 ms transfer, +25 ms waiting for rank 1"."""
    if row.change in (Change.ONLY_A, Change.ONLY_B):
        return "only in A" if row.change is Change.ONLY_A else "only in B"
    parts: list[str] = []
    for delta, what in ((row.delta_comm_ns, "transfer"), (row.delta_wait_ns, "waiting")):
        # a part of under 5 % of the change is left unsaid, unless nothing else would be
        if abs(delta) >= 0.05 * max(abs(row.delta_ns), 1.0) or not parts and what == "waiting":
            text = f"{'+' if delta >= 0 else '-'}{fmt_ns(abs(delta))} {what}"
            if what == "waiting" and row.late_ranks:
                text += f" for rank{'s' if len(row.late_ranks) > 1 else ''} " + \
                        md.ranks_text(row.late_ranks)
            parts.append(text)
    parts += [f"rank {s.rank} {s.cause}" for s in row.named]
    return ", ".join(parts)


def _pair(a: Any, b: Any) -> str:
    return f"{a} → {b}" if a != b else str(a)


def _side(s: Side | None, pick: Callable[[Side], str]) -> str:
    return "-" if s is None else pick(s)


def cells(row: Row) -> list[str]:
    a, b = row.a, row.b
    t = (lambda s: fmt_ns(s.time_ns))
    where = b or a
    assert where is not None
    sizes_a = ", ".join(md.fmt_bytes(x) for x in a.sizes) if a else "-"
    sizes_b = ", ".join(md.fmt_bytes(x) for x in b.sizes) if b else "-"
    return [
        row.key,
        f"{_side(a, t)} → {_side(b, t)}",
        f"{'+' if row.delta_ns >= 0 else '-'}{fmt_ns(abs(row.delta_ns))}",
        why(row),
        _pair(_side(a, lambda s: f"{s.calls_per_step:.3g}"),
              _side(b, lambda s: f"{s.calls_per_step:.3g}")),
        f"{_side(a, lambda s: fmt_ns(s.comm_ns))} → {_side(b, lambda s: fmt_ns(s.comm_ns))}",
        f"{_side(a, lambda s: fmt_ns(s.wait_ns))} → {_side(b, lambda s: fmt_ns(s.wait_ns))}",
        _pair(_side(a, lambda s: fmt_gbps(s.busbw_gbps)),
              _side(b, lambda s: fmt_gbps(s.busbw_gbps))),
        _pair(_side(a, lambda s: f"{fmt_ns(s.skew_p50_ns)} / {fmt_ns(s.skew_p99_ns)}"),
              _side(b, lambda s: f"{fmt_ns(s.skew_p50_ns)} / {fmt_ns(s.skew_p99_ns)}")),
        _pair(_side(a, _late_text), _side(b, _late_text)),
        f"{', '.join(where.groups)} · {', '.join(where.ops)} · {_pair(sizes_a, sizes_b)}",
    ]


def _late_text(s: Side) -> str:
    top = sorted(s.late.items(), key=lambda rw: (-rw[1], rw[0]))[:3]
    return ", ".join(f"{r} ({fmt_ns(w)})" for r, w in top) or "-"


def columns(by: str) -> list[str]:
    return [by, "time A → B", "Δ", "why", "calls", "comm", "wait", "busbw GB/s",
            "skew p50 / p99", "late ranks (wait on them)", "group · op · size"]


def headline(d: Diff) -> str:
    counts = ", ".join(f"{len(d.of(c))} {c.value}{'s' if c in PLURAL and len(d.of(c)) != 1 else ''}"
                       for c in ORDER_SHOWN)
    return f"commviz diff by {d.by}: {counts}"


PLURAL = (Change.REGRESSION, Change.IMPROVEMENT)
ORDER_SHOWN = (Change.REGRESSION, Change.IMPROVEMENT, Change.ONLY_B, Change.ONLY_A,
               Change.UNCHANGED)


def _preamble(d: Diff) -> list[str]:
    return [f"A: {_run_text(d.a)}", f"B: {_run_text(d.b)}",
            "Times are per rank in the median profiler step; comm: once every rank had "
            "arrived; wait: for the last rank to arrive.",
            f"Noise rule: {d.rule.text}.",
            *[f"problem (A): {p}" for p in d.a.problems],
            *[f"problem (B): {p}" for p in d.b.problems]]


def render_table(d: Diff, width: int = 200) -> str:
    from rich.console import Console
    from rich.table import Table

    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False)
    console.print(headline(d), markup=False, highlight=False)
    for line in _preamble(d):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    for change in ORDER_SHOWN:
        rows = d.of(change)
        if not rows:
            continue
        table = Table(title=TITLES[change], title_justify="left")
        for col in columns(d.by):
            table.add_column(col, overflow="fold")
        for row in rows:
            table.add_row(*cells(row))
        console.print(table)
    return buf.getvalue()


def render_markdown(d: Diff, plot: Path | None = None, base: Path | None = None) -> str:
    """Markdown for a pull request: the verdict in the first lines, then one table per kind of
    change, the unchanged keys folded away (``<details>``)."""
    regressions = d.of(Change.REGRESSION)
    lines = [f"## {headline(d)}", ""]
    if regressions:
        lines += ["**Regressions**, worst first:", ""]
        lines += [f"{n}. `{_md_cell(r.key)}`: {fmt_ns(r.a.time_ns)} → {fmt_ns(r.b.time_ns)} a "
                  f"step ({why(r)})" for n, r in enumerate(regressions, 1) if r.a and r.b]
    else:
        lines += ["No regression outside the noise."]
    lines += ["", *[f"- {_md_cell(line)}" for line in _preamble(d)], ""]
    if plot is not None:
        link = Path(os.path.relpath(plot, base)).as_posix() if base is not None else str(plot)
        lines += [f"![B against A per {d.by}]({link})", ""]
    for change in ORDER_SHOWN:
        rows = d.of(change)
        if not rows:
            continue
        folded = change is Change.UNCHANGED
        lines += ([f"<details><summary>{TITLES[change]}: {len(rows)}</summary>", ""] if folded
                  else [f"### {TITLES[change]}", ""])
        cols = columns(d.by)
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        lines += ["| " + " | ".join(_md_cell(c) for c in cells(r)) + " |" for r in rows]
        lines += ["", "</details>", ""] if folded else [""]
    return "\n".join(lines)


def _side_json(s: Side | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {"calls_per_step": s.calls_per_step, "time_ns": s.time_ns, "comm_ns": s.comm_ns,
            "wait_ns": s.wait_ns, "spread_ns": s.spread_ns, "steps": s.steps,
            "busbw_GBps": s.busbw_gbps, "skew_p50_ns": s.skew_p50_ns,
            "skew_p99_ns": s.skew_p99_ns,
            "late_ranks": {str(r): w for r, w in sorted(s.late.items())},
            "groups": s.groups, "ops": s.ops, "sizes": s.sizes}


def row_json(row: Row, by: str) -> dict[str, Any]:
    return {by: row.key, "key": row.key, "change": row.change.value,
            "delta_ns": row.delta_ns, "delta_comm_ns": row.delta_comm_ns,
            "delta_wait_ns": row.delta_wait_ns, "cause": row.cause,
            "late_ranks": row.late_ranks, "noise_ns": row.noise_ns, "why": why(row),
            "named": [{"rank": s.rank, "cause": str(s.cause), "peer": s.peer,
                       "group": s.group_label, "origin": s.origin, "cost_ns": s.cost_ns}
                      for s in row.named],
            "a": _side_json(row.a), "b": _side_json(row.b)}


def _run_json(run: RunSide) -> dict[str, Any]:
    return {"run_dir": str(run.run_dir), "ranks": run.ranks, "steps": run.steps,
            "instances": run.instances, "outside_steps": run.outside, "problems": run.problems}


def to_json(d: Diff, plot: Path | None = None) -> dict[str, Any]:
    return {"by": d.by, "a": _run_json(d.a), "b": _run_json(d.b),
            "noise_rule": {"text": d.rule.text, "standard_errors": d.rule.se,
                           "relative": d.rule.rel, "min_ns": d.rule.min_ns},
            "units": "per rank, median profiler step; ns, GB/s",
            "regressions": [row_json(r, d.by) for r in d.of(Change.REGRESSION)],
            "improvements": [row_json(r, d.by) for r in d.of(Change.IMPROVEMENT)],
            "only_a": [row_json(r, d.by) for r in d.of(Change.ONLY_A)],
            "only_b": [row_json(r, d.by) for r in d.of(Change.ONLY_B)],
            "unchanged": [row_json(r, d.by) for r in d.of(Change.UNCHANGED)],
            "plot": str(plot) if plot is not None else None}


def render(d: Diff, fmt: str, plot: Path | None = None, base: Path | None = None) -> str:
    if fmt == "table":
        return render_table(d)
    if fmt == "markdown":
        return render_markdown(d, plot, base)
    if fmt == "json":
        return json.dumps(to_json(d, plot), indent=1) + "\n"
    raise ValueError(f"unknown diff format {fmt!r} (one of {', '.join(FORMATS)})")


def plot_diff(d: Diff, path: Path) -> Path:
    """One pair of bars per key, A (light) beside B (dark), per rank and step, each its comm
    time (solid) then its wait (hatched): regressions' B bars red, improvements' green; keys
    in the tables' order, the first ``PLOTTED``."""
    rows = d.rows[:PLOTTED]
    fig = Figure(figsize=(10, 1.2 + 0.42 * max(len(rows), 1)))
    ax = fig.add_subplot()
    if not rows:
        ax.text(0.5, 0.5, "no collectives in either run", ha="center", va="center",
                transform=ax.transAxes, color="gray")
    y = list(range(len(rows)))[::-1]
    b_colours = [COLOURS.get(r.change, B_COLOUR) for r in rows]
    for side, at, colours in (("a", 0.2, [A_COLOUR] * len(rows)), ("b", -0.2, b_colours)):
        sides = [getattr(r, side) for r in rows]
        comm = [s.comm_ns / 1e6 if s else 0 for s in sides]
        wait = [s.wait_ns / 1e6 if s else 0 for s in sides]
        ax.barh([v + at for v in y], comm, height=0.4, color=colours)
        ax.barh([v + at for v in y], wait, left=comm, height=0.4, color=colours, alpha=0.55,
                hatch="//", edgecolor="white", linewidth=0)
    a_ms = [(r.a.time_ns if r.a else 0) / 1e6 for r in rows]
    b_ms = [(r.b.time_ns if r.b else 0) / 1e6 for r in rows]
    for v, r, b in zip(y, rows, b_ms):
        if r.change in (Change.REGRESSION, Change.IMPROVEMENT, Change.ONLY_A, Change.ONLY_B):
            ax.text(b, v - 0.2, f" {why(r)}", va="center", fontsize=7,
                    color=COLOURS.get(r.change, "black"))
    ax.set_yticks(y, [_short(r.key) for r in rows], fontsize=8)
    ax.set_xlabel("comm + wait per rank, median step (ms)")
    ax.set_title(f"B against A per {d.by}: regressions red, improvements green", fontsize=10)
    if rows:
        handles = [Patch(color=A_COLOUR, label="A"), Patch(color=B_COLOUR, label="B"),
                   Patch(color=COLOURS[Change.REGRESSION], label="B, regression"),
                   Patch(color=COLOURS[Change.IMPROVEMENT], label="B, improvement"),
                   Patch(facecolor=B_COLOUR, alpha=0.55, hatch="//", edgecolor="white",
                         label="hatched: waiting")]
        ax.legend(handles=handles, fontsize=7, loc="lower right")
        ax.set_xlim(0, max(a_ms + b_ms) * 1.45 or 1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def _short(key: str, width: int = 48) -> str:
    return key if len(key) <= width else "…" + key[-(width - 1):]


# -- the command -------------------------------------------------------------------------------

def register(p: argparse.ArgumentParser) -> None:
    p.description = ("What changed between two runs, from their comm tables: per origin (or "
                     "unit, process group, op), A beside B per rank and profiler step: calls, "
                     "comm time, wait time, bus bandwidth, arrival skew, late ranks. "
                     "Regressions first, worst first, each split into more transfer time and "
                     "more waiting (for which late rank); then improvements and what one run "
                     "alone has. Groups match by description or rank pattern, not torch's "
                     "numbering; the noise rule used is printed.")
    p.add_argument("run_a", metavar="RUN_A", help="the run compared against (before)")
    p.add_argument("run_b", metavar="RUN_B", help="the run compared (after)")
    p.add_argument("--by", choices=BY, default=ORIGIN,
                   help="compare per origin (default), unit (FSDP module, DDP bucket, pipeline "
                        "stage), process group or op")
    p.add_argument("--format", choices=FORMATS, default="table",
                   help="table (terminal), markdown or json (default: table)")
    p.add_argument("-o", "--out", metavar="FILE", default=None,
                   help="write the report there (the picture beside it, FILE's name .png) "
                        "instead of printing it")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help=f"the picture (default: beside -o, else RUN_B/plots/{PLOT_NAME})")
    p.add_argument("--no-plot", action="store_true", help="draw no picture")
    rule = NoiseRule()
    p.add_argument("--noise-se", type=float, default=rule.se,
                   help=f"standard errors of the step-to-step spread a change must exceed "
                        f"(default {rule.se:g})")
    p.add_argument("--noise-rel", type=float, default=rule.rel,
                   help=f"share of A's time a change must exceed (default {rule.rel:g})")
    p.add_argument("--noise-ms", type=float, default=rule.min_ns / 1e6,
                   help=f"least change per rank and step, in ms (default {rule.min_ns / 1e6:g})")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    rule = NoiseRule(se=args.noise_se, rel=args.noise_rel, min_ns=round(args.noise_ms * 1e6))
    d = diff_runs(args.run_a, args.run_b, by=args.by, rule=rule)
    out = Path(args.out) if args.out is not None else None
    plot = None
    if not args.no_plot:
        plot = Path(args.plot) if args.plot is not None else (
            out.with_suffix(".png") if out is not None else Path(args.run_b) / "plots" / PLOT_NAME)
        plot_diff(d, plot)
    text = render(d, args.format, plot, out.parent if out is not None else None)
    if out is None:
        sys.stdout.write(text)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    written = [str(p) for p in (out, plot) if p is not None]
    if written:
        print(f"commviz diff: wrote {', '.join(written)}", file=sys.stderr)
    return 0
