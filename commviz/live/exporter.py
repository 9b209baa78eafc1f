"""``commviz exporter RUN_DIR [--address HOST:PORT]``: a Prometheus ``/metrics`` endpoint per
node, fed by the node's ranks' journals while the job runs (docs/prometheus.md); on NCCL, by the
GPU times of their ops too (``commviz.live.gpujoin``: a CUDA call waits up to its hold for them).

It is a process of its own that only reads files the ranks write anyway: no rank waits on it,
talks to it or knows it exists, so an exporter that dies, hangs, is killed or is scraped far
too often never slows, blocks or stops a rank (tests/test_prometheus.py does all four to a
live job). To keep a flood of scrapes off the ranks' CPUs too, it lowers its own priority, reads
the journals once per ``--interval`` whatever the scrapes, and serves every scrape the text
rendered at the last read, one request at a time, each cut off after ``REQUEST_TIMEOUT_S``.
It serves GET only (``/metrics``), on loopback unless an address says otherwise.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from commviz.errors import CommvizError, ConfigError
from commviz.live.address import add_address, checked
from commviz.live.gpujoin import GpuJoin
from commviz.live.metrics import ORIGINS, SERIES, Counts
from commviz.live.tail import RunTail
from commviz.merge.select import parse_ranks

DEFAULT_PORT = 9464
INTERVAL_S = 1.0
REQUEST_TIMEOUT_S = 5.0
NICENESS = 10
PARENT_POLL_S = 1.0               # how soon it notices the launch is gone


class Exporter:
    """Follows ``run_dir``'s journals every ``interval`` seconds and keeps the rendered
    metrics; ``local``: only the ranks whose journal names this host (a shared run dir)."""

    def __init__(self, run_dir: Path, interval: float = INTERVAL_S, ranks: list[int] | None = None,
                 local: bool = False, origins: int = ORIGINS, series: int = SERIES) -> None:
        self.run_dir, self.interval = run_dir, interval
        self.tail = RunTail(run_dir, ranks)
        self.gpu = GpuJoin(run_dir)
        self.host = socket.gethostname() if local else None
        self.counts = Counts(origins, series)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.counts)
        self.body = generate_latest(self.registry)
        self._said: set[str] = set()
        self._stop = threading.Event()

    def refresh(self) -> None:
        """Read what the ranks ended since the last refresh and render the metrics anew."""
        try:
            calls = self.gpu.timed(self.tail.poll(), time.time_ns())
        except CommvizError as exc:
            self._say(str(exc))
            return
        headers = self.tail.headers
        for call in calls:
            if self.host is None or headers.get(call.rank, {}).get("host") == self.host:
                self.counts.add(call, untimed=call.gpu_begin_ns < 0 and call.shape.device
                                == "cuda" and self.gpu.follows(call.rank))
        self.counts.set_missed(self.tail.missed)
        for line in self.tail.problems + self.gpu.problems:
            self._say(line)
        self.body = generate_latest(self.registry)

    def _say(self, line: str) -> None:
        if line not in self._said:
            self._said.add(line)
            print(f"commviz exporter: {line}", file=sys.stderr, flush=True)

    def follow(self) -> None:
        while not self._stop.wait(self.interval):
            self.refresh()

    def stop(self) -> None:
        self._stop.set()


def _handler(exporter: Exporter) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S          # a client that never finishes its request

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] not in ("/metrics", "/"):
                self.send_error(404, "only /metrics is served here")
                return
            body = exporter.body
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass                             # a scrape a second is no news

    return Handler


class _Server(HTTPServer):
    """One request at a time, on IPv4 or IPv6 as the host is written."""

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)

    def handle_error(self, request: object, client_address: object) -> None:
        pass                                 # a client gone mid-answer is its own business


def _leave_with(parent: int, server: HTTPServer) -> None:
    """Stop serving once process ``parent`` is no longer this one's parent (it ended, or was
    killed: this process was handed to another)."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    server.shutdown()


def serve(run_dir: Path, address: str, interval: float = INTERVAL_S,
          ranks: list[int] | None = None, local: bool = False, origins: int = ORIGINS,
          series: int = SERIES, parent: int | None = None) -> None:
    """Serve ``/metrics`` on ``address`` until killed, or until process ``parent`` is gone
    (says where on stdout once bound)."""
    host, port = checked(run_dir, address, NICENESS)
    exporter = Exporter(run_dir, interval, ranks, local, origins, series)
    exporter.refresh()
    try:
        server = _Server((host, port), _handler(exporter))
    except OSError as exc:
        raise ConfigError("--address", f"cannot serve on {address}: {exc.strerror or exc}"
                          ) from None
    bound = server.server_address
    print(f"commviz exporter: serving http://{host}:{bound[1]}/metrics for {run_dir}",
          flush=True)
    threading.Thread(target=exporter.follow, name="commviz-exporter-follow", daemon=True).start()
    if parent is not None:
        threading.Thread(target=_leave_with, args=(parent, server), name="commviz-exporter-parent",
                         daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        exporter.stop()
        server.server_close()


def register(p: argparse.ArgumentParser) -> None:
    p.description = ("While a job runs: serve its collectives as Prometheus metrics on "
                     "/metrics, from the ranks' journals in RUN_DIR (one exporter per node; "
                     "metric names, labels and the late-rank rule: docs/prometheus.md).")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    add_address(p, DEFAULT_PORT, "for a Prometheus elsewhere")
    p.add_argument("--interval", type=float, default=INTERVAL_S,
                   help=f"seconds between reads of the journals (default {INTERVAL_S})")
    p.add_argument("--ranks", default=None,
                   help="only these ranks, e.g. 0-7 (default: every rank in RUN_DIR)")
    p.add_argument("--local", action="store_true",
                   help="only the ranks running on this host (a run dir shared by nodes)")
    p.add_argument("--origins", type=int, default=ORIGINS,
                   help=f"origins per rank with a label of their own (default {ORIGINS})")
    p.add_argument("--series", type=int, default=SERIES,
                   help=f"label sets per rank before the overflow set (default {SERIES})")
    p.add_argument("--parent", type=int, default=None, metavar="PID",
                   help="stop when process PID (this one's parent: the launch) is gone")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    serve(args.run_dir, args.address, args.interval,
          None if args.ranks is None else parse_ranks(args.ranks), args.local, args.origins,
          args.series, args.parent)
    return 0
