"""The per-config proof of a launched GPU run: is every NCCL kernel named, rightly, and does
every record agree with torch's own Flight Recorder?

Usage: python scripts/gpu_proof.py RUN_DIR[=EAGER_RUN_DIR] ...

Per run dir (a ``commviz launch`` run with ``TORCH_FR_BUFFER_SIZE`` set, so each rank left
``flight_recorder/rank_{R}``), one row:
- ``kernels``: NCCL kernels in the ranks' profiler traces (eager and graphed);
- ``named``: those in ``merged.pftrace`` that carry commviz's metadata (``commviz.op`` and
  every eager key), ``SendRecv`` included;
- ``conflicts``: eager kernels whose profiler keys disagree with the record commviz matched
  to them (the matcher's own conflict list);
- ``graph_diff``: with ``=EAGER_RUN_DIR`` (the same config with ``cuda_graphs: false``),
  graphed kernels whose metadata (the eager keys) is not the eager run's, per rank and group:
  the graphed run's kernels per replay against the eager run's per step, as multisets;
- ``fr_diff``: records that differ from the Flight Recorder dump (number, op, sizes, dtype,
  ranks; ``tests/fr_compare.py``), ``p2p_diff``: p2p records whose ``commviz.fr_p2p_seq`` is
  not the dump's ``p2p_seq_id`` (of ``p2p_checked`` compared: NCCL's recorder keeps p2p
  entries, gloo's none);
- ``no_origin``: records without ``commviz.origin``; ``verify``: ``commviz verify``'s verdict;
- ``ddp_buckets`` / ``ddp_buckets_named``: records of a DDP bucket / those naming its parameters;
- ``lanes``: comm lanes in the merged trace (all ranks); ``lane_diff``: per rank, groups whose
  lanes are not exactly one lane per group it has collectives in, or whose lane shows ranks other
  than the group's own in torch's Flight Recorder dump (``pg_config``) or a group the rank is not
  in; ``links``: cross-rank links between comm lanes; ``link_diff``: those joining slices of
  different groups, or a rank outside the group's ranks in its dump.
Exits 1 when any count that must be 0 is not.
"""

from __future__ import annotations

import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import fr_compare  # noqa: E402  (tests/: the Flight Recorder comparison the tests use)

from commviz import metadata as md  # noqa: E402
from commviz.errors import CommvizError  # noqa: E402
from commviz.review.analyses import flightrec  # noqa: E402
from commviz.match import match_run  # noqa: E402
from commviz.record.store import loads_plain  # noqa: E402
from commviz.kernels import parse_nccl  # noqa: E402
from commviz.trace.run import load_run  # noqa: E402
from commviz.verify import read_slices  # noqa: E402

MUST_BE_ZERO = ("missing", "conflicts", "graph_diff", "fr_diff", "p2p_diff", "no_origin",
                "lane_diff", "link_diff")


def _nccl_kernels(run: Any) -> int:
    return sum(1 for item in run.ranks.values() for t in item.load_traces(run.problems)
               for e in t.events if e.get("cat") == "kernel" and parse_nccl(e.get("name", "")))


def _merged(run_dir: Path) -> tuple[list[Any], bool]:
    """Every slice of the merged trace (read once: it is the slow part), verify's ok."""
    slices, report = read_slices(run_dir / "merged.pftrace")
    return slices, report.ok


def _kernels(slices: list[Any]) -> list[Any]:
    """The NCCL kernel slices of the merged trace (not the comm lanes' copies)."""
    return [s for s in slices if s.name and parse_nccl(s.name)
            and not s.track.startswith(("PG ", "summary")) and not s.instant]


def _named(s: Any) -> bool:
    return md.OP in s.args and all(k in s.args for k in md.EAGER_KEYS)


def _identity(s: Any) -> tuple:
    return tuple(str(s.args.get(k)) for k in md.EAGER_KEYS)


def _per_unit(kernels: list[Any], graphed: bool) -> dict[tuple[str, str], Counter]:
    """Per (rank's process, group): the kernels' identities, per replay (graphed) or over
    the whole profiled run (eager: ``_graph_diff`` divides by the profiled steps)."""
    out: dict[tuple[str, str], Counter] = {}
    units: dict[tuple[str, str], set] = {}
    for s in kernels:
        if (md.REPLAY in s.args) != graphed:
            continue
        key = (s.process, str(s.args.get(md.PG_NAME)))
        out.setdefault(key, Counter())[_identity(s)] += 1
        units.setdefault(key, set()).add(s.args.get(md.REPLAY))    # a step's replays share it
    return {k: Counter({i: n / len(units[k]) for i, n in c.items()}) if graphed else c
            for k, c in out.items()}


def _graph_diff(graphed: list[Any], eager: list[Any], eager_steps: int) -> int:
    """Graphed kernels whose identity the eager run lacks, or whose count per replay differs."""
    g, e = _per_unit(graphed, True), _per_unit(eager, False)
    bad = 0
    for key, per_replay in g.items():
        per_step = e.get(key, Counter())
        for ident, n in per_replay.items():
            if abs(n - per_step[ident] / eager_steps) > 1e-9:
                bad += sum(1 for s in graphed if (s.process, str(s.args.get(md.PG_NAME))) == key
                           and _identity(s) == ident and md.REPLAY in s.args)
    return bad


def _flight_recorder(run_dir: Path, run: Any) -> tuple[int, int, int, int]:
    """(records differing from the dump, p2p numbers differing, p2p numbers compared, dumps
    read). A dump without p2p entries (gloo's recorder keeps none) compares no p2p."""
    fr_diff = p2p_diff = p2p_checked = dumps = 0
    for rank, item in sorted(run.ranks.items()):
        path = flightrec.dump_path(run_dir, rank)
        if not path.is_file() or item.record is None:
            continue
        dumps += 1
        dump = loads_plain(path.read_bytes(), str(path))   # torch's dump: plain data only
        snap = fr_compare.from_dump(dump, item.record["collectives"])
        problems, _ = fr_compare.differences(snap)
        fr_diff += len(problems)
        for p in problems[:5]:
            print(f"  rank {rank}: {p}", file=sys.stderr)
        if not any(e["p2p"] for e in snap["fr"]):
            continue
        try:
            pairs = fr_compare.p2p_pairs(snap)
        except AssertionError as exc:             # the p2p ops themselves differ
            print(f"  rank {rank}: p2p ops differ from Flight Recorder: {exc}", file=sys.stderr)
            p2p_diff += 1
            continue
        p2p_diff += sum(e["p2p_seq"] != r.get(md.FR_P2P_SEQ) for e, r in pairs)
        p2p_checked += len(pairs)
    return fr_diff, p2p_diff, p2p_checked, dumps


def _torch_groups(run_dir: Path, run: Any) -> dict[int, dict[str, list[int]]]:
    """Per rank, its process groups as torch knows them: pg name -> ranks, from the rank's
    Flight Recorder dump (``pg_config``)."""
    out = {}
    for rank in run.ranks:
        path = flightrec.dump_path(run_dir, rank)
        if path.is_file():
            config = loads_plain(path.read_bytes(), str(path)).get("pg_config", {})
            out[rank] = {name: json.loads(c["ranks"]) for name, c in config.items()}
    return out


_RANK = re.compile(r"^rank (\d+) ")


def _lanes_and_links(run_dir: Path, run: Any, slices: list[Any]) -> dict[str, int]:
    """Each rank's comm lanes against its groups, and every cross-rank link against the groups
    (torch's own account of them: the Flight Recorder dumps' ``pg_config``)."""
    groups = _torch_groups(run_dir, run)
    lanes: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    used: dict[int, set[str]] = defaultdict(set)
    flows: dict[int, list[Any]] = defaultdict(list)
    lane_diff = 0
    for s in slices:
        m = _RANK.match(s.process)
        if m is None:
            continue
        rank, pg = int(m.group(1)), s.args.get(md.PG_NAME)
        if s.track.startswith("PG ") and pg is not None:
            lanes[rank][str(pg)].add(s.track)
            for fid in s.flow_ids:
                flows[fid].append((rank, str(pg)))
        elif pg is not None and parse_nccl(s.name or ""):
            used[rank].add(str(pg))
    for rank, by_group in lanes.items():
        known = groups.get(rank, {})
        for pg, tracks in by_group.items():
            shown = {t.partition("ranks ")[2].split(" ·")[0] for t in tracks}
            if len(tracks) != 1 or pg not in known or rank not in known[pg] \
                    or shown != {str(known[pg])}:
                lane_diff += 1
                print(f"  rank {rank}: group {pg}: lanes {sorted(tracks)}, torch: "
                      f"{known.get(pg)}", file=sys.stderr)
        lane_diff += len(used[rank] - set(by_group))
    links = link_diff = 0
    for points in flows.values():
        if len({r for r, _ in points}) < 2:
            continue
        links += 1
        pgs = {pg for _, pg in points}
        if len(pgs) != 1 or any(r not in groups.get(r, {}).get(pg, ()) for r, pg in points):
            link_diff += 1
    return {"lanes": sum(len(v) for v in lanes.values()), "lane_diff": lane_diff,
            "links": links, "link_diff": link_diff}


def prove(run_dir: Path, eager_dir: Path | None) -> dict[str, Any]:
    run = load_run(run_dir)
    records = [r for item in run.ranks.values() if item.record is not None
               for r in item.record["collectives"]]
    matches = match_run(run)
    slices, ok = _merged(run_dir)
    kernels = _kernels(slices)
    row: dict[str, Any] = {
        "run": run_dir.name,
        "kernels": _nccl_kernels(run),
        "eager": sum(md.REPLAY not in s.args for s in kernels),
        "graphed": sum(md.REPLAY in s.args for s in kernels),
        "named": sum(_named(s) for s in kernels),
        "sendrecv": sum("SendRecv" in s.name for s in kernels),
        "sendrecv_named": sum("SendRecv" in s.name and _named(s) for s in kernels),
        "conflicts": sum(len(m.conflicts) for m in matches.values()),
        "records": len(records),
        "no_origin": sum(not r.get(md.ORIGIN) for r in records),
        "ddp_buckets": sum(md.DDP_BUCKET in r for r in records),
        "ddp_buckets_named": sum(md.DDP_BUCKET_PARAMS in r for r in records),
        "verify": "OK" if ok else "PROBLEMS",
    }
    row["missing"] = row["kernels"] - row["named"]
    if eager_dir is not None:
        eager_kernels = _kernels(_merged(eager_dir)[0])
        row["graph_diff"] = _graph_diff(kernels, eager_kernels, _active_steps(eager_dir))
        row["eager_twin"] = eager_dir.name
    row["fr_diff"], row["p2p_diff"], row["p2p_checked"], row["fr_dumps"] = \
        _flight_recorder(run_dir, run)
    row["p2p_records"] = sum(r.get(md.KIND) == "p2p" for r in records)
    row.update(_lanes_and_links(run_dir, run, slices))
    return row


def _config(run_dir: Path) -> Any:
    import yaml

    return yaml.safe_load((run_dir / "config.yaml").read_text())


def _active_steps(run_dir: Path) -> int:
    p = _config(run_dir)["profile"]
    return int(p["active"]) * max(1, int(p.get("repeat") or 1))


def main(argv: list[str]) -> int:
    rows = []
    for arg in argv:
        graphed, _, eager = arg.partition("=")
        try:
            rows.append(prove(Path(graphed), Path(eager) if eager else None))
        except CommvizError as exc:         # a launch that left no run: its row says why
            rows.append({"run": Path(graphed).name, "error": str(exc)})
        print(json.dumps(rows[-1]), flush=True)
    bad = [(r["run"], "error", r["error"]) for r in rows if "error" in r]
    rows = [r for r in rows if "error" not in r]
    bad += [(r["run"], k, r[k]) for r in rows for k in MUST_BE_ZERO if r.get(k)]
    bad += [(r["run"], "verify", r["verify"]) for r in rows if r["verify"] != "OK"]
    bad += [(r["run"], "fr_dumps", 0) for r in rows if not r["fr_dumps"]]
    for b in bad:
        print("NOT PROVEN:", *b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
