"""Writing Perfetto TrackEvent traces fast: one packet sequence per track, everything interned.

Each (backing) track gets its own ``trusted_packet_sequence_id``. Its first packet clears the
sequence's incremental state and sets two defaults, as Perfetto's own SDK does: the track uuid
(so events carry none) and a sequence-scoped incremental clock (so each timestamp is the small
delta from the previous packet on the track). Event names, categories, debug-annotation names
and string values are interned per sequence (but the strings of an id key, such as an
instance's name, which rarely repeat: those are written in place); the encoded bytes of
repeated annotations are cached. Events of one track are written in nesting order (an END
before a BEGIN at the same time, a parent's BEGIN before its child's), which also keeps the
deltas non-negative.

A profiler event's args repeat but for a few ids (``External id``, ``correlation``, ``Ev Idx``):
per sequence and per key order, the encoded annotations are cached by the args' other values
(``_ArgsPlan``), so an event's args cost one lookup plus its ids, not one step per arg. Which
keys are ids is learnt once per piece: a piece's many alike tracks (one per process group)
start knowing what the first ones found.

A piece (one rank, or the cross-rank part) owns a range of sequence ids and track uuids, so
pieces written separately can be concatenated into one valid trace.
"""

from __future__ import annotations

import math
import struct
from operator import itemgetter
from typing import Any, BinaryIO, Iterable

import orjson

try:                                  # the hot loop in C, built by pip install when it can be
    from commviz.write import _emit as _native
except ImportError:
    _native = None
from commviz.write.proto import (
    CLOCK_BOOTTIME, CLOCK_INCREMENTAL, COUNTER, FIXED64, INSTANT, LEN, LOW14, MERGE_BY_KEY,
    ORDER_EXPLICIT, PROCESS_ORDERING_EXPLICIT, SEQ_CLEARED, SEQ_NEEDS, SLICE_BEGIN, SLICE_END,
    SMALL, VARINT, F, f_bytes, f_str, f_varint, packet, tag, varint)

FLUSH_BYTES = 4 << 20
CACHE_LIMIT = 2048            # past this many distinct values of one key, they are not cached
# a key with more distinct numbers (or strings, most of them new) is an id: left out of the
# args cache key, which keys are ids looked at again at these cache sizes
DYNAMIC_MIN = 64
PLAN_CHECKS = (64, 256, 1024)
PLAN_CACHE_MAX = 4096         # args of one key order cached per sequence, at most
_pack_double = struct.Struct("<d").pack
_pack_u64 = struct.Struct("<Q").pack

# field tags and fixed parts of the hot path, encoded once
_ANN = tag(F.ANNOTATIONS, LEN)
_TE_BEGIN = f_varint(F.TYPE, SLICE_BEGIN)
_TE_INSTANT = f_varint(F.TYPE, INSTANT)
_FLOW = tag(F.FLOW_IDS, FIXED64)
_A_INT = tag(F.A_INT, VARINT)
_A_DOUBLE = tag(F.A_DOUBLE, FIXED64)
_A_STRING_IID = tag(F.A_STRING_IID, VARINT)
_A_STRING = tag(F.A_STRING, LEN)
_TS = tag(F.TIMESTAMP, VARINT)
_INTERNED = tag(F.INTERNED, LEN)
_TRACK_EVENT = tag(F.TRACK_EVENT, LEN)
_INT63 = 1 << 63


def flow_field(flow_id: int) -> bytes:
    """The bytes that attach one flow id to an event (append to its ``flows`` entry)."""
    return _FLOW + _pack_u64(flow_id)


def _wrap(inner: bytes) -> bytes:
    return _ANN + varint(len(inner)) + inner


class Sequence:
    """One track's packet sequence: its interning tables, caches and running clock."""

    __slots__ = ("seq_id", "uuid", "last_ts", "head", "end_hdr", "end_tail", "names", "cats",
                 "keys", "strings", "next_iid", "pending", "plans", "ids")

    def __init__(self, seq_id: int, uuid: int, ids: set[str] | None = None) -> None:
        self.seq_id = seq_id
        self.uuid = uuid
        self.ids = set() if ids is None else ids   # keys found to be ids (shared in a piece)
        self.last_ts: int | None = None
        self.head = f_varint(F.SEQ_ID, seq_id) + f_varint(F.FLAGS, SEQ_NEEDS)
        self.end_tail = self.head + f_bytes(F.TRACK_EVENT, f_varint(F.TYPE, SLICE_END))
        # END packet header for each length of the timestamp delta varint (1..10 bytes)
        self.end_hdr = [b""] + [b"\x0a" + varint(1 + n + len(self.end_tail)) + _TS
                                for n in range(1, 11)]
        self.names: dict[str, bytes] = {}          # event name -> name_iid field bytes
        self.cats: dict[str, bytes] = {}           # category -> category_iids field bytes
        # annotation key -> [name part, str/JSON cache, int cache, float cache, strings encoded]
        # (a cache None: that key's values are ids, not cached; strings written in place)
        self.keys: dict[str, list] = {}
        self.strings: dict[Any, int] = {}          # interned string values (str or JSON bytes)
        self.next_iid = 1
        self.pending = bytearray()                 # InternedData entries not yet written
        self.plans: dict[tuple, _ArgsPlan] = {}     # args key order -> its encoded-args cache

    # -- interning (cache misses only) ----------------------------------------------------------
    def _iid(self) -> int:
        iid = self.next_iid
        self.next_iid += 1
        return iid

    def _define(self, field: int, iid: int, text: str | bytes, str_field: int = 2) -> None:
        data = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")
        self.pending += f_bytes(field, f_varint(1, iid) + f_bytes(str_field, data))

    def name(self, name: str) -> bytes:
        iid = self._iid()
        self._define(F.I_NAMES, iid, name)
        out = self.names[name] = f_varint(F.NAME_IID, iid)
        return out

    def cat(self, cat: str) -> bytes:
        iid = self._iid()
        self._define(F.I_CATEGORIES, iid, cat)
        out = self.cats[cat] = f_varint(F.CATEGORY_IIDS, iid)
        return out

    def key(self, key: str) -> list:
        iid = self._iid()
        self._define(F.I_ANNOTATION_NAMES, iid, key)
        known = key in self.ids
        entry = self.keys[key] = [f_varint(F.A_NAME_IID, iid), None if known else {},
                                  None if known else {}, {}, 0]
        return entry

    def ann_str(self, entry: list, value: str | bytes) -> bytes:
        """Annotation with a string value (``value`` bytes = JSON text of a list): interned,
        or in place for an id key (most of whose strings are new)."""
        cache = entry[1]
        if cache is None:
            return _ann_text(entry[0], value)
        if len(cache) >= CACHE_LIMIT:
            entry[1] = None
            return _ann_text(entry[0], value)
        iid = self.strings.get(value)
        if iid is None:
            iid = self.strings[value] = self._iid()
            self._define(F.I_STRINGS, iid, value)
        out = entry[1][value] = _wrap(entry[0] + _A_STRING_IID + varint(iid))
        return out

    def ann_int(self, entry: list, value: int) -> bytes:
        if not -(1 << 63) <= value < 1 << 63:
            return self.ann_str(entry, str(value))
        out = _wrap(entry[0] + _A_INT + varint(value))
        cache = entry[2]
        if cache is not None:
            if len(cache) < CACHE_LIMIT:
                cache[value] = out
            else:
                entry[2] = None            # a key of mostly unique values (ids): stop caching
        return out

    def ann_float(self, entry: list, value: float) -> bytes:
        out = _wrap(entry[0] + _A_DOUBLE + _pack_double(value))
        if len(entry[3]) < CACHE_LIMIT:
            entry[3][value] = out
        return out

    def ann_value(self, entry: list, value: Any) -> bytes:
        """Any other value: bools, None, dicts and other JSON values (as JSON strings)."""
        if type(value) is bool:
            return _wrap(entry[0] + f_varint(F.A_BOOL, int(value)))
        try:
            text = orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS)
        except TypeError:
            text = orjson.dumps(str(value))
        cached = entry[1].get(text) if entry[1] is not None else None
        return cached if cached is not None else self.ann_str(entry, text)

    def interned_part(self) -> bytes:
        """The TracePacket.interned_data field for what is pending (and clear it)."""
        if not self.pending:
            return b""
        out = _INTERNED + varint(len(self.pending)) + bytes(self.pending)
        self.pending.clear()
        return out

    # -- packets ----------------------------------------------------------------------------
    def start(self, ts: int) -> bytes:
        """First packet: clear state, default track + incremental clock, clock snapshot."""
        self.last_ts = ts
        clocks = (f_bytes(F.CS_CLOCKS, f_varint(F.CL_ID, CLOCK_BOOTTIME) + f_varint(F.CL_TIMESTAMP, ts))
                  + f_bytes(F.CS_CLOCKS, f_varint(F.CL_ID, CLOCK_INCREMENTAL)
                            + f_varint(F.CL_TIMESTAMP, ts) + f_varint(F.CL_INCREMENTAL, 1)))
        defaults = (f_varint(F.PD_CLOCK_ID, CLOCK_INCREMENTAL)
                    + f_bytes(F.PD_TRACK_EVENT_DEFAULTS, f_varint(F.TD_TRACK_UUID, self.uuid)))
        return packet(f_varint(F.TIMESTAMP, ts) + f_varint(F.CLOCK_ID, CLOCK_BOOTTIME)
                      + f_varint(F.SEQ_ID, self.seq_id)
                      + f_varint(F.FLAGS, SEQ_CLEARED | SEQ_NEEDS)
                      + f_bytes(F.CLOCK_SNAPSHOT, clocks) + f_bytes(F.DEFAULTS, defaults))

    def event(self, ts: int, track_event: bytes) -> bytes:
        """Any TrackEvent packet (counters, summary slices): not the hot path."""
        delta = ts - self.last_ts
        if delta < 0:
            raise ValueError(f"track {self.uuid}: events must be written in time order")
        self.last_ts = ts
        return packet(_TS + varint(delta) + self.head + self.interned_part()
                      + f_bytes(F.TRACK_EVENT, track_event))

    def counters(self, samples: list[tuple[int, float]]) -> bytearray:
        """A counter track's (ts, value) samples in time order, each as ``event`` with
        ``counter_event`` writes it, in one loop: a run's bandwidth counters hold tens of
        thousands, and only the time delta and the value change from one to the next."""
        out = bytearray()
        if not samples:
            return out
        out += self.event(samples[0][0], counter_event(samples[0][1]))   # any interned data
        rest = self.head + f_bytes(F.TRACK_EVENT, counter_event(0.0))[:-8]
        last = self.last_ts
        for ts, value in samples[1:]:
            if ts < last:
                raise ValueError(f"track {self.uuid}: events must be written in time order")
            body = _TS + varint(ts - last) + rest + _pack_double(float(value))
            out += b"\x0a" + varint(len(body)) + body
            last = ts
        self.last_ts = last
        return out


def _ann_text(name: bytes, value: str | bytes) -> bytes:
    """An annotation with its string value in place (not interned)."""
    data = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
    return _wrap(name + _A_STRING + varint(len(data)) + data)


def _is_id(entry: list) -> bool:
    """Whether an annotation key has had many distinct numbers, or many strings most of which
    were new (an id, not a setting)."""
    strings = entry[1]
    return (entry[2] is None or strings is None or len(entry[2]) > DYNAMIC_MIN
            or len(entry[3]) > DYNAMIC_MIN
            or len(strings) > DYNAMIC_MIN and 2 * len(strings) > entry[4])


class _ArgsPlan:
    """The encoded annotations of one args key order on one sequence, cached by the values of
    its non-id keys (their JSON); the ids (ints and floats of keys with many distinct values)
    are encoded per event between the cached byte runs.

    A cached run only holds strings the sequence has interned already (an event with the same
    values interned them), so a hit writes exactly what the per-arg encoding would.
    """

    __slots__ = ("ids", "pos", "fixed", "n_fixed", "cache", "next_check")

    def __init__(self, seq: Sequence, keys: tuple) -> None:
        entries = [seq.keys[k] for k in keys]
        self.pos = [i for i, e in enumerate(entries) if _is_id(e)]
        self.ids = [(keys[i], entries[i][0] + _A_INT, entries[i][0] + _A_DOUBLE, entries[i][0])
                    for i in self.pos]
        for i in self.pos:                  # an id here is one on the piece's other tracks
            seq.ids.add(keys[i])
            entries[i][1] = entries[i][2] = None
        fixed = [k for i, k in enumerate(keys) if i not in self.pos]
        self.n_fixed = len(fixed)
        # the non-id values (a bare value for one key): their JSON is the cache key
        self.fixed = itemgetter(*fixed) if fixed else None
        self.cache: dict[bytes, tuple[bytes, ...]] = {}
        self.next_check = 0

    def same_ids(self, seq: Sequence, keys: tuple) -> bool:
        return self.pos == [i for i, k in enumerate(keys) if _is_id(seq.keys[k])]

    def store(self, key: bytes, args: dict, encoded: list[bytes]) -> None:
        """Cache one event's per-arg encodings as byte runs around its ids."""
        fixed = self.fixed(args) if self.fixed is not None else ()
        for v in (fixed if self.n_fixed != 1 else (fixed,)):
            # JSON null is None, NaN and infinity alike: only the first is a string annotation
            if v is None or (v.__class__ is float and not math.isfinite(v)):
                return
        runs, prev = [], 0
        for i in self.pos:
            runs.append(b"".join(encoded[prev:i]))
            prev = i + 1
        runs.append(b"".join(encoded[prev:]))
        self.cache[key] = tuple(runs)


def _plan(seq: Sequence, keys: tuple) -> _ArgsPlan | None:
    """The args plan of a key order, made or made again as the sequence learns which keys are
    ids; None while some key has never been encoded on this sequence."""
    plan = seq.plans.get(keys)
    if plan is None:
        if not all(k in seq.keys for k in keys):
            return None
        plan = seq.plans[keys] = _ArgsPlan(seq, keys)
    size = len(plan.cache)
    if size >= plan.next_check:
        if size and not plan.same_ids(seq, keys):
            plan = seq.plans[keys] = _ArgsPlan(seq, keys)
        plan.next_check = next((n for n in PLAN_CHECKS if n > size), PLAN_CACHE_MAX + 1)
    return plan


def python_emit_slices(seq: Sequence, out: bytearray, items: Iterable[tuple[int, int, int]],
                       events: list[dict], extra: dict[int, dict] | None = None,
                       flows: dict[int, bytes] | None = None) -> int:
    """Write one backing track's slices; return how many.

    ``items`` are ``(start_ns, -end_ns, index)`` sorted, already known to nest (``split``);
    ``events[index]`` gives ``name``, ``cat`` and ``args`` (Chrome trace event layout).
    ``extra[index]``: args to add; ``flows[index]``: encoded flow ids (``flow_field``).
    A zero-duration slice is an INSTANT. This is the hot loop: everything is inlined. Where
    commviz's C extension is built, ``emit_slices`` is its port of this loop (``_emit.c``),
    which writes the same bytes (tests/test_write_emit.py); this one is the reference and
    serves where no compiler was at hand.
    """
    names, cats, keys, plans = seq.names, seq.cats, seq.keys, seq.plans
    head, end_hdr, end_tail = seq.head, seq.end_hdr, seq.end_tail
    head_len = len(head)
    pending = seq.pending
    small, big, low14 = SMALL, varint, LOW14
    dumps = orjson.dumps
    extra = extra or {}
    flows = flows or {}
    last = seq.last_ts
    stack: list[int] = []
    count = 0
    for start, neg_end, index in items:
        while stack and stack[-1] <= start:
            t = stack.pop()
            d = t - last
            last = t
            vd = (small[d] if d < 16384 else low14[d & 0x3FFF] + small[d >> 14]
                  if d < 0x10000000 else big(d))
            out += end_hdr[len(vd)] + vd + end_tail
        ev = events[index]
        name = ev.get("name", "")
        nb = names.get(name)
        if nb is None:
            nb = seq.name(str(name))
        parts = [_TE_INSTANT if start == -neg_end else _TE_BEGIN, nb]
        cat = ev.get("cat")
        if cat:
            cb = cats.get(cat)
            if cb is None:
                cb = seq.cat(str(cat))
            parts.append(cb)
        args = ev.get("args")
        more = extra.get(index)
        if more:
            args = {**args, **more} if args else more
        if args:
            order = tuple(args)
            plan = plans.get(order)
            if plan is None:
                plan = _plan(seq, order)
            runs = ck = None
            if plan is not None:
                try:
                    ck = dumps(plan.fixed(args)) if plan.fixed is not None else b""
                except TypeError:           # an integer past 64 bits, a non-str dict key
                    ck = None
                else:
                    runs = plan.cache.get(ck)
            n0 = len(parts)
            if runs is not None:            # cached: only the ids are encoded
                parts.append(runs[0])
                j = 1
                for k, p_int, p_double, p_name in plan.ids:
                    v = args[k]
                    if v.__class__ is int and 0 <= v < _INT63:
                        inner = p_int + (small[v] if v < 16384 else low14[v & 0x3FFF] + small[
                            v >> 14] if v < 0x10000000 else big(v))
                        parts.append(_ANN + small[len(inner)] + inner)
                    elif v.__class__ is float:
                        inner = p_double + _pack_double(v)
                        parts.append(_ANN + small[len(inner)] + inner)
                    elif v.__class__ is str:
                        parts.append(_ann_text(p_name, v))
                    else:                   # an id of another type: encoded arg by arg
                        del parts[n0:]
                        runs = None
                        break
                    parts.append(runs[j])
                    j += 1
        if args and runs is None:
            for k, v in args.items():
                entry = keys.get(k)
                if entry is None:
                    entry = seq.key(str(k))
                t = type(v)
                if t is str:
                    entry[4] += 1
                    cache = entry[1]
                    b = cache.get(v) if cache is not None else None
                    if b is None:
                        b = seq.ann_str(entry, v)
                elif t is int:
                    cache = entry[2]
                    if cache is None and 0 <= v < 1 << 62:      # ids: encode, do not cache
                        inner = entry[0] + _A_INT + big(v)
                        b = _ANN + small[len(inner)] + inner
                    else:
                        b = cache.get(v) if cache is not None else None
                        if b is None:
                            b = seq.ann_int(entry, v)
                elif t is list:
                    try:
                        text = dumps(v)
                    except TypeError:       # an integer past 64 bits: as any other value
                        b = seq.ann_value(entry, v)
                    else:
                        entry[4] += 1
                        cache = entry[1]
                        b = cache.get(text) if cache is not None else None
                        if b is None:
                            b = seq.ann_str(entry, text)
                elif t is float:
                    b = entry[3].get(v)
                    if b is None:
                        b = seq.ann_float(entry, v)
                else:
                    b = seq.ann_value(entry, v)
                parts.append(b)
            if ck is not None and len(plan.cache) < PLAN_CACHE_MAX:
                plan.store(ck, args, parts[n0:])
                if len(plan.cache) >= plan.next_check:
                    _plan(seq, order)       # which keys are ids, looked at again
        f = flows.get(index)
        if f:
            parts.append(f)
        te = b"".join(parts)
        d = start - last
        last = start
        vd = (small[d] if d < 16384 else low14[d & 0x3FFF] + small[d >> 14]
              if d < 0x10000000 else big(d))
        n = len(te)
        lte = small[n] if n < 16384 else big(n)
        if pending:
            body = b"".join((_TS, vd, head, _INTERNED, big(len(pending)), pending, _TRACK_EVENT,
                             lte, te))
            pending.clear()
            out += b"\x0a"
            out += big(len(body))
            out += body
        else:
            n += 2 + len(vd) + head_len + len(lte)
            out += b"".join((b"\x0a", small[n] if n < 16384 else big(n), _TS, vd, head,
                             _TRACK_EVENT, lte, te))
        if start != -neg_end:
            stack.append(-neg_end)
        count += 1
    while stack:
        t = stack.pop()
        d = t - last
        last = t
        vd = (small[d] if d < 16384 else low14[d & 0x3FFF] + small[d >> 14]
              if d < 0x10000000 else big(d))
        out += end_hdr[len(vd)] + vd + end_tail
    seq.last_ts = last
    return count


if _native is not None:
    _native.setup(ann=_ANN, te_begin=_TE_BEGIN, te_instant=_TE_INSTANT, ts=_TS,
                  interned=_INTERNED, track_event=_TRACK_EVENT, a_int=_A_INT,
                  a_string=_A_STRING, plan=_plan, dumps=orjson.dumps,
                  plan_cache_max=PLAN_CACHE_MAX)
    emit_slices = _native.emit_slices
else:
    emit_slices = python_emit_slices


def split(items: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Spread sorted ``(start, -end, index)`` items over the fewest backing tracks that nest
    (``python_split``; its C port where built)."""
    if _native is not None:
        backs = _native.split(items)
        if backs is not None:
            return backs
    return python_split(items)


def python_split(items: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Spread sorted ``(start, -end, index)`` items over the fewest backing tracks that nest.

    A slice goes on the first backing track where it fits inside the innermost open slice (or
    where nothing is open); crossing slices open another. No time is moved. The reference for
    ``_emit.split`` and its fallback.
    """
    backs: list[list[tuple[int, int, int]]] = []
    stacks: list[list[int]] = []
    for item in items:
        start, end = item[0], -item[1]
        n = 0
        for stack in stacks:
            while stack and stack[-1] <= start:
                stack.pop()
            if not stack or stack[-1] >= end:
                backs[n].append(item)
                stack.append(end)
                break
            n += 1
        else:
            backs.append([item])
            stacks.append([end])
    return backs


def track_descriptor(uuid: int, *, name: str | None = None, parent: int | None = None,
                     pid: int | None = None, process_name: str | None = None,
                     labels: Iterable[str] = (), explicit_children: bool = False,
                     order_rank: int | None = None, merge_key: str | None = None,
                     description: str | None = None, counter: bool = False,
                     counter_unit: int | None = None, counter_unit_name: str | None = None,
                     y_axis_key: str | None = None, explicit_processes: bool = False) -> bytes:
    """A TrackDescriptor message (only the fields commviz uses)."""
    out = f_varint(F.D_UUID, uuid)
    if name is not None:
        out += f_str(F.D_NAME, name)
    if pid is not None:
        proc = f_varint(F.P_PID, pid)
        if process_name is not None:
            proc += f_str(F.P_NAME, process_name)
        for label in labels:
            proc += f_str(F.P_LABELS, label)
        out += f_bytes(F.D_PROCESS, proc)
    if parent is not None:
        out += f_varint(F.D_PARENT, parent)
    if counter:
        spec = f_varint(F.C_UNIT, counter_unit) if counter_unit is not None else b""
        if counter_unit_name is not None:
            spec += f_str(F.C_UNIT_NAME, counter_unit_name)
        if y_axis_key is not None:
            spec += f_str(F.C_Y_AXIS_SHARE_KEY, y_axis_key)
        out += f_bytes(F.D_COUNTER, spec)
    if explicit_children:
        out += f_varint(F.D_CHILD_ORDERING, ORDER_EXPLICIT)
    if order_rank is not None:
        out += f_varint(F.D_ORDER_RANK, order_rank)
    if description is not None:
        out += f_str(F.D_DESCRIPTION, description)
    if merge_key is not None:
        out += f_varint(F.D_MERGE_BEHAVIOR, MERGE_BY_KEY) + f_str(F.D_MERGE_KEY, merge_key)
    if explicit_processes:
        out += f_varint(F.D_PROCESS_ORDERING, PROCESS_ORDERING_EXPLICIT)
    return out


_COUNTER_HEAD = f_varint(F.TYPE, COUNTER) + tag(F.DOUBLE_COUNTER_VALUE, FIXED64)


def counter_event(value: float) -> bytes:
    """A TYPE_COUNTER TrackEvent (double value)."""
    return _COUNTER_HEAD + _pack_double(float(value))


class Piece:
    """A range of sequence ids and track uuids, written to one file: a rank or the cross part.

    ``piece_id`` 0 is the cross-rank piece, rank R is piece R + 1. Track uuids are
    ``piece_id << 32 | n`` and sequence ids ``piece_id << 12 | n`` (n >= 1), so pieces never
    collide and the root track (uuid 0) is never taken.

    A sequence id is a uint32 and each backing track takes one. A rank's piece holds its own
    threads, streams and lanes (4,095 at most); the cross-rank piece holds every process
    group's tracks, which grow with the job (16,384 ranks of TP 8: 2,057 groups, two tracks
    each). So the rank pieces keep the lower half of the id space (2**19 - 1 ranks) and the
    cross-rank piece, written by one process, goes on into the upper half (2**31 ids).
    """

    MAX_SEQUENCES = (1 << 12) - 1
    MAX_PIECES = 1 << 19
    _CROSS_MORE = 1 << 31                     # the cross-rank piece's ids past its first 4,095

    def __init__(self, out: BinaryIO, piece_id: int) -> None:
        if not 0 <= piece_id < self.MAX_PIECES:
            raise ValueError(f"piece {piece_id}: commviz writes at most 2**19 - 1 ranks")
        self.file = out
        self.piece_id = piece_id
        self.buf = bytearray()
        self._uuids = 0
        self._seqs = 0
        self.descriptor_seq = self._next_seq()
        self._desc_head = f_varint(F.SEQ_ID, self.descriptor_seq)
        self.packets_bytes = 0
        self.ids: set[str] = set()            # annotation keys its tracks found to be ids

    def _next_seq(self) -> int:
        self._seqs += 1
        if self._seqs <= self.MAX_SEQUENCES:
            return self.piece_id << 12 | self._seqs
        more = self._seqs - self.MAX_SEQUENCES
        if self.piece_id == 0 and more < self._CROSS_MORE:
            return self._CROSS_MORE | more
        raise ValueError(f"piece {self.piece_id}: more than {self.MAX_SEQUENCES} tracks")

    def new_uuid(self) -> int:
        self._uuids += 1
        return self.piece_id << 32 | self._uuids

    def sequence(self, uuid: int) -> Sequence:
        return Sequence(self._next_seq(), uuid, self.ids)

    def descriptor(self, desc: bytes) -> None:
        self.buf += packet(self._desc_head + f_bytes(F.TRACK_DESCRIPTOR, desc))

    def maybe_flush(self) -> None:
        if len(self.buf) >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            self.file.write(self.buf)
            self.packets_bytes += len(self.buf)
            self.buf.clear()

