"""The report's "over the whole run": the windows a watcher kept, read back after the job.

``commviz watch`` (or ``commviz launch`` with ``live.watch``) appends each window to
``RUN_DIR/windows.jsonl`` (``commviz.live.series``) while the job runs. The report turns them
into two tables and a plot:

- where each slowdown began: per rank named, its cause (``commviz.live.cause``: late, transfer,
  pause, p2p_link) and origin, the first window it was named in (the window where the slowdown
  began), how many windows named it, its median skew (for a transfer or link: the time lost
  per instance against its siblings) and what it cost the others over all of them;
- who was late where, window by window (runs of windows naming nobody folded into one row);
- ``plots/windows.png``: per window, the arrival skew (p50) of the origins with the most wait,
  the windows that named a late rank marked with the rank, and the wait per group.

A run no watcher watched has no such file and no such section. Times are the calls' CPU times,
or on NCCL their ops' GPU times where the windows say so (``times``, per window and row).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import NamedTuple

from commviz.errors import SourceError
from commviz.live import series
from commviz.metadata import fmt_ns
from commviz.review.analyses.kept_windows import read_whole_run, times_of

WINDOWS_PNG = "windows.png"
ORIGINS_DRAWN = 6


class Table(NamedTuple):
    """A section as ``review.render.report_formats.Section`` takes it (the report imports this
    module, so it gets the tables here, not the other way)."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    note: str = ""


def _who(rank: int, cause: str, peer: int | None) -> str:
    return f"rank {rank} -> {peer}" if peer is not None else f"rank {rank}"


def _late(w: series.WindowFile) -> str:
    return "; ".join(f"{_who(s['rank'], s.get('cause', 'late'), s.get('peer'))} "
                     f"{s.get('cause', 'late')} at {s['origin']} in {s['group_label']} "
                     f"({fmt_ns(s['skew_ns'])}, cost {fmt_ns(s['cost_ns'])})"
                     for s in w["stragglers"])


_SAID = {"cpu": "CPU times of the calls", "gpu": "GPU times of the NCCL ops",
         "mixed": "GPU times where a window's row says gpu, else CPU"}


def tables(run_dir: Path, top: int) -> list[Table]:
    """The two tables (none without a kept series; one line when it cannot be read)."""
    try:
        whole = read_whole_run(run_dir)
    except SourceError as exc:
        return [Table("Over the whole run", ["problem"], [[str(exc)]])]
    if whole is None:
        return []
    n = len(whole.windows)
    span = (whole.windows[-1]["end_ns"] - whole.t0) / 1e9
    note = (f"{n} windows over {span:.0f} s kept by the watcher in {whole.path.name}; "
            f"{_SAID[times_of(whole)]}; a late rank is last in three quarters of an origin's "
            "instances of a window; transfer: the groups a rank shares run slower than their "
            "siblings; pause: its groups stalled at once; p2p_link: a pipeline link delivers "
            "slower than its siblings (docs/watch.md)")
    downs = whole.slowdowns()
    began = Table(
        "Over the whole run: where each slowdown began",
        ["rank", "cause", "origin", "group", "began in window", "window's span", "windows named",
         "skew (median)", "cost the others"],
        [[_who(d.rank, d.cause, d.peer), d.cause, d.origin, d.group_label, f"#{d.began}",
          f"+{d.began_s[0]:.1f} to +{d.began_s[1]:.1f} s",
          f"{len(d.windows)} of {n}", fmt_ns(statistics.median(d.skews)), fmt_ns(d.cost_ns)]
         for d in downs[:top]] or [["none", "-", "-", "-", "-", "-", f"0 of {n}", "-", "-"]],
        " ".join([note, *whole.notes]))
    rows: list[list[str]] = []
    quiet: list[series.WindowFile] = []

    def flush_quiet() -> None:
        if quiet:
            first, last = quiet[0], quiet[-1]
            label = f"#{first['index']}" + (f"-#{last['index']}" if last is not first else "")
            rows.append([label, f"+{(first['start_ns'] - whole.t0) / 1e9:.1f} s", "nobody"])
            quiet.clear()
    for w in whole.windows:
        if not w["stragglers"]:
            quiet.append(w)
            continue
        flush_quiet()
        rows.append([f"#{w['index']}", f"+{(w['start_ns'] - whole.t0) / 1e9:.1f} s",
                     _late(w)])
    flush_quiet()
    per_window = Table("Over the whole run: who was late where, window by window",
                         ["window", "from", "ranks named, cause (skew, what they cost the others)"],
                         rows[:top * 2])
    return [began, per_window]


def to_json(run_dir: Path) -> dict | None:
    """The report's JSON of it: the windows kept, each slowdown, what was skipped (None: no
    watcher kept windows; ``{"problem": ...}``: they cannot be read)."""
    try:
        whole = read_whole_run(run_dir)
    except SourceError as exc:
        return {"problem": str(exc)}
    if whole is None:
        return None
    return {"windows": len(whole.windows), "times": times_of(whole), "notes": whole.notes,
            "slowdowns": [{"rank": d.rank, "cause": d.cause, "peer": d.peer,
                           "origin": d.origin, "group": d.group_label,
                           "began_window": d.began, "began_s": list(d.began_s),
                           "windows": d.windows, "skew_ns": int(statistics.median(d.skews)),
                           "cost_ns": d.cost_ns} for d in whole.slowdowns()],
            "late": [{"window": w["index"], "start_ns": w["start_ns"], "end_ns": w["end_ns"],
                      "stragglers": w["stragglers"]} for w in whole.windows if w["stragglers"]]}


def plot_windows(run_dir: Path, plots_dir: Path) -> list[Path]:
    """``plots/windows.png`` (nothing without a kept series)."""
    from matplotlib.figure import Figure      # only a report that draws pays for it

    from commviz.review.render.plots import _save

    try:
        whole = read_whole_run(run_dir)
    except SourceError:
        return []
    if whole is None:
        return []
    t = {w["index"]: ((w["end_ns"] - whole.t0) / 1e9) for w in whole.windows}
    wait: dict[str | None, float] = {}
    for w in whole.windows:
        for r in w["origins"]:
            wait[r["origin"]] = wait.get(r["origin"], 0) + r["window"]["wait_ns"]
    drawn = sorted(wait, key=lambda o: -wait[o])[:ORIGINS_DRAWN]
    fig = Figure(figsize=(10, 6.5))
    ax, ax2 = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    for origin in drawn:
        xs, ys = [], []
        for w in whole.windows:
            got = [r["window"]["skew_p50_ns"] for r in w["origins"] if r["origin"] == origin
                   and r["window"]["skew_p50_ns"] is not None]
            if got:
                xs.append(t[w["index"]])
                ys.append(max(got) / 1e6)
        ax.plot(xs, ys, marker=".", label=origin)
    for w in whole.windows:
        for s in w["stragglers"]:
            ax.scatter([t[w["index"]]], [s["skew_ns"] / 1e6], s=90, facecolors="none",
                       edgecolors="red", linewidths=1.5, zorder=3)
            ax.annotate(f"rank {s['rank']}", (t[w["index"]], s["skew_ns"] / 1e6),
                        textcoords="offset points", xytext=(4, 6), fontsize=7, color="red")
    downs = whole.slowdowns()
    for d in downs:
        ax.axvspan(*d.began_s, color="red", alpha=0.08, linewidth=0)
    ax.margins(y=0.15)                      # room for the ranks' names above the circles
    ax.set_ylabel("arrival skew p50 per window (ms)")
    ax.set_title("Over the whole run: arrival skew per origin; late ranks circled, "
                 f"the window a slowdown began shaded ({_SAID[times_of(whole)]})", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    groups: dict[str, tuple[list[float], list[float]]] = {}
    for w in whole.windows:
        for r in w["groups"]:
            xs, ys = groups.setdefault(r["label"], ([], []))
            xs.append(t[w["index"]])
            ys.append(r["window"]["wait_ns"] / 1e6)
    for label, (xs, ys) in sorted(groups.items(), key=lambda kv: -sum(kv[1][1]))[:ORIGINS_DRAWN]:
        ax2.plot(xs, ys, marker=".", label=label)
    ax2.set_ylabel("wait per window (ms)")
    ax2.set_xlabel("seconds since the first window began (each point: a window's end)")
    ax2.legend(fontsize=7, loc="upper left")
    plots_dir.mkdir(parents=True, exist_ok=True)
    return [_save(fig, plots_dir / WINDOWS_PNG)]
