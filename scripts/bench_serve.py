"""Benchmark of ``commviz serve``'s live page for a simulated 1,024-rank job: server time, size.

The ranks are ``scripts/bench_watch.py``'s (``rank_calls``: ``bench_scale``'s generator, TP
groups of 8, DP groups across them, a world all_reduce a step; rank 5 late at every third DP
collective), joined into one window by ``commviz.live.window.Windows`` as the page's watcher
does. The page then holds ``HISTORY`` such windows (the plots' full length) and is served by
``commviz serve``'s own server, in process, on loopback.

Printed: the window's close (what each refresh reads and joins, once per interval whatever
the requests), the panel's rendering (once per refresh), the bytes of the page and of the panel
the page fetches every interval (raw and gzipped, for a proxy that compresses), and the time a
request takes end to end over HTTP (median and p99 of ``--requests`` sequential GETs each of
``/`` and ``/live``: what a flood of browsers costs, since every request is answered with the
bytes the last refresh rendered).

    .venv/bin/python scripts/bench_serve.py                 # 1,024 ranks
    .venv/bin/python scripts/bench_serve.py --ranks 4096
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_watch  # noqa: E402

from commviz.live import series  # noqa: E402
from commviz.live.window import Windows  # noqa: E402
from commviz.serve import server  # noqa: E402
from commviz.serve.live import HISTORY  # noqa: E402
from commviz.serve.page import Panel, live_html  # noqa: E402


def _ms(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args(argv)
    windows, shapes = Windows(), {}
    for rank in range(args.ranks):
        windows.add(bench_watch.rank_calls(rank, args.ranks, shapes))
    t = time.perf_counter()
    window = windows.close(range(args.ranks), 0, 5_000_000_000)
    closed = time.perf_counter() - t
    line = series.to_file(window)
    history = [{**line, "index": i} for i in range(HISTORY)]
    with tempfile.TemporaryDirectory() as tmp:
        site = server.Site(Path(tmp), 2.0)
        panel = Panel(tmp, "running", history, None, 0.0, [])   # type: ignore[arg-type]
        renders = []
        for _ in range(5):
            t = time.perf_counter()
            site.live.html = live_html(panel, site.rank_links)
            renders.append(time.perf_counter() - t)
        httpd = server._Server(("127.0.0.1", 0), server._handler(site))
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        times: dict[str, list[float]] = {"/": [], "/live": []}
        sizes: dict[str, bytes] = {}
        for path, took in times.items():
            for _ in range(args.requests):
                t = time.perf_counter()
                with urllib.request.urlopen(base + path) as r:
                    sizes[path] = r.read()
                took.append(time.perf_counter() - t)
        httpd.shutdown()
        httpd.server_close()
    print(f"machine: {len(os.sched_getaffinity(0))} CPUs, 1-minute load "
          f"{os.getloadavg()[0]:.1f}; {args.ranks} ranks, a window of "
          f"{sum(r.window.instances for r in window.groups)} instances in "
          f"{len(window.groups)} groups and {len(window.origins)} origin rows, "
          f"{len(window.stragglers)} late ranks named; {HISTORY} windows on the page")
    print(f"refresh (once per interval): window close {closed:.2f} s, panel render "
          f"{statistics.median(renders) * 1e3:.1f} ms (median of {len(renders)})")
    for path, body in sizes.items():
        print(f"GET {path:6} {len(body) / 1024:.1f} KiB ({len(gzip.compress(body)) / 1024:.1f} "
              f"KiB gzipped); server time median {_ms(times[path], 0.5):.2f} ms, p99 "
              f"{_ms(times[path], 0.99):.2f} ms over {args.requests} requests")
    return 0


if __name__ == "__main__":
    sys.exit(main())
