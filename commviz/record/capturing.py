"""The record side's hand-off to CUDA graph capture: the few calls it makes into it, one way.

The capture code (``commviz.capture``) reads and fills the recorder: its graph tables, the
calls the boundary kernel recorded under capture. The record side (``calls``, the boundary
kernel) must also reach the capture code, for a collective that may be captured. So that the
two do not import each other in a loop, the record side calls only the entries here, and
``commviz.capture.region`` fills them in when it is imported (``connect``): the capture code
subscribes, the recorder never imports it. Until then nothing counts as capturing; whatever
turns recording on (``commviz.start``, ``commviz.patch``, ``commviz.distributed``,
``annotate_collective``) imports the capture code first.

``calls`` looks ``capture_possible`` and ``installed`` up here on every call, and the boundary
kernel ``installed`` on a captured call, so a benchmark may replace them here. The boundary
kernel reads ``capture_possible`` from a flag of its own, which ``changed`` sets (the capture
code calls it when a capture begins or ends and when its hooks go in or out).
"""

from __future__ import annotations

from typing import Any, Callable


def capture_possible() -> bool:
    """Whether some stream may be capturing (the capture hooks count the captures open)."""
    return False


def capturing_here() -> bool:
    """Whether the current stream is capturing now (one cheap CUDA query, once connected)."""
    return False


def installed() -> bool:
    """Whether the ``torch.cuda.CUDAGraph`` hooks are in: the boundary kernel then records a
    synchronous captured call natively, for the hooks to place at the capture's end."""
    return False


def enter(rec: list[Any], walk: bool) -> Any:
    """Start a collective's capture region; returns the token for ``exit`` (None: none)."""
    return None


def exit(token: Any, rec: list[Any]) -> None:  # noqa: A001 - mirrors __exit__
    """End the region ``enter`` returned ``token`` for."""


def _unheard(possible: bool) -> None:
    """Until the boundary kernel is in, nobody keeps the flag."""


NOTIFY: Callable[[bool], None] = _unheard       # the boundary kernel's flag setter, once in


def changed() -> None:
    """What ``capture_possible`` says may have changed: set the boundary kernel's flag."""
    NOTIFY(capture_possible())


def connect(*, capture_possible: Callable[[], bool], capturing_here: Callable[[], bool],
            installed: Callable[[], bool], enter: Callable[[list[Any], bool], Any],
            exit: Callable[[Any, list[Any]], None]) -> None:  # noqa: A002
    """The capture code's entries, in place of the defaults above."""
    globals().update(capture_possible=capture_possible, capturing_here=capturing_here,
                     installed=installed, enter=enter, exit=exit)
    changed()
