"""Benchmark ``commviz merge`` against a straightforward writer and against JSON parsing alone.

Generates realistic per-rank profiler traces (``scripts/gen_traces.py``) and prints, from one
run, side by side:

(a) baseline: the per-event writer a tutorial would write: stdlib ``json`` load, one protobuf
    packet object per slice begin / end through perfetto's ``TraceProtoBuilder``, literal
    strings (no interning), overlapping slices split over backing tracks, ac2g launch flows;
(b) ``commviz merge`` (``commviz.merge.merge_run``, its ranks in ``--workers`` processes);
(c) parsing the same inputs with orjson and nothing else, one after the other;
(d) parsing the largest rank's input alone (the peak-RSS yardstick);

each measured ``--rounds`` times (default 3) in turn, a b c d, a b c d, ..., every row taken
from its round of median time, so a drift of the machine's speed between two programs does
not decide a target; each round's (b)/(a) is printed too;

then the four targets (issues 12 and 32), each with PASS or MISS: (b)/(a) events/s >= 10x;
(b)/(a) bytes per event <= 0.35x; (b) time <= 1.5x (c) time (issue 32; issue 12 asked 1.0x with
16 cores); the largest peak RSS of any one merge process (main or worker) <= 1.2x (d)'s. Then
the merge's peak RSS at 2, 8 and 32 ranks of one trace size, to show memory follows the largest
rank's trace, not the number of ranks. Every measured program runs in a child process of its
own, so peaks do not mix. Needs numpy, orjson and perfetto (commviz's merge needs nothing
else); Linux (/proc) for the RSS figures.

The merge is parallel over ranks and the baseline and the parse are serial: on 2 cores, parsing
alone with orjson is only about 5x the baseline on these inputs, so 10x there means converting a
rank in about the time orjson takes to parse it. Every row also gives its CPU seconds (user +
system, worker processes included): on a machine shared with other work the wall-clock ratios
move with the load, the CPU seconds much less. ``taskset -c 0,1 python scripts/bench_merge.py``
measures 2 cores of a bigger machine (cores and default workers follow the CPU affinity).

    python scripts/bench_merge.py                       # 8 ranks x 200k events, workers = cores
    python scripts/bench_merge.py --ranks 16 --events 500000 --baseline-ranks 4 --workers 16
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gen_traces  # noqa: E402

# --- (a) the baseline writer ------------------------------------------------------------------


def _uuid(*parts: Any) -> int:
    return int(hashlib.sha1(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)


def _lanes(slices: list[tuple[float, float, int]]) -> dict[int, int]:
    """Backing track per slice (ts, end, index) so that each one nests properly."""
    lane_of: dict[int, int] = {}
    stacks: list[list[float]] = []
    for ts, end, i in sorted(slices, key=lambda s: (s[0], -s[1], s[2])):
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= ts:
                stack.pop()
            if not stack or end <= stack[-1]:
                stack.append(end)
                lane_of[i] = lane
                break
        else:
            stacks.append([end])
            lane_of[i] = len(stacks) - 1
    return lane_of


def _annotate(te: Any, key: str, value: Any) -> None:
    a = te.debug_annotations.add()
    a.name = key
    if isinstance(value, bool):
        a.bool_value = value
    elif isinstance(value, int):
        a.int_value = value
    elif isinstance(value, float):
        a.double_value = value
    elif isinstance(value, str):
        a.string_value = value
    else:
        a.legacy_json_value = json.dumps(value)


def baseline_merge(paths: dict[int, Path], out: Path) -> int:
    """Write every rank's trace into one .pftrace, one packet object per event; returns the
    number of input events."""
    from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import TrackDescriptor, TrackEvent
    from perfetto.trace_builder.proto_builder import TraceProtoBuilder

    BY_KEY = TrackDescriptor.SIBLING_MERGE_BEHAVIOR_BY_SIBLING_MERGE_KEY
    builder = TraceProtoBuilder()
    n_events = 0
    markers: list[tuple[int, int, int, int, Any, int, Any]] = []
    for rank, path in sorted(paths.items()):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt") as f:
            doc = json.load(f)
        events = doc["traceEvents"]
        n_events += len(events)
        base = int(doc.get("baseTimeNanoseconds", 0))
        proc = _uuid("rank", rank)
        pkt = builder.add_packet()
        pkt.track_descriptor.uuid = proc
        pkt.track_descriptor.process.pid = rank + 1
        pkt.track_descriptor.process.process_name = f"rank {rank}"
        names: dict[tuple[Any, Any], str] = {}
        rows: dict[tuple[Any, Any], list[int]] = defaultdict(list)
        flow_ends: dict[int, list[tuple[Any, Any, float]]] = defaultdict(list)
        for i, e in enumerate(events):
            ph = e.get("ph")
            if ph == "X" and isinstance(e.get("pid"), int):
                rows[(e["pid"], e["tid"])].append(i)
            elif ph == "M" and e.get("name") == "thread_name":
                names[(e["pid"], e["tid"])] = e["args"]["name"]
            elif ph in ("s", "f") and e.get("cat") == "ac2g":
                flow_ends[e["id"]].append((e["pid"], e["tid"], e["ts"]))
        # a flow is attached to the slice on its row that starts at its timestamp
        flow_at = {(pid, tid, ts): (rank << 32) | fid
                   for fid, ends in flow_ends.items() if len(ends) == 2
                   for pid, tid, ts in ends}
        for (pid, tid), idxs in rows.items():
            lane_of = _lanes([(events[i]["ts"], events[i]["ts"] + events[i]["dur"], i)
                              for i in idxs])
            name = names.get((pid, tid), f"thread {tid}")
            n_lanes = max(lane_of.values()) + 1
            uuids = []
            for lane in range(n_lanes):
                uuid = _uuid(rank, pid, tid, lane)
                uuids.append(uuid)
                d = builder.add_packet().track_descriptor
                d.uuid = uuid
                d.parent_uuid = proc
                d.name = f"{pid} {name}"
                if n_lanes > 1:
                    d.sibling_merge_behavior = BY_KEY
                    d.sibling_merge_key = f"{rank}:{pid}:{tid}"
            for i in idxs:
                e = events[i]
                t0 = base + round(e["ts"] * 1000)
                t1 = base + round((e["ts"] + e["dur"]) * 1000)
                flow = flow_at.get((pid, tid, e["ts"]))
                uuid = uuids[lane_of[i]]
                if t1 == t0:
                    markers.append((t0, 1, 0, 0, uuid, TrackEvent.TYPE_INSTANT, (e, flow)))
                    continue
                # ENDs before BEGINs at one time; inner ENDs first, outer BEGINs first
                markers.append((t0, 1, -t1, i, uuid, TrackEvent.TYPE_SLICE_BEGIN, (e, flow)))
                markers.append((t1, 0, -t0, -i, uuid, TrackEvent.TYPE_SLICE_END, None))
    markers.sort(key=lambda m: m[:4])
    for ts, _o, _a, _b, uuid, kind, payload in markers:
        pkt = builder.add_packet()
        pkt.timestamp = ts
        pkt.trusted_packet_sequence_id = 1
        te = pkt.track_event
        te.type = kind
        te.track_uuid = uuid
        if payload is not None:
            e, flow = payload
            te.name = e["name"]
            if e.get("cat"):
                te.categories.append(e["cat"])
            if flow is not None:
                te.flow_ids.append(flow)
            for key, value in (e.get("args") or {}).items():
                _annotate(te, key, value)
    out.write_bytes(builder.serialize())
    return n_events


# --- (c), (d) parsing only ------------------------------------------------------------------

def parse_only(paths: dict[int, Path]) -> int:
    import orjson

    n = 0
    for path in paths.values():
        data = path.read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
        n += len(orjson.loads(data)["traceEvents"])
    return n


# --- measuring in child processes -------------------------------------------------------------

def _phases(stats: dict[str, Any]) -> dict[str, float]:
    """Where a merge's time went: each step of a rank's conversion, averaged over its ranks
    (``stats["per_rank"][R]["phases"]``), and the main process's own steps."""
    per_rank = [st.get("phases") or {} for st in (stats.get("per_rank") or {}).values()]
    steps: dict[str, float] = {}
    for phases in per_rank:
        for step, sec in phases.items():
            steps[f"rank {step}"] = steps.get(f"rank {step}", 0.0) + sec / len(per_rank)
    for step, sec in (stats.get("phases") or {}).items():
        steps[f"main {step}"] = sec
    return steps


def _hwm_mib(pid: int | str = "self") -> float:
    """Peak RSS of a live process (Linux VmHWM; 0 when it is gone). A forked child's VmHWM
    starts from what it shares with its parent at the fork, as the kernel counts it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)
    except OSError:
        return 0.0


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc/PID/task/TID/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tasks:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _inputs(run: Path) -> dict[int, Path]:
    """Each rank's trace: the one file of the run dir whose name says that rank, as ``commviz
    merge`` files it (``gen_traces``' names, or a real job's, ``--run``). Found here, in the
    parent: the measured children import nothing of commviz but the merge's."""
    from commviz.trace.load import rank_from_name

    found: dict[int, list[Path]] = defaultdict(list)
    for path in sorted(run.glob("trace_rank*.json*")):
        rank = rank_from_name(path)
        if rank is not None:
            found[rank].append(path)
    return {r: paths[0] for r, paths in sorted(found.items()) if len(paths) == 1}


def _copy_inputs(run_dir: Path, to: Path) -> None:
    """A run dir's inputs (traces, records, Flight Recorder dumps, ...) without what commviz
    made of them (``OWN_OUTPUT_PREFIXES``: merged traces, shards, matched runs), so the merge
    measured starts from the job's own outputs, as the first one after a job does."""
    from commviz.trace.run import OWN_OUTPUT_PREFIXES

    if to.exists():
        shutil.rmtree(to)
    shutil.copytree(run_dir, to, ignore=lambda d, names: [
        n for n in names if Path(d) == run_dir and n.startswith(OWN_OUTPUT_PREFIXES)])


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its reaped children (the merge's workers:
    the pool joins them before ``merge_run`` returns)."""
    usage = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    return sum(u.ru_utime + u.ru_stime for u in usage)


def _cores() -> int:
    """The cores this process may run on (``taskset`` narrows them), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _physical_cores() -> str:
    """Which of the CPUs this process may run on share a physical core: two SMT siblings give
    two workers about one core's throughput, while the serial baseline runs at full speed."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
        sib = {c: Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list")
               .read_text().strip() for c in cpus}
    except (AttributeError, OSError):
        return "physical cores unknown"
    shared = sorted({s for s in sib.values() if sum(v == s for v in sib.values()) > 1})
    cores = len(set(sib.values()))
    return (f"CPUs {','.join(map(str, cpus))} on {cores} physical core(s)"
            + (f"; SMT siblings: {' '.join(shared)}" if shared else ""))


def _child(kind: str, run_dir: str, out: str, workers: str, traces: str) -> None:
    """Run one measured program; print its figures as JSON (the parent reads the last line)."""
    run = Path(run_dir)
    paths = {int(r): Path(p) for r, p in json.loads(traces).items()}
    result: dict[str, Any] = {}
    if kind == "merge":
        from commviz.merge import merge_run    # imported before the clock starts
    elif kind == "largest":
        rank = max(paths, key=lambda r: paths[r].stat().st_size)
        paths = {rank: paths[rank]}
    cpu = _cpu_seconds()
    t = time.perf_counter()
    if kind == "baseline":
        result["events"] = baseline_merge(paths, Path(out))
    elif kind in ("parse", "largest"):
        result["events"] = parse_only(paths)
    else:
        res = merge_run(run, Path(out), progress=False, workers=int(workers))
        result["stats"] = {k: v for k, v in (res.stats or {}).items()
                           if isinstance(v, (int, float))}
        result["phases"] = _phases(res.stats or {})
        result["problems"] = len(res.problems)
    result["seconds"] = time.perf_counter() - t
    result["cpu_seconds"] = _cpu_seconds() - cpu
    result["bytes"] = Path(out).stat().st_size if kind in ("baseline", "merge") else 0
    result["rss_self_mib"] = _hwm_mib()
    print(json.dumps(result))


def measure(kind: str, run_dir: Path, out: Path, traces: dict[int, Path], workers: int = 1
            ) -> dict[str, Any]:
    """Run ``kind`` in a child process (``traces``: the ranks' traces the baseline and the
    parses read; the merge reads the run dir); add, sampled every 20 ms, the peak RSS summed
    over its process tree and the largest peak (VmHWM) of any one of its worker processes."""
    out.unlink(missing_ok=True)     # each round writes a new file: replacing the last round's
    # would add freeing its pages (about 10 ms for 18 MB) to the round's time
    cmd = [sys.executable, __file__, "_child", kind, str(run_dir), str(out), str(workers),
           json.dumps({r: str(path) for r, path in traces.items()})]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0.0, 0.0]                           # tree total, largest worker (MiB)

    def sample() -> None:
        while proc.poll() is None:
            kids = _descendants(proc.pid)
            for k in kids:
                peak[1] = max(peak[1], _hwm_mib(k))
            peak[0] = max(peak[0], _rss_mib(proc.pid) + sum(_rss_mib(k) for k in kids))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    sampler.join()
    if proc.returncode != 0:
        tail = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit {proc.returncode}"
        return {"error": tail}
    result = json.loads(stdout.strip().splitlines()[-1])
    result["rss_tree_mib"], result["rss_worker_mib"] = peak
    result["rss_process_mib"] = max(result["rss_self_mib"], peak[1])
    return result


# --- report -----------------------------------------------------------------------------------

def _fmt_row(label: str, r: dict[str, Any]) -> str:
    if "error" in r:
        return f"{label:<36} FAILED: {r['error']}"
    ev, sec = r["events"], r["seconds"]
    size = (f"{r['bytes'] / 1e6:10.1f} {r['bytes'] / ev:9.1f}" if r.get("bytes")
            else f"{'-':>10} {'-':>9}")
    return (f"{label:<36} {ev:>10,} {sec:8.2f} {r['cpu_seconds']:8.2f} {ev / sec:>11,.0f} {size} "
            f"{r['rss_process_mib']:12.0f}")


def _median(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The result of median seconds (the upper one of an even count); a failed one if any
    failed."""
    failed = [r for r in results if "error" in r]
    if failed:
        return failed[0]
    return sorted(results, key=lambda r: r["seconds"])[len(results) // 2]


def _round_ratio(res: list[dict[str, Any]]) -> str:
    """One round's (b)/(a) events per second, as the targets compute it."""
    a, b = res[0], res[1]
    if "error" in a or "error" in b:
        return ""
    return f"; (b)/(a) {(b['events'] / b['seconds']) / (a['events'] / a['seconds']):.2f}x"


def _target(name: str, value: float | None, op: str, limit: float) -> tuple[str, bool]:
    """One target line (PASS/MISS) and whether it passed."""
    if value is None:
        return f"  {name:<52} n/a      (target {op} {limit:g}x)  MISS", False
    ok = value >= limit if op == ">=" else value <= limit
    return f"  {name:<52} {value:6.2f}x  (target {op} {limit:g}x)  {'PASS' if ok else 'MISS'}", ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--events", type=int, default=200_000, help="trace events per rank")
    ap.add_argument("--baseline-ranks", type=int, default=2,
                    help="ranks the baseline converts (it holds the whole trace in memory: about "
                         "1.3 KB per packet); its events/s and bytes/event are compared")
    ap.add_argument("--workers", type=int, default=_cores(),
                    help="merge worker processes (default: the cores this process may use)")
    ap.add_argument("--rss-scan", default="2,8,32",
                    help="rank counts for the peak-RSS scan ('' to skip)")
    ap.add_argument("--rss-events", type=int, default=20_000, help="events per rank in the scan")
    ap.add_argument("--no-gzip", action="store_true", help="plain .json inputs")
    ap.add_argument("--keep", type=Path, help="generate into (and keep) this directory")
    ap.add_argument("--verify", action="store_true", help="commviz verify the merged trace")
    ap.add_argument("--into-run-dir", action="store_true",
                    help="write the merged trace into the run dir, as `commviz merge RUN_DIR` "
                         "does by default: each rank's matched run is then saved beside its "
                         "inputs for the report (default: beside the run dir, where it is not)")
    ap.add_argument("--run", type=Path,
                    help="measure a real job's run dir (a copy of its traces, records and "
                         "other inputs, without commviz's outputs) instead of generated traces; "
                         "--ranks, --events, --no-gzip and the RSS scan's inputs do not apply")
    ap.add_argument("--rounds", type=int, default=3,
                    help="measure (a) to (d) this many times, interleaved; each row and target "
                         "takes the round of median time (a VM's speed drifts by several "
                         "percent within minutes, and one round can fall either side)")
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be at least 1")
    if a.run is not None and not a.run.is_dir():
        ap.error(f"--run {a.run}: not a directory")

    work = Path(a.keep) if a.keep else Path(tempfile.mkdtemp(prefix="commviz-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    ok = True
    try:
        run = work / "run"
        if a.run is not None:            # a real job's run dir: its traces as they are
            _copy_inputs(a.run, run)
            traces = _inputs(run)
            if not traces or sorted(traces) != list(range(len(traces))):
                ap.error(f"--run {a.run}: no profiler traces of ranks 0..N-1 there "
                         f"(found ranks {sorted(traces)})")
            a.ranks = len(traces)
            counts = {r: parse_only({r: path}) for r, path in traces.items()}
            print(f"inputs: {a.run}, {a.ranks} ranks, {sum(counts.values()):,} events, "
                  f"{sum(p.stat().st_size for p in traces.values()) / 1e6:.1f} MB of traces "
                  f"on disk, with the run's records beside them")
        else:
            if run.exists():
                shutil.rmtree(run)
            t = time.perf_counter()
            counts = gen_traces.write_run(run, a.ranks, a.events, compress=not a.no_gzip)
            traces = _inputs(run)
            in_bytes = sum(p.stat().st_size for p in run.iterdir())
            print(f"inputs: {a.ranks} ranks, {sum(counts.values()):,} events, "
                  f"{in_bytes / 1e6:.1f} MB on disk ({'gzip' if not a.no_gzip else 'json'}), "
                  f"generated in {time.perf_counter() - t:.1f}s")
        print(f"machine: {_cores()} cores ({_physical_cores()}), merge workers {a.workers}, "
              f"load average {os.getloadavg()[0]:.1f} (other work slows every row alike)")
        base_ranks = min(a.baseline_ranks, a.ranks)
        merged = (run if a.into_run_dir else work) / "merged.pftrace"
        rounds: list[list[dict[str, Any]]] = []
        for k in range(a.rounds):        # (a) (b) (c) (d), again: each sees the machine alike
            res = [measure("baseline", run, work / "baseline.pftrace",
                           {r: traces[r] for r in range(base_ranks)}),
                   measure("merge", run, merged, traces, workers=a.workers),
                   measure("parse", run, work / "unused", traces),
                   measure("largest", run, work / "unused", traces)]
            if "error" not in res[1]:
                res[1]["events"] = sum(counts.values())
            rounds.append(res)
            if a.rounds > 1:
                print(f"round {k + 1}: " + ", ".join(
                    f"({x}) {r['seconds']:.2f}s" if "error" not in r else f"({x}) FAILED"
                    for x, r in zip("abcd", res)) + _round_ratio(res))
        res_a, res_b, res_c, res_d = (_median([res[i] for res in rounds]) for i in range(4))

        if a.rounds > 1:
            print(f"\neach row: its round of median time, of {a.rounds} rounds")
        print(f"\n{'':<36} {'events':>10} {'seconds':>8} {'cpu s':>8} {'events/s':>11} {'MB':>10} "
              f"{'B/event':>9} {'peak MiB/pr':>12}")
        print(_fmt_row(f"(a) baseline, {base_ranks} of {a.ranks} ranks", res_a))
        print(_fmt_row(f"(b) commviz merge, {a.ranks} ranks", res_b))
        print(_fmt_row(f"(c) orjson parse only, {a.ranks} ranks", res_c))
        print(_fmt_row("(d) orjson parse, largest rank alone", res_d))
        if "error" not in res_b:
            print(f"    (b) peak RSS: main {res_b['rss_self_mib']:.0f} MiB, largest worker "
                  f"{res_b['rss_worker_mib']:.0f} MiB, all processes at once "
                  f"{res_b['rss_tree_mib']:.0f} MiB")
        have = all("error" not in r for r in (res_a, res_b, res_c, res_d))
        speed = ((res_b["events"] / res_b["seconds"]) / (res_a["events"] / res_a["seconds"])
                 if have else None)
        size = ((res_b["bytes"] / res_b["events"]) / (res_a["bytes"] / res_a["events"])
                if have else None)
        vs_parse = res_b["seconds"] / res_c["seconds"] if have else None
        cpu_speed = ((res_a["cpu_seconds"] / res_a["events"])
                     / (res_b["cpu_seconds"] / res_b["events"]) if have else None)
        rss = res_b["rss_process_mib"] / res_d["rss_process_mib"] if have else None
        print(f"\ntargets (issues 12, 32), {_cores()} cores, {a.workers} merge workers")
        for line, passed in (
                _target("(b)/(a) events per second", speed, ">=", 10),
                _target("(b)/(a) bytes per event", size, "<=", 0.35),
                _target("(b) merge time / (c) parse time", vs_parse, "<=", 1.5),
                _target("(b) peak RSS per process / (d) parse of largest rank", rss, "<=", 1.2)):
            print(line)
            ok = ok and passed
        if have:
            print(f"  CPU seconds per event, (a)/(b): {cpu_speed:.2f}x; (b)/(c) CPU seconds: "
                  f"{res_b['cpu_seconds'] / res_c['cpu_seconds']:.2f}x (all processes; no target)")
        if have and "stats" in res_b:
            print(f"  merge stats: {res_b['stats']}; problems: {res_b['problems']}")
        if res_b.get("phases"):
            print("  where (b)'s time went, seconds (a rank's steps: the mean over its ranks; "
                  "main ranks: wall, from the start until every rank was converted; main cross: "
                  "the cross-rank piece and the copy): " + ", ".join(
                      f"{step} {sec:.2f}" for step, sec in res_b["phases"].items()))

        if a.verify and "error" not in res_b:
            from commviz.trace.run import load_run
            from commviz.verify import verify_pftrace

            t = time.perf_counter()
            rep = verify_pftrace(merged, inputs=load_run(run))
            totals: dict[str, int] = {}
            for st in rep.inputs.values():
                for k, n in st.items():
                    totals[k] = totals.get(k, 0) + n
            print(f"\nverify: {'OK' if rep.ok else 'FAILED'} in {time.perf_counter() - t:.1f}s; "
                  f"input events {totals}; {rep.counts}")
            for p in rep.errors[:10]:
                print(f"  {p}")
            ok = ok and rep.ok

        scan = [int(x) for x in a.rss_scan.split(",") if x.strip()]
        if scan:
            print(f"\npeak RSS of commviz merge, {a.rss_events:,} events per rank, "
                  f"{a.workers} workers (child process per measurement)")
            print(f"{'ranks':>6} {'largest input MB':>17} {'seconds':>8} {'main MiB':>9} "
                  f"{'worker MiB':>11} {'tree MiB':>9}   (worker: largest one; tree: all at once)")
            for n in scan:
                scan_run = work / f"scan{n}"
                gen_traces.write_run(scan_run, n, a.rss_events, compress=not a.no_gzip)
                largest = max(p.stat().st_size for p in scan_run.iterdir())
                r = measure("merge", scan_run, scan_run / "merged.pftrace", _inputs(scan_run),
                            workers=a.workers)
                if "error" in r:
                    print(f"{n:>6} FAILED: {r['error']}")
                    ok = False
                    break
                print(f"{n:>6} {largest / 1e6:>17.1f} {r['seconds']:>8.2f} "
                      f"{r['rss_self_mib']:>9.0f} {r['rss_worker_mib']:>11.0f} "
                      f"{r['rss_tree_mib']:>9.0f}")
                shutil.rmtree(scan_run)
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        _child(*sys.argv[2:7])
        sys.exit(0)
    sys.exit(main())
