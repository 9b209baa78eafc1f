"""Every thread's Python stack, left in the run dir when a rank is torn down or asked for it.

When a job hangs, the question is where the rank that never arrived *was*. Python-level signal
handlers run only once the main thread is back in Python, so a rank blocked in a C++ collective
would say nothing until the watchdog kills it. ``faulthandler`` writes the stacks from its own
C-level handler at once, then hands the signal on (``chain=True``) to whatever handler torch,
the program or commviz's flush installed before it. ``install`` arms it per rank:

- ``stacks_rank{R}.txt`` (teardown): on SIGTERM/SIGINT (torchrun stopping the job), on a fatal
  signal (SIGABRT from NCCL's watchdog, SIGSEGV, ...: ``faulthandler.enable``, unless the program
  enabled it already), and an uncaught exception's traceback (``sys.excepthook``, chained);
- ``stacks_rank{R}.live.txt`` (on request, the job goes on): ``LIVE_SIGNAL``, sent by ``commviz
  status`` / ``commviz launch`` while a job hangs (``signal_here``: to this host's ranks; other
  nodes' ranks are asked through the run dir, ``commviz.record.asking``). A real-time signal,
  which no launcher or program sends by default; if the program handles it already, it is left
  alone. ``Dumps`` tells when the asked ranks have written.

Each file starts with one header line (rank, pid, the main thread's id, the live signal); the
dumps follow in faulthandler's own format, which ``read_stacks`` parses (text only; the last
dump of each thread wins). SIGKILL leaves nothing here (nothing can run): the journal still
keeps that rank's records.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import linecache
import os
import re
import signal
import sys
import sysconfig
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable

STACKS = "stacks_rank{rank}.txt"
LIVE_SUFFIX = ".live.txt"
LIVE = "stacks_rank{rank}" + LIVE_SUFFIX
LIVE_SIGNAL = signal.SIGRTMIN + 5 if hasattr(signal, "SIGRTMIN") else None
TEARDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
POLL_S = 0.05                              # how often a dump's arrival is looked for
HEADER = "# commviz stacks: rank {rank} pid {pid} main {main} live-signal {sig}\n"
EXCEPTION = "Uncaught exception"           # how an uncaught exception's section starts
_HEADER_RE = re.compile(r"# commviz stacks: rank (\d+) pid (\d+) main (0x[0-9a-f]+) "
                        r"live-signal (\S+)")
_THREAD_RE = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)(?: \[[^\]]*\])? "
                        r"\(most recent call first\):")
_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (.*)$')
_TB_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+), in (.*)$', re.M)
_FATAL_RE = re.compile(r"^Fatal Python error: (.*)$")
# what joins the tracebacks of a chained exception (the first raised printed first)
_CHAINED_RE = re.compile(r"^(?:The above exception was the direct cause of the following "
                         r"exception:|During handling of the above exception, another "
                         r"exception occurred:)$", re.M)

_files: dict[str, IO[str]] = {}            # kept open: faulthandler writes to their fds
_headers: dict[str, int] = {}              # each file's size before anything was dumped
_teardown: IO[str] | None = None           # this rank's teardown file
_fatal_ours = False                        # faulthandler.enable was commviz's call


def stacks_path(run_dir: Path, rank: int, live: bool = False) -> Path:
    return Path(run_dir) / (LIVE if live else STACKS).format(rank=rank)


def _thread_id(ident: int | None) -> str:
    return f"0x{ident or 0:016x}"


def _open(path: Path, rank: int) -> IO[str]:
    old = _files.pop(str(path), None)
    if old is not None:
        old.close()
    f = open(path, "w", buffering=1)
    f.write(HEADER.format(rank=rank, pid=os.getpid(), main=_thread_id(threading.main_thread().ident),
                          sig=LIVE_SIGNAL if LIVE_SIGNAL is not None else "-"))
    f.flush()
    if not _files and not _headers:
        atexit.register(tidy)
    _files[str(path)], _headers[str(path)] = f, f.tell()
    return f


def tidy() -> None:
    """Remove the files nothing was dumped into (a healthy run leaves none). Runs at a normal
    exit; a process that ends with ``os._exit`` calls it first. A rank torn down by a signal
    never gets here, and keeps its dump."""
    for name, f in list(_files.items()):
        try:
            if os.fstat(f.fileno()).st_size == _headers.get(name):   # faulthandler writes the fd
                os.unlink(name)     # the fd stays open: faulthandler may still hold it
        except (OSError, ValueError):
            pass


def install(run_dir: Path, rank: int) -> None:
    """Arm the stack dumps of this rank into ``run_dir`` (main thread only: signal handlers
    can only be set there). Called by ``commviz.start``; a later call moves the dumps to its
    run dir (the exception hook is chained once)."""
    global _teardown, _fatal_ours
    if threading.current_thread() is not threading.main_thread():
        return
    _teardown = _open(stacks_path(run_dir, rank), rank)
    if _fatal_ours or not faulthandler.is_enabled():   # the program's own fatal dump stays
        faulthandler.enable(_teardown, all_threads=True)
        _fatal_ours = True
    for sig in TEARDOWN_SIGNALS:
        faulthandler.register(sig, _teardown, all_threads=True, chain=True)
    if LIVE_SIGNAL is not None and signal.getsignal(LIVE_SIGNAL) in (signal.SIG_DFL, None):
        faulthandler.register(LIVE_SIGNAL, _open(stacks_path(run_dir, rank, True), rank),
                              all_threads=True, chain=False)
    if getattr(sys.excepthook, "__module__", None) != __name__:
        previous = sys.excepthook

        def excepthook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
            try:
                if _teardown is not None:
                    _teardown.write(f"{EXCEPTION} ({time.time_ns()}):\n"
                                    + "".join(traceback.format_exception(kind, exc, tb)) + "\n")
                    _teardown.flush()
            except (OSError, ValueError):
                pass
            previous(kind, exc, tb)
        sys.excepthook = excepthook


def request(pid: int) -> bool:
    """Ask the rank with ``pid`` (on this host) for its stacks now; False if it cannot be
    asked (gone, not ours, no live signal)."""
    if LIVE_SIGNAL is None:
        return False
    try:
        os.kill(pid, LIVE_SIGNAL)
    except OSError:
        return False
    return True


def live_pids(run_dir: Path) -> dict[int, int]:
    """rank -> pid of every rank that armed its live dump in ``run_dir`` (its file's header)."""
    out = {}
    for path in Path(run_dir).glob(LIVE.format(rank="*")):
        try:
            with open(path) as f:
                m = _HEADER_RE.match(f.readline())
        except OSError:
            continue
        if m and m.group(4) != "-":
            out[int(m.group(1))] = int(m.group(2))
    return out


def _holds(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open: it is that rank, not a later process that
    reuses its pid (a real-time signal's default action would end it)."""
    target = str(Path(path).resolve())
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                return True
        except OSError:
            continue
    return False


def signal_here(run_dir: Path, ranks: Iterable[int] | None = None) -> list[int]:
    """Ask every rank of ``run_dir`` (of ``ranks``) that runs on this host for its stacks, at
    once; the ranks asked. Others (on other hosts) are asked by their node's launch
    (``commviz.record.asking``)."""
    wanted = None if ranks is None else set(ranks)
    return [rank for rank, pid in sorted(live_pids(run_dir).items())
            if (wanted is None or rank in wanted)
            and _holds(pid, stacks_path(run_dir, rank, live=True)) and request(pid)]


def _size(path: Path) -> int:
    """The file's size, through an open: a shared file system revalidates its cached
    attributes on open, not on a plain stat."""
    try:
        with open(path, "rb") as f:
            return os.fstat(f.fileno()).st_size
    except OSError:
        return -1


class Dumps:
    """Which ranks' live stacks files got a new dump since it was made: grown, and no longer
    growing (faulthandler writes a dump in many small writes)."""

    def __init__(self, run_dir: Path, ranks: Iterable[int]) -> None:
        self.run_dir = Path(run_dir)
        self.before = {r: _size(stacks_path(run_dir, r, live=True)) for r in ranks}
        self._last = dict(self.before)

    def poll(self, ranks: Iterable[int]) -> set[int]:
        """Those of ``ranks`` (known at the start) that have written by now."""
        now = {r: _size(stacks_path(self.run_dir, r, live=True)) for r in ranks
               if r in self.before}
        done = {r for r, n in now.items() if n > self.before[r] and n == self._last[r]}
        self._last.update(now)
        return done

    def wait(self, ranks: Iterable[int], wait_s: float) -> set[int]:
        """Poll until each of ``ranks`` wrote its dump, or ``wait_s`` passed; those that did."""
        todo, deadline = set(ranks), time.monotonic() + wait_s
        while True:
            done = self.poll(todo)
            if done == todo or time.monotonic() >= deadline:
                return done
            time.sleep(POLL_S)


def request_all(run_dir: Path, wait_s: float = 1.0) -> list[int]:
    """Ask every rank of ``run_dir`` running on this host for its stacks, then give them up to
    ``wait_s`` to write; the ranks asked."""
    dumps = Dumps(run_dir, live_pids(run_dir))
    asked = signal_here(run_dir)
    dumps.wait(asked, wait_s)
    return asked


# -- reading back -------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Frame:
    file: str
    line: int
    func: str

    def source(self) -> str:
        """The line's text, when the file is readable here."""
        return linecache.getline(self.file, self.line).strip()

    def __str__(self) -> str:
        text = self.source()
        func = f" in {self.func}" if self.func else ""       # "": a call site, not a stack's
        return f"{self.file}:{self.line}{func}" + (f": {text}" if text else "")


@dataclass(frozen=True, slots=True)
class ThreadStack:
    ident: str
    frames: tuple[Frame, ...]              # innermost first, as faulthandler prints them


@dataclass
class Stacks:
    """One rank's stacks file, parsed."""

    path: Path
    rank: int | None = None
    pid: int | None = None
    main: str | None = None                # the main thread's id, as faulthandler prints it
    threads: dict[str, ThreadStack] = field(default_factory=dict)   # last dump of each
    fatal: str | None = None               # "Aborted", "Segmentation fault", ...
    exception: str | None = None           # an uncaught exception's last line
    traceback: str | None = None

    @property
    def main_thread(self) -> ThreadStack | None:
        if self.main in self.threads:
            return self.threads[self.main]
        return next(iter(self.threads.values()), None)

    def raised_at(self) -> Frame | None:
        """Where the uncaught exception was raised (``raised_at``)."""
        return raised_at(self.traceback or "")

    def user_frame(self) -> Frame | None:
        """The innermost frame of the main thread in the program's own code (not the standard
        library, an installed package or commviz): the line it was stuck on."""
        main = self.main_thread
        if main is None:
            return None
        return next((f for f in main.frames if is_user(f.file)), None)


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    package = Path(__file__).resolve().parents[1]
    dirs.add(str(package))                                      # commviz itself
    return tuple(sorted(d.rstrip("/") + "/" for d in dirs if d))


# any Python's standard library, wherever it is installed: stacks are often read on another
# machine than the one that wrote them (/usr/lib/python3.12/ there, a pyenv's here)
_STDLIB_RE = re.compile(r"/lib(?:64)?/python\d+\.\d+/")


def is_user(file: str) -> bool:
    """Whether ``file`` is the program's own code (not the standard library, an installed
    package or commviz)."""
    return not (file.startswith("<") or "/site-packages/" in file or "/dist-packages/" in file
                or file.startswith(_library_dirs()) or _STDLIB_RE.search(file) is not None)


def chain(traceback_text: str) -> list[str]:
    """A formatted traceback's part per exception of its chain, the first raised first (a
    framework that wraps an error, ``raise ... from``, prints the original first)."""
    return [part for part in _CHAINED_RE.split(traceback_text) if part.strip()]


def raised_at(traceback_text: str) -> Frame | None:
    """The innermost frame of the program's own code in a formatted traceback: the line that
    raised (or called what raised); of a chained exception, the first one raised that passed
    through the program's own code (the original error, not the wrapper around it)."""
    for part in chain(traceback_text):
        frames = [Frame(m.group(1), int(m.group(2)), m.group(3))
                  for m in _TB_FRAME_RE.finditer(part)]
        frame = next((f for f in reversed(frames) if is_user(f.file)), None)
        if frame is not None:
            return frame
    return None


def exception_line(text: str) -> str:
    """An exception's message on one line: its first, joined with the next where the first
    says nothing past the type (``RuntimeError: `` with the message on the lines after)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    first = lines[0]
    if len(lines) > 1 and (first.endswith(":") or ":" not in first):
        first = f"{first} {lines[1]}"
    return first.rstrip(":").strip()


def _exception_of(part: str) -> str:
    """The exception one part of a formatted traceback ends with (its frames skipped)."""
    lines = part.strip().splitlines()
    at = next((i for i, line in enumerate(lines) if line and not line[0].isspace()
               and not line.startswith("Traceback (")), None)
    return "" if at is None else exception_line("\n".join(lines[at:]))


def raised(traceback_text: str) -> str | None:
    """What a formatted traceback raised, on one line: of a chained exception the first one
    raised, and what it was raised again as ("RuntimeError: injected (raised again as
    RuntimeError: [Stage 1] failed to run forward)"). None: no exception in it."""
    said = [e for e in map(_exception_of, chain(traceback_text)) if e]
    if not said:
        return None
    return said[0] if len(said) == 1 else f"{said[0]} (raised again as {said[-1]})"


def _chain_goes_on(lines: list[str], i: int) -> bool:
    """Whether the blank line ``i`` of an exception's section is inside its chain (the next
    text joins another traceback to it) rather than its end."""
    after = next((line for line in lines[i + 1:] if line.strip()), "")
    return bool(_CHAINED_RE.match(after)) or after.startswith("Traceback (")


def read_stacks(path: Path) -> Stacks | None:
    """Parse a stacks file; None when it holds no dump (the rank was never torn down)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    out = Stacks(path=Path(path))
    current: list[Frame] | None = None
    ident = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if m := _HEADER_RE.match(line):
            out.rank, out.pid, out.main = int(m.group(1)), int(m.group(2)), m.group(3)
        elif m := _FATAL_RE.match(line):
            out.fatal = m.group(1)
        elif m := _THREAD_RE.match(line):
            current, ident = [], m.group(2)
            out.threads[ident] = ThreadStack(ident, ())
        elif current is not None and (m := _FRAME_RE.match(line)):
            current.append(Frame(m.group(1), int(m.group(2)), m.group(3)))
            out.threads[ident] = ThreadStack(ident, tuple(current))
        elif line.startswith(EXCEPTION):
            current = None
            block = []
            while i < len(lines) and (lines[i].strip() or _chain_goes_on(lines, i)):
                block.append(lines[i])
                i += 1
            out.traceback = "\n".join(block)
            out.exception = raised(out.traceback)
        elif not line.strip():
            current = None
    if not out.threads and out.fatal is None and out.exception is None:
        return None
    return out
