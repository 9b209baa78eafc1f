"""The after-the-job tools need no torch, and importing commviz changes nothing in torch.

Each check runs in a fresh interpreter (``sys.modules`` tells what was imported) on a real run
dir made by a 2-rank gloo job.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import free_port, run_ranks


def _job(rank: int, world: int, run_dir: str) -> None:
    import torch.distributed as dist

    import commviz

    commviz.start(run_dir, flush_interval=None)
    with commviz.profile(run_dir):
        for _ in range(3):
            dist.all_reduce(torch.ones(16))
    commviz.flush()


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("imports") / "run"
    run_ranks(_job, 2, str(run_dir))
    return run_dir


def _python(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_after_the_job_commands_import_no_torch(run: Path, tmp_path: Path) -> None:
    for argv in (["--help"], ["merge", "--help"], ["merge", str(run), "-o", str(tmp_path / "m.pftrace")],
                 ["verify", str(tmp_path / "m.pftrace")],
                 ["report", str(run), "-o", str(tmp_path / "r.md"), "--no-plots"],
                 ["annotate", str(run / "trace_rank0.json.gz"), str(run / "commviz_rank0.pkl"),
                  "-o", str(tmp_path / "a.pftrace")],
                 ["merge", str(run)],       # into the run dir: its comm tables, which diff reads
                 ["diff", str(run), str(run), "-o", str(tmp_path / "d.md"), "--format", "markdown"],
                 ["watch", str(run), "--once", "--format", "json"], ["exporter", "--help"]):
        code = ("import sys\nfrom commviz.cli import main\ntry:\n    rc = main(%r)\n"
                "except SystemExit as exc:\n    rc = exc.code\nprint(rc, 'torch' in sys.modules)"
                % (argv,))
        assert _python(code) == "0 False", argv


def test_the_front_reads_a_run_without_torch(run: Path) -> None:
    """``commviz.Run``, every analysis of a notebook's, loads no torch."""
    code = ("import sys\nimport commviz\nr = commviz.Run(%r)\n"
            "r.review(); r.verdict(); r.stragglers(); r.windows(); r.report('json')\n"
            "print('torch' in sys.modules)" % str(run))
    assert _python(code) == "False"

def test_serve_renders_its_pages_without_torch(run: Path) -> None:
    """``commviz serve``: the live panel refreshed from the run's files and the page after the
    job (report, whole run, timeline form) are made without torch."""
    code = ("import sys\nfrom pathlib import Path\nfrom commviz.serve.server import Site\n"
            "site = Site(Path(%r), 1.0)\nsite.live.refresh()\nsite.page({})\n"
            "site.after_body({})\nprint('torch' in sys.modules)" % str(run))
    assert _python(code) == "False"


def test_importing_commviz_installs_nothing() -> None:
    code = """
import torch, torch.distributed
before = (torch.cuda.CUDAGraph.replay, torch.cuda.CUDAGraph.capture_begin,
          torch.distributed.all_reduce)
import commviz, commviz.record, commviz.capture, commviz.metadata
from commviz.record import boundary
after = (torch.cuda.CUDAGraph.replay, torch.cuda.CUDAGraph.capture_begin,
         torch.distributed.all_reduce)
print(before == after and boundary.BOUNDARY.impl is None)
"""
    assert _python(code) == "True"


def test_recording_imports_no_torch_module_the_job_did_not() -> None:
    """A job's first recorded collective imported DTensor (0.7 s, and its ops registered) to
    learn its redistribute's code: a job with commviz must load what it loads without."""
    code = """
import os, sys, tempfile
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="%d", RANK="0", WORLD_SIZE="1")
import torch, torch.distributed as dist
import commviz
dist.init_process_group("gloo")
commviz.start(tempfile.mkdtemp(), flush_interval=None)
before = set(sys.modules)
dist.all_reduce(torch.ones(4))
dist.broadcast(torch.ones(4), 0)
new = sorted(m for m in set(sys.modules) - before if m.startswith("torch"))
dist.destroy_process_group()
print(new)
""" % free_port()
    assert _python(code) == "[]"


def test_the_api_stays_callable_whatever_was_imported_first() -> None:
    """A submodule named like a lazily loaded function would shadow it once imported."""
    code = """
import importlib, pkgutil
import commviz
for mod in pkgutil.walk_packages([commviz.__path__[0]], "commviz."):
    if not mod.name.endswith(("__main__", "cli")):
        importlib.import_module(mod.name)
import commviz.capture, commviz.record
api = [getattr(commviz, n) for n in commviz.__all__ if n not in ("__version__", "RECORDER")]
api += [getattr(commviz.capture, n) for n in commviz.capture.__all__]
api += [getattr(commviz.record, n) for n in commviz.record.__all__ if n != "RECORDER"]
print(all(callable(f) and not isinstance(f, type(commviz)) for f in api))
"""
    assert _python(code) == "True"


def test_every_command_module_fills_its_parser() -> None:
    """``commviz --help`` imports no command module, so each is checked here: it exists and
    its ``register`` gives the command a handler (a misspelled module would fail here)."""
    import argparse

    from commviz import cli

    for command in cli.COMMANDS:
        parser = cli.build_parser([command.name])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        assert callable(sub.choices[command.name].get_default("func")), command.name
        assert sub.choices[command.name].description not in (None, command.help), command.name
