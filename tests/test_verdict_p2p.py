"""Issue 23: the verdict on point-to-point transfers, on real gloo jobs (tests/jobs/p2p_job.py).

One torchrun job per scenario, all started at once (one module fixture). What is expected comes
from the scenario (which rank breaks, how, on which line of the job; each pair's 5th transfer of
16 floats) and from gloo's own words in the job's output (its timeout names the op a rank waited
in, its abort both sizes). torch's Flight Recorder keeps no point-to-point op on gloo (checked
below), so it speaks only for the chain scenario's subgroup collective, through its analyzer.
Never from commviz.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from fr_compare import FR_ENV, fr_entries, fr_findings
from harness import torchrun

from commviz.review.model.verdict import Call, CallState, FailureKind, Verdict
from commviz.review.analyses.judge import build_verdict
from commviz.review.render.verdict_text import verdict_json, verdict_text

JOB = Path(__file__).parent / "jobs" / "p2p_job.py"
RANKS = {"stuck": 2, "size": 2, "deadlock": 2, "raise": 2, "chain": 3}
N, AT = 16, 5                        # p2p_job.py: 16 floats; step 4 (0-based) is each pair's 5th
GLOO_TIMEOUT_S = 3
NBYTES = N * torch.float32.itemsize


def line_of(text: str) -> int:
    """The line of p2p_job.py that holds ``text`` (once)."""
    (n,) = [i for i, line in enumerate(JOB.read_text().splitlines(), 1) if text in line]
    return n


class Scenario(NamedTuple):
    run_dir: Path
    fr_dir: Path
    output: str                      # torchrun's and the ranks' stdout and stderr


@pytest.fixture(scope="module")
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Scenario]:
    base = tmp_path_factory.mktemp("p2p")

    def run(case: str) -> tuple[str, Scenario]:
        run_dir, fr_dir = base / case / "run", base / case / "fr"
        # a rank that torchrun stops while it writes its record at exit can hang there (a
        # signal-time flush waits on the lock the interrupted exit flush holds): torchrun's
        # SIGKILL then ends it after 3 s, not 30
        got = torchrun(["--shutdown-timeout=3", str(JOB), str(run_dir), str(fr_dir), case],
                       nproc=RANKS[case], env=FR_ENV, timeout=240)
        assert got.returncode != 0, got.stdout + got.stderr   # every scenario breaks the job
        return case, Scenario(run_dir, fr_dir, got.stdout + got.stderr)

    with ThreadPoolExecutor(len(RANKS)) as pool:
        return dict(pool.map(run, RANKS))


def verdict_of(s: Scenario) -> Verdict:
    v = build_verdict(s.run_dir)
    assert v is not None and v.root is not None
    return v


def transfer(call: Call) -> tuple[int, str, int | None, int]:
    """(rank, op, peer, number) of a transfer."""
    return call.rank, call.signature.op, call.peer, call.seq


def gloo_timeouts(output: str) -> dict[int, str]:
    """rank -> the op gloo says it timed out in ("recv", "send")."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(
        r"^\[rank(\d+)\]:.*Timed out waiting \d+ms for (\w+) operation", output, re.M)}


def test_a_rank_stuck_before_its_send(scenarios) -> None:
    """Rank 1 sleeps before its 5th send; rank 0, which sent its own 5th, waits in its receive
    until gloo's timeout. The verdict blames rank 1, says rank 0 waited in that receive, and
    where rank 1 was; rank 0's unreceived send is a second incident of the same culprit."""
    s = scenarios["stuck"]
    v = verdict_of(s)
    root = v.root
    assert (v.kind, v.culprits) == (FailureKind.HANG, (1,)), verdict_text(v)
    assert gloo_timeouts(s.output) == {0: "recv"}, s.output[-3000:]
    assert list(root.calls) == [0] and root.missing == (1,)
    waited = root.calls[0]
    assert transfer(waited) == (0, "recv", 1, AT) and waited.state is CallState.UNMATCHED
    assert waited.callsite == f"{JOB}:{line_of('dist.recv(buf[:N // 2]')}"
    assert v.ranks[0].waited_ns(waited) >= 0.9 * GLOO_TIMEOUT_S * 1e9
    stopped = v.ranks[1].stopped_at
    assert stopped is not None and Path(stopped.file) == JOB, verdict_text(v)
    assert stopped.line == line_of('bad and case == "stuck"') + 1
    assert "time.sleep(" in stopped.source()
    (also,) = v.others
    assert [transfer(c) for c in also.calls.values()] == [(0, "send", 1, AT)]
    assert also.missing == (1,) and also.culprits == (1,) and not v.consequences

    lines = verdict_text(v).splitlines()
    assert lines[0] == "VERDICT: hang - culprit rank(s) 1"
    assert lines[1].startswith(f"  at group 0 (default_pg) rank 0 recv←1 #{AT} {NBYTES} B Float: "
                               f"rank 1 never posted send→0 #{AT}"), lines
    assert lines[2].startswith("  rank 0 waited ") and \
        lines[2].endswith(f" s in it at {waited.callsite} (never matched)"), lines


def test_a_stuck_rank_in_the_report_json(scenarios, tmp_path: Path) -> None:
    """``commviz report --format json``: the root transfer with its channel, number, each
    posted side's call (label, call site) and how long rank 0 waited in it."""
    from commviz.review.render.report_formats import write_report

    s = scenarios["stuck"]
    doc = json.loads(write_report(s.run_dir, fmt="json", plots=False,
                                  out=tmp_path / "r.json").text)
    got = doc["verdict"]
    assert (got["kind"], got["culprits"]) == ("hang", [1])
    root = got["root"]
    assert (root["p2p"], root["seq"], root["missing"]) == ({"src": 1, "dst": 0}, AT, [1])
    call = root["calls"]["0"]
    assert call["label"] == f"default_pg recv←1 #{AT} {NBYTES} B Float"
    assert (call["op"], call["in_nelems"], call["state"]) == ("recv", N, "never matched")
    assert call["callsite"] == f"{JOB}:{line_of('dist.recv(buf[:N // 2]')}"
    assert root["waited_ns"]["0"] >= 0.9 * GLOO_TIMEOUT_S * 1e9
    assert "flight_recorder" not in root           # torch's recorder numbers no transfer here
    assert got == json.loads(json.dumps(verdict_json(verdict_of(s))))


def test_a_send_larger_than_its_receive(scenarios) -> None:
    """Rank 1 posts its 5th receive with half the elements; gloo aborts it when rank 0's 64
    bytes arrive for its 32 (its message says both). The verdict: a size mismatch of that
    transfer, rank 1 the culprit (its receive changed size, rank 0's send did not), stopped on
    that line; whatever rank 0 posted after it waits on rank 1, which is in the root."""
    s = scenarios["size"]
    v = verdict_of(s)
    root = v.root
    sent, room = map(int, re.search(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)",
                                    s.output).groups())
    assert (sent, room) == (NBYTES, NBYTES // 2)
    assert (v.kind, v.culprits) == (FailureKind.SIZE_MISMATCH, (1,)), verdict_text(v)
    assert root.channel is not None and (root.channel.src, root.channel.dst) == (0, 1)
    assert root.seq == AT and not root.missing
    send, recv = root.calls[0], root.calls[1]
    assert (transfer(send), transfer(recv)) == ((0, "send", 1, AT), (1, "recv", 0, AT))
    itemsize = torch.float32.itemsize
    assert (send.signature.in_nelems * itemsize, recv.signature.in_nelems * itemsize) == \
        (sent, room)
    assert f"rank 0 sends {sent} B Float, rank 1 receives {room} B Float" in root.why
    stopped = v.ranks[1].stopped_at
    assert stopped is not None and stopped.line == line_of("dist.recv(buf[:N // 2]")
    assert v.ranks[1].stacks is not None and v.ranks[1].stacks.fatal, verdict_text(v)
    for then in v.consequences:      # rank 0's later transfers, or its 5th receive if it failed
        assert then.cause is root and then.waits_on == (1,), verdict_text(v)
    assert not v.others, verdict_text(v)


def test_both_ranks_receive_first(scenarios) -> None:
    """At the 5th step both ranks receive before they send: each waits for the other. The
    verdict: a deadlock of both, naming both receives; neither is a mere waiter."""
    s = scenarios["deadlock"]
    v = verdict_of(s)
    assert set(gloo_timeouts(s.output).values()) == {"recv"}, s.output[-3000:]
    assert (v.kind, v.culprits) == (FailureKind.DEADLOCK, (0, 1)), verdict_text(v)
    (then,) = v.consequences
    assert then.cause is v.root and not v.others
    ops = {transfer(c) for i in (v.root, then) for c in i.calls.values()}
    assert ops == {(0, "recv", 1, AT), (1, "recv", 0, AT)}
    for r in (0, 1):
        stopped = v.ranks[r].stopped_at
        assert stopped is not None and stopped.line == line_of("dist.recv(buf, prv)"), \
            verdict_text(v)
    assert f"recv←1 #{AT}" in v.root.why and f"recv←0 #{AT}" in v.root.why
    assert verdict_text(v).startswith("VERDICT: deadlock - culprit rank(s) 0-1\n")


def test_a_rank_raises_before_its_send(scenarios) -> None:
    """Rank 1 raises before its 5th send: a crash of rank 1 at rank 0's 5th receive, with
    rank 1's raise line; rank 0, which waited, is not blamed."""
    s = scenarios["raise"]
    v = verdict_of(s)
    root = v.root
    assert (v.kind, v.culprits) == (FailureKind.CRASH, (1,)), verdict_text(v)
    assert [transfer(c) for c in root.calls.values()] == [(0, "recv", 1, AT)]
    assert root.missing == (1,) and "injected failure at step 4" in root.why
    stopped = v.ranks[1].stopped_at
    assert stopped is not None and stopped.line == line_of("raise RuntimeError("), verdict_text(v)
    assert all(i.culprits == (1,) for i in (root, *v.others, *v.consequences))


def test_a_transfer_waits_on_a_collective(scenarios) -> None:
    """3 ranks: rank 0 sleeps before the subgroup's 5th all_reduce; rank 1 waits in it, so it
    never sends to rank 2, whose 5th receive waits. Flight Recorder's analyzer finds rank 0
    missing from the subgroup's 5th collective; the verdict makes it the root (rank 0, the
    first rank, is the culprit) and rank 2's receive its consequence, across kinds."""
    s = scenarios["chain"]
    v = verdict_of(s)
    root = v.root
    findings = fr_findings(s.fr_dir, s.run_dir.parent / "db.pkl")
    assert findings[("sub", AT)][0] == {0}
    assert any(e["collective_seq_id"] == AT for e in fr_entries(s.fr_dir)[1])   # rank 1 in it
    assert (v.kind, v.culprits) == (FailureKind.HANG, (0,)), verdict_text(v)
    assert (root.channel, root.pg_desc, root.seq, root.missing) == (None, "sub", AT, (0,))
    (then,) = v.consequences
    assert then.cause is root and then.missing == (1,)
    assert [transfer(c) for c in then.calls.values()] == [(2, "recv", 1, AT)]
    assert [transfer(c) for i in v.others for c in i.calls.values()] == [(2, "send", 0, AT)]
    stopped = v.ranks[0].stopped_at
    assert stopped is not None, verdict_text(v)
    assert stopped.line == line_of('bad and case == "chain"') + 1, verdict_text(v)
    text = verdict_text(v)
    assert f"  then group 0 (default_pg) rank 2 recv←1 #{AT} {NBYTES} B Float: rank(s) 1 " \
           f"missing, waiting in group 1 (sub) seq {AT} all_reduce(" in text, text


def test_gloo_flight_recorder_keeps_no_transfer(scenarios) -> None:
    """Why the expectations above come from the scenario: on gloo, torch's Flight Recorder
    dump holds the collectives (the chain's subgroup all_reduces) but none of the sends and
    receives every rank made."""
    for case, s in scenarios.items():
        entries = fr_entries(s.fr_dir)
        assert entries, case
        assert not any(e.get("is_p2p") or "send" in e["profiling_name"]
                       or "recv" in e["profiling_name"] for es in entries.values() for e in es)
    chain = fr_entries(scenarios["chain"].fr_dir)
    assert {e["process_group"][1] for e in chain[1]} == {"sub"}
