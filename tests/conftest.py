"""Shared test fixtures: real multi-process gloo jobs, torchrun runs, GPU skips."""

from __future__ import annotations

import ast
import functools
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from harness import run_ranks, torchrun  # noqa: E402,F401


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# What starts a process. A test that reaches one, in its own code or its fixtures' (through the
# functions of its module and of the helpers of tests/ it imports), runs real jobs or commands,
# seconds each: it is the slow tier, and ``pytest -m "not slow"`` runs the in-process rest. A
# job that commviz itself starts (an in-process ``cli.main(["launch", ...])``) is not seen
# here: such a test is marked ``slow`` where it stands.
_STARTERS = frozenset({"subprocess", "multiprocessing", "Popen", "Process", "Pool", "spawn",
                       "start_processes"})


def _used(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


@functools.cache
def starting_names(path: Path) -> frozenset[str]:
    """The top-level functions and classes of the module at ``path`` (and the names it imports
    from a helper of tests/) that can start a process, read from the code, not run."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    uses = {node.name: _used(node) for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    starting = set(_STARTERS)
    for node in ast.walk(tree):             # a helper's names, imported at the top or in a def
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            helper = path.parent / f"{node.module}.py"
            if helper.is_file() and helper != path:
                starting |= {a.asname or a.name for a in node.names
                             if a.name in starting_names(helper)}
    grew = True
    while grew:
        grew = False
        for name, used in uses.items():
            if name not in starting and used & starting:
                starting.add(name)
                grew = True
    return frozenset(starting - _STARTERS)


def _starts_processes(item: pytest.Item) -> bool:
    names = starting_names(Path(str(item.fspath)))
    own = item.cls.__name__ if item.cls is not None else item.originalname
    return own in names or any(f in names for f in item.fixturenames)


def pytest_collection_modifyitems(config, items):
    gpus = _gpu_count()
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.slow)
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
