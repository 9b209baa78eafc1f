"""Errors commviz reports to people: each names the file (or config key) it is about."""

from __future__ import annotations

import errno


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


WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM,
                          errno.EFBIG})


class WriteError(SourceError):
    """An output that cannot be written (a full or read-only disk): the path and the errno."""


def cannot_write(exc: OSError, path: object = None) -> WriteError:
    """``exc`` as one line naming the path and the errno ("No space left on device")."""
    where = exc.filename if exc.filename is not None else path
    code = f" [{errno.errorcode.get(exc.errno, exc.errno)}]" if exc.errno else ""
    return WriteError(str(where), f"cannot write: {exc.strerror or exc}{code}")
