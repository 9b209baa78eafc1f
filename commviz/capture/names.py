"""One comparable key per GPU kernel, whether its name is mangled (``cuFuncGetName`` at capture)
or demangled (the profiler's trace).

The key is the kernel's qualified name without template arguments, parameters or return type:
``_Z39ncclDevKernel_AllReduce_Sum_f32_RING_LL24ncclDevKernelArgsStorageILm4096EE`` and
``ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)`` both give
``ncclDevKernel_AllReduce_Sum_f32_RING_LL``;
``_ZN2at6native29vectorized_elementwise_kernelILi4E...`` and
``void at::native::vectorized_elementwise_kernel<4, ...>(int, ...)`` both give
``at::native::vectorized_elementwise_kernel``. Two instantiations of one template share a key:
the matcher treats such kernels as interchangeable and checks order, never the key alone.
"""

from __future__ import annotations

from functools import lru_cache

_ANON_MANGLED = "_GLOBAL__N_"  # GCC: _GLOBAL__N_1; NVCC: _GLOBAL__N__<hash>_<file>
_ANON = "(anonymous namespace)"


def _source_name(name: str, at: int) -> tuple[str | None, int]:
    """Read one ``<length><identifier>`` at ``at``; (None, at) when there is none."""
    end = at
    while end < len(name) and name[end].isdigit():
        end += 1
    if end == at:
        return None, at
    length = int(name[at:end])
    ident = name[end:end + length]
    if len(ident) != length:
        return None, at
    return (_ANON if ident.startswith(_ANON_MANGLED) else ident), end + length


def _from_mangled(name: str) -> str:
    at = 2                                   # after "_Z"
    if name.startswith("L", at):             # internal linkage
        at += 1
    if name.startswith("N", at):             # nested name: components until template args / end
        at += 1
        while at < len(name) and name[at] in "rVKRO":   # cv / ref qualifiers of a member
            at += 1
        parts = []
        if name.startswith("St", at):
            parts.append("std")
            at += 2
        while True:
            ident, at = _source_name(name, at)
            if ident is None:
                break
            parts.append(ident)
        return "::".join(parts) if parts else name
    if name.startswith("St", at):
        ident, _ = _source_name(name, at + 2)
        return f"std::{ident}" if ident else name
    ident, _ = _source_name(name, at)
    return ident or name


def _from_demangled(name: str) -> str:
    out: list[str] = []
    depth = 0
    i = 0
    while i < len(name):
        ch = name[i]
        if ch == "(" and depth == 0:
            if name.startswith(_ANON, i):
                out.append(_ANON)
                i += len(_ANON)
                continue
            break                            # the parameter list: the name is complete
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
        i += 1
    text = "".join(out).strip()
    # drop a return type ("void ns::kernel"): the name is the last space-free token
    # ("(anonymous namespace)" holds a space, so split on it only outside that token)
    head, sep, tail = text.replace(_ANON, "\0").rpartition(" ")
    return (tail if sep else text.replace(_ANON, "\0")).replace("\0", _ANON)


@lru_cache(maxsize=65536)
def kernel_key(name: str) -> str:
    """The comparable key of a kernel name (see the module docstring)."""
    name = name.strip()
    if name.startswith("_Z"):
        return _from_mangled(name)
    return _from_demangled(name)
