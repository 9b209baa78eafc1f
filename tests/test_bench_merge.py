"""scripts/bench_merge.py's ``--run``: a real run dir is measured from the job's own outputs.

A run dir that was merged before holds commviz's outputs beside the job's; a merge measured on
it would reuse the matched runs and shards and skip its work. The copy the benchmark measures
must hold every input byte for byte and none of those outputs, and its traces must be filed
under the ranks their files state (the real 2-GPU FSDP2 run of the GPU proof).
"""

from __future__ import annotations

import filecmp
import shutil
import sys
from pathlib import Path

from commviz.merge import merge_run

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_merge  # noqa: E402

FSDP2 = Path(__file__).parent / "fixtures" / "gpu" / "proof-2xh100" / "fsdp2"


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_a_merged_run_is_copied_without_what_the_merge_made(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FSDP2, run)
    inputs = _files(run)
    merge_run(run, progress=False, workers=1)          # its outputs land in the run dir
    made = _files(run) - inputs
    assert any(name.startswith("merged") for name in made)
    assert any(name.startswith("matched_rank") for name in made)

    copy = tmp_path / "copy"
    bench_merge._copy_inputs(run, copy)
    assert _files(copy) == inputs
    for name in inputs:
        assert filecmp.cmp(run / name, copy / name, shallow=False), name

    traces = bench_merge._inputs(copy)
    assert traces == {0: copy / "trace_rank0_step4.json.gz", 1: copy / "trace_rank1_step4.json.gz"}
