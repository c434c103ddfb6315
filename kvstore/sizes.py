"""Sizes in settings (``"512MiB"``, ``"2G"``, bytes): parsed with the standard library only, so that a command
refuses a bad size before it loads the store (and torch)."""

from __future__ import annotations

import math
import re
from fractions import Fraction

from kvshelf.kvstore.errors import ConfigError

MAX_SIZE_BYTES = 1 << 60  # 1 EiB: a larger size is a typo, never a capacity
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
          "tib": 1 << 40, "p": 1 << 50, "pb": 1000**5, "pib": 1 << 50, "e": 1 << 60, "eb": 1000**6, "eib": 1 << 60}
_SIZE = re.compile(r"\s*(-?)(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


def parse_size(value: int | float | str, setting: str = "size") -> int:
    """``"512MiB"``, ``"2G"``, ``"1000000"`` or an int -> bytes; errors start with ``setting``.

    A size is a whole number of bytes in ``[0, 1 EiB]``. A fraction is accepted only with a unit larger than a
    byte (``"1.5GiB"``) and is rounded down to whole bytes (an amount that rounds down to 0 is refused); a bare
    ``"1.5"``, a non-integral float, a bool, NaN, infinity, a negative or a larger size is a ``ConfigError``.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{setting}: {value!r} is not a size; use a number of bytes or e.g. '512MiB', '2GiB'")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise ConfigError(f"{setting}: {value!r} is not a whole number of bytes")
        value = int(value)
    if isinstance(value, int):
        amount, negative = Fraction(abs(value)), value < 0
    else:
        match = _SIZE.fullmatch(value)
        if not match or match.group(3).lower() not in _UNITS:
            raise ConfigError(f"{setting}: cannot read size {value!r}; use a number of bytes or e.g. '512MiB', '2GiB'")
        sign, number, unit = match.group(1), match.group(2), _UNITS[match.group(3).lower()]
        if len(number) > 30:
            raise ConfigError(f"{setting}: size {value[:40]!r}... is too large (at most 1 EiB)")
        if "." in number and unit == 1:
            raise ConfigError(f"{setting}: {value!r} is not a whole number of bytes (a fraction needs a unit, "
                              "e.g. '1.5GiB')")
        amount, negative = Fraction(number) * unit, sign == "-" and Fraction(number) != 0
    if negative:
        raise ConfigError(f"{setting}: size {value!r} is negative")
    if amount > MAX_SIZE_BYTES:
        raise ConfigError(f"{setting}: size {value!r} is too large (at most {MAX_SIZE_BYTES} bytes, 1 EiB)")
    if 0 < amount < 1:
        raise ConfigError(f"{setting}: size {value!r} is less than one byte")
    return math.floor(amount)
