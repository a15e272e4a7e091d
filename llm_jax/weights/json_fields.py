"""Typed reads of an untrusted JSON object (a checkpoint's config.json); errors name the field.

`int("big")` says "invalid literal for int()" without saying which field; a vocab_size of 10^12
would be taken at its word. These readers check the type (a bool is no number, a float no int),
the range (sizes are at most MAX_SIZE, floats finite) and raise ValueError naming the file, the
field and what was expected.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

MAX_SIZE = 2**31 - 1  # no dimension, count or length in a model config is beyond int32
MAX_JSON_BYTES = 16 * 2**20  # config.json and index files are kilobytes
_MISSING = object()


def read_json_object(path: Path) -> dict[str, Any]:
    """A small JSON file whose top level is an object; ValueError naming it otherwise."""
    if not path.is_file():  # a FIFO or device would block or never end
        raise ValueError(f"{path} is not a regular file")
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ValueError(f"{path} has {size} bytes: expected a small JSON file (at most "
                         f"{MAX_JSON_BYTES})")
    try:
        d = json.loads(path.read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path} is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{path} holds a JSON {type(d).__name__}: expected an object")
    return d


class Fields:
    """The fields of one JSON object, read by name; `where` prefixes every error."""

    def __init__(self, d: Any, where: str):
        if not isinstance(d, dict):
            raise ValueError(f"{where} is a {type(d).__name__}: expected a JSON object")
        self.d, self.where = d, where

    def __contains__(self, key: str) -> bool:
        return self.d.get(key) is not None

    def raw(self, key: str, default: Any = None) -> Any:
        return self.d.get(key, default)

    def _bad(self, key: str, expected: str) -> ValueError:
        return ValueError(f"{self.where}: field {key}={self.d.get(key)!r} is invalid: expected "
                          f"{expected}")

    def _get(self, keys: tuple[str, ...], default: Any) -> tuple[str, Any]:
        for k in keys:
            if self.d.get(k) is not None:
                return k, self.d[k]
        if default is _MISSING:
            raise ValueError(f"{self.where} is missing field {keys[0]!r}")
        return keys[0], default

    def int(self, *keys: str, default: Any = _MISSING, low: int = 1) -> int:
        """An integer in [low, MAX_SIZE] from the first of `keys` that is set (null = unset)."""
        key, v = self._get(keys, default)
        if not (isinstance(v, int) and not isinstance(v, bool) and low <= v <= MAX_SIZE):
            raise self._bad(key, f"an integer in [{low}, {MAX_SIZE}]")
        return v

    def float(self, *keys: str, default: Any = _MISSING, above: float | None = None,
              at_least: float | None = None) -> float:
        """A finite number (> above, >= at_least when given)."""
        key, v = self._get(keys, default)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        if ok and above is not None and not v > above:
            raise self._bad(key, f"a number > {above}")
        if ok and at_least is not None and not v >= at_least:
            raise self._bad(key, f"a number >= {at_least}")
        if not ok:
            raise self._bad(key, "a finite number")
        return float(v)

    def obj(self, *keys: str) -> Fields | None:
        """The nested object of the first of `keys` that is set, or None."""
        key, v = self._get(keys, None)
        if v is None:
            return None
        if not isinstance(v, dict):
            raise self._bad(key, "a JSON object")
        return Fields(v, f"{self.where}: {key}")

    def str_list(self, key: str) -> list[str] | None:
        v = self.d.get(key)
        if v is None:
            return None
        if not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise self._bad(key, "a list of strings")
        return v
