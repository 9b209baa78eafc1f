"""The per-rank recorder: a bounded ring of collective records, flushed atomically to the run dir.

Like the flight recorder's ring buffer, memory is capped (``capacity`` records, default 100k or
``COMMVIZ_CAPACITY``) and what falls off is counted. Most calls are kept by the boundary
kernel's native ring (fixed entries, no Python object per call); the others in a deque here.
The record is written at normal exit and on SIGTERM/SIGINT (torchrun's way of stopping
workers), and every record is journaled as it is made (``journal``), so a killed rank keeps
what it recorded.
"""

from __future__ import annotations

import atexit
import collections
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from commviz import metadata as md
from commviz.record import process_groups, schema, store
from commviz.record.origins import RESOLVERS, State
from commviz.record.journal import (CAPTURED, FAILED, NATIVE_CALL, NATIVE_FAILED, RUNNING, Journal,
                                    flush_lock, native_numbers)

DEFAULT_CAPACITY = 100_000


class Recorder:
    """Collects this rank's collective records and the CUDA graph tables beside them.

    Records come two ways, numbered by one ordinal counter: calls the boundary kernel records
    natively (``native``: its ring of fixed entries, each naming a shape of ``shapes``) and
    records built in Python (``append``: annotations, calls with split sizes or origins that
    change per call, asynchronous or point-to-point calls under capture). ``records()`` puts them back in one order."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._enabled = os.environ.get("COMMVIZ_RECORD", "1") != "0"
        self.native: Any = None        # the boundary kernel's ring, once it is installed
        self.run_dir: Path | None = None
        self.capacity = capacity
        self._ring: collections.deque[tuple[int, Any]] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._recorded = 0
        # what a call site repeats, for natively recorded calls: (record fields up to
        # R_SEQ, extra); one per distinct site, sizes and group, kept for the whole run
        self.shapes: list[tuple[list[Any], dict[str, Any] | None]] = []
        self._shape_ids: dict[tuple[Any, ...], int] = {}
        self.errors: dict[int, str] = {}      # ordinal -> error of a natively recorded call
        # natively recorded calls under capture, as records placed in their graph (ordinal ->
        # record): ``records()`` returns these objects, which the capture code finishes
        self._captured: dict[int, list[Any]] = {}
        self.graphs: list[dict[str, Any]] = []
        self.replays: list[dict[str, Any]] = []
        self.marks: list[dict[str, Any]] = []
        self.traces: list[str] = []
        self.clock: dict[str, Any] = {"offset_ns": 0, "offset_source": "none"}
        self._groups: dict[str, dict[str, Any]] = {}
        # run before a payload is built: parts whose records finish lazily (capture records)
        self.before_payload: list[Callable[[], None]] = []
        self._identity: dict[str, Any] = {}
        self.journal: Journal | None = None   # every record, kept on disk past a SIGKILL
        self.origins = State(RESOLVERS)       # what working out origins keeps (``origins``)

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, on: bool) -> None:
        if on and not self._enabled:
            process_groups.follow_backend_numbering()
        self._enabled = on
        if self.native is not None:
            self.native.set_active(on)

    # -- the boundary kernel's native ring ----------------------------------------------------
    def attach(self, native: Any) -> None:
        """The boundary kernel is in: it records plain calls itself, numbered after ours."""
        with self._lock:
            native.set_ordinal(self._recorded)
            native.resize(self.capacity)
            self.native = native
        native.set_active(self._enabled)

    def detach(self) -> None:
        """The boundary kernel is out: its calls join the Python ring."""
        with self._lock:
            native = self.native
            if native is None:
                return
            native.set_active(False)
            kept = sorted(list(self._ring) + self._native_records(native.entries()),
                          key=lambda r: r[0])
            self._ring = collections.deque(kept, maxlen=self.capacity)
            self._recorded = native.last_ordinal()
            native.clear()
            self._captured.clear()
            self.native = None

    def add_shape(self, fields: list[Any], extra: dict[str, Any] | None) -> int:
        """The index of a call shape (``calls.shape``), journaled before any call uses it."""
        key = (id(fields[md.R_INFO]), *fields[:md.R_INFO], *fields[md.R_INFO + 1:],
               None if extra is None else tuple(sorted(extra.items())))
        with self._lock:
            index = self._shape_ids.get(key)
            if index is None:
                index = self._shape_ids[key] = len(self.shapes)
                self.shapes.append((fields, extra))
            if self.journal is not None:
                self.journal.native_shape(index, fields, extra)
        return index

    def add_error(self, ordinal: int, error: str) -> None:
        with self._lock:
            self.errors[ordinal] = error
            if self.journal is not None:
                self.journal.note_error(ordinal, error)

    def _native_record(self, shape: int, flags: int, seq: int, t_begin: int, t_end: int,
                       ordinal: int, pair: int = -1) -> list[Any]:
        """The compact record of one native entry (``journal.NATIVE_CALL``'s fields)."""
        fields, extra = self.shapes[shape]
        error = self.errors.get(ordinal) or (NATIVE_FAILED if flags & FAILED else None)
        seq, extra = native_numbers(fields[md.R_KIND], extra, seq, pair)
        rec = fields + [seq, extra, t_begin, None if t_end == RUNNING else t_end, error]
        rec += [0 if flags & CAPTURED else None] + [None] * (md.R_REGION - md.R_GRAPH)
        return rec

    def _native_records(self, entries: bytes) -> list[tuple[int, list[Any]]]:
        """Compact records of the native ring's entries (those placed in a graph as placed)."""
        captured = self._captured
        return [(ordinal, captured.get(ordinal) or
                 self._native_record(shape, flags, seq, t0, t1, ordinal, pair))
                for shape, flags, seq, pair, t0, t1, ordinal in NATIVE_CALL.iter_unpack(entries)]

    def take_captured(self) -> list[tuple[Any, ...]]:
        """The calls the kernel recorded under capture since the last take, in call order:
        (shape, flags, seq, t_begin, t_end, ordinal, capture id, graph, stream, the stream's
        frontier as the call returned). A capture id of 0: the capture was over when the call returned."""
        return self.native.take_captured() if self.native is not None else []

    def captured_record(self, entry: tuple[int, int, int, int, int, int]) -> list[Any]:
        """The record of a call ``take_captured`` gave, for the capture code to place in its
        graph; ``records()`` returns this very object from now on."""
        with self._lock:
            captured = self._captured
            rec = captured[entry[5]] = self._native_record(*entry)
            if len(captured) > self.capacity:           # fallen off the native ring too
                del captured[next(iter(captured))]
        return rec

    # -- hot path (calls the boundary kernel does not record natively) -------------------------
    def append(self, record: Any, journaled: list[Any] | None = None) -> None:
        """Keep ``record``; the journal gets ``journaled`` where given (the compact record of
        an annotation whose ``record`` is its metadata dict: no JSON per call)."""
        with self._lock:
            if self.native is not None:
                ordinal = self.native.next_ordinal()
            else:
                self._recorded += 1
                ordinal = self._recorded
            self._ring.append((ordinal, record))
            if self.journal is not None:
                self.journal.add(record if journaled is None else journaled, ordinal)

    # -- bookkeeping ------------------------------------------------------------------------
    @property
    def recorded(self) -> int:
        return self.native.last_ordinal() if self.native is not None else self._recorded

    @property
    def dropped(self) -> int:
        kept = len(self._ring) + (self.native.size() if self.native is not None else 0)
        return max(0, self.recorded - min(self.capacity, kept))

    def records(self) -> list[dict[str, Any]]:
        """The records still kept, as metadata dicts, oldest first (read without the lock when
        a signal's flush interrupted the thread holding it: that thread is paused)."""
        with flush_lock(self._lock):
            kept = list(self._ring)
            if self.native is not None:
                kept += self._native_records(self.native.entries())
        kept.sort(key=lambda r: r[0])
        return [md.expand(r) for _, r in kept[-self.capacity:]]

    def clear(self) -> None:
        with self._lock:
            self._ring.clear()
            self._recorded = 0
            self.errors.clear()
            self._captured.clear()
            if self.native is not None:
                self.native.clear()
            if self.journal is not None:
                self.journal.restart()
        self.graphs.clear()
        self.replays.clear()
        self.marks.clear()
        self.traces.clear()

    def resize(self, capacity: int) -> None:
        with self._lock:
            self._ring = collections.deque(self._ring, maxlen=capacity)
            self.capacity = capacity
            if self.native is not None:
                self.native.resize(capacity)

    def note_groups(self) -> None:
        """Remember every live process group and this rank's place, so both survive teardown."""
        if dist.is_available() and dist.is_initialized():
            self._identity = {"rank": dist.get_rank(), "world_size": dist.get_world_size(),
                              "backend": str(dist.get_backend())}
        for info in process_groups.known_groups() + process_groups.seen_groups():
            self._groups[info.name] = info.table_row()

    def add_trace(self, file_name: str) -> None:
        if file_name not in self.traces:
            self.traces.append(file_name)

    # -- output -----------------------------------------------------------------------------
    def payload(self, exit_reason: str) -> dict[str, Any]:
        """The versioned record dict (``schema.py``) for this rank."""
        for finish in self.before_payload:
            finish()
        self.note_groups()
        rank = self._identity.get("rank", int(os.environ.get("RANK", 0)))
        world = self._identity.get("world_size", int(os.environ.get("WORLD_SIZE", 1)))
        nccl = None
        if torch.cuda.is_available():
            try:
                nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
            except Exception:
                nccl = None
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() and \
            torch.cuda.is_initialized() else "cpu"
        backend = self._identity.get("backend", "none")
        return {
            "schema": schema.SCHEMA, "version": schema.VERSION,
            "rank": rank, "world_size": world,
            "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
            "host": socket.gethostname(), "pid": os.getpid(), "device": device,
            "backend": backend, "torch_version": str(torch.__version__), "nccl_version": nccl,
            "exit": exit_reason,
            "clock": dict(self.clock, wall_ns=time.time_ns()),
            "process_groups": sorted(self._groups.values(),
                                     key=lambda g: (g["name"] != "0", g["name"])),
            "collectives": self.records(),
            "capacity": self.capacity, "recorded": self.recorded, "dropped": self.dropped,
            "graphs": list(self.graphs), "replays": list(self.replays),
            "marks": list(self.marks), "traces": list(self.traces),
        }

    def flush(self, exit_reason: str = "explicit", run_dir: str | os.PathLike[str] | None = None
              ) -> Path | None:
        """Write ``RUN_DIR/commviz_rank{R}.pkl`` atomically; returns its path (None: no run dir)."""
        target = Path(run_dir) if run_dir is not None else self.run_dir
        if target is None:
            return None
        if self.journal is not None:
            self.journal.rotate()
        payload = self.payload(exit_reason)
        path = target / schema.record_name(payload["rank"])
        store.dump_record(path, payload)
        if self.journal is not None:
            self.journal.flushed(target)
        return path


RECORDER = Recorder(int(os.environ.get("COMMVIZ_CAPACITY", DEFAULT_CAPACITY)))

_installed = False
_previous: dict[int, Any] = {}


def _on_signal(signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    try:
        RECORDER.flush(name)
    finally:
        prev = _previous.get(signum, signal.SIG_DFL)
        if callable(prev):
            prev(signum, frame)
        else:
            signal.signal(signum, signal.SIG_DFL if prev is None else prev)
            os.kill(os.getpid(), signum)


def _on_exit() -> None:
    if RECORDER.run_dir is not None:
        RECORDER.flush("normal")


class _PeriodicFlush(threading.Thread):
    """Rewrites the record every ``interval`` seconds when something new was recorded.

    Signal handlers only run when the main thread is back in Python; a rank stuck inside a
    blocking collective would lose its records to SIGKILL. This bounds the loss to one interval.
    """

    def __init__(self, interval: float) -> None:
        super().__init__(name="commviz-flush", daemon=True)
        self.interval = interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        written = -1
        while not self._stop_event.wait(self.interval):
            if RECORDER.recorded != written and RECORDER.run_dir is not None:
                written = RECORDER.recorded
                try:
                    RECORDER.flush("running")
                except Exception:  # a full disk must not kill the job; the exit flush retries
                    pass

    def stop(self) -> None:
        self._stop_event.set()


_flusher: _PeriodicFlush | None = None


def arm(run_dir: str | os.PathLike[str] | None = None, *, capacity: int | None = None,
        enabled: bool = True, handle_signals: bool = True,
        flush_interval: float | None = 30.0) -> Recorder:
    """Record into ``run_dir`` (default ``$COMMVIZ_RUN_DIR``) and arm flushing: the recorder's
    half of ``commviz.start`` (``commviz.patching``), which puts the kernels in first.

    The record is written at normal interpreter exit, when SIGTERM/SIGINT arrive (the previous
    handlers still run afterwards) and every ``flush_interval`` seconds while new records come
    in (None: never). Call ``flush()`` yourself before ``os._exit``. With a run dir, every
    thread's stack is left there when the rank is torn down (``commviz.record.stacks``).
    """
    global _installed, _flusher
    run_dir = run_dir if run_dir is not None else os.environ.get("COMMVIZ_RUN_DIR")
    if run_dir is not None:
        RECORDER.run_dir = Path(run_dir)
        RECORDER.run_dir.mkdir(parents=True, exist_ok=True)
        if RECORDER.journal is None or RECORDER.journal.run_dir != RECORDER.run_dir:
            if RECORDER.journal is not None:
                RECORDER.journal.close()
            RECORDER.journal = Journal(RECORDER.run_dir, RECORDER._lock,
                                       lambda: RECORDER.native)
    if capacity is not None:
        RECORDER.resize(capacity)
    RECORDER.enabled = enabled
    if not _installed:
        atexit.register(_on_exit)
        if handle_signals and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                _previous[sig] = signal.getsignal(sig)
                signal.signal(sig, _on_signal)
        _installed = True
    if run_dir is not None and handle_signals:         # after the handlers it chains to
        from commviz.record import stacks

        stacks.install(RECORDER.run_dir, dist.get_rank() if dist.is_available()
                       and dist.is_initialized() else int(os.environ.get("RANK", 0)))
    if flush_interval and _flusher is None:
        _flusher = _PeriodicFlush(flush_interval)
        _flusher.start()
    return RECORDER


def flush(exit_reason: str = "explicit") -> Path | None:
    """Write this rank's record now (also safe to call repeatedly: each write replaces the last)."""
    return RECORDER.flush(exit_reason)


def enable(on: bool = True) -> None:
    """Turn recording on or off (off: the boundary kernel passes calls straight to torch)."""
    RECORDER.enabled = on
