"""GPU time of every NCCL op, always: commviz's NCCL profiler plugin, built, armed, switched.

On NCCL every c10d call returns once its kernel is enqueued, so a record's times are the
launch's. ``nccl_profiler.c`` is an NCCL profiler plugin (the interface NCCL Inspector uses):
NCCL's kernels stamp each channel's start and end with the GPU's timer, its proxy thread hands
the stamps to the plugin, and the plugin appends one fixed entry per op to
``RUN_DIR/commviz_rank{R}.gputime`` (``commviz.live.gputime`` reads it and matches each op to
its record). The calling thread only fills a slot per op (about 0.1 us); NCCL's own share,
its kernels stamping and its proxy thread collecting, costs the calling thread more: +2.9 us
a call on 2 x H200 when every call is timed (torch's TORCH_NCCL_ENABLE_TIMING=1: +5.9 us in
the same run). So by default one NCCL call in ``DEFAULT_EVERY`` is timed (+0.1 us;
``COMMVIZ_GPUTIME_EVERY=1`` times every call): windows of 20 calls gave bus bandwidths within
1.8 % of timing every call (``tests/test_gputime.py``).

``arm`` (called by ``commviz.start``) builds the plugin with the C compiler (once, cached
beside the boundary kernel's build) and points NCCL at it through ``NCCL_PROFILER_PLUGIN``
and the rank's file through ``COMMVIZ_GPUTIME_FILE``. NCCL reads both when it makes its first
communicator (torch makes it at a group's first collective, or in ``init_process_group`` when
given ``device_id``): a job whose communicators exist before ``commviz.start`` gets no GPU
times. ``COMMVIZ_GPUTIME=off`` arms nothing; a plugin the user set in ``NCCL_PROFILER_PLUGIN``
is left alone (NCCL loads one).

This module imports no torch at import time: the file's layout below is read by the live tools.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import struct
import subprocess
import sysconfig
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("nccl_profiler.c")
HEADER_FILE = Path(__file__).with_name("nccl_profiler.h")
LIBRARY = "libcommviz-nccl-profiler.so"
SWITCH = "COMMVIZ_GPUTIME"                  # "off": no plugin
FILE_ENV = "COMMVIZ_GPUTIME_FILE"           # where the plugin writes (read by it at NCCL init)
EVERY = "COMMVIZ_GPUTIME_EVERY"             # time one NCCL call in k (1: every call)
DEFAULT_EVERY = 4                           # measured: +0.1 us a call; every call +2.9 us
PLUGIN_ENV = "NCCL_PROFILER_PLUGIN"

# The file (nccl_profiler.c, top): a header, then fixed entries whose first u32 is their kind
MAGIC = b"commviz.gputime.1\n"
HEADER = struct.Struct("<24sIIqqi")         # magic (padded), entry size, header size, pid, t0,
                                            # one call in how many timed (EVERY)
HEADER_SIZE = 4096
KIND_OP, KIND_COMM, KIND_NAME = 1, 2, 3
FLAG_P2P, FLAG_PARTIAL, FLAG_REPLAY = 1, 2, 4
OP = struct.Struct("<IBBBBQQQiiqQQqq")      # kind func flags channels expected comm seq bytes
                                            # peer tid t_enqueue gpu_start gpu_end seen_s seen_e
COMM = struct.Struct("<IiQii56s")           # kind rank comm nranks nnodes name
NAME = struct.Struct("<II72s")              # kind code name
ENTRY_SIZE = OP.size
assert OP.size == COMM.size == NAME.size == 80


def gputime_name(rank: int) -> str:
    """Rank ``rank``'s GPU-time file in the run dir."""
    return f"commviz_rank{rank}.gputime"


def build() -> Path:
    """The plugin library, compiled on first use (C compiler, about a second) and cached by
    its source's content; builds are serialised by an ``flock`` (ranks start together)."""
    from torch.utils import cpp_extension

    digest = hashlib.sha1(SOURCE.read_bytes() + HEADER_FILE.read_bytes()).hexdigest()[:12]
    name = f"commviz_nccl_profiler_{digest}"
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    out = build_dir / LIBRARY
    if out.exists():
        return out
    cc = shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) or "cc"
    with open(build_dir / "commviz.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        if not out.exists():
            tmp = build_dir / f".{LIBRARY}.{os.getpid()}"
            subprocess.run([cc, "-O2", "-fPIC", "-shared", "-fvisibility=hidden", "-std=gnu11",
                            "-o", str(tmp), str(SOURCE), "-lpthread"],
                           check=True, capture_output=True, text=True)
            os.replace(tmp, out)
    return out


def arm(run_dir: Path, rank: int) -> Path | None:
    """Point NCCL at the plugin and rank ``rank``'s file in ``run_dir`` (before NCCL makes its
    first communicator); returns the file, or None when GPU times are not taken (said once)."""
    if os.environ.get(SWITCH, "on").lower() in ("off", "0", "false", "no"):
        return None
    mine = os.environ.get(PLUGIN_ENV)
    if mine and Path(mine).name != LIBRARY:
        warnings.warn(f"commviz: {PLUGIN_ENV}={mine} is set, so NCCL loads that profiler and "
                      "commviz takes no GPU times", RuntimeWarning, stacklevel=3)
        return None
    try:
        library = build()
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        warnings.warn(f"commviz: the NCCL profiler plugin could not be built, so NCCL ops get no "
                      f"GPU times ({detail.strip().splitlines()[-1] if detail.strip() else exc})",
                      RuntimeWarning, stacklevel=3)
        return None
    path = Path(run_dir) / gputime_name(rank)
    os.environ[PLUGIN_ENV] = str(library)
    os.environ[FILE_ENV] = str(path)
    os.environ.setdefault(EVERY, str(DEFAULT_EVERY))
    return path


def enable(on: bool = True) -> bool:
    """Time NCCL ops enqueued from now on (``on``) or not; returns whether it was on. Off,
    NCCL skips the plugin and its kernels stamp nothing."""
    library = os.environ.get(PLUGIN_ENV)
    if not library or Path(library).name != LIBRARY:
        return False
    return bool(ctypes.CDLL(library).commviz_gputime_enable(int(on)))
