"""CUDA graph capture: which graph node is which collective (or marked compute), per replay.

- ``graph(cuda_graph, ...)``: ``torch.cuda.graph`` with commviz's capture records and replay tags.
- ``mark(name, stream=None)``: label the compute kernels of a block (captured or eager).
- ``install()`` / ``uninstall()``: the ``torch.cuda.CUDAGraph`` hooks behind both (installed
  by ``commviz.start``, ``commviz.patch`` and ``graph``; importing commviz installs nothing).
- ``region.enter`` / ``region.exit``: called by ``commviz.record.calls`` for collectives under
  capture, through ``commviz.record.capturing`` (which ``region`` fills in as it is imported).
- ``resolve_all()``: finish the capture records now; commviz does it before writing records.
"""

from commviz.lazy import lazy_api

_API = {"resolve_all": "commviz.capture.graphs", "graph": "commviz.capture.hooks",
        "install": "commviz.capture.hooks", "installed": "commviz.capture.hooks",
        "uninstall": "commviz.capture.hooks", "mark": "commviz.capture.marks"}

__all__ = sorted(_API)

__getattr__ = lazy_api(__name__, _API)
