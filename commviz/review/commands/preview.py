"""``commviz preview MERGED.pftrace -o timeline.png``: draw a merged trace as one picture
(``review.render.timeline``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from commviz.errors import SourceError
from commviz.merge.select import format_ranks, parse_ranks
from commviz.review.render.timeline import MAX_RANKS, TIMELINE_PNG, write_preview


def run(args: argparse.Namespace) -> int:
    trace = Path(args.trace)
    if not trace.is_file():
        raise SourceError(str(trace), "no such file")
    out = Path(args.out) if args.out else trace.with_name(TIMELINE_PNG)
    result = write_preview(trace, out, window=args.window,
                           ranks=parse_ranks(args.ranks) if args.ranks else None)
    t0, t1 = result.window_ms
    print(f"commviz preview: wrote {result.out}: ranks {format_ranks(result.ranks)}"
          + (f" ({result.hidden_ranks} more: --ranks)" if result.hidden_ranks else "")
          + f", {result.what}, {t0:.3f}:{t1:.3f} ms; {result.collectives} collectives, "
          f"{result.flows} cross-rank links, {result.compute} compute slices", file=sys.stderr)
    return 0


def register(p: argparse.ArgumentParser) -> None:
    p.description = ("Draw a merged trace as a PNG timeline: the ranks one under another, a "
                     "comm lane per process group with its collectives coloured by op, a "
                     "lighter compute lane, and lines joining each collective across ranks. "
                     "Default: the first profiler step holding a collective, the first "
                     f"{MAX_RANKS} ranks.")
    p.add_argument("trace", metavar="MERGED.pftrace", help="a trace `commviz merge` wrote")
    p.add_argument("-o", "--out", metavar="PNG", default=None,
                   help=f"image to write (default: {TIMELINE_PNG} beside the trace)")
    p.add_argument("--window", metavar="T0:T1", default=None,
                   help="milliseconds since the trace's first collective, e.g. 0:25.5 (the "
                        "origin of `commviz merge --window`)")
    p.add_argument("--ranks", metavar="0-3,8", default=None, help="ranks to draw")
    p.set_defaults(func=run)
