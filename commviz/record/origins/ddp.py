"""DDP: the reducer's bucket (``GradBucket.index()``): from the comm hook's ``bucket`` where a
hook runs, else in the reducer's own order (it reduces bucket 0, 1, ... after each forward,
``DdpCount``; the buckets' parameters as ``ddp_buckets`` read them); the unused-parameter map;
a collective inside ``DistributedDataParallel.forward`` (its buffers' broadcast). Per call:
buckets may share a size."""

from __future__ import annotations

from typing import Any

from commviz import metadata as md
from commviz.record import ddp_buckets
from commviz.record.origins.base import Call, Origin, Refresh, Resolver
from commviz.record.origins.user_names import param_name

FORWARD = "DistributedDataParallel.forward"   # the range the boundary kernel follows


class DdpCount:
    """The reducer's bucket order: it reduces bucket 0, 1, ... after each DDP forward
    (``prepare_for_backward``), so the n-th reducer all_reduce since the last forward is
    bucket n. Forwards are counted by the boundary kernel (``DistributedDataParallel.forward``
    ranges entered)."""

    def __init__(self) -> None:
        self.forwards = -1
        self.next = 0

    def take(self, forwards: int, count: bool) -> int:
        """The bucket of this call (``count``: False to look without taking it)."""
        if forwards != self.forwards:
            self.forwards, self.next = forwards, 0
        self.next += count
        return self.next - count


def _hooked(bucket: Any, params: dict[int, str]) -> ddp_buckets.Bucket | None:
    """What the comm hook's ``GradBucket`` holds."""
    held = bucket.parameters()
    if not held:
        return None
    buffer = bucket.buffer()
    return ddp_buckets.Bucket(len(held), buffer.numel() * buffer.element_size(),
                              param_name(held[0], params), param_name(held[-1], params))


def _bucket(index: int, nbytes: int, held: ddp_buckets.Bucket | None,
            extra: list[tuple[str, Any]]) -> Origin:
    extra = [(md.DDP_BUCKET, index), (md.DDP_BUCKET_BYTES, nbytes), *extra]
    if held is not None:
        extra += [(md.DDP_BUCKET_PARAMS, held.params), (md.DDP_BUCKET_BYTES, held.nbytes)]
        extra += [(key, name) for key, name in ((md.DDP_BUCKET_FIRST, held.first),
                                                (md.DDP_BUCKET_LAST, held.last)) if name]
    return Origin(f"DDP bucket {index}", md.OriginKind.DDP, f"bucket {index}", "all-reduce",
                  tuple(dict(extra).items()), Refresh.ALL)


def _resolve(call: Call, order: DdpCount) -> Origin | None:
    frames, native = call.frames, call.state.native
    if frames.bucket is not None:
        return _bucket(frames.bucket.index(), call.nbytes,
                       _hooked(frames.bucket, call.state.params), [])
    if frames.from_cpp and call.op == "all_reduce" and native is not None:
        forwards = native.origin_count(FORWARD)
        if forwards:
            index = order.take(forwards, call.count)
            if ddp_buckets.used_map(index, call.numel):
                return Origin("DDP unused-parameter map", md.OriginKind.DDP,
                              "unused parameters", "all-reduce", refresh=Refresh.ALL)
            return _bucket(index, call.nbytes, ddp_buckets.lookup(index, call.nbytes),
                           [(md.DDP_BUCKET_NUMEL, call.numel)])
    if FORWARD in call.ranges:
        return Origin("DDP forward", md.OriginKind.DDP, None, "forward")
    return None


RESOLVER = Resolver("DDP", _resolve, DdpCount, prefixes=(FORWARD,))
