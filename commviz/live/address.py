"""Where a live endpoint listens: loopback unless the address names another host.

One parser for the exporter's and ``commviz serve``'s ``--address`` and the launch config's
``live.exporter`` key, so all accept and refuse the same text.
"""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from commviz.errors import ConfigError

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


def checked(run_dir: Path, address: str, niceness: int) -> tuple[str, int]:
    """A live endpoint's start: its ``address`` parsed and ``run_dir`` checked, each refused
    with one error naming its argument; then the process lowered to ``niceness`` (a page or
    scrape never competes with the ranks for the CPU)."""
    try:
        host, port = parse_address(address)
    except ValueError as exc:
        raise ConfigError("--address", str(exc)) from None
    if not run_dir.is_dir():
        raise ConfigError("RUN_DIR", f"{run_dir} is not a directory")
    os.nice(niceness)
    return host, port


def add_address(p: argparse.ArgumentParser, port: int, elsewhere: str) -> None:
    """A live endpoint command's ``--address`` (``elsewhere``: what 0.0.0.0 is for)."""
    p.add_argument("--address", default=f"{LOOPBACK}:{port}",
                   help=f"HOST:PORT to serve on, or PORT on {LOOPBACK} (default "
                   f"{LOOPBACK}:{port}); 0.0.0.0:PORT {elsewhere}")
