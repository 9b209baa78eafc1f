"""The live views on NCCL: calls given their ops' GPU times (``commviz.live.gpujoin``), joined
into windows (``commviz.live.window``) and counted for Prometheus (``commviz.live.metrics``).

Real data: the 2 x H200 run kept in ``tests/fixtures/gpu/gputime-2xh200`` (its records, the
NCCL profiler plugin's files, every call timed), fed through the same ``Call`` type the
journals give (``Call.of_record``). The expected figures are the job's own CUDA events
(``truth_rank*.json``) and its hand counts (``tests/test_gputime.py``'s job).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from test_gputime import BIG, EVERY, FIXTURE, MID, STEADY, TIMED, WINDOW

RANKS = (0, 1)


def calls_of(run: Path) -> list:
    from commviz.live.tail import Call
    from commviz.record.store import load_record

    out = []
    for rank in RANKS:
        recs = load_record(run / f"commviz_rank{rank}.pkl")["collectives"]
        out += [Call.of_record(rank, i, rec) for i, rec in enumerate(recs)]
    return out


@pytest.fixture(scope="module")
def timed() -> list:
    from commviz.live.gpujoin import GpuJoin

    join = GpuJoin(FIXTURE)
    out = join.timed(calls_of(FIXTURE), time.time_ns(), final=True)
    assert join.every == {0: 1, 1: 1} and not join.problems
    return out


def truth() -> list[dict]:
    return [json.loads((FIXTURE / f"truth_rank{r}.json").read_text()) for r in RANKS]


def window_of(calls: list):
    from commviz.live.window import Windows

    windows = Windows()
    windows.add(calls)
    return windows.close(RANKS, 0, 1)


def origin_of(calls: list, nbytes: int) -> str:
    """The origin of the job's all_reduces of ``nbytes`` (one line of the job each)."""
    (origin,) = {c.shape.origin for c in calls
                 if c.shape.op == "all_reduce" and c.shape.size_bytes == nbytes}
    return origin


def row_of(window, origin: str):
    (row,) = [r for r in window.origins if r.origin == origin]
    return row


def test_the_window_gpu_time_and_bus_bandwidth_are_cuda_events(timed: list) -> None:
    window = window_of(timed)
    row = row_of(window, origin_of(timed, BIG * 4))
    assert row.times == "gpu"
    assert (row.window.instances, row.window.timed, row.window.calls) == (TIMED, TIMED, 2 * TIMED)
    # an instance's comm time runs from the last kernel start to the last end: the later
    # rank's CUDA event pair brackets that (the earlier rank's includes its wait), so the
    # truth per instance is the shorter of the two ranks' event times
    events_ns = sum(min(a, b) * 1e6 for a, b in zip(*(t["events_ms"] for t in truth())))
    assert abs(row.window.comm_ns - events_ns) <= 0.05 * events_ns, (row.window, events_ns)
    # 2 ranks: an all_reduce's bus factor 2 (n - 1) / n is 1
    busbw = TIMED * BIG * 4 / events_ns
    assert abs(row.window.busbw_gbps - busbw) <= 0.05 * busbw, (row.window.busbw_gbps, busbw)
    # a healthy run names nobody; the GPU skew of back-to-back all_reduces is microseconds
    assert window.stragglers == []
    group = next(r for r in window.groups if r.group == truth()[0]["default_name"])
    assert group.times == "gpu"
    from commviz.live import series

    line = series.FILE.parse_json(series.dumps(window), "window")
    assert {r["origin"]: r["times"] for r in line["origins"]}[row.origin] == "gpu"


def test_one_call_in_four_keeps_each_window_within_5_percent(timed: list) -> None:
    """The plugin's sampling (1 call in ``EVERY``): a window's figures from its timed calls,
    against the same window with every call timed."""
    origin = origin_of(timed, MID * 4)
    steady = sorted((c for c in timed if c.shape.origin == origin), key=lambda c: c.seq)
    seqs = sorted({c.seq for c in steady})
    assert len(seqs) == STEADY
    worst = 0.0
    for w in range(0, STEADY, WINDOW):
        chosen = set(seqs[w:w + WINDOW])
        every = [c for c in steady if c.seq in chosen]
        sampled = [c if (c.seq - seqs[0]) % EVERY == 0 else
                   c._replace(gpu_begin_ns=-1, gpu_end_ns=-1) for c in every]
        full, part = (row_of(window_of(cs), origin).window for cs in (every, sampled))
        assert (full.timed, part.timed, part.instances) == (WINDOW, WINDOW // EVERY, WINDOW)
        worst = max(worst, abs(part.busbw_gbps - full.busbw_gbps) / full.busbw_gbps)
    assert worst <= 0.05, worst


def test_without_gpu_times_a_nccl_call_stays_its_launch(timed: list, tmp_path: Path) -> None:
    """No GPU-time file (the plugin off): the calls go on as read, CPU times, no comm time."""
    from commviz.live.gpujoin import GpuJoin

    plain = GpuJoin(tmp_path).timed(calls_of(FIXTURE), time.time_ns())
    assert all(c.gpu_begin_ns < 0 for c in plain)
    row = row_of(window_of(plain), origin_of(plain, BIG * 4))
    assert (row.times, row.window.timed, row.window.comm_ns, row.window.busbw_gbps) == (
        "cpu", 0, 0, None)


def test_the_histogram_holds_gpu_seconds_and_counts_the_untimed(timed: list) -> None:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from commviz.live.metrics import Counts

    big, mid = origin_of(timed, BIG * 4), origin_of(timed, MID * 4)
    counts = Counts()
    for c in timed:
        if c.shape.origin == big:
            counts.add(c)
        elif c.shape.origin == mid:        # sampled: 1 in EVERY kept its times
            counts.add(c, untimed=c.seq % EVERY != 0)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(counts)
    samples = [s for f in text_string_to_metric_families(generate_latest(registry).decode())
               for s in f.samples]
    for rank, t in zip(RANKS, truth()):
        def value(name: str, origin: str) -> float:
            return next(s.value for s in samples if s.name == name
                        and s.labels["rank"] == str(rank) and s.labels["origin"] == origin)

        # each rank's kernels lie inside its own event pairs (the first waits for the other)
        events_s = sum(t["events_ms"]) / 1e3
        got = value("commviz_collective_seconds_sum", big)
        assert 0.9 * events_s <= got <= 1.01 * events_s, (got, events_s)
        assert value("commviz_collective_seconds_count", big) == TIMED
        assert value("commviz_collective_seconds_count", mid) == STEADY // EVERY
        assert value("commviz_collective_untimed_total", mid) == STEADY - STEADY // EVERY
        assert value("commviz_collective_bytes_total", mid) == STEADY * MID * 4


def test_kept_windows_say_gpu_and_the_report_reads_them(timed: list, tmp_path: Path) -> None:
    from commviz.live import series
    from commviz.review.render import wholerun

    window = window_of(timed)
    series.append(tmp_path, window)
    (line,), _ = series.read(series.path_of(tmp_path))
    row = row_of(window, origin_of(timed, BIG * 4))
    (kept,) = [r for r in line["origins"] if r["origin"] == row.origin]
    assert (kept["times"], kept["window"]["timed"]) == ("gpu", TIMED)
    assert wholerun.to_json(tmp_path)["times"] == line["times"]
