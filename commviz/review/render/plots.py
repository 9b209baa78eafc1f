"""The review's PNG plots: skew over time, bandwidth vs message size, rank x collective waits.

Figures are built with ``matplotlib.figure.Figure`` directly (no pyplot), so plotting never
touches the process's global backend or opens a window. A plot with nothing to show still
gets written, saying so, so a run dir always holds the same three files.
"""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
from matplotlib.colors import LogNorm
from matplotlib.figure import Figure

from commviz import metadata as md
from commviz.merge.instances import Instance

SKEW_PNG = "skew_over_time.png"
BANDWIDTH_PNG = "bandwidth_vs_size.png"
WAIT_PNG = "wait_heatmap.png"
# Columns of the wait heat map; more instances than this are binned (max wait per bin).
MAX_COLUMNS = 2000
# Waits spanning more than this ratio get a log colour scale.
LOG_RANGE = 100
# Up to this many instances, each column is labelled with its group and collective.
LABELLED_COLUMNS = 40
# A pause between two instances of a group longer than this many times the group's median
# interval (and than GAP_MIN_S) is drawn as a gap, not bridged by a line.
GAP_FACTOR = 10
GAP_MIN_S = 0.05
# Skews whose largest is more than this many times their median get a log axis.
SKEW_LOG_RATIO = 30


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="gray")
    ax.set_xticks([])
    ax.set_yticks([])


def _save(fig: Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def with_gaps(x: list[float], y: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """The points with a NaN between two whose distance stands out (a warm-up pause, the
    time between profiled windows), so the line breaks there instead of bridging it."""
    xs, ys = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    if len(xs) < 3:
        return xs, ys
    step = np.diff(xs)
    limit = max(GAP_FACTOR * float(np.median(step)), GAP_MIN_S)
    cut = np.flatnonzero(step > limit) + 1
    return np.insert(xs, cut, np.nan), np.insert(ys, cut, np.nan)


def plot_skew(instances: list[Instance], path: Path) -> Path:
    fig = Figure(figsize=(10, 4.5))
    ax = fig.add_subplot()
    multi = [i for i in instances if len(i.events) > 1]
    if not multi:
        _empty(ax, "no collective ran on more than one rank")
        return _save(fig, path)
    t0 = min(i.first_start_ns for i in multi)
    skews = np.array([i.skew_ns / 1e6 for i in multi])
    positive = skews[skews > 0]
    log = bool(positive.size) and positive.max() > SKEW_LOG_RATIO * float(np.median(positive))
    floor = float(positive.min()) if log else 0.0     # a zero skew sits on the axis's floor

    def skew_ms(i: Instance) -> float:
        return max(i.skew_ns / 1e6, floor)

    by_pg: dict[str, list[Instance]] = defaultdict(list)
    for inst in multi:
        by_pg[inst.pg].append(inst)
    for pg, insts in sorted(by_pg.items()):
        x, y = with_gaps([(i.first_start_ns - t0) / 1e9 for i in insts], [skew_ms(i) for i in insts])
        args = next(iter(insts[0].events.values())).args
        ax.plot(x, y, marker=".", linewidth=0.8,
                label="pg " + md.group_title(pg, insts[0].pg_desc, args.get(md.PG_RANKS)))
    strag = [i for i in multi if i.straggler is not None]
    if strag:
        ax.scatter([(i.first_start_ns - t0) / 1e9 for i in strag], [skew_ms(i) for i in strag],
                   s=80, facecolors="none", edgecolors="red", label="straggler", zorder=3)
        for i in strag[:40]:
            ax.annotate(f"r{i.straggler}", ((i.first_start_ns - t0) / 1e9, skew_ms(i)),
                        textcoords="offset points", xytext=(4, 4), fontsize=7, color="red")
    if log:
        ax.set_yscale("log")
    ax.set_xlabel("time since first collective (s); breaks: pauses between steps")
    ax.set_ylabel("arrival skew (ms" + (", log scale)" if log else ")"))
    ax.set_title("Arrival skew per collective (last start - first start)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both" if log else "major")
    return _save(fig, path)


def plot_bandwidth(instances: list[Instance], path: Path) -> Path:
    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    by_type: dict[str, list[Instance]] = defaultdict(list)
    for inst in instances:
        if inst.bandwidth is not None and len(inst.ranks) > 1:   # one rank: no link used
            by_type[inst.ctype].append(inst)
    if not by_type:
        _empty(ax, "no collective with a size and a measured time")
        return _save(fig, path)
    for ctype, insts in sorted(by_type.items()):
        sizes = np.array([i.bandwidth.size_bytes for i in insts], dtype=float)
        bus = np.array([i.bandwidth.busbw_gbps for i in insts])
        points = ax.scatter(sizes, bus, s=12, alpha=0.5, label=ctype)
        uniq = np.unique(sizes)
        ax.plot(uniq, [np.median(bus[sizes == s]) for s in uniq], color=points.get_facecolor()[0],
                linewidth=1, marker="_", markersize=16)     # the marker shows a lone size's median
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes, nccl-tests definition)")
    ax.set_ylabel("bus bandwidth (GB/s)")
    ax.set_title("Bus bandwidth vs message size (line: median)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    return _save(fig, path)


def plot_waits(instances: list[Instance], path: Path) -> Path:
    ranks = sorted({r for i in instances for r in i.events})
    multi = [i for i in instances if len(i.events) > 1]
    labelled = len(multi) <= LABELLED_COLUMNS
    fig = Figure(figsize=(10, 2.2 + 0.35 * max(len(ranks), 2) + (1.6 if labelled else 0)))
    ax = fig.add_subplot()
    if not multi:
        _empty(ax, "no collective ran on more than one rank")
        return _save(fig, path)
    row = {r: k for k, r in enumerate(ranks)}
    grid = np.full((len(ranks), len(multi)), np.nan)
    for col, inst in enumerate(multi):
        for rank, wait in inst.wait_ns.items():
            grid[row[rank], col] = wait / 1e6
    binned = len(multi) > MAX_COLUMNS
    if binned:
        edges = np.linspace(0, len(multi), MAX_COLUMNS + 1).astype(int)
        with warnings.catch_warnings():          # a bin where a rank took no part is all-NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            grid = np.stack([np.nanmax(grid[:, a:b], axis=1) for a, b in
                             zip(edges[:-1], edges[1:])], axis=1)
    norm, label = None, "wait (ms)"
    positive = grid[np.isfinite(grid) & (grid > 0)]
    if positive.size and positive.max() / positive.min() > LOG_RANGE:
        # one long wait would wash out the rest on a linear scale
        low = max(positive.min(), positive.max() / 1e5)
        norm, label = LogNorm(vmin=low, vmax=positive.max()), "wait (ms, log scale)"
        grid = np.where(np.isfinite(grid), np.maximum(grid, low), grid)
    image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="magma_r", norm=norm)
    fig.colorbar(image, ax=ax, label=label)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    if labelled:
        ax.set_xticks(range(len(multi)), [f"{i.pg}:{i.label}"[:28] for i in multi], rotation=60,
                      ha="right", fontsize=7)
    ax.set_xlabel("collective instance, in time order" + (" (binned: max per bin)" if binned else ""))
    ax.set_title("Time each rank waited for the last rank to arrive")
    return _save(fig, path)


def write_plots(instances: list[Instance], plots_dir: str | Path) -> list[Path]:
    """Write the three PNGs into ``plots_dir`` (created) and return their paths."""
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    return [plot_skew(instances, plots_dir / SKEW_PNG),
            plot_bandwidth(instances, plots_dir / BANDWIDTH_PNG),
            plot_waits(instances, plots_dir / WAIT_PNG)]
