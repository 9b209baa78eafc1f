"""Errors commviz reports to people: each names the file (or config key) it is about."""

from __future__ import annotations


class CommvizError(Exception):
    """Base of commviz's user-facing errors: the CLI prints these without a traceback."""


class SourceError(CommvizError):
    """Something wrong with one input file; ``source`` names it."""

    def __init__(self, source: str, message: str) -> None:
        super().__init__(f"{source}: {message}")
        self.source = source
        self.message = message


class RecordError(SourceError):
    """A record pickle that cannot be used (corrupt, hostile, wrong schema)."""


class TraceError(SourceError):
    """A profiler trace that cannot be used (corrupt JSON, empty, wrong rank)."""


class ConfigError(SourceError):
    """An experiment config that is invalid; ``source`` is ``file:line`` and the key path."""
