"""Streaming line readers and field checks shared by the trace readers.

Every error is a `ValueError` whose message starts with `<file>:<line>:` so a person can find
the offending row."""

from __future__ import annotations

import json
import lzma
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

XZ_MAGIC = b"\xfd7zXZ\x00"


def is_xz(path: Path) -> bool:
    """True when the file starts with the xz magic bytes (whatever its name)."""
    with path.open("rb") as f:
        return f.read(len(XZ_MAGIC)) == XZ_MAGIC


def open_text(path: Path) -> IO[str]:
    """Open a UTF-8 text file for streaming, decompressing xz on the fly when it is xz."""
    if is_xz(path):
        return lzma.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def json_lines(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield `(line number, object)` for each non-blank line of a JSONL file (plain or xz).

    Raises ValueError naming the file and line for a line that is not a JSON object, and for a
    truncated or corrupt xz stream or invalid UTF-8."""
    lineno = 0
    try:
        with open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                if not isinstance(obj, dict):
                    raise ValueError(f"{path}:{lineno}: expected a JSON object per line")
                yield lineno, obj
    except (lzma.LZMAError, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}:{lineno + 1}: unreadable ({e})") from None


def get_int(obj: dict[str, Any], key: str, where: str, *, minimum: int = 0) -> int:
    """`obj[key]` as an int ≥ `minimum`; ValueError naming `where` (file:line) otherwise."""
    value = obj.get(key)
    if type(value) is not int or value < minimum:
        raise ValueError(f"{where}: field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def get_float(
    obj: dict[str, Any], key: str, where: str, *, optional: bool = False, minimum: float = 0.0
) -> float:
    """`obj[key]` as a float ≥ `minimum` (None or absent gives 0.0 when `optional`)."""
    value = obj.get(key)
    if value is None and optional:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ValueError(f"{where}: field {key!r} must be a number >= {minimum}, got {value!r}")
    return float(value)


def get_str(obj: dict[str, Any], key: str, where: str) -> str:
    """`obj[key]` as a non-empty string."""
    value = obj.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: field {key!r} must be a non-empty string, got {value!r}")
    return value


def get_ids(obj: dict[str, Any], key: str, where: str) -> tuple[int, ...]:
    """`obj[key]` as a tuple of non-negative ints."""
    value = obj.get(key)
    if not isinstance(value, list) or not all(type(x) is int and x >= 0 for x in value):
        raise ValueError(f"{where}: field {key!r} must be a list of non-negative integers")
    return tuple(value)


def check_cap(name: str, value: int | None) -> None:
    """Reject a negative `max_*` option."""
    if value is not None and value < 0:
        raise ValueError(f"{name} must be >= 0 or None, got {value}")
