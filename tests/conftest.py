"""Shared test fixtures: real multi-process gloo jobs, torchrun runs, GPU skips."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from harness import run_ranks, torchrun  # noqa: E402,F401


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    gpus = _gpu_count()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        need = marker.kwargs.get("count", 1)
        if gpus < need:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {gpus}"))


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    path.mkdir()
    return path


@pytest.fixture(autouse=True)
def _fresh_origins():
    """Each test starts with the origin resolvers' state empty (where commviz's recorder is
    loaded in this process: loading it here would change what tests of imports see)."""
    recorder = sys.modules.get("commviz.record.recorder")
    if recorder is not None:
        recorder.RECORDER.origins.reset()
    yield


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
