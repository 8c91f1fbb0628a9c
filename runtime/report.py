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


# ----------------------------------------------------------------------------- peaks per stage

class StagePeaks:
    """The device figure of each stage of a step, as the step's own peak is measured: where
    the backend counts device memory (CUDA) its allocator's peak, else the rise of the
    process's peak RSS (VmHWM) over the RSS at the step's start. As each stage begins the
    peak since the last one is read and reset, and kept for the stage that ran, the largest
    over the step's passes; the interval before the first stage is the prologue's (stage 0),
    the one after the last backward up to the step's end the optimizer phase's (2U+1).
    Two /proc calls per stage on a CPU host (about 20 us each), two counters on CUDA."""

    def __init__(self, be, n_stages: int):
        self.be, self.n = be, int(n_stages)
        self.peaks: list | None = None
        self.cur = 0
        self.base = None
        self.cuts = 0

    def begin(self, base) -> None:
        """A step starts; its peak was just reset; ``base`` the RSS then (None on CUDA)."""
        self.peaks, self.cur, self.base, self.cuts = [None] * self.n, 0, base, 0

    def _read(self):
        """The peak since the last reset, and reset (None where it cannot be)."""
        if self.be.peak() is not None:
            got = int(self.be.peak())
            self.be.reset_peak()
            return got
        hwm = read_status().get("VmHWM")
        if hwm is None or self.base is None or not reset_hwm():
            return None
        return max(0, hwm - self.base)

    def _close(self):
        got = self._read()
        if got is not None and 0 <= self.cur < self.n:
            old = self.peaks[self.cur]
            self.peaks[self.cur] = got if old is None else max(old, got)
        return got

    def cut(self, stage: int) -> None:
        """Stage ``stage`` begins."""
        if self.peaks is None:
            return
        self._close()
        self.cur = stage
        self.cuts += 1

    def end(self) -> tuple[list | None, int | None]:
        """The step ends: (peaks per stage, None where no stage began; the step's peak, the
        largest of every interval, None where none could be read)."""
        if self.peaks is None:
            return None, None
        last = self._close()
        peaks, self.peaks = self.peaks, None
        got = [x for x in peaks if x is not None]
        top = max(got) if got else last
        return (peaks if self.cuts else None), top
