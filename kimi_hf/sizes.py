"""Sizes in bytes written as text ("5GB", "139GiB", "500MB", "80e9", "1024"), read one way everywhere: every
--max-shard-size and --gpu-memory, the converters' `max_shard_size`, the planner's `gpu_memory`.

The convention is transformers' (`transformers.utils.hub.convert_file_size_to_int`: what `save_pretrained`'s
`max_shard_size` means), so that one string names one number here and in transformers:
- decimal units KB / MB / GB / TB are 10^3 / 10^6 / 10^9 / 10^12 bytes,
- binary units KiB / MiB / GiB / TiB are 2^10 / 2^20 / 2^30 / 2^40 bytes,
- a bare number (or B) is bytes; the case of the prefix does not matter ("5gB", "5gib").
transformers reads a decimal unit ending in a lowercase b ("5Gb", "5gb", "500mb") as *bits* (5Gb = 625 x 10^6 bytes).
Typed by hand that is almost always meant as bytes, so it is refused, naming the byte spelling: a string is never
read as another number than transformers reads. Beyond transformers, decimals and exponents are accepted ("1.5GB",
"80e9"); the result is rounded down to whole bytes and must be at least 1.

A leaf: standard library only, so the command lines parse sizes before torch or transformers is imported.
"""

from __future__ import annotations

import math
import numbers
import re
from decimal import Decimal


UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})
_SIZE = re.compile(r"\s*((?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*((?:[KMGT]i?)?B)?\s*", re.IGNORECASE)
MAX_SIZE = 10**24  # a yottabyte: larger is a typo
_EXAMPLES = "use 5GB (5 x 10^9 bytes), 5GiB (5 x 2^30 bytes) or a number of bytes"


def parse_size(size: int | float | str, name: str | None = None) -> int:
    """A size -> whole bytes (>= 1), by transformers' convention (see the module docstring).

    size: an int or float (bytes) or a str such as "5GB", "139GiB", "500MB", "1.5e9". name: the argument or flag the
    size came from ("--max-shard-size", "gpu_memory"), named first in the errors. TypeError for another type,
    ValueError (naming `name` and the value) for text that is not a size, bits ("5Gb") or less than one byte."""
    where = f"{name}: " if name else ""
    if isinstance(size, bool) or not isinstance(size, (numbers.Real, str)):
        raise TypeError(
            f"{name or 'size'} must be a number of bytes or a str such as '5GB', got {type(size).__name__}"
        )
    if isinstance(size, numbers.Integral):  # numpy integers too
        value = int(size)
    elif isinstance(size, numbers.Real):
        if not math.isfinite(size):
            raise ValueError(f"{where}invalid size {size!r}; {_EXAMPLES}")
        value = int(size)
    else:
        m = _SIZE.fullmatch(size)
        if not m:
            raise ValueError(f"{where}invalid size {size!r}; {_EXAMPLES}")
        number, unit = m.group(1), m.group(2) or "B"
        if unit.endswith("b") and not unit.upper().endswith("IB"):
            # transformers: bits. Refused rather than read as 1/8 of what the writer most likely meant.
            raise ValueError(
                f"{where}invalid size {size!r}: transformers reads a lowercase b as bits; "
                f"write {number}{unit[:-1].upper()}B for bytes"
            )
        number = Decimal(number)  # exact: no float rounding of 1.1GB and the like
        if number.adjusted() > 24:  # before the product: "1e999999999" would be a billion-digit int
            raise ValueError(f"{where}invalid size {size!r}: more than {MAX_SIZE:.0e} bytes")
        value = int(number * UNITS[unit.upper()])
    if value < 1:
        raise ValueError(f"{where}invalid size {size!r}: less than 1 byte; {_EXAMPLES}")
    if value > MAX_SIZE:
        raise ValueError(f"{where}invalid size {size!r}: more than {MAX_SIZE:.0e} bytes")
    return value


__all__ = ["UNITS", "parse_size"]
