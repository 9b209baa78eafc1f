"""The ``commviz verify`` command: the report as tables, exit 1 on problems, 2 on unreadable
input, and never a traceback (an input that breaks the checker itself is named, not raised)."""

from __future__ import annotations

import argparse
from pathlib import Path

from commviz.errors import CommvizError, SourceError
from commviz.verify import verify_pftrace
from commviz.verify.structure import VerifyReport


def _print(report: VerifyReport, *, max_errors: int, lanes: bool) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    con = Console()
    totals = ", ".join(f"{k} {v:,}" for k, v in report.counts.items())
    con.print(f"[bold]{report.path}[/bold]: {totals}")
    rank_of = {label: rank for rank, label in report.ranks.items()}
    table = Table(title="slices per process", show_lines=False)
    for col in ("process", "rank", "tracks", "slices"):
        table.add_column(col, justify="right" if col != "process" else "left")
    if report.inputs:
        for col in ("input matched", "missing", "bad args", "launch flows"):
            table.add_column(col, justify="right")
    for proc, n in sorted(report.per_process.items(),
                          key=lambda kv: (rank_of.get(kv[0], 1 << 30), kv[0])):
        rank = rank_of.get(proc)
        row = [proc, "" if rank is None else str(rank), str(len(report.per_lane.get(proc, {}))),
               f"{n:,}"]
        if report.inputs:
            st = report.inputs.get(rank, {}) if rank is not None else {}
            row += [f"{st.get('matched', 0):,}", f"{st.get('missing', 0):,}",
                    f"{st.get('bad_args', 0):,}", f"{st.get('launch_flows', 0):,}"]
        table.add_row(*row)
    con.print(table)
    if lanes:
        lt = Table(title="slices per track")
        for col in ("process", "track", "slices"):
            lt.add_column(col, justify="right" if col == "slices" else "left")
        for proc in sorted(report.per_lane, key=lambda p: (rank_of.get(p, 1 << 30), p)):
            for lane, n in sorted(report.per_lane[proc].items()):
                lt.add_row(proc, lane, f"{n:,}")
        con.print(lt)
    for rank, off in sorted(report.clock_offsets.items()):
        con.print(f"rank {rank}: output is {off:+,} ns from its input trace (clock alignment)")
    for w in report.warnings[:max_errors]:
        con.print(f"[yellow]warning[/yellow] {escape(str(w))}", highlight=False)
    if report.ok:
        con.print("[green]OK[/green]: no problems found")
        return
    shown = 0
    for p in report.errors:
        if shown >= max_errors:
            break
        con.print(f"[red]error[/red] {escape(str(p))}", highlight=False)
        shown += 1
    kinds = ", ".join(f"{k} {n:,}" for k, n in report.error_counts.most_common())
    con.print(f"[red]FAILED[/red]: {sum(report.error_counts.values()):,} problem(s): {kinds}")


def run(args: argparse.Namespace) -> int:
    inputs = None
    if args.run is not None:
        from commviz.trace.run import load_run

        inputs = load_run(args.run)
    try:
        report = verify_pftrace(args.trace, inputs=inputs)
    except (CommvizError, OSError):
        raise                                   # the CLI prints these in one line
    except Exception as exc:                    # an input the checker did not foresee
        raise SourceError(str(args.trace), f"cannot be checked: {type(exc).__name__}: {exc} "
                          "(a commviz bug: please report it with this file)") from None
    _print(report, max_errors=args.max_errors,
           lanes=args.lanes or len(report.per_process) <= 8)
    return 0 if report.ok else 1


def register(p: argparse.ArgumentParser) -> None:
    p.description = ("Parse a Perfetto trace back and check it: every slice ends on its own "
                     "track, nesting is valid, tracks are declared, interning resolves, flows "
                     "link two or more slices; with --run, every input slice is there exactly "
                     "once with its args and launch flow. Exits 1 when it finds problems.")
    p.add_argument("trace", type=Path, help="the .pftrace to check")
    p.add_argument("--run", type=Path, metavar="RUN_DIR",
                   help="the run dir it was merged from: also compare with its traces")
    p.add_argument("--max-errors", type=int, default=30, help="problems to print in full")
    p.add_argument("--lanes", action="store_true", help="print slices per track for every "
                   "process (the default for up to 8 processes)")
    p.set_defaults(func=run)
