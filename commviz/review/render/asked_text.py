"""``commviz status``'s account of whom it asked for stacks (``review.analyses.asked``): which
ranks gave theirs, which nodes' launches answered, and why the others did not where it can
tell; a launch's hang watch prints the same lines."""

from __future__ import annotations

import time
from pathlib import Path

from commviz.merge.select import format_ranks
from commviz.review.analyses.asked import Asked, Starting


def asked_text(asked: Asked, run_dir: Path) -> str:
    return "\n".join([f"commviz status: {run_dir}", *asked_lines(asked)]) + "\n"


def asked_lines(asked: Asked) -> list[str]:
    """Who was asked where, and which ranks or nodes did not answer."""
    lines = []
    if asked.here:
        lines.append(f"  stacks asked here of ranks {format_ranks(asked.here)}"
                     + _not_written(asked.here, asked.wrote_here))
    elif not any(s.here for s in asked.starting):
        lines.append("  no rank of it runs on this host")
    lines += [_starting_line(s) for s in asked.starting]
    for a in asked.answered:
        lines.append(f"  node {a['node']} ({a['host']}, ranks {format_ranks(a['ranks'])}): "
                     f"its launch asked ranks {format_ranks(a['signalled']) or 'none'}"
                     + _not_written(a["signalled"], set(a["written"])))
        gone = sorted(set(a["ranks"]) - set(a["signalled"]) - set(asked.here))
        if gone:
            lines.append(f"    ranks {format_ranks(gone)}: no process of theirs on "
                         f"{a['host']} (ended?)")
    for (node, host), ranks in sorted(asked.silent.items()):
        lines.append(f"  node {node} ({host}, ranks {format_ranks(ranks)}): no answer in "
                     f"{asked.wait_s:g} s: its launch is gone or stuck")
    for host, ranks in sorted(asked.unanswered.items()):
        lines.append(f"  ranks {format_ranks(ranks)} on {host}: no answer in "
                     f"{asked.wait_s:g} s: no commviz launch of this run dir runs there "
                     "(plain torchrun? a run dir not shared with this one?)")
    if asked.absent:
        lines.append(f"  ranks {format_ranks(asked.absent)}: no live stacks file in this run "
                     "dir (not started, or ended; or their node's run dir is not this one)")
    lines += [f"  problem: {p}" for p in asked.problems]
    return lines


def _starting_line(s: Starting) -> str:
    pids = f", pid(s) {', '.join(map(str, s.pids))}" if s.here and s.pids else ""
    since = "" if s.since_ns is None else (
        f" {max(0, time.time_ns() - s.since_ns) / 1e9:.0f} s ago (at "
        f"{time.strftime('%H:%M:%S', time.localtime(s.since_ns / 1e9))})")
    head = f"  ranks {format_ranks(s.ranks)} on {s.host}{pids}: started{since}"
    if s.gone:
        return head + "; their process is gone, and left no record"
    return head + (", not recording yet (no record or stacks file: importing torch, "
                   "joining the process group, or building commviz's c10d boundary kernel)")


def _not_written(asked: list[int], wrote: set[int]) -> str:
    missing = sorted(set(asked) - wrote)
    return f"; ranks {format_ranks(missing)} wrote no stacks in time" if missing else ""
