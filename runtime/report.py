"""Measuring a step on this host: the probes behind the report (``planner.formats.report`` holds the
report's format).

A step is the forward pass(es), the backward(s) and the optimizer step; it starts at the first
forward with gradients after the previous optimizer step and ends when the optimizer holding the
model's parameters has stepped. ``docs/runtime.md`` says exactly how each figure is measured.
"""
from __future__ import annotations

import contextlib
import ctypes
import os



# ----------------------------------------------------------------------------- host memory probes

_FDS: dict = {}


def _fd(path: str, flags: int):
    """An fd kept open for the process: opening a /proc file costs more than reading it
    (about 45 us per open-read-close of /proc/self/status against 19 us for a pread here)."""
    key = (os.getpid(), path)
    fd = _FDS.get(key)
    if fd is None:
        fd = _FDS[key] = os.open(path, flags | os.O_CLOEXEC)
    return fd


def read_status() -> dict:
    """VmRSS and VmHWM of this process in bytes (Linux ``/proc/self/status``); {} elsewhere."""
    out = {}
    try:
        text = os.pread(_fd("/proc/self/status", os.O_RDONLY), 1 << 16, 0)
    except OSError:
        return out
    for key in (b"VmRSS:", b"VmHWM:"):
        i = text.find(key)
        if i >= 0:
            # the kernel reports kB
            out[key[:-1].decode()] = int(text[i + len(key):text.index(b"kB", i)]) * 1024
    return out


def reset_hwm() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) to the current RSS: ``echo 5 > clear_refs``
    (Documentation/admin-guide/mm/soft-dirty.rst, Linux >= 4.0). False where not allowed."""
    try:
        os.write(_fd("/proc/self/clear_refs", os.O_WRONLY), b"5")
        return True
    except OSError:
        return False


_libc = None


def malloc_trim() -> None:
    """Give freed heap pages back to the kernel so the RSS before a step is not inflated by
    memory glibc keeps cached (tensors below glibc's mmap threshold, up to 32 MiB, live on the
    heap)."""
    global _libc
    with contextlib.suppress(OSError, AttributeError):   # not glibc: nothing to trim
        if _libc is None:
            _libc = ctypes.CDLL("libc.so.6")
        _libc.malloc_trim(0)
