"""Short human-readable figures for the status bar, the gauges and --stats."""
from __future__ import annotations

_UNITS = ("B", "kB", "MB", "GB", "TB")


def human_bytes(n: int | float | None) -> str:
    """585 MB, 1.3 GB: decimal units, two or three significant figures."""
    if n is None or n < 0:
        return "–"
    value = float(n)
    for unit in _UNITS:
        # Compare the figure as it will be printed: 999.7 kB shows as "1.0 MB", not "1000 kB".
        if round(value, 1 if value < 10 else 0) < 1000 or unit == _UNITS[-1]:
            break
        value /= 1000
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.1f} {unit}" if round(value, 1) < 10 else f"{value:.0f} {unit}"


def rate(tps: float | None) -> str:
    """Tokens per second: one decimal below 100, whole numbers above."""
    if not tps:
        return "–"
    return f"{tps:.1f}" if tps < 100 else f"{tps:.0f}"
