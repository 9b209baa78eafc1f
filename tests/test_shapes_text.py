"""Kineto's op-shape args read as the text the pftrace writer makes of them (``_scan.c``'s
``shapes_into``, ``load_trace(..., shapes_as_text=True)``, which the merge uses).

The writer writes a list-valued arg as the string ``orjson.dumps`` makes of it; the merge reads
the plain lists of ``SHAPE_KEYS`` as that string to begin with. Expected values come from the
standard library's reading of the same JSON and from orjson, never from commviz: every fixture
trace with shapes reads the same but for those lists, each now ``orjson.dumps`` of itself; a
list the rule does not take (a float, an escape, an int past 18 digits, bad JSON) stays as it
is, byte for byte; and a merge gives the same bytes either way.
"""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest

from commviz.match import graphed
from commviz.merge import merge_run
from commviz.trace import joinable, load
from commviz.trace.load import SHAPE_KEYS

FIXTURES = Path(__file__).parent / "fixtures"
TRACES = sorted(p for p in FIXTURES.rglob("*.json*") if "trace" in p.name)
KEYS = tuple(k.encode() for k in SHAPE_KEYS)
native = joinable.native
pytestmark = pytest.mark.skipif(native is None, reason="commviz.trace._scan not built")


def _raw(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def _plain(value: Any) -> bool:
    """The lists the rule takes: ints of at most 18 digits, printable ASCII strings that JSON
    writes without an escape, true/false/null and such lists."""
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return len(str(abs(value))) <= 18
    if isinstance(value, str):
        return all(" " <= c <= "~" and c not in '"\\' for c in value)
    return False


def _turned(data: bytes) -> bytes:
    out = bytearray()
    native.shapes_into(out, data, KEYS)
    return bytes(out)


def _events(doc: Any) -> list:
    return doc["traceEvents"] if isinstance(doc, dict) else doc


def _turned_events(raw: bytes) -> list:
    """The stdlib's events of ``raw``, each plain shape list as ``orjson.dumps`` of itself."""
    events = _events(json.loads(raw))
    for event in events:
        args = event.get("args") if isinstance(event, dict) else None
        for key in SHAPE_KEYS:
            if isinstance(args, dict) and isinstance(args.get(key), list) and _plain(args[key]):
                args[key] = orjson.dumps(args[key]).decode()
    return events


@pytest.mark.parametrize("path", TRACES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_shape_lists_come_as_the_text_orjson_makes_of_them(path: Path) -> None:
    raw = _raw(path)
    want = _events(json.loads(raw))
    got = _events(json.loads(_turned(raw)))
    assert len(got) == len(want)
    for was, now in zip(want, got):
        args = was.get("args") if isinstance(was, dict) else None
        if not isinstance(args, dict):
            assert now == was
            continue
        turned = {k: orjson.dumps(v).decode() for k, v in args.items()
                  if k in SHAPE_KEYS and isinstance(v, list) and _plain(v)}
        assert now == {**was, "args": {**args, **turned}}


def test_real_traces_with_shapes_have_them_turned() -> None:
    """Not a vacuous pass: the GPU fixtures were profiled with ``record_shapes=True``."""
    path = FIXTURES / "gpu/proof-4x/3d/trace_rank0_step7.json.gz"
    raw = _raw(path)
    turned = sum(isinstance(v, str) for e in _events(json.loads(_turned(raw)))
                 if isinstance(e, dict) for k, v in (e.get("args") or {}).items()
                 if k in SHAPE_KEYS)
    lists = sum(isinstance(v, list) for e in _events(json.loads(raw)) if isinstance(e, dict)
                for k, v in (e.get("args") or {}).items() if k in SHAPE_KEYS)
    assert lists > 1000 and turned == lists


@pytest.mark.parametrize("chunk", [7, 4096, load.INFLATE_CHUNK])
@pytest.mark.parametrize("members", [1, 3])
def test_a_trace_loads_with_its_shapes_turned_however_it_is_inflated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, chunk: int, members: int) -> None:
    """The text is turned as it is inflated, a piece at a time: pieces that cut lines (and
    lists), and gzip members one after another, give the events of the whole text turned."""
    raw = _raw(FIXTURES / "gpu/proof-4x/3d/trace_rank0_step7.json.gz")
    cuts = [len(raw) * k // members for k in range(members + 1)]
    path = tmp_path / "trace_rank0.json.gz"
    path.write_bytes(b"".join(gzip.compress(raw[a:b]) for a, b in zip(cuts, cuts[1:])))
    monkeypatch.setattr(load, "INFLATE_CHUNK", chunk)
    assert load.load_trace(path, shapes_as_text=True).events == _turned_events(raw)


@pytest.mark.parametrize("value", [
    "[[1, 2], [3], []]", '["float", "c10::BFloat16", ""]', "[\n\t[1 ,2]\r\n]", "[]",
    "[true, false, null]", "[-5, 0, 123456789012345678]", '[[["a b", [7]]], "[x]"]',
])
def test_a_plain_list_becomes_its_compact_text(value: str) -> None:
    text = '{"traceEvents": [{"args": {"Ev Idx": 3, "Input Dims": %s, "x": [1, 2]}}]}' % value
    out = _turned(text.encode())
    args = json.loads(out)["traceEvents"][0]["args"]
    assert args == {"Ev Idx": 3, "Input Dims": orjson.dumps(json.loads(value)).decode(),
                    "x": [1, 2]}


@pytest.mark.parametrize("text", [
    '{"Input Dims": [1.5]}', '{"Input Dims": [1e3]}', '{"Input Dims": [2E-1]}',
    '{"Input Dims": [1234567890123456789]}', '{"Input Dims": [-0]}',
    '{"Input type": ["a\\"b"]}', '{"Input type": ["\\u00e9"]}', '{"Input type": ["é"]}',
    '{"Input type": ["tab\there"]}',
    '{"Input Dims": [1 2]}', '{"Input Dims": [1,]}', '{"Input Dims": [,1]}',
    '{"Input Dims": [01]}', '{"Input Dims": [tru]}', '{"Input Dims": [1, 2',
    '{"name": "x\\"Input Dims\\": [1]"}', '["Input Dims", [1]]', '{"stream": [1, 1, 1]}',
    '{"Input Dimsx": [1]}', '{"xInput Dims": [1]}', '{"a\\"Input Dims": [1]}',
])
def test_any_other_list_stays_as_it_is(text: str) -> None:
    data = text.encode()
    assert _turned(data) == data


@pytest.mark.parametrize("fixture", ["proof-4x/3d", "proof-2xh100/graphs"])
def test_a_merge_writes_the_same_bytes_with_shapes_read_as_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fixture: str) -> None:
    """The lists and their text give one merged trace: the writer makes the same string, and
    the graph matcher reads a graphed kernel's grid and block from either (``graphs``: CUDA
    graph replays, every kernel matched by its launch dims)."""
    runs = [shutil.copytree(FIXTURES / "gpu" / fixture, tmp_path / name)
            for name in ("text", "lists")]                  # nothing one merge saved is reused
    as_text = merge_run(runs[0], tmp_path / "text.pftrace", workers=1, progress=False)
    with monkeypatch.context() as m:
        m.setattr(load, "_SHAPE_KEYS", ())
        as_lists = merge_run(runs[1], tmp_path / "lists.pftrace", workers=1, progress=False)
    for key in ("slices", "comm_events"):
        assert as_text.stats[key] == as_lists.stats[key] > 0
    assert as_text.out.read_bytes() == as_lists.out.read_bytes()


@pytest.mark.parametrize("grid, block", [([2, 64, 1], [256, 1, 1]), ("[2,64,1]", "[256,1,1]")])
def test_the_graph_matcher_reads_launch_dims_either_way(grid: Any, block: Any) -> None:
    assert graphed._dims({"grid": grid, "block": block}) == (2, 64, 1, 256, 1, 1)


@pytest.mark.parametrize("grid", ["", "[2,64", "{}", "2", None, 7, [2, "x", 1]])
def test_launch_dims_that_are_no_list_of_ints_are_none(grid: Any) -> None:
    assert graphed._dims({"grid": grid, "block": [256, 1, 1]}) is None


REAL = sorted(p for p in (FIXTURES / "gpu").rglob("trace_rank*.json.gz")
              if p.parts[-3] in ("proof-2xh100", "proof-4x", "stacks-2xh200"))


@pytest.mark.parametrize("path", REAL, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_real_traces_are_read_by_declaration_alone_as_the_stdlib_reads_them(
        path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The merge's read decodes a Kineto trace by declaration (``decode_declared``) and needs
    no other decoding: the events equal the stdlib's, every key and every phase kept."""
    def refused(data: bytes, source: str) -> None:
        raise AssertionError(f"{source} was not read by declaration")
    monkeypatch.setattr(load, "parse_json", refused)
    assert load.load_trace(path, shapes_as_text=True).events == _turned_events(_raw(path))


@pytest.mark.parametrize("events", [
    [{"ph": "Z", "name": "a phase outside Chrome's format", "ts": 1, "pid": 1, "tid": 1}],
    [{"ph": "X", "name": "args not an object", "ts": 1, "dur": 2, "pid": 1, "tid": 1,
      "args": None}, None, 7],
    [{"ph": 88, "name": "a phase that is no string", "ts": 1, "pid": 1, "tid": 1}],
], ids=["phase", "not-events", "phase-number"])
@pytest.mark.parametrize("bare", [False, True], ids=["object", "bare-array"])
def test_a_trace_outside_the_declaration_reads_as_the_stdlib_reads_it(
        tmp_path: Path, events: list, bare: bool) -> None:
    kept = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 5.5, "dur": 1.25,
             "pid": 7, "tid": 8, "args": {"Input Dims": [[2, 3], []], "Ev Idx": 1}}, *events]
    path = tmp_path / "trace_rank0.json"
    path.write_text(json.dumps(kept if bare else {"traceEvents": kept, "schemaVersion": 1}))
    assert load.load_trace(path, shapes_as_text=True).events == _turned_events(path.read_bytes())


def test_keys_outside_the_format_change_no_merged_byte(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The declaration leaves out what Chrome's format does not name (the merge reads none of
    it): a run whose every event and trace carries such keys merges to the same bytes read by
    declaration as read whole."""
    runs = [shutil.copytree(FIXTURES / "gpu/proof-2xh100/graphs", tmp_path / name)
            for name in ("declared", "whole")]
    for run in runs:
        for path in run.glob("trace_rank*.json.gz"):
            doc = json.loads(gzip.decompress(path.read_bytes()))
            doc["commviz_test_top"] = {"x": 1}
            for i, event in enumerate(doc["traceEvents"]):
                event["commviz_test_key"] = i
            path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    declared = merge_run(runs[0], tmp_path / "declared.pftrace", workers=1, progress=False)
    with monkeypatch.context() as m:
        m.setattr(load, "decode_declared", lambda data: None)
        whole = merge_run(runs[1], tmp_path / "whole.pftrace", workers=1, progress=False)
    for key in ("slices", "comm_events"):
        assert declared.stats[key] == whole.stats[key] > 0
    assert declared.out.read_bytes() == whole.out.read_bytes()
