"""Byte sizes as users write them and as we print them.

``K M G T`` and ``KiB MiB GiB TiB`` are powers of 1024; ``KB MB GB TB`` are powers of 1000;
a bare integer is bytes (the design brief fixes this).
"""
import re
from fractions import Fraction

from planner.errors import UserError

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1024, "KIB": 1024, "KB": 1000,
    "M": 1024**2, "MIB": 1024**2, "MB": 1000**2,
    "G": 1024**3, "GIB": 1024**3, "GB": 1000**3,
    "T": 1024**4, "TIB": 1024**4, "TB": 1000**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$", re.ASCII)
# The largest size accepted: 1 EiB (1048576T), far above any machine's memory or disk. Sums
# of such sizes over 10^5 units stay far from a float's range (a 400-digit size overflowed it).
MAX_BYTES = 2**60
_MAX_TEXT = 40      # characters of a size as written: '1152921504606846976' is 19


def parse_size(text, what: str = "size") -> int:
    """Parse ``80G``, ``1.5TB``, ``512MiB`` or ``123`` into bytes; raise UserError otherwise.

    Exact (no float rounding: ``1.1G`` is 1181116006 bytes, the nearest integer), at most
    ``MAX_BYTES``."""
    if isinstance(text, bool):
        raise UserError(f"{what}: {text!r} is not a size; give a number of bytes, e.g. 80G")
    if isinstance(text, int):
        if text < 0:
            raise UserError(f"{what}: {text} is negative; give a size of 0 or more, e.g. 80G")
        if text > MAX_BYTES:
            raise UserError(f"{what}: {text} bytes is more than 1 EiB; give a size of at most "
                            "1048576T, e.g. 80G")
        return text
    s = str(text)
    shown = s if len(s) <= _MAX_TEXT else s[:_MAX_TEXT] + "..."
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in shown)
    if s.strip().startswith("-"):
        raise UserError(f"{what}: '{shown}' is negative; give a size of 0 or more, e.g. 80G")
    if len(s) > _MAX_TEXT:
        raise UserError(f"{what}: '{shown}' is {len(s)} characters long, too long for a size; "
                        "give a size of at most 1 EiB, e.g. 80G")
    m = _SIZE_RE.match(s)
    if not m or m.group(2).upper() not in _UNITS:
        raise UserError(
            f"{what}: '{shown}' is not a size; use a number with K, M, G, T (powers of 1024), "
            "KB, MB, GB, TB (powers of 1000) or KiB..TiB, e.g. 80G")
    unit = m.group(2)
    if len(unit) == 2 and unit[0] in "KMGT" and unit[1] == "b":
        # "Gb" is gigabits in the usual notation: which was meant is not ours to guess
        raise UserError(f"{what}: '{shown}' reads as {unit[0]}bits ('b' is a bit); write "
                        f"{unit[0]}B or {unit[0]}iB for bytes, e.g. 80GB or 80G")
    scale = _UNITS[unit.upper()]
    value = Fraction(m.group(1)) * scale
    if scale == 1 and value.denominator != 1:
        raise UserError(f"{what}: '{shown}' is a fraction of a byte; give whole bytes or a "
                        "unit, e.g. 80G or 0.5G")
    n = round(value)
    if n > MAX_BYTES:
        raise UserError(f"{what}: '{shown}' is more than 1 EiB; give a smaller size, e.g. 80G")
    return int(n)


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


def fmt_rate(flops, seconds) -> str:
    """Achieved arithmetic rate (``12.2 TFLOP/s``; GFLOP/s below one TFLOP/s, where a CPU
    host's plans printed "0.0 TFLOP/s")."""
    r = flops / seconds if seconds else 0.0
    return f"{r / 1e12:.1f} TFLOP/s" if r >= 0.9995e12 or r == 0 else f"{r / 1e9:.1f} GFLOP/s"
