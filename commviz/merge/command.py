"""``commviz merge RUN_DIR [-o OUT] [--format pftrace|json] [--strict] [--workers N]``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from commviz.merge.core import FORMATS, merge_run


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "merge", help="merge every rank's profiler trace and record into one trace",
        description="Merge a run dir (or a directory of profiler traces) into one multi-rank "
                    "trace: one process per rank with its CPU threads, GPU streams and one "
                    "comm lane per process group, linked across ranks.")
    p.add_argument("run_dir", help="run dir with commviz_rank*.pkl and trace_rank*.json[.gz], "
                                   "or a plain directory of profiler traces")
    p.add_argument("-o", "--out", help="output file (default RUN_DIR/merged.pftrace or "
                                       "RUN_DIR/merged.json)")
    p.add_argument("--format", choices=FORMATS, default="pftrace",
                   help="pftrace: native Perfetto; json: one Chrome JSON trace")
    p.add_argument("--strict", action="store_true",
                   help="any problem with the inputs is an error, and nothing is written")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes (default: one per CPU core, at most one per rank)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    result = merge_run(args.run_dir, args.out, fmt=args.format, strict=args.strict,
                       workers=args.workers, progress=True)
    for problem in result.problems:
        print(f"commviz merge: problem: {problem}", file=sys.stderr)
    s = result.stats
    lanes = ", ".join(f"PG {pg}: {n}" for pg, n in sorted(s["lanes"].items()))
    print(f"merged {s['merged_ranks']} of {s['ranks']} ranks "
          f"({s['profiler_events']} profiler events, {s['comm_events']} collectives"
          f"{'; ' + lanes if lanes else ''}) in {s['seconds']} s")
    print(f"clock: {s['clock']}")
    unmatched = {r: st["unmatched"] for r, st in s["per_rank"].items() if st.get("unmatched")}
    if unmatched:
        print("left unlabelled (not certain): " + ", ".join(
            f"rank {r}: {n}" for r, n in sorted(unmatched.items())))
    if result.problems:
        print(f"{len(result.problems)} problem(s) listed above; the other inputs were merged")
    print(f"wrote {result.out} ({s['bytes']} bytes)")
    return 0
