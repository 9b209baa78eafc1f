"""Clock offsets between ranks, measured over the job's own process group.

Ranks on one host share the wall clock. Across hosts each rank plays a few NTP-style rounds with
rank 0 over a gloo group: rank 0 notes t0, the rank answers with its clock t1, rank 0 notes t2;
the round with the smallest round trip gives ``offset = (t0 + t2) / 2 - t1``, the amount to add
to this rank's timestamps to land on rank 0's clock (error at most half that round trip).
"""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
import torch.distributed as dist

ROUNDS = 8


def measure_offsets(group: Any) -> dict[str, Any]:
    """Collective over ``group`` (gloo, all ranks): this rank's clock entry for its record.

    Its own messages are not recorded as the job's collectives."""
    from commviz.record.calls import unrecorded

    with unrecorded():
        return _measure(group)


def _measure(group: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    world = dist.get_world_size(group)
    host = socket.gethostname().encode()[:255]
    name = torch.zeros(256, dtype=torch.uint8)
    name[0] = len(host)
    name[1:1 + len(host)] = torch.frombuffer(bytearray(host), dtype=torch.uint8)
    hosts = [torch.zeros_like(name) for _ in range(world)]
    dist.all_gather(hosts, name, group=group)
    h0 = bytes(hosts[0][1:1 + int(hosts[0][0])].tolist())
    remote = [dist.get_global_rank(group, i) for i in range(world)
              if bytes(hosts[i][1:1 + int(hosts[i][0])].tolist()) != h0]
    if not remote:
        return {"offset_ns": 0, "offset_source": "same-host", "rtt_ns": 0}
    buf = torch.zeros(1, dtype=torch.int64)
    best = (None, 0)
    for peer in remote:
        for _ in range(ROUNDS):
            if rank == 0:
                t0 = time.time_ns()
                dist.send(buf, peer, group=group)
                dist.recv(buf, peer, group=group)
                t2 = time.time_ns()
                dist.send(torch.tensor([t0 + t2 - 2 * int(buf.item())], dtype=torch.int64)
                          // 2, peer, group=group)
                dist.send(torch.tensor([t2 - t0], dtype=torch.int64), peer, group=group)
            elif rank == peer:
                dist.recv(buf, 0, group=group)
                buf[0] = time.time_ns()
                dist.send(buf, 0, group=group)
                offset, rtt = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
                dist.recv(offset, 0, group=group)
                dist.recv(rtt, 0, group=group)
                if best[0] is None or rtt.item() < best[1]:
                    best = (int(offset.item()), int(rtt.item()))
    if rank in remote:
        return {"offset_ns": best[0], "offset_source": "measured", "rtt_ns": best[1]}
    return {"offset_ns": 0, "offset_source": "same-host", "rtt_ns": 0}
