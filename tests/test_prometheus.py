"""The Prometheus exporter and the late-rank rule, against a real Prometheus server.

A live 4-rank gloo job (``tests/jobs/late_allreduce.py``, no profiler) is scraped through
``commviz exporter`` by Debian's ``prometheus`` (started here on a scratch config, port and data
dir, scraping every second) loaded with ``configs/prometheus/commviz.rules.yml`` as shipped,
only its windows shortened for a job of seconds (``WINDOWS``). The planted late rank and the
planted line (found in the job's source by its marker, not from commviz) must be the only ones
the alert ever names; a healthy run of the same program must name nobody. Meanwhile the
exporter is flooded with scrapes, stopped (SIGSTOP: a hang), killed and started again: the
job's exit and records must be what the program does (a hand count), as if no exporter ran.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest

from harness import REPO, free_port, torchrun

PROMETHEUS = shutil.which("prometheus")
RULES = REPO / "configs" / "prometheus" / "commviz.rules.yml"
DOC = REPO / "docs" / "prometheus.md"
JOB = REPO / "tests" / "jobs" / "late_allreduce.py"
# 1 s scrapes: 5 s of rate (5 scrapes) and 8 s of persistence stand for the rules' 1m and 2m.
WINDOWS = {"[1m]": "[5s]", "for: 2m": "for: 8s"}
STEP_S = 0.04
ALL_REDUCES_PER_STEP = 3          # the job's three all_reduce lines
LATE_RANK, LATE_FROM, LATE_STEPS = 3, 30, 200
HEALTHY_STEPS = 150
FIRING = 'ALERTS{alertname="CommvizLateRank", alertstate="firing"}'

needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="the prometheus binary is not installed and could not be: "
    "scripts/setup.sh installs Debian's package when run as root with apt-get")


def planted_origin() -> str:
    """The late line's origin as the job's source marks it: ``file:line``."""
    lines = JOB.read_text().splitlines()
    line = next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith("# the late line"))
    return f"{JOB.name}:{line}"


def all_reduce_lines() -> dict[str, int]:
    """Each all_reduce line of the job's source (``file:line``) and the bytes it sends: the
    float32 ``x = torch.ones(1024)`` whole, or ``x[:16]``."""
    lines = JOB.read_text().splitlines()
    return {f"{JOB.name}:{i}": 4 * (16 if "x[:16]" in text else 1024)
            for i, text in enumerate(lines, 1) if "dist.all_reduce(" in text}


def test_rules_are_valid_and_documented_verbatim():
    """promtool accepts the shipped rules, and docs/prometheus.md shows exactly them."""
    if shutil.which("promtool"):
        check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                               text=True)
        assert check.returncode == 0, check.stdout + check.stderr
    doc = DOC.read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    assert RULES.read_text().split("groups:", 1)[1] in [b.split("groups:", 1)[-1] for b in blocks]


class Prometheus:
    """A Prometheus server of this test's own, scraping ``target`` every second."""

    def __init__(self, tmp: Path, target: str) -> None:
        rules = RULES.read_text()
        for old, new in WINDOWS.items():
            assert old in rules
            rules = rules.replace(old, new)
        (tmp / "rules.yml").write_text(rules)
        (tmp / "prometheus.yml").write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "rule_files: [rules.yml]\n"
            "scrape_configs:\n"
            f"  - job_name: commviz\n    static_configs: [{{targets: ['{target}']}}]\n")
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp / 'data'}", f"--web.listen-address={self.url[7:]}",
             "--web.console.templates=", "--web.console.libraries="],
            stdout=self.log, stderr=subprocess.STDOUT, cwd=tmp)
        self._wait(lambda: self._get("/-/ready") is not None, "ready")

    def _get(self, path: str, **params: Any) -> bytes | None:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(self.url + path + query, timeout=5) as r:
                return r.read()
        except (urllib.error.URLError, ConnectionError):
            return None

    def _wait(self, done: Any, what: str, limit_s: float = 60) -> None:
        end = time.monotonic() + limit_s
        while not done():
            assert self.proc.poll() is None, f"prometheus exited: {self.log.name}"
            assert time.monotonic() < end, f"prometheus never got {what}: {self.log.name}"
            time.sleep(0.2)

    def api(self, path: str, **params: Any) -> Any:
        body = self._get(path, **params)
        assert body is not None, f"prometheus did not answer {path} {params}"
        answer = json.loads(body)
        assert answer["status"] == "success", answer
        return answer["data"]

    def evaluated_after(self, t: float) -> None:
        """Wait until every rule group has been evaluated on data scraped after ``t``."""
        def done() -> bool:
            groups = self.api("/api/v1/rules")["groups"]
            return bool(groups) and all(_epoch(g["lastEvaluation"]) > t + 2 for g in groups)
        self._wait(done, "its rules evaluated after the job")

    def ever(self, expr: str, start: float, end: float) -> list[dict[str, str]]:
        """The label sets of every series ``expr`` gave at any second of [start, end]."""
        data = self.api("/api/v1/query_range", query=expr, start=f"{start:.3f}",
                        end=f"{end:.3f}", step="1")
        return [r["metric"] for r in data["result"]]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def _epoch(rfc3339: str) -> float:
    """Prometheus's "2026-11-28T15:40:01.123456789Z" as seconds since the epoch."""
    from datetime import datetime, timezone

    head, _, frac = rfc3339.rstrip("Z").partition(".")
    whole = datetime.strptime(head, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    return whole.timestamp() + float(f"0.{frac or 0}")


class Exporter:
    """``commviz exporter RUN_DIR`` as its own process, as a user runs it."""

    def __init__(self, run_dir: Path, port: int, *options: str) -> None:
        self.address = f"127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "commviz", "exporter", str(run_dir), "--address",
             self.address, "--interval", "0.5", *options], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        assert "serving" in (self.proc.stdout.readline() if self.proc.stdout else "")

    def flood(self, requests: int) -> int:
        """Scrape it ``requests`` times back to back from four threads; the answers that came."""
        def scrape(_: int) -> bool:
            try:
                with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=5) as r:
                    return r.status == 200 and b"commviz_" in r.read()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return False
        with ThreadPoolExecutor(4) as pool:
            return sum(pool.map(scrape, range(requests)))

    def samples(self) -> list[Any]:
        """Its metrics now, parsed by prometheus_client's own parser."""
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://{self.address}/metrics", timeout=5) as r:
            text = r.read().decode()
        return [s for family in text_string_to_metric_families(text) for s in family.samples]

    def settled(self, calls_per_rank: int) -> list[Any]:
        """Its samples once every rank's calls are counted (the last read after the job)."""
        end = time.monotonic() + 30
        while True:
            samples = self.samples()
            counted: dict[str, float] = {}
            for s in samples:
                if s.name == "commviz_collective_seconds_count":
                    counted[s.labels["rank"]] = counted.get(s.labels["rank"], 0) + s.value
            if counted == {str(r): calls_per_rank for r in range(4)} or time.monotonic() > end:
                return samples
            time.sleep(0.2)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> str:
        """Stop it; what it said on stderr."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.communicate(timeout=30)[1]


def _run_job(run_dir: Path, steps: int, late_rank: int) -> Any:
    return torchrun([str(JOB), str(run_dir), str(steps), str(late_rank), str(LATE_FROM),
                     str(STEP_S)], nproc=4, timeout=240)


def _records_as_programmed(run_dir: Path, steps: int) -> None:
    """Every rank exited normally with exactly the calls its program makes, each ended."""
    from commviz import metadata as md
    from commviz.record.store import load_record

    for rank in range(4):
        record = load_record(run_dir / f"commviz_rank{rank}.pkl")
        calls = record["collectives"]
        assert record["exit"] == "normal" and record["dropped"] == 0
        assert len(calls) == ALL_REDUCES_PER_STEP * steps
        assert all(c[md.OP] == "all_reduce" and c.get(md.T_END) and md.ERROR not in c
                   for c in calls)


@pytest.fixture
def live_job(tmp_path: Path) -> Iterator[Any]:
    """Start Prometheus, an exporter and a job; yields a function running them to the end."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    port = free_port()
    prom = Prometheus(tmp_path, f"127.0.0.1:{port}")
    exporters = [Exporter(run_dir, port)]
    pool = ThreadPoolExecutor(1)
    try:
        yield run_dir, prom, exporters, port, pool
    finally:
        pool.shutdown(wait=True)
        for e in exporters:
            e.stop()
        prom.stop()


def _ran(job: Any) -> float:
    done = job.result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return time.time()


@needs_prometheus
@pytest.mark.slow
def test_prometheus_names_the_late_rank_and_line(live_job):
    run_dir, prom, exporters, _, pool = live_job
    start = time.time()
    job = pool.submit(_run_job, run_dir, LATE_STEPS, LATE_RANK)
    exporter = exporters[0]
    assert exporter.flood(400) == 400                    # far too often: 400 scrapes at once
    exporter.signal(signal.SIGSTOP)                      # hung: the scrapes time out
    time.sleep(3)
    exporter.signal(signal.SIGCONT)
    end = _ran(job)
    _records_as_programmed(run_dir, LATE_STEPS)
    # every call counted once, by the line that made it, with its bytes and size class
    served = exporter.settled(ALL_REDUCES_PER_STEP * LATE_STEPS)
    counts = {(s.labels["rank"], s.labels["origin"], s.labels["size"]): s.value for s in served
              if s.name == "commviz_collective_seconds_count"}
    nbytes = {(s.labels["rank"], s.labels["origin"]): s.value for s in served
              if s.name == "commviz_collective_bytes_total"}
    lines = all_reduce_lines()
    assert counts == {(str(r), origin, "4KiB" if size > 1024 else "1KiB"): LATE_STEPS
                      for r in range(4) for origin, size in lines.items()}
    assert nbytes == {(str(r), origin): size * LATE_STEPS for r in range(4)
                      for origin, size in lines.items()}
    prom.evaluated_after(end)
    named = prom.ever(FIRING, start, end + 3)
    assert {(m["rank"], m["group"], m["origin"]) for m in named} == {
        (str(LATE_RANK), "0", planted_origin())}
    assert "commviz exporter:" not in exporter.stop()    # nothing it could not read


@needs_prometheus
@pytest.mark.slow
def test_prometheus_names_nobody_in_a_healthy_run(live_job):
    run_dir, prom, exporters, port, pool = live_job
    start = time.time()
    job = pool.submit(_run_job, run_dir, HEALTHY_STEPS, -1)
    first = exporters[0]
    exporters.append(Exporter(run_dir, free_port(), "--origins", "1", "--series", "2"))
    capped = exporters[-1]
    assert first.flood(400) == 400
    time.sleep(4)
    first.signal(signal.SIGKILL)                         # killed mid-run, then started again
    first.stop()
    exporters.append(Exporter(run_dir, port))
    end = _ran(job)
    _records_as_programmed(run_dir, HEALTHY_STEPS)
    # capped: one origin of its own, then "other"; two label sets, then the overflow set
    served = capped.settled(ALL_REDUCES_PER_STEP * HEALTHY_STEPS)
    first_line, *later = all_reduce_lines()
    assert {(s.labels["rank"], s.labels["origin"], s.labels["op"], s.value) for s in served
            if s.name == "commviz_collective_seconds_count"} == {
        (str(r), origin, op, HEALTHY_STEPS * n) for r in range(4) for origin, op, n in (
            (first_line, "all_reduce", 1), ("other", "all_reduce", 1), ("other", "other", 1))}
    prom.evaluated_after(end)
    scraped = prom.ever('commviz_collective_seconds_count{rank="3"}', start, end)
    assert {m["origin"] for m in scraped} >= {planted_origin()}   # the rule had data to judge
    assert prom.ever(FIRING, start, end + 3) == []


def _launch_with_exporter(run_root: Path, port: int, steps: int, **popen: Any
                          ) -> subprocess.Popen:
    """``commviz launch`` of the default job (no profiler, no merge, no report) with its
    exporter on ``port``."""
    return subprocess.Popen(
        [sys.executable, "-m", "commviz", "launch", "--hang-after", "0",
         "--set", f"workload.steps={steps}", "--set", "profile.enabled=false",
         "--set", "output.merge=false", "--set", "output.report=false",
         "--set", f"output.dir={run_root}", "--set", f"live.exporter={port}"],
        cwd=run_root, **popen)


@pytest.mark.slow
def test_launch_serves_metrics_while_the_job_runs_and_stops_after(tmp_path: Path):
    """``live.exporter``: the launch's exporter serves the job's ranks while torchrun runs and
    is gone when the launch returns."""
    port = free_port()
    launch = _launch_with_exporter(tmp_path, port, 800, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}/metrics"
    seen: set[str] = set()
    while launch.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                seen |= set(re.findall(r'commviz_collective_seconds_count\{[^}]*rank="(\d+)"',
                                       r.read().decode()))
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.2)
    out = launch.communicate()[0]
    assert launch.returncode == 0, out
    assert f"serving http://127.0.0.1:{port}/metrics" in out
    assert seen == {"0", "1"}, out
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url, timeout=5)


def _children(pid: int) -> list[int]:
    """``pid``'s child processes (read from /proc)."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
            for c in (task / "children").read_text().split()]


def _tree(pid: int) -> list[int]:
    """``pid``'s descendants: torchrun's workers lead sessions of their own, out of reach of
    a signal to the launch's process group."""
    found = []
    for child in _children(pid):
        found += [child, *_tree(child)]
    return found


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie counts: its parent, the killed launch, cannot reap
    it; whoever inherited it does)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_the_exporter_leaves_when_its_launch_is_killed(tmp_path: Path):
    """A launch killed by SIGKILL cannot stop its exporter: the exporter notices its parent is
    gone and stops serving by itself (an orphan would hold the port for the next job)."""
    tree: list[int] = []
    port = free_port()
    launch = _launch_with_exporter(tmp_path, port, 100_000, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 120
        while True:                            # until both ranks run (torchrun's workers exist)
            assert launch.poll() is None and time.monotonic() < deadline
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if 'rank="1"' in r.read().decode():
                        break
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.2)
        tree = _tree(launch.pid)
        (exporter,) = [pid for pid in _children(launch.pid)
                       if b"exporter" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
        launch.send_signal(signal.SIGKILL)
        launch.wait()
        deadline = time.monotonic() + 15
        while not _gone(exporter) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(exporter)
        with pytest.raises(urllib.error.URLError):
            urllib.request.urlopen(url, timeout=5)
    finally:
        if launch.poll() is None:
            tree = _tree(launch.pid)
            launch.kill()
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)          # torchrun and its ranks, orphaned too
            except ProcessLookupError:
                pass


def test_a_bad_exporter_address_is_one_error_naming_the_key():
    from commviz.errors import ConfigError
    from commviz.launch import config as C

    with pytest.raises(ConfigError, match=r"live\.exporter: 'node0:port' is not an address"):
        C.load(None, ("live.exporter=node0:port",))


def test_a_corrupt_journal_is_one_line_and_the_endpoint_stays(run_dir: Path):
    """A journal that cannot be one (bytes no rank writes) is named once on stderr, with its
    file; /metrics goes on answering."""
    bad = run_dir / "commviz_rank0.1.journal"
    bad.write_bytes(b"\x07\x00\x00\x00cnot a commviz journal")
    exporter = Exporter(run_dir, free_port())
    try:
        first = exporter.samples()
        time.sleep(1.5)                                  # three more reads of the same file
        assert [s.name for s in exporter.samples()] == [s.name for s in first]
    finally:
        said = exporter.stop()
    lines = [line for line in said.splitlines() if line.startswith("commviz exporter:")]
    assert len(lines) == 1 and str(bad) in lines[0], said
