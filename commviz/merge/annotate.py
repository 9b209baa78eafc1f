"""``commviz annotate TRACE [RECORD] -o OUT``: one rank's trace, written back with the metadata.

The matcher alone, without a run dir: every collective kernel (or gloo range) the record can be
matched with gains commviz's keys, and the count of matched and unmatched kernels, with the
reasons, is printed. JSON output is the profiler's trace with only ``args`` added to; pftrace
output goes through the merger as a run of one rank (so this command lives after the merge).
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

from commviz.match import RankMatch, Source, match_rank
from commviz.record import schema
from commviz.record.store import dump_record, load_record, write_atomic
from commviz.trace.load import Trace, load_trace
from commviz.write.chrome import trace_bytes

FORMATS = ("json", "pftrace")


def register(p: argparse.ArgumentParser) -> None:
    p.description = ("Match one rank's profiler trace with its commviz record and write the "
                     "trace back with the metadata attached to each collective kernel (eager "
                     "and graphed) or gloo range. Prints matched and unmatched counts and why.")
    p.add_argument("trace", metavar="TRACE", help="the rank's profiler trace (.json or .json.gz)")
    p.add_argument("record", metavar="RECORD", nargs="?", default=None,
                   help="the rank's commviz record (commviz_rank{R}.pkl); without it only the "
                        "profiler's own metadata is used")
    p.add_argument("-o", "--out", metavar="OUT", required=True,
                   help="where the annotated trace goes (.json, .json.gz or .pftrace)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="json (Chrome/profiler JSON) or pftrace (Perfetto); default: by OUT's "
                        "suffix")
    p.set_defaults(func=handler)


def handler(args: argparse.Namespace) -> int:
    out = Path(args.out)
    fmt = args.format or ("pftrace" if out.suffix == ".pftrace" else "json")
    record = load_record(args.record) if args.record is not None else None
    rank = int(record["rank"]) if record is not None else None
    trace = load_trace(args.trace, rank=rank)
    result = match_rank(trace, record, rank=trace.rank)
    if fmt == "json":
        write_json(trace, result, out)
    else:
        write_pftrace(Path(args.trace), record, trace.rank, out)
    summarize(result, out, sys.stdout)
    return 0


def annotated_events(trace: Trace, result: RankMatch) -> list[dict]:
    """The trace's events, with each labelled event copied and its args extended."""
    events = list(trace.events)
    for labels in (result.kernel_args, result.marks):
        for index, add in labels.items():
            ev = dict(events[index])
            ev["args"] = {**(ev.get("args") or {}), **add}
            events[index] = ev
    return events


def write_json(trace: Trace, result: RankMatch, out: Path) -> None:
    """The profiler's JSON with the labels added: same events, same order, same top-level keys."""
    doc: dict[str, Any] = dict(trace.meta)
    if trace.distributed_info is not None:
        doc["distributedInfo"] = trace.distributed_info
    doc["deviceProperties"] = trace.device_properties
    doc["baseTimeNanoseconds"] = trace.base_ns
    data = trace_bytes(doc, annotated_events(trace, result))   # "rank": N spaced, for HTA
    write_atomic(out, gzip.compress(data, compresslevel=6) if out.name.endswith(".gz") else data)


def write_pftrace(trace_path: Path, record: dict | None, rank: int, out: Path) -> None:
    """A Perfetto trace of this one rank, made by the merger from a run dir holding the trace
    (linked) and a copy of the record that lists only that trace."""
    from commviz.merge.core import merge_run

    with tempfile.TemporaryDirectory(prefix="commviz-annotate-") as tmp:
        name = f"trace_rank{rank}" + (".json.gz" if trace_path.name.endswith(".gz") else ".json")
        os.symlink(trace_path.resolve(), Path(tmp) / name)
        if record is not None:
            dump_record(Path(tmp) / schema.record_name(rank), dict(record, traces=[name]))
        # not strict: a run of one rank always misses the others, which is no error here
        merged = merge_run(tmp, out=out, fmt="pftrace", progress=False)
    for problem in merged.problems:
        print(f"commviz annotate: note: {problem}", file=sys.stderr)


def summarize(result: RankMatch, out: Path, stream: TextIO) -> None:
    """What was matched, what was not and why, in a few lines a person reads."""
    s = result.stats
    print(f"rank {result.rank}: {s.get('eager_kernels', 0)} eager and "
          f"{s.get('graphed_kernels', 0)} graphed NCCL kernels, {len(result.events)} "
          f"collectives -> {out}", file=stream)
    labelled = sum(1 for ev in result.events if ev.source is Source.KERNEL)
    kernels = s.get("eager_kernels", 0) + s.get("graphed_kernels", 0)
    missed = sum(1 for u in result.unmatched if u.what.startswith(("kernel ", "graphed kernel ")))
    print(f"  kernels: {kernels - missed} matched, {missed} unmatched "
          f"({labelled} collectives on a kernel)", file=stream)
    by_source = Counter(ev.source for ev in result.events)
    print("  collectives by source: " + (", ".join(f"{n} {src}" for src, n in
                                                  sorted(by_source.items())) or "none"),
          file=stream)
    example: dict[str, str] = {}
    for u in result.unmatched:
        example.setdefault(u.reason, u.what)
    for reason, n in Counter(u.reason for u in result.unmatched).most_common():
        print(f"  unmatched {n} (e.g. {example[reason]}): {reason}", file=stream)
    for c in result.conflicts:
        print(f"  conflict on event {c.index}: {c.key!r} profiler {c.profiler!r}, record "
              f"{c.record!r} (kept the profiler's)", file=stream)
