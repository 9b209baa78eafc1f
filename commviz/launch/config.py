"""Load a launch config: YAML + ``--set`` overrides -> a checked ``Config``, or one clear error.

Every problem is reported as ``FILE:LINE key.path: message`` (or ``--set key=value key.path:
message`` when an override caused it), using the YAML nodes' marks, before any process starts:
unknown keys (with a did-you-mean), wrong types, layouts that do not tile the world, ranks that
do not exist, ops that do not fit their group, entrypoints that do not import. YAML is read with
the safe loader only: a config can never build Python objects.
"""

from __future__ import annotations

import copy

import difflib
import importlib
import importlib.resources
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from commviz.errors import ConfigError
from commviz.launch import config_schema as S
from commviz.launch.groups import LayoutError, layout

DEFAULT_NAME = "default.yaml"
DEFAULT_SOURCE = "<embedded default.yaml>"
# NVLink multicast (NVLS) stays off on every launch: it can take a host's shared GPUs out of
# service. These values are forced; a config may not change them.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                 "NVSHMEM_DISABLE_NVLS": "1"}
RUN_NAME_FIELDS = ("name", "time", "rdzv_id", "world")
MULTINODE_RUN_NAME = "{name}-{rdzv_id}"   # the same on every node: the default with nnodes > 1

Loc = tuple[Any, ...]


def _given(source: str, lines: dict[Loc, int], overridden: dict[Loc, str], loc: Loc) -> bool:
    """Whether the user's file, a --set or Slurm gave this key: the embedded default's keys
    are defaults (its nnodes: 1 and {time} yield to Slurm and to a multi-node job)."""
    return (any(loc[:len(k)] == k for k in overridden)
            or (source != DEFAULT_SOURCE and loc in lines))


@dataclass
class Loaded:
    """A checked config and where it came from (to resolve relative paths and name errors)."""

    config: S.Config
    source: str                      # the file's path, or DEFAULT_SOURCE
    base_dir: Path                   # relative paths in the config are relative to this
    overrides: list[str] = field(default_factory=list)
    lines: dict[Loc, int] = field(default_factory=dict, repr=False)   # key path -> line
    overridden: dict[Loc, str] = field(default_factory=dict, repr=False)  # key -> "--set k=v"

    def where(self, loc: Loc) -> str:
        """``FILE:LINE key.path`` (or ``--set ... key.path``) of a key of this config."""
        return _Locator(self.source, self.lines, self.overridden)(loc)

    def given(self, loc: Loc) -> bool:
        return _given(self.source, self.lines, self.overridden, loc)

    def fail(self, problems: list[tuple[Loc, str]]) -> None:
        """Raise one ConfigError naming each problem's key and line (nothing if none)."""
        _raise(problems, _Locator(self.source, self.lines, self.overridden))


# -- YAML with line numbers ------------------------------------------------------------------
def _walk(node: yaml.Node, path: Loc, lines: dict[Loc, int], source: str) -> None:
    """Record the 1-based line of every key and list item; refuse duplicate keys."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = yaml.safe_load(yaml.serialize(key_node)) if key_node.tag != \
                "tag:yaml.org,2002:str" else key_node.value
            line = key_node.start_mark.line + 1
            if key in seen:
                raise ConfigError(f"{source}:{line} {_dotted(path + (key,))}",
                                  f"duplicate key (first given on line {seen[key]})")
            seen[key] = line
            lines[path + (key,)] = line
            _walk(value_node, path + (key,), lines, source)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            _walk(item, path + (i,), lines, source)


def parse_yaml(text: str, source: str) -> tuple[dict[str, Any], dict[Loc, int]]:
    """The config's data and each key's line; YAML syntax errors name their line."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{source}:{mark.line + 1}" if mark is not None else source
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(where, f"invalid YAML: {problem}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}:1", "the config must be a mapping of keys (name, job, "
                          "groups, workload, profile, record, output)")
    lines: dict[Loc, int] = {(): 1}
    if root is not None:
        _walk(root, (), lines, source)
    return data, lines


# -- --set overrides ---------------------------------------------------------------------------
_KEY_RE = re.compile(r"^[A-Za-z_][\w\-]*(?:\.[A-Za-z_][\w\-]*|\.\d+|\[\d+\])*$")
_PART_RE = re.compile(r"([A-Za-z_][\w\-]*)|(\d+)")


def parse_key(path: str) -> Loc:
    """``"workload.collectives[0].size"`` (or ``.0.``) -> ``("workload", "collectives", 0, "size")``."""
    if not _KEY_RE.match(path):
        raise ValueError(f"bad key path {path!r} (e.g. workload.collectives[0].size)")
    return tuple(m.group(1) if m.group(1) else int(m.group(2)) for m in _PART_RE.finditer(path))


def override_value(loc: Loc, raw: str) -> Any:
    """A ``--set`` value as a person types it: read as YAML (numbers, booleans, flow lists),
    except that a text key takes the text itself when YAML would make something else of it
    (``{name}-{rdzv_id}``, ``host:29500``, ``007``); ValueError when YAML cannot read it."""
    if not raw.strip():
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        if _type_at(loc) is str:
            return raw
        raise ValueError(str(exc)) from None
    if _type_at(loc) is str and value is not None and not isinstance(value, str):
        return raw
    return value


def apply_override(data: dict[str, Any], text: str) -> Loc:
    """Apply one ``key.path=value`` (``override_value``) to ``data``."""
    where = f"--set {text}"
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(where, "expected key.path=value, e.g. job.nproc_per_node=4")
    try:
        loc = parse_key(key.strip())
        value = override_value(loc, raw)
    except ValueError as exc:
        raise ConfigError(where, f"cannot read it: {exc}") from None
    node: Any = data
    for i, part in enumerate(loc[:-1]):
        nxt = loc[i + 1]
        if isinstance(node, dict) and isinstance(part, (str, int)):
            if node.get(part) is None:
                node[part] = [] if isinstance(nxt, int) else {}
            node = node[part]
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
        else:
            raise ConfigError(where, f"{_dotted(loc[:i + 1])} is not there to set")
    last = loc[-1]
    if isinstance(node, dict):
        node[last] = value
    elif isinstance(node, list) and isinstance(last, int) and last <= len(node):
        if last == len(node):
            node.append(value)
        else:
            node[last] = value
    else:
        raise ConfigError(where, f"{_dotted(loc)} is not there to set")
    return loc


# -- error messages ---------------------------------------------------------------------------
def _dotted(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _unwrap(typ: Any) -> Any:
    if get_origin(typ) in (Union, types.UnionType):
        args = [a for a in get_args(typ) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return typ


def _type_at(loc: Loc) -> Any:
    """The schema type found at ``loc`` (a model class, list/dict type, or None)."""
    typ: Any = S.Config
    for part in loc:
        typ = _unwrap(typ)
        if isinstance(typ, type) and issubclass(typ, BaseModel):
            f = typ.model_fields.get(part) if isinstance(part, str) else None
            typ = f.annotation if f is not None else None
        elif get_origin(typ) is list and isinstance(part, int):
            typ = get_args(typ)[0]
        elif get_origin(typ) is dict:
            typ = get_args(typ)[1]
        else:
            return None
    return _unwrap(typ)


def did_you_mean(word: Any, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def _pydantic_message(err: dict[str, Any]) -> str:
    kind, loc, value = err["type"], tuple(err["loc"]), err.get("input")
    if kind == "extra_forbidden":
        parent = _type_at(loc[:-1])
        keys = list(parent.model_fields) if isinstance(parent, type) and \
            issubclass(parent, BaseModel) else []
        hint = did_you_mean(loc[-1], keys) or (f" (known keys: {', '.join(keys)})" if keys else "")
        return f"unknown key '{loc[-1]}'{hint}"
    if kind == "missing":
        return "is required"
    msg = err["msg"].removeprefix("Value error, ")
    if kind == "literal_error":
        expected = re.findall(r"'([^']*)'", err.get("ctx", {}).get("expected", ""))
        return f"{msg}, got {value!r}{did_you_mean(value, expected)}"
    if isinstance(value, (str, int, float, bool)) or value is None:
        if kind != "value_error":
            return f"{msg}, got {value!r}"
    return msg


def _problem(err: dict[str, Any]) -> tuple[Loc, str]:
    """A pydantic error as (key path, message); a bad mapping key is named as that key."""
    loc = tuple(err["loc"])
    if loc and loc[-1] == "[key]":
        return loc[:-1], f"a key here must be text, got {err.get('input')!r}"
    return loc, _pydantic_message(err)


class _Locator:
    """Turns a key path into ``FILE:LINE key.path`` or ``--set ... key.path``."""

    def __init__(self, source: str, lines: dict[Loc, int], overridden: dict[Loc, str]) -> None:
        self.source, self.lines, self.overridden = source, lines, overridden

    def _override(self, loc: Loc) -> str | None:
        for path, text in self.overridden.items():
            if loc[:len(path)] == path:
                return text
        return None

    def line(self, loc: Loc) -> int | None:
        """The line of ``loc`` or of its nearest parent in the file (None: from --set)."""
        if self._override(loc) is not None:
            return None
        return next((self.lines[loc[:n]] for n in range(len(loc), -1, -1)
                     if loc[:n] in self.lines), None)

    def __call__(self, loc: Loc) -> str:
        text = self._override(loc)
        if text is not None:
            return f"{text} {_dotted(loc)}"
        line = self.line(loc)
        return f"{self.source}:{line} {_dotted(loc)}" if line else f"{self.source} {_dotted(loc)}"


def _raise(problems: list[tuple[Loc, str]], locate: _Locator) -> None:
    if not problems:
        return
    in_order = sorted(problems, key=lambda p: (locate.line(p[0]) or 10**9))
    lines = [(locate(loc), msg) for loc, msg in in_order]
    first_where, first_msg = lines[0]
    more = "".join(f"\n  {where}: {msg}" for where, msg in lines[1:])
    err = ConfigError(first_where, first_msg + more)
    err.problems = [f"{where}: {msg}" for where, msg in lines]
    raise err


# -- whole-config checks ----------------------------------------------------------------------
def itemsize(dtype: str) -> int:
    import torch

    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def elements(op: S.Collective) -> int:
    """The op's ``size`` in elements of its dtype (bytes with a unit are divided)."""
    if isinstance(op.size, int):
        return op.size
    return S.size_in_bytes(op.size) // itemsize(op.dtype)


def _check_groups(cfg: S.Config) -> Iterator[tuple[Loc, str]]:
    for name, group in cfg.groups.items():
        if not S.NAME_RE.match(name):
            yield ("groups", name), "a group name uses letters, digits, '_' and '-'"
        try:
            layout(group, cfg.world_size)
        except LayoutError as exc:
            size = f"world size {cfg.world_size} = nnodes {cfg.job.nnodes} × nproc_per_node " \
                   f"{cfg.job.nproc_per_node}"
            msg = str(exc) if "world size" not in str(exc) or cfg.job.nnodes == 1 else \
                str(exc).replace(f"world size {cfg.world_size}", size)
            yield ("groups", name) + exc.key, msg


def _group_sizes(cfg: S.Config) -> dict[str, set[int]]:
    sizes = {S.WORLD: {cfg.world_size}}
    for name, group in cfg.groups.items():
        try:
            sizes[name] = {len(r) for r in layout(group, cfg.world_size)}
        except LayoutError:
            sizes[name] = set()   # reported by _check_groups
    return sizes


def _group_backend(cfg: S.Config, name: str) -> str:
    group = cfg.groups.get(name)
    return (group.backend if group is not None and group.backend else None) or cfg.job.backend


def _check_group_ref(cfg: S.Config, loc: Loc, name: str) -> Iterator[tuple[Loc, str]]:
    known = [S.WORLD, *cfg.groups]
    if name not in known:
        yield loc, f"unknown group '{name}'{did_you_mean(name, known)} (groups: {', '.join(known)})"


def _check_collectives(cfg: S.Config, sizes: dict[str, set[int]]) -> Iterator[tuple[Loc, str]]:
    graphs = cfg.workload.cuda_graphs
    if cfg.workload.collectives is not None and not cfg.workload.collectives:
        yield ("workload", "collectives"), "is empty: list at least one op (or remove the key)"
    for i, op in enumerate(cfg.workload.collectives or []):
        at = ("workload", "collectives", i)
        bad_ref = list(_check_group_ref(cfg, at + ("group",), op.group))
        yield from bad_ref
        if bad_ref:
            continue
        backend = _group_backend(cfg, op.group)
        if op.root is not None and op.op not in S.ROOTED_OPS:
            yield at + ("root",), f"{op.op} has no root (only {', '.join(sorted(S.ROOTED_OPS))})"
        if op.reduce_op is not None and op.op not in S.REDUCING_OPS:
            yield at + ("reduce_op",), f"{op.op} does not reduce"
        if op.reduce_op == "avg" and op.op in S.REDUCING_OPS and backend != "nccl":
            yield at + ("reduce_op",), f"avg is nccl-only; group '{op.group}' uses {backend}"
        if op.op == "barrier" and graphs:
            yield at + ("op",), "a barrier cannot be captured in a CUDA graph"
        if graphs and backend != "nccl":
            yield at + ("group",), f"group '{op.group}' uses {backend}: only nccl collectives " \
                                   "can be captured in a CUDA graph"
        n_elems = elements(op)
        if isinstance(op.size, str) and S.size_in_bytes(op.size) % itemsize(op.dtype):
            yield at + ("size",), f"{op.size} is not a whole number of {op.dtype} elements " \
                                  f"({itemsize(op.dtype)} bytes each)"
        for n in sorted(sizes.get(op.group, ())):
            if op.op in S.ROOTED_OPS and (op.root or 0) >= n:
                yield at + ("root",), f"root {op.root} is outside group '{op.group}' of {n} " \
                                      f"ranks (roots count within the group: 0-{n - 1})"
            if op.op in S.SPLIT_OPS and n_elems % n:
                yield at + ("size",), f"{op.op} splits its input over the {n} ranks of " \
                                      f"'{op.group}': {n_elems} elements is not a multiple of {n}"
            if op.op == "batch_isend_irecv" and n < 2:
                yield at + ("group",), f"batch_isend_irecv exchanges around a ring: group " \
                                       f"'{op.group}' has {n} rank"


def _check_transformer(cfg: S.Config, sizes: dict[str, set[int]]) -> Iterator[tuple[Loc, str]]:
    tf = cfg.workload.transformer
    if tf is None:
        return
    at = ("workload", "transformer")
    if tf.hidden % tf.heads:
        yield at + ("heads",), f"{tf.heads} heads do not divide hidden {tf.hidden}"
    for key in ("tp_group", "dp_group"):
        name = getattr(tf, key)
        if name is None:
            continue
        bad = list(_check_group_ref(cfg, at + (key,), name))
        yield from bad
        if not bad and cfg.workload.cuda_graphs and _group_backend(cfg, name) != "nccl":
            yield at + (key,), f"group '{name}' is not nccl: it cannot be captured in a CUDA graph"
    for n in sorted(sizes.get(tf.tp_group, ())):
        if tf.heads % n:
            yield at + ("heads",), f"{tf.heads} heads cannot be split over the {n} ranks of " \
                                   f"'{tf.tp_group}'"
        if (tf.ffn_mult * tf.hidden) % n:
            yield at + ("ffn_mult",), f"MLP width {tf.ffn_mult * tf.hidden} cannot be split " \
                                      f"over the {n} ranks of '{tf.tp_group}'"


def import_entrypoint(spec: str, paths: Sequence[Path]) -> Any:
    """Import ``module:function`` with ``paths`` first on sys.path (ValueError says why not)."""
    module_name, sep, func_name = spec.partition(":")
    if not sep or not module_name or not func_name:
        raise ValueError(f"{spec!r} is not 'module:function'")
    added = [str(p) for p in paths if str(p) not in sys.path]
    sys.path[:0] = added
    try:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                where = ", ".join(str(p) for p in paths) or "the working directory"
                raise ValueError(f"module '{module_name}' not found (looked in {where} and "
                                 "the installed packages)") from None
            raise ValueError(f"importing '{module_name}' failed: {exc}") from None
        except Exception as exc:  # the user's module raised while importing
            raise ValueError(f"importing '{module_name}' failed: {type(exc).__name__}: "
                             f"{exc}") from None
    finally:
        for p in added:
            sys.path.remove(p)
    func = getattr(module, func_name, None)
    if func is None:
        names = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")]
        raise ValueError(f"module '{module_name}' has no function '{func_name}'"
                         f"{did_you_mean(func_name, names)}")
    if not callable(func):
        raise ValueError(f"'{spec}' is not callable")
    return func


def pythonpath(loaded: Loaded) -> list[Path]:
    """The workload's extra import directories, absolute, plus the working directory."""
    dirs = [(loaded.base_dir / p).resolve() for p in loaded.config.workload.pythonpath]
    return dirs + [Path.cwd()]


def _check_workload(loaded: Loaded, sizes: dict[str, set[int]]) -> Iterator[tuple[Loc, str]]:
    cfg = loaded.config
    wl = cfg.workload
    if wl.transformer is None and wl.collectives is None and wl.entrypoint is None:
        yield ("workload",), "nothing to run: give transformer, collectives and/or entrypoint"
    if wl.cuda_graphs and cfg.job.backend != "nccl":
        yield ("workload", "cuda_graphs"), "CUDA graphs need job.backend nccl"
    if wl.cuda_graphs and wl.warmup_steps < 1:
        yield ("workload", "warmup_steps"), "a CUDA graph capture needs at least one eager " \
                                            "warmup step first (NCCL communicators, allocator)"
    yield from _check_collectives(cfg, sizes)
    yield from _check_transformer(cfg, sizes)
    for i, p in enumerate(wl.pythonpath):
        if not (loaded.base_dir / p).is_dir():
            yield ("workload", "pythonpath", i), f"{loaded.base_dir / p} is not a directory"
    if wl.args and wl.entrypoint is None:
        yield ("workload", "args"), "args are handed to an entrypoint, and none is given"
    if wl.entrypoint is not None:
        try:
            import_entrypoint(wl.entrypoint, pythonpath(loaded))
        except ValueError as exc:
            yield ("workload", "entrypoint"), str(exc)
    pr = cfg.profile
    need = pr.wait + pr.warmup + pr.active * max(pr.repeat, 1)
    if pr.enabled and wl.steps < need:
        yield ("workload", "steps"), f"{wl.steps} steps are fewer than the profiler schedule " \
            f"needs: {need} = wait {pr.wait} + warmup {pr.warmup} + active {pr.active} × " \
            f"repeat {max(pr.repeat, 1)}"


def _check_job(cfg: S.Config) -> Iterator[tuple[Loc, str]]:
    if cfg.job.nnodes > 1 and cfg.job.rdzv_endpoint is None:
        yield ("job", "rdzv_endpoint"), "is required with nnodes > 1: host:port of the " \
                                        "rendezvous (reachable from every node)"
    for key, value in cfg.job.env.items():
        if key in MULTICAST_OFF and value != MULTICAST_OFF[key]:
            yield ("job", "env", key), f"NVLink multicast stays off: {key} is always " \
                                       f"{MULTICAST_OFF[key]}"
    try:
        render_run_name(cfg, time="t")
    except ValueError as exc:
        yield ("output", "run_name"), str(exc)
    if cfg.job.nnodes > 1 and "{time}" in cfg.output.run_name:
        yield ("output", "run_name"), (
            f"{cfg.output.run_name!r}: {{time}} is each node's own clock, so nodes that start a "
            f"second apart would write two run dirs; name a multi-node run by its rendezvous id: "
            f"--set 'output.run_name={MULTINODE_RUN_NAME}' (and a new job.rdzv_id per job)")


def check(loaded: Loaded) -> list[tuple[Loc, str]]:
    """Every whole-config problem as (key path, message); empty when the config can run."""
    sizes = _group_sizes(loaded.config)
    return [*_check_job(loaded.config), *_check_groups(loaded.config),
            *_check_workload(loaded, sizes)]


def render_run_name(cfg: S.Config, *, time: str) -> str:
    """``output.run_name`` with its placeholders filled (ValueError names a bad one)."""
    values = {"name": cfg.name, "time": time, "rdzv_id": cfg.job.rdzv_id,
              "world": cfg.world_size}
    try:
        name = cfg.output.run_name.format(**values)
    except (KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"bad placeholder {exc} in {cfg.output.run_name!r} (known: "
                         f"{', '.join('{' + k + '}' for k in RUN_NAME_FIELDS)})") from None
    if not name or "/" in name or name in (".", ".."):
        raise ValueError(f"{name!r} is not a directory name")
    return name


# -- entry points -----------------------------------------------------------------------------
def default_text() -> str:
    """The embedded default config (shipped in the package as ``default.yaml``)."""
    return importlib.resources.files("commviz.launch").joinpath(DEFAULT_NAME).read_text()


def load_text(text: str, source: str, base_dir: Path, overrides: Sequence[str] = (),
              defaults: Mapping[Loc, tuple[Any, str]] | None = None) -> Loaded:
    """Parse, override, validate and check one config (raises ConfigError). ``defaults``: key
    -> (value, where it came from) for keys the file and the overrides leave out (Slurm's)."""
    data, lines = parse_yaml(text, source)
    overridden = {apply_override(data, o): f"--set {o}" for o in overrides}
    for loc, (value, origin) in (defaults or {}).items():   # a key set to null is left out
        if (not _given(source, lines, overridden, loc) or _value_at(data, loc) is None) \
                and _set_default(data, loc, value):
            overridden[loc] = origin
    locate = _Locator(source, lines, overridden)
    try:
        config = S.Config.model_validate(data)
    except ValidationError as exc:
        problems = [_problem(e) for e in exc.errors(include_url=False)]
        rest = _without(data, [loc for loc, _ in problems])
        sized = not any(loc[:2] in WORLD_KEYS for loc, _ in problems)
        if rest is not None and sized:   # the whole-config checks too: every error at once
            beside = Loaded(rest, source, base_dir, list(overrides), lines, overridden)
            bad = [loc for loc, _ in problems]
            problems += [(loc, msg) for loc, msg in check(beside)
                         if not any(loc[:len(b)] == b or b[:len(loc)] == loc for b in bad)]
        _raise(problems, locate)
        raise  # unreachable: _raise raised
    loaded = Loaded(config, source, base_dir, list(overrides), lines, overridden)
    if config.job.nnodes > 1 and not loaded.given(("output", "run_name")):
        config.output.run_name = MULTINODE_RUN_NAME
    loaded.fail(check(loaded))
    return loaded


def _value_at(data: dict[str, Any], loc: Loc) -> Any:
    node: Any = data
    for part in loc:
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _set_default(data: dict[str, Any], loc: Loc, value: Any) -> bool:
    """Put ``value`` at ``loc`` unless a section on the way is not a mapping (the schema then
    reports that section)."""
    node: Any = data
    for part in loc[:-1]:
        node = node.setdefault(part, {}) if isinstance(node, dict) else None
        if node is None:
            return False
    if not isinstance(node, dict):
        return False
    node[loc[-1]] = value
    return True


# Keys the world size comes from: with one of them invalid, the group checks would guess.
WORLD_KEYS = {("job", "nnodes"), ("job", "nproc_per_node")}


def _without(data: dict[str, Any], bad: list[Loc]) -> S.Config | None:
    """The config with each schema-invalid mapping key left to its default, when that makes it
    valid (None otherwise): what the whole-config checks can still look at."""
    rest = copy.deepcopy(data)
    for loc in bad:
        parent: Any = rest
        for part in loc[:-1]:
            try:
                parent = parent[part]
            except (KeyError, IndexError, TypeError):
                return None
        if not isinstance(parent, dict) or loc[-1] not in parent:
            return None
        del parent[loc[-1]]
    try:
        return S.Config.model_validate(rest)
    except ValidationError:
        return None


def load(path: str | Path | None = None, overrides: Sequence[str] = (),
         defaults: Mapping[Loc, tuple[Any, str]] | None = None) -> Loaded:
    """Load ``path`` (None: the embedded default) with ``overrides`` applied."""
    if path is None:
        return load_text(default_text(), DEFAULT_SOURCE, Path.cwd(), overrides, defaults)
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(str(p), f"cannot read the config: {exc.strerror or exc}") from None
    return load_text(text, str(p), p.resolve().parent, overrides, defaults)


def run_dir(cfg: S.Config) -> Path:
    """The run dir of a resolved config (its run_name filled in)."""
    return Path(cfg.output.dir) / cfg.output.run_name


def _nccl_keys(cfg: S.Config) -> list[Loc]:
    keys: list[Loc] = [("job", "backend")] if cfg.job.backend == "nccl" else []
    return keys + [("groups", n, "backend") for n, g in cfg.groups.items() if g.backend == "nccl"]


def uses_nccl(cfg: S.Config) -> bool:
    """Whether any group is nccl: then every rank works on its own GPU."""
    return bool(_nccl_keys(cfg))


def check_environment(loaded: Loaded, gpus: int | None = None) -> None:
    """What this machine must offer to run the job here (after ``load``; not for --dry-run)."""
    cfg = loaded.config
    nccl = _nccl_keys(cfg)
    if not nccl:
        return
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < cfg.job.nproc_per_node:
        loaded.fail([(nccl[0], f"nccl needs one CUDA GPU per rank: nproc_per_node is "
                               f"{cfg.job.nproc_per_node}, this machine has {gpus}")])


def dump(config: S.Config) -> str:
    """The config as YAML (every key, defaults included): what the run dir's config.yaml holds."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, width=100)
