"""What the SIGKILL-proof journal adds to a recorded collective, measured side by side.

One gloo rank records one-element ``all_reduce`` calls in interleaved batches, the recorder's
journal attached (every record also lands in ``commviz_rank0.N.journal``) or detached; per call,
median and minimum over the batches of this thread's CPU time. Target: well under 1 us added.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as td

import commviz
from commviz.record.recorder import RECORDER


def _batch(tensor: torch.Tensor, calls: int) -> float:
    t0 = time.thread_time_ns()
    for _ in range(calls):
        td.all_reduce(tensor)
    return (time.thread_time_ns() - t0) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per batch")
    parser.add_argument("--batches", type=int, default=15)
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
    td.init_process_group("gloo", rank=0, world_size=1)
    commviz.start(tempfile.mkdtemp(prefix="commviz-journal-bench-"), capacity=10_000,
                  flush_interval=None)
    commviz.patch()                        # whichever path records: wrappers or the boundary
    journal = RECORDER.journal
    tensor = torch.ones(1)
    times: dict[str, list[float]] = {"journal": [], "no journal": []}
    _batch(tensor, 200)
    for _ in range(args.batches):
        for name in times:
            RECORDER.journal = journal if name == "journal" else None
            times[name].append(_batch(tensor, args.calls))
    RECORDER.journal = journal
    print(f"journal cost: all_reduce of 1 element, gloo, 1 rank, {args.batches} batches x "
          f"{args.calls} calls, thread CPU time per call")
    for stat in (statistics.median, min):
        on, off = stat(times["journal"]), stat(times["no journal"])
        print(f"{stat.__name__:>6}: no journal {off / 1000:.2f} us, journal {on / 1000:.2f} us, "
              f"added {(on - off) / 1000:+.2f} us")
    print(f"records journaled: {RECORDER.recorded}, journal: {journal.error or 'ok'}")
    td.destroy_process_group()


if __name__ == "__main__":
    main()
