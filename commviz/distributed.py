"""Drop-in torch.distributed that records: ``import commviz.distributed as dist``.

It is torch.distributed itself, every function and object unchanged (``dist.isend`` *is*
``torch.distributed.isend``, so ``P2POp``, ``batch_isend_irecv`` and torch's warnings behave as
they do without commviz). Importing it installs commviz's c10d boundary recorder
(``commviz.record.boundary``, the same step ``commviz.start`` and ``commviz.patch`` take), which
records each collective once, where it enters c10d, whoever issues it.
"""

from __future__ import annotations

from torch.distributed import *  # noqa: F401,F403 - the whole API, unchanged
from torch.distributed import ReduceOp, GroupMember, P2POp  # noqa: F401 - not in torch's __all__

from commviz.patching import patch as _patch

_patch()
