"""Where a recorded call comes from: ``commviz.origin``, one short string, and its parts.

The user's call site says where a call was made; for communication a framework issues it says
little (``model(x)``, ``loss.backward()``) or nothing (DDP's reducer on an autograd thread).
So a record also names the unit of the model the call serves, in its framework's own words.
Each framework has a resolver, a module of its own here with the same small interface
(``base.Resolver``); ``RESOLVERS`` asks them in order, the first answer wins, and adding a
framework is adding its module to that list:

- ``dtensor``: a redistribute's module and placements (first: it names the module even
  inside FSDP's or a schedule's range); a gradient norm made whole (``clip_grad_norm_``);
- ``fsdp``: FSDP2's module and phase, from its ``FSDP::`` ranges;
- ``deepspeed``: its ZeRO stages' and engine's units, from its frames;
- ``megatron``: Megatron-core's tensor, pipeline, expert and data parallelism by module,
  layer and phase, from its frames;
- ``pipelining``: torch's pipeline stage, action and micro-batch, p2p transfers only;
- ``ddp``: the reducer's bucket;
- ``compiled``: the compiled function (``Torch-Compiled Region``);
- ``user``: the user's line, else the line that called ``backward()``: never None.

The boundary kernel keeps the chain of the ranges the resolvers read (``Resolver.prefixes``)
open on each thread as an id (kernels on the ops Python's ``record_function`` enters and exits
ranges through, ``boundary.cpp``: no RecordFunction callback, which would make c10d build a
profiling range of its own on every collective); a call's origin is worked out from that chain
and the live Python frames (one walk, ``frames.read``) once per call shape (what a call site
repeats, with its origin id), so natively recorded calls pay nothing per call for it, except
where a resolver says its answer holds for one call (``Refresh``). What the resolvers keep
lives in one ``State`` the recorder owns. ``COMMVIZ_ORIGIN_RANGES=off`` follows no ranges
(``prefixes`` says what that loses).
"""

from __future__ import annotations

import os
from types import CodeType, FrameType
from typing import Any, Callable

from commviz.record.origins import (compiled, ddp, deepspeed, dtensor, fsdp, megatron,
                                    pipelining, user)
from commviz.record.origins.base import Call, Origin, Refresh, Resolver
from commviz.record.origins.frames import read
from commviz.record.origins.state import State

RESOLVERS: tuple[Resolver, ...] = (
    dtensor.RESOLVER, fsdp.RESOLVER, deepspeed.RESOLVER, megatron.RESOLVER, pipelining.RESOLVER,
    ddp.RESOLVER, compiled.RESOLVER, user.RESOLVER)

__all__ = ["RESOLVERS", "Origin", "Refresh", "State", "prefixes", "resolve"]


def prefixes(state: State) -> tuple[str, ...]:
    """The range prefixes the boundary kernel follows; none with ``COMMVIZ_ORIGIN_RANGES=off``
    (origins then come from the frames alone: FSDP modules, DDP buckets without a hook and
    GPipe micro-batches are not named)."""
    return () if os.environ.get("COMMVIZ_ORIGIN_RANGES", "on") == "off" else state.prefixes()


def resolve(state: State, origin_id: int, op: str, kind: str, numel: int, nbytes: int,
            frame: FrameType | None, own: Callable[[CodeType], bool], count: bool = True
            ) -> tuple[dict[str, Any], Refresh]:
    """A call's origin keys, and what of them a later call of its shape must work out again
    (``count``: False where the call is only being looked at, not recorded)."""
    frames = read(frame, own, state.looks)
    call = Call(op, kind, numel, nbytes, frame, own, count, state.ranges(origin_id), frames,
                state)
    caches = state.caches       # the last resolver (``user``) always answers
    origin = next(o for r in state.resolvers if (o := r.resolve(call, caches[r.name])))
    return origin.as_keys(frames.backward), origin.refresh
