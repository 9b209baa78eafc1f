"""A slow first ``import torch`` in every rank, as on a fresh node: on PYTHONPATH, Python runs
this at start-up; in a process torchrun started (``RANK`` set) with ``HOLD_TORCH_IMPORT_S``
set, the first import of torch waits that long before it goes on. The launcher, torchrun and
other processes are left alone."""

import os
import sys
import time


class _Hold:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            time.sleep(float(os.environ["HOLD_TORCH_IMPORT_S"]))
        return None


if "RANK" in os.environ and os.environ.get("HOLD_TORCH_IMPORT_S"):
    sys.meta_path.insert(0, _Hold())
