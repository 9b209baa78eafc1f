"""One ``commviz launch`` per node under Slurm's ``srun``: the job's shape from Slurm's environment.

Inside an srun step (``SLURM_STEP_ID`` set) the launch takes what the config leaves out: the node
count (``SLURM_STEP_NUM_NODES``, else ``SLURM_JOB_NUM_NODES``), this node's rank
(``SLURM_NODEID``), the rendezvous endpoint (the step's first host, from ``SLURM_STEP_NODELIST``
in Slurm's hostlist syntax, at port ``PORT_BASE`` + job id mod 1000, so two jobs sharing a first
node do not meet) and the rendezvous id (``SLURM_JOB_ID``: a new one per job, which also names
the run dir on every node). Outside srun (the batch script itself, a plain shell) nothing is
taken: that launch is one node.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

PORT_BASE = 29400          # torch's default c10d rendezvous port
_RANGE = re.compile(r"^(\d+)-(\d+)$")


@dataclass(frozen=True)
class Step:
    """What Slurm says about this srun step; each value with the variable it came from."""

    nnodes: tuple[int, str]
    node_rank: tuple[int, str]
    endpoint: tuple[str, str]
    job_id: tuple[str, str]
    tasks: int | None               # SLURM_STEP_NUM_TASKS: one per node is what we need


def hostnames(nodelist: str) -> list[str]:
    """Expand Slurm's hostlist: ``"gpu[01-03,07],login1"`` -> gpu01 gpu02 gpu03 gpu07 login1."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?([^,]*)", nodelist):
        prefix, ranges, suffix = m.groups()
        if ranges is None:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            r = _RANGE.match(part)
            if r is None:
                hosts.append(prefix + part + suffix)
                continue
            lo, hi = r.groups()
            hosts += [f"{prefix}{n:0{len(lo)}d}{suffix}" for n in range(int(lo), int(hi) + 1)]
    return hosts


def _first(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    return next(((environ[n], n) for n in names if environ.get(n)), None)


def step(environ: Mapping[str, str]) -> Step | None:
    """This srun step's shape, or None outside one (ValueError: Slurm's values do not read)."""
    if not environ.get("SLURM_STEP_ID") or not environ.get("SLURM_NODEID"):
        return None
    nnodes = _first(environ, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    nodelist = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    job_id = _first(environ, "SLURM_JOB_ID", "SLURM_JOBID")
    if nnodes is None or nodelist is None or job_id is None:
        raise ValueError("an srun step without SLURM_STEP_NUM_NODES, SLURM_STEP_NODELIST or "
                         "SLURM_JOB_ID")
    hosts = hostnames(nodelist[0])
    if not hosts or not job_id[0].isdigit() or not nnodes[0].isdigit():
        raise ValueError(f"cannot read {nodelist[1]}={nodelist[0]!r}, {nnodes[1]}={nnodes[0]!r} "
                         f"or {job_id[1]}={job_id[0]!r}")
    port = PORT_BASE + int(job_id[0]) % 1000
    tasks = environ.get("SLURM_STEP_NUM_TASKS")
    return Step(nnodes=(int(nnodes[0]), nnodes[1]),
                node_rank=(int(environ["SLURM_NODEID"]), "SLURM_NODEID"),
                endpoint=(f"{hosts[0]}:{port}", f"{nodelist[1]}={nodelist[0]}"),
                job_id=job_id, tasks=int(tasks) if tasks and tasks.isdigit() else None)


def defaults(s: Step) -> dict[tuple[str, ...], tuple[Any, str]]:
    """The config keys Slurm fills when the config leaves them out: key -> (value, source)."""
    return {("job", "nnodes"): (s.nnodes[0], f"{s.nnodes[1]}={s.nnodes[0]}"),
            ("job", "rdzv_endpoint"): s.endpoint,
            ("job", "rdzv_id"): (s.job_id[0], f"{s.job_id[1]}={s.job_id[0]}")}
