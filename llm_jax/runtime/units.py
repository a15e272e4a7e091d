"""Numbers for people: counts with SI prefixes and byte sizes in binary units, as describe,
compile and the mxfp4 benchmark print them."""

from __future__ import annotations


def format_si(x: float, unit: str = "") -> str:
    """1.234 G, 12.500 MFLOP ...: a count with an SI prefix."""
    for div, p in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3f} {p}{unit}".rstrip()
    return f"{x:g} {unit}".rstrip()


def format_bytes(x: float) -> str:
    """1.50 GiB ...: a byte count in binary units."""
    for div, p in ((2 ** 40, "TiB"), (2 ** 30, "GiB"), (2 ** 20, "MiB"), (2 ** 10, "KiB")):
        if x >= div:
            return f"{x / div:.2f} {p}"
    return f"{x:.0f} B"
