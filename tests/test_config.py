"""Launch configs: shipped configs validate, bad input names file:line and key, --set, --dry-run.

No processes start here; the real launches are in test_launch.py.
"""

from __future__ import annotations

import itertools
import shlex
import textwrap
from pathlib import Path

import pytest

from commviz import cli
from commviz.errors import ConfigError
from commviz.launch import config as C
from commviz.launch import groups
from commviz.launch.launch_command import resolve
from commviz.launch.config_schema import Group

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def error_of(path: Path | None, overrides: tuple[str, ...] = ()) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        C.load(path, overrides)
    return info.value


# -- shipped configs --------------------------------------------------------------------------
def test_configs_are_shipped():
    names = {p.name for p in CONFIGS}
    assert {"default.yaml", "gpu-2x-graphs.yaml", "multinode.yaml", "tp-dp-4gpu.yaml",
            "tp-dp-8gpu.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_validates(path):
    loaded = C.load(path)
    assert loaded.config.world_size >= 2
    assert C.load_text(C.dump(loaded.config), "dumped", path.parent).config == loaded.config


def test_embedded_default_is_configs_default():
    assert C.default_text() == (REPO / "configs" / "default.yaml").read_text()
    loaded = C.load(None)
    assert loaded.source == C.DEFAULT_SOURCE
    cfg = loaded.config
    assert (cfg.job.backend, cfg.world_size, cfg.workload.cuda_graphs) == ("gloo", 2, False)
    assert cfg.workload.collectives and set(cfg.groups)


def test_tp_dp_layouts_of_the_gpu_configs():
    four = groups.layouts(C.load(REPO / "configs" / "tp-dp-4gpu.yaml").config)
    assert four["tp"] == [[0, 1], [2, 3]] and four["dp"] == [[0, 2], [1, 3]]
    eight = groups.layouts(C.load(REPO / "configs" / "tp-dp-8gpu.yaml").config)
    assert eight["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert eight["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    two = C.load(REPO / "configs" / "gpu-2x-graphs.yaml").config
    assert two.workload.cuda_graphs and two.job.backend == "nccl" and len(two.groups) == 2


@pytest.mark.parametrize("group, world, expected", [
    (Group(size=2), 4, [[0, 1], [2, 3]]),
    (Group(size=2, stride=2), 4, [[0, 2], [1, 3]]),
    (Group(size=2, stride=2), 8, [[0, 2], [1, 3], [4, 6], [5, 7]]),
    (Group(size=1), 2, [[0], [1]]),
    (Group(ranks=[0, 3]), 4, [[0, 3]]),
    (Group(ranks=[[0, 1, 2], [3]]), 4, [[0, 1, 2], [3]]),
])
def test_layout(group, world, expected):
    assert groups.layout(group, world) == expected


# -- bad input: one clear error naming FILE:LINE key.path ---------------------------------------
BAD = {
    "unknown key": ("""
        job:
          nproc_per_node: 2
        workload:
          stepz: 3
          collectives: [{op: all_reduce}]
        """, (), "exp.yaml:4 workload.stepz: unknown key 'stepz'; did you mean 'steps'?"),
    "unknown key in a list item": ("""
        workload:
          collectives:
            - op: all_reduce
              sise: 4
        """, (), "exp.yaml:4 workload.collectives[0].sise: unknown key 'sise'; did you mean 'size'?"),
    "wrong type": ("""
        job:
          nproc_per_node: two
        workload: {collectives: [{op: all_reduce}]}
        """, (), "exp.yaml:2 job.nproc_per_node: Input should be a valid integer, got 'two'"),
    "misspelt op": ("""
        workload:
          collectives:
            - {op: allreduce}
        """, (), "exp.yaml:3 workload.collectives[0].op: Input should be"),
    "bad backend": ("""
        job: {backend: ncl}
        workload: {collectives: [{op: all_reduce}]}
        """, (), "exp.yaml:1 job.backend: Input should be 'gloo' or 'nccl', got 'ncl'; did you mean 'nccl'?"),
    "layout does not divide the world": ("""
        job: {nproc_per_node: 4}
        groups:
          tp:
            size: 3
        workload: {collectives: [{op: all_reduce, group: tp}]}
        """, (), "exp.yaml:4 groups.tp.size: size 3 does not divide the world size 4"),
    "stride does not divide the world": ("""
        job: {nproc_per_node: 4}
        groups:
          dp: {size: 2, stride: 3}
        workload: {collectives: [{op: all_reduce}]}
        """, (), "exp.yaml:3 groups.dp.size: size 2 × stride 3 = 6 does not divide the world size 4"),
    "rank that does not exist": ("""
        job: {nproc_per_node: 4}
        groups:
          pair:
            ranks:
              - [0, 1]
              - [2, 9]
        workload: {collectives: [{op: all_reduce}]}
        """, (), "exp.yaml:6 groups.pair.ranks[1][1]: rank 9 does not exist (world size 4: ranks 0-3)"),
    "rank in two groups of a name": ("""
        groups:
          pair: {ranks: [[0, 1], [1]]}
        workload: {collectives: [{op: all_reduce}]}
        """, (), "exp.yaml:2 groups.pair.ranks[1][0]: rank 1 is also in group 0"),
    "unknown group": ("""
        groups: {tp: {size: 2}}
        workload:
          collectives:
            - {op: all_reduce, group: tpp}
        """, (), "exp.yaml:4 workload.collectives[0].group: unknown group 'tpp'; did you mean 'tp'?"),
    "root outside the group": ("""
        workload:
          collectives:
            - {op: broadcast, root: 2}
        """, (), "exp.yaml:3 workload.collectives[0].root: root 2 is outside group 'world' of 2 ranks"),
    "size not split evenly": ("""
        workload:
          collectives:
            - op: reduce_scatter_tensor
              size: 7
        """, (), "exp.yaml:4 workload.collectives[0].size: reduce_scatter_tensor splits its input over the 2 ranks of 'world': 7 elements is not a multiple of 2"),
    "missing entrypoint module": ("""
        workload:
          entrypoint: no_such_module_xyz:build
        """, (), "exp.yaml:2 workload.entrypoint: module 'no_such_module_xyz' not found"),
    "entrypoint not module:function": ("""
        workload: {entrypoint: just_a_name}
        """, (), "exp.yaml:1 workload.entrypoint: 'just_a_name' is not 'module:function'"),
    "graphs with gloo": ("""
        workload:
          cuda_graphs: true
          collectives: [{op: all_reduce}]
        """, (), "exp.yaml:2 workload.cuda_graphs: CUDA graphs need job.backend nccl"),
    "barrier under graphs": ("""
        job: {backend: nccl}
        workload:
          cuda_graphs: true
          collectives:
            - {op: barrier}
        """, (), "exp.yaml:5 workload.collectives[0].op: a barrier cannot be captured in a CUDA graph"),
    "several nodes need an endpoint": ("""
        job:
          nnodes: 2
        workload: {collectives: [{op: all_reduce}]}
        """, (), "exp.yaml:1 job.rdzv_endpoint: is required with nnodes > 1"),
    "endpoint is host:port": ("""
        job: {nnodes: 2, rdzv_endpoint: "node0"}
        workload: {collectives: [{op: all_reduce}]}
        """, (), "exp.yaml:1 job.rdzv_endpoint: 'node0' is not host:port"),
    "NVLink multicast stays off": ("""
        job:
          env: {NCCL_NVLS_ENABLE: "1"}
        workload: {collectives: [{op: all_reduce}]}
        """, (), "exp.yaml:2 job.env.NCCL_NVLS_ENABLE: NVLink multicast stays off"),
    "profiler schedule longer than the steps": ("""
        workload:
          steps: 2
          collectives: [{op: all_reduce}]
        profile: {warmup: 1, active: 2}
        """, (), "exp.yaml:2 workload.steps: 2 steps are fewer than the profiler schedule needs: 3"),
    "nothing to run": ("""
        workload: {steps: 4}
        """, (), "exp.yaml:1 workload: nothing to run"),
    "transformer heads over tp": ("""
        job: {nproc_per_node: 4}
        workload:
          transformer:
            heads: 6
            hidden: 192
        """, (), "exp.yaml:4 workload.transformer.heads: 6 heads cannot be split over the 4 ranks of 'world'"),
    "duplicate key": ("""
        job:
          nproc_per_node: 2
          nproc_per_node: 4
        workload: {collectives: [{op: all_reduce}]}
        """, (), "exp.yaml:3 job.nproc_per_node: duplicate key (first given on line 2)"),
    "YAML syntax": ("""
        job:
          nproc_per_node: [2
        workload: {}
        """, (), "exp.yaml:3: invalid YAML"),
    "unknown key from --set": ("""
        workload: {collectives: [{op: all_reduce}]}
        """, ("job.nprocs=3",), "--set job.nprocs=3 job.nprocs: unknown key 'nprocs'"),
    "bad value from --set": ("""
        workload: {collectives: [{op: all_reduce}]}
        """, ("workload.collectives[0].size=6B",),
        "--set workload.collectives[0].size=6B workload.collectives[0].size: 6B is not a whole number of float32 elements (4 bytes each)"),
    "unsettable --set": ("""
        workload: {collectives: [{op: all_reduce}]}
        """, ("workload.collectives[3].size=1",), "--set workload.collectives[3].size=1: workload.collectives[3] is not there to set"),
    "bad run name placeholder": ("""
        workload: {collectives: [{op: all_reduce}]}
        output: {run_name: "{name}-{date}"}
        """, (), "exp.yaml:2 output.run_name: bad placeholder 'date'"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_names_line_and_key(tmp_path, case):
    text, overrides, expected = BAD[case]
    path = write(tmp_path, text)
    message = str(error_of(path, overrides)).replace(str(tmp_path) + "/", "")
    assert message.startswith(expected), message


def test_every_problem_is_listed_in_file_order(tmp_path):
    path = write(tmp_path, """
        job: {nproc_per_node: 4}
        groups:
          tp: {size: 3}
        workload:
          collectives:
            - {op: broadcast, group: world, root: 7}
            - {op: all_reduce, group: nope}
        """)
    err = error_of(path)
    assert [p.split(" ")[0].rsplit(":", 1)[1] for p in err.problems] == ["3", "6", "7"]
    assert "groups.tp.size" in err.problems[0] and "unknown group 'nope'" in err.problems[2]


def test_entrypoint_function_missing_and_module_failing(tmp_path):
    (tmp_path / "myjob.py").write_text("def build(ctx):\n    return lambda: None\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom at import')\n")
    ok = write(tmp_path, """
        workload:
          entrypoint: myjob:build
          pythonpath: ["."]
        """)
    assert C.load(ok).config.workload.entrypoint == "myjob:build"
    missing = write(tmp_path, """
        workload:
          entrypoint: myjob:biuld
          pythonpath: ["."]
        """, "missing.yaml")
    assert "missing.yaml:2 workload.entrypoint: module 'myjob' has no function 'biuld'; " \
           "did you mean 'build'?" in str(error_of(missing))
    broken = write(tmp_path, """
        workload:
          pythonpath: ["."]
          entrypoint: broken:build
        """, "broken.yaml")
    assert "broken.yaml:3 workload.entrypoint: importing 'broken' failed: RuntimeError: boom " \
           "at import" in str(error_of(broken))


def test_nccl_without_gpus_is_refused_before_launch(tmp_path):
    path = write(tmp_path, """
        job:
          nproc_per_node: 2
          backend: nccl
        workload: {collectives: [{op: all_reduce}]}
        """)
    loaded = C.load(path)              # valid as a config: a GPU machine could run it
    with pytest.raises(ConfigError) as info:
        C.check_environment(loaded, gpus=0)
    assert str(info.value) == f"{path}:3 job.backend: nccl needs one CUDA GPU per rank: " \
                              "nproc_per_node is 2, this machine has 0"
    C.check_environment(loaded, gpus=2)


def test_nccl_without_gpus_through_the_cli(tmp_path, capsys):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has the GPUs")
    code = cli.main(["launch", str(REPO / "configs" / "gpu-2x-graphs.yaml"),
                     "--set", f"output.dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2 and "gpu-2x-graphs.yaml:8 job.backend: nccl needs one CUDA GPU per rank" in err
    assert not any(tmp_path.iterdir())     # nothing started, no run dir


# -- --set ------------------------------------------------------------------------------------
def test_overrides(tmp_path):
    path = write(tmp_path, """
        job: {nproc_per_node: 2}
        workload:
          collectives:
            - {op: all_reduce, size: 8}
            - {op: broadcast}
        """)
    cfg = C.load(path, ["job.nproc_per_node=4", "workload.collectives[0].size=1MiB",
                        "workload.collectives.1.root=3", "workload.cuda_graphs=false",
                        "groups.tp={size: 2}", "job.env.NCCL_DEBUG=INFO",
                        "workload.collectives[2]={op: all_gather, group: tp}",
                        "name=renamed"]).config
    assert cfg.job.nproc_per_node == 4 and cfg.world_size == 4
    ops = cfg.workload.collectives
    assert (ops[0].size, ops[1].root, ops[2].op, ops[2].group) == ("1MiB", 3, "all_gather", "tp")
    assert groups.layout(cfg.groups["tp"], 4) == [[0, 1], [2, 3]]
    assert cfg.job.env == {"NCCL_DEBUG": "INFO"} and cfg.name == "renamed"


def test_parse_key():
    assert C.parse_key("a.b[0].c") == ("a", "b", 0, "c") == C.parse_key("a.b.0.c")
    for bad in ("", "a..b", "a.[0]x", "a b=c"):
        with pytest.raises(ValueError):
            C.parse_key(bad)


# -- resolving and --dry-run ------------------------------------------------------------------
def test_resolve_makes_paths_absolute_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "job2.py").write_text("def build(ctx):\n    return lambda: None\n")
    path = write(tmp_path, """
        name: rt
        workload:
          entrypoint: job2:build
          pythonpath: [code]
        output: {dir: out, run_name: "{name}-{world}-{time}"}
        """)
    cfg = resolve(C.load(path))
    assert cfg.output.dir == str(tmp_path / "out")
    assert cfg.output.run_name.startswith("rt-2-") and "{" not in cfg.output.run_name
    assert cfg.workload.pythonpath == [str(tmp_path / "code")]
    assert cfg.job.rdzv_endpoint.startswith("127.0.0.1:")
    again = C.load_text(C.dump(cfg), "resolved", tmp_path / "elsewhere").config
    assert again == cfg


def test_dry_run_prints_torchrun_for_both_nodes(tmp_path, capsys):
    cfg_path = REPO / "configs" / "multinode.yaml"
    code = cli.main(["launch", str(cfg_path), "--dry-run", "--set", f"output.dir={tmp_path}"])
    out = capsys.readouterr().out
    assert code == 0 and not any(tmp_path.iterdir())
    lines = out.splitlines()
    run_dir = tmp_path / "multinode-multinode-001"
    assert f"run dir: {run_dir}" in lines
    assert "group dp: [[0, 4], [1, 5], [2, 6], [3, 7]]" in lines
    commands = {}
    for i, line in enumerate(lines):
        if line.startswith("# node "):
            node = int(line.split()[2].rstrip(":"))
            assert shlex.split(line.split(": ", 1)[1])[-2:] == ["--node-rank", str(node)]
            commands[node] = shlex.split(lines[i + 1])
    assert sorted(commands) == [0, 1]
    for node, argv in commands.items():
        env = dict(a.split("=", 1) for a in itertools.takewhile(lambda a: "=" in a, argv))
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
        assert env["NVSHMEM_DISABLE_NVLS"] == "1" and env["NCCL_SOCKET_IFNAME"] == "eth0"
        cmd = argv[len(env):]
        assert cmd[1:3] == ["-m", "commviz.launch.elastic"]     # torchrun, results kept
        opts = dict(zip(cmd[3::2], cmd[4::2]))
        assert opts["--nnodes"] == "2" and opts["--nproc_per_node"] == "4"
        assert opts["--node_rank"] == str(node) and opts["--rdzv_backend"] == "c10d"
        assert opts["--rdzv_endpoint"] == "node0.example.com:29500"
        assert opts["--rdzv_id"] == "multinode-001"
        assert opts["--rdzv_conf"] == "join_timeout=600"     # job.join_timeout_s's default
        assert cmd[-4:] == ["-m", "commviz.launch.worker", "--config", str(run_dir / "config.yaml")]


def test_node_rank_outside_the_job(capsys):
    code = cli.main(["launch", str(REPO / "configs" / "multinode.yaml"), "--dry-run",
                     "--node-rank", "2"])
    assert code == 2
    assert "--node-rank: 2 is not a node of this job (job.nnodes is 2: 0-1)" in \
        capsys.readouterr().err


def test_schema_documents_every_key():
    from pydantic import BaseModel

    from commviz.launch import config_schema as S

    for model in (S.Config, S.Job, S.Group, S.Collective, S.Transformer, S.Workload, S.Profile,
                  S.Record, S.Output):
        for name, f in model.model_fields.items():
            section = isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
            assert section or f.description, f"{model.__name__}.{name} has no description"


def test_an_existing_run_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "commviz_rank0.pkl").write_bytes(b"an earlier run")
    code = cli.main(["launch", "--set", f"output.dir={tmp_path}", "--set", "output.run_name=run"])
    err = capsys.readouterr().err
    assert code == 2 and f"{tmp_path / 'run'} already holds a run" in err
    assert "--set output.run_name=run output.run_name" in err
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["commviz_rank0.pkl"]


def test_schema_and_group_errors_come_in_one_pass(tmp_path):
    """A wrong type and a root outside its group: both named by one load, not in rounds."""
    path = tmp_path / "both.yaml"
    path.write_text("name: both\nworkload:\n  seed: x\n  collectives:\n"
                    "    - op: broadcast\n      root: 5\n      size: 64\n")
    with pytest.raises(ConfigError) as info:
        C.load(path)
    text = "\n".join(info.value.problems)
    assert f"{path}:3 workload.seed" in text
    assert f"{path}:6 workload.collectives[0].root: root 5 is outside group 'world'" in text
    assert len(info.value.problems) == 2
