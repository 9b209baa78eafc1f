"""``commviz.debug_handler(run_dir)``: the commviz page for torch's debug server, and the
``live.debug_server`` launch key that starts that server with it on every rank.

torch's debug server (``torch.distributed.debug.start_debug_server``, experimental in 2.13)
needs jinja2, aiohttp and tabulate (the extra ``debug-server``). Where torch or those lack it,
``debug_handler`` raises one ``CommvizError`` saying so and pointing at ``commviz serve``, which
shows the same page from a process of its own; the launch then says it once and the job runs on
without the server.

    from torch.distributed.debug import start_debug_server
    from torch.distributed.debug._debug_handlers import default_handlers
    import commviz

    start_debug_server(port=25999, handlers=default_handlers() + [commviz.debug_handler(run_dir)],
                       start_method="spawn")
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from commviz.errors import CommvizError
from commviz.serve.live import DEFAULT_INTERVAL_S

FALLBACK = "commviz serve RUN_DIR shows the same page without it (docs/serve.md)"


def _torch_lacks(exc: BaseException) -> CommvizError:
    import torch

    return CommvizError(f"torch {torch.__version__} has no usable debug server "
                        f"(torch.distributed.debug: {type(exc).__name__}: {exc}); {FALLBACK}")


def debug_handler(run_dir: str | Path, interval: float = DEFAULT_INTERVAL_S,
                  nccl: bool = False) -> Any:
    """A ``torch.distributed.debug`` ``DebugHandler`` serving ``run_dir``'s live panel at
    ``/commviz`` (``nccl``: link late ranks to the NCCL Flight Recorder page)."""
    try:
        from commviz.serve.torchpage import CommvizHandler
    except ImportError as exc:
        raise _torch_lacks(exc) from None
    return CommvizHandler(run_dir, interval, nccl)


_FRONTEND: list[bool] = []         # this rank started the frontend (rank 0)


def start_in_job(run_dir: Path, port: int, rank: int, nccl: bool) -> None:
    """Start torch's debug server on this rank with torch's pages and commviz's (rank 0 serves
    the frontend on ``port``); where it cannot start, rank 0 says why and the job goes on."""
    try:
        handler = debug_handler(run_dir, nccl=nccl)
        from torch.distributed.debug import start_debug_server
        from torch.distributed.debug._debug_handlers import default_handlers

        start_debug_server(port=port, handlers=default_handlers() + [handler],
                           start_method="spawn")
    # torch's server is experimental: another torch's may lack a module, a name or an argument
    except (CommvizError, ImportError, AttributeError, TypeError, RuntimeError, OSError) as exc:
        if rank == 0:
            said = exc if isinstance(exc, CommvizError) else _torch_lacks(exc)
            print(f"[commviz] live.debug_server: not started: {said}", file=sys.stderr,
                  flush=True)
        return
    if rank == 0:
        _FRONTEND.append(True)
        print(f"[commviz] live.debug_server: torch's debug server starting on port {port}, "
              "commviz's page at /commviz", file=sys.stderr, flush=True)


def stop_in_job() -> None:
    """Stop the frontend process rank 0 started (it would outlive ``os._exit``; the other
    ranks' worker servers are threads that end with their process, and torch's
    ``stop_debug_server`` refuses a rank without a frontend)."""
    if _FRONTEND:
        from torch.distributed.debug import stop_debug_server

        _FRONTEND.clear()
        stop_debug_server()
