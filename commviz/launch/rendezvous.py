"""While torchrun's c10d rendezvous waits for the nodes: say so every few seconds, and who is
missing when it gives up.

The watch reads torch's own rendezvous state from the c10d store at ``job.rdzv_endpoint`` (the
key ``torch.rendezvous.{rdzv_id}`` that ``C10dRendezvousBackend`` keeps: a pickled
``_RendezvousState``, read here by an unpickler that builds plain stand-ins for its two classes,
allows ``datetime``'s value types and refuses every other global, so no foreign code can run).
Each launch also leaves ``commviz.launch.{rdzv_id}.node{N}`` = its host in the store, so a
timeout can name the ``--node-rank`` whose launch never reached it. The store lives in the
torchrun of the node whose address the endpoint names; until that one runs, the watch says the
store does not answer.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import io
import pickle
import socket
import threading
from dataclasses import dataclass, field
from typing import Any, TextIO

STATE_KEY = "torch.rendezvous.{rdzv_id}"        # torch's C10dRendezvousBackend._key
LAUNCH_KEY = "commviz.launch.{rdzv_id}.node{node}"
INTERVAL_S = 3.0
_TORCH_STATE = "torch.distributed.elastic.rendezvous.dynamic_rendezvous"
_DATETIME = ("datetime", "timezone", "timedelta")
# failures torchrun reports by these class names (torch.distributed.elastic.rendezvous.api)
TIMEOUT_ERROR = "RendezvousTimeoutError"
CONNECTION_ERROR = "RendezvousConnectionError"


class _Blank:
    """Stands in for torch's ``_RendezvousState`` and ``_NodeDesc``: pickle fills its
    ``__dict__``, nothing of torch's runs."""


class _StateUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == _TORCH_STATE and name in ("_RendezvousState", "_NodeDesc"):
            return _Blank
        if module == "datetime" and name in _DATETIME:      # deadlines and heartbeats
            return getattr(datetime, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a rendezvous state")


def decode_state(raw: bytes) -> tuple[list[str], bool] | None:
    """The addresses of the nodes in the current round (torch's node descriptors) and whether
    the round is complete, from the store's value; None: no state (yet) or not one."""
    try:
        state = _StateUnpickler(io.BytesIO(base64.b64decode(raw, validate=True))).load()
    except (binascii.Error, ValueError, pickle.UnpicklingError, EOFError, TypeError):
        return None
    participants = getattr(state, "participants", None)
    if not isinstance(participants, dict):
        return None
    return (sorted(str(getattr(node, "addr", "?")) for node in participants),
            getattr(state, "complete", False) is True)


@dataclass
class Seen:
    """What the last look that reached the store found."""

    # torch's participants' addresses, every one seen while waiting: torch drops them again as
    # its join timeout expires, and the error that follows names who had come
    joined: list[str] = field(default_factory=list)
    complete: bool = False
    launches: dict[int, str] = field(default_factory=dict)   # --node-rank -> host


class Watch(threading.Thread):
    """Polls the rendezvous every ``interval`` s until it completes or ``stop()``; prints
    ``waiting for nodes: ...`` each time it is still waiting."""

    def __init__(self, endpoint: str, rdzv_id: str, nnodes: int, node_rank: int, out: TextIO,
                 interval: float = INTERVAL_S) -> None:
        super().__init__(name="commviz-rendezvous-watch", daemon=True)
        host, _, port = endpoint.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port)
        self.endpoint, self.rdzv_id, self.nnodes, self.node_rank = endpoint, rdzv_id, nnodes, \
            node_rank
        self.out, self.interval = out, interval
        self.seen: Seen | None = None       # None: the store never answered
        self.answering = False              # whether the latest look reached it
        self._done = threading.Event()

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=self.interval + 5)

    def run(self) -> None:
        while not self._done.wait(self.interval):
            try:
                seen = self._look()
                if self.seen is not None:
                    seen.joined = sorted(set(seen.joined) | set(self.seen.joined))
                self.seen, self.answering = seen, True
            except (OSError, RuntimeError, ValueError):  # not up yet, or gone (torchrun ended)
                self.answering = False
            if self.seen is not None and self.seen.complete:
                return
            if not self._done.is_set():
                self.out.write(self.line() + "\n")
                self.out.flush()

    def _connect(self) -> Any:
        """A fresh client per look, dropped after it: a connection held open across torchrun's
        exit makes torch's C++ side print a stack trace when the server goes away."""
        from torch.distributed import TCPStore

        # a plain connect first: TCPStore's own attempts log an error per try in C++
        socket.create_connection((self.host, self.port), timeout=2).close()
        store = TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=2))
        store.set(LAUNCH_KEY.format(rdzv_id=self.rdzv_id, node=self.node_rank),
                  socket.gethostname())
        return store

    def _look(self) -> Seen:
        store = self._connect()
        seen = Seen()
        for node in range(self.nnodes):
            key = LAUNCH_KEY.format(rdzv_id=self.rdzv_id, node=node)
            if store.check([key]):
                seen.launches[node] = store.get(key).decode(errors="replace")
        key = STATE_KEY.format(rdzv_id=self.rdzv_id)
        if store.check([key]):
            decoded = decode_state(store.get(key))
            if decoded is not None:
                seen.joined, seen.complete = decoded
        return seen

    def missing(self) -> list[int]:
        """The --node-ranks whose launch has not reached the store (empty: unknown or none)."""
        if self.seen is None:
            return []
        return [n for n in range(self.nnodes) if n not in self.seen.launches]

    def line(self) -> str:
        where = f"at {self.endpoint}, id {self.rdzv_id}"
        if not self.answering or self.seen is None:
            return (f"waiting for nodes: the rendezvous store {where} does not answer yet (it "
                    f"runs in the torchrun of the node at {self.host})")
        text = f"waiting for nodes: {len(self.seen.joined)} of {self.nnodes} joined {where}"
        missing = self.missing()
        if missing:
            text += "; no launch seen yet for " + ", ".join(f"node {n}" for n in missing)
        return text

    def timed_out(self, join_timeout_s: int) -> str:
        """The one error line after torch's join timeout expired."""
        text = (f"the rendezvous {self.rdzv_id!r} at {self.endpoint} timed out after "
                f"job.join_timeout_s = {join_timeout_s} s: ")
        if self.seen is None:
            return text + (f"its store never answered (it runs in the torchrun of the node at "
                           f"{self.host}: start that node's launch)")
        joined = self.seen.joined
        text += f"{len(joined)} of {self.nnodes} nodes joined"
        if joined:
            text += f" ({', '.join(joined)})"
        missing = self.missing()
        if missing:
            text += "; never reached it: " + ", ".join(
                f"node {n} (`commviz launch ... --node-rank {n}`)" for n in missing)
        else:
            text += f"; {self.nnodes - len(joined)} node(s) did not join"
        return text
