"""Issue 33's verdict on 4 ranks where the groups chain, on gloo (CPU), as a user launches them.

Every scenario of ``tests/jobs/broken_mesh.py`` is launched at once (``commviz launch
tests/jobs/broken_mesh.yaml --set job.backend=gloo --set job.timeout_s=30 --set
workload.args.sleep_s=60 --hang-after 6``), 4 ranks each; ``commviz status`` is asked while the
hang goes on. The checks are ``tests/mesh_verdict.py``'s, as on NCCL
(``test_gpu_verdict_4x.py``, ``test_verdict_mesh_fixtures.py``), where they apply on gloo: a
gloo call blocks in Python until its peers come or its timeout, so nothing is "enqueued"; a rank
that gets an all_to_all's splits wrong raises at once (gloo's alltoallv enforces
``inLengthPerRank[myRank] == outLengthPerRank[myRank]``).

What is expected comes from the scenario and from torch: its Flight Recorder's dumps and its
analyzer on them. gloo's dumps keep the collectives (every entry "scheduled") but no group
table and no transfer: the table is filled from the dumps' own entries (``gloo_flight``), and
the pipeline's transfers are the scenario's alone. Never from commviz.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from math import prod
from pathlib import Path

import pytest

import mesh_verdict as mv
from fr_compare import fr_entries, fr_findings
from nccl_verdict import Flight, launch_all, launch_verdict, unrecorded

from commviz.review.analyses import flightrec
from commviz.review.render.verdict_text import verdict_text

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
GLOO = ("--set", "job.backend=gloo", "--set", "job.timeout_s=30",
        "--set", "workload.args.sleep_s=60", "--hang-after", "6")
A2A_SEQ = 2 * mv.AT_STEP                 # each step: the counts exchange, then the dispatch
KEPT = Path(__file__).parent / "fixtures" / "gloo-mesh"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mesh_gloo")
    codes = launch_all(root, mv.CASES, *GLOO, config=mv.CONFIG,
                       status_after_s=mv.STATUS_AFTER_S)
    assert all(codes[c] != 0 for c in mv.CASES), codes
    return root


@pytest.fixture(scope="module")
def flights(runs: Path) -> dict[str, Flight]:
    """Each run's Flight Recorder, read once (its analyzer takes seconds)."""
    return {case: gloo_flight(runs / case, runs / f"fr_{case}") for case in mv.CASES}


def gloo_flight(run_dir: Path, scratch: Path) -> Flight:
    """torch's Flight Recorder on a gloo run: its dumps, their group table (which gloo leaves
    empty) filled from their own entries (each group's name and description, and the ranks
    whose entries name it), and its analyzer's findings on them."""
    scratch.mkdir(parents=True, exist_ok=True)
    dumps = {int(p.name.removeprefix(flightrec.PREFIX)): pickle.loads(p.read_bytes())
             for p in flightrec.folder(run_dir).glob(f"{flightrec.PREFIX}*")}
    groups: dict[str, tuple[str, set[int]]] = {}
    for rank, dump in dumps.items():
        for e in dump["entries"]:
            name, desc = e["process_group"]
            groups.setdefault(name, (desc, set()))[1].add(rank)
    for rank, dump in dumps.items():
        dump = dict(dump, pg_config={name: {"name": name, "desc": desc, "ranks": str(sorted(rs))}
                                     for name, (desc, rs) in groups.items()})
        (scratch / f"fr_rank{rank}").write_bytes(pickle.dumps(dump))
    findings = fr_findings(scratch, scratch / "db.pkl") if groups else None
    return Flight(findings, fr_entries(scratch), dumps)


@pytest.mark.parametrize("case", mv.CASES)
def test_verdict_agrees_with_flight_recorder(runs: Path, flights: dict[str, Flight],
                                             case: str) -> None:
    fl = flights[case]
    if case == "pp_raise":           # gloo's recorder keeps no transfer: nothing to line up
        assert fl.findings is None and not any(fl.entries.values()), fl.entries
    mv.check_agrees_with_flight_recorder(case, launch_verdict(runs / case), fl)


@pytest.mark.parametrize("case", mv.CASES)
def test_verdict_names_the_culprit_and_where_it_was(runs: Path, case: str) -> None:
    mv.check_verdict(case, launch_verdict(runs / case), runs / case)


@pytest.mark.parametrize("case", mv.CASES)
def test_told_live_and_printed(runs: Path, case: str) -> None:
    v = launch_verdict(runs / case)
    mv.check_live(case, runs / case)
    mv.check_printed(case, v, runs / case)


@pytest.mark.parametrize("case", mv.CASES)
def test_nothing_recorded_is_lost(runs: Path, flights: dict[str, Flight], case: str) -> None:
    """Every Flight Recorder entry has its record, with the same op, sizes and group."""
    fl = flights[case]
    assert fl.dumps and unrecorded(runs / case, fl.dumps) == {r: [] for r in fl.dumps}


def test_uneven_splits_told_and_in_the_desync_table(runs: Path, flights: dict[str, Flight],
                                                    tmp_path: Path) -> None:
    check_uneven_splits(runs / "a2a_splits", flights["a2a_splits"], tmp_path)


def test_uneven_splits_where_ranks_were_torn_down_inside_the_all_to_all(tmp_path: Path) -> None:
    """A run of the same scenario (``fixtures/gloo-mesh/a2a_splits-held``, kept from a loaded
    2-core machine) in which ranks 2 and 3 were torn down inside the dispatch before gloo's
    error reached them: their records have it begun, never returned. They made the call, so
    the desync is still the sizes, rank 1 on its own side, not ranks 2 and 3 "missing"."""
    run = shutil.copytree(KEPT / "a2a_splits-held", tmp_path / "run")   # nothing written there
    check_uneven_splits(run, gloo_flight(run, tmp_path / "fr"), tmp_path)


def check_uneven_splits(run: Path, fl: Flight, tmp_path: Path) -> None:
    """The dispatch of step 5: gloo's enforce on rank 1 (its failure file), torch's analyzer
    finds the totals of that all_to_all disagree; the verdict shows each rank's totals (its
    Flight Recorder entry's sizes) and the report's desync table the same collective, rank 1
    on a side of its own."""
    failed = json.loads((run / "logs" / "failed_rank1.json").read_text())
    assert "inLengthPerRank[myRank] == outLengthPerRank[myRank]" in failed["error"], failed
    assert fl.findings is not None and ("default_pg", A2A_SEQ) in fl.findings, fl.findings
    v = launch_verdict(run)
    assert v is not None and v.root is not None
    for rank, entries in fl.entries.items():
        (e,) = [e for e in entries if e["collective_seq_id"] == A2A_SEQ]
        sig = v.root.calls[rank].signature
        assert (sig.in_total, sig.out_total) == (prod(e["input_sizes"][0]),
                                                 prod(e["output_sizes"][0])), verdict_text(v)
    got = subprocess.run([sys.executable, "-m", "commviz", "report", str(run), "--no-plots",
                          "--format", "json", "-o", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stdout + got.stderr
    (desync,) = json.loads((tmp_path / "r.json").read_text())["desyncs"]
    assert (desync["pg_desc"], desync["seq"], desync["kind"]) == ("default_pg", A2A_SEQ, "size")
    assert [mv.BAD] in [s["ranks"] for s in desync["sides"]], desync
