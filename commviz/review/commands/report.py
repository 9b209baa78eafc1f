"""``commviz report RUN_DIR``: print the review and write it (and its plots) into the run dir.

Exit status: 0 when the report was written; 1 with ``--fail-on-desync`` when a process group's
ranks ran different collective sequences; 2 when the run cannot be read (the CLI prints the
error naming the file).
"""

from __future__ import annotations

import argparse
import sys

from commviz.merge import instances
from commviz.review.analyses.origins import BY
from commviz.review.front import Run
from commviz.review.render.report_formats import FORMATS, TOP


def run(args: argparse.Namespace) -> int:
    result = Run(args.run_dir).write_report(
        fmt=args.format, plots_dir=args.plots, out=args.out, plots=not args.no_plots,
        top=args.top, by=args.by, straggler_min_ns=int(args.straggler_ms * 1e6))
    if args.out is None:                       # with -o the file is the output
        sys.stdout.write(result.text)
    written = [str(result.out), *(str(p) for p in result.plots)]
    print(f"commviz report: wrote {', '.join(written)}", file=sys.stderr)
    if args.fail_on_desync and result.review.desyncs:
        for d in result.review.desyncs:
            print(f"commviz report: desync: {d.message}", file=sys.stderr)
        return 1
    return 0


def register(p: argparse.ArgumentParser) -> None:
    p.description = ("Review a run dir: per collective instance the arrival skew, late rank, "
                     "waits and bandwidth (nccl-tests formulas); per group and rank the "
                     "totals and stragglers; desyncs; GPU streams and comm/compute overlap.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run dir with commviz records and/or traces")
    p.add_argument("--format", choices=FORMATS, default="table",
                   help="table (terminal), markdown or json (default: table)")
    p.add_argument("--plots", metavar="DIR", default=None,
                   help="where the PNG plots go (default: RUN_DIR/plots)")
    p.add_argument("--no-plots", action="store_true", help="draw no plots")
    p.add_argument("-o", "--out", metavar="FILE", default=None,
                   help="report file (default: RUN_DIR/report.txt, .md or .json by format)")
    p.add_argument("--top", type=int, default=TOP, help=f"rows per table (default {TOP})")
    p.add_argument("--straggler-ms", type=float, default=instances.STRAGGLER_MIN_NS / 1e6,
                   help="smallest arrival skew that names a straggler, in ms (default "
                        f"{instances.STRAGGLER_MIN_NS / 1e6:g}; it must also be "
                        f"{instances.STRAGGLER_FACTOR:g}x the group's median skew)")
    p.add_argument("--by", choices=BY, default=None,
                   help="also roll comm time and wait time up per origin (the code or framework "
                        "unit each collective comes from) or per unit (FSDP module, DDP bucket, "
                        "pipeline stage)")
    p.add_argument("--fail-on-desync", action="store_true",
                   help="exit with status 1 when a desync is found")
    p.set_defaults(func=run)
