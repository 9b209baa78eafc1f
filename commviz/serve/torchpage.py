"""The commviz page in torch's debug server (``torch.distributed.debug``): a ``DebugHandler``.

torch's frontend runs in a process of its own beside rank 0 and answers each route with the
bytes a handler returns (as text/html). ``CommvizHandler`` answers ``/commviz`` (the live panel
in the server's own frame, with its nav bar) and ``/commviz/live`` (the panel alone, which the
page fetches every ``interval``) from a ``LiveView`` started on the first request or dump, in
that process, never in a rank: the handler object itself is made in rank 0 and handed to the
frontend, so it holds settings only until then. Each late rank links to torch's own pages for
it: its Python stack and the Flight Recorder tables (CPU; on NCCL, NCCL's).

``dump()`` is the latest windows as JSON lines (``commviz.live.series``), what the server's
periodic dumps keep when ``enabled_dumps`` names ``commviz_windows``.

This module imports torch's debug server; ``commviz.serve.debug`` is the way in, with a clear
message where torch has none.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any
from urllib.parse import quote

from torch.distributed.debug._frontend import DebugHandler, NavLink, Route

from commviz.live import series
from commviz.serve.live import DEFAULT_INTERVAL_S, LiveView
from commviz.serve.page import STYLE, refresh_script

PAGE, FRAGMENT = "/commviz", "/commviz/live"
DUMP_NAME = "commviz_windows"
TEMPLATE = """
{% extends "base.html" %}
{% block header %}<h1>{% block title %}commviz{% endblock %}</h1>{% endblock %}
{% block content %}<style>{{ style | safe }}</style>{{ panel | safe }}{{ script | safe }}
{% endblock %}
"""
_START = threading.Lock()


class CommvizHandler(DebugHandler):
    """The run dir's live panel as a page of torch's debug server."""

    def __init__(self, run_dir: str | Path, interval: float = DEFAULT_INTERVAL_S,
                 nccl: bool = False) -> None:
        self.run_dir, self.interval, self.nccl = Path(run_dir), interval, nccl
        self._live: LiveView | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Settings only: the view starts where the page is served (torch may spawn it)."""
        return {**self.__dict__, "_live": None}

    def routes(self) -> list[Route]:
        return [Route(PAGE, self._page), Route(FRAGMENT, self._fragment)]

    def nav_links(self) -> list[NavLink]:
        return [NavLink(PAGE, "commviz")]

    def templates(self) -> dict[str, str]:
        return {"commviz.html": TEMPLATE}

    def dump(self) -> str | None:
        live = self.live()
        return "".join(series.FILE.dump_json(w).decode() + "\n" for w in live.windows) or None

    def dump_filename(self) -> str:
        return DUMP_NAME

    def live(self) -> LiveView:
        with _START:
            if self._live is None:
                self._live = LiveView(self.run_dir, self.interval, links=self.rank_links)
                self._live.start()
            return self._live

    def rank_links(self, rank: int) -> list[tuple[str, str]]:
        """torch's pages show every rank under ``Rank R: ...``: a text fragment scrolls there."""
        at = "#:~:text=" + quote(f"Rank {rank}:")
        fr = "/fr_trace_nccl" if self.nccl else "/fr_trace"
        return [(f"/stacks{at}", f"rank {rank}'s Python stack"),
                (fr, "Flight Recorder" + (" NCCL" if self.nccl else ""))]

    def _page(self, req: Any) -> bytes:
        return req.frontend.render_template(
            "commviz.html", style=STYLE, panel=self.live().html,
            script=refresh_script(self.interval, FRAGMENT, False))

    def _fragment(self, req: Any) -> bytes:
        return self.live().html.encode()
