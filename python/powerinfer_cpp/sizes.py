"""Byte sizes as users write them ("8G", "512M", "1.5GiB") and as reports print them."""

from __future__ import annotations

import math
import numbers
import re

_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: int | str, what: str = "size") -> int:
    """Bytes from an int (bytes) or a string with a binary unit ("512M", "6G", "1.5GiB",
    "300K"); a string without a unit is GiB, as PowerInfer's --vram-budget reads it."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a number of bytes or a size string like '6G'")
    if isinstance(value, numbers.Integral):
        n = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", value)
        if not m or (not m.group(2) and re.search(r"[bB]\s*$", value)):
            raise ValueError(f"{what} '{value}' is not a size: use a number with K, M, G or T "
                             "(e.g. 512M, 6G; a bare number is GiB)")
        v = float(m.group(1)) * _UNITS[(m.group(2) or "g").lower()]
        if not math.isfinite(v) or v >= 2 ** 63:
            raise ValueError(f"{what} '{value}' is out of range (0 to 8 EiB)")
        n = int(v)
    else:
        raise TypeError(f"{what} must be a number of bytes or a size string like '6G', not "
                        f"{type(value).__name__}")
    if n < 0 or n >= 2 ** 63:
        raise ValueError(f"{what} {n} is out of range (0 to 8 EiB)")
    return n


def format_size(n: int) -> str:
    """"1.50 GiB", "512.00 KiB", "17 B"."""
    for unit, m in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= m:
            return f"{n / m:.2f} {unit}"
    return f"{n} B"
