"""Compare commviz's records with torch's own Flight Recorder, per group and op.

The expectation comes from torch (``TORCH_FR_BUFFER_SIZE`` set before the process group is
made, then ``torch._C._distributed_c10d._dump_fr_trace()``), never from commviz. A rank calls
``snapshot()`` at the end of its program and returns it; the test calls ``compare()``. A
torchrun job that leaves each rank's dump in a folder (``tests/jobs/fr_dump.py``) is read with
``fr_entries``, and judged by torch's own analyzer with ``fr_findings``.
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

FR_ENV = {"TORCH_FR_BUFFER_SIZE": "200000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "200000"}


def snapshot() -> dict[str, Any]:
    """This rank's Flight Recorder entries, group table and commviz records (plain data)."""
    import torch

    import commviz

    c10d = torch._C._distributed_c10d
    # NCCL keeps its own recorder (dumped by _dump_nccl_trace; TORCH_NCCL_TRACE_BUFFER_SIZE
    # in torch 2.11); gloo's is the generic one
    nccl = torch.distributed.get_backend() == "nccl" and hasattr(c10d, "_dump_nccl_trace")
    dump = pickle.loads(c10d._dump_nccl_trace() if nccl else c10d._dump_fr_trace())
    return from_dump(dump, commviz.RECORDER.records())


def from_dump(dump: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """``snapshot()``'s shape from a Flight Recorder dump (torch's pickle, as written to
    ``TORCH_FR_DUMP_TEMP_FILE``) and the same rank's commviz records."""
    entries = [{"group": e["process_group"][0], "desc": e["process_group"][1],
                "seq": e["collective_seq_id"], "p2p": bool(e.get("is_p2p")),
                "p2p_seq": e.get("p2p_seq_id"),
                "name": e["profiling_name"],
                "in": sum(_numel(s) for s in e["input_sizes"]),
                "out": sum(_numel(s) for s in e["output_sizes"]),
                "dtypes": list(e["input_dtypes"])} for e in dump["entries"]]
    groups = {str(name): {"ranks": _ranks(cfg.get("ranks")), "desc": cfg.get("desc")}
              for name, cfg in dump.get("pg_config", {}).items()}
    return {"fr": entries, "groups": groups, "records": records}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _ranks(value: Any) -> list[int]:
    if isinstance(value, str):
        return [int(x) for x in re.findall(r"-?\d+", value)]
    return [int(x) for x in value or []]


def _norm(name: str) -> str:
    """'gloo:all_reduce' -> 'allreduce'; commviz's 'all_reduce_coalesced' -> 'allreducecoalesced'."""
    return re.sub(r"[^a-z]", "", name.split(":")[-1].lower())


# gloo runs reduce_scatter_tensor as an all_reduce of the whole input (ProcessGroupGloo's
# _reduce_scatter_base), and Flight Recorder records that all_reduce: same number, same input,
# output the size of the input; its coalesced form too (functional reduce_scatter on gloo, as
# DTensor issues it: seen on torch 2.13). (op commviz records, name Flight Recorder gives it)
BACKEND_ALIASES = {("reduce_scatter_tensor", "allreduce"),
                   ("reduce_scatter_tensor_coalesced", "allreduce")}
# NCCL's Flight Recorder names the tensor collectives after c10d's base ops
NAME_ALIASES = {("all_gather_into_tensor", "allgatherbase"),
                ("reduce_scatter_tensor", "reducescatterbase")}
# gloo's Flight Recorder entry for allgather_into_tensor_coalesced (functional all_gather on
# gloo) gives as output one rank's chunk, the input's size, whatever the group's size (seen on
# torch 2.13 with 2 and 3 ranks: out 4 for a 4-element input both times): the output is that
# times the group's size.
CHUNK_OUTPUT = {("all_gather_into_tensor_coalesced", "allgather")}
# NCCL's Flight Recorder files scatter's tensors the other way round: the received chunk as
# its input, the root's scatter list as its output (torch 2.11, NCCL, 2 x H100); commviz, as
# the profiler, says input = what is sent.
SWAPPED_ON_NCCL = {"scatter"}
# NCCL runs a barrier as an all_reduce of one Float zero (ProcessGroupNCCL::barrier: Flight
# Recorder's "nccl:all_reduce_barrier", in 1, out 1, Float); the profiler's own keys for it
# (its RECORD_PARAM_COMMS: "barrier", 0 in, 0 out, Byte) and commviz's record say what the
# caller asked for, a barrier that sends nothing. (op commviz records, name Flight Recorder
# gives it): the entry's own sizes and dtype, the record's
NCCL_BARRIER = {("barrier", "allreducebarrier"): ((1, 1, "Float"), (0, 0, "Byte"))}
# gloo runs the list reduce_scatter as one all_reduce per rank of the group, each numbered:
# one commviz record stands for that many entries, each of the output's size.
PER_RANK = {"reduce_scatter"}


def compare(snap: dict[str, Any], *, ignore_ops: tuple[str, ...] = (),
            after: dict[str, int] | None = None) -> dict[str, Counter]:
    """``differences`` that must be none; returns its confirmed ops."""
    problems, counts = differences(snap, ignore_ops=ignore_ops, after=after)
    assert not problems, "\n".join(problems[:30])
    return counts


def differences(snap: dict[str, Any], *, ignore_ops: tuple[str, ...] = (),
                after: dict[str, int] | None = None) -> tuple[list[str], dict[str, Counter]]:
    """Where commviz's records and Flight Recorder's collectives differ (none: commviz recorded
    exactly the collectives Flight Recorder did).

    Per Flight Recorder entry (group, collective_seq_id): one commviz record with that group and
    ``commviz.seq``, an op whose name starts with Flight Recorder's, the same element counts
    in and out and the same dtype, and the group's ranks. No commviz collective without an
    entry (ops in ``ignore_ops`` excepted: those Flight Recorder does not record on gloo, such
    as ``monitored_barrier``). ``after``: per group, the last number torch gave before
    commviz started recording (those entries are not commviz's). Returns the differences and,
    per group, the commviz ops that Flight Recorder confirmed, counted (for checks on what a
    program issued).
    """
    recs = [r for r in snap["records"] if r.get("commviz.kind") == "collective"]
    by_key: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in recs:
        span = r["Group size"] if r["commviz.op"] in PER_RANK and \
            r.get("commviz.device") == "cpu" else 1
        for i in range(span):
            seq = r.get("commviz.seq")
            by_key.setdefault((r["Process Group Name"], None if seq is None else seq + i),
                              []).append(r)
    entries: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for e in snap["fr"]:
        # NCCL's end-of-coalescing entry shares the number of the ops it closes
        if (after or {}).get(e["group"], 0) >= e["seq"]:
            continue
        if not e["p2p"] and not e["name"].endswith(":coalesced"):
            entries.setdefault((e["group"], e["seq"]), []).append(e)
    problems = []
    seen: set[int] = set()
    counts: dict[str, Counter] = {}
    for key, group_entries in entries.items():
        found = by_key.get(key, [])
        if len(found) == 1 and found[0]["commviz.op"] in PER_RANK and \
                found[0].get("commviz.device") == "cpu":
            r = found[0]
            e = group_entries[0]
            if (e["in"], e["out"]) != (r["Out msg nelems"],) * 2:
                problems.append(f"FR {key}: part of {r['commviz.op']} with sizes "
                                f"{(e['in'], e['out'])}")
            if id(r) not in seen:
                seen.add(id(r))
                counts.setdefault(key[0], Counter())[r["commviz.op"]] += 1
            continue
        if len(found) != len(group_entries):
            problems.append(f"FR {key} {[e['name'] for e in group_entries]}: "
                            f"{len(found)} records")
            continue
        for e, r in zip(group_entries, found):      # coalesced ops share a number: in order
            seen.add(id(r))
            counts.setdefault(key[0], Counter())[r["commviz.op"]] += 1
            problems += _differences(e, r, snap["groups"].get(e["group"]))
    # NCCL's Flight Recorder keeps no entry for a call made under CUDA graph capture (torch
    # 2.11): those records carry NCCL's own number (read after the call) and are checked below
    extra = [r for r in recs if id(r) not in seen and r["commviz.op"] not in ignore_ops
             and not (r.get("commviz.captured") and r.get("commviz.device") == "cuda")]
    problems += [f"commviz {r['Process Group Name']}#{r.get('commviz.seq')} {r['commviz.op']} "
                 f"has no Flight Recorder entry" for r in extra]
    return problems, counts


def p2p_pairs(snap: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Per group, Flight Recorder's p2p entries beside commviz's p2p records (captured ones
    too: torch 2.11's NCCL recorder keeps p2p calls made under capture), in order, after
    checking that both list the same ops (direction and element count): the pairs whose
    numbers a test compares (FR's ``p2p_seq_id``, commviz's ``commviz.fr_p2p_seq``)."""
    entries: dict[str, list[dict[str, Any]]] = {}
    for e in snap["fr"]:
        if e["p2p"]:
            entries.setdefault(e["group"], []).append(e)
    recs: dict[str, list[dict[str, Any]]] = {}
    for r in snap["records"]:      # NCCL's recorder keeps p2p calls made under graph capture too
        if r.get("commviz.kind") == "p2p":
            recs.setdefault(r["Process Group Name"], []).append(r)
    assert entries.keys() == recs.keys(), (sorted(entries), sorted(recs))
    pairs = []
    for group, group_entries in entries.items():
        ops = [(_norm(e["name"].split(" ")[0]), e["in"]) for e in group_entries]
        mine = [(r["commviz.op"], r["In msg nelems"]) for r in recs[group]]
        assert ops == mine, (group, ops, mine)
        pairs += zip(group_entries, recs[group])
    return pairs


def eval_ranks(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"-?\d+", text)]


def _differences(e: dict[str, Any], r: dict[str, Any], group: dict[str, Any] | None) -> list[str]:
    """What a commviz record says differently from its Flight Recorder entry."""
    where = f"FR {e['group']}#{e['seq']} {e['name']}"
    out = []
    if group and group["ranks"] and eval_ranks(r["Process Group Ranks"]) != group["ranks"]:
        out.append(f"{where}: ranks {r['Process Group Ranks']} != {group['ranks']}")
    barrier = NCCL_BARRIER.get((r["commviz.op"], _norm(e["name"])))
    if barrier is not None:
        entry, record = barrier
        if (e["in"], e["out"], (e["dtypes"] or [None])[0]) != entry or \
                (r["In msg nelems"], r["Out msg nelems"], r["dtype"]) != record:
            out.append(f"{where}: not NCCL's barrier: entry {(e['in'], e['out'], e['dtypes'])}, "
                       f"record {(r['In msg nelems'], r['Out msg nelems'], r['dtype'])}")
        return out
    aliased = (r["commviz.op"], _norm(e["name"])) in BACKEND_ALIASES
    named = (r["commviz.op"], _norm(e["name"])) in NAME_ALIASES
    if not (aliased or named or _norm(r["commviz.op"]).startswith(_norm(e["name"]))):
        out.append(f"{where} recorded as {r['commviz.op']}")
    if aliased and r["In msg nelems"] != e["in"]:
        out.append(f"{where}: input {r['In msg nelems']} != {e['in']}")
    elif (r["commviz.op"], _norm(e["name"])) in CHUNK_OUTPUT and r.get("commviz.device") == "cpu":
        expected = (e["in"], e["out"] * r["Group size"])
        if (r["In msg nelems"], r["Out msg nelems"]) != expected:
            out.append(f"{where}: sizes {(r['In msg nelems'], r['Out msg nelems'])} != {expected}")
    elif r["commviz.op"] in SWAPPED_ON_NCCL and r.get("commviz.device") == "cuda":
        if (r["In msg nelems"], r["Out msg nelems"]) != (e["out"], e["in"]):
            out.append(f"{where}: sizes {(r['In msg nelems'], r['Out msg nelems'])} != "
                       f"{(e['out'], e['in'])} (Flight Recorder's in and out swapped)")
    elif not aliased and (r["In msg nelems"], r["Out msg nelems"]) != (e["in"], e["out"]):
        out.append(f"{where}: sizes {(r['In msg nelems'], r['Out msg nelems'])} != "
                   f"{(e['in'], e['out'])}")
    if e["dtypes"] and r["dtype"] != e["dtypes"][0]:
        out.append(f"{where}: dtype {r['dtype']} != {e['dtypes'][0]}")
    return out


def fr_findings(fr_dir: Path, out: Path) -> dict[tuple[str, int], tuple[set[int], set[int]]]:
    """Flight Recorder's analyzer on the dumps: (group desc, seq) -> (missing ranks, ranks
    whose call mismatched), for every collective it did not pass."""
    subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                    str(fr_dir), "-p", "fr_rank", "--allow-incomplete-ranks", "-o", str(out)],
                   check=True, capture_output=True, timeout=120)
    _, db = pickle.loads(out.read_bytes())
    return {(c.pg_desc.split(":", 1)[-1], c.collective_seq_id):
            (set(c.missing_ranks or ()), set(c.mismatch_collectives or ()))
            for c in db.collectives if c.missing_ranks or not c.pass_check}


def fr_entries(fr_dir: Path) -> dict[int, list[dict]]:
    """Each rank's raw Flight Recorder entries (ranks that left no dump are absent)."""
    return {int(p.name.removeprefix("fr_rank")): pickle.loads(p.read_bytes())["entries"]
            for p in fr_dir.glob("fr_rank*")}
