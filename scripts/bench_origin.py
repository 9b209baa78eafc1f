"""What working out a DTensor origin costs per call, in Python (``commviz.record.origins``).

A DTensor redistribute's origin is worked out per call (layers called in a loop share call
site and sizes): the live frames are read (``frames.read``) and the innermost module named
(``names.module_name``). This prints the thread CPU time of those two for a redistribute
``--depth`` modules deep (default 8, about a transformer block's nesting under its model),
median and best of ``--rounds`` rounds of ``--calls`` calls. No process group: the stack is
real nn.Module calls down to a function compiled under DTensor's own file and name, which is
all ``read`` looks at. Run it on two trees (``PYTHONPATH=OTHER_TREE``) to compare them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

import torch

from commviz.record import calls
from commviz.record.origins import dtensor, frames, names
from commviz.record.recorder import RECORDER


def _stack(depth: int) -> torch.nn.Module:
    """``depth`` nested modules, the innermost calling DTensor's redistribute_local_tensor
    (a stand-in compiled under that file and name), which calls the measure."""
    scope: dict[str, Any] = {}
    exec(compile("def redistribute_local_tensor(measure):\n    return measure()\n",
                 dtensor.redistribute_file(), "exec"), scope)

    class Nested(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module | None) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, measure: Callable[[], float]) -> float:
            if self.inner is None:
                return scope["redistribute_local_tensor"](measure)
            return self.inner(measure)

    model = None
    for _ in range(depth):
        model = Nested(model)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()

    state = RECORDER.origins

    def measure() -> float:
        caller = sys._getframe(1)
        start = time.thread_time_ns()
        for _ in range(args.calls):
            names.module_name(frames.read(caller, calls.own_code, state.looks).modules,
                              state.modules)
        return (time.thread_time_ns() - start) / args.calls / 1000

    model = _stack(args.depth)
    runs = [model(measure) for _ in range(args.rounds)]
    print(f"read + module_name, {args.depth} modules deep ({frames.__file__}): "
          f"median {statistics.median(runs):.2f} us, best {min(runs):.2f} us per call")


if __name__ == "__main__":
    main()
