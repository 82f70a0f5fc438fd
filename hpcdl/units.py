"""Bytes as a person reads them, in binary units, as hpcdl-stage prints them
(`human_bytes` in staging/src/common.h): the doctor's lines and the staging dry run."""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def binary_size(nbytes: int | float) -> str:
    """'512 B', '48.8 KiB', '65.1 GiB': whole bytes below 1 KiB, else one decimal."""
    value, unit = float(nbytes), 0
    while value >= 1024 and unit + 1 < len(_UNITS):
        value /= 1024
        unit += 1
    return f"{value:.0f} {_UNITS[unit]}" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"
