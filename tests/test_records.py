"""Record files: atomic, versioned, plain data only; a killed rank keeps what it recorded."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import commviz
from commviz import metadata as md
from commviz.errors import RecordError
from commviz.record import schema, store
from harness import REPO, free_port


def _job_record(rank: int, world: int, run_dir: str) -> int:
    import commviz.distributed as dist

    commviz.RECORDER.clear()
    commviz.start(run_dir)
    t = torch.ones(3)
    for _ in range(4):
        dist.all_reduce(t)
    return commviz.flush() is not None


@pytest.fixture
def real_record(run_dir: Path) -> Path:
    from harness import run_ranks

    assert run_ranks(_job_record, 2, str(run_dir)) == [True, True]
    return run_dir / schema.record_name(0)


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_hostile_pickle_is_refused_and_runs_nothing(tmp_path: Path, real_record: Path) -> None:
    marker = tmp_path / "pwned"
    payload = commviz.load_record(real_record)
    payload["collectives"].append({"x": _Evil(marker)})
    evil = tmp_path / "commviz_rank7.pkl"
    evil.write_bytes(pickle.dumps(payload, protocol=4))
    assert pickle.loads(pickle.dumps(_Evil(tmp_path / "control"))) == 0  # the payload is live
    assert (tmp_path / "control").exists()
    with pytest.raises(RecordError) as err:
        commviz.load_record(evil)
    assert str(evil) in str(err.value) and "posix.system" in str(err.value)
    assert not marker.exists()
    for proto in (0, 2, 5):  # GLOBAL and STACK_GLOBAL opcodes alike
        evil.write_bytes(pickle.dumps({"schema": _Evil(marker)}, protocol=proto))
        with pytest.raises(RecordError):
            commviz.load_record(evil)
    assert not marker.exists()


def test_truncated_and_wrong_version_records(tmp_path: Path, real_record: Path) -> None:
    data = real_record.read_bytes()
    cut = tmp_path / "commviz_rank0.pkl"
    for size in (0, 1, len(data) // 3, len(data) - 1):
        cut.write_bytes(data[:size])
        with pytest.raises(RecordError) as err:
            commviz.load_record(cut)
        assert str(cut) in str(err.value)
    payload = commviz.load_record(real_record)
    payload["version"] = schema.VERSION + 1
    store.dump_record(cut, payload)
    with pytest.raises(RecordError, match="schema version"):
        commviz.load_record(cut)
    cut.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(RecordError, match="not a commviz record"):
        commviz.load_record(cut)
    with pytest.raises(RecordError, match="cannot read"):
        commviz.load_record(tmp_path / "absent.pkl")


def test_record_contents_and_atomic_write(real_record: Path) -> None:
    rec = commviz.load_record(real_record)
    assert (rec["schema"], rec["version"], rec["rank"], rec["world_size"]) == \
        ("commviz.record", schema.VERSION, 0, 2)
    assert rec["host"] and rec["pid"] > 0 and rec["device"] == "cpu"
    assert rec["torch_version"] == str(torch.__version__)
    assert rec["process_groups"][0] == {"name": "0", "desc": "default_pg", "ranks": [0, 1],
                                        "backend": "gloo", "lane": md.lane_id("0")}
    assert [c[md.SEQ] for c in rec["collectives"]] == [1, 2, 3, 4]
    assert rec["graphs"] == [] and rec["replays"] == [] and rec["marks"] == []
    assert not [p for p in real_record.parent.iterdir() if p.name.endswith(".tmp")]


def test_ring_buffer_caps_memory_and_counts_drops() -> None:
    rec = commviz.record.Recorder(capacity=5)
    for i in range(12):
        rec.append({"i": i})
    assert [r["i"] for r in rec.records()] == list(range(7, 12))
    assert (rec.recorded, rec.dropped) == (12, 7)


def test_ring_buffer_is_thread_safe() -> None:
    import threading

    rec = commviz.record.Recorder(capacity=1000)
    threads = [threading.Thread(target=lambda: [rec.append({}) for _ in range(5000)])
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert (rec.recorded, rec.dropped, len(rec.records())) == (20000, 19000, 1000)


def test_killed_rank_keeps_its_records(run_dir: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={free_port()}", str(REPO / "tests/jobs/killed_rank.py"), str(run_dir)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        pid_file = run_dir / "rank1.pid"
        deadline = time.time() + 120
        while not pid_file.exists() and time.time() < deadline:
            time.sleep(0.2)
        assert pid_file.exists(), proc.stdout.read() if proc.poll() is not None else "no pid"
        time.sleep(0.3)
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0, out
    killed = commviz.load_record(run_dir / schema.record_name(1))
    assert killed["exit"] == "SIGTERM"
    assert [c[md.OP] for c in killed["collectives"]] == ["all_reduce"] * 3
    survivor = commviz.load_record(run_dir / schema.record_name(0))  # torchrun stopped it too
    assert len(survivor["collectives"]) == 3
