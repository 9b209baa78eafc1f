"""One node's torchrun, leaving torch.distributed.elastic's own per-rank results in the run dir.

``python -m commviz.launch.elastic ARGS`` is ``torchrun ARGS`` (``torch.distributed.run.main``,
the same agent, output and exit code), except that when ranks fail, what the elastic agent knows
of each (``ChildFailedError.failures``: global rank -> ``ProcessFailure``: exit code, signal,
pid, the rank's error file and message, failure time) is written to the file named by
``RESULTS_ENV`` before torchrun reports it. The launcher and ``commviz report`` read those typed
results (``commviz.review.analyses.exits``, where the file is declared: ``ResultsFile``), never
torchrun's printed summary, which is not an API.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

from commviz.review.analyses.exits import RESULTS, FailureFile, ResultsFile

RESULTS_ENV = "COMMVIZ_ELASTIC_RESULTS"


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
    doc = ResultsFile(schema=RESULTS.schema, version=RESULTS.version, host=socket.gethostname(),
                      failures=[_failure(r, f) for r, f in sorted(failures.items())])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(RESULTS.dump_json(doc, indent=1))
    tmp.replace(path)


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
