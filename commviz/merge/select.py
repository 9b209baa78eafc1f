"""Detail on demand: which ranks ``commviz merge RUN_DIR --ranks 0-7,512`` merges.

The overview (``commviz overview``) shows every rank's collectives; the ranks that matter (a
straggler and its group peers) are then merged in full. Only the selected ranks' inputs are
opened (``load_rank``: never the other ranks' records or trace headers), so a detail merge of
8 ranks costs the same in a 1,024-rank run dir as in an 8-rank one; flows to ranks outside the
selection are left out by the merge (an instance held by one selected rank has no other end).
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable

from commviz.errors import CommvizError, SourceError
from commviz.trace.run import Run, load_rank


def parse_ranges(text: str, flag: str, what: str) -> list[int]:
    """``"0-7,512"`` -> [0, ..., 7, 512]; anything else is one error naming ``flag`` and the
    bad part (``what``: "rank", "step")."""
    found: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise CommvizError(f"{flag} {text!r}: {part!r} is not a {what} or a range "
                               f"A-B of {what}s") from None
        if first < 0 or last < first:
            raise CommvizError(f"{flag} {text!r}: {part!r} is not a range of {what}s "
                               "(A-B needs 0 <= A <= B)")
        found.update(range(first, last + 1))
    return sorted(found)


def parse_ranks(text: str) -> list[int]:
    """``"0-7,512"`` -> [0, ..., 7, 512]."""
    return parse_ranges(text, "--ranks", "rank")


def format_ranks(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 3, 7] -> ``"0-3,7"`` (what ``parse_ranks`` reads back)."""
    out: list[str] = []
    todo = sorted(set(ranks))
    i = 0
    while i < len(todo):
        j = i
        while j + 1 < len(todo) and todo[j + 1] == todo[j] + 1:
            j += 1
        out.append(str(todo[i]) if i == j else f"{todo[i]}-{todo[j]}")
        i = j + 1
    return ",".join(out)


def detail_name(ranks: Iterable[int] | None, keep: str | None = None) -> str:
    """The default output of a detail merge: ``merged_ranks0-7,512.pftrace``, with the
    ``Keep`` label when it keeps some steps or a window (``merged_ranks0-7_steps3-4.pftrace``,
    ``merged_steps3-4.pftrace`` for every rank)."""
    parts = ([f"ranks{format_ranks(ranks)}"] if ranks is not None else []) + (
        [keep] if keep else [])
    return f"merged_{'_'.join(parts)}.pftrace"


def load_selected(run_dir: str | os.PathLike[str], ranks: list[int]) -> Run:
    """The selected ranks' inputs; every rank the run dir has nothing of is named in one error."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise SourceError(str(run_dir), "not a directory")
    inputs, problems, missing = {}, [], []
    for rank in ranks:
        try:
            inputs[rank], found = load_rank(run_dir, rank)
        except SourceError:
            missing.append(rank)
            continue
        problems.extend(found)
    if missing:
        raise SourceError(str(run_dir), f"--ranks: rank(s) {format_ranks(missing)} not in this "
                                        "run (no record and no trace)")
    return Run(run_dir=run_dir, ranks=inputs, world_size=None, problems=problems)


def suggestion(run_dir: str | os.PathLike[str], instances: Iterable[Any]) -> str | None:
    """The command that merges the worst straggler with its peers, ready to paste: the rank
    whose late arrivals cost the most skew, and the ranks of the smallest group it was late in
    (``instances``: the review's, with ``straggler``, ``skew_ns`` and ``ranks``)."""
    cost: dict[int, int] = defaultdict(int)
    groups: dict[int, tuple[int, ...]] = {}
    for inst in instances:
        if inst.straggler is None:
            continue
        cost[inst.straggler] += inst.skew_ns
        known = groups.get(inst.straggler)
        if known is None or len(inst.ranks) < len(known):
            groups[inst.straggler] = tuple(inst.ranks)
    if not cost:
        return None
    worst = max(cost, key=lambda r: (cost[r], -r))
    return f"commviz merge {run_dir} --ranks {format_ranks([worst, *groups[worst]])}"
