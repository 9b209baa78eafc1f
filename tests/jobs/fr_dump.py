"""torch's own Flight Recorder dump of a job's rank, the test's independent expectation.

``arm(path)``: the rank writes its dump to ``path`` when torchrun stops it (SIGTERM) and when
``dump(path)`` is called (at the job's end or failure). gloo leaves the dump's group table
empty, so it is filled from torch's own (``get_process_group_ranks``), as NCCL's dump has it.
Call ``arm`` before ``commviz.start``, which chains its handler in front of this one.
"""

import pickle
import signal
from pathlib import Path

import torch
import torch.distributed as td


def dump(path: Path) -> None:
    data = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    data["pg_config"] = {name: {"name": name, "desc": pg.group_desc,
                                "ranks": str(td.get_process_group_ranks(pg))}
                         for pg, name in td.distributed_c10d._world.pg_names.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(pickle.dumps(data))


def arm(path: Path) -> None:
    def on_term(signum, frame):             # torchrun stops the others: dump, then stop
        dump(path)
        raise SystemExit(1)

    signal.signal(signal.SIGTERM, on_term)
