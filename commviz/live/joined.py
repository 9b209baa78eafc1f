"""What the live join makes of a window's calls (``commviz.live.window.join``) and the causes
read (``commviz.live.cause``): instances of collectives and point-to-point transfers, in columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from commviz import metadata as md
from commviz.merge.instances import WARMUP

P2P_GROUP = "p2p"                # the rows of transfers: one group, a row per origin


class Group(NamedTuple):
    name: str
    desc: str
    ranks: tuple[int, ...]

    @property
    def label(self) -> str:
        return md.group_label(self.desc, self.ranks)


@dataclass(slots=True)
class Instances:
    """Complete instances, one element per instance in each array (``join``)."""

    groups: list[Group]
    origins: list[str]
    group: np.ndarray            # index into ``groups``
    origin: np.ndarray           # index into ``origins`` (the late rank's call's)
    seq: np.ndarray
    n: np.ndarray                # ranks that made the call
    first_start: np.ndarray
    last_start: np.ndarray
    last_end: np.ndarray
    late_rank: np.ndarray
    wait: np.ndarray             # the other ranks' wait for the late one, summed
    comm: np.ndarray             # ns; -1: none (launch only, failed)
    bus_bytes: np.ndarray        # size x bus factor where there is a bandwidth, else 0
    launch_only: np.ndarray
    arrived: np.ndarray          # its calls' starts are the ranks' arrivals (not an NCCL launch)
    gpu: np.ndarray              # its times are its calls' GPU times (every call timed)
    size: np.ndarray             # bytes (nccl-tests' S)
    root: np.ndarray             # the rank whose lateness it was (``roots``; -1: not known)
    inherited: np.ndarray        # its late rank's lateness was carried in (``held``)

    @property
    def skew(self) -> np.ndarray:
        return self.last_start - self.first_start

    def arrivals(self) -> np.ndarray:
        """The skews a row's figures are read from: those of instances with real arrivals
        (GPU-timed, or CPU calls); all of them when there are none (NCCL without GPU times:
        the launch skew, said as CPU times)."""
        usable = self.arrived
        return self.skew[usable] if usable.any() else self.skew

    def take(self, mask: np.ndarray) -> Instances:
        return Instances(self.groups, self.origins, **{
            name: getattr(self, name)[mask] for name in _INSTANCE_ARRAYS})

    def __len__(self) -> int:
        return len(self.group)


_INSTANCE_ARRAYS = ("group", "origin", "seq", "n", "first_start", "last_start", "last_end",
                    "late_rank", "wait", "comm", "bus_bytes", "launch_only", "arrived", "gpu", "size",
                    "root", "inherited")


@dataclass(slots=True)
class Transfers:
    """A window's point-to-point transfers, each a send matched to its receive (``join``)."""

    group_names: list[str]
    group_labels: list[str]
    origins: list[str]
    group: np.ndarray            # index into ``group_names``: the process group
    origin: np.ndarray           # index into ``origins``: the receive's (stage and action)
    src: np.ndarray
    dst: np.ndarray
    link: np.ndarray             # src << 32 | dst
    size: np.ndarray
    send_post: np.ndarray
    recv_post: np.ndarray
    delivery: np.ndarray         # the later post -> the receiver's next call; -1: not yet seen

    def __len__(self) -> int:
        return len(self.src)

    def take(self, mask: np.ndarray) -> Transfers:
        return Transfers(self.group_names, self.group_labels, self.origins, **{
            name: getattr(self, name)[mask] for name in _TRANSFER_ARRAYS})

    def as_instances(self) -> Instances:
        """The transfers as instances of one group (``P2P_GROUP``), for the rows per origin:
        skew between the two postings, the receive's wait for a late send, the delivery as
        their comm time."""
        first = np.minimum(self.send_post, self.recv_post)
        last = np.maximum(self.send_post, self.recv_post)
        known = self.delivery >= 0
        z = np.zeros(len(self), np.int64)
        return Instances(
            [Group(P2P_GROUP, P2P_GROUP, ())], self.origins, group=z, origin=self.origin,
            seq=z + WARMUP + 1, n=z + 2, first_start=first, last_start=last,
            last_end=last + np.maximum(self.delivery, 0),
            late_rank=np.where(self.send_post > self.recv_post, self.src, self.dst),
            wait=np.maximum(0, self.send_post - self.recv_post), comm=self.delivery,
            bus_bytes=np.where(known & (self.delivery > 0), self.size, 0).astype(np.float64),
            launch_only=np.zeros(len(self), bool), arrived=np.ones(len(self), bool),
            gpu=np.zeros(len(self), bool),
            size=self.size, root=np.where(self.send_post > self.recv_post, self.src, self.dst),
            inherited=np.zeros(len(self), bool))


_TRANSFER_ARRAYS = ("group", "origin", "src", "dst", "link", "size", "send_post", "recv_post",
                    "delivery")
