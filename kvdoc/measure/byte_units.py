"""Byte counts for people: the largest binary (KiB, MiB) and decimal (kB, MB) unit, side by side
with the exact count (:func:`format_bytes`).
"""

from __future__ import annotations

BINARY_UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")  # powers of 1024
DECIMAL_UNITS = ("bytes", "kB", "MB", "GB", "TB", "PB")  # powers of 1000


def _scaled(n: int, base: int, units: tuple[str, ...], digits: int) -> str:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"a byte count must be a non-negative integer, got {n!r}")
    power = 0
    while power + 1 < len(units) and n >= base ** (power + 1):
        power += 1
    if power == 0:
        return f"{n:,} bytes"
    text = f"{n / base ** power:,.{digits}f}".rstrip("0").rstrip(".")
    return f"{text} {units[power]}"


def binary_size(n: int, digits: int = 3) -> str:
    """``n`` bytes in the largest binary unit (KiB = 1024 bytes, MiB = 1024**2, ...).

    >>> binary_size(536870912), binary_size(278528), binary_size(1536)
    ('512 MiB', '272 KiB', '1.5 KiB')
    """
    return _scaled(n, 1024, BINARY_UNITS, digits)


def decimal_size(n: int, digits: int = 3) -> str:
    """``n`` bytes in the largest decimal unit (kB = 1000 bytes, MB = 1000**2, ...).

    >>> decimal_size(536870912), decimal_size(278528)
    ('536.871 MB', '278.528 kB')
    """
    return _scaled(n, 1000, DECIMAL_UNITS, digits)


def format_bytes(n: int) -> str:
    """Exact bytes, then binary and decimal units side by side.

    >>> format_bytes(536870912)
    '536,870,912 bytes = 512 MiB = 536.871 MB'
    """
    return f"{n:,} bytes = {binary_size(n)} = {decimal_size(n)}"
