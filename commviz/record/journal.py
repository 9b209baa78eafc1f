"""A per-rank journal of records as they are made, in a memory-mapped file: SIGKILL loses nothing.

The pickle ``commviz_rank{R}.pkl`` is written at exit, on SIGTERM and every flush interval; a
rank killed outright (SIGKILL, the OOM killer) never writes it. So every ``Recorder.append``
also lands in ``RUN_DIR/commviz_rank{R}.{gen}.journal``: stores into a shared file mapping go
to the kernel's page cache, which outlives the process, so no syscall is needed per record.
Blocks are reserved with ``posix_fallocate`` (a full disk is then an error here, not a SIGBUS).

Per call only a fixed 37-byte entry is written (shape id, seq, times, ordinal): what a call
site repeats (op, group, sizes, dtype, call site, extras) is a *shape*, written once as JSON.
Calls the boundary kernel records natively go to a sibling file per generation,
``commviz_rank{R}.{gen}.calls``, written by the kernel itself (``NATIVE_CALL`` entries whose
shapes, ``T_NSHAPE``, and errors, ``T_ERROR``, are JSON entries here).
Entries are ``<u32 body length><u8 type><body>``; a JSON entry's header is stored after its
body, a call entry's ordinal is its last field, so a torn last entry reads as absent. Times
are set after ``append`` (the call has not run yet), so a ticker patches them in place every
0.1 s, marks calls still running, and stamps a "last seen alive" time: the call a killed rank
hung in is rebuilt ending then, saying it never returned.

After each successful flush the journal starts a new generation and drops the old ones: the
pickle holds those records. ``recover`` rebuilds a rank's record (pickle + newer journal
entries, or the journal alone) as plain data; reading parses JSON and integers only.
"""

from __future__ import annotations

import mmap
from array import array
import os
import re
import socket
import struct
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import orjson

from commviz import metadata as md
from commviz.errors import RecordError
from commviz.record import schema

HEAD = struct.Struct("<IB")                 # body length, entry type
CALL = struct.Struct("<IBIqqqq")            # header + shape id, seq, t_begin, t_end, ordinal
TIMES = struct.Struct("<qq")
TIMES_AT = HEAD.size + 4 + 8                # where t_begin/t_end sit in a call entry
CALL_BODY = CALL.size - HEAD.size
# (T_META, a call's metadata as JSON, is written no more since 2026-11-26; older journals have it)
T_HEADER, T_GROUP, T_EXTRA, T_SHAPE, T_META, T_CALL, T_ALIVE, T_NSHAPE, T_ERROR = b"hgesmcaNE"
ALIVE = struct.Struct("<q")                 # the ticker's last "still alive" wall time
RUNNING = -1                                # t_end of a call still running at that time
# The boundary kernel's calls file (boundary.cpp ``Call``), one per generation beside it:
# a magic line, then fixed entries (shape index, flags, seq, pair, t_begin, t_end, ordinal);
# files of version 1 (written before p2p calls were recorded natively) have no pair.
NATIVE_CALL = struct.Struct("<iiqqqqq")
CALLS_MAGIC = b"commviz.calls.2\n"
_CALLS_V1 = (b"commviz.calls.1\n", struct.Struct("<iiqqqq"))
FAILED = 1                                  # NATIVE_CALL flag: the call raised
CAPTURED = 2                                # NATIVE_CALL flag: it ran under CUDA graph capture
NATIVE_FAILED = "failed (its error text was not kept)"
NEVER_RETURNED = ("never returned: still running when its process was last seen alive; the end "
                  "shown is that time (from the journal)")
CHUNK = 64 << 10                            # first reservation; doubles up to MAX_STEP
MAX_STEP = 16 << 20
TICK_S = 0.1                                # how late a call's times reach the file
LOCK_WAIT_S = 0.1                           # a flush waits this long for the recorder's lock
CACHE_LIMIT = 4096                          # extras/shapes remembered before starting afresh
EXIT = "journal"                            # exit reason of a record rebuilt from a journal
_FIELDS = md.R_SEQ                          # compact record fields 0..R_SEQ-1 make the shape
_LINE, _EXTRA, _SEQ = md.R_LINE, md.R_EXTRA, md.R_SEQ
_pack_call = CALL.pack_into
_JSON_OPTS = orjson.OPT_NON_STR_KEYS
_GEN_RE = re.compile(r"commviz_rank(\d+)\.(\d+)\.journal$")


def journal_name(rank: int, gen: int) -> str:
    return f"commviz_rank{rank}.{gen}.journal"


def calls_path(journal: Path) -> Path:
    """The boundary kernel's calls file of a journal generation."""
    return journal.with_suffix(".calls")


def journal_paths(run_dir: Path, rank: int) -> list[Path]:
    """Rank ``rank``'s journal generations in ``run_dir``, oldest first."""
    found = [(int(m.group(2)), p) for p in run_dir.glob(f"commviz_rank{rank}.*.journal")
             if (m := _GEN_RE.search(p.name)) and int(m.group(1)) == rank]
    return [p for _, p in sorted(found)]


def journal_ranks(run_dir: Path) -> list[int]:
    return sorted({int(m.group(1)) for p in run_dir.glob("commviz_rank*.journal")
                   if (m := _GEN_RE.search(p.name))})


def _json(value: Any) -> bytes:
    return orjson.dumps(value, option=_JSON_OPTS, default=repr)


class _Segment:
    """One generation's file, mapped and grown in reserved steps."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.calls: Path | None = None          # the boundary kernel's calls file beside it
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.size = 0
        self.map: mmap.mmap | None = None
        self.pos = 0
        try:
            self.reserve(CHUNK)
        except OSError:                          # no room: leave no empty file behind
            os.close(self.fd)
            path.unlink(missing_ok=True)
            raise

    def reserve(self, need: int) -> None:
        """Make room for ``need`` more bytes (raises OSError, e.g. ENOSPC)."""
        if self.pos + need <= self.size:
            return
        size = max(self.size + min(max(self.size, CHUNK), MAX_STEP), self.pos + need)
        os.posix_fallocate(self.fd, 0, size)
        if self.map is not None:
            self.map.close()
        self.map = mmap.mmap(self.fd, size)
        self.size = size

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
            self.map = None
        os.close(self.fd)


@contextmanager
def flush_lock(lock: Any) -> Iterator[bool]:
    """The recorder's lock for a flush, unless it cannot be had within ``LOCK_WAIT_S``: a
    flush from a signal handler may interrupt this very thread while it holds the lock
    (recording a call, or flushing at exit); waiting would deadlock. Yields whether it is held."""
    got = lock.acquire(timeout=LOCK_WAIT_S)
    try:
        yield got
    finally:
        if got:
            lock.release()


class Journal:
    """Journals one rank's records under ``run_dir``; ``add`` runs under the recorder's lock."""

    def __init__(self, run_dir: Path, lock: threading.Lock,
                 native: Callable[[], Any] = lambda: None) -> None:
        self.run_dir = run_dir
        self._lock = lock
        self._native = native               # the boundary kernel's ring, when it is in
        self.error: str | None = None       # why journaling stopped (a full disk, say)
        self._rank: int | None = None
        self._gen = 0
        self._seg: _Segment | None = None
        self._limit = 0                     # past this offset, make room before writing
        self._alive_at = 0                  # offset of the "last seen alive" time
        self._path = run_dir                # the generation being written (named in errors)
        self._old: list[_Segment] = []      # rotated generations, dropped once flushed
        # records whose times are not in the file yet, and their entries' offsets (two flat
        # sequences: a tuple per call would be a GC-tracked object per call)
        self._waiting: list[Any] = []
        self._waiting_at = array("q")
        self._groups: dict[int, tuple[Any, int]] = {}
        self._extras: dict[int, tuple[Any, int]] = {}
        self._extra_ids: dict[bytes, int] = {}
        self._sites: dict[Any, tuple[list, Any, int]] = {}
        self._shapes: dict[bytes, int] = {}
        self._native_shapes: set[int] = set()   # native shapes written to this generation
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    # -- hot path ---------------------------------------------------------------------------
    def add(self, rec: list[Any], ordinal: int) -> None:
        """Journal one compact record; ``ordinal`` is the recorder's count after appending it."""
        seg = self._seg
        if seg is None or seg.pos > self._limit:
            seg = self._prepare()
            if seg is None:
                return
        site = self._sites.get(rec[_LINE])
        if site is None or rec[_EXTRA] is not site[1] or rec[:_FIELDS] != site[0]:
            site = self._shape(rec)
        sid, seq = site[2], rec[_SEQ]
        pos = seg.pos
        _pack_call(seg.map, pos, CALL_BODY, T_CALL, sid, -1 if seq is None else seq, 0, 0,
                   ordinal)
        seg.pos = pos + CALL.size
        self._waiting.append(rec)
        self._waiting_at.append(pos)

    def native_shape(self, index: int, fields: list, extra: Any) -> None:
        """Before the boundary kernel records a call of shape ``index`` natively: the shape is
        in this generation and the kernel writes to its calls file."""
        seg = self._seg
        if seg is None or seg.pos > self._limit:
            seg = self._prepare()
            if seg is None:
                return
        if index not in self._native_shapes:
            self._write(T_NSHAPE, _json([index, *self._shape_body(fields, extra)]))
            self._native_shapes.add(index)
        if seg.calls is None:
            native = self._native()
            if native is not None:
                path = calls_path(seg.path)
                err = native.calls_open(str(path))
                if err:
                    self._fail(OSError(err, os.strerror(err), str(path)))
                    return
                seg.calls = path

    def note_error(self, ordinal: int, error: str) -> None:
        """A natively recorded call raised."""
        if self._seg is not None and self.error is None:
            try:
                self._write_json(T_ERROR, [ordinal, error])
            except OSError as exc:
                self._fail(exc)

    # -- shapes, groups, extras -------------------------------------------------------------
    def _shape_body(self, fields: list, extra: Any) -> list:
        """A shape as JSON: its record fields with the group as its entry id, its extra's id."""
        fields = list(fields)
        fields[md.R_INFO] = self._group(fields[md.R_INFO])
        return [fields, self._extra(extra)]

    def _shape(self, rec: list) -> tuple[list, Any, int]:
        extra = rec[md.R_EXTRA]
        body = _json(self._shape_body(rec[:_FIELDS], extra))
        sid = self._shapes.get(body)
        if sid is None:
            if len(self._shapes) > CACHE_LIMIT:
                self._forget()
            sid = self._shapes[body] = self._write(T_SHAPE, body)
        if len(self._sites) > CACHE_LIMIT:
            self._sites.clear()
        site = self._sites[rec[_LINE]] = (rec[:_FIELDS], extra, sid)
        return site

    def _group(self, info: Any) -> int:
        known = self._groups.get(id(info))
        if known is not None and known[0] is info:
            return known[1]
        row = dict(info.table_row(), ranks_str=info.ranks_str)
        gid = self._write_json(T_GROUP, row)
        self._groups[id(info)] = (info, gid)     # the info is kept alive: its id stays its own
        return gid

    def _extra(self, extra: Any) -> int:
        if extra is None:
            return 0
        known = self._extras.get(id(extra))
        if known is not None and known[0] is extra:
            return known[1]
        body = _json(extra)
        eid = self._extra_ids.get(body)
        if eid is None:
            eid = self._extra_ids[body] = self._write(T_EXTRA, body)
        if len(self._extras) > CACHE_LIMIT:       # fresh dicts per call must not pile up
            self._extras.clear()
        self._extras[id(extra)] = (extra, eid)
        return eid

    def _forget(self) -> None:
        self._sites.clear()
        self._shapes.clear()
        self._extras.clear()
        self._extra_ids.clear()

    def _write_json(self, kind: int, value: Any) -> int:
        return self._write(kind, _json(value))

    def _write(self, kind: int, body: bytes) -> int:
        """Append a JSON entry (body first, header last); its offset is its id."""
        seg = self._seg
        assert seg is not None
        seg.reserve(HEAD.size + len(body) + 512)
        pos = seg.pos
        seg.map[pos + HEAD.size:pos + HEAD.size + len(body)] = body
        HEAD.pack_into(seg.map, pos, len(body), kind)
        seg.pos = pos + HEAD.size + len(body)
        return pos + 1                            # ids are nonzero (0: no extra)

    # -- files ------------------------------------------------------------------------------
    def _prepare(self) -> _Segment | None:
        """Open (or grow) the current generation."""
        if self.error is not None:
            return None
        try:
            if self._seg is None:
                self._open()
            else:
                self._seg.reserve(512)
            self._limit = self._seg.size - 512
        except OSError as exc:
            self._fail(exc)
            return None
        return self._seg

    def _open(self) -> None:
        import torch.distributed as dist

        if self._rank is None:
            self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() \
                else int(os.environ.get("RANK", 0))
        self._gen += 1
        self._forget_waiting()
        self._groups.clear()
        self._forget()
        self._native_shapes.clear()
        self._path = self.run_dir / journal_name(self._rank, self._gen)
        self._seg = _Segment(self._path)
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() \
            else int(os.environ.get("WORLD_SIZE", 1))
        self._write_json(T_HEADER, {
            "rank": self._rank, "world_size": world,
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)), "host": socket.gethostname(),
            "pid": os.getpid(), "start_ns": time.time_ns(),
            "backend": str(dist.get_backend()) if dist.is_available() and dist.is_initialized()
            else "none"})
        self._alive_at = self._write(T_ALIVE, ALIVE.pack(time.time_ns())) - 1 + HEAD.size
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="commviz-journal",
                                            daemon=True)
            self._ticker.start()

    def _fail(self, exc: OSError) -> None:
        self.error = f"{exc.filename or self._path}: {exc.strerror or exc}"
        self._say_stopped()

    def _say_stopped(self) -> None:
        print(f"[commviz] journal stopped: {self.error}; records are still kept in memory and "
              "written at exit", file=sys.stderr)

    # -- times ------------------------------------------------------------------------------
    def _tick(self) -> None:
        while not self._stop.wait(TICK_S):
            with self._lock:
                self.patch_times()
                if self._seg is not None and self._seg.map is not None:
                    ALIVE.pack_into(self._seg.map, self._alive_at, time.time_ns())
                native = self._native()
                if native is not None and self.error is None and native.calls_error():
                    self.error = native.calls_error()     # the kernel's file hit a full disk
                    self._say_stopped()

    def patch_times(self) -> None:
        """Write the begin/end times calls have gained; keep those still running (call locked)."""
        seg = self._seg
        if seg is None or seg.map is None or not self._waiting:
            return
        running: list[Any] = []
        running_at = array("q")
        for rec, pos in zip(self._waiting, self._waiting_at):
            begin, end = rec[md.R_T_BEGIN], rec[md.R_T_END]
            TIMES.pack_into(seg.map, pos + TIMES_AT, begin or 0, RUNNING if end is None else end)
            if end is None:
                running.append(rec)
                running_at.append(pos)
        self._waiting, self._waiting_at = running[-CACHE_LIMIT:], running_at[-CACHE_LIMIT:]

    def _forget_waiting(self) -> None:
        self._waiting, self._waiting_at = [], array("q")

    # -- flush cooperation ------------------------------------------------------------------
    def rotate(self) -> None:
        """Before a flush builds its payload: later records go to a new generation. (Skipping
        a rotation only keeps older entries a while longer: recovery skips what the pickle
        has.)"""
        with flush_lock(self._lock) as got:
            if not got:
                return
            self._end_generation()

    def flushed(self, target: Path) -> None:
        """After the pickle reached ``target``: generations it covers are dropped."""
        if Path(target) == self.run_dir:
            with flush_lock(self._lock) as got:
                if got:
                    self.drop_rotated()

    def _end_generation(self) -> None:
        """Later records go to a new generation (call locked)."""
        self.patch_times()
        self._forget_waiting()                 # their offsets belong to the old generation
        native = self._native()
        if native is not None:
            native.calls_close()               # its later calls register shapes anew
        if self._seg is not None:
            self._old.append(self._seg)
            self._seg = None

    def restart(self) -> None:
        """After ``Recorder.clear`` (call locked): the cleared records are gone for good."""
        self._end_generation()
        self.drop_rotated()

    def drop_rotated(self) -> None:
        native = self._native()
        if native is not None:
            native.calls_drop()
        for seg in self._old:
            seg.close()
            seg.path.unlink(missing_ok=True)
            if seg.calls is not None:
                seg.calls.unlink(missing_ok=True)
        self._old = []

    def close(self) -> None:
        """Stop journaling (files stay: they are what a later recovery reads)."""
        self._stop.set()
        with self._lock:
            self._end_generation()
            native = self._native()
            if native is not None:
                native.calls_drop()
            for seg in self._old:
                seg.close()
            self._old = []


# -- reading back -------------------------------------------------------------------------------
class _Group(NamedTuple):
    """What ``md.expand`` reads of a GroupInfo."""

    name: str
    desc: str
    ranks: list
    ranks_str: str
    lane: int


class Entries(NamedTuple):
    header: dict
    groups: dict[int, dict]
    calls: list[tuple[int, dict]]          # (ordinal, metadata dict)
    alive_ns: int                          # the last time the process was seen alive


def read_journal(path: Path) -> Entries:
    """Parse one generation and its calls file: JSON and integers only; a torn tail ends
    either quietly."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RecordError(str(path), f"cannot read: {exc.strerror or exc}") from None
    header: dict = {}
    groups: dict[int, dict] = {}
    objects: dict[int, Any] = {}
    shapes: dict[int, Any] = {}             # native shapes by index
    errors: dict[int, str] = {}
    calls: list[tuple[int, dict]] = []
    alive = 0
    pos = 0
    while pos + HEAD.size <= len(data):
        size, kind = HEAD.unpack_from(data, pos)
        end = pos + HEAD.size + size
        if size == 0 or end > len(data):
            break
        if kind == T_CALL:
            if size != CALL_BODY:
                break
            _, _, sid, seq, begin, end_ns, ordinal = CALL.unpack_from(data, pos)
            if ordinal <= 0 or sid not in objects:
                break
            calls.append((ordinal, _call(objects[sid], groups, objects, seq, begin, end_ns,
                                         alive)))
        elif kind == T_ALIVE:
            if size != ALIVE.size:
                break
            alive = max(alive, ALIVE.unpack_from(data, pos + HEAD.size)[0])
        else:
            try:
                value = orjson.loads(data[pos + HEAD.size:end])
            except orjson.JSONDecodeError:
                break
            if kind == T_HEADER and isinstance(value, dict):
                header = value
            elif kind == T_GROUP and isinstance(value, dict):
                groups[pos + 1] = value
            elif kind in (T_EXTRA, T_SHAPE, T_META):
                objects[pos + 1] = (kind, value)
            elif kind == T_NSHAPE and isinstance(value, list) and len(value) == 3:
                shapes[value[0]] = (T_SHAPE, value[1:])
            elif kind == T_ERROR and isinstance(value, list) and len(value) == 2:
                errors[value[0]] = str(value[1])
            else:
                raise RecordError(str(path), f"unknown journal entry {kind!r} at byte {pos}")
        pos = end
    for shape, flags, seq, pair, begin, end_ns, ordinal in _native_calls(calls_path(path)):
        if shape not in shapes:
            break
        meta = _call(shapes[shape], groups, objects, seq, begin, end_ns, alive, pair)
        if flags & FAILED:
            meta[md.ERROR] = NATIVE_FAILED
        if flags & CAPTURED:                 # its graph placement was never journaled
            meta[md.CAPTURED] = True
        calls.append((ordinal, meta))
    for ordinal, meta in calls:
        if ordinal in errors:
            meta[md.ERROR] = errors[ordinal]
    return Entries(header, groups, calls, alive)


def native_numbers(kind: str, extra: Any, seq: int, pair: int) -> tuple[int | None, Any]:
    """A native entry's number and extra as its record has them: a p2p call's numbers are
    its extra's (Flight Recorder's ``FR_P2P_SEQ``, its pair's ``P2P_SEQ``), not a ``SEQ``."""
    if kind != "p2p":
        return (None if seq < 0 else seq), extra
    numbers = {md.FR_P2P_SEQ: seq, md.P2P_SEQ: pair} if pair >= 0 else {md.FR_P2P_SEQ: seq}
    return None, {**extra, **numbers} if extra else numbers


def _native_calls(path: Path) -> Iterator[tuple[int, int, int, int, int, int, int]]:
    """The boundary kernel's entries in a calls file, up to the first one not (fully) written:
    (shape, flags, seq, pair, t_begin, t_end, ordinal)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise RecordError(str(path), f"cannot read: {exc.strerror or exc}") from None
    magic, entry = CALLS_MAGIC, NATIVE_CALL
    if data.startswith(_CALLS_V1[0]):
        magic, entry = _CALLS_V1
    elif not data.startswith(CALLS_MAGIC):
        if data.strip(b"\0"):
            raise RecordError(str(path), "not a commviz calls file")
        return
    end = len(magic) + (len(data) - len(magic)) // entry.size * entry.size
    for fields in entry.iter_unpack(data[len(magic):end]):
        if fields[-1] <= 0:
            return
        yield fields if entry is NATIVE_CALL else (*fields[:3], -1, *fields[3:])


def _call(obj: tuple[int, Any], groups: dict[int, dict], objects: dict[int, Any], seq: int,
          begin: int, end: int, alive: int, pair: int | None = None) -> dict:
    """One call's metadata from its shape (or JSON) entry and per-call numbers; ``pair``: the
    boundary kernel's entry's (None: a journal call entry, whose extra has its p2p numbers)."""
    kind, value = obj
    if kind == T_META:
        meta = dict(value)
    else:
        fields, eid = value
        rec: list[Any] = list(fields) + [None] * (md.R_META + 3 - len(fields))
        g = groups.get(fields[md.R_INFO], {})
        rec[md.R_INFO] = _Group(str(g.get("name", "?")), str(g.get("desc", "?")),
                                list(g.get("ranks", [])), str(g.get("ranks_str", "[]")),
                                int(g.get("lane", 0)))
        extra = objects[eid][1] if eid in objects else None
        if pair is None:
            rec[md.R_SEQ], rec[md.R_EXTRA] = None if seq < 0 else seq, extra
        else:
            rec[md.R_SEQ], rec[md.R_EXTRA] = native_numbers(fields[md.R_KIND], extra, seq, pair)
        meta = md.expand(rec)
    if begin:
        meta[md.T_BEGIN] = begin
    if end > 0:
        meta[md.T_END] = end
    elif end == RUNNING and alive >= begin > 0:     # the process died inside this call
        meta[md.T_END] = alive
        meta[md.ERROR] = NEVER_RETURNED
    if kind == T_META and seq >= 0:
        meta[md.SEQ] = seq
    return meta


def recover(run_dir: Path, rank: int, base: dict | None = None) -> tuple[dict, int] | None:
    """Rank ``rank``'s record rebuilt from its journal, on top of ``base`` (a periodic pickle),
    and how many collectives the journal added; None when the journal adds nothing."""
    paths = journal_paths(run_dir, rank)
    if not paths:
        return None
    parts = [read_journal(p) for p in paths]
    header = next((p.header for p in reversed(parts) if p.header), {})
    seen = int((base or {}).get("recorded") or 0)
    calls = sorted({o: m for p in parts for o, m in p.calls if o > seen}.items())
    if not calls and (base is not None or not header):
        return None
    groups = {g["name"]: g for p in parts for g in p.groups.values() if "name" in g}
    payload = dict(base) if base is not None else {
        "schema": schema.SCHEMA, "version": schema.VERSION,
        "rank": rank, "world_size": int(header.get("world_size") or 1),
        "local_rank": int(header.get("local_rank") or 0), "host": header.get("host"),
        "pid": header.get("pid"), "device": "cpu", "backend": header.get("backend", "none"),
        "torch_version": None, "nccl_version": None,
        "clock": {"offset_ns": 0, "offset_source": "none", "wall_ns": time.time_ns()},
        "process_groups": [], "collectives": [], "capacity": 0, "recorded": 0, "dropped": 0,
        "graphs": [], "replays": [], "marks": [], "traces": []}
    known = {g.get("name") for g in payload["process_groups"] if isinstance(g, dict)}
    payload["process_groups"] = list(payload["process_groups"]) + [
        {k: g.get(k) for k in ("name", "desc", "ranks", "backend", "lane")}
        for name, g in sorted(groups.items()) if name not in known]
    payload["collectives"] = list(payload["collectives"]) + [m for _, m in calls]
    payload["recorded"] = max([seen] + [o for o, _ in calls])
    payload["capacity"] = max(int(payload.get("capacity") or 0), len(payload["collectives"]))
    payload["exit"] = EXIT
    return payload, len(calls)


def write_recovered(run_dir: Path, read: dict[Path, Any] | None = None) -> dict[int, int]:
    """Write ``commviz_rank{R}.pkl`` for every rank whose journal holds records its pickle
    lacks (a killed rank), then drop its journal; rank -> collectives the journal added.
    ``read``: gets each final pickle this had to load (so a caller need not load it again)."""
    from commviz.record.store import dump_record, load_record

    added: dict[int, int] = {}
    for rank in journal_ranks(run_dir):
        pickle_path = run_dir / schema.record_name(rank)
        base = None
        if pickle_path.exists():
            try:
                base = load_record(pickle_path)
            except RecordError:
                base = None
        if base is not None and base.get("exit") != "running":
            got = None                       # a final pickle: the journal is leftover
            if read is not None:
                read[pickle_path] = base
        else:
            got = recover(run_dir, rank, base)
        if got is not None:
            dump_record(pickle_path, got[0])
            added[rank] = got[1]
        for path in journal_paths(run_dir, rank):
            path.unlink(missing_ok=True)
            calls_path(path).unlink(missing_ok=True)
    return added
