"""Where a live endpoint listens: loopback unless the address names another host.

One parser for the exporter's ``--address`` and the launch config's ``live.exporter`` key, so
both accept and refuse the same text.
"""

from __future__ import annotations

import re

LOOPBACK = "127.0.0.1"
_ADDRESS_RE = re.compile(r"^(?:(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.\-]+):)?(\d{1,5})$")


def parse_address(text: str) -> tuple[str, int]:
    """``"PORT"`` (on loopback), ``"HOST:PORT"`` or ``"[V6]:PORT"`` -> (host, port); port 0:
    any free one."""
    m = _ADDRESS_RE.match(text.strip())
    if m is None or int(m.group(2)) > 65535:
        raise ValueError(f"{text!r} is not an address: give PORT (on {LOOPBACK}), HOST:PORT "
                         "or [IPv6]:PORT, e.g. 127.0.0.1:9464")
    return (m.group(1) or LOOPBACK).strip("[]"), int(m.group(2))
