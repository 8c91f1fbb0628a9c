"""Byte sizes as users write them and as we print them.

``K M G T`` and ``KiB MiB GiB TiB`` are powers of 1024; ``KB MB GB TB`` are powers of 1000;
a bare integer is bytes (the design brief fixes this).
"""
import re

from .errors import UserError

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024, "KIB": 1024, "KB": 1000,
    "M": 1024**2, "MIB": 1024**2, "MB": 1000**2,
    "G": 1024**3, "GIB": 1024**3, "GB": 1000**3,
    "T": 1024**4, "TIB": 1024**4, "TB": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text, what: str = "size") -> int:
    """Parse ``80G``, ``1.5TB``, ``512MiB`` or ``123`` into bytes; raise UserError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise UserError(f"{what}: {text} is negative; give a size of 0 or more, e.g. 80G")
        return text
    s = str(text)
    if s.strip().startswith("-"):
        raise UserError(f"{what}: '{s}' is negative; give a size of 0 or more, e.g. 80G")
    m = _SIZE_RE.match(s)
    if not m or m.group(2).upper() not in _UNITS:
        raise UserError(
            f"{what}: '{s}' is not a size; use a number with K, M, G, T (powers of 1024), "
            "KB, MB, GB, TB (powers of 1000) or KiB..TiB, e.g. 80G")
    value = float(m.group(1)) * _UNITS[m.group(2).upper()]
    return int(round(value))


def fmt_bytes(n) -> str:
    """Human-readable bytes in powers of 1024 (``1.50 GiB``)."""
    if n is None:
        return "-"
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def fmt_seconds(s) -> str:
    """Human-readable duration (``12.3 ms``)."""
    if s is None:
        return "-"
    a = abs(s)
    if a >= 1:
        return f"{s:.3f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} us"
