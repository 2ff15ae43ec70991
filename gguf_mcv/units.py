"""Sizes in bytes: read from what people type (``"6GB"``) and written for people to read."""

from __future__ import annotations

import re
from decimal import Decimal

from .errors import ConfigError

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}  # fmt: skip
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)
#: The largest size accepted: 1 EB (10**18 bytes), far beyond any machine's RAM or disk; a larger
#: number is a typo, and would not even fit the 64-bit counts the OS and llama.cpp use.
MAX_SIZE = 10**18


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like ``"6GB"``, ``"6 GB"``, ``"512MiB"``, ``"3.5G"``.

    Units are decimal unless they carry an ``i``: ``G``, ``g``, ``GB`` and ``gb`` all
    mean 10**9, ``GiB``/``Gi`` 2**30 (as in Kubernetes). A bare ``G`` read the
    other way would overstate a RAM budget by 7%, so decimal is the safe reading.
    Sizes above :data:`MAX_SIZE` (1 EB) are refused too.
    Raises :class:`~gguf_mcv.errors.ConfigError` on anything else.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ConfigError(f"a size cannot be negative: {value}")
        return _at_most_max(value, value)
    if isinstance(value, str) and len(value) <= _MAX_SIZE_TEXT and (m := _SIZE_RE.fullmatch(value)):
        # Decimal, not float: "0.1GB" must be exactly 100_000_000 bytes.
        return _at_most_max(int(Decimal(m.group(1)) * _UNITS[(m.group(2) or "").lower()]), value)
    if isinstance(value, str) and len(value) > _MAX_SIZE_TEXT:
        raise ConfigError(f"a size must be from 0 to 1 EB (10**18 bytes), not a text of {len(value)} "
                          "characters: give a size such as '6GB' or '512MiB'.")
    raise ConfigError(
        f"cannot read {value!r} as a size: give a number of bytes, or a number with a unit "
        "such as '6GB', '6 GB', '512MiB' or '3.5G' (GB = 10**9 bytes, GiB = 2**30)"
    )


#: Longer text is not a size (1 EB written in bytes, with spaces and a unit, takes under 40).
_MAX_SIZE_TEXT = 100


def _at_most_max(size: int, given: int | str) -> int:
    if size > MAX_SIZE:
        # str() of a huge int raises past 4300 digits: name its size instead
        shown = repr(given) if isinstance(given, str) or given.bit_length() <= 128 else \
            f"a {given.bit_length()}-bit integer"
        raise ConfigError(f"a size must be from 0 to 1 EB (10**18 bytes), not {shown}: "
                          "give a size such as '6GB' or '512MiB'.")
    return size


def format_size(n: int | None) -> str:
    """``3_600_000_000`` → ``"3.6 GB"`` (decimal units, like :func:`parse_size`); None → ``"-"``."""
    if n is None:
        return "-"
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
