"""Byte sizes with units, as operators write them (``64GiB``, ``512MiB``, ``4096``)."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_ALLOWED = (
    "write a non-negative integer number of bytes or a number with one of the units "
    "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 64GiB)"
)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str) -> int:
    """Return the number of bytes ``value`` names; raise ValueError saying what is allowed."""
    if isinstance(value, bool) or isinstance(value, int) and value < 0:
        raise ValueError(f"{value!r} is not a size; {_ALLOWED}")
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(f"{value!r} is not a size; {_ALLOWED}")
    try:
        exact = Decimal(match.group(1)) * _UNITS[unit]  # Decimal: "2.01MB" is 2010000, not 2009999
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a size; {_ALLOWED}") from None
    if exact != exact.to_integral_value():
        raise ValueError(f"{value!r} is not a whole number of bytes; {_ALLOWED}")
    return int(exact)


def format_size(nbytes: int) -> str:
    """Human-readable binary size for tables and logs."""
    size = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(size) < 1024 or unit == "TiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
