"""GPU start and end of NCCL ops, read off the plugin's file and matched to commviz's records.

``commviz.record.nccl_plugin`` makes NCCL write one entry per op to
``commviz_rank{R}.gputime``: the communicator, NCCL's numbers, the bytes, the thread that
enqueued it and when, and its first channel's start and last channel's end on the GPU's timer.
``GpuTimes`` follows such a file while the job runs (each ``poll`` reads what is new) and
``match`` joins ops to records.

**Which record.** NCCL enqueues an op inside the c10d call that asks for it, on the calling
thread, so an op belongs to the record of its thread whose call was running when it was
enqueued (``commviz.tid``, ``t_begin``..``t_end``). NCCL's own numbers cannot be joined to c10d's
directly: NCCL counts per communicator and per NCCL function (a barrier is an AllReduce, an
all_to_all a group of Sends and Recvs, a coalesced block several ops), c10d counts per group;
they serve as checks. One call may own several ops (coalesced, all_to_all): its span runs from
the first start to the last end. A CUDA graph replay's ops are started by NCCL from CUDA's
host-callback thread with no API call before them (the plugin flags them): each goes to its
captured call, in capture order (``_replays``). Ops of no recorded call are counted by reason,
never guessed.

**Clock.** The GPU timer is not the host's wall clock. NCCL's proxy thread sees each stamp
shortly after the GPU writes it, so over the ops read so far, ``min(seen - stamp)`` is the
offset from the GPU timer to the host's clock plus the proxy's shortest reaction (about a
microsecond): GPU times land on the records' clock (``time.time_ns``) that late at most.

No torch here: this runs beside the job, in its own process.
"""

from __future__ import annotations

import bisect
import os
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from commviz import metadata as md
from commviz.errors import RecordError
from commviz.record import nccl_plugin as layout

NEVER = 2 ** 64 - 1  # a GPU start no channel reported
NESTED = 8          # records a call may sit inside (a batch around its ops) looked back through


class GpuOp(NamedTuple):
    """One NCCL op as the plugin wrote it (times: ns; GPU times on the GPU's timer)."""

    comm: int               # NCCL's commHash
    func: str               # NCCL's name: "AllReduce", "Send", ...
    p2p: bool
    seq: int                # NCCL's seqNumber (per comm and func); p2p: the comm's p2p count
    bytes: int              # count x datatype size (0: unknown datatype)
    peer: int               # p2p peer, a collective's root (communicator ranks)
    tid: int                # the thread that enqueued it
    t_enqueue: int          # host wall clock then
    gpu_start: int
    gpu_end: int
    seen_start: int         # host wall clock when NCCL's proxy saw the start stamp
    seen_end: int
    channels: int           # channels that reported an end, of
    expected: int           # the channels NCCL gave it
    partial: bool           # not every channel reported: its end is a lower bound
    replay: bool            # a CUDA graph replay's (NCCL made no API call event for it)


class Communicator(NamedTuple):
    comm: int
    rank: int
    nranks: int
    nnodes: int
    name: str


@dataclass
class GpuTimes:
    """A rank's GPU-time file, followed: ``poll`` reads the entries written since the last one."""

    path: Path
    pid: int = 0
    comms: dict[int, Communicator] = field(default_factory=dict)
    ops: list[GpuOp] = field(default_factory=list)
    offset_ns: int | None = None        # host clock = GPU timer + offset (None: no op yet)
    every: int = 1                      # one NCCL call in ``every`` was timed (sampling)
    _names: dict[int, str] = field(default_factory=dict)
    _next: int = 0                      # the first entry not read for good
    _done: set[int] = field(default_factory=set)    # entries past _next already read

    def poll(self) -> list[GpuOp]:
        """The ops written since the last poll (also appended to ``ops``)."""
        try:
            with open(self.path, "rb") as f:
                head = f.read(layout.HEADER_SIZE)
                if len(head) < layout.HEADER_SIZE:
                    raise RecordError(str(self.path), "not a commviz GPU-time file (too short)")
                magic, size, header, pid, _, every = layout.HEADER.unpack_from(head)
                if not magic.startswith(layout.MAGIC) or size != layout.ENTRY_SIZE \
                        or header != layout.HEADER_SIZE:
                    raise RecordError(str(self.path), "not a commviz GPU-time file (its header "
                                      f"is not {layout.MAGIC!r} with {layout.ENTRY_SIZE}-byte "
                                      "entries)")
                if pid != self.pid:                  # a new process wrote it afresh
                    self.pid, self._next, self._done = pid, 0, set()
                    self.comms, self.ops, self._names, self.offset_ns = {}, [], {}, None
                self.every = max(every, 1)
                f.seek(layout.HEADER_SIZE + self._next * layout.ENTRY_SIZE)
                data = f.read()
        except OSError as exc:
            raise RecordError(str(self.path), f"cannot read: {exc.strerror or exc}") from None
        new = self._entries(data)
        self.ops.extend(new)
        return new

    def _entries(self, data: bytes) -> list[GpuOp]:
        new: list[GpuOp] = []
        size = layout.ENTRY_SIZE
        first_empty = last_full = -1
        full: list[int] = []
        for i in range(len(data) // size):
            kind = int.from_bytes(data[i * size:i * size + 4], "little")
            if kind == 0:
                if first_empty < 0:
                    first_empty = i
                continue
            last_full = i
            full.append(i)
            if self._next + i in self._done:
                continue
            if kind == layout.KIND_OP:
                new.append(self._op(layout.OP.unpack_from(data, i * size)))
            elif kind == layout.KIND_COMM:
                _, rank, comm, nranks, nnodes, name = layout.COMM.unpack_from(data, i * size)
                self.comms[comm] = Communicator(comm, rank, nranks, nnodes, _text(name))
            elif kind == layout.KIND_NAME:
                _, code, name = layout.NAME.unpack_from(data, i * size)
                self._names[code] = _text(name)
            else:
                raise RecordError(str(self.path), f"unknown entry kind {kind} at entry "
                                  f"{self._next + i}")
        # an empty slot before the last written one is a writer a moment behind, unless it is
        # far behind (a chunk's tail skipped when the plugin was loaded again): read from it
        # again next time, skipping what was read after it
        start = self._next
        behind = 0 <= first_empty < last_full and last_full - first_empty < 4096
        self._next = start + (first_empty if behind else last_full + 1)
        self._done = {start + i for i in full if i > first_empty} if behind else set()
        return new

    def _op(self, f: tuple) -> GpuOp:
        (_, func, flags, channels, expected, comm, seq, nbytes, peer, tid, t_enq, g0, g1, s0,
         s1) = f
        op = GpuOp(comm, self._names.get(func, f"func {func}"), bool(flags & layout.FLAG_P2P),
                   seq, nbytes, peer, tid, t_enq, g0, g1, s0, s1, channels, expected,
                   bool(flags & layout.FLAG_PARTIAL), bool(flags & layout.FLAG_REPLAY))
        candidates = [s1 - g1] + ([s0 - g0] if s0 and g0 != NEVER else [])
        low = min(candidates)
        if self.offset_ns is None or low < self.offset_ns:
            self.offset_ns = low
        return op

    def host(self, gpu_ns: int) -> int:
        """A GPU timer value on the host's wall clock (the records' clock)."""
        return gpu_ns + (self.offset_ns or 0)


def read(path: str | os.PathLike[str]) -> GpuTimes:
    """The whole file, read once."""
    times = GpuTimes(Path(path))
    times.poll()
    return times


def _text(raw: bytes) -> str:
    return raw.split(b"\0", 1)[0].decode("utf-8", "replace")


# -- matching ---------------------------------------------------------------------------------

class Span(NamedTuple):
    """A record's GPU time on the records' clock: its ops' first start to their last end."""

    start_ns: int
    end_ns: int
    ops: int
    bytes: int
    partial: bool


@dataclass
class Matched:
    spans: dict[int, Span]                      # record index -> its GPU time
    unmatched: Counter[str]                     # ops that belong to no record, by reason
    groups: dict[int, str]                      # commHash -> the process group its ops had
    replays: dict[int, list[Span]]              # captured record -> its replays' GPU times


OUTSIDE = "enqueued outside every recorded call on its thread (a call commviz does not " \
          "record; after a graph capture NCCL may enqueue eager ops from CUDA's callback thread)"
UNCAPTURED = "a CUDA graph replay's op with no captured call of its group and size to give it to"
NO_TIMES = "no channel reported a start (its kernel did not run, or NCCL lost the stamps)"
STALE = "stamps of an earlier call's kernel (NCCL 2.28 gives them to all but the last op of a " \
        "coalesced block): the block's span is its last op's, which covers its one kernel"


def match(records: Sequence[Mapping[str, Any]], times: GpuTimes,
          ops: Iterable[GpuOp] | None = None) -> Matched:
    """Each op of ``times`` (or ``ops``) joined to the record whose call enqueued it."""
    calls: dict[int, tuple[list[int], list[int], list[int]]] = {}
    by_tid: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for i, rec in enumerate(records):
        tid, begin = rec.get(md.TID), rec.get(md.T_BEGIN)
        if tid is None or begin is None:
            continue
        end = rec.get(md.T_END)
        by_tid[int(tid)].append((int(begin), int(end) if end is not None else 1 << 62, i))
    for tid, spans in by_tid.items():
        spans.sort()
        calls[tid] = ([s[0] for s in spans], [s[1] for s in spans], [s[2] for s in spans])

    owned: dict[int, list[GpuOp]] = defaultdict(list)
    unmatched: Counter[str] = Counter()
    votes: dict[int, Counter[str]] = defaultdict(Counter)
    # a communicator's kernels run one after another: an op ending no later than an op of an
    # earlier call on it carries stamps that are not its own
    done: dict[int, tuple[int | None, int, int]] = {}  # comm -> (call, its end, ends before)
    replayed: list[GpuOp] = []
    for op in sorted(times.ops if ops is None else ops, key=lambda o: o.t_enqueue):
        if op.gpu_start == NEVER or op.gpu_end == 0:
            unmatched[NO_TIMES] += 1
            continue
        got = None if op.replay else _owner(calls.get(op.tid), op.t_enqueue)
        owner, end, before = done.get(op.comm, (None, 0, 0))
        if got is None or got != owner:                 # the first op of a call on this comm
            before, end = max(before, end), 0
        if op.gpu_end <= before:
            unmatched[STALE] += 1
            continue
        done[op.comm] = (got, max(end, op.gpu_end), before)
        if op.replay:
            replayed.append(op)
            continue
        if got is None:
            unmatched[OUTSIDE] += 1
            continue
        owned[got].append(op)
        votes[op.comm][str(records[got].get(md.PG_NAME))] += 1
    spans = {i: Span(times.host(min(o.gpu_start for o in group)),
                     times.host(max(o.gpu_end for o in group)), len(group),
                     sum(o.bytes for o in group), any(o.partial for o in group))
             for i, group in owned.items()}
    groups = {comm: c.most_common(1)[0][0] for comm, c in votes.items()}
    return Matched(spans, unmatched, groups, _replays(records, times, replayed, groups,
                                                      unmatched))


def _replays(records: Sequence[Mapping[str, Any]], times: GpuTimes, ops: list[GpuOp],
             groups: dict[int, str], unmatched: Counter[str]) -> dict[int, list[Span]]:
    """Each replay's op given to its captured call: a graph replays its communicator's ops in
    the order they were captured, so the k-th replayed op of a communicator is the next
    captured call of its group (cyclically) of the op's size."""
    captured: dict[str, list[int]] = defaultdict(list)
    for i, rec in sorted(enumerate(records), key=lambda r: r[1].get(md.T_BEGIN) or 0):
        if rec.get(md.CAPTURED):
            captured[str(rec.get(md.PG_NAME))].append(i)
    cursor: dict[int, int] = defaultdict(int)
    out: dict[int, list[Span]] = defaultdict(list)
    for op in ops:
        calls = captured.get(groups.get(op.comm, ""), [])
        at = cursor[op.comm]
        hit = next((k for k in range(at, at + len(calls))
                    if op.bytes in (records[calls[k % len(calls)]].get(md.BYTES_IN),
                                    records[calls[k % len(calls)]].get(md.BYTES_OUT))), None)
        if hit is None:
            unmatched[UNCAPTURED] += 1
            continue
        cursor[op.comm] = hit + 1
        out[calls[hit % len(calls)]].append(Span(times.host(op.gpu_start), times.host(op.gpu_end),
                                                 1, op.bytes, op.partial))
    return dict(out)


def _owner(calls: tuple[list[int], list[int], list[int]] | None, t: int) -> int | None:
    """The record (index) of the call running at ``t`` on this thread: the latest begun, or
    one around it (a batch's record spans its ops' records)."""
    if calls is None:
        return None
    begins, ends, index = calls
    j = bisect.bisect_right(begins, t) - 1
    for k in range(j, max(j - NESTED, -1), -1):
        if ends[k] >= t:
            return index[k]
    return None
