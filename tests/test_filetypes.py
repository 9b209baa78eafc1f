"""Every file commviz writes is a declared type: what a real 2-rank gloo job leaves in its run
dir (records, matched runs, comm tables, the gather summary) reads back through its type and
writes back byte for byte; a file missing a key or holding a wrong one is one error naming the
file and the key, never a ``"None"`` or a traceback."""

from __future__ import annotations

import json
import pickle
from dataclasses import replace
from pathlib import Path

import pytest

from commviz.errors import RecordError, SourceError
from commviz.gathered import SUMMARY_NAME, load_summary
from commviz.match import artifact
from commviz.merge import table
from commviz.record import schema, store
from harness import run_ranks

WORLD = 2
CALLS = 3


def _job(rank: int, world: int, run_dir: str) -> None:
    import torch

    import commviz
    import commviz.distributed as dist
    from commviz.merge import write_shard

    commviz.start(run_dir, flush_interval=None)
    with commviz.profile(run_dir):
        for _ in range(CALLS):
            dist.all_reduce(torch.ones(16))
    commviz.gather(run_dir)
    write_shard(run_dir, rank)
    table.write_table(run_dir, rank)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("filetypes") / "run"
    run_ranks(_job, WORLD, str(run_dir))
    return run_dir


def test_each_file_reads_back_through_its_type_and_writes_back_the_same(run: Path) -> None:
    for rank in range(WORLD):
        record = store.load_record(run / schema.record_name(rank))
        assert (record["schema"], record["version"], record["rank"]) == \
            (schema.SCHEMA, schema.VERSION, rank)
        assert sum(c["Collective name"] == "allreduce" for c in record["collectives"]) == CALLS
        path = artifact.matched_path(run, rank)
        art = artifact.load(path)
        assert art.rank == rank and art.inputs and isinstance(art.inputs, str)
        assert artifact.to_json(art) == path.read_bytes()
        # written by orjson: what the declaration's own (pydantic) serializer writes
        assert path.read_bytes() == artifact.FILE.dump_json(artifact.to_file(art),
                                                            fallback=artifact._plain)
        path = table.table_path(run, rank)
        assert table.to_json(table.load(path)) == path.read_bytes()
    summary = load_summary(run)
    assert summary is not None and summary["world_size"] == WORLD
    assert summary["mode"] == "full" and summary["missing"] == []


def test_a_matched_run_holding_what_orjson_refuses_still_reads_back(run: Path,
                                                                     tmp_path: Path) -> None:
    """An arg past 64 bits (orjson refuses it) and a set (JSON has none) in a recorded call."""
    art = artifact.load(artifact.matched_path(run, 0))
    event = art.events[0]
    args = {**event.args, "big": 2 ** 70, "peers": {3, 1, 2}}
    art = replace(art, events=[replace(event, args=args), *art.events[1:]])
    back = artifact.load(artifact.save(art, tmp_path / "matched_rank0.json"))
    assert back.events[0].args == {**event.args, "big": 2 ** 70, "peers": [1, 2, 3]}
    assert back.events[0].key == event.key and back.events[1:] == art.events[1:]


def _rewrite(path: Path, out: Path, change) -> Path:
    doc = json.loads(path.read_bytes())
    change(doc)
    out.write_text(json.dumps(doc))
    return out


@pytest.mark.parametrize("what, change, key", [
    ("no inputs", lambda d: d.pop("inputs"), "'inputs'"),
    ("a label without its trace", lambda d: d["labels"][0].pop("trace"), "'labels.0.trace'"),
    ("a string time", lambda d: d["events"][0].__setitem__(2, "soon"), "'events.0.2'"),
    ("a true rank", lambda d: d.__setitem__("rank", True), "'rank'"),
    ("a GPU op naming no name", lambda d: d["gpu"]["ops"].append([0, 10 ** 6, 0, 1, 2, False]),
     "gpu.ops"),
])
def test_a_matched_run_missing_or_mistyping_a_key_is_refused_naming_it(
        run: Path, tmp_path: Path, what: str, change, key: str) -> None:
    """The string ``"None"`` for a missing value came from here: now the key is named."""
    bad = _rewrite(artifact.matched_path(run, 0), tmp_path / "matched_rank0.json", change)
    with pytest.raises(SourceError) as err:
        artifact.load(bad)
    assert str(bad) in str(err.value) and key in str(err.value), what


def test_a_comm_table_with_a_bad_row_is_refused_naming_it(run: Path, tmp_path: Path) -> None:
    bad = _rewrite(table.table_path(run, 1), tmp_path / "comm_rank1.json",
                   lambda d: d["rows"][0].__setitem__(2, "not a key"))
    with pytest.raises(SourceError, match=r"comm_rank1\.json.*'rows\.0\.2'"):
        table.load(bad)


def test_a_record_missing_a_key_is_refused_naming_it(run: Path, tmp_path: Path) -> None:
    payload = store.load_record(run / schema.record_name(1))
    for key in ("world_size", "collectives"):
        bad = tmp_path / f"{key}.pkl"
        bad.write_bytes(pickle.dumps({k: v for k, v in payload.items() if k != key}))
        with pytest.raises(RecordError, match=rf"{bad.name}.*'{key}'"):
            store.load_record(bad)


def test_a_bad_gather_summary_is_a_warning_naming_it(run: Path, tmp_path: Path) -> None:
    _rewrite(run / SUMMARY_NAME, tmp_path / SUMMARY_NAME, lambda d: d.__setitem__("mode", "x"))
    with pytest.warns(UserWarning, match=rf"{SUMMARY_NAME}.*'mode'"):
        assert load_summary(tmp_path) is None
