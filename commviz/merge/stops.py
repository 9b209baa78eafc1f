"""Where each rank stopped, for the merged trace of a job that hung or died.

When any rank left a stack dump in the run dir (``commviz.record.stacks``: torn down, raised,
died of a signal) or a call raised, every rank gets one marker at the end of its last
collective (on the merged clock): its op and number, whether it returned, and in its args the
stack the rank left (the main thread's frames, innermost first) and its uncaught exception.
The culprit is the review's to name (``commviz.review.analyses.judge``); the markers show every
rank's last moment side by side, so the culprit's stack is in its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from commviz import metadata as md
from commviz.match.model import CommEvent
from commviz.record import stacks as st

STOP_CAT = "commviz.stop"


class Stop(NamedTuple):
    rank: int
    ts_ns: int
    name: str
    args: dict[str, Any]


def _stack_args(s: st.Stacks | None) -> dict[str, Any]:
    if s is None:
        return {}
    out: dict[str, Any] = {}
    main = s.main_thread
    if main is not None and main.frames:
        out["commviz.stack"] = "\n".join(str(f) for f in main.frames)
    where = s.raised_at() or s.user_frame()
    if where is not None:
        out["commviz.stopped_at"] = str(where)
    if s.fatal:
        out["commviz.fatal"] = s.fatal
    if s.exception:
        out["commviz.exception"] = s.exception
    return out


def stops(events: list[CommEvent], run_dir: Path) -> list[Stop]:
    """One marker per rank with events, or none when the job ended well (no stacks were
    left and no call raised)."""
    dumps = {r: st.read_stacks(st.stacks_path(run_dir, r)) for r in {e.rank for e in events}}
    if not any(dumps.values()) and not any(md.ERROR in e.args for e in events):
        return []
    last: dict[int, CommEvent] = {}
    for ev in events:
        if ev.rank not in last or ev.end_ns >= last[ev.rank].end_ns:
            last[ev.rank] = ev
    out = []
    for rank, ev in sorted(last.items()):
        error = ev.args.get(md.ERROR)
        state = "failed" if error else "returned"
        number = f" #{ev.seq}" if ev.seq is not None else ""
        args = {"commviz.rank": rank, "commviz.last": f"{ev.op}{number}",
                "commviz.pg": f"{ev.pg} ({ev.args.get(md.PG_DESC, '')})", "commviz.state": state,
                **({md.CALLSITE: ev.args[md.CALLSITE]} if md.CALLSITE in ev.args else {}),
                **({md.ERROR: error} if error else {}), **_stack_args(dumps.get(rank))}
        out.append(Stop(rank, ev.end_ns, f"rank {rank} stopped after {ev.op}{number} ({state})",
                        args))
    return out
