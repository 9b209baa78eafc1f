"""Desyncs: collective sequences that differ across the ranks of a process group.

Like the flight recorder's analyzer, each group's collectives are lined up by sequence number
on every rank that has data, and the first sequence number where the ranks disagree is
reported, with the ranks on each side. What is compared per collective: its type (the
torch.distributed function), its sizes (in/out elements; not for ``all_to_allv``, whose
splits may differ by design), its dtype, and its root and reduction. The kinds:

- ``missing``: some ranks have no collective at that number (they stopped early, hung, or
  skipped one: then their later collectives line up with the others' one step on);
- ``order``: the ranks ran the same collectives in a different order;
- ``type`` / ``size`` / ``dtype`` / ``args``: the first field that differs.

Only the stretch every rank recorded is compared: a ring buffer that dropped its oldest
entries on one rank is not a desync. Nor is a missing record: a rank with no sequence-numbered
collective at all (its trace alone, without commviz's record) cannot be lined up, so it is left
out of the comparison rather than called "missing" (the merge names the missing record). p2p transfers are not sequence-numbered per group and
are left out.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from commviz import metadata as md
from commviz.metadata import StrEnum
from commviz.match.model import CommEvent

# How many steps ahead a skip or a reorder is looked for, and confirmed over.
LOOKAHEAD = 8


@dataclass(frozen=True, slots=True)
class Signature:
    op: str
    in_nelems: int | None
    out_nelems: int | None
    dtype: str | None
    root: int | None
    reduce_op: str | None

    def __str__(self) -> str:
        parts = [f"{self.dtype}", f"{self.in_nelems}->{self.out_nelems} elems"]
        if self.root is not None:
            parts.append(f"root {self.root}")
        if self.reduce_op is not None:
            parts.append(self.reduce_op)
        return f"{self.op}({', '.join(parts)})"


def signature(ev: CommEvent) -> Signature:
    return signature_of(ev.op, ev.args)


# rooted collectives whose one side only the root has: scatter's input, gather's output
_ROOT_ONLY_IN, _ROOT_ONLY_OUT = frozenset({"scatter"}), frozenset({"gather"})


def signature_of(op: str, a: Mapping[str, Any]) -> Signature:
    """What must agree across the ranks of one collective, from its metadata (``a``): not the
    sizes of uneven splits, nor the side of a scatter or gather only its root has."""
    uneven = a.get(md.IN_SPLIT, "[]") not in ("[]", None) or a.get(md.OUT_SPLIT, "[]") not in (
        "[]", None)
    return Signature(
        op=op, in_nelems=None if uneven or op in _ROOT_ONLY_IN else a.get(md.IN_NELEMS),
        out_nelems=None if uneven or op in _ROOT_ONLY_OUT else a.get(md.OUT_NELEMS),
        dtype=a.get(md.DTYPE), root=a.get(md.ROOT), reduce_op=a.get(md.REDUCE_OP))


@dataclass(frozen=True, slots=True)
class Side:
    ranks: tuple[int, ...]
    signature: Signature | None      # None: nothing at this sequence number


class DesyncKind(StrEnum):
    """How the ranks first differ (the module docstring says what each means)."""

    MISSING = "missing"
    ORDER = "order"
    TYPE = "type"
    SIZE = "size"
    DTYPE = "dtype"
    ARGS = "args"


@dataclass(frozen=True, slots=True)
class Desync:
    pg: str
    pg_desc: str
    seq: int
    kind: DesyncKind
    sides: tuple[Side, ...]          # largest side first
    detail: str
    group: str                       # how people name the group (``md.group_label``)

    @property
    def message(self) -> str:
        sides = "; ".join(f"ranks {list(s.ranks)}: {s.signature or 'nothing'}" for s in self.sides)
        return (f"process group {self.pg} ({self.group}) first differs at seq {self.seq} "
                f"[{self.kind}]: {sides}. {self.detail}")


def first_diff(a: Signature, b: Signature) -> DesyncKind:
    """The first field in which two signatures differ."""
    if a.op != b.op:
        return DesyncKind.TYPE
    if (a.in_nelems, a.out_nelems) != (b.in_nelems, b.out_nelems):
        return DesyncKind.SIZE
    if a.dtype != b.dtype:
        return DesyncKind.DTYPE
    return DesyncKind.ARGS


def _agrees(xs: dict[int, Signature], x0: int, ys: dict[int, Signature], y0: int) -> bool:
    """Whether ``xs`` from ``x0`` and ``ys`` from ``y0`` agree on the next LOOKAHEAD steps
    (where both have one), and at least one step is compared or both have run out."""
    compared = 0
    for i in range(LOOKAHEAD):
        x, y = xs.get(x0 + i), ys.get(y0 + i)
        if x is None or y is None:
            continue
        if x != y:
            return False
        compared += 1
    return compared > 0 or (x0 not in xs and y0 not in ys)


def _classify(seq: int, sides: list[Side], by_rank: dict[int, dict[int, Signature]]
              ) -> tuple[DesyncKind, str]:
    """Name the mismatch between the two largest sides: the first hypothesis that explains the
    next LOOKAHEAD steps wins (one collective differs, a reorder, one side skipped d)."""
    a, b = sides[0], sides[1]
    ra, rb = by_rank[a.ranks[0]], by_rank[b.ranks[0]]
    la, lb = list(a.ranks), list(b.ranks)
    if a.signature is None or b.signature is None:
        gone = la if a.signature is None else lb
        return DesyncKind.MISSING, (f"ranks {gone} have no collective numbered {seq} in this "
                                    "group: they stopped, hung or skipped before it")
    if _agrees(ra, seq + 1, rb, seq + 1):
        kind = first_diff(a.signature, b.signature)
        return kind, f"the {kind} differs; the collectives after it line up again"
    for k in range(1, LOOKAHEAD):
        window_a = [ra.get(seq + i) for i in range(k + 1)]
        window_b = [rb.get(seq + i) for i in range(k + 1)]
        if None in window_a or None in window_b:
            break
        if Counter(window_a) == Counter(window_b) and _agrees(ra, seq + k + 1, rb, seq + k + 1):
            return DesyncKind.ORDER, (f"the same {k + 1} collectives from seq {seq} on, in a "
                                      f"different order: ranks {la} run {a.signature} first, "
                                      f"ranks {lb} run {b.signature} first")
    for d in range(1, LOOKAHEAD + 1):
        if _agrees(rb, seq, ra, seq + d) and (seq + d) in ra:
            return DesyncKind.MISSING, (f"ranks {lb} skipped {d} collective(s) from seq {seq} "
                                        f"on ({a.signature} on ranks {la}); their later ones "
                                        "line up")
        if _agrees(ra, seq, rb, seq + d) and (seq + d) in rb:
            return DesyncKind.MISSING, (f"ranks {la} skipped {d} collective(s) from seq {seq} "
                                        f"on ({b.signature} on ranks {lb}); their later ones "
                                        "line up")
    kind = first_diff(a.signature, b.signature)
    return kind, f"the {kind} differs, and the collectives after it do not line up either"


def find_desyncs(events: Iterable[CommEvent], *, present: set[int] | None = None
                 ) -> list[Desync]:
    """The first mismatch of each process group (groups that agree are left out).

    ``present``: ranks the run has data for (default: those in ``events``); a member of a group
    that is present and has numbered collectives of other groups, but none of this one, is
    "missing" from the first one on. A rank with no numbered collective at all (no record:
    its trace alone, or nothing) cannot be lined up and is left out, never called missing.
    """
    seqs: dict[str, dict[int, dict[int, Signature]]] = defaultdict(lambda: defaultdict(dict))
    members: dict[str, set[int]] = defaultdict(set)
    desc: dict[str, tuple[str, str]] = {}       # pg -> its description and how it is named
    seen: set[int] = set()
    numbered: set[int] = set()
    for ev in events:
        seen.add(ev.rank)
        if ev.seq is None or ev.args.get(md.KIND, "collective") != "collective":
            continue
        numbered.add(ev.rank)
        seqs[ev.pg][ev.rank].setdefault(int(ev.seq), signature(ev))
        members[ev.pg].update(md.group_ranks(ev.args.get(md.PG_RANKS)))
        members[ev.pg].add(ev.rank)
        if ev.pg not in desc:
            d = ev.args.get(md.PG_DESC)
            desc[ev.pg] = (str(d or ""), md.group_label(d, ev.args.get(md.PG_RANKS)))
    present = seen if present is None else present
    out = []
    for pg in sorted(seqs, key=lambda p: (len(p), p)):
        by_rank = seqs[pg]
        ranks = sorted(r for r in members[pg] if r in present and r in numbered)
        for r in ranks:
            by_rank.setdefault(r, {})
        lo = max((min(s) for s in by_rank.values() if s), default=None)
        hi = max((max(s) for s in by_rank.values() if s), default=None)
        if lo is None or len(ranks) < 2:
            continue
        for seq in range(lo, hi + 1):
            found: dict[Signature | None, list[int]] = defaultdict(list)
            for r in ranks:
                found[by_rank[r].get(seq)].append(r)
            if len(found) == 1 and None not in found:
                continue
            sides = sorted((Side(tuple(rs), sig) for sig, rs in found.items()),
                           key=lambda s: (-len(s.ranks), s.signature is None, s.ranks))
            if len(sides) == 1:          # every rank lacks it: a hole in all records, not a desync
                continue
            kind, detail = _classify(seq, sides, by_rank)
            out.append(Desync(pg=pg, pg_desc=desc[pg][0], seq=seq, kind=kind,
                              sides=tuple(sides), detail=detail, group=desc[pg][1]))
            break
    return out
