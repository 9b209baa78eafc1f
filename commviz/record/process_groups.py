"""The job's registry of process groups: what each group torch.distributed knows is (its
``GroupInfo``), looked up once, and the torch objects a record names (dtypes, reduce ops) as the
profiler writes them.

It asks torch.distributed, so it lives here in the job's room and not in ``commviz.metadata``,
the vocabulary every after-the-job reader imports without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from commviz.metadata import SIDE_GROUP_DESC, UNDESCRIBED, GroupInfo, lane_id

if TYPE_CHECKING:
    import torch

_DTYPES: dict[torch.dtype, tuple[str, int]] = {}


def dtype_info(dtype: torch.dtype) -> tuple[str, int]:
    """(c10's ScalarType name, the profiler's "dtype" format: "Float", "BFloat16"; item size)."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        pass
    import torch

    try:
        name = torch.empty(0, dtype=dtype).type().rsplit(".", 1)[-1].removesuffix("Tensor")
    except (TypeError, RuntimeError):
        name = str(dtype).removeprefix("torch.")
    info = _DTYPES[dtype] = (name, dtype.itemsize)
    return info


_REDUCE_OP_NAMES: dict[Any, str] = {}


def reduce_op_name(op: Any) -> str:
    """Lower-case name of a ReduceOp ("sum", "avg", "premul_sum", ...)."""
    try:
        return _REDUCE_OP_NAMES[op]
    except (KeyError, TypeError):
        pass
    text = str(op)
    name = text.rsplit(".", 1)[-1].lower()
    if "premul" in text.lower():
        name = "premul_sum"
    try:
        _REDUCE_OP_NAMES[op] = name
    except TypeError:
        pass
    return name


_GROUPS: dict[int, GroupInfo] = {}


_dist: Any = None    # torch.distributed once group_info imported it (an import a call costs more)


def _torch_distributed() -> Any:
    global _dist
    import torch.distributed as dist

    _dist = dist
    return dist


def group_info(group: Any = None) -> GroupInfo:
    """The cached ``GroupInfo`` of ``group`` (``None`` means the world group)."""
    dist = _dist or _torch_distributed()
    pg = dist.group.WORLD if group is None else group
    info = _GROUPS.get(id(pg))
    if info is not None and info.pg is pg:
        return info
    if pg is dist.GroupMember.NON_GROUP_MEMBER:
        info = GroupInfo(pg=pg, name="", desc="", ranks=[], backend="none", lane=0,
                         member=False)
        _GROUPS[id(pg)] = info
        return info
    name = getattr(pg, "group_name", None) or dist.distributed_c10d._get_process_group_name(pg)
    desc = getattr(pg, "group_desc", None) or ("default_pg" if name == "0" else UNDESCRIBED)
    try:
        backend = str(dist.get_backend(pg))
    except Exception:  # a group this rank is not part of has no backend here
        backend = "unknown"
    info = GroupInfo(pg=pg, name=str(name), desc=str(desc),
                     ranks=list(dist.get_process_group_ranks(pg)), backend=backend,
                     lane=lane_id(str(name)), my_rank=dist.get_rank(),
                     first_seq=backend_seq(pg) or 0)
    _GROUPS[id(pg)] = info
    return info


def backend_seq(pg: Any) -> int | None:
    """The number ``pg``'s backend gave its last collective (Flight Recorder's
    collective_seq_id, for gloo and NCCL alike), or None where the backend keeps none.

    commviz numbers a group's collectives from it where it did not see the calls before: a
    group first seen after it was used (``commviz.start()`` late in a job), and every group
    when recording is turned back on."""
    try:
        return int(pg._get_sequence_number_for_group())
    except Exception:  # no such backend call (a fake or third-party backend), a torn-down group
        return None


def follow_backend_numbering() -> None:
    """Take each seen group's numbering from its backend: recording was off, so calls made
    meanwhile were not counted."""
    for info in seen_groups():
        seq = backend_seq(info.pg) if info.pg is not None else None
        if seq is not None:
            info.last_seq = seq


_BY_NAME: dict[str, GroupInfo] = {}


def group_by_name(name: str) -> GroupInfo:
    """The ``GroupInfo`` of the process group torch knows by ``name`` (the c10d boundary sees
    groups by name). A group made after the last look-up is found by looking again."""
    import torch.distributed as dist

    info = _BY_NAME.get(name)
    if info is not None:
        return info
    for pg, pg_name in list(dist.distributed_c10d._world.pg_names.items()):
        if pg_name == name:
            info = group_info(pg)
            break
    else:  # not registered with torch.distributed (a bare backend): what the name tells
        info = GroupInfo(pg=None, name=name, desc=UNDESCRIBED, ranks=[], backend="unknown",
                         lane=lane_id(name), my_rank=dist.get_rank() if dist.is_initialized()
                         else 0)
    _BY_NAME[name] = info
    return info


def known_groups() -> list[GroupInfo]:
    """Every process group torch.distributed knows of on this rank, world group first."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return []
    world = dist.distributed_c10d._world
    infos = []
    for pg in list(world.pg_names):
        try:
            infos.append(group_info(pg))
        except Exception:  # a group being torn down: skip it, the others still count
            continue
    return sorted((i for i in infos if i.desc != SIDE_GROUP_DESC),
                  key=lambda i: (i.name != "0", i.name))


def seen_groups() -> list[GroupInfo]:
    """Groups commviz has looked up on this rank (still known after they are destroyed)."""
    return [i for i in _GROUPS.values() if i.member and i.desc != SIDE_GROUP_DESC]
