"""Against the inputs: every slice of every input trace is in the merged trace exactly once,
with its duration, its args and its flows (its launch flow above all).

Input traces are read with the merge's own loader (``commviz.trace.load``): an event whose time
the loader does not believe is left out of both. Pairs are found per thread, name and time,
after moving the rank by the clock offset the merge applied (found from the data, not trusted
from the merge).
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from typing import Any, BinaryIO

import numpy as np
import orjson

from commviz.errors import TraceError
from commviz.kernels import GPU_CATS, LAUNCH_CAT, LAUNCH_CATS
from commviz.trace.load import load_trace     # the merge's loader: the contract's reading
from commviz.trace.run import skipped_note
from commviz.verify.structure import TraceCheck
from commviz.write.read import Track, open_trace

# Tracks commviz derives from the inputs (comm lanes, per-PG summaries) may repeat an input
# slice's name and time; "exactly once" counts the other tracks only.
_DERIVED_RE = re.compile(r"^(PG |summary\b)", re.IGNORECASE)
# Slices of the profiler's own bookkeeping, not of the job.
_SKIPPED_CATS = frozenset({"Trace"})


def _json_equal(out: str, inp: Any) -> bool:
    try:
        return _same(orjson.loads(out), inp)
    except orjson.JSONDecodeError:
        return False


def _same(out: Any, inp: Any) -> bool:
    """Whether an arg read back from the trace carries the input's value.

    Debug annotations are typed: lists and dicts may come back as nested values or as
    legacy JSON strings, ints may come back as doubles where the writer chose to.
    """
    if type(out) is type(inp) and out == inp:
        return True
    if isinstance(inp, bool) or isinstance(out, bool):
        return out is inp or (isinstance(out, (int, float)) and isinstance(inp, (int, float))
                              and not isinstance(out, bool) and out == inp)
    if isinstance(inp, (int, float)) and isinstance(out, (int, float)):
        if isinstance(inp, float) and math.isnan(inp):
            return isinstance(out, float) and math.isnan(out)
        return out == inp or abs(out - inp) <= 1e-9 * max(1.0, abs(inp))
    if isinstance(inp, str):
        return out == inp
    if inp is None:
        return out is None or out in ("null", "None")
    if isinstance(out, str):
        return _json_equal(out, inp)
    if isinstance(inp, (list, tuple)) and isinstance(out, list):
        return len(out) == len(inp) and all(_same(o, i) for o, i in zip(out, inp))
    if isinstance(inp, dict) and isinstance(out, dict):
        return out.keys() == inp.keys() and all(_same(out[k], inp[k]) for k in inp)
    return False


def _input_slices(events: list[dict]) -> list[int]:
    """Indices of the input events that must reach the output: slices of real processes."""
    return [i for i, e in enumerate(events)
            if e.get("ph") == "X" and isinstance(e.get("pid"), int)
            and e.get("cat") not in _SKIPPED_CATS]


class InputCheck:
    """Every slice of every input trace appears exactly once, with its duration, args, flow."""

    def __init__(self, v: TraceCheck, run: Any) -> None:
        self.v = v
        self.run = run
        rank_of_proc = {label: rank for rank, label in v.report.ranks.items()}
        n_tracks = len(v.track_uuid)
        track_rank = np.full(n_tracks, -1, dtype=np.int64)
        derived = np.zeros(n_tracks, dtype=bool)
        for tr, uuid in enumerate(v.track_uuid):
            proc = v.process_of(uuid)
            if proc is not None:
                track_rank[tr] = rank_of_proc.get(v.track_name(proc), -1)
            derived[tr] = bool(_DERIVED_RE.match(v.track_name(uuid)))
        s_track = v.track[v.slice_idx]
        self.s_rank = track_rank[s_track]
        self.s_kept = ~derived[s_track]
        self.threads: dict[str, int] = {}      # "pid:tid" of an input thread -> id
        track_thread = np.array([self.thread_id(v.tracks.get(u)) for u in v.track_uuid] or [-1],
                                dtype=np.int64)
        self.s_thread = track_thread[s_track] if len(s_track) else np.zeros(0, np.int64)

    def thread_id(self, t: Track | None) -> int:
        """The input thread a track shows: commviz names it in the track's merge key
        ("track PID:TID"); a thread track names it in its descriptor. -1: not known."""
        if t is None:
            return -1
        if t.merge_key and t.merge_key.startswith("track "):
            key = t.merge_key[6:]
        elif t.thread is not None:
            key = f"{t.thread[0]}:{t.thread[1]}"
        else:
            return -1
        return self.threads.setdefault(key, len(self.threads))

    def check(self) -> None:
        v = self.v
        for problem in getattr(self.run, "problems", None) or ():
            v.problem("input", str(problem), warn=True)
        note = skipped_note(getattr(self.run, "skipped", None) or [])
        if note:
            v.problem("input", note, warn=True)
        with open_trace(v.path) as f:
            for rank in sorted(self.run.ranks):
                paths = self.run.ranks[rank].trace_paths
                if not paths:
                    continue
                sel = np.flatnonzero((self.s_rank == rank) & self.s_kept)
                if not len(sel):
                    v.problem("missing-rank", f"rank {rank} has input traces but the output has "
                              f"no process named 'rank {rank} ...'")
                    continue
                for path in paths:
                    try:
                        trace = load_trace(path, rank=rank)
                    except TraceError as exc:
                        v.problem("input-unreadable", f"cannot compare with it: {exc}")
                        continue
                    self.check_trace(f, rank, trace, sel)

    def check_trace(self, f: BinaryIO, rank: int, trace: Any, sel: np.ndarray) -> None:
        v = self.v
        stats = v.report.inputs.setdefault(rank, Counter())
        events = trace.events
        wanted = _input_slices(events)
        out_ts = v.ts[v.slice_idx[sel]]
        out_name = v.name[v.slice_idx[sel]]
        out_dur = v.ts[v.slice_end[sel]] - out_ts
        out_thread = self.s_thread[sel]
        # events pair up per thread when the output says which thread each track shows
        threaded = bool((out_thread >= 0).any())
        if not threaded:
            out_thread = np.full(len(sel), -1, dtype=np.int64)
        by_key: dict[tuple[int, int, int], list[int]] = defaultdict(list)  # (thread, name, ts)
        for j, key in enumerate(zip(out_thread.tolist(), out_name.tolist(), out_ts.tolist())):
            by_key[key].append(j)
        offset = self.clock_offset(trace, wanted, out_name, out_ts)
        if offset:
            v.report.clock_offsets[rank] = offset
        want_key: dict[tuple[int, int, int], list[int]] = defaultdict(list)
        for i in wanted:
            e = events[i]
            thread = self.threads.get(f"{e.get('pid')}:{e.get('tid')}", -2) if threaded else -1
            want_key[(thread, v.name_ids.get(e.get("name", ""), -2),
                      trace.ns(e["ts"]) + offset)].append(i)
        pairs: list[tuple[int, int]] = []          # (input event index, slice k)
        for key, ins in want_key.items():
            thread, name, ts = key
            outs = (by_key.get(key) or by_key.get((thread, name, ts - 1))
                    or by_key.get((thread, name, ts + 1)))
            e = events[ins[0]]
            where = dict(track=f"rank {rank}", ts=ts, name=e.get("name"))
            if not outs:
                stats["missing"] += len(ins)
                v.problem("missing-event", f"{e.get('cat')} event #{ins[0]} of "
                          f"{trace.path.name} (tid {e.get('tid')}) is not in the output", **where)
                continue
            if len(outs) != len(ins):
                diff = len(outs) - len(ins)
                stats["duplicated" if diff > 0 else "missing"] += abs(diff)
                v.problem("count-mismatch", f"{len(ins)} input event(s) of {trace.path.name} "
                          f"but {len(outs)} output slice(s) with this name and time", **where)
            for i, j in zip(sorted(ins, key=lambda i: events[i].get("dur", 0)),
                            sorted(outs, key=lambda j: int(out_dur[j]))):
                pairs.append((i, int(sel[j])))
                want = round(float(events[i].get("dur", 0)) * 1000)
                got = int(out_dur[j])
                if abs(got - want) > 2:
                    stats["bad_duration"] += 1
                    v.problem("duration", f"lasts {got} ns in the output, {want} ns in "
                              f"{trace.path.name} (crossing slices on one track?)", **where)
        stats["matched"] += len(pairs)
        self.check_args(f, trace, pairs, stats)
        self.check_launch_flows(trace, pairs, stats)
        self.check_other_flows(trace, pairs, stats)

    def clock_offset(self, trace: Any, wanted: list[int], out_name: np.ndarray,
                     out_ts: np.ndarray) -> int:
        """ns the merge moved this rank by (cross-host alignment), from the names that occur
        once in the input and once in the output; 0 without a clear majority."""
        v = self.v
        events = trace.events
        in_count = Counter(events[i].get("name") for i in wanted)
        out_count = Counter(out_name.tolist())
        once = {nid: t for nid, t in zip(out_name.tolist(), out_ts.tolist()) if out_count[nid] == 1}
        diffs: Counter = Counter()
        for i in wanted:
            nm = events[i].get("name")
            got = once.get(v.name_ids.get(nm, -2))
            if got is not None and in_count[nm] == 1:
                diffs[got - trace.ns(events[i]["ts"])] += 1
        if not diffs:
            return 0
        best, n = diffs.most_common(1)[0]
        return best if n * 2 > sum(diffs.values()) else 0

    def check_args(self, f: BinaryIO, trace: Any, pairs: list[tuple[int, int]],
                   stats: Counter) -> None:
        v = self.v
        for i, k in sorted(pairs, key=lambda p: v.ev_off[int(v.slice_idx[p[1]])]):
            e = trace.events[i]
            want = e.get("args") or {}
            got, cats = v.slice_args(f, k)
            bad = [key for key, val in want.items() if key not in got or not _same(got[key], val)]
            detail = [f"{key}: {want[key]!r} -> " + (repr(got[key]) if key in got else "missing")
                      for key in bad[:4]]
            if e.get("cat") and e["cat"] not in cats:
                detail.append(f"category {e['cat']!r} -> {list(cats)!r}")
            if detail:
                stats["bad_args"] += 1
                b = int(v.slice_idx[k])
                v.problem("args", f"differs from {trace.path.name}: " + "; ".join(detail)
                          + (f" (+{len(bad) - 4} more)" if len(bad) > 4 else ""),
                          track=v.label(v.track_uuid[v.track[b]]), ts=int(v.ts[b]),
                          name=e.get("name"))

    def linked(self, b: int) -> set[int]:
        """Slice begin indices that share a flow id with slice begin ``b``."""
        flows, by_id = self.v.flow_map(), self.v.flow_slices()
        return {o for fid in flows.get(b, ()) for o in by_id.get(fid, ()) if o != b}

    def check_launch_flows(self, trace: Any, pairs: list[tuple[int, int]],
                           stats: Counter) -> None:
        """Every GPU event is linked to the CPU call with its correlation id, and to no other
        call of the input (with the input's own ``ac2g`` flows, or without: the merge draws
        them from correlation ids)."""
        v = self.v
        events = trace.events
        launch_of: dict[Any, int] = {}           # correlation -> launch slice begin
        corr_of: dict[int, Any] = {}             # CPU slice begin -> its correlation
        gpu: list[tuple[Any, int, int]] = []
        for i, k in pairs:
            e = events[i]
            corr = (e.get("args") or {}).get("correlation")
            if corr is None:
                continue
            b = int(v.slice_idx[k])
            if e.get("cat") in GPU_CATS:
                gpu.append((corr, i, b))
            elif e.get("cat") in LAUNCH_CATS:
                launch_of[corr] = b
                corr_of[b] = corr
        for corr, i, b in gpu:
            lb = launch_of.get(corr)
            if lb is None:
                continue
            linked = self.linked(b)
            wrong = sorted(o for o in linked if o in corr_of and corr_of[o] != corr)
            where = dict(track=v.label(v.track_uuid[v.track[b]]), ts=int(v.ts[b]),
                         name=events[i].get("name"))
            if lb in linked and not wrong:
                stats["launch_flows"] += 1
                continue
            stats["missing_flows" if lb not in linked else "wrong_flows"] += 1
            if wrong:
                v.problem("launch-flow", f"linked to {v.names[v.name[wrong[0]]]!r} (correlation "
                          f"{corr_of[wrong[0]]}), not only to its launch "
                          f"{v.names[v.name[lb]]!r} (correlation {corr})", **where)
            else:
                v.problem("launch-flow", f"no flow links it to its launch "
                          f"{v.names[v.name[lb]]!r} (correlation {corr})", **where)

    def check_other_flows(self, trace: Any, pairs: list[tuple[int, int]],
                          stats: Counter) -> None:
        """Every other input flow (``fwdbwd``, ...) links the slices starting at its points'
        times on their threads (any of them, where several start at one time)."""
        v = self.v
        events = trace.events
        out_of = {i: int(v.slice_idx[k]) for i, k in pairs}
        starting: dict[tuple, list[int]] = defaultdict(list)   # (pid, tid, ns) -> input events
        for i in out_of:
            e = events[i]
            starting[(e.get("pid"), e.get("tid"), trace.ns(e["ts"]))].append(i)
        points: dict[tuple, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        for e in events:
            if e.get("ph") in ("s", "t", "f") and e.get("cat") != LAUNCH_CAT:
                at = starting.get((e.get("pid"), e.get("tid"), trace.ns(e["ts"])), [])
                points[(e.get("cat"), e.get("id"))]["s" if e["ph"] == "s" else "f"] += at
        for (cat, fid), ends in points.items():
            if not ends["s"] or not ends["f"]:
                continue                         # a point on no slice: nothing to link
            starts = {out_of[i] for i in ends["s"]}
            if any(self.linked(out_of[i]) & starts for i in ends["f"]):
                stats["other_flows"] += 1
                continue
            stats["missing_flows"] += 1
            b = out_of[ends["s"][0]]
            v.problem("flow", f"input flow {cat!r} id {fid} links nothing in the output",
                      track=v.label(v.track_uuid[v.track[b]]), ts=int(v.ts[b]),
                      name=v.names[v.name[b]] if v.name[b] >= 0 else None)


