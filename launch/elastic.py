"""One node's torchrun, leaving torch.distributed.elastic's own per-rank results in the run dir.

``python -m commviz.launch.elastic ARGS`` is ``torchrun ARGS`` (``torch.distributed.run.main``,
the same agent, output and exit code), except that when ranks fail, what the elastic agent knows
of each (``ChildFailedError.failures``: global rank -> ``ProcessFailure``: exit code, signal,
pid, the rank's error file and message, failure time) is written to the file named by
``RESULTS_ENV`` before torchrun reports it. The launcher reads those typed results
(``results_of``), never torchrun's printed summary, which is not an API. Declared once
(``ResultsFile``)::

    {"schema": "commviz.elastic", "version": 1, "host": str,
     "failures": [{"rank": int, "local_rank": int, "pid": int, "exitcode": int,
                   "signal": str | null, "message": str, "error_file": str | null,
                   "timestamp": int}]}
"""

from __future__ import annotations

import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any, Literal

from typing_extensions import TypedDict

from commviz.errors import SourceError
from commviz.filetype import STRICT, FileType

RESULTS_ENV = "COMMVIZ_ELASTIC_RESULTS"
RESULTS_GLOB = "elastic_node*.json"


def results_name(node_rank: int) -> str:
    return f"elastic_node{node_rank}.json"


class FailureFile(TypedDict):
    __pydantic_config__ = STRICT  # type: ignore[misc]
    rank: int                   # torch's global rank
    local_rank: int
    pid: int
    exitcode: int               # negative: killed by that signal
    signal: str | None          # "SIGKILL" where a signal ended it
    message: str                # the rank's error file's message, or the agent's
    error_file: str | None      # the rank's error file (None: it wrote none)
    timestamp: int              # seconds since the epoch


class ResultsFile(TypedDict):
    """What one node's elastic agent said of its failed ranks."""

    __pydantic_config__ = STRICT  # type: ignore[misc]
    schema: Literal["commviz.elastic"]
    version: Literal[1]
    host: str
    failures: list[FailureFile]


FILE = FileType(ResultsFile, "elastic results")


def _failure(rank: int, f: Any) -> FailureFile:
    message = f.message["message"] if isinstance(f.message, dict) else f.message
    return FailureFile(rank=int(rank), local_rank=int(f.local_rank), pid=int(f.pid),
                       exitcode=int(f.exitcode),
                       signal=f.signal_name() if f.exitcode < 0 else None,
                       message=str(message or ""),
                       error_file=f.error_file if os.path.isfile(f.error_file) else None,
                       timestamp=int(f.timestamp))


def write_results(path: Path, failures: dict[int, Any]) -> None:
    """``failures``: ``ChildFailedError.failures``."""
    doc = ResultsFile(schema=FILE.schema, version=FILE.version, host=socket.gethostname(),
                      failures=[_failure(r, f) for r, f in sorted(failures.items())])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(FILE.dump_json(doc, indent=1))
    tmp.replace(path)


def results_of(log_dir: Path) -> list[ResultsFile]:
    """Every node's results in ``log_dir`` (one per node on a shared disk); an unreadable one
    is skipped with a warning naming it."""
    out = []
    for path in sorted(log_dir.glob(RESULTS_GLOB)):
        try:
            out.append(FILE.load(path))
        except SourceError as exc:
            warnings.warn(str(exc), stacklevel=2)
    return out


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    target = os.environ.get(RESULTS_ENV)
    try:
        torchrun.main(argv)
    except ChildFailedError as exc:
        if target:
            try:
                write_results(Path(target), exc.failures)
            except OSError as err:          # a full disk: torchrun's own report still follows
                print(f"[commviz] could not write {target}: {err}", file=sys.stderr)
        raise


if __name__ == "__main__":
    main()
