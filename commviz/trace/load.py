"""Loading one rank's profiler trace (torch.profiler / Kineto Chrome JSON, plain or gzip).

Every shape real jobs write is accepted: compact or pretty JSON, ``ts`` relative to
``baseTimeNanoseconds`` or absolute, ``distributedInfo`` present, partial or missing (the rank
then comes from the file name), a bare event array, a pid or tid written as a string of digits
(Kineto's first releases: ``"tid": "24572"`` on slices, ``24572`` on their flows), read as its
number as Perfetto's JSON importer reads it. Anything unusable raises one ``TraceError``
naming the file. ``read_header`` looks only at the start of a file, so a run dir of many big
traces can be sorted by rank without parsing them.

Traces are decoded by msgspec's JSON decoder (the events as the dicts and lists the profiler
wrote, as orjson or the stdlib give them, but in about four fifths of orjson's time on profiler
traces, whose decoding is most of what reading a rank costs); the stdlib reads what it refuses
(NaN or Infinity literals, lone surrogates). The merge's read decodes by declaration
(``decode_declared``).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Literal, TypedDict

import msgspec
from isal import isal_zlib

from commviz.errors import TraceError
from commviz.trace.gpu import GpuIndex, gpu_index
from commviz.trace.joinable import JOIN_CATS, NAMED, index_events, native

_GZIP_MAGIC = b"\x1f\x8b"
HEADER_BYTES = 1 << 20          # how much of a trace read_header looks at (decompressed)

# Where a file name says the rank: commviz's ``trace_rank3_step2.json.gz``, and the usual
# ``rank3`` / ``rank_3`` / ``rank-3`` / ``-rank-3`` spellings (not ``rank3`` inside ``crank3``).
_RANK_NAME_RE = re.compile(r"(?:^|[^a-z0-9])rank[_-]?(\d+)(?![0-9])", re.IGNORECASE)
_DIST_RE = re.compile(r'"distributedInfo"\s*:\s*')
_PID_RE = re.compile(r'"pid"\s*:\s*(-?\d+)')
_HOST_RE = re.compile(r'"host_name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_TRACE_ID_RE = re.compile(r'"trace_id"\s*:\s*"([^"]*)"')
_BASE_RE = re.compile(r'"baseTimeNanoseconds"\s*:\s*(\d+)')
_TS_RE = re.compile(r'"ts"\s*:\s*([-+0-9.eE]+)')
_OWN_SCHEMA_RE = re.compile(r'^\s*\{\s*"schema"\s*:\s*"commviz\.')   # commviz.filetype's files
MAX_NS = (1 << 63) - 1          # wall times are int64 nanoseconds downstream
MIN_SPAN_US = 1e6               # a trace's span is taken as at least a second...
SPAN_FACTOR = 1000              # ...and times this many spans away from it are not believed
FAR_NS = 6 * 3_600 * 10**9      # a trace this far from the rest of the job is not believed
# Kineto's shape args: an op's (``record_shapes=True``) and a kernel's launch grid and block.
# The pftrace writer writes each list as its compact JSON text, and ``load_trace(...,
# shapes_as_text=True)`` reads them as that text; the one step that reads any of them, the
# graph matcher (a graphed kernel's grid and block), reads the text too (``json_list``).
SHAPE_KEYS = ("Input Dims", "Input type", "Input Strides", "Concrete Inputs", "grid", "block")
_SHAPE_KEYS = tuple(key.encode() for key in SHAPE_KEYS)


def rank_from_name(path: str | os.PathLike[str]) -> int | None:
    """The rank a trace's file name states, or None; two different ranks in one name -> None."""
    found = {int(m.group(1)) for m in _RANK_NAME_RE.finditer(Path(path).name)}
    return found.pop() if len(found) == 1 else None


@dataclass
class Trace:
    """One profiler trace, events as the profiler wrote them (digit-string ids as numbers)."""

    path: Path
    rank: int
    events: list[dict]
    base_ns: int                      # wall ns = base_ns + round(ts_us * 1000)
    distributed_info: dict | None
    device_properties: list
    meta: dict[str, Any] = field(default_factory=dict)   # other top-level keys (host_name, ...)
    problems: list[str] = field(default_factory=list)    # events left out: times not believed
    _joinable: tuple[list, list[int]] = field(default=((), []), repr=False, compare=False)
    _gpu: tuple[list, GpuIndex | None] = field(default=((), None), repr=False, compare=False)

    @property
    def joinable(self) -> list[int]:
        """Indices of the events a matcher may join on (``trace.joinable``): found when the
        trace is loaded, and again for an events list put in its place."""
        events, found = self._joinable
        if events is not self.events:
            found = index_events(self.events)
            self._joinable = (self.events, found)
        return found

    @property
    def gpu(self) -> GpuIndex:
        """Its launches and GPU work (``commviz.trace.gpu.GpuIndex``): found once, when first
        asked for, and again for an events list put in its place."""
        events, found = self._gpu
        if events is not self.events or found is None:
            found = gpu_index(self.events, self.joinable, self.rank, self.base_ns)
            self._gpu = (self.events, found)
        return found

    def ns(self, ts_us: float) -> int:
        return self.base_ns + round(ts_us * 1000)

    @property
    def host(self) -> str | None:
        host = self.meta.get("host_name")
        return str(host) if host else None


@dataclass
class TraceHeader:
    """What the first bytes of a trace say: enough to file it under a rank."""

    path: Path
    distributed_info: dict | None
    rank: int | None                  # distributedInfo.rank
    world_size: int | None            # distributedInfo.world_size
    host: str | None
    pid: int | None                   # pid of the first trace event: which process wrote it
    identity: str | None              # trace_id, else the first event's ts: which trace it is
    base_ns: int | None               # baseTimeNanoseconds, when the start of the file has it
    is_trace: bool                    # the start looks like a Chrome trace
    merged: bool                      # a trace commviz itself wrote (merge --format json)
    commviz_file: bool = False        # another file commviz wrote (a declared "commviz.*" schema)
    start_ns: int | None = None       # wall ns of its first events (median of the first few)


def read_bytes(path: Path, limit: int | None = None,
               shapes_as_text: bool = False) -> bytes | bytearray:
    """The file's bytes, gunzipped when it is gzip; ``limit`` reads only that much;
    ``shapes_as_text``: as ``shapes_text`` gives them (where the C pass is built)."""
    try:
        with open(path, "rb") as f:
            magic = f.read(2)
            f.seek(0)
            shapes = shapes_as_text and native is not None and limit is None
            if magic == _GZIP_MAGIC:
                if shapes:
                    return shapes_text(inflate(f.read(), INFLATE_CHUNK))
                if limit is None:                   # in one call: no chunks to join
                    return b"".join(inflate(f.read()))
                with gzip.GzipFile(fileobj=f) as g:
                    return g.read(limit)
            if shapes:
                return shapes_text([f.read()])
            return f.read(limit) if limit is not None else f.read()
    except (EOFError, zlib.error, isal_zlib.error, gzip.BadGzipFile) as exc:
        raise TraceError(str(path), f"truncated or corrupt gzip ({exc})") from None
    except OSError as exc:
        raise TraceError(str(path), f"cannot read: {exc.strerror or exc}") from None


INFLATE_CHUNK = 1 << 17     # compressed bytes inflated at a time: text of about 1.5 MB


def inflate(data: bytes, chunk: int | None = None) -> Iterator[bytes]:
    """The text of every member of a gzip file, as ``gzip.decompress`` gives it, by ISA-L's
    inflate (half zlib's time, which was a fifth of reading a trace): a piece a member, or the
    text of ``chunk`` compressed bytes at a time. Zero bytes after the last member (padding
    some writers leave) are ignored, as gzip does."""
    view = memoryview(data)
    while True:
        member = isal_zlib.decompressobj(31)
        step, at = chunk or max(len(view), 1), 0
        while not member.eof:
            if at >= len(view):
                raise EOFError("compressed file ended before the end-of-stream marker was reached")
            text = member.decompress(view[at:at + step])
            at += step
            if text:
                yield text
        view = view[min(at, len(view)) - len(member.unused_data):]   # the next member, uncopied
        if not view or view[0] == 0:                # padding (a member starts with 0x1f)
            if any(view.tobytes()):
                raise EOFError("bytes other than zero padding after the last gzip member")
            return


def shapes_text(pieces: Iterable[bytes]) -> bytearray:
    """The JSON text of ``pieces`` with the plain lists of ``SHAPE_KEYS`` as their compact text
    (``_scan.shapes_into``), made a piece at a time as it is inflated: the text is written once
    (no whole inflated copy to fault in first) and read while in cache. Pieces are cut at line
    ends, and Kineto writes an event a line, so no list is cut; one that is all the same stays
    a list, which the writer writes as the same text."""
    out, line = bytearray(), bytearray()
    for piece in pieces:
        cut = piece.rfind(b"\n") + 1
        if not cut:
            line += piece
            continue
        head = piece.find(b"\n") + 1
        line += piece[:head]
        native.shapes_into(out, line, _SHAPE_KEYS)
        native.shapes_into(out, memoryview(piece)[head:cut], _SHAPE_KEYS)
        line = bytearray(piece[cut:])
    native.shapes_into(out, line, _SHAPE_KEYS)
    return out


def json_list(value: Any) -> Any:
    """A ``SHAPE_KEYS`` arg as its list, whichever way the trace was loaded (a string that is
    no JSON list: None)."""
    if value.__class__ is not str:
        return value
    try:
        value = msgspec.json.decode(value)
    except msgspec.DecodeError:
        return None
    return value if value.__class__ is list else None


def read_header(path: str | os.PathLike[str]) -> TraceHeader:
    """Look at the start of a trace (at most ``HEADER_BYTES``) without parsing the whole file."""
    path = Path(path)
    try:
        head = read_bytes(path, HEADER_BYTES)
    except TraceError:
        # a truncated gzip still has a readable start; fall back to what zlib can give
        head = _partial_gunzip(path)
    text = head.decode("utf-8", errors="replace")
    events_at = text.find('"traceEvents"')
    meta_end = events_at if events_at >= 0 else len(text)   # top-level keys before the events
    info = None
    at = _DIST_RE.search(text)
    if at:
        try:
            info, _ = json.JSONDecoder().raw_decode(text, at.end())
        except ValueError:
            info = None
        if not isinstance(info, dict):
            info = None
    host = _HOST_RE.search(text, 0, meta_end)
    base = _BASE_RE.search(text, 0, meta_end)
    pid = _PID_RE.search(text, events_at) if events_at >= 0 else None
    ident = _TRACE_ID_RE.search(text, 0, meta_end) or (
        _TS_RE.search(text, events_at) if events_at >= 0 else None)
    base_ns = int(base.group(1)) if base else None
    return TraceHeader(
        path=path, distributed_info=info,
        rank=_int_or_none(info, "rank"), world_size=_int_or_none(info, "world_size"),
        host=json.loads(f'"{host.group(1)}"') if host else None,
        pid=int(pid.group(1)) if pid else None, identity=ident.group(1) if ident else None,
        base_ns=base_ns,
        is_trace=looks_like_trace(text, cut=len(head) >= HEADER_BYTES),
        merged='"commviz_merged"' in text[:4096],
        commviz_file=bool(_OWN_SCHEMA_RE.search(text, 0, 4096)),
        start_ns=_start_ns(text, events_at, base_ns))


_WS = re.compile(r"\s*")
_EVENTS_ANYWHERE = re.compile(r'"traceEvents"\s*:\s*\[\s*\{\s*"')
_JSON = json.JSONDecoder()


def looks_like_trace(text: str, cut: bool = False) -> bool:
    """Whether the start of a file (``read_header``'s text) is a Chrome trace: a JSON object
    whose own ``traceEvents`` key holds a list of event objects (each with a ``ph``), or a bare
    list of them. Only the top level is walked, each value before ``traceEvents`` decoded and
    dropped, so a user's JSON that merely mentions the names is not taken. ``cut``: the text is
    the start of a longer file; where it ends before the walk could tell, the key is enough."""
    at = _WS.match(text).end()
    if text.startswith("[", at):
        return _first_event(text, at, cut)
    if not text.startswith("{", at):
        return False
    at += 1
    try:
        while True:
            at = _WS.match(text, at).end()
            key, at = _JSON.raw_decode(text, at)
            at = _WS.match(text, at).end()
            if not isinstance(key, str) or not text.startswith(":", at):
                return False
            at = _WS.match(text, at + 1).end()
            if key == "traceEvents":
                return text.startswith("[", at) and _first_event(text, at, cut)
            _, at = _JSON.raw_decode(text, at)
            at = _WS.match(text, at).end()
            if not text.startswith(",", at):
                return False                       # the object ended without traceEvents
            at += 1
    except (ValueError, RecursionError):
        # not JSON, or the header ended inside a value: the key itself then, where it is
        return cut and bool(_EVENTS_ANYWHERE.search(text))


def _first_event(text: str, at: int, cut: bool) -> bool:
    """Whether the list opening at ``at`` starts with a trace event (an object with ``ph``)."""
    at = _WS.match(text, at + 1).end()
    if not text.startswith("{", at):
        return False
    try:
        event, _ = _JSON.raw_decode(text, at)
    except (ValueError, RecursionError):           # cut by the header's end: its first key
        return cut and '"ph"' in text[at:at + 4096]
    return isinstance(event, dict) and isinstance(event.get("ph"), str)


def _start_ns(text: str, events_at: int, base_ns: int | None) -> int | None:
    """Wall ns of a trace's first events: the median of its first non-zero ``ts`` values
    (metadata events may carry 0), so one odd event does not decide it."""
    if events_at < 0:
        return None
    found = []
    for m in _TS_RE.finditer(text, events_at):
        value = _number(_float(m.group(1)))
        if value:
            found.append(value)
            if len(found) == 25:
                break
    if not found:
        return None
    ns = (base_ns or 0) + sorted(found)[len(found) // 2] * 1000
    return round(ns) if _wall_ok(0, ns / 1000) else None


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def far_traces(starts: dict[Path, tuple[int, int]],
               records: dict[int, tuple[int, int]]) -> list[tuple[Path, int, str]]:
    """Traces whose times are plausible on their own but ``FAR_NS`` or more away from the job.

    ``starts``: trace -> (rank, start ns); ``records``: rank -> (first, last) call wall ns of
    its record. A trace is far when it is that far from its own rank's record, or, for a rank
    without one, from most of the other ranks' traces and records (at least two of them: with
    one, which side is wrong cannot be told). Returns (trace, rank, why) for each.
    """
    far = []
    for path, (rank, start) in starts.items():
        own = records.get(rank)
        if own is not None:
            gap = _gap(start, own)
            if gap >= FAR_NS:
                far.append((path, rank, f"starts {_days(gap)} from its rank's own record"))
            continue
        gaps = [_gap(start, (s, s)) for p, (r, s) in starts.items() if r != rank]
        gaps += [_gap(start, span) for r, span in records.items() if r != rank]
        away = sorted(g for g in gaps if g >= FAR_NS)
        if len(gaps) >= 2 and len(away) * 2 > len(gaps):
            far.append((path, rank, f"starts {_days(away[0])} or more from {len(away)} of the "
                                    f"other {len(gaps)} ranks' traces and records"))
    return far


def _gap(ns: int, span: tuple[int, int]) -> int:
    return max(span[0] - ns, ns - span[1], 0)


def _days(ns: int) -> str:
    return f"{ns / 86_400e9:.1f} days" if ns >= 86_400e9 else f"{ns / 3_600e9:.1f} hours"


def _partial_gunzip(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(HEADER_BYTES)
        if data[:2] != _GZIP_MAGIC:
            return data
        return zlib.decompressobj(wbits=31).decompress(data, HEADER_BYTES)
    except (OSError, zlib.error):
        return b""


def _int_or_none(info: dict | None, key: str) -> int | None:
    if not info:
        return None
    value = info.get(key)
    try:
        return int(value) if value is not None else None
    except (TypeError, ValueError):
        return None


_DECODE = msgspec.json.Decoder().decode

# The merge's read (``load_trace(..., shapes_as_text=True)``) decodes by declaration: an event
# as a dict of the keys of Chrome's trace event format, its phase one of the format's. Its
# keys are then the declaration's own strings and its phase one of a few, not new strings of
# every event: a real FSDP2 rank with Python stacks (56 MB of JSON) decodes in the same time
# into 35 MB less, and every later lookup of a key finds the very string it asks for; merging
# two such ranks takes 4-8 % less. A key outside the format is left out (the merge reads
# none), and a trace that does not fit (another phase, a bare event array) is decoded whole.
_Phase = Literal["B", "E", "X", "i", "I", "C", "b", "n", "e", "s", "t", "f", "P", "O", "N", "D",
                 "M", "V", "v", "R", "c", "(", ")"]
_Event = TypedDict("_Event", {
    "ph": _Phase, "name": Any, "cat": Any, "ts": Any, "tts": Any, "pid": Any, "tid": Any,
    "dur": Any, "tdur": Any, "args": Any, "id": Any, "id2": Any, "bp": Any, "s": Any,
    "scope": Any, "cname": Any, "sf": Any, "stack": Any, "esf": Any, "estack": Any,
    "bind_id": Any, "flow_in": Any, "flow_out": Any}, total=False)
_Trace = TypedDict("_Trace", {     # the top-level keys Kineto writes
    "traceEvents": list[_Event], "schemaVersion": Any, "deviceProperties": Any,
    "distributedInfo": Any, "baseTimeNanoseconds": Any, "displayTimeUnit": Any,
    "traceName": Any, "trace_id": Any, "host_name": Any, "record_shapes": Any,
    "with_stack": Any, "profile_memory": Any, "with_flops": Any, "with_modules": Any,
    "cuda_driver_version": Any, "cuda_runtime_version": Any, "cupti_version": Any,
    "roctracer_version": Any, "hip_runtime_version": Any}, total=False)
_DECODE_DECLARED = msgspec.json.Decoder(_Trace).decode


def decode_declared(data: bytes) -> Any | None:
    """The merge's read of a trace's text (above), or None where the text does not fit."""
    try:
        return _DECODE_DECLARED(data)
    except ValueError:                 # msgspec's DecodeError and ValidationError
        return None


def parse_json(data: bytes, source: str) -> Any:
    """msgspec, with the stdlib as a fallback for what it refuses (NaN / Infinity literals, lone
    surrogates). Integers keep every digit, as the stdlib reads them."""
    try:
        return _DECODE(data)
    except (msgspec.DecodeError, ValueError) as exc:     # ValueError: bytes that are not UTF-8
        first = exc
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise TraceError(source, f"not valid JSON (truncated or corrupt?): {first}") from None


def load_trace(path: str | os.PathLike[str], *, rank: int | None = None,
               shapes_as_text: bool = False) -> Trace:
    """Load one trace. The rank is ``distributedInfo.rank``, else the file name's, else ``rank``.

    When ``rank`` is given (the caller filed this trace under that rank) and the trace itself
    says another rank, that is an error, never a silent choice. ``shapes_as_text``: each list
    of ``SHAPE_KEYS`` that holds only ints, plain strings and such lists comes as the string
    ``orjson.dumps`` makes of it (``"[[4096,1024],[]]"``), which is what the pftrace writer
    writes of the list: the same merged trace from a third fewer objects (where the C pass is
    built; elsewhere the lists, to the same end). It is the merge's read: the text is decoded
    by declaration (``decode_declared``), each event keeping the keys of Chrome's format.
    """
    path = Path(path)
    source = str(path)
    data = read_bytes(path, shapes_as_text=shapes_as_text)
    if not data or data.isspace():             # (no stripped copy of a big file)
        raise TraceError(source, "empty file")
    doc = decode_declared(data) if shapes_as_text else None
    if doc is None:
        doc = parse_json(data, source)
    del data
    if isinstance(doc, list):                  # Chrome's bare "JSON array" trace format
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict):
        raise TraceError(source, "not a Chrome trace (top level is neither an object nor a list)")
    events = doc.pop("traceEvents", None)
    if not isinstance(events, list):
        raise TraceError(source, "no traceEvents list: not a profiler trace")
    if not any(isinstance(e, dict) and e.get("ph") not in (None, "M") for e in events):
        raise TraceError(source, "empty trace: no events besides metadata")
    info = doc.pop("distributedInfo", None)
    info = info if isinstance(info, dict) else None
    own = _int_or_none(info, "rank")
    named = rank_from_name(path)
    if own is not None:
        if rank is not None and own != rank:
            raise TraceError(source, f"distributedInfo says rank {own}, but the file was filed "
                                     f"under rank {rank}")
        found = own
    elif rank is not None:
        found = rank
    elif named is not None:
        found = named
    else:
        raise TraceError(source, "cannot tell the rank: no distributedInfo.rank and no rank in "
                                 "the file name (name it like trace_rank3.json)")
    base = doc.pop("baseTimeNanoseconds", None)
    try:
        base_ns = int(base) if base is not None else 0
    except (TypeError, ValueError):
        raise TraceError(source, f"baseTimeNanoseconds is not an integer: {base!r}") from None
    props = doc.pop("deviceProperties", None)
    joinable, bounds = scan_loaded(events)
    kept, problems = plausible_events(events, base_ns, source, found, bounds)
    if kept is not events:
        joinable = index_events(kept)
    return Trace(path=path, rank=found, events=kept, base_ns=base_ns, distributed_info=info,
                 device_properties=props if isinstance(props, list) else [], meta=doc,
                 problems=problems, _joinable=(kept, joinable))


def scan_loaded(events: list) -> tuple[list[int], tuple[Any, Any, Any, Any] | None]:
    """``index_events`` and ``time_bounds`` of a trace just decoded, in one pass where the C
    extension is built (each event read once, while it is still in the cache)."""
    if native is not None and events.__class__ is list:
        joinable, bounds = native.scan_loaded(events, JOIN_CATS, NAMED)
        return joinable, bounds if bounds is not None else python_time_bounds(events)
    return index_events(events), time_bounds(events)


def plausible_events(events: list, base_ns: int, source: str, rank: int,
                     bounds: tuple[Any, Any, Any, Any] | None) -> tuple[list, list[str]]:
    """The events whose times can be believed, and one problem naming those that cannot.

    A time is not believed when it is not a finite number, a duration is negative, the wall
    time overflows int64 nanoseconds, or an event lies (or lasts) more than ``SPAN_FACTOR``
    times the trace's own span (its middle half, at least a second) away from it. A trace with
    no believable event is a ``TraceError``: the rank's trace is left out, its record kept.
    ``bounds``: ``time_bounds(events)`` (``scan_loaded`` finds it).
    """
    if bounds is not None:
        lo, hi, longest, shortest = bounds
        usual = SPAN_FACTOR * MIN_SPAN_US
        if (hi - lo <= usual and longest <= usual and shortest >= 0 and _wall_ok(base_ns, lo)
                and _wall_ok(base_ns, hi + longest)):
            return events, []                           # the usual trace: nothing to check
    timed = [e for e in events if e.__class__ is dict and "ts" in e and e.get("ph") != "M"]
    finite = sorted(t for e in timed if (t := _number(e.get("ts"))) is not None
                    and _wall_ok(base_ns, t))
    lo = hi = reach = 0.0
    if finite:
        q_lo, q_hi = finite[len(finite) // 4], finite[-1 - len(finite) // 4]
        reach = SPAN_FACTOR * max(q_hi - q_lo, MIN_SPAN_US)
        lo, hi = q_lo - reach, q_hi + reach
    bad: list[tuple[int, dict, str]] = []
    kept = []
    for i, e in enumerate(events):
        if not isinstance(e, dict) or e.get("ph") == "M" or "ts" not in e:
            kept.append(e)
            continue
        why = _implausible(e, base_ns, lo, hi, reach) if finite else "no finite time at all"
        if why is None:
            kept.append(e)
        else:
            bad.append((i, e, why))
    if not bad:
        return events, []
    shown = "; ".join(f"event #{i} {str(e.get('name'))[:60]!r} ts={e.get('ts')!r} "
                      f"dur={e.get('dur')!r}: {why}" for i, e, why in bad[:3])
    more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
    if not any(isinstance(e, dict) and e.get("ph") != "M" for e in kept):
        raise TraceError(source, f"rank {rank}: no profiler event has a believable time "
                                 f"({len(bad)} events, e.g. {shown}); trace left out")
    return kept, [f"{source}: rank {rank}: {len(bad)} events with unbelievable times skipped: "
                  f"{shown}{more}"]


def time_bounds(events: list) -> tuple[Any, Any, Any, Any] | None:
    """The least and greatest ``ts`` and ``dur`` (0 where absent) of the timed events (dicts
    with a ``ts``, phase not M), or None where some value is not a finite number
    (``python_time_bounds``)."""
    if native is not None:
        bounds = native.time_bounds(events)
        if bounds is not None:
            return bounds
    return python_time_bounds(events)


def python_time_bounds(events: list) -> tuple[Any, Any, Any, Any] | None:
    """``time_bounds`` in Python: the reference for ``_scan.time_bounds`` and the fallback
    (and what decides where the C pass finds a value a double does not hold exactly)."""
    timed = [e for e in events if e.__class__ is dict and "ts" in e and e.get("ph") != "M"]
    try:
        ts = [e["ts"] for e in timed]
        durs = [e.get("dur", 0) for e in timed]
        bounds = (min(ts, default=0.0), max(ts, default=0.0), max(durs, default=0.0),
                  min(durs, default=0.0))
        # sum: a TypeError for any value that is not a number; isfinite: OverflowError for an
        # integer no float holds
        return bounds if math.isfinite(sum(ts, 0.0) + sum(durs, 0.0)) else None
    except (TypeError, OverflowError):
        return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        value = float(value)
    except OverflowError:                   # an integer of more digits than a float holds
        return None
    return value if math.isfinite(value) else None


def _wall_ok(base_ns: int, ts_us: float) -> bool:
    return 0 <= base_ns + ts_us * 1000 <= MAX_NS


def _implausible(e: dict, base_ns: int, lo: float, hi: float, reach: float) -> str | None:
    ts, dur = _number(e.get("ts")), e.get("dur", 0)
    if ts is None:
        return "ts is not a finite number"
    if not _wall_ok(base_ns, ts):
        return "wall time overflows int64 nanoseconds"
    if not lo <= ts <= hi:
        return "far outside the trace's own span"
    dur = _number(dur)
    if dur is None:
        return "dur is not a finite number"
    if dur < 0:
        return "negative duration"
    if dur > reach or not _wall_ok(base_ns, ts + dur):
        return "lasts far longer than the trace's own span"
    return None
