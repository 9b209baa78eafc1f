"""The last resort, never None: the user's call site, else the line that called
``backward()`` (a call on autograd's device thread), else "no Python caller"."""

from __future__ import annotations

import os

from commviz import metadata as md
from commviz.record.origins.base import Call, Origin, Resolver


def _resolve(call: Call, _: None) -> Origin:
    frames = call.frames
    if frames.user is not None:
        code = frames.user.f_code
        return Origin(f"{os.path.basename(code.co_filename)}:{frames.user.f_lineno}",
                      md.OriginKind.USER)
    if frames.backward is not None:
        return Origin(f"backward ({os.path.basename(frames.backward)})", md.OriginKind.BACKWARD)
    return Origin(f"c10d {call.op} (no Python caller)", md.OriginKind.UNKNOWN)


RESOLVER = Resolver("user", _resolve)
