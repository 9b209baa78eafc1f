"""What the Prometheus exporter counts: its metric names, their labels and the labels' bounds.

Per rank, every collective and p2p call that ended (``commviz.live.tail.Call``) lands in one
label set (group, op, size, origin, rank):

- ``commviz_collective_seconds``: histogram of the time each call took on the rank (its
  ``_count`` is the calls, its ``_sum`` the time spent in them: waiting for peers included);
  on NCCL, where the rank's ops are timed (``commviz.live.gpujoin``), its ops' GPU seconds,
  first start to last end: a CUDA call the plugin did not sample is in no bucket but in
  ``commviz_collective_untimed_total`` (a mean per call from ``_sum / _count`` is then the timed
  calls' mean);
- ``commviz_collective_untimed_total``: CUDA calls of a rank with GPU times that got none;
- ``commviz_collective_bytes_total``: the calls' sizes (``commviz.merge.bandwidth.size_bytes``);
- ``commviz_collective_failed_total``: calls that raised (in no other family; a label set
  has it once one of its calls failed);
- ``commviz_exporter_missed_calls_total``: per rank, calls the journals lost before they were
  read (``RunTail.missed``).

The labels are bounded so a 16,384-rank job stays a known number of series
(docs/prometheus.md): ``size`` is one of ``SIZE_LABELS``; ``origin`` is the rank's first
``origins`` distinct origins, later ones ``"other"``; a rank past ``series`` label sets counts
its further calls under one overflow set whose labels are all ``"other"``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, NamedTuple

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric

from commviz.live.tail import Call

OTHER = "other"               # an origin past the cap; every label of the overflow set
UNKNOWN = "unknown"           # a call with neither an origin nor a call site
ORIGINS = 32                  # distinct origins per rank with a label of their own
SERIES = 256                  # label sets per rank before the overflow set
# Histogram bounds, seconds: 100 us to 10 s in 1-3-10 steps (+Inf above).
TIME_BUCKETS = (1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)
# Size classes, powers of 4 from 1 KiB: a call of S bytes is in the first class >= S.
_SIZE_BOUNDS = tuple(1 << (10 + 2 * i) for i in range(11))         # 1 KiB .. 1 GiB
_UNITS = ((30, "GiB"), (20, "MiB"), (10, "KiB"))
LABELS = ("group", "op", "size", "origin", "rank")


def _bound_label(bound: int) -> str:
    shift, unit = next((s, u) for s, u in _UNITS if bound >= 1 << s)
    return f"{bound >> shift}{unit}"


SIZE_LABELS = (*map(_bound_label, _SIZE_BOUNDS), "over1GiB")


def size_label(nbytes: int) -> str:
    """The size class of a call of ``nbytes``: "1KiB" (up to 1 KiB), "4KiB" (over 1 KiB, up
    to 4 KiB), ..., "1GiB", "over1GiB"."""
    for bound, label in zip(_SIZE_BOUNDS, SIZE_LABELS):
        if nbytes <= bound:
            return label
    return SIZE_LABELS[-1]


class Labels(NamedTuple):
    group: str
    op: str
    size: str
    origin: str
    rank: str


@dataclass(slots=True)
class _Series:
    """One label set's sums: calls per histogram bucket (not cumulative; the last +Inf)."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(TIME_BUCKETS) + 1))
    seconds: float = 0.0
    nbytes: int = 0
    failed: int = 0
    untimed: int = 0


@dataclass(slots=True)
class _Rank:
    origins: set[str] = field(default_factory=set)     # the origins with a label of their own
    series: dict[Labels, _Series] = field(default_factory=dict)
    missed: int = 0


class Counts:
    """Every call's sums by label set, exposed as metric families (a prometheus_client
    collector: ``registry.register(counts)``). Fed and collected from one thread."""

    def __init__(self, origins: int = ORIGINS, series: int = SERIES) -> None:
        self.max_origins, self.max_series = origins, series
        self._ranks: dict[int, _Rank] = {}

    def add(self, call: Call, untimed: bool = False) -> None:
        """``untimed``: a CUDA call that should have had GPU times and has none (its bytes
        counted, its time not: a launch is not its collective's time)."""
        shape = call.shape
        rank = self._ranks.setdefault(call.rank, _Rank())
        labels = self._labels(rank, call)
        series = rank.series.get(labels)
        if series is None:
            if len(rank.series) >= self.max_series:
                labels = Labels(OTHER, OTHER, OTHER, OTHER, labels.rank)
            series = rank.series.setdefault(labels, _Series())
        if call.failed:
            series.failed += 1
            return
        series.nbytes += shape.size_bytes or 0
        if untimed:
            series.untimed += 1
            return
        begin, end = ((call.gpu_begin_ns, call.gpu_end_ns) if call.gpu_begin_ns >= 0
                      else (call.t_begin_ns, call.t_end_ns))
        seconds = max(0, end - begin) / 1e9
        series.buckets[_bucket(seconds)] += 1
        series.seconds += seconds

    def set_missed(self, missed: dict[int, int]) -> None:
        """The tail's count of calls lost per rank (it only grows)."""
        for rank, n in missed.items():
            self._ranks.setdefault(rank, _Rank()).missed = n

    def _labels(self, rank: _Rank, call: Call) -> Labels:
        shape = call.shape
        origin = shape.origin or UNKNOWN
        if origin not in rank.origins:
            if len(rank.origins) >= self.max_origins:
                origin = OTHER
            else:
                rank.origins.add(origin)
        return Labels(shape.group, shape.op, size_label(shape.size_bytes or 0), origin,
                      str(call.rank))

    def collect(self) -> Iterator[Metric]:
        seconds = HistogramMetricFamily(
            "commviz_collective_seconds", "Time each collective or p2p call took on the rank "
            "(waiting for its peers included; on NCCL its ops' GPU time where timed, else the "
            "launch)", labels=LABELS)
        nbytes = CounterMetricFamily(
            "commviz_collective_bytes", "Bytes of the calls (nccl-tests' size S)", labels=LABELS)
        failed = CounterMetricFamily(
            "commviz_collective_failed", "Calls that raised", labels=LABELS)
        untimed = CounterMetricFamily(
            "commviz_collective_untimed", "CUDA calls with no GPU time (not sampled by the NCCL "
            "profiler plugin): in no histogram bucket", labels=LABELS)
        missed = CounterMetricFamily(
            "commviz_exporter_missed_calls", "Calls the rank's journal lost before the exporter "
            "read them", labels=("rank",))
        for number, rank in sorted(self._ranks.items()):
            for labels, s in rank.series.items():
                total, cumulative = 0, []
                for bound, n in zip((*map(repr, TIME_BUCKETS), "+Inf"), s.buckets):
                    total += n
                    cumulative.append((bound, total))
                seconds.add_metric(labels, cumulative, s.seconds)
                nbytes.add_metric(labels, s.nbytes)
                if s.failed:
                    failed.add_metric(labels, s.failed)
                if s.untimed:
                    untimed.add_metric(labels, s.untimed)
            missed.add_metric((str(number),), rank.missed)
        yield from (seconds, nbytes, failed, untimed, missed)


def _bucket(seconds: float) -> int:
    for i, bound in enumerate(TIME_BUCKETS):
        if seconds <= bound:
            return i
    return len(TIME_BUCKETS)
