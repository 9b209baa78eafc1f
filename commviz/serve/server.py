"""``commviz serve RUN_DIR [--address HOST:PORT]``: the run in a browser, live and after the job.

While the job runs (its journals are in the run dir) ``/`` is the live panel (``LiveView``),
refreshed in place every ``--interval``; once the job has ended it is the run reviewed
(``commviz.serve.after``). Routes, GET only (anything else: 501, there is no write route):

- ``/``: the page; ``/live``: the live panel alone (what the page fetches);
- ``/timeline.png?window=T0:T1&ranks=0-3``: ``commviz preview``'s picture of the merged trace;
- ``/files/PATH``: a file of the run dir (report plots, the merged trace for the Perfetto UI).
  A path is taken as text relative to the run dir: one with ``..``, an absolute one, or one
  that resolves outside the run dir (a symlink) is 404, as is every other route.

It listens on loopback unless ``--address`` names another host, runs at a lower priority than
the ranks, and reads files only: a page that is slow, stuck or flooded touches no rank
(tests/test_serve.py floods and stops it during a live job).
"""

from __future__ import annotations

import argparse
import mimetypes
import socket
from html import escape
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

from commviz.errors import CommvizError, ConfigError
from commviz.live.address import add_address, checked
from commviz.record.journal import journal_ranks
from commviz.serve import after
from commviz.serve.live import DEFAULT_INTERVAL_S, HANG_AFTER_S, LiveView
from commviz.serve.page import STYLE, refresh_script

DEFAULT_PORT = 8464
REQUEST_TIMEOUT_S = 5.0
NICENESS = 10
PAGE_STYLE = """
body{font-family:-apple-system,"Segoe UI",Roboto,Arial,sans-serif;margin:0 auto;max-width:1500px;
     padding:10px 18px;color:#212529}
h1{font-size:1.4rem} h2{font-size:1.15rem;margin-top:1.4rem} h3{font-size:1rem}
pre{white-space:pre-wrap;background:#f6f8fa;padding:8px}
img{max-width:100%}
.report table{border-collapse:collapse;font-size:.85rem}
.report th,.report td{border:1px solid #ddd;padding:2px 6px}
button{font-size:.95rem;padding:4px 10px}
"""

PERFETTO_SCRIPT = """
<script>
async function openPerfetto(url, name) {
  const ui = window.open("https://ui.perfetto.dev/#!/");
  if (!ui) { alert("The browser blocked the Perfetto UI's window: allow pop-ups here."); return; }
  const buffer = await (await fetch(url)).arrayBuffer();
  const ready = await new Promise((resolve) => {
    const onMessage = (e) => {
      if (e.source === ui && e.data === "PONG") { done(true); }
    };
    const ping = setInterval(() => { try { ui.postMessage("PING", "*"); } catch (e) {} }, 250);
    const stop = setTimeout(() => done(false), 30000);
    function done(ok) {
      clearInterval(ping); clearTimeout(stop); window.removeEventListener("message", onMessage);
      resolve(ok);
    }
    window.addEventListener("message", onMessage);
  });
  if (!ready) { alert("The Perfetto UI did not answer (it needs https://ui.perfetto.dev)."); }
  else { ui.postMessage({perfetto: {buffer: buffer, title: name, fileName: name}}, "*"); }
}
</script>
"""


def confined(run_dir: Path, rel: str) -> Path | None:
    """The run dir's file at ``rel`` (URL-decoded text relative to it), or None: an absolute
    path, a ``..`` or ``.`` part, a backslash, or anything that resolves outside the run dir or
    is not a file."""
    rel = unquote(rel)
    if not rel or "\\" in rel or "\x00" in rel or rel.startswith("/"):
        return None
    parts = rel.split("/")
    if any(p in ("..", ".", "") for p in parts):
        return None
    root = run_dir.resolve()
    path = root.joinpath(*parts).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        return None
    return path


class Site:
    """What the routes answer from: the run dir, its live view and its timelines."""

    def __init__(self, run_dir: Path, interval: float, hang_after_s: float = HANG_AFTER_S
                 ) -> None:
        self.run_dir, self.interval = run_dir, interval
        self.live = LiveView(run_dir, interval, hang_after_s, links=self.rank_links)
        self._timelines: after.Timelines | None = None

    def rank_links(self, rank: int) -> list[tuple[str, str]]:
        """The stacks the rank last left in the run dir (``commviz status``, a hang watch)."""
        return [(after.file_url(name), f"rank {rank}'s stacks")
                for name in (f"stacks_rank{rank}.live.txt", f"stacks_rank{rank}.txt")
                if (self.run_dir / name).is_file()][:1]

    def ended(self) -> bool:
        return not journal_ranks(self.run_dir) and (
            (self.run_dir / after.REPORT_NAME).is_file() or after.trace_of(self.run_dir)
            is not None)

    def page(self, query: dict[str, list[str]]) -> bytes:
        title = f"commviz: {self.run_dir.name}"
        if self.ended():
            body = self.after_body(query)
        else:
            body = (f"<h1>{escape(title)}: live</h1>{self.live.html}"
                    + refresh_script(self.interval, "/live", True))
        return (f'<!doctype html><html><head><meta charset="utf-8"><title>{escape(title)}</title>'
                f'<link rel="icon" href="data:,"><style>{PAGE_STYLE}{STYLE}</style></head>'
                f"<body>{body}</body></html>").encode()

    def after_body(self, query: dict[str, list[str]]) -> str:
        run_dir = self.run_dir
        parts = [f"<h1>commviz: {escape(str(run_dir))}: the job has ended</h1>",
                 '<p><a href="#report">report</a> · <a href="#whole-run">over the whole run</a>'
                 ' · <a href="#timeline-form">timeline</a></p>']
        trace = after.trace_of(run_dir)
        if trace is not None:
            size = trace.stat().st_size / 1e6
            parts.append(
                PERFETTO_SCRIPT + f'<p><button id="perfetto" onclick="openPerfetto('
                f"'{after.file_url(trace.name)}', '{escape(trace.name)}')\">Open {trace.name} "
                f"({size:.1f} MB) in the Perfetto UI</button> <small>needs a network: the page "
                "opens https://ui.perfetto.dev and hands it the trace from this server; the trace "
                "itself is not uploaded anywhere</small></p>")
        report = after.report_html(run_dir)
        parts.append(f'<div class="report" id="report">{report}</div>' if report is not None else
                     f"<p>no {after.REPORT_NAME} yet: <code>commviz report {escape(str(run_dir))}"
                     "</code></p>")
        parts.append(after.whole_run_html(run_dir))
        if trace is not None:
            parts.append(self.timeline_form(trace, query))
        return "".join(parts)

    def timeline_form(self, trace: Path, query: dict[str, list[str]]) -> str:
        window, ranks = (query.get(k, [""])[0] for k in ("window", "ranks"))
        try:
            after.timeline_args(window, ranks)
        except CommvizError as exc:
            picture = f'<p class="cv-late">{escape(str(exc))}</p>'
        else:
            src = f"/timeline.png?window={escape(window)}&ranks={escape(ranks)}"
            picture = f'<img id="timeline" src="{src}" alt="timeline of {escape(trace.name)}">'
        return (f'<h2 id="timeline-form">Timeline ({escape(trace.name)}, drawn by commviz '
                "preview)</h2>"
                '<form method="get" action="/">'
                f'<label>window (ms since the first collective) <input name="window" '
                f'value="{escape(window)}" placeholder="first step"></label> '
                f'<label>ranks <input name="ranks" value="{escape(ranks)}" '
                'placeholder="first 16"></label> <button type="submit">draw</button></form>'
                + picture)

    def timeline(self, query: dict[str, list[str]]) -> bytes:
        trace = after.trace_of(self.run_dir)
        if trace is None:
            raise FileNotFoundError("no merged or overview trace in the run dir")
        window, ranks = after.timeline_args(*(query.get(k, [""])[0] for k in ("window", "ranks")))
        if self._timelines is None or self._timelines.trace != trace:
            self._timelines = after.Timelines(trace)
        return self._timelines.png(window, ranks)


def _handler(site: Site) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            query = parse_qs(url.query)
            try:
                if url.path == "/":
                    self._send(site.page(query), "text/html; charset=utf-8")
                elif url.path == "/live":
                    self._send(site.live.html.encode(), "text/html; charset=utf-8")
                elif url.path == "/timeline.png":
                    self._send(site.timeline(query), "image/png")
                elif url.path.startswith(after.FILES) and (
                        path := confined(site.run_dir, url.path[len(after.FILES):])) is not None:
                    kind = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
                    self._send(path.read_bytes(), kind)
                else:
                    self.send_error(404)
            except CommvizError as exc:
                self.send_error(400, str(exc))
            except FileNotFoundError as exc:
                self.send_error(404, str(exc))

        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass                                 # a refresh every few seconds is no news

    return Handler


class _Server(ThreadingHTTPServer):
    """A thread per request (a browser keeps idle connections open), IPv4 or IPv6 as the host
    is written."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        super().__init__(address, handler)

    def handle_error(self, request: object, client_address: object) -> None:
        pass                                     # a client gone mid-answer is its own business


def serve(run_dir: Path, address: str, interval: float = DEFAULT_INTERVAL_S,
          hang_after_s: float = HANG_AFTER_S) -> None:
    """Serve the run's page on ``address`` until killed (says where on stdout once bound)."""
    host, port = checked(run_dir, address, NICENESS)
    site = Site(run_dir, interval, hang_after_s)
    try:
        server = _Server((host, port), _handler(site))
    except OSError as exc:
        raise ConfigError("--address", f"cannot serve on {address}: {exc.strerror or exc}"
                          ) from None
    site.live.start()
    shown = f"[{host}]" if ":" in host else host
    print(f"commviz serve: serving http://{shown}:{server.server_address[1]}/ for {run_dir}",
          flush=True)
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        site.live.stop()
        server.server_close()


def register(p: argparse.ArgumentParser) -> None:
    p.description = ("The run in a browser: while the job runs, the late ranks with their line "
                     "and cost and per group and origin the window beside the run so far, with "
                     "plots (the windows of commviz watch); after it, the report, its plots, the "
                     "whole run, the timeline and the merged trace for the Perfetto UI. "
                     "Read-only (docs/serve.md).")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    add_address(p, DEFAULT_PORT, "serves other hosts too")
    p.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, metavar="S",
                   help=f"seconds between live refreshes (default {DEFAULT_INTERVAL_S:g})")
    p.add_argument("--hang-after", type=float, default=HANG_AFTER_S, metavar="S",
                   help="show commviz status's verdict once no collective has completed for S "
                   f"seconds while the job runs (default {HANG_AFTER_S:g})")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    serve(args.run_dir, args.address, args.interval, args.hang_after)
    return 0
