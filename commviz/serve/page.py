"""The live panel as HTML: the late ranks first, then per group and per origin the window beside
the run so far, each row with small plots of its windows (inline SVG: no script, no request).

It renders the windows ``commviz watch`` makes (``commviz.live.series``' lines, kept in memory
while the job runs or read from ``windows.jsonl`` after it), in the words ``commviz watch`` and
``commviz report`` use (``commviz.live.cause.said``, ``fmt_ns``). Everything shown is
escaped: group names, origins and a verdict's stacks come from the job. At most ``ROWS_SHOWN``
rows and ``LATE_SHOWN`` late ranks a table, so the page stays small for any number of ranks.
"""

from __future__ import annotations

from html import escape
from typing import Any, Callable, Iterable, NamedTuple

from commviz.live import series
from commviz.live.cause import said
from commviz.live.watch import NO_NAME, ROWS_SHOWN, TIMES_NOTE
from commviz.merge.select import format_ranks
from commviz.metadata import fmt_gbps, fmt_ns

LATE_SHOWN = 16
CHART_W, CHART_H = 120, 30
Links = Callable[[int], list[tuple[str, str]]]     # rank -> (href, label) of pages about it

STYLE = """
.cv-late{background:#fde8e8;border-left:4px solid #c0392b;padding:6px 10px;margin:4px 0}
.cv-ok{background:#e8f5e9;padding:6px 10px}
.cv-verdict{background:#fff4e5;border-left:4px solid #e67e22;padding:6px 10px}
.cv-verdict pre{white-space:pre-wrap;margin:0}
.cv table{border-collapse:collapse;font-size:.85rem;margin:6px 0 14px}
.cv th,.cv td{border-bottom:1px solid #ddd;padding:2px 6px;text-align:right;vertical-align:middle}
.cv td{white-space:nowrap}
.cv th:first-child,.cv td:first-child,.cv td.cv-o{text-align:left}
.cv .cv-head{color:#555;font-size:.9rem}
.cv svg{display:block}
.cv .cv-links a{margin-left:8px;font-size:.85rem}
"""


class Panel(NamedTuple):
    """What the live panel shows: the state of the job, the windows so far, a verdict."""

    run_dir: str
    state: str                       # "waiting" | "running" | "ended"
    windows: list[series.WindowFile]   # oldest first (the last: the window just closed)
    verdict: str | None              # ``commviz status``'s verdict while nothing moves
    still_s: float                   # how long nothing has completed (with a verdict)
    problems: list[str]


def late_items(stragglers: Iterable[dict[str, Any]], links: Links | None) -> str:
    """The late ranks, the costliest first, each with its cause where the window has one."""
    out = []
    items = list(stragglers)
    for s in items[:LATE_SHOWN]:
        line = said(s, fmt_ns)
        cause = _cause(s.get("cause"))
        more = "".join(f'<a href="{escape(h)}">{escape(t)}</a>'
                       for h, t in (links(s["rank"]) if links else []))
        out.append(f'<div class="cv-late" data-rank="{s["rank"]}" '
                   f'data-origin="{escape(s["origin"])}"><b>{escape(line)}</b>'
                   + (f'<div class="cv-cause">cause: {escape(cause)}</div>' if cause else "")
                   + (f'<span class="cv-links">{more}</span>' if more else "") + "</div>")
    if len(items) > LATE_SHOWN:
        out.append(f"<div>{len(items) - LATE_SHOWN} more late ranks (commviz watch --format "
                   "json has them all)</div>")
    return "".join(out) or f'<div class="cv-ok">{escape(NO_NAME)}</div>'


def _cause(cause: Any) -> str:
    """A straggler's cause as text: a line, or its fields ``key: value``."""
    if cause is None or cause == "":
        return ""
    if isinstance(cause, dict):
        return "; ".join(f"{k}: {v}" for k, v in cause.items() if v not in (None, ""))
    return str(cause)


def chart(values: list[float | None], marks: list[bool], unit: str, fmt: Callable[[Any], str]
          ) -> str:
    """A small line plot of one figure per window (gaps where a window had none); windows
    that named a late rank in the row are marked red."""
    known = [v for v in values if v is not None]
    top = max(known, default=0) or 1
    n = max(len(values) - 1, 1)
    pts: list[list[str]] = [[]]
    dots = []
    for i, (v, m) in enumerate(zip(values, marks)):
        if v is None:
            pts.append([])
            continue
        x, y = 1 + (CHART_W - 2) * i / n, CHART_H - 2 - (CHART_H - 4) * v / top
        pts[-1].append(f"{x:.0f},{y:.0f}")        # whole pixels: half the bytes, same picture
        if m:
            dots.append(f'<circle cx="{x:.0f}" cy="{y:.0f}" r="2" fill="#c0392b"/>')
    lines = "".join(f'<polyline points="{" ".join(p)}" fill="none" stroke="#1f77b4"/>'
                    for p in pts if p)
    last = fmt(known[-1]) if known else "-"
    return (f'<svg width="{CHART_W}" height="{CHART_H}" role="img"><title>{escape(unit)}: last '
            f'{escape(last)}, max {escape(fmt(max(known, default=None)))} ({len(values)} windows)'
            f'</title><rect width="{CHART_W}" height="{CHART_H}" fill="#f7f7f7"/>{lines}'
            f"{''.join(dots)}</svg>")


Key = tuple[str, str | None]


def _history(windows: list[series.WindowFile], kind: str
             ) -> dict[Key, tuple[list[dict[str, Any] | None], list[bool]]]:
    """Per row key, its window figures in every window (None: not in it) and whether that
    window named a late rank in it."""
    out: dict[Key, tuple[list[dict[str, Any] | None], list[bool]]] = {}
    for i, w in enumerate(windows):
        late = {(s["group"], s["origin"]) for s in w["stragglers"]} | {
            (s["group"], None) for s in w["stragglers"]}
        for r in w[kind]:     # type: ignore[literal-required]
            figs, marks = out.setdefault((r["group"], r["origin"]),
                                         ([None] * len(windows), [False] * len(windows)))
            figs[i], marks[i] = dict(r["window"]), (r["group"], r["origin"]) in late
    return out


def _vs(now: str, run: str) -> str:
    return now if now == run else f"{now} ({run})"


def _per(f: dict[str, Any]) -> str:
    return fmt_ns(f["wait_ns"] / f["instances"]) if f["instances"] else "-"


def rows_table(windows: list[series.WindowFile], kind: str, title: str) -> str:
    """The last window's rows of ``kind`` ("groups" or "origins") beside the run so far, with
    plots of each row's skew p50 and wait over ``windows`` (what a late rank moves)."""
    last = next((w for w in reversed(windows) if w["groups"]), None)
    if last is None:
        return ""
    hist = _history(windows, kind)
    by_origin = kind == "origins"
    head = ["group", *(["origin"] if by_origin else []), "ranks", "times", "calls", "comm",
            "busbw GB/s (run)", "skew p50 (run)", "skew p99 (run)",
            "wait (per instance: window vs run)", "skew p50 / window", "wait / window"]
    body = []
    rows = last[kind]         # type: ignore[literal-required]
    for r in rows[:ROWS_SHOWN]:
        w, run = r["window"], r["run"]
        figs, marks = hist[(r["group"], r["origin"])]

        def plot(key: str, unit: str, fmt: Callable[[Any], str]) -> str:
            return chart([None if f is None else f[key] for f in figs], marks, unit, fmt)

        times = f"gpu {w['timed']}/{w['instances']}" if r["times"] == "gpu" else "cpu"
        cells = [escape(r["label"]), *([escape(r["origin"] or "-")] if by_origin else []),
                 f"{r['seen']}/{r['size']}", times, str(w["calls"]), fmt_ns(w["comm_ns"]),
                 _vs(fmt_gbps(w["busbw_gbps"]), fmt_gbps(run["busbw_gbps"])),
                 _vs(fmt_ns(w["skew_p50_ns"]), fmt_ns(run["skew_p50_ns"])),
                 _vs(fmt_ns(w["skew_p99_ns"]), fmt_ns(run["skew_p99_ns"])),
                 f"{fmt_ns(w['wait_ns'])} ({_per(w)} vs {_per(run)})",
                 plot("skew_p50_ns", "skew p50", fmt_ns), plot("wait_ns", "wait", fmt_ns)]
        tds = "".join(f'<td class="cv-o">{c}</td>' if by_origin and i == 1 else f"<td>{c}</td>"
                      for i, c in enumerate(cells))
        body.append(f"<tr>{tds}</tr>")
    more = (f"<div>{len(rows) - ROWS_SHOWN} more rows (commviz watch --format json has them "
            "all)</div>") if len(rows) > ROWS_SHOWN else ""
    ths = "".join(f"<th>{escape(h)}</th>" for h in head)
    return f"<h3>{escape(title)}</h3><table><tr>{ths}</tr>{''.join(body)}</table>{more}"


def live_html(p: Panel, links: Links | None = None) -> str:
    """The live panel (a fragment: the pages put it in their own frame and refresh it), in
    ASCII with character references: torch's frame declares no charset."""
    parts = [f'<div class="cv" id="commviz-live" data-state="{p.state}">']
    last = p.windows[-1] if p.windows else None
    if p.state == "waiting":
        parts.append(f'<p class="cv-head">{escape(p.run_dir)}: no rank records yet (waiting '
                     "for the job's journals)</p>")
    elif p.state == "ended":
        parts.append(f'<p class="cv-head">{escape(p.run_dir)}: the job has ended (its '
                     "journals are gone); the report follows once the launch wrote it</p>")
    elif last is not None:
        secs = (last["end_ns"] - last["start_ns"]) / 1e9
        parts.append(f'<p class="cv-head">{escape(p.run_dir)}: window {last["index"]} '
                     f'({secs:.1f} s), ranks {escape(format_ranks(last["ranks"]) or "none yet")}'
                     f"; {escape(TIMES_NOTE[last['times']])}</p>")
    if p.verdict is not None:
        parts.append(f'<div class="cv-verdict"><b>HANG? nothing has completed for '
                     f"{p.still_s:.0f} s while the ranks disagree (commviz status's verdict; "
                     f"the job goes on)</b><pre>{escape(p.verdict)}</pre></div>")
    if last is not None and p.state == "running":
        parts.append(late_items(last["stragglers"], links))
    parts.append(rows_table(p.windows, "groups", "per process group"))
    parts.append(rows_table(p.windows, "origins", "per origin"))
    parts += [f"<div>problem: {escape(x)}</div>" for x in p.problems]
    parts.append("</div>")
    return "".join(parts).encode("ascii", "xmlcharrefreplace").decode()   # µs in any frame


REFRESH_SCRIPT = """
<script>
(function () {
  const every = %d, from = %s;
  async function refresh() {
    try {
      const r = await fetch(from, {cache: "no-store"});
      if (r.ok) {
        const text = await r.text();
        const box = document.getElementById("commviz-live");
        const was = box ? box.dataset.state : "";
        if (box) box.outerHTML = text;
        const now = document.getElementById("commviz-live");
        if (%s && was === "running" && now && now.dataset.state === "ended") location.reload();
      }
    } catch (e) { /* the server is away: the last panel stays */ }
    setTimeout(refresh, every);
  }
  setTimeout(refresh, every);
})();
</script>
"""


def refresh_script(interval_s: float, fragment: str, reload_when_ended: bool) -> str:
    """Fetch the fragment again every ``interval_s`` and put it in place (the page itself stays:
    no flicker, no lost scroll); ``reload_when_ended``: load the page anew when the job ended
    (``commviz serve`` then shows the report)."""
    return REFRESH_SCRIPT % (max(500, int(interval_s * 1000)), _js_string(fragment),
                             "true" if reload_when_ended else "false")


def _js_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
