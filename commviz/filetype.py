"""The files commviz writes, each declared once as a type: reading, checking and writing follow
from the declaration, and so do its schema name and version.

Hand-written checks drift from the writer (a missing value once came back as the string
``"None"``). A ``FileType`` wraps one pydantic declaration whose ``schema`` and ``version``
fields are ``Literal``s; a file that does not fit is one error naming the file and the key
(``events.3.2: Input should be a valid integer``), never a traceback, and nothing in a file is
ever run. Declarations are strict: ``"5"`` is not 5 and ``true`` is not 1.
"""

from __future__ import annotations

import functools
import os
import typing
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

from pydantic import ConfigDict, TypeAdapter, ValidationError

from commviz.errors import SourceError

T = TypeVar("T")

# The configs declarations use (``__pydantic_config__``): strict, and for files a newer writer
# may add keys to, strict keeping what it does not know.
STRICT = ConfigDict(strict=True)
OPEN = ConfigDict(strict=True, extra="allow")


class FileType(Generic[T]):
    """One file's declared type: ``load``/``parse_json``/``parse`` check it, ``dump_json``
    writes it; ``schema`` and ``version`` come from the declaration's ``Literal`` fields."""

    def __init__(self, declared: type[T], what: str, error: type[SourceError] = SourceError
                 ) -> None:
        self.declared = declared
        self.what = what                  # "matched run": how errors name the kind of file
        self.error = error
        hints = typing.get_type_hints(declared)
        (self.schema,) = typing.get_args(hints["schema"])
        (self.version,) = typing.get_args(hints["version"])

    @functools.cached_property
    def _adapter(self) -> TypeAdapter[T]:
        """Built at first use: a job that only writes its record never pays for it."""
        return TypeAdapter(self.declared)

    def load(self, path: str | os.PathLike[str]) -> T:
        """Read and check a JSON file; any failure is one ``error`` naming it."""
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise self.error(str(path), f"cannot read: {exc.strerror or exc}") from None
        return self.parse_json(data, str(path))

    def parse_json(self, data: bytes, source: str) -> T:
        try:
            return self._adapter.validate_json(data)
        except ValidationError as exc:
            raise self.refusal(exc, source) from None

    def parse(self, value: Any, source: str) -> T:
        """Check plain data already read (a record's unpickled payload)."""
        try:
            return self._adapter.validate_python(value)
        except ValidationError as exc:
            raise self.refusal(exc, source) from None

    def dump_json(self, value: T, fallback: Callable[[Any], Any] | None = None,
                  indent: int | None = None) -> bytes:
        """The file's bytes; ``fallback`` turns values JSON lacks into ones it has."""
        return self._adapter.dump_json(value, fallback=fallback, indent=indent)

    def refusal(self, exc: ValidationError, source: str) -> SourceError:
        """The one error for a file that does not fit: what it is not, or its first bad key."""
        errors = exc.errors(include_url=False)
        by_key = {e["loc"][:1]: e for e in errors}
        if any(e["type"] == "json_invalid" for e in errors):
            return self.error(source, f"not JSON ({errors[0]['msg']})")
        if () in by_key or ("schema",) in by_key:
            return self.error(source, f"not a commviz {self.what} (no 'schema': {self.schema!r})")
        if ("version",) in by_key:
            error = by_key[("version",)]
            got = None if error["type"] == "missing" else error.get("input")
            return self.error(source, f"schema version {got!r}, this commviz reads version "
                                      f"{self.version}: the file and the reader come from "
                                      "different commviz releases")
        first = errors[0]
        key = ".".join(str(part) for part in first["loc"])
        return self.error(source, f"not a usable {self.what}: key {key!r}: {first['msg']}")
