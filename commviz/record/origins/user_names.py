"""Names of things as their users wrote them: modules (``named_modules()``'s name in the
outermost module called, torch's wrappers left out) and DDP's parameters. The names seen so
far are kept in the recorder's origin state (``State.modules``, ``State.params``)."""

from __future__ import annotations

import gc
import re
import weakref
from typing import Any

# the segments torch's wrappers add to a module's name (activation checkpointing, compile,
# FSDP1): not the user's
_WRAPPERS = re.compile(r"(?:^|\.)(?:_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)"
                       r"(?=\.|$)")


class Names:
    """A name per live object, looked up by ``id`` (a hash and no weak reference made per
    look-up: a DTensor origin looks up two per call); an entry goes with its object."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, str]] = {}

    def get(self, obj: Any, default: str | None = None) -> str | None:
        entry = self._by_id.get(id(obj))
        return entry[1] if entry is not None and entry[0]() is obj else default

    def __setitem__(self, obj: Any, name: str) -> None:
        key = id(obj)
        self._by_id[key] = (weakref.ref(obj, lambda _, by_id=self._by_id: by_id.pop(key, None)),
                            name)


def as_written(name: str) -> str:
    """A module's name as the user wrote it: ``layers.0._checkpoint_wrapped_module.attention``
    is ``layers.0.attention``."""
    return _WRAPPERS.sub("", name).lstrip(".") if "_" in name else name


def module_name(modules: tuple[Any, ...], names: Names) -> str | None:
    """The fully qualified name of the innermost module being called (``named_modules()``'s
    name in the outermost one, wrappers left out); None outside any module call. A module
    called without its model around it (a block recomputed by activation checkpointing) keeps
    the name its model gave it."""
    return named(modules[0], modules[-1], names) if modules else None


def named(module: Any, root: Any, names: Names) -> str:
    """``module``'s name in ``root`` (its class name where it is not one of root's)."""
    name = names.get(module)
    if name is None or names.get(root) is None:
        prefix = names.get(root, "")
        for sub, m in root.named_modules():
            names[m] = as_written(f"{prefix}.{sub}" if prefix and sub else prefix or sub)
        name = names.get(module)
    return type(module).__name__ if name is None else name


def param_name(param: Any, params: dict[int, str]) -> str | None:
    """A DDP parameter's name in its module (``DistributedDataParallel.module``); the
    DDP instances are found once, and again when a parameter is new to them."""
    name = params.get(id(param))
    if name is None:
        from torch.nn.parallel import DistributedDataParallel

        for obj in gc.get_objects():
            if isinstance(obj, DistributedDataParallel):
                params.update((id(p), n) for n, p in obj.module.named_parameters())
        name = params.get(id(param))
    return name
