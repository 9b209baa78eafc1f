"""Record every collective where it enters c10d: a kernel in front of each c10d dispatcher op.

torch.distributed's functions, DDP's C++ reducer and its setup, FSDP, DTensor and functional
collectives, compiled code and calls under CUDA graph capture all end in c10d's dispatcher ops
(``c10d::allreduce_``, ``c10d::_allgather_base_``, ``c10d::send``, ...), whose kernels sit at the
backend's dispatch key: ``CPU`` for gloo, ``CUDA`` for NCCL. ``install()`` registers one kernel
per op at ``BackendSelect``, the key dispatched just before the backend's; it records the call
(``commviz.record.calls``) and redispatches to torch's own kernel, which stays registered as it
is. Nothing of torch is replaced at the Python level, so torch's functions, objects, warnings
and graph breaks stay exactly as they are.

The kernel is C++ (``boundary.cpp``), built against the installed torch on first use
(``torch.utils.cpp_extension``, cached in torch's extension dir; about 20 s once). Calls reach
it boxed (torch.distributed's functions, DDP and FSDP: torch's Autograd fallback, which runs
first for c10d's ops, boxes them) or unboxed (functional collectives, compiled code, inference
mode); it has an entry for each and takes a call as it came, so with recording off
(``commviz.enable(False)``) it converts nothing: an atomic load and a redispatch, about 200
instructions per call either way (``scripts/bench_overhead.py --instructions``, gloo). Measured
alternatives: a boxed-only kernel costs about 5,000 instructions per unboxed call even when off
(the dispatcher boxes the arguments for it and unboxes them again for torch's kernel); an
unboxed-only one costs about 550 per boxed call off and 5,900 more when recording. An op whose
C++ signature this torch changed gets the boxed-only kernel (``BOUNDARY.boxed`` names them).
Recording, it reads the call's sizes, dtype, group and root off the boxed
arguments without making Python objects of them and never holds the GIL while torch's kernel
runs. A call is recorded in C++, collective or point-to-point, while a profiler runs or not:
its call site's *shape* is registered once (``calls.shape``), then each call adds a fixed entry
to a native ring and calls file (``RECORDER.attach``); under a profiler the profiler's own
``c10d::<op>`` event is the call in the trace (``commviz.match.ranges`` pairs them after the
job). A collective inside an ``annotate_collective`` block gives its number to the block
(``calls.Claim``). Under CUDA graph capture a synchronous call is recorded the same way and the
kernel reads its stream's capture frontier as it returns; the capture code places it in its
graph after the capture (``graphs.adopt_native``). Other calls (split sizes, origins that
change per call, asynchronous or p2p work under capture) build their record in Python
(``calls.begin``).

There is no pure-Python kernel on purpose: a ``torch.library`` Python kernel must call torch's
kernel with the GIL held, and gloo's worker thread (like NCCL's watchdog) takes the GIL to free
the previous call's tensors while holding the lock the next call needs: the job deadlocks
within a few thousand calls (seen here on gloo, torch 2.13). Where the C++ kernel cannot be
built (no compiler), ``install`` says why once and records nothing at the boundary; a job runs
exactly as without commviz. ``COMMVIZ_BOUNDARY=off`` installs nothing.
"""

from __future__ import annotations

import enum
import fcntl
import hashlib
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from commviz import metadata as md
from commviz.record import calls, capturing, ddp_buckets, origins
from commviz.record.ops import CODES, OPS, OpSpec
from commviz.record.recorder import RECORDER

SOURCE = Path(__file__).with_name("boundary.cpp")


class Impl(enum.Enum):
    CPP = "cpp"
    OFF = "off"


@dataclass(frozen=True)
class Positions:
    """Where an op's schema keeps each argument the record reads (-1: it has none)."""

    sent: int
    received: int
    group: int
    reduce_op: int
    root: int
    async_op: int
    out_split: int
    in_split: int

    @classmethod
    def of(cls, name: str, spec: OpSpec) -> "Positions":
        args = [a.name for a in getattr(torch.ops.c10d, name).default._schema.arguments]

        def at(*names: str) -> int:
            return next((args.index(n) for n in names if n in args), -1)

        # the list all_to_all's splits are its tensors' sizes (as the profiler records them)
        lists = (spec.received, spec.sent) if spec.split_by_tensor else ("", "")
        return cls(sent=at(spec.sent), received=at(spec.received) if spec.received else -1,
                   group=at("process_group"), reduce_op=at("reduce_op"),
                   root=at("root_rank", "dst", "src"), async_op=at("async_op"),
                   out_split=at("output_split_sizes", lists[0]),
                   in_split=at("input_split_sizes", lists[1]))


def available_ops() -> dict[str, Positions]:
    """The ops of ``OPS`` this torch has, with their argument positions."""
    out = {}
    for name, spec in OPS.items():
        if hasattr(torch.ops.c10d, name):
            out[name] = Positions.of(name, spec)
    return out


# -- the compiled kernel ----------------------------------------------------------------------

def build_directory() -> tuple[str, Path]:
    """The extension's name (this source file, its content, this torch) and where torch builds
    and caches it. The path is part of the name because torch's build file names the source's
    path: two checkouts sharing one build dir would rebuild it in turn, minutes each."""
    from torch.utils import cpp_extension

    key = SOURCE.read_bytes() + str(SOURCE.resolve()).encode() + torch.__version__.encode()
    digest = hashlib.sha1(key).hexdigest()[:12]
    name = f"commviz_boundary_{digest}"
    return name, Path(cpp_extension._get_build_directory(name, verbose=False))


def _build() -> Any:
    """Build (or load the cached build of) ``boundary.cpp`` against this torch.

    torch's own build lock is a file that a process killed mid-build (a SIGKILLed rank) leaves
    behind, and every later build then waits on it forever. So builds are serialised by an
    ``flock``, which the kernel drops with its holder, and under it a torch lock file can
    only be such a leftover: it is removed."""
    from torch.utils import cpp_extension

    name, build_dir = build_directory()
    with open(build_dir / "commviz.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=["-O2"],
                                      build_directory=str(build_dir), verbose=False)


def prebuild() -> str | None:
    """Build the kernel now, once, before ranks start (they would otherwise all wait on one
    build lock at their first collective); returns why it cannot be built, or None."""
    try:
        _build()
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[-1] if lines else ''}"
    return None


class _Boundary:
    """The installed kernels: which implementation, and what keeps them registered."""

    def __init__(self) -> None:
        self.impl: Impl | None = None
        self.problem: str | None = None       # why the C++ kernel is not the one in use
        self.boxed: tuple[str, ...] = ()      # ops whose C++ signature this torch changed
        self.unrecorded: tuple[str, ...] = ()  # ops with another BackendSelect kernel
        self._lock = threading.Lock()
        self._ext: Any = None

    def install(self, impl: Impl | None = None) -> Impl:
        """Put commviz's kernel in front of every c10d op (idempotent); returns whether it is.

        ``impl`` defaults to ``$COMMVIZ_BOUNDARY`` (``cpp`` or ``off``), else ``cpp``."""
        with self._lock:
            if self.impl is not None:
                return self.impl
            want = impl or Impl(os.environ.get("COMMVIZ_BOUNDARY", Impl.CPP.value))
            self.impl = Impl.OFF
            if want is Impl.CPP:
                try:
                    self._install_cpp(available_ops())
                    self.impl = Impl.CPP
                except Exception as exc:  # no compiler, no headers: run as without commviz
                    lines = str(exc).strip().splitlines()
                    self.problem = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
                    warnings.warn("commviz: the c10d boundary recorder could not be built, "
                                  f"so collectives are not recorded ({self.problem})",
                                  RuntimeWarning, stacklevel=3)
            if self.impl is Impl.CPP:
                RECORDER.attach(self._ext)
            return self.impl

    def _install_cpp(self, ops: dict[str, Positions]) -> None:
        ext = self._ext or _build()
        specs = [(name, ext.OpSpec(CODES.index(name), p.sent, p.received, p.group, p.reduce_op,
                                   p.root, p.async_op, p.out_split, p.in_split))
                 for name, p in ops.items()]
        python = {"begin": calls.begin, "finish": calls.finish, "shape": calls.shape,
                  "microbatch": calls.microbatch, "scoped": calls.scoped,
                  "failed": calls.failed, "hooks": capturing, "coalescing": calls.COALESCING}
        boxed, unrecorded = ext.install(specs, python,
                                        (md.R_SEQ, md.R_T_END, md.R_META, md.R_REGION),
                                        list(calls.OWN_DIRS),
                                        list(origins.prefixes(RECORDER.origins)))
        self._ext = ext
        stack = calls.SCOPE.stack
        ext.set_scope(len(stack), stack[-1] if stack else None)
        calls.MIRROR = ext.set_scope
        capturing.NOTIFY = ext.set_capture_possible
        capturing.changed()
        RECORDER.origins.native = ext
        ext.watch_exit(origins.ddp.FORWARD, ddp_buckets.learn)
        self.boxed, self.unrecorded = tuple(boxed), tuple(unrecorded)
        if unrecorded:
            warnings.warn("commviz: another kernel sits at BackendSelect for "
                          f"{', '.join(unrecorded)}; those ops are not recorded",
                          RuntimeWarning, stacklevel=4)

    def uninstall(self) -> None:
        """Give torch its own kernels back."""
        with self._lock:
            if self._ext is not None:
                self._ext.uninstall()
                RECORDER.detach()
            self.impl = None


BOUNDARY = _Boundary()
install = BOUNDARY.install
uninstall = BOUNDARY.uninstall
