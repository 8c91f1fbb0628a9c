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

def read_peak(be, base, reset: bool = False):
    """The device figure since the last reset: where the backend counts device memory (CUDA)
    its allocator's peak, else the rise of the process's peak RSS (VmHWM) over ``base`` (the
    RSS at the step's start); None where it cannot be read, or, with ``reset``, reset (the
    peak mark is then reset to what is held now)."""
    got = be.peak()
    if got is not None:
        if reset:
            be.reset_peak()
        return int(got)
    hwm = read_status().get("VmHWM")
    if hwm is None or base is None or (reset and not reset_hwm()):
        return None
    return max(0, hwm - base)


class StagePeaks:
    """The device figure of each stage of a step (``apply_plan(..., stage_peaks=True)``), as
    the step's own peak is measured (``read_peak``): as each stage begins the peak since the
    previous one is read and reset, and kept for the stage that ran, the largest over the
    step's passes. The interval before the first stage is the prologue's (stage 0); the one
    from a pass's last backward to the next pass's start is that backward stage's (2U); the
    one from the last pass's backward to the step's close is the optimizer phase's (2U+1),
    read without a reset (the next step's start resets it; a peak read after the step is
    that interval's, not the step's).
    Per stage: two /proc calls on a CPU host (about 10 us here), one peak read and one reset
    of the allocator's statistics on CUDA."""

    def __init__(self, be, n_stages: int):
        self.be, self.n = be, int(n_stages)
        self.peaks: list | None = None
        self.cur = 0
        self.base = None
        self.failed = False              # a reset failed: the stages' figures are incomplete

    def begin(self, base) -> None:
        """A step starts; its peak was just reset; ``base`` the RSS then (None on CUDA)."""
        self.peaks, self.cur, self.base, self.failed = [None] * self.n, 0, base, False

    def _close(self, reset: bool) -> None:
        got = read_peak(self.be, self.base, reset)
        if got is None:
            self.failed = True
            return
        k = self.cur
        if k == self.n - 1 and reset:    # a pass ended and another began: its last backward's
            k = self.n - 2
        if 0 <= k < self.n:
            old = self.peaks[k]
            self.peaks[k] = got if old is None else max(old, got)

    def cut(self, stage: int) -> None:
        """Stage ``stage`` begins."""
        if self.peaks is None:
            return
        self._close(reset=True)
        self.cur = stage

    def end(self) -> list | None:
        """The step ends: the peaks per stage (None where no stage began; None altogether
        where none was read)."""
        if self.peaks is None:
            return None
        self._close(reset=False)
        peaks, self.peaks = self.peaks, None
        return peaks if any(x is not None for x in peaks) else None
