"""Desyncs: collective sequences that differ across the ranks of a process group.

Like the flight recorder's analyzer, each group's collectives are lined up by sequence number
on every rank that has data, and the first sequence number where the ranks disagree is
reported, with the ranks on each side. What is compared per collective: its type (the
torch.distributed function), its sizes (in/out elements), its dtype, and its root and
reduction. An all_to_all's uneven splits differ across ranks by design: they are compared
pairwise instead (``split_mismatch``: rank i's input split for j must be rank j's output split
for i), and a rank whose splits its peers' do not match is a ``size`` desync. The kinds:

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
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NamedTuple, Sequence

from commviz import metadata as md
from commviz.metadata import StrEnum
from commviz.match.model import CommEvent
from commviz.merge.select import format_ranks

# How many steps ahead a skip or a reorder is looked for, and confirmed over.
LOOKAHEAD = 8


# the collectives whose splits may be uneven: the list form's splits are its tensors' numels, the
# single tensor's are rows of dim 0 (as the profiler records them)
ALL_TO_ALL = frozenset({"all_to_all", "all_to_all_single"})


@dataclass(frozen=True, slots=True)
class Sizes:
    """One rank's own side of an all_to_all, not compared across its ranks (their uneven splits
    differ by design: ``split_mismatch`` pairs them up): its totals and splits."""

    uneven: bool
    in_total: int | None = None
    out_total: int | None = None
    in_split: tuple[int, ...] | None = None    # (): split evenly; None: not recorded
    out_split: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Signature:
    """What must agree across the ranks of one collective (the compared fields), and, for an
    all_to_all, this rank's own ``sizes``."""

    op: str
    in_nelems: int | None                # None: not compared (uneven splits, the root's side)
    out_nelems: int | None
    dtype: str | None
    root: int | None
    reduce_op: str | None
    sizes: Sizes | None = field(default=None, compare=False)

    @property
    def uneven(self) -> bool:
        return self.sizes is not None and self.sizes.uneven

    @property
    def in_total(self) -> int | None:
        return self.sizes.in_total if self.sizes is not None else self.in_nelems

    @property
    def out_total(self) -> int | None:
        return self.sizes.out_total if self.sizes is not None else self.out_nelems

    def shared(self) -> Signature:
        """What every rank of the collective has alike: without this rank's uneven splits."""
        if not self.uneven:
            return self
        return Signature(self.op, self.in_nelems, self.out_nelems, self.dtype, self.root,
                         self.reduce_op, Sizes(uneven=True))

    def _sizes(self) -> str:
        z = self.sizes
        if z is None or not z.uneven:
            return f"{self.in_nelems}->{self.out_nelems} elems"
        if z.in_total is None and z.out_total is None:
            return "uneven splits"
        return (f"{z.in_total}->{z.out_total} elems, split {_split(z.in_split)}->"
                f"{_split(z.out_split)}")

    def __str__(self) -> str:
        parts = [f"{self.dtype}", self._sizes()]
        if self.root is not None:
            parts.append(f"root {self.root}")
        if self.reduce_op is not None:
            parts.append(self.reduce_op)
        return f"{self.op}({', '.join(parts)})"


def signature(ev: CommEvent) -> Signature:
    return signature_of(ev.op, ev.args)


# rooted collectives whose one side only the root has: scatter's input, gather's output
_ROOT_ONLY_IN, _ROOT_ONLY_OUT = frozenset({"scatter"}), frozenset({"gather"})


def _split(split: tuple[int, ...] | None) -> str:
    return "?" if split is None else str(list(split)) if split else "even"


def _parse_split(value: Any) -> tuple[int, ...] | None:
    """A recorded split ("[2, 4]"; "[]": even) as ints; None where none was recorded."""
    return None if value is None else md.group_ranks(value)


def signature_of(op: str, a: Mapping[str, Any]) -> Signature:
    """What must agree across the ranks of one collective, from its metadata (``a``): not the
    sizes of uneven splits (kept apart, for ``split_mismatch``), nor the side of a scatter or
    gather only its root has."""
    in_s, out_s = a.get(md.IN_SPLIT), a.get(md.OUT_SPLIT)
    uneven = in_s not in ("[]", None) or out_s not in ("[]", None)
    sizes = Sizes(uneven, a.get(md.IN_NELEMS), a.get(md.OUT_NELEMS), _parse_split(in_s),
                  _parse_split(out_s)) if uneven or op in ALL_TO_ALL else None
    return Signature(
        op=op, in_nelems=None if uneven or op in _ROOT_ONLY_IN else a.get(md.IN_NELEMS),
        out_nelems=None if uneven or op in _ROOT_ONLY_OUT else a.get(md.OUT_NELEMS),
        dtype=a.get(md.DTYPE), root=a.get(md.ROOT), reduce_op=a.get(md.REDUCE_OP), sizes=sizes)


class SplitMismatch(NamedTuple):
    """An all_to_all whose ranks' splits do not pair up: what rank i sends to j (its input
    split for j) must be what j takes from i (its output split for i)."""

    pairs: tuple[tuple[int, int], ...]   # (sender, receiver) whose two sides differ
    culprits: tuple[int, ...]            # in every such pair; else in the most of them
    detail: str


def _side(sig: Signature, inbound: bool) -> tuple[tuple[int, ...] | None, int | None]:
    """One side's split and total (what it takes, ``inbound``, or what it sends)."""
    z = sig.sizes or Sizes(False)
    return (z.out_split, z.out_total) if inbound else (z.in_split, z.in_total)


def _elements(sig: Signature, inbound: bool, n: int) -> tuple[int, ...] | None:
    """One side's split in elements (None: not known)."""
    split, total = _side(sig, inbound)
    if split is None or total is None:
        return None
    if not split:
        return (total // n,) * n if total % n == 0 else None
    if len(split) != n:
        return None
    if sig.op == "all_to_all":           # the list form: each tensor's numel already
        return tuple(split)
    rows = sum(split)
    if rows == 0 or total % rows:
        return (0,) * n if total == 0 else None
    return tuple(s * (total // rows) for s in split)


def _in_units(elems: Sequence[int], sig: Signature, inbound: bool) -> str:
    """Element counts in the units the rank's own split is given in (rows of dim 0)."""
    split, total = _side(sig, inbound)
    row = total // sum(split) if sig.op != "all_to_all" and split and sum(split) and total \
        and total % sum(split) == 0 else 1
    if all(e % row == 0 for e in elems):
        return str([e // row for e in elems])
    return f"{list(elems)} elems"


def split_mismatch(sigs: Mapping[int, Signature], ranks: Sequence[int]) -> SplitMismatch | None:
    """Whether the uneven splits of one all_to_all (``sigs``: each member's call) pair up;
    ``ranks``: the group's members in group-rank order (the order splits index). None: they
    do, or what they are is not known on every member."""
    if len(ranks) < 2 or any(r not in sigs for r in ranks):
        return None
    calls = [sigs[r] for r in ranks]
    if not any(s.uneven for s in calls) or any(s.op not in ALL_TO_ALL for s in calls):
        return None
    n = len(ranks)
    sends = {r: _elements(sigs[r], False, n) for r in ranks}
    takes = {r: _elements(sigs[r], True, n) for r in ranks}
    if any(v is None for v in (*sends.values(), *takes.values())):
        return None
    at = {r: i for i, r in enumerate(ranks)}
    pairs = tuple((i, j) for i in ranks for j in ranks
                  if sends[i][at[j]] != takes[j][at[i]])          # type: ignore[index]
    if not pairs:
        return None
    culprits = tuple(r for r in ranks if all(r in p for p in pairs))
    if not culprits:
        count = Counter(r for p in pairs for r in set(p))
        top = max(count.values())
        culprits = tuple(r for r in ranks if count[r] == top)
    said = []
    for r in culprits:
        sig = sigs[r]
        into = [i for i, j in pairs if j == r]
        out_of = [j for i, j in pairs if i == r]
        if into and (len(into) > 1 or into != [r] or not out_of):
            theirs = [sends[i][at[r]] for i in ranks]             # type: ignore[index]
            split, total = _side(sig, True)
            said.append(f"rank {r} takes {_split(split)} (of {total} elems) from ranks "
                        f"{format_ranks(ranks)}, which send it {_in_units(theirs, sig, True)}")
        if out_of and (len(out_of) > 1 or out_of != [r] or not into):
            theirs = [takes[j][at[r]] for j in ranks]             # type: ignore[index]
            split, total = _side(sig, False)
            said.append(f"rank {r} sends {_split(split)} (of {total} elems) to ranks "
                        f"{format_ranks(ranks)}, which take {_in_units(theirs, sig, False)} "
                        "from it")
    return SplitMismatch(pairs, culprits, "; ".join(said))


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
        return (f"process group {md.pg_shown(self.pg)} ({self.group}) first differs at seq {self.seq} "
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
                (sig,) = found
                split = None if sig is None or sig.op not in ALL_TO_ALL else split_mismatch(
                    {r: by_rank[r][seq] for r in ranks}, sorted(members[pg]))
                if split is None:
                    continue
                out.append(_split_desync(pg, *desc[pg], seq, split, by_rank))
                break
            sides = sorted((Side(tuple(rs), sig) for sig, rs in found.items()),
                           key=lambda s: (-len(s.ranks), s.signature is None, s.ranks))
            if len(sides) == 1:          # every rank lacks it: a hole in all records, not a desync
                continue
            kind, detail = _classify(seq, sides, by_rank)
            out.append(Desync(pg=pg, pg_desc=desc[pg][0], seq=seq, kind=kind,
                              sides=tuple(sides), detail=detail, group=desc[pg][1]))
            break
    return out


def _split_desync(pg: str, pg_desc: str, group: str, seq: int, split: SplitMismatch,
                  by_rank: dict[int, dict[int, Signature]]) -> Desync:
    """An all_to_all whose splits do not pair up: the ranks that agree (their common
    signature), then each culprit with its own splits."""
    ranks = sorted(by_rank)
    agree = tuple(r for r in ranks if r not in split.culprits)
    sides = ([Side(agree, by_rank[agree[0]][seq].shared())] if agree else []) + [
        Side((r,), by_rank[r][seq]) for r in split.culprits]
    return Desync(pg=pg, pg_desc=pg_desc, seq=seq, kind=DesyncKind.SIZE, sides=tuple(sides),
                  group=group, detail=f"the splits do not pair up (what rank i sends to j must be what j "
                         f"takes from i): {split.detail}")
