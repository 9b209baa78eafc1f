"""The C passes over a rank's events (``commviz/trace/_scan.c``) do what their Python passes do.

``joinable.index_events``, ``load.time_bounds``, ``gpu.gpu_index``, ``_Layout``'s pass and the
flow binder's loop use the C port wherever pip could build it; ``python_index_events``,
``python_time_bounds``, ``python_gpu_index``, ``_Layout._event``, ``Binder.python_bind`` and
``flows.python_back_links`` are the reference and the fallback. Both run here
on the same inputs, each on its own fresh decode: every real profiler trace under
tests/fixtures (NCCL kernels of real GPU runs, graph replays, early Kineto with digit-string
ids), laid out as two traces of one rank, with and without a ``--steps`` window, and events
that take every branch (times that are ints, bools, strings, NaN or past int64; durations of
every kind; args that are not a dict; unhashable categories). Beside that, what the layout
holds is checked against the trace's JSON as the standard library reads it.
"""

from __future__ import annotations

import copy
import gzip
import json
import math
import random
from array import array
from pathlib import Path
from typing import Any

import orjson
import pytest
from harness import c_compiler

from commviz.merge import flows, piece
from commviz.merge.flows import Binder
from commviz.merge.keep import Spans
from commviz.merge.piece import _Layout
from commviz.trace import joinable
from commviz.trace.gpu import gpu_index, python_gpu_index
from commviz.trace.joinable import python_index_events
from commviz.trace.load import python_time_bounds

FIXTURES = Path(__file__).parent / "fixtures"
TRACES = sorted(p for p in FIXTURES.rglob("*.json*") if "trace" in p.name)
native = joinable.native


def test_the_c_passes_are_built_where_a_compiler_is() -> None:
    """``pip install`` builds them (pyproject's ext-modules): a machine with a compiler must
    not fall back to the Python passes without anyone noticing."""
    if c_compiler() is None:
        pytest.skip("no C compiler here: the Python passes serve")
    assert native is not None, "commviz.trace._scan was not built: pip install -e . again"
    assert piece.native is native


needs_native = pytest.mark.skipif(native is None, reason="commviz.trace._scan not built")


def _events(path: Path) -> list:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    doc = orjson.loads(data)
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def _outcome(fn: Any, *args: Any) -> Any:
    """What a pass returns, or the type and text of what it raises."""
    try:
        return fn(*args)
    except Exception as exc:            # both must fail alike
        return (type(exc), str(exc))


def _layout(events: list, segments: list, spans: Spans | None, use_c: bool,
            monkeypatch: pytest.MonkeyPatch) -> Any:
    with monkeypatch.context() as m:
        if not use_c:
            m.setattr(piece, "native", None)
        try:
            lay = _Layout(events, segments, spans)
        except Exception as exc:
            return (type(exc), str(exc))
    return {"items": dict(lay.items), "gpu": lay.gpu, "flows": lay.flows,
            "correlated": dict(lay.correlated), "counters": dict(lay.counters),
            "labels": lay.process_labels, "threads": lay.thread_names,
            "skipped": dict(lay.skipped), "negative": lay.negative,
            "out_of_range": lay.out_of_range}


def _bind(events: list, segments: list, use_c: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The flow binder's edges, unbound points and launch-bound traces, by the C loop or the
    Python one, on one layout of the events."""
    lay = _Layout(events, segments, None)
    binder = Binder(events, lay.items, lay.correlated)
    with monkeypatch.context() as m:
        if not use_c:
            m.setattr(flows, "native", None)
        edges = _outcome(binder.bind, lay.flows)
    return edges, binder.unbound, binder.launch_segments


def _same_binding(events: list, segments: list, monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        want = _bind(events, segments, False, monkeypatch)
    except Exception:                    # no layout of these events: nothing to bind
        return
    assert _bind(events, segments, True, monkeypatch) == want


def _segments(events: list) -> list[tuple[int, int, int]]:
    """The events as two traces of one rank, the second shifted as a clock offset would."""
    half = len(events) // 2
    return [(0, half, 1_700_000_000_000_000_000), (half, len(events), 5_000_123)]


def _window(events: list, segments: list) -> Spans:
    """A ``--steps``-like window: the middle third of the first trace's times."""
    lo, hi, base = segments[0]
    ts = sorted(e["ts"] for e in events[lo:hi] if isinstance(e, dict)
                and isinstance(e.get("ts"), (int, float)) and not isinstance(e.get("ts"), bool)
                and math.isfinite(e["ts"]))
    if not ts:
        return Spans([])
    a, b = ts[len(ts) // 3], ts[2 * len(ts) // 3]
    return Spans([(base + round(a * 1000), base + round(b * 1000))])


@needs_native
@pytest.mark.parametrize("path", TRACES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_index_events_as_python_on_real_traces(path: Path) -> None:
    want_events, got_events = _events(path), _events(path)
    want = _outcome(python_index_events, want_events)
    got = _outcome(joinable.index_events, got_events)
    assert got == want
    assert got_events == want_events          # digit-string ids read as numbers alike
    _same_bounds(got_events)
    fused_events = _events(path)              # both in one pass, on a fresh decode
    fused = _outcome(native.scan_loaded, fused_events, joinable.JOIN_CATS, joinable.NAMED)
    bounds = python_time_bounds(_events(path))
    if isinstance(got, tuple):                # raised: alike
        assert fused == got
    else:
        assert fused[0] == got and fused_events == want_events
        if fused[1] is not None:              # else Python decides, as time_bounds' None
            assert bounds is not None and [(type(v), v) for v in fused[1]] == [
                (type(v), v) for v in bounds]


def _same_bounds(events: list) -> None:
    """``time_bounds`` as Python's: the same objects, or None where Python says None (where
    C says None, Python decides)."""
    got, want = native.time_bounds(events), python_time_bounds(events)
    if got is None:
        return
    assert want is not None and [type(v) for v in got] == [type(v) for v in want]
    assert all(a is b for a, b in zip(got, want)), (got, want)


@needs_native
@pytest.mark.parametrize("path", TRACES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_layout_as_python_on_real_traces(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events = _events(path)
    python_index_events(events)
    segments = _segments(events)
    for spans in (None, _window(events, segments)):
        want = _layout(events, segments, spans, False, monkeypatch)
        got = _layout(events, segments, spans, True, monkeypatch)
        assert got == want
    _same_binding(events, segments, monkeypatch)
    _same_back_links(list(_Layout(events, segments, None).items.values()))


def _same_back_links(tracks: list[list]) -> None:
    """``_scan.back_links`` as ``flows.python_back_links``, on each track's items."""
    for items in tracks:
        want, got = array("q", bytes(8 * len(items))), array("q", bytes(8 * len(items)))
        flows.python_back_links(items, want)
        assert native.back_links(items, got) is True and got == want


@pytest.mark.parametrize("use_c", [True, False])
def test_back_links_by_hand(use_c: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Slices [0,10] [1,5] [2,3] [4,5] [6,8]: each one's nearest earlier slice ending strictly
    later, counted by hand (a tie in the end, [1,5] before [4,5], is not one)."""
    if use_c and native is None:
        pytest.skip("commviz.trace._scan not built")
    if not use_c:
        monkeypatch.setattr(flows, "native", None)
    items = [(0, -10, 0), (1, -5, 1), (2, -3, 2), (4, -5, 3), (6, -8, 4)]
    assert list(flows.Track(items).back) == [-1, 0, 1, 0, 0]


@needs_native
@pytest.mark.parametrize("seed", range(5))
def test_back_links_as_python_on_nested_and_tied_slices(seed: int) -> None:
    """Slices that nest, cross, share starts and share ends (``>=`` keeps a tie back)."""
    rng = random.Random(seed)
    items = sorted((start, -(start + rng.choice([0, 1, 2, 5, 50])), i)
                   for i, start in enumerate(rng.choice(range(40)) for _ in range(400)))
    _same_back_links([items, items[:1], []])


@needs_native
@pytest.mark.parametrize("odd", [1 << 63, -(1 << 63) - 1, -4.5, True])
def test_back_links_leave_a_slice_end_that_is_no_int64_to_python(odd: Any) -> None:
    items = [(0, -10, 0), (1, -5, 1), (2, odd, 2), (3, -4, 3)]
    assert native.back_links(items, array("q", bytes(8 * len(items)))) is None
    want = array("q", bytes(8 * len(items)))
    flows.python_back_links(items, want)
    assert flows.Track(items).back == want


@needs_native
@pytest.mark.parametrize("path", TRACES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_gpu_index_as_python_on_real_traces(path: Path) -> None:
    """Each pass on its own decode of the trace (neither may change it: the events compared
    after)."""
    want_events, got_events = _events(path), _events(path)
    joinable = python_index_events(want_events)
    assert python_index_events(got_events) == joinable
    for base in (1_700_000_000_000_000_000, -5_000_123, MAX_NS):
        assert (_outcome(gpu_index, got_events, joinable, 3, base)
                == _outcome(python_gpu_index, want_events, joinable, 3, base))
    assert got_events == want_events


def _same_gpu_index(events: list, joinable: list[int], base: int) -> None:
    """``gpu_index`` as ``python_gpu_index``: the same launches, work, graphed and ops (or the
    same error), each on its own copy of the events."""
    want = _outcome(python_gpu_index, copy.deepcopy(events), joinable, 3, base)
    got = _outcome(gpu_index, copy.deepcopy(events), joinable, 3, base)
    assert got == want


MAX_NS = (1 << 63) - 1


@needs_native
def test_time_bounds_takes_the_first_of_equals_and_leaves_inexact_ints_to_python() -> None:
    """min() and max() give the first of equal values: 1 before 1.0 before another 1.0; an
    int a double cannot hold (2**62 + 1) is Python's to compare."""
    one, other_one = float("1"), float("1.0")
    tied = [{"ts": 1, "dur": one}, {"ts": one, "dur": 1}, {"ts": other_one, "dur": other_one},
            {"ts": float("3"), "dur": 0.5}, {"ts": float("3.0"), "ph": "X", "dur": float(".5")},
            {"ts": 7.5, "ph": "M"}]
    _same_bounds(tied)
    assert native.time_bounds(tied) is not None
    big = [{"ts": 2**62}, {"ts": 2**62 + 1}, {"ts": 5}]
    assert python_time_bounds(big)[1] == 2**62 + 1
    _same_bounds(big)


@needs_native
def test_both_passes_alike_at_the_edges_of_int64(monkeypatch: pytest.MonkeyPatch) -> None:
    """Times that end exactly at the last nanosecond Perfetto holds, one past it, at 0 and
    just before it, on a base whose sum with them is exact; and bases past int64."""
    last_us = (MAX_NS - 807) // 1000                  # base 807: base + last_us * 1000 == MAX_NS
    events = [{"ph": "X", "ts": last_us, "dur": 0, "pid": 1, "tid": 1},
              {"ph": "X", "ts": last_us - 1, "dur": 1, "pid": 1, "tid": 1},
              {"ph": "X", "ts": last_us - 1, "dur": 1.001, "pid": 1, "tid": 1},
              {"ph": "X", "ts": last_us + 1, "pid": 1, "tid": 1},
              {"ph": "X", "ts": -0.807, "dur": 0.5, "pid": 1, "tid": 2},
              {"ph": "X", "ts": -0.8075, "pid": 1, "tid": 2},
              {"ph": "s", "ts": last_us, "id": 1, "pid": 1, "tid": 1, "cat": "ac2g"},
              {"ph": "f", "ts": last_us + 1, "id": 1, "pid": 1, "tid": 1, "cat": "ac2g"},
              {"ph": "t", "ts": -0.8075, "id": 1, "pid": 1, "tid": 1, "cat": "ac2g"}]
    for base in (807, 808, 0, -(1 << 63), 1 << 63, -(1 << 64)):
        segments = [(0, len(events), base)]
        want = _layout(copy.deepcopy(events), segments, None, False, monkeypatch)
        got = _layout(copy.deepcopy(events), segments, None, True, monkeypatch)
        assert got == want, base


def _odd_events(seed: int, n: int, failing: float) -> list:
    """Events whose fields take every branch of both passes, mixed with ordinary ones; each
    field takes a value on which the Python pass raises with probability ``failing``."""
    rnd = random.Random(seed)
    times = [0, 1, 1.5, 2.5, -0.0005, 0.0005, 0.0015, 1e3, 1.7e9, 123456789.123, 9.3e15, 9.3e18,
             2**62, 2**70, -5, True, False, 0.0, -0.0]
    durs = times + [None, "", -1.0, -3, -0.0005]
    ids = [1, 7, "7", "0012", "x7", "", "\u0663", "\u3031", "12a", None, 3.0, -1, True, 2**70,
           "9" * 30]
    cats = ["kernel", "cpu_op", "cuda_runtime", "cuda_driver", "ac2g", "gpu_memcpy", "Kernel",
            "Runtime", "gpu_user_annotation", None, 3]
    names = ["aten::mm", "commviz::all_reduce", "c10d::broadcast_", "record_param_comms",
             "nccl:coalesced", "ncclDevKernel_AllReduce_Sum_f32_RING_LL", None, 5, "c10d",
             "cudaGraphLaunch", "cuGraphLaunch_ptsz", "cudaLaunchKernel"]
    phases = ["X"] * 10 + ["s", "f", "t", "i", "I", "C", "M", "B", "E", None, 1, "XX", ""]
    argses = [None, {}, {"correlation": 5}, {"correlation": None}, {"correlation": "5"},
              {"External id": 3, "correlation": 9}, {"correlation": 9}, [], "", 0,
              {"name": "thread 1"}, {"labels": "GPU 0"}, {"v": 1.5, "w": True, "x": "s"},
              {"correlation": 5, "cbid": 311}, {"correlation": 9, "cbid": 312.0},
              {"correlation": 9, "graph node id": 3, "stream": 7}, {"graph node id": "4"},
              {"correlation": 5, "graph node id": 0, "stream": 2**70}, {"stream": "7"},
              {"stream": True, "graph node id": True}, {"graph node id": 1.5, "stream": None},
              {"graph node id": "x", "correlation": 5}, {"graph node id": None, "stream": -1}]
    raising = {"ts": [None, "12", [1], math.nan, math.inf], "dur": ["12", [1], math.nan],
               "args": [[1], "a", {"correlation": [5]}, {"correlation": 5, "cbid": [311]}],
               "cat": [["kernel"]]}
    out: list = []
    for _ in range(n):
        if rnd.random() < failing:
            out.append(rnd.choice([[1, 2], "event", None, 3]))
            continue
        e: dict[str, Any] = {}
        for key, pool in (("ph", phases), ("cat", cats), ("name", names), ("pid", ids),
                          ("tid", ids), ("ts", times), ("dur", durs), ("args", argses),
                          ("id", ids)):
            if key in raising and rnd.random() < failing:
                pool = raising[key]
            elif key == "ts" and rnd.random() < failing:
                continue                                   # no time at all
            value = rnd.choice(pool)
            e[key] = copy.deepcopy(value)
        if e.get("ph") == "M":
            e["name"] = rnd.choice(["process_labels", "thread_name", "process_name"])
        out.append(e)
    return out


@needs_native
@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("failing", [0.0, 0.002])
def test_both_passes_alike_on_odd_events(seed: int, failing: float,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every branch, and every way of failing, alike: the events of one seed in runs of 200,
    so an event the passes fail on stops one run and the others still compare what they hold."""
    events = _odd_events(seed, 4000, failing)
    for k in range(0, len(events), 200):
        part = events[k:k + 200]
        want_events, got_events = copy.deepcopy(part), copy.deepcopy(part)
        assert _outcome(joinable.index_events, got_events) == _outcome(python_index_events,
                                                                        want_events)
        assert got_events == want_events          # NaN: deepcopy keeps the one float object
        _same_bounds(got_events)
        _same_bounds([e for e in got_events if isinstance(e, dict) and type(e.get("ts")) in
                      (int, float) and type(e.get("dur", 0)) in (int, float)])
        joined = _outcome(python_index_events, copy.deepcopy(part))
        for base in (1000, MAX_NS - 10**9, 2**70) if isinstance(joined, list) else ():
            _same_gpu_index(part, joined, base)
        segments = [(0, len(part) // 2, 1000), (len(part) // 2, len(part), -(2**40))]
        _same_binding(copy.deepcopy(part), segments, monkeypatch)
        for spans in (None, Spans([(0, 10**12), (10**15, 10**18)])):
            want = _layout(copy.deepcopy(part), segments, spans, False, monkeypatch)
            got = _layout(copy.deepcopy(part), segments, spans, True, monkeypatch)
            assert got == want


@pytest.mark.parametrize("path", TRACES[::6], ids=lambda p: str(p.relative_to(FIXTURES)))
def test_layout_holds_every_timed_event_of_the_json(path: Path) -> None:
    """Whichever pass is built: each complete event of the trace, as the standard library
    reads its JSON, is one slice item on its (pid, tid) track at base + ts·1000 with its
    duration, and each flow event one flow point; the joinable indices name only complete
    events."""
    data = path.read_bytes()
    text = gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data
    doc = json.loads(text)
    reference = doc["traceEvents"] if isinstance(doc, dict) else doc
    events = _events(path)
    joined = joinable.index_events(events)
    assert all(reference[i].get("ph") == "X" for i in joined)
    base = 1_000_000_000
    lay = _Layout(events, [(0, len(events), base)])
    want: dict[tuple, list] = {}
    flows = 0
    for i, e in enumerate(reference):
        if not isinstance(e, dict) or "ts" not in e:
            continue
        key = (_num(e.get("pid")), _num(e.get("tid")))
        start = base + round(e["ts"] * 1000)
        if e.get("ph") == "X":
            end = start + round((e.get("dur") or 0) * 1000)
            want.setdefault(key, []).append((start, -max(end, start), i))
        elif e.get("ph") in ("i", "I"):
            want.setdefault(key, []).append((start, -start, i))
        elif e.get("ph") in ("s", "t", "f"):
            flows += 1
    assert {k: sorted(v) for k, v in want.items()} == dict(lay.items)
    assert len(lay.flows) == flows


def _num(value: Any) -> Any:
    return int(value) if isinstance(value, str) and value.isascii() and value.isdigit() else value
