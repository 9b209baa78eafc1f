"""Following every rank's journal while it is written: each call once, when it has ended.

A rank writes its calls into ``commviz_rank{R}.{gen}.journal`` and the boundary kernel's
``.calls`` file beside it (formats: ``commviz.record.journal``). ``read_journal`` reads a whole
generation once; a live view needs the calls made *since it last looked*, every second, without
re-reading what it has, from files still being written. ``RunTail`` does that:

    tail = RunTail(run_dir)                 # every rank whose journal is there (or ranks=[...])
    while True:
        for call in tail.poll():            # calls that ended since the last poll, every rank
            call.rank, call.shape.group, call.seq, call.t_begin_ns, call.t_end_ns, ...
        tail.problems                       # one line per unusable file (path: what is wrong)
        time.sleep(1)

API (the exporter, ``commviz.live.exporter``, builds on it):

- ``RunTail(run_dir, ranks=None)``: ``poll() -> list[Call]``; ``headers`` (rank -> the
  journal's header: host, pid, world_size, backend, start_ns); ``problems`` (list of lines);
  ``missed`` (rank -> calls that could not be read: running when their generation was dropped,
  or in a generation that came and went between two polls); ``ranks`` (those seen so far);
  ``readable`` (those whose newest generation is not given up as unreadable).
- ``Call``: ``rank``, ``ordinal`` (the rank's record number), ``seq`` (a collective's number in
  its group, Flight Recorder's ``collective_seq_id``; a p2p call's ``fr_p2p_seq``; None: none),
  ``pair`` (a p2p call's number between its two ranks; else None), ``t_begin_ns``/``t_end_ns``
  (the rank's wall clock: CPU times of the call; on NCCL the launch), ``failed``, ``shape``.
- ``Shape`` (shared by every call of a call site, one object per rank and generation):
  ``group``, ``group_desc``, ``group_ranks``, ``op``, ``kind``, ``ctype`` (nccl-tests type),
  ``size_bytes``, ``origin``, ``device``, ``async_op``, and ``meta`` (the record's metadata
  dict without per-call numbers and times: every ``commviz.metadata`` key the call has).

A call is returned once, when its times are final: a journal's call entry gets its times from
the rank's ticker within 0.1 s, a calls-file entry its end when the call returns. A call still
running is held back until it ends (``commviz status`` is the tool for a rank stuck inside).

Files being written: an entry not complete yet (its header or ordinal still zero: both are
written last) ends a read quietly, and the next poll resumes there. A rank rotates to a new
generation at every flush of its pickle and drops the old files once the pickle holds them;
each generation's file stays open here until a newer one exists and it was unlinked, then is
read one last time through the open descriptor, so nothing written before the drop is lost.
Reading parses JSON (orjson) and fixed integers (struct) only: nothing in a file is ever run.
A file that cannot be a journal being written (an unknown entry type, an entry past the end
of the file, JSON that does not parse behind a written header, a call of a shape never
declared, a calls file without its magic) is one line in ``problems`` naming the file and the
byte, and that generation is read no further; every other file goes on being read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection, NamedTuple

import orjson

from commviz import metadata as md
from commviz.errors import RecordError
from commviz.merge import bandwidth as bw
from commviz.record import journal as jn

READ = 64 << 10                 # bytes read at a time past the last complete entry
_MAGICS = {jn.CALLS_MAGIC: jn.NATIVE_CALL, jn._CALLS_V1[0]: jn._CALLS_V1[1]}
_MAGIC_SIZE = len(jn.CALLS_MAGIC)


@dataclass(frozen=True, slots=True, eq=False)
class Shape:
    """What one call site's calls share (``commviz.record.journal``'s shape entry), decoded
    once: the view groups and labels calls by these without building a dict per call."""

    group: str
    group_desc: str
    group_ranks: tuple[int, ...]
    op: str
    kind: str                        # md.KIND: collective | p2p | batch
    ctype: str                       # nccl-tests type (commviz.merge.bandwidth)
    size_bytes: int | None
    origin: str | None               # md.ORIGIN, else the call site
    device: str | None
    async_op: bool
    meta: dict[str, Any] = field(repr=False)

    @classmethod
    def of(cls, meta: dict[str, Any]) -> Shape:
        return cls(group=str(meta.get(md.PG_NAME)), group_desc=str(meta.get(md.PG_DESC, "")),
                   group_ranks=md.group_ranks(meta.get(md.PG_RANKS)), op=str(meta.get(md.OP)),
                   kind=str(meta.get(md.KIND, "collective")), ctype=bw.collective_type(meta),
                   size_bytes=bw.size_bytes(meta),
                   origin=meta.get(md.ORIGIN) or meta.get(md.CALLSITE),
                   device=meta.get(md.DEVICE), async_op=bool(meta.get(md.ASYNC)), meta=meta)


class Call(NamedTuple):
    """One call of one rank, ended (see the module docstring)."""

    rank: int
    ordinal: int
    seq: int | None
    pair: int | None
    t_begin_ns: int
    t_end_ns: int
    failed: bool
    shape: Shape
    gpu_begin_ns: int = -1           # its NCCL ops' GPU start and end on this clock; -1: none
    gpu_end_ns: int = -1             # (``commviz.live.gpujoin`` sets them)

    @classmethod
    def of_record(cls, rank: int, ordinal: int, rec: dict[str, Any]) -> Call:
        """A pickled record (``commviz_rank{R}.pkl``) as the call a journal would have given:
        the window and the exporter take calls from either source through this one type."""
        p2p = rec.get(md.KIND) == "p2p"
        seq = rec.get(md.FR_P2P_SEQ if p2p else md.SEQ)
        return cls(rank, ordinal, seq, rec.get(md.P2P_SEQ) if p2p else None,
                   int(rec.get(md.T_BEGIN) or 0), int(rec.get(md.T_END) or 0),
                   md.ERROR in rec, Shape.of(rec))


class _Corrupt(Exception):
    """This generation cannot be read further (the message says why)."""


class _Rewritten(Exception):
    """The file shrank below what was read: written anew under the same name (a restarted
    rank truncates its generation 1): read again from its start."""


def _read(fd: int, pos: int, size: int) -> bytes:
    return os.pread(fd, size, pos)


@dataclass(eq=False)
class _Generation:
    """One generation of one rank: its journal and calls file, read up to ``pos``/``cpos``."""

    rank: int
    gen: int
    path: Path
    inode: int
    fd: int
    cfd: int | None = None
    pos: int = 0
    cpos: int = 0
    entry: Any = None                            # the calls file's entry struct, once read
    groups: dict[int, dict] = field(default_factory=dict)
    objects: dict[int, Any] = field(default_factory=dict)
    native: dict[int, Any] = field(default_factory=dict)       # native shape index -> entry
    shapes: dict[Any, Shape] = field(default_factory=dict)
    errors: dict[int, str] = field(default_factory=dict)
    header: dict = field(default_factory=dict)
    pending: list[tuple[int, Any, int]] = field(default_factory=list)   # (offset, shape, seq)
    npending: list[tuple[int, int]] = field(default_factory=list)       # (offset, shape index)

    # -- the journal ---------------------------------------------------------------------
    def read_journal(self) -> None:
        """Parse the entries written since the last read (up to the first incomplete one)."""
        size = os.fstat(self.fd).st_size
        if size < self.pos:
            raise _Rewritten(str(self.path))
        want = READ
        while self.pos < size:
            data = _read(self.fd, self.pos, min(want, size - self.pos))
            used, want = self._entries(data, size)
            self.pos += used
            if not want:
                return
            if not used and len(data) < jn.HEAD.size:     # the file ends inside a header
                if data.strip(b"\0"):
                    raise _Corrupt(f"its last {len(data)} bytes (from byte {self.pos}) are part "
                                   "of an entry's header: half-written or cut short")
                return

    def _entries(self, data: bytes, size: int) -> tuple[int, int]:
        """Consume the complete entries of ``data`` (read at ``pos``): the bytes used, and how
        many to read next (0: stop here, the next entry is not written yet)."""
        off = 0
        while off + jn.HEAD.size <= len(data):
            length, kind = jn.HEAD.unpack_from(data, off)
            if length == 0:
                return off, 0                     # not written yet
            at = self.pos + off
            end = off + jn.HEAD.size + length
            if at + jn.HEAD.size + length > size:
                raise _Corrupt(f"entry at byte {at} ({length} bytes) runs past the end of the "
                               f"file ({size} bytes): half-written or cut short")
            if end > len(data):
                return off, max(READ, end - off)  # read again from this entry, all of it
            if at == 0 and kind != jn.T_HEADER:
                raise _Corrupt("not a commviz journal: its first entry is not the header")
            if kind == jn.T_CALL:
                if length != jn.CALL_BODY:
                    raise _Corrupt(f"call entry at byte {at} is {length} bytes, not "
                                   f"{jn.CALL_BODY}")
                _, _, sid, seq, _, _, ordinal = jn.CALL.unpack_from(data, off)
                if ordinal <= 0:
                    return off, 0                 # its ordinal (written last) is not there yet
                if sid not in self.objects:
                    raise _Corrupt(f"call entry at byte {at} names shape {sid}, never declared")
                self.pending.append((at, sid, seq))
            elif kind == jn.T_ALIVE:                  # the ticker's stamp: nothing to read here
                if length != jn.ALIVE.size:
                    raise _Corrupt(f"alive entry at byte {at} is {length} bytes")
            else:
                self._json_entry(kind, data[off + jn.HEAD.size:end], at)
            off = end
        return off, READ

    def _json_entry(self, kind: int, body: bytes, at: int) -> None:
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError:
            raise _Corrupt(f"entry at byte {at} is not JSON") from None
        if kind == jn.T_HEADER and isinstance(value, dict):
            self.header = value
        elif kind == jn.T_GROUP and isinstance(value, dict):
            self.groups[at + 1] = value
        elif kind in (jn.T_EXTRA, jn.T_SHAPE, jn.T_META):
            self.objects[at + 1] = (kind, value)
        elif kind == jn.T_NSHAPE and isinstance(value, list) and len(value) == 3:
            self.native[value[0]] = (jn.T_SHAPE, value[1:])
        elif kind == jn.T_ERROR and isinstance(value, list) and len(value) == 2:
            self.errors[value[0]] = str(value[1])
        else:
            raise _Corrupt(f"unknown journal entry {bytes([kind])!r} at byte {at}")

    # -- the calls file --------------------------------------------------------------------
    def open_calls(self) -> None:
        if self.cfd is None:
            try:
                self.cfd = os.open(jn.calls_path(self.path), os.O_RDONLY)
            except FileNotFoundError:
                return

    def read_calls(self) -> None:
        """Note the calls-file entries written since the last read."""
        if self.cfd is None:
            return
        size = os.fstat(self.cfd).st_size
        if self.entry is None:
            magic = _read(self.cfd, 0, _MAGIC_SIZE)
            if len(magic) < _MAGIC_SIZE or not magic.strip(b"\0"):
                return                            # not written yet
            self.entry = _MAGICS.get(magic)
            if self.entry is None:
                raise _Corrupt(f"{jn.calls_path(self.path).name} is not a commviz calls file")
            self.cpos = _MAGIC_SIZE
        step = self.entry.size
        while self.cpos + step <= size:
            data = _read(self.cfd, self.cpos, min(READ // step * step, size - self.cpos))
            whole = len(data) // step * step
            for n, fields in enumerate(self.entry.iter_unpack(data[:whole])):
                if fields[-1] <= 0 or fields[0] not in self.native:
                    self.cpos += n * step         # not written yet (or its shape not read yet)
                    return
                self.npending.append((self.cpos + n * step, fields[0]))
            self.cpos += whole
            if whole < READ // step * step:
                break
        if (size - _MAGIC_SIZE) % step and self.cpos + step > size and size > self.cpos:
            raise _Corrupt(f"{jn.calls_path(self.path).name}: last entry at byte {self.cpos} "
                           f"cut short ({size} bytes): half-written")

    # -- calls that ended ------------------------------------------------------------------
    def ended(self) -> list[Call]:
        """The pending calls whose times are now final (re-read from the files)."""
        out: list[Call] = []
        if self.pending:
            first = self.pending[0][0]
            data = _read(self.fd, first, self.pending[-1][0] + jn.CALL.size - first)
            keep = []
            for at, sid, seq in self.pending:
                fields = jn.CALL.unpack_from(data, at - first)
                begin, end, ordinal = fields[4], fields[5], fields[6]
                if begin > 0 and end > 0:
                    out.append(self._call(ordinal, self._shape(sid), seq, None, begin, end, 0))
                else:
                    keep.append((at, sid, seq))
            self.pending = keep
        if self.npending and self.cfd is not None:
            first = self.npending[0][0]
            data = _read(self.cfd, first, self.npending[-1][0] + self.entry.size - first)
            keep_n = []
            for at, index in self.npending:
                fields = self.entry.unpack_from(data, at - first)
                if len(fields) == 6:              # a version-1 file: no pair
                    fields = (*fields[:3], -1, *fields[3:])
                _, flags, seq, pair, begin, end, ordinal = fields
                if end == jn.RUNNING or end <= 0:
                    keep_n.append((at, index))
                    continue
                out.append(self._call(ordinal, self._shape(("n", index)), seq, pair, begin, end,
                                      flags))
            self.npending = keep_n
        return out

    def _shape(self, key: Any) -> Shape:
        shape = self.shapes.get(key)
        if shape is None:
            obj = self.native[key[1]] if isinstance(key, tuple) else self.objects[key]
            meta = jn._call(obj, self.groups, self.objects, -1, 0, 0, 0)
            meta.pop(md.SEQ, None)
            shape = self.shapes[key] = Shape.of(meta)
        return shape

    def _call(self, ordinal: int, shape: Shape, seq: int, pair: int | None, begin: int,
              end: int, flags: int) -> Call:
        p2p = shape.kind == "p2p"
        number = None if seq < 0 else seq
        return Call(self.rank, ordinal, number, None if not p2p or pair is None or pair < 0
                    else pair, begin, end, bool(flags & jn.FAILED) or ordinal in self.errors,
                    shape)

    def close(self) -> int:
        """Stop reading; returns the calls left unread (still running when it was dropped)."""
        for fd in (self.fd, self.cfd):
            if fd is not None:
                os.close(fd)
        self.fd, self.cfd = -1, None
        return len(self.pending) + len(self.npending)


@dataclass(eq=False)
class _RankTail:
    rank: int
    gens: dict[int, _Generation] = field(default_factory=dict)
    last_gen: int = 0                              # the newest generation opened
    opened: set[tuple[int, int]] = field(default_factory=set)   # (generation, inode) opened
    missed: int = 0
    missed_gens: int = 0
    header: dict = field(default_factory=dict)
    broken: bool = False                           # its newest generation could not be read


class RunTail:
    """Every rank's journals of ``run_dir`` followed (``ranks``: only these ranks)."""

    def __init__(self, run_dir: str | os.PathLike[str],
                 ranks: Collection[int] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.only = None if ranks is None else frozenset(ranks)
        self._ranks: dict[int, _RankTail] = {}
        self._problems: dict[str, str] = {}

    @property
    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    @property
    def readable(self) -> list[int]:
        """The ranks whose newest generation is being read (not given up as unreadable)."""
        return sorted(r for r, t in self._ranks.items() if not t.broken)

    @property
    def headers(self) -> dict[int, dict]:
        return {r: t.header for r, t in sorted(self._ranks.items()) if t.header}

    @property
    def problems(self) -> list[str]:
        return list(self._problems.values())

    @property
    def missed(self) -> dict[int, int]:
        """Per rank, calls seen but never seen to end before their generation was dropped (a
        call running at a flush), and generations dropped between two polls (one each)."""
        return {r: t.missed + t.missed_gens for r, t in sorted(self._ranks.items())
                if t.missed + t.missed_gens}

    def _listing(self) -> dict[int, dict[int, tuple[Path, int]]]:
        """rank -> generation -> (path, inode): a restarted rank writes generation 1 again."""
        found: dict[int, dict[int, tuple[Path, int]]] = {}
        try:
            entries = list(os.scandir(self.run_dir))
        except OSError as exc:
            raise RecordError(str(self.run_dir), f"cannot list: {exc.strerror or exc}") from None
        for entry in entries:
            m = jn._GEN_RE.search(entry.name)
            if m is None:
                continue
            rank = int(m.group(1))
            if self.only is None or rank in self.only:
                found.setdefault(rank, {})[int(m.group(2))] = (Path(entry.path), entry.inode())
        return found

    def poll(self) -> list[Call]:
        """The calls every rank ended since the last poll (RecordError only when the run dir
        itself cannot be listed)."""
        listing = self._listing()
        out: list[Call] = []
        for rank in sorted(set(listing) | set(self._ranks)):
            tail = self._ranks.setdefault(rank, _RankTail(rank))
            out += self._poll_rank(tail, listing.get(rank, {}))
        return out

    def _poll_rank(self, tail: _RankTail, listed: dict[int, tuple[Path, int]]) -> list[Call]:
        for gen, (path, inode) in sorted(listed.items()):
            if (gen, inode) in tail.opened or gen in tail.gens:
                continue                              # read already, or being read
            if gen <= tail.last_gen:                  # a new file of an old number: restarted
                tail.last_gen = 0
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                continue                              # dropped since the listing
            except OSError as exc:
                self._problems[str(path)] = f"{path}: cannot read: {exc.strerror or exc}"
                continue
            if tail.last_gen:
                tail.missed_gens += gen - tail.last_gen - 1
            tail.last_gen, tail.broken = gen, False
            tail.opened.add((gen, inode))
            tail.gens[gen] = _Generation(tail.rank, gen, path, inode, fd)
        out: list[Call] = []
        for gen, g in sorted(tail.gens.items()):
            # unlinked (or its name taken by a new file): read it once more, then close
            final = listed.get(gen, (None, None))[1] != g.inode
            try:
                g.open_calls()
                g.read_journal()
                g.read_calls()
                out += g.ended()
            except _Rewritten:
                tail.opened.discard((gen, g.inode))   # the next poll opens it afresh
                final = True
            except _Corrupt as exc:
                self._problems[str(g.path)] = f"{g.path}: {exc}"
                tail.broken = gen == tail.last_gen
                final = True
            except OSError as exc:
                self._problems[str(g.path)] = f"{g.path}: cannot read: {exc.strerror or exc}"
                tail.broken = gen == tail.last_gen
                final = True
            if g.header:
                tail.header = g.header
            if final:
                tail.missed += g.close()
                del tail.gens[gen]
        return out
