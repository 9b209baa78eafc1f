"""The pftrace writer's C loop (``commviz/write/_emit.c``) writes what its Python loop writes.

``pftrace.emit_slices`` is the C port wherever pip could build it, and ``python_emit_slices``
the reference. Both run here over the same inputs, each on fresh sequences, and must give the
same bytes and leave each sequence's clock at the same place: every real profiler trace under
tests/fixtures (NCCL kernels of real GPU runs, graph replays, early Kineto), laid out as the
merge lays a rank out, and events whose args take every branch of the encoder (ids of every
type, values past 64 bits, lone surrogates, caches filling up, args added by the matcher).
And what the C loop writes, parsed back, must be each profiler event as the trace's JSON has
it (time, end, name, category, every arg); test_write_pftrace.py checks the encoding against
perfetto's own parser with whichever loop is built.
"""

from __future__ import annotations

import io
import math
import random
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import orjson
import pytest
from harness import c_compiler

from commviz.merge.flows import launch_edges
from commviz.merge.piece import _flow_fields, _Layout
from commviz.trace.load import Trace, load_trace
from commviz.write import pftrace
from commviz.write.pftrace import (Piece, flow_field, python_emit_slices, python_split, split,
                                   track_descriptor)
from commviz.write.read import read_pftrace, slices

FIXTURES = Path(__file__).parent / "fixtures"
TRACES = sorted(p for p in FIXTURES.rglob("*.json*") if "trace" in p.name)
native = pftrace._native


def test_the_c_loop_is_built_where_a_compiler_is() -> None:
    """``pip install`` builds it (pyproject's ext-modules): a machine with a compiler must not
    fall back to the Python loop without anyone noticing."""
    if c_compiler() is None:
        pytest.skip("no C compiler here: the Python loop serves")
    assert native is not None, "commviz.write._emit was not built: pip install -e . again"
    assert pftrace.emit_slices is native.emit_slices


def _write(emit: Callable[..., int], tracks: list[tuple[list, list[dict], dict, dict]]
           ) -> tuple[bytes, list[int], int]:
    """Every track through ``emit`` on a fresh piece, each backing track declared: the bytes,
    each sequence's clock after, and the slices written."""
    piece = Piece(io.BytesIO(), 1)
    out = piece.buf
    clocks, count = [], 0
    for items, events, extra, flows in tracks:
        for back in split(items):
            uuid = piece.new_uuid()
            piece.descriptor(track_descriptor(uuid, name=f"track {uuid}"))
            seq = piece.sequence(uuid)
            out += seq.start(back[0][0])
            count += emit(seq, out, back, events, extra, flows)
            clocks.append(seq.last_ts)
    return bytes(out), clocks, count


def _same(tracks: list[tuple[list, list[dict], dict, dict]]) -> int:
    want = _write(python_emit_slices, tracks)
    got = _write(native.emit_slices, tracks)
    assert got[1:] == want[1:]
    if got[0] != want[0]:
        at = next(i for i, (a, b) in enumerate(zip(got[0], want[0])) if a != b)
        raise AssertionError(f"bytes differ from byte {at} of {len(want[0])}: "
                             f"C {got[0][at - 16:at + 16]!r}, Python {want[0][at - 16:at + 16]!r}")
    return want[2]


def _rank_tracks(trace: Trace) -> list[tuple[list, list[dict], dict, dict]]:
    """A trace's tracks as the merge lays them out, its launch flows attached."""
    layout = _Layout(trace.events, [(0, len(trace.events), trace.base_ns)])
    bound, derived, _ = launch_edges(trace.events, layout.items, layout.correlated,
                                     layout.flows, 1)
    flows = _flow_fields(bound + derived, trace.rank)
    return [(items, trace.events, {}, flows) for items in layout.items.values()]


needs_native = pytest.mark.skipif(native is None, reason="the C loop is not built here")


@needs_native
@pytest.mark.parametrize("path", TRACES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_real_traces_give_the_same_bytes(path: Path) -> None:
    assert _same(_rank_tracks(load_trace(path))) > 0


def _as_written(args: dict) -> dict:
    """An event's args as a reader of the trace gets them: lists and objects as JSON text."""
    return {k: orjson.dumps(v).decode() if isinstance(v, (list, dict)) else v
            for k, v in args.items()}


@needs_native
@pytest.mark.parametrize("path", TRACES[::6], ids=lambda p: str(p.relative_to(FIXTURES)))
def test_real_traces_read_back_as_the_profiler_wrote_them(path: Path, tmp_path: Path) -> None:
    """What the C loop writes, parsed back, is each profiler event itself: its time, end, name,
    category and every arg, as the trace's JSON has them."""
    trace = load_trace(path)
    data, _, count = _write(native.emit_slices, _rank_tracks(trace))
    (tmp_path / "t.pftrace").write_bytes(data)
    contents = read_pftrace(tmp_path / "t.pftrace")
    got, problems = slices(contents)
    assert contents.problems == [] and problems == [] and len(got) == count
    base = trace.base_ns
    want = Counter()
    for e in trace.events:
        if e.get("ph") == "X" or e.get("ph") in ("i", "I"):
            start = base + round(e["ts"] * 1000)
            end = start + round((e.get("dur") or 0) * 1000)
            want[(start, end, e.get("name", ""), e.get("cat") or None,
                  orjson.dumps(_as_written(e.get("args") or {}), option=orjson.OPT_SORT_KEYS))] += 1
    seen = Counter((sl.start, sl.end, sl.name, sl.category,
                    orjson.dumps(sl.args, option=orjson.OPT_SORT_KEYS)) for sl in got)
    assert seen == want


def _odd_events(n: int, scalars: bool = False) -> tuple[list, list[dict], dict, dict]:
    """One track of nested slices and instants whose args take every path of the encoder.
    ``scalars``: no list or dict among the args (shape lists as the text the loader makes of
    them), and values equal across types (1, 1.0, True, "1"), so the C loop keys its cache by
    each value's type and bytes rather than by their JSON."""
    rng = random.Random(7)
    values: list[Any] = [True, False, None, 0, -1, -(1 << 63), (1 << 63) - 1, 1 << 64, 1 << 70,
                         0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, "", "x", "\ud800 lone",
                         "é", [1, [2, 3]], [1 << 70], [], {"a": [1]}, {}, [None, True, 1.0]]
    if scalars:
        values = [v for v in values if not isinstance(v, (list, dict))] + [
            1, 1.0, "1", "true", "null", False, 0, "0", "", "\x01", "s\x01i"]
    events, items, extra, flows = [], [], {}, {}
    t = 1_000
    for i in range(n):
        args: dict[str, Any] = {
            "External id": i,                                   # an int id
            "correlation": i * 7 if i % 50 else str(i),         # mostly ints, some strings
            "Ev Idx": f"id-{i}",                                # a string id: written in place
            "ratio": i / 3,                                     # a float id
            "dims": (f"[[{rng.randrange(4)},1024],[{rng.randrange(3)}]]" if scalars
                     else [[rng.randrange(4), 1024], [rng.randrange(3)]]),
            "setting": rng.choice(values),                      # a value of every type
            "bucket": rng.randrange(3000),                      # more than the cache holds
        }
        if i % 17 == 0:
            args = {"odd order": rng.choice(values), **args}    # another key order
        if i % 29 == 0:
            args = {}
        events.append({"name": rng.choice(["aten::mm", "aten::add", "", "ncclDevKernel"]),
                       "cat": rng.choice(["cpu_op", "kernel", "", None]), "args": args})
        if i % 11 == 0:
            extra[i] = {"commviz.seq": i, "commviz.op": "all_reduce", "commviz.ranks": [0, 1]}
        if i % 13 == 0:
            flows[i] = flow_field(i) + flow_field(1 << 62 | i)
        start = t
        dur = rng.choice([0, 0, 5, 40])
        items.append((start, -(start + dur), i))
        t += rng.randrange(0, 30)
    items.sort()
    return items, events, extra, flows          # crossing slices: split spreads them


@needs_native
@pytest.mark.parametrize("scalars", [False, True])
def test_odd_args_give_the_same_bytes(scalars: bool) -> None:
    items, events, extra, flows = _odd_events(6000, scalars)
    assert _same([(items, events, extra, flows)]) == len(items)


@needs_native
def test_a_name_that_cannot_be_a_key_fails_both_alike() -> None:
    events = [{"name": ["not", "hashable"], "cat": "x", "args": {}}]
    for emit in (python_emit_slices, native.emit_slices):
        piece = Piece(io.BytesIO(), 1)
        seq = piece.sequence(piece.new_uuid())
        out = bytearray(seq.start(0))
        with pytest.raises(TypeError):
            emit(seq, out, [(0, -10, 0)], events)


@pytest.mark.skipif(native is None, reason="commviz.write._emit not built")
@pytest.mark.parametrize("seed", range(30))
def test_split_as_python(seed: int) -> None:
    """The C split puts the same item objects on the same backing tracks as ``python_split``:
    nested, crossing, touching and equal slices, instants, times near int64's ends; and leaves
    items it cannot read as int64 to Python."""
    rnd = random.Random(seed)
    edge = (1 << 63) - 1
    items = []
    for i in range(rnd.choice([0, 1, 5, 300, 3000])):
        start = rnd.choice([rnd.randrange(0, 10_000), rnd.randrange(edge - 10_000, edge),
                            rnd.randrange(0, 50)])
        end = min(edge, start + rnd.choice([0, 0, 1, 3, rnd.randrange(0, 2_000)]))
        items.append((start, -end, i))
    items.sort()
    want = python_split(items)
    got = native.split(items)
    assert got == want
    assert all(a is b for g, w in zip(got, want) for a, b in zip(g, w))
    assert split(items) == want
    for odd in ([(1.5, -2, 0)], [(0, -(1 << 64), 0)], [(True, -1, 0)], [(0,)], [[0, -1, 0]]):
        assert native.split(items + odd) is None
