"""The run reviewed, after the job: its report (verdict first), plots, the whole run's windows,
the timeline picture for a chosen window and ranks, and the merged trace for the Perfetto UI.

``report.md`` is rendered as ``commviz report`` wrote it (markdown-it, raw HTML in it shown as
text), its images pointed at the run dir's files. The timeline is ``commviz preview``'s picture
of ``merged.pftrace`` (else ``overview.pftrace``), drawn on request, one drawing at a time, the
last few kept (``Timelines``): a flood of requests for new windows waits its turn, and never
more than one core draws.
"""

from __future__ import annotations

import tempfile
import threading
from collections import Counter, OrderedDict
from html import escape
from pathlib import Path
from urllib.parse import quote

from markdown_it import MarkdownIt

from commviz.errors import CommvizError
from commviz.live import series
from commviz.merge.core import MERGED_NAME
from commviz.merge.keep import parse_window
from commviz.merge.select import format_ranks, parse_ranks
from commviz.review.overview import OVERVIEW_NAME
from commviz.review.render.timeline import write_preview
from commviz.serve.page import rows_table

REPORT_NAME = "report.md"
FILES = "/files/"               # the route the run dir's files are served under
KEPT = 8                        # timeline pictures kept


def file_url(rel: str) -> str:
    return FILES + quote(rel)


def report_html(run_dir: Path) -> str | None:
    """``report.md`` as HTML (None: no report yet), its images served from the run dir."""
    path = run_dir / REPORT_NAME
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    md = MarkdownIt("commonmark", {"html": False}).enable("table")
    tokens = md.parse(text)
    for tok in tokens:
        for child in tok.children or []:
            src = child.attrs.get("src") if child.type == "image" else None
            if isinstance(src, str) and "://" not in src and not src.startswith("/"):
                child.attrs["src"] = file_url(src)
    return md.renderer.render(tokens, md.options, {})


def whole_run_html(run_dir: Path) -> str:
    """The windows the launch's watch kept (``windows.jsonl``), the last beside the whole run,
    with each row's plots over every window ("" without a watch)."""
    path = series.path_of(run_dir)
    if not path.is_file():
        return ""
    try:
        lines, notes = series.read(path)
    except CommvizError as exc:
        return f"<p>{escape(str(exc))}</p>"
    windows = series.one_watcher(lines)
    named = Counter((s["rank"], s["origin"]) for w in windows for s in w["stragglers"])
    said = ", ".join(f"rank {r} to {o} ({n} window{'s' if n > 1 else ''})"
                     for (r, o), n in named.most_common())
    return (f'<div class="cv"><h2 id="whole-run">Over the whole run ({len(windows)} windows of '
            "commviz watch)</h2>"
            f"<p>late ranks, the most often named first: {escape(said or 'none')}</p>"
            + rows_table(windows, "groups", "per process group: the last window (the whole run)")
            + rows_table(windows, "origins", "per origin: the last window (the whole run)")
            + "".join(f"<p>{escape(n)}</p>" for n in notes) + "</div>")


def trace_of(run_dir: Path) -> Path | None:
    """The trace the timeline is drawn from: the merged one, else the overview."""
    return next((p for p in (run_dir / MERGED_NAME, run_dir / OVERVIEW_NAME) if p.is_file()),
                None)


def timeline_args(window: str, ranks: str) -> tuple[str | None, list[int] | None]:
    """The form's text checked as ``commviz preview`` checks its flags (CommvizError)."""
    window, ranks = window.strip(), ranks.strip()
    if window:
        parse_window(window)
    return window or None, parse_ranks(ranks) if ranks else None


class Timelines:
    """``commviz preview``'s pictures of one trace, drawn one at a time, the last ``KEPT``
    kept by (window, ranks)."""

    def __init__(self, trace: Path) -> None:
        self.trace = trace
        self._kept: OrderedDict[tuple[str | None, str | None], bytes] = OrderedDict()
        self._lock = threading.Lock()
        self._dir = tempfile.TemporaryDirectory(prefix="commviz-serve-")

    def png(self, window: str | None, ranks: list[int] | None) -> bytes:
        key = (window, None if ranks is None else format_ranks(ranks))
        with self._lock:
            if key not in self._kept:
                out = Path(self._dir.name) / "timeline.png"
                write_preview(self.trace, out, window=window, ranks=ranks)
                self._kept[key] = out.read_bytes()
                while len(self._kept) > KEPT:
                    self._kept.popitem(last=False)
            self._kept.move_to_end(key)
            return self._kept[key]
