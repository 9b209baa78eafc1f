"""The launch config's schema: every key, its type, default and meaning (the README's table).

Models only check what one key can know on its own (types, ranges, spelling); everything that
needs the whole config (a group that does not divide the world, a root outside its group, an
entrypoint that does not import) is checked by ``commviz.launch.config.check`` so each error can
name the key it is about. Unknown keys are errors everywhere (``extra="forbid"``).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from commviz.live.address import parse_address

# Collective ops a ``workload.collectives`` entry may name (torch.distributed function names).
OPS = (
    "all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
    "reduce_scatter", "reduce_scatter_tensor", "all_to_all", "all_to_all_single",
    "gather", "scatter", "batch_isend_irecv", "barrier",
)
ROOTED_OPS = frozenset({"broadcast", "reduce", "gather", "scatter"})
REDUCING_OPS = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"})
# Ops whose input is split evenly over the group: ``size`` must be a multiple of its size.
SPLIT_OPS = frozenset({"reduce_scatter", "reduce_scatter_tensor", "all_to_all",
                       "all_to_all_single"})
FLOAT_DTYPES = ("float32", "float16", "bfloat16", "float64")
DTYPES = (*FLOAT_DTYPES, "int32", "int64", "int8", "uint8")
REDUCE_OPS = ("sum", "product", "min", "max", "avg")
WORLD = "world"   # the name of the default (whole-world) process group

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|KiB|MB|MiB|GB|GiB)\s*$")
_UNITS = {"B": 1, "KB": 10**3, "KiB": 2**10, "MB": 10**6, "MiB": 2**20, "GB": 10**9,
          "GiB": 2**30}
_ENDPOINT_RE = re.compile(r"^(\[[0-9a-fA-F:]+\]|[A-Za-z0-9_.\-]+):(\d{1,5})$")
NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")   # group names


class Strict(BaseModel):
    """Base of every section: unknown keys are errors, no silent type coercion."""

    model_config = ConfigDict(extra="forbid", strict=True)


def size_in_bytes(text: str) -> int:
    """``"4KiB"`` -> 4096 (units B, KB, KiB, MB, MiB, GB, GiB)."""
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(f"{text!r} is not a size: give elements as an integer or bytes with a "
                         "unit, e.g. 4096 or '1MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


class Job(Strict):
    """How many processes, where, and over which backend."""

    nnodes: int = Field(1, ge=1, description="nodes in the job; one `commviz launch` per node")
    nproc_per_node: int = Field(2, ge=1, description="processes (ranks) per node; one GPU each "
                                "with nccl")
    backend: Literal["gloo", "nccl"] = Field("gloo", description="torch.distributed backend of "
                                             "the world group and the default for named groups")
    rdzv_endpoint: str | None = Field(None, description="host:port of torchrun's c10d "
                                      "rendezvous; required with nnodes > 1; null: a free port "
                                      "on 127.0.0.1")
    rdzv_id: str = Field("commviz", description="rendezvous id, the same on every node; a new "
                         "one per job (under Slurm: the job id)")
    join_timeout_s: int = Field(600, ge=1, description="how long the rendezvous waits for every "
                                "node to join (torch's rdzv_conf join_timeout) before the launch "
                                "fails naming the nodes that did not")
    local_addr: str | None = Field(None, description="this node's address in the rendezvous "
                                   "(torchrun --local-addr; set per node with --set); c10d gives "
                                   "rank 0 to the node whose address sorts first; null: its "
                                   "host name")
    timeout_s: float = Field(300.0, gt=0, description="process-group timeout: a collective "
                             "stuck this long fails the rank")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment for "
                                "every rank (values are strings)")

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None:
            m = _ENDPOINT_RE.match(v)
            if m is None or not 0 < int(m.group(2)) < 65536:
                raise ValueError(f"{v!r} is not host:port (e.g. 'node0.example:29500')")
        return v


class Group(Strict):
    """A named process-group layout: blocks of ``size`` ranks ``stride`` apart, or explicit."""

    size: int | None = Field(None, ge=1, description="ranks per group; groups tile the world")
    stride: int = Field(1, ge=1, description="distance between a group's consecutive ranks: "
                        "1 gives [[0,1],[2,3]], 2 gives [[0,2],[1,3]] (size 2, 4 ranks)")
    ranks: list[list[int]] | None = Field(None, description="explicit groups, e.g. "
                                          "[[0, 1], [2, 3]] or one group [0, 2]")
    backend: Literal["gloo", "nccl"] | None = Field(None, description="null: job.backend")

    @field_validator("ranks", mode="before")
    @classmethod
    def _one_group(cls, v: Any) -> Any:
        """A flat list of ranks is one group."""
        if isinstance(v, list) and v and all(isinstance(r, int) for r in v):
            return [v]
        return v


class Collective(Strict):
    """One entry of the built-in collective mix, issued once per step (``repeat`` times)."""

    op: Literal[OPS] = Field(description="torch.distributed function: " + ", ".join(OPS))
    group: str = Field(WORLD, description="a name under `groups`, or `world`")
    size: int | str = Field(4096, description="the `tensor`/`input` argument per rank: "
                            "elements (int) or bytes with a unit ('1MiB')")
    dtype: Literal[DTYPES] = Field("float32", description="tensor dtype")
    reduce_op: Literal[REDUCE_OPS] | None = Field(None, description="reduction of all_reduce, "
                                                  "reduce, reduce_scatter(_tensor); null: sum; "
                                                  "avg needs nccl")
    root: int | None = Field(None, ge=0, description="broadcast/reduce/gather/scatter root, as "
                             "a rank within the group; null: 0, the group's first rank")
    async_op: bool = Field(False, description="issue with async_op=True; waited at the end of "
                           "the step")
    repeat: int = Field(1, ge=1, description="times this entry is issued per step")

    @field_validator("size", mode="plain")
    @classmethod
    def _size(cls, v: Any) -> int | str:
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise ValueError(f"expected elements (an integer) or bytes with a unit ('1MiB'), "
                             f"got {v!r}")
        if isinstance(v, int):
            if v < 1:
                raise ValueError(f"size must be at least 1 element, got {v}")
            return v
        if size_in_bytes(v) < 1:
            raise ValueError(f"size {v!r} is 0 bytes")
        return v.strip()


class Transformer(Strict):
    """The built-in tensor-parallel transformer block (Megatron-style column/row parallel)."""

    layers: int = Field(2, ge=1, description="blocks per step")
    batch: int = Field(2, ge=1, description="sequences per step")
    seq: int = Field(64, ge=1, description="tokens per sequence")
    hidden: int = Field(256, ge=1, description="model width")
    heads: int = Field(4, ge=1, description="attention heads (split over tp_group)")
    ffn_mult: int = Field(4, ge=1, description="MLP width = ffn_mult * hidden (split over "
                          "tp_group)")
    dtype: Literal[FLOAT_DTYPES] = Field("float32", description="activations and weights")
    tp_group: str = Field(WORLD, description="group whose all_reduce follows attention and MLP "
                          "in every layer")
    dp_group: str | None = Field(None, description="group that all-reduces a gradient-sized "
                                 "buffer once per step; null: none")


class Workload(Strict):
    """What each rank runs every step; the parts present run in this order each step."""

    steps: int = Field(4, ge=1, description="profiled steps (graph replays with cuda_graphs)")
    warmup_steps: int = Field(1, ge=0, description="eager steps before profiling (and before "
                              "capture); NCCL needs at least one before a capture")
    cuda_graphs: bool = Field(False, description="capture one step in a CUDA graph and replay "
                              "it every step (nccl only)")
    transformer: Transformer | None = Field(None, description="the built-in TP transformer block")
    collectives: list[Collective] | None = Field(None, description="the built-in collective mix")
    entrypoint: str | None = Field(None, description="'module:function' building a step: "
                                   "function(ctx) -> callable, ctx holds the process groups")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword data handed to the "
                                 "entrypoint as ctx.args")
    pythonpath: list[str] = Field(default_factory=list, description="directories added to "
                                  "sys.path for the entrypoint, relative to the config file")
    seed: int = Field(0, description="seed of the built-in workloads' tensors")


class Profile(Strict):
    """torch.profiler schedule around the steps (one trace per active window per rank)."""

    enabled: bool = Field(True, description="profile the steps and export per-rank traces")
    wait: int = Field(0, ge=0, description="steps skipped at the start of each cycle")
    warmup: int = Field(1, ge=0, description="steps traced but discarded before each window")
    active: int = Field(2, ge=1, description="steps recorded per window")
    repeat: int = Field(1, ge=0, description="windows (0: until the steps end)")
    record_shapes: bool = Field(False, description="ops' input shapes in the traces (commviz "
                                "needs none)")
    with_stack: bool = Field(False, description="Python stacks (large traces)")


class Record(Strict):
    """commviz's own per-rank recording."""

    capacity: int = Field(100_000, ge=1, description="collectives kept per rank (ring buffer)")


class Output(Strict):
    """Where the run goes and what happens after the job."""

    dir: str = Field("runs", description="parent of run dirs, relative to the working directory")
    run_name: str = Field("{name}-{time}", description="run dir name; placeholders {name}, "
                          "{time}, {rdzv_id}, {world}; with nnodes > 1 the default is "
                          "{name}-{rdzv_id} (the same on every node) and {time} is refused")
    merge: bool = Field(True, description="merge the per-rank traces when the job ends")
    gather: Literal["auto", "full", "tables"] = Field(
        "auto", description="what reaches rank 0's run dir: full (records and traces: one "
        "merged trace), tables (each rank's comm table only, tens of kB: the overview; shards "
        "and traces stay on their nodes), auto (full up to 16 ranks, tables above)")
    gather_traces: bool = Field(True, description="with a full gather, bring every rank's raw "
                                "profiler traces to rank 0's run dir when it is not shared; "
                                "false: a rank that made its Perfetto shard sends only the shard "
                                "and its record (the report then has no stream/overlap rows for "
                                "it)")
    format: Literal["pftrace", "json"] = Field("pftrace", description="merged trace format")
    report: bool = Field(True, description="write report.md after merging")


class Live(Strict):
    """What reads the always-on record while the job runs: processes beside the ranks, never
    inside them."""

    exporter: str | None = Field(None, description="serve the job's collectives as Prometheus "
                                 "metrics on /metrics at this address while it runs (`commviz "
                                 "exporter`, one per node, docs/prometheus.md): PORT on "
                                 "127.0.0.1, or HOST:PORT; null: none")

    watch: bool = Field(False, description="show `commviz watch` while the job runs: every "
                        "`watch_interval_s` the launch says per window the busiest group's skew, "
                        "bandwidth and wait and the late ranks with the origin they were late to "
                        "(CPU times), and keeps the windows in RUN_DIR/windows.jsonl for the "
                        "report's \"over the whole run\" (docs/watch.md)")
    watch_interval_s: float = Field(5.0, gt=0, description="seconds a watch window lasts")
    debug_server: int | None = Field(None, ge=1, le=65535, description="start torch's debug "
                                     "server (`torch.distributed.debug`, torch 2.13) on every "
                                     "rank, its frontend on rank 0 at this port (every "
                                     "interface: torch's choice), with commviz's live page at "
                                     "/commviz beside torch's stacks and Flight Recorder pages "
                                     "(docs/serve.md; needs the extra `debug-server`); where "
                                     "torch has none the launch says so and runs the job "
                                     "without it (`commviz serve` shows the same page); null: "
                                     "none")

    @field_validator("exporter", mode="before")
    @classmethod
    def _address(cls, v: object) -> object:
        if isinstance(v, int) and not isinstance(v, bool):
            v = str(v)                          # `exporter: 9464` in YAML: a port
        if isinstance(v, str):
            parse_address(v)
        return v


class Config(Strict):
    """A whole launch config (one YAML file)."""

    name: str = Field("commviz", description="experiment name, used in the run dir's name")
    job: Job = Field(default_factory=Job)
    groups: dict[str, Group] = Field(default_factory=dict, description="named process groups "
                                     "besides `world`")
    workload: Workload = Field(default_factory=Workload)
    profile: Profile = Field(default_factory=Profile)
    record: Record = Field(default_factory=Record)
    output: Output = Field(default_factory=Output)
    live: Live = Field(default_factory=Live)

    @property
    def world_size(self) -> int:
        return self.job.nnodes * self.job.nproc_per_node
