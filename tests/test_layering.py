"""The code's layout follows the data's flow: no module imports a later stage, no two modules
import each other (directly or round a loop), and no module hides an import behind
``importlib`` (where a misspelled name would fail only when reached).

Every module under ``commviz/`` is parsed with ``ast``; every ``import`` in it, at module level
or inside a function, is checked against the stage order below and for loops. Imports within one
stage are free, as long as they run one way.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Stage order, earliest first: (module prefixes, why they stand there). A module belongs to the
# longest prefix that names it.
STAGES: list[tuple[tuple[str, ...], str]] = [
    (("commviz",), "shared facts: errors, metadata keys and wording, lazy API, kernel names"),
    (("commviz.record", "commviz.capture", "commviz.collective_annotation", "commviz.patching",
      "commviz.distributed"), "record: in the job, every call as it is made"),
    (("commviz.trace",), "trace: loading profiler traces and run dirs"),
    (("commviz.match",), "match: records onto kernels, one rank at a time"),
    (("commviz.write",), "write: the Perfetto encoder and reader, Chrome JSON"),
    (("commviz.merge",), "merge: shards, comm tables, cross-rank instances, the merged trace"),
    (("commviz.live",), "live: the always-on record read while the job runs (watch, metrics)"),
    (("commviz.review.model", "commviz.review.analyses"),
     "review's analyses: functions over a loaded run (verdict, desyncs, roll-ups, pipeline, "
     "overlap), and the model they return"),
    (("commviz.review.render",), "review's wording: text, Markdown, JSON, plots, the timeline"),
    (("commviz.review",), "review's front (commviz.Run) over the analyses and their wording, the "
                          "diff and the overview"),
    (("commviz.review.commands",), "review's command line: one module a command"),
    (("commviz.verify",), "verify: checks the merged trace against the inputs"),
    (("commviz.cli", "commviz.__main__", "commviz.launch", "commviz.gathering",
      "commviz.gathered", "commviz.convert", "commviz.serve"),
     "drivers: the command line, the launcher, gather (which converts on the node), and the "
     "pages (live windows beside the review)"),
]

# Modules that never import torch, not even inside a function: the ground floor (the vocabulary
# every reader shares with the job), the record's on-disk formats, and every after-the-job stage.
# The job's side of the record (its registry of groups, its wrappers, its journal writer) stands
# above them in ``commviz.record``.
TORCH_FREE = ("commviz.record.schema", "commviz.record.store", "commviz.record.stacks",
              "commviz.trace", "commviz.match", "commviz.write", "commviz.merge", "commviz.live",
              "commviz.review", "commviz.verify")

# The only modules that may import by name at run time, and why.
IMPORTLIB_ALLOWED = {
    "commviz.cli": "the command registry (a missing module is an error, not a dropped command)",
    "commviz.lazy": "the packages' lazy public API",
    "commviz.launch.config": "imports the user's workload from its 'module:function' spec",
}


def _module_files() -> dict[str, Path]:
    files = {}
    for path in sorted((ROOT / "commviz").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


MODULES = _module_files()


def stage_of(module: str) -> int:
    best, stage = -1, None
    for i, (prefixes, _) in enumerate(STAGES):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, stage = len(prefix), i
    if stage is None:
        raise AssertionError(f"{module} is in no stage: add it to STAGES")
    return stage


def imported(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, module) of every commviz module ``module`` imports; ``from pkg import name``
    counts as ``pkg.name`` when that is a module."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else base))
    return sorted({(line, name) for line, name in out if name == "commviz" or
                   name.startswith("commviz.")})


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of ``modules`` it imports (a package's own ``__init__``, run
    when a submodule is imported, is not counted: it imports only its lazy API)."""
    return {module: {name for _, name in imported(module, path) if name in modules}
            for module, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import each other round a loop (Tarjan's strongly connected
    components), as one loop through them: ``[a, b, c, a]``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_loop(graph, group) for group in groups]


def _loop(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest loop from the group's first module back to it, breadth-first."""
    start = min(group)
    came: dict[str, str] = {}
    frontier = [start]
    while start not in came:
        reached = []
        for v in frontier:
            for w in sorted(graph[v] & group - came.keys()):
                came[w] = v
                reached.append(w)
        frontier = reached
    back = [start]
    while back[-1] != start or len(back) == 1:
        back.append(came[back[-1]])
    return back[::-1]


def import_names(path: Path) -> Iterator[tuple[int, list[str]]]:
    """Each import in ``path`` wherever it stands, and each ``__import__`` call: line, names."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield node.lineno, [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.lineno, [node.module or ""]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id == "__import__":
            yield node.lineno, ["__import__"]


def torch_imports(path: Path) -> list[int]:
    """Lines that import torch or a module of it, wherever they stand."""
    return sorted(line for line, names in import_names(path)
                  if any(n.split(".")[0] == "torch" for n in names))


def uses_importlib(path: Path) -> list[int]:
    """Lines that import by name at run time: ``importlib`` (but its ``resources``),
    ``__import__``, ``pkgutil``/``runpy``."""
    return sorted(line for line, names in import_names(path)
                  if any(n.split(".")[0] in ("importlib", "__import__", "pkgutil", "runpy")
                         and n != "importlib.resources" for n in names))


def test_every_module_has_a_stage() -> None:
    assert "commviz.merge.cross" in MODULES and "commviz.launch.config" in MODULES
    for module in MODULES:
        stage_of(module)


def test_no_import_runs_backwards() -> None:
    backwards = []
    for module, path in MODULES.items():
        mine = stage_of(module)
        for line, name in imported(module, path):
            if stage_of(name) > mine:
                backwards.append(f"{path.relative_to(ROOT)}:{line}: {module} "
                                 f"({STAGES[mine][1].split(':')[0]}) imports {name} "
                                 f"({STAGES[stage_of(name)][1].split(':')[0]})")
    assert backwards == []


def test_no_import_cycle() -> None:
    """The recorder and the capture code, in particular, hand off one way
    (``commviz.record.capturing``): each can be read and tested without the other."""
    assert import_cycles(import_graph(MODULES)) == []


def test_the_checker_sees_an_import_cycle(tmp_path: Path) -> None:
    """A loop through a function-level and a relative import is found, and named in order."""
    sources = {"commviz.record.calls": "from commviz.capture import region\n",
               "commviz.capture.region": "def f():\n    from ..capture import hooks\n",
               "commviz.capture.hooks": "from commviz.record import calls\n",
               "commviz.record.ops": "from commviz.record import calls\n"}
    modules = {}
    for name, source in sources.items():
        path = tmp_path / name.replace(".", "_") / f"{name.rpartition('.')[2]}.py"
        path.parent.mkdir()
        path.write_text(source)
        modules[name] = path
    graph = import_graph(modules)
    assert graph["commviz.capture.region"] == {"commviz.capture.hooks"}
    assert import_cycles(graph) == [["commviz.capture.hooks", "commviz.record.calls",
                                     "commviz.capture.region", "commviz.capture.hooks"]]


def test_the_ground_floor_and_the_readers_import_no_torch() -> None:
    """What reads a run after the job, and the vocabulary it shares with the job, loads without
    torch wherever a reader's call leads (test_imports runs the commands; this reads every
    function)."""
    free = [m for m in MODULES if stage_of(m) == 0 or
            any(m == p or m.startswith(p + ".") for p in TORCH_FREE)]
    assert {"commviz.metadata", "commviz.kernels", "commviz.record.schema",
            "commviz.live.window"} <= set(free)
    found = [f"{MODULES[m].relative_to(ROOT)}:{line}" for m in free
             for line in torch_imports(MODULES[m])]
    assert found == []


def test_the_checker_sees_a_torch_import(tmp_path: Path) -> None:
    path = tmp_path / "m.py"
    path.write_text("import os\ndef f():\n    from torch.distributed import group\n")
    assert torch_imports(path) == [3]


def test_no_import_is_hidden_behind_importlib() -> None:
    hidden = [f"{path.relative_to(ROOT)}:{line}" for module, path in MODULES.items()
              if module not in IMPORTLIB_ALLOWED for line in uses_importlib(path)]
    assert hidden == []


@pytest.mark.parametrize("source, found", [
    ("from commviz.review.analyses.rollups import summary_tracks\n",
     "commviz.review.analyses.rollups"),
    ("def f():\n    from commviz.review.render import report_formats\n",
     "commviz.review.render.report_formats"),
    ("from ..review.render import report_formats\n", "commviz.review.render.report_formats"),
    ("import commviz.verify\n", "commviz.verify"),
])
def test_the_checker_sees_a_backward_import(tmp_path: Path, source: str, found: str) -> None:
    """The checks above would catch what they are there for: a merge module importing the
    review, at module level, inside a function or relatively; and a hidden import."""
    path = tmp_path / "cross.py"
    path.write_text(source)
    names = [name for _, name in imported("commviz.merge.cross", path)]
    assert names == [found]
    assert stage_of(found) > stage_of("commviz.merge.cross")


@pytest.mark.parametrize("source", ["import importlib\n", "from importlib import import_module\n",
                                    "x = __import__('commviz.review')\n",
                                    "def f():\n    import importlib.util\n"])
def test_the_checker_sees_importlib(tmp_path: Path, source: str) -> None:
    path = tmp_path / "m.py"
    path.write_text(source)
    assert uses_importlib(path) == [source.count("\n")]
