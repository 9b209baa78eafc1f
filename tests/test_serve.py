"""``commviz serve`` and the commviz page in torch's debug server, in a real browser.

One live job for the module: ``commviz launch tests/jobs/late_allreduce.yaml`` (4 gloo ranks,
three all_reduce lines a step; rank 2 sleeps 20 ms before the line marked ``# the late line``
from step ``LATE_FROM`` on and writes down itself which rank and line, ``late.json``), profiled,
merged and reported at its end, with ``live.debug_server`` on. ``commviz serve`` runs beside it
as a user runs it, and Debian's ``chromium`` (driven by Playwright, never a downloaded browser)
loads the pages: the late rank and its line are read from the rendered DOM of both live pages
and must be the planted ones; after the job the page shows the report, its plots and the
timeline (every image loads, no console error). Meanwhile the page is flooded and stopped
(SIGSTOP): the job's records must still be exactly what the program does. Then one rank is
held (SIGSTOP, as on a cluster) until the page shows a hung job's verdict, which must name it;
let go, the job ends as programmed. The path checks run on an in-process server over a scratch
run dir.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from harness import REPO, free_port

CHROMIUM = shutil.which("chromium")
CONFIG = REPO / "tests" / "jobs" / "late_allreduce.yaml"
STEPS, LATE_FROM, STEP_S = 280, 20, 0.05
HANG_AFTER_S, HELD_S = 2.0, 20.0          # the page's --hang-after; the most a rank is held
ALL_REDUCES_PER_STEP = 3
COMMVIZ = [sys.executable, "-m", "commviz"]

needs_browser = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Debian's chromium is not installed (scripts/setup_tests.sh installs it as root)")


class Job:
    """The launch, ``commviz serve`` beside it, and a browser."""

    def __init__(self, root: Path) -> None:
        self.run_dir = root / "run"
        self.run_dir.mkdir()
        self.debug_port = free_port()
        self.serve = subprocess.Popen(
            [*COMMVIZ, "serve", str(self.run_dir), "--address", "127.0.0.1:0", "--interval",
             "1", "--hang-after", str(HANG_AFTER_S)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.serve.stdout.readline() if self.serve.stdout else ""
        assert "serving" in line, line
        self.url = line.split()[3].rstrip("/")
        self.launch = subprocess.Popen(
            [*COMMVIZ, "launch", str(CONFIG), "--set", f"output.dir={root}",
             "--set", "output.run_name=run", "--set", f"workload.args.out={self.run_dir}",
             "--set", f"workload.steps={STEPS}", "--set", f"workload.args.late_from={LATE_FROM}",
             "--set", f"workload.args.step_s={STEP_S}", "--set", "profile.enabled=true",
             "--set", "output.merge=true", "--set", "output.report=true",
             "--set", f"live.debug_server={self.debug_port}"],
            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: str | None = None

    def planted(self) -> tuple[int, str]:
        """The late rank and its line, as the job itself wrote them down."""
        path = self.run_dir / "late.json"
        end = time.monotonic() + 120
        while not path.is_file():
            assert time.monotonic() < end and self.launch.poll() is None, self.finish()
            time.sleep(0.2)
        late = json.loads(path.read_text())
        return late["rank"], f"{Path(late['file']).name}:{late['line']}"

    def finish(self) -> str:
        if self.output is None:
            self.output, _ = self.launch.communicate(timeout=300)
        return self.output

    def stop(self) -> None:
        for proc in (self.launch, self.serve):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
            proc.communicate(timeout=60)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Job]:
    j = Job(tmp_path_factory.mktemp("serve"))
    try:
        yield j
    finally:
        j.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield b
        finally:
            b.close()


def _open(browser: Any, url: str) -> tuple[Any, list[str]]:
    """A page at ``url`` and the console errors it logs."""
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url)
    return page, errors


def _late_in(page: Any) -> list[tuple[int, str, str]]:
    """The late ranks the rendered page names: (rank, origin, the line shown)."""
    page.wait_for_selector(".cv-late", timeout=90_000)
    return [(int(e.get_attribute("data-rank")), e.get_attribute("data-origin"),
             e.inner_text()) for e in page.query_selector_all(".cv-late")]


def _get(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            r.read()
            return r.status
    except OSError:
        return 0


@needs_browser
@pytest.mark.slow
def test_a_flooded_or_stopped_page_leaves_the_job_as_programmed(job: Job):
    """400 requests at once, then the server stopped for 2 s (SIGSTOP): the job runs on and
    makes exactly its calls (they are counted after it in the ranks' records)."""
    job.planted()                                  # the ranks are recording
    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(_get, [f"{job.url}/{p}" for p in ("", "live") * 200]))
    assert codes == [200] * 400
    os.kill(job.serve.pid, signal.SIGSTOP)
    time.sleep(2)
    os.kill(job.serve.pid, signal.SIGCONT)
    assert job.launch.poll() is None, "the job ended before the page was read live"


@needs_browser
@pytest.mark.slow
def test_the_live_pages_name_the_late_rank_and_its_line(job: Job, browser: Any):
    rank, line = job.planted()
    page, errors = _open(browser, job.url + "/")
    named = _late_in(page)
    assert job.launch.poll() is None, "the job ended before the page named a late rank"
    # the costliest first (on a loaded machine a window may also name a brief other)
    assert named[0][:2] == (rank, line)
    assert f"LATE: rank {rank} to {line} in default_pg" in named[0][2]
    assert page.query_selector_all("#commviz-live svg polyline")      # the windows' plots
    head = page.inner_text(".cv-head")                # refreshed in place: a later window
    page.wait_for_function("h => document.querySelector('.cv-head').innerText !== h", arg=head,
                           timeout=30_000)
    assert not errors, errors
    # the same panel inside torch's debug server, linking to torch's own pages for the rank
    torch_url = f"http://127.0.0.1:{job.debug_port}/commviz"
    end = time.monotonic() + 60                    # its frontend is a process spawned by rank 0
    while _get(torch_url) != 200:
        assert time.monotonic() < end, "torch's debug server never answered"
        time.sleep(0.5)
    torch_page, _ = _open(browser, torch_url)
    assert _late_in(torch_page)[0][:2] == (rank, line)
    links = [a.get_attribute("href") for a in torch_page.query_selector_all(".cv-late a")]
    assert any(h.startswith("/stacks") and f"Rank%20{rank}%3A" in h for h in links), links
    assert torch_page.query_selector('nav a[href="/commviz"]') is not None
    assert torch_page.query_selector('nav a[href="/fr_trace"]') is not None   # torch's own
    page.close()
    torch_page.close()


def _rank_pid(launch_pid: int, rank: int) -> int:
    """The worker process of ``rank`` under the launch (torchrun's environment tells)."""
    import psutil

    for p in psutil.Process(launch_pid).children(recursive=True):
        try:
            if "commviz.launch.worker" in " ".join(p.cmdline()) and \
                    p.environ().get("RANK") == str(rank):
                return p.pid
        except psutil.Error:
            continue
    raise AssertionError(f"no worker of rank {rank} under the launch")


@needs_browser
@pytest.mark.slow
def test_a_held_rank_is_named_by_the_hung_jobs_verdict(job: Job, browser: Any):
    """Rank 1 stopped (SIGSTOP) while the others go on into their next all_reduce: once nothing
    has completed for --hang-after, the page shows commviz status's verdict with rank 1 as its
    culprit. A rank stopped inside a collective its peers are in holds no one apart (rank 1
    waits in each all_reduce for the late rank 2, a third of its time or more under load): the
    stop is tried again then, once the page has cleared that verdict."""
    from playwright.sync_api import TimeoutError as NotShown

    assert job.launch.poll() is None, "the job ended before a rank could be held"
    pid = _rank_pid(job.launch.pid, 1)
    page, errors = _open(browser, job.url + "/")
    for _ in range(10):
        os.kill(pid, signal.SIGSTOP)
        try:
            shown = page.wait_for_selector(".cv-verdict", timeout=HELD_S * 1000)
            text = shown.inner_text() if shown is not None else ""
        except NotShown:
            text = ""
        finally:
            os.kill(pid, signal.SIGCONT)
        if "culprit rank(s) 1" in text:
            break
        page.wait_for_selector(".cv-verdict", state="detached", timeout=30_000)
        time.sleep(random.uniform(0.0, 0.1))    # the next stop at another point of a step
    assert "HANG? nothing has completed" in text and "VERDICT: hang - culprit rank(s) 1" in text, \
        text
    page.wait_for_selector(".cv-verdict", state="detached", timeout=30_000)   # it moves again
    assert not errors, errors
    page.close()


def _records_as_programmed(run_dir: Path) -> None:
    from commviz import metadata as md
    from commviz.record.store import load_record

    for rank in range(4):
        record = load_record(run_dir / f"commviz_rank{rank}.pkl")
        calls = [c for c in record["collectives"]
                 if str(c.get(md.ORIGIN, "")).startswith("late_allreduce.py:")]
        assert record["dropped"] == 0
        assert len(calls) == ALL_REDUCES_PER_STEP * STEPS
        assert all(c[md.OP] == "all_reduce" and c.get(md.T_END) and md.ERROR not in c
                   for c in calls)


@needs_browser
@pytest.mark.slow
def test_after_the_job_the_page_shows_the_report_plots_and_timeline(job: Job, browser: Any):
    rank, line = job.planted()
    out = job.finish()
    assert job.launch.returncode == 0, out[-4000:]
    assert "live.debug_server: torch's debug server starting on port" in out
    _records_as_programmed(job.run_dir)
    end = time.monotonic() + 30
    while b"the job has ended" not in urllib.request.urlopen(job.url + "/").read():
        assert time.monotonic() < end
        time.sleep(0.5)
    page, errors = _open(browser, job.url + "/")
    page.wait_for_load_state("networkidle")
    images = page.eval_on_selector_all("img", "els => els.map(e => [e.src, e.naturalWidth])")
    plots = {Path(src).name for src, _ in images}
    assert {"timeline.png", "skew_over_time.png", "windows.png"} <= plots, plots
    assert all(width > 0 for _, width in images), images
    assert not errors, errors
    # the report as written, its headline first; the stragglers' table names the planted rank
    assert page.inner_text(".report h1").startswith("commviz report:")
    assert "with a straggler" in page.inner_text(".report h1")
    whole = page.inner_text("body")
    assert f"late ranks, the most often named first: rank {rank} to {line} (" in whole
    # the merged trace, for the Perfetto UI: the bytes the button hands over
    assert page.query_selector("#perfetto") is not None
    got = page.evaluate("fetch('/files/merged.pftrace').then(r => r.arrayBuffer())"
                        ".then(b => b.byteLength)")
    assert got == (job.run_dir / "merged.pftrace").stat().st_size
    # the timeline for a chosen window and ranks; a bad window is said, not a broken image
    page.fill("input[name=window]", "0:40")
    page.fill("input[name=ranks]", "1-2")
    page.click("form button")
    page.wait_for_load_state("networkidle")
    assert page.eval_on_selector("#timeline", "e => e.naturalWidth") > 0
    page.fill("input[name=window]", "40:1")
    page.click("form button")
    page.wait_for_load_state("networkidle")
    assert page.query_selector("#timeline") is None
    assert "T1 must be after T0" in page.inner_text("body")
    assert not errors, errors
    page.close()


# -- paths: an in-process server over a scratch run dir ---------------------------------------

@pytest.fixture
def site(tmp_path: Path) -> Iterator[str]:
    from commviz.serve import server

    run_dir = tmp_path / "run"
    (run_dir / "plots").mkdir(parents=True)
    (run_dir / "report.md").write_text("# commviz report: scratch\n")
    (run_dir / "plots" / "a.png").write_bytes(b"\x89PNG")
    (tmp_path / "secret.txt").write_text("outside")
    (run_dir / "link.txt").symlink_to(tmp_path / "secret.txt")
    httpd = server._Server(("127.0.0.1", 0), server._handler(server.Site(run_dir, 1.0)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def _status(address: str, path: str, method: str = "GET") -> int:
    conn = http.client.HTTPConnection(address, timeout=5)
    conn.request(method, path)            # the path as written: no client normalises it
    status = conn.getresponse().status
    conn.close()
    return status


def test_paths_outside_the_run_dir_are_404_and_nothing_writes(site: str):
    assert _status(site, "/files/report.md") == 200
    assert _status(site, "/files/plots/a.png") == 200
    for path in ("/files/../secret.txt", "/files/%2e%2e/secret.txt", "/files/..%2fsecret.txt",
                 "/files//etc/passwd", "/files/%2Fetc%2Fpasswd", "/files/plots/../report.md",
                 "/files/link.txt", "/../secret.txt", "/etc/passwd", "/files/",
                 "/files/./report.md", "/files/plots"):
        assert _status(site, path) == 404, path
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        assert _status(site, "/files/report.md", method) == 501, method


# -- the handler for torch's debug server, in process -------------------------------------------

def test_the_handler_is_a_torch_debug_page_that_travels_to_its_frontend(tmp_path: Path):
    import pickle

    from torch.distributed.debug._frontend import DebugHandler

    import commviz

    handler = commviz.debug_handler(tmp_path)
    assert isinstance(handler, DebugHandler)
    assert [r.path for r in handler.routes()] == ["/commviz", "/commviz/live"]
    assert [(n.path, n.label) for n in handler.nav_links()] == [("/commviz", "commviz")]
    assert "commviz.html" in handler.templates()
    assert handler.dump() is None                 # no window yet: nothing in the dumps
    assert handler.live().panel.state == "waiting"
    handler.live().stop()
    copy = pickle.loads(pickle.dumps(handler))    # torch may spawn its frontend
    assert copy.run_dir == tmp_path and copy._live is None


def test_without_torchs_debug_server_the_handler_says_so(tmp_path: Path, monkeypatch, capsys):
    """As on a torch whose ``torch.distributed.debug`` lacks the frontend: one error naming
    torch and the way out; the launch's rank 0 says it and the job goes on."""
    from commviz.errors import CommvizError
    from commviz.serve import debug

    monkeypatch.setitem(sys.modules, "torch.distributed.debug._frontend", None)
    monkeypatch.delitem(sys.modules, "commviz.serve.torchpage", raising=False)
    with pytest.raises(CommvizError, match=r"torch .* has no usable debug server .*commviz "
                                           r"serve RUN_DIR"):
        debug.debug_handler(tmp_path)
    debug.start_in_job(tmp_path, free_port(), 0, False)
    assert "live.debug_server: not started: torch" in capsys.readouterr().err
    debug.stop_in_job()                           # nothing was started: nothing to stop


def test_a_late_rank_is_shown_with_its_cause_when_the_window_has_one():
    """A straggler entry with a ``cause`` (a later window version) shows it under its line;
    one without shows the line alone. Text from the job is escaped."""
    from commviz.serve.page import late_items

    entry = {"rank": 3, "origin": "train.py:<12>", "group": "0", "group_label": "default_pg",
             "instances": 8, "late_in": 7, "skew_ns": 2_000_000, "cost_ns": 5_000_000}
    shown = late_items([{**entry, "cause": {"kind": "cpu", "detail": "throttled 40 %"}}], None)
    assert 'data-rank="3"' in shown and "train.py:&lt;12&gt;" in shown
    assert "cause: kind: cpu; detail: throttled 40 %" in shown
    assert "cv-cause" not in late_items([entry], None)
