"""Writing and loading record files: atomic writes, and loads that can never run foreign code."""

from __future__ import annotations

import io
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

from commviz.errors import RecordError
from commviz.record import schema


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file + rename: readers see old or new, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def dump_record(path: str | os.PathLike[str], payload: dict[str, Any]) -> None:
    write_atomic(path, pickle.dumps(payload, protocol=4))


class _PlainUnpickler(pickle.Unpickler):
    """Builds only dicts, lists, tuples, sets, strings, bytes, numbers, bools and None.

    Anything that needs a class or function (``GLOBAL``/``STACK_GLOBAL``, hence ``REDUCE``,
    ``BUILD``, ``INST``, ``OBJ``) is refused before it is looked up, so nothing is imported
    or called; persistent ids are refused too.
    """

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused to load {module}.{name}: records hold plain data only")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("refused a persistent id: records hold plain data only")


def loads_plain(data: bytes, source: str) -> Any:
    """Unpickle plain data from ``data``; ``source`` names the file in errors."""
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as exc:
        raise RecordError(source, f"not a plain-data pickle: {exc}") from None
    except (EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            MemoryError, RecursionError, OverflowError, UnicodeDecodeError) as exc:
        raise RecordError(source, f"truncated or corrupt pickle ({type(exc).__name__}: {exc})") from None


def load_record(path: str | os.PathLike[str]) -> schema.RecordFile:
    """Load and check one rank's record; every failure is a ``RecordError`` naming the file."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RecordError(str(path), f"cannot read: {exc.strerror or exc}") from None
    return schema.FILE.parse(loads_plain(data, str(path)), str(path))
