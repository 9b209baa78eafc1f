"""Issue 33 on a real 4-rank gloo job where every rank sits in several groups
(``tests/jobs/groups_job.py``): the world, a named ``tp`` pair, and a group made with
``dist.new_group(ranks)`` and no description. Rank 1 sleeps before its unnamed group's 3rd
all_reduce: rank 3 waits in it, ranks 0 and 2 in the world's that follows, until gloo's timeout.

What is expected comes from torch and from the scenario: each group's name, description and
ranks as the job's torch gave them (``_get_process_group_name``, ``group_desc``,
``get_process_group_ranks``, written by every rank), torch's Flight Recorder dumps (which
collectives each rank entered), and which rank the scenario stops. Never from commviz's output.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from commviz.merge.select import parse_ranks
from commviz.verify import read_slices
from fr_compare import FR_ENV

JOBS = Path(__file__).parent / "jobs"
WORLD, BAD, AT = 4, 1, 3          # rank 1 breaks in its 3rd call: each group's collective #3
TIMEOUT_S = 4


def commviz_cli(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "commviz", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def hang(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("hang4")
    env = ", ".join(f"{k}: \"{v}\"" for k, v in FR_ENV.items())
    (base / "job.yaml").write_text(textwrap.dedent(f"""
        name: hang4
        job: {{nproc_per_node: {WORLD}, timeout_s: {TIMEOUT_S}, env: {{{env}}}}}
        groups:
          tp: {{size: 2}}
        workload:
          steps: 4
          entrypoint: groups_job:build
          args: {{how: stuck, rank: {BAD}, at: {AT}, sleep_s: 120, groups_dir: "{base}"}}
          pythonpath: ["{JOBS}"]
        output: {{dir: "{base / 'out'}", run_name: run}}
        """))
    got = commviz_cli("launch", str(base / "job.yaml"), cwd=base)
    run_dir = base / "out" / "run"
    assert got.returncode == 1, got.stdout + got.stderr        # the job hung, then timed out
    groups = {}
    for rank in range(WORLD):
        for g in json.loads((base / f"groups_rank{rank}.json").read_text()):
            groups[g["name"]] = g
    fr = {rank: pickle.loads((run_dir / "flight_recorder" / f"rank_{rank}").read_bytes())
          for rank in range(WORLD)}
    return {"run_dir": run_dir, "base": base, "launch": got.stdout, "groups": groups, "fr": fr}


def _label(g: dict[str, Any]) -> str:
    """How torch's group should be named to people: its description, else its ranks."""
    return g["desc"] if g["desc"] != "undefined" else f"ranks {g['ranks']}"


def _rows(text: str, section: str) -> list[dict[str, str]]:
    """A markdown table of the report, each row by its column headers."""
    lines = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0].splitlines()
    cells = [[c.strip() for c in ln.strip("|").split(" | ")] for ln in lines
             if ln.startswith("| ") and not ln.startswith("|---")]
    return [dict(zip(cells[0], row)) for row in cells[1:]]


def _entered(fr: dict[int, Any]) -> dict[int, set[tuple[str, int]]]:
    """rank -> (group name, collective number) of every collective torch's Flight Recorder
    saw it enter."""
    return {r: {(e["process_group"][0], e["collective_seq_id"]) for e in d["entries"]
                if not e.get("is_p2p")} for r, d in fr.items()}


def test_groups_without_a_description_are_named_by_their_ranks(hang) -> None:
    groups, run_dir = hang["groups"], hang["run_dir"]
    unnamed = [g for g in groups.values() if g["desc"] == "undefined"]
    assert len(unnamed) == 2 and sorted(len(g["ranks"]) for g in unnamed) == [2, 2]
    report = commviz_cli("report", str(run_dir), "--format", "markdown", "--no-plots",
                         "-o", str(hang["base"] / "r.md"), cwd=run_dir)
    md_text = (hang["base"] / "r.md").read_text()
    status = commviz_cli("status", str(run_dir), "--wait", "0.5", cwd=run_dir)
    assert report.returncode == 0 and status.returncode == 1, report.stderr + status.stdout
    verdict = hang["launch"][hang["launch"].index("VERDICT:"):]
    for text in (verdict, md_text, status.stdout):
        assert "undefined" not in text
    # the group the culprit never joined: its own name and ranks, as torch has them
    stuck = next(g for g in unnamed if BAD in g["ranks"])
    assert f"at group {stuck['name']} (ranks {stuck['ranks']}) seq {AT} " in verdict
    assert f"at group {stuck['name']} (ranks {stuck['ranks']}) seq {AT} " in status.stdout
    # the report's group table: every group by its name and label, with torch's own ranks
    table = {r["group"]: r["ranks"] for r in _rows(md_text, "Process groups")}
    assert table == {f"{g['name']} ({_label(g)})": ",".join(map(str, g["ranks"]))
                     for g in groups.values()}
    # the merged trace's lanes: a described group by its description, the others by number
    slices, check = read_slices(run_dir / "merged.pftrace")
    assert check.ok, check.errors[:5]
    lanes = {s.track for s in slices if s.track.startswith("PG ") and s.process}
    assert lanes == {f"PG {g['desc'] if g['desc'] != 'undefined' else g['name']} · ranks "
                     f"{g['ranks']}" for g in groups.values()}


def test_the_report_tells_the_verdicts_story(hang) -> None:
    """The culprit first in the ranks table, each waiting rank shown waiting on it where torch's
    Flight Recorder saw it enter a collective that a member of its group never entered."""
    groups, run_dir = hang["groups"], hang["run_dir"]
    entered = _entered(hang["fr"])
    # from Flight Recorder alone: per waiting rank, the collective it entered that some member
    # of its group never entered, and those members
    waits: dict[int, tuple[str, int, set[int]]] = {}
    for rank, seen in entered.items():
        for pg, seq in sorted(seen, key=lambda k: -k[1]):
            absent = {r for r in groups[pg]["ranks"] if (pg, seq) not in entered[r]}
            if absent:
                waits.setdefault(rank, (pg, seq, absent))
    assert BAD not in waits and set(waits) == set(range(WORLD)) - {BAD}, waits
    text = commviz_cli("report", str(run_dir), "--format", "markdown", "--no-plots",
                       "-o", str(hang["base"] / "story.md"), cwd=run_dir)
    assert text.returncode == 0, text.stderr
    story = (hang["base"] / "story.md").read_text()
    detail = next(ln for ln in story.splitlines() if ln.startswith("detail of"))
    assert BAD in parse_ranks(detail.rsplit("--ranks ", 1)[1]), detail
    rows = _rows(story, "Ranks")
    assert rows[0]["rank"] == str(BAD) and rows[0]["in the verdict"] == "culprit (hang)", rows
    by_rank = {int(r["rank"]): r["in the verdict"] for r in rows}
    for rank, (pg, seq, absent) in waits.items():
        said = by_rank[rank]
        g = groups[pg]
        assert said.startswith("waited ") and f" in {_label(g)}#{seq} all_reduce " in said, said
        named = {int(x) for x in said.rsplit("for rank(s) ", 1)[1].split(",")}
        assert named == absent and BAD in named, (rank, said, absent)
    # the instances a rank never entered: their late ranks are those that never came
    inst = _rows(story, "Collective instances")
    for row in inst:
        if row["missing ranks"] != "-":
            assert row["late rank"] == f"{row['missing ranks']} (never came)", row
            assert row["comm time"] in ("failed", "incomplete"), row
    got = commviz_cli("report", str(run_dir), "--format", "json", "--no-plots",
                      "-o", str(hang["base"] / "r.json"), cwd=run_dir)
    assert got.returncode == 0, got.stderr
    doc = json.loads((hang["base"] / "r.json").read_text())
    held = {r["rank"]: r["caused_ns"] for r in doc["rank_summaries"]}
    assert max(held, key=held.get) == BAD                      # it held the others up most
    # the verdict's own lines: what followed from the root names its culprit, no second root
    verdict = hang["launch"][hang["launch"].index("VERDICT:"):]
    assert "also hang" not in verdict, verdict
