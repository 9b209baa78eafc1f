"""``commviz merge RUN_DIR [-o OUT] [--format pftrace|json] [--per-rank] [--strict] [--workers N]
[--ranks 0-7,512] [--steps 3-4 | --window T0:T1]``."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from commviz.merge.core import FORMATS, merge_run
from commviz.merge.keep import keep_of
from commviz.merge.select import parse_ranks
from commviz.trace.run import skipped_note


def register(p: argparse.ArgumentParser) -> None:
    p.description = ("Merge a run dir (or a directory of profiler traces) into one multi-rank "
                     "trace: one process per rank with its CPU threads, GPU streams and one "
                     "comm lane per process group, linked across ranks.")
    p.add_argument("run_dir", help="run dir with commviz_rank*.pkl and trace_rank*.json[.gz], "
                                   "or a plain directory of profiler traces")
    p.add_argument("-o", "--out", help="output file (default RUN_DIR/merged.pftrace or "
                                       "RUN_DIR/merged.json)")
    p.add_argument("--format", choices=FORMATS, default="pftrace",
                   help="pftrace: native Perfetto; json: one Chrome JSON trace")
    p.add_argument("--per-rank", action="store_true",
                   help="with --format json: one trace_rank{R}.json per rank on the merged clock, "
                        "in the directory OUT (default RUN_DIR/merged_ranks); HTA reads these")
    p.add_argument("--strict", action="store_true",
                   help="any problem with the inputs is an error, and nothing is written")
    p.add_argument("--ranks", default=None, metavar="0-7,512",
                   help="merge only these ranks (detail on demand, after `commviz overview`); "
                        "default output RUN_DIR/merged_ranks0-7,512.pftrace; cross-rank flows "
                        "only between selected ranks")
    p.add_argument("--steps", default=None, metavar="3-4",
                   help="keep only these profiler steps: each rank's ProfilerStep#N ranges in its "
                        "own traces (events starting inside; flows only where both ends are "
                        "kept); default output RUN_DIR/merged[_ranksSEL]_steps3-4.pftrace")
    p.add_argument("--window", default=None, metavar="T0:T1",
                   help="keep only events starting in this time window: milliseconds after "
                        "the run's first collective on the merged clock (time 0 of "
                        "`commviz overview`'s trace in the Perfetto UI), e.g. 120:180.5")
    p.add_argument("--workers", type=int, default=None,
                   help="worker processes (default: one per CPU core, at most one per rank)")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    result = merge_run(args.run_dir, args.out, fmt=args.format, strict=args.strict,
                       workers=args.workers, progress=True, per_rank=args.per_rank,
                       ranks=parse_ranks(args.ranks) if args.ranks is not None else None,
                       keep=keep_of(args.steps, args.window))
    for problem in result.problems:
        print(f"commviz merge: problem: {problem}", file=sys.stderr)
    note = skipped_note(result.skipped)
    if note:
        print(f"commviz merge: {note}", file=sys.stderr)
    s = result.stats
    lanes = ", ".join(f"PG {pg}: {n}" for pg, n in sorted(s["lanes"].items()))
    print(f"merged {s['merged_ranks']} of {s['ranks']} ranks ({_events(s)}, "
          f"{s['comm_events']} collectives{'; ' + lanes if lanes else ''}) in {s['seconds']} s")
    print(f"clock: {s['clock']}")
    for key, what in (("unmatched", "left unlabelled (not certain)"),
                      ("no_metadata", "kernels with no collective metadata to match (no record "
                                      "and none from the profiler)")):
        counts = {r: st[key] for r, st in s["per_rank"].items() if st.get(key)}
        if counts:
            print(f"{what}: " + ", ".join(f"rank {r}: {n}" for r, n in sorted(counts.items())))
    if result.problems:
        print(f"{len(result.problems)} problem(s) listed above; the other inputs were merged")
    print(f"wrote {result.out} ({s['bytes']} bytes)")
    return 0


def _events(stats: dict[str, Any]) -> str:
    """How many profiler events were converted, and how many ranks came from their shards
    (whose events were converted on their own node, and are not counted again)."""
    reused, converted = stats["reused_shards"], stats["ranks"] - stats["reused_shards"]
    parts = [f"{stats['profiler_events']} profiler events"] if converted else []
    if reused:
        parts.append(f"{reused} rank(s) from their shards")
    return ", ".join(parts)
