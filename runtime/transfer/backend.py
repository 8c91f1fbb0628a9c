"""The backend interface every byte the runtime moves goes through, and the pinned slab.

A backend names streams (``stream(name)``; ``None`` is the compute stream, the one the
training thread's kernels run on), makes events (``event()``), records them on a stream
(``record(event, stream)``), makes a stream wait for one (``wait(stream, event)``; the compute
stream too: it is how a consumer waits for its producer, explicitly; ``record_stream`` is never
used, pytorch#147168), blocks the host on one (``host_wait``), and copies bytes on a stream
(``copy(dst, src, stream)``: non-blocking where the device allows, never synchronising the
compute stream; DeepSpeed#1130). Device buffers are allocated on the compute stream
(``empty``); a buffer a copy stream still reads is kept alive until that copy's event
(``keep``), not by ``record_stream``. File ranges are read and written (``read``/``write``) by
the caller's thread: the runtime calls them on its I/O worker (``files.NvmeStore``).

``pinned(nbytes)`` carves a view from one slab of pinned host memory allocated once, at the
first request, with the size the runtime gave (``Slab``); a request the slab cannot hold is
refused in one line. One slab rather than a pinned tensor per buffer: PyTorch's caching host
allocator rounds every pinned request up to a power of two (pytorch#95823, #150517: a 20 GiB
request pins 32 GiB), and many small pinned allocations are slow to make and to free.

``unified``: device memory is host memory (a CPU device): nothing is staged, the I/O worker
reads and writes the tensors' own memory. ``allocated``/``reset_peak``/``peak``: the device's
memory counters, or ``None`` where the backend has none (a CPU: the runtime reads RSS)."""
from __future__ import annotations

import contextlib
import threading

import torch

from ..files import pread_many, pwrite_many

# every view the slab hands out starts at a multiple of this (any dtype's alignment)
SLAB_ALIGN = 64


class TransferError(RuntimeError):
    """The transfer engine cannot serve a request (one line: what was asked, what to do)."""


class Slab:
    """One host buffer of ``nbytes``, allocated once (lazily, by ``alloc``), carved into views
    first fit and given back range by range (neighbouring free ranges merge)."""

    def __init__(self, nbytes: int, alloc):
        self.nbytes = int(nbytes)
        self._alloc = alloc
        self.buf = None
        self.free = [(0, self.nbytes)]     # sorted, disjoint [lo, hi)
        self.used: dict[int, tuple[int, int]] = {}   # data_ptr of a view -> its range
        self.lock = threading.Lock()
        self.peak = self.in_use = 0

    def drop(self) -> None:
        """Free the buffer (none of it in use); the next ``take`` allocates it again. The peak
        stays, for the runtime's report."""
        with self.lock:
            assert self.in_use == 0
            self.buf, self.free, self.used = None, [(0, self.nbytes)], {}

    def drop_if_idle(self) -> bool:
        """``drop`` where none of the buffer is in use, checked and done under the lock (a
        view taken by another thread between a check and the drop would be freed under
        it); whether it was dropped."""
        with self.lock:
            if self.in_use:
                return False
            self.buf, self.free, self.used = None, [(0, self.nbytes)], {}
            return True

    def take(self, n: int) -> torch.Tensor:
        n = int(n)
        need = -(-n // SLAB_ALIGN) * SLAB_ALIGN or SLAB_ALIGN
        with self.lock:
            for i, (lo, hi) in enumerate(self.free):
                if hi - lo >= need:
                    break
            else:
                raise TransferError(
                    f"tierplan: the pinned staging slab ({self.nbytes} bytes) cannot hold "
                    f"{n} more bytes ({self.in_use} in use); re-solve the plan for this batch "
                    "size, or give the runtime a larger staging pool")
            if self.buf is None:
                self.buf = self._alloc(self.nbytes)
            self.free[i:i + 1] = [(lo + need, hi)] if hi - lo > need else []
            view = self.buf[lo:lo + n]
            self.used[view.data_ptr() if n else -lo - 1] = (lo, lo + need)
            self.in_use += need
            self.peak = max(self.peak, self.in_use)
            return view

    def give(self, view: torch.Tensor) -> None:
        with self.lock:
            key = view.data_ptr() if view.numel() else None
            if key not in self.used:
                key = next(k for k, (lo, _) in self.used.items()
                           if k < 0 and view.numel() == 0 and -k - 1 == lo)
            lo, hi = self.used.pop(key)
            self.in_use -= hi - lo
            free = sorted(self.free + [(lo, hi)])
            merged = [free[0]]
            for a, b in free[1:]:
                if a == merged[-1][1]:
                    merged[-1] = (merged[-1][0], b)
                else:
                    merged.append((a, b))
            self.free = merged


class Backend:
    """The interface (docstring of this module). Subclasses: ``cpu.CpuBackend``,
    ``cuda.CudaBackend``, ``recording.RecordingBackend``."""

    unified = True
    name = "base"

    def __init__(self, device: torch.device, pinned_bytes: int = 0):
        self.device = device
        self.slab = Slab(pinned_bytes, self._alloc_pinned)
        self.unpinning: list = []      # (view, event): given back once the event has happened
        self.unpin_lock = threading.Lock()

    def size_pinned(self, nbytes: int) -> None:
        """The slab's size (the runtime gives it from the plan): set before its first use; a
        larger one later replaces it while none of it is in use (the next plan's runtime)."""
        if self.slab.buf is not None:
            self._reap(block=True)
        if self.slab.buf is None or (nbytes > self.slab.nbytes and self.slab.in_use == 0):
            self.slab = Slab(nbytes, self._alloc_pinned)

    def release_pinned(self) -> None:
        """Give the slab's memory back once none of it is in use (its runtime closed): the
        backend lives as long as the process, a plan's slab only as long as its runtime."""
        if self.slab.buf is not None:
            self._reap(block=True)
            self.slab.drop_if_idle()     # in_use read under the slab's lock, not before it

    # -- streams and events
    def stream(self, name: str):
        raise NotImplementedError

    def event(self):
        raise NotImplementedError

    def record(self, event, stream) -> None:
        raise NotImplementedError

    def wait(self, stream, event) -> None:
        raise NotImplementedError

    def host_wait(self, event) -> None:
        raise NotImplementedError

    def compute_context(self):
        """A zero-argument callable giving a context manager that, entered on another thread,
        makes the caller's compute stream that thread's (a thread starts on the device's
        default stream; the layer-major micro-batch threads run the caller's compute)."""
        return contextlib.nullcontext

    def synchronize(self) -> None:
        raise NotImplementedError

    # -- memory and copies
    def empty(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of device memory (uint8), allocated for the compute stream."""
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        raise NotImplementedError

    def keep(self, tensor: torch.Tensor, event) -> None:
        """Hold ``tensor`` until ``event`` has happened (a copy stream still reads it)."""

    def pinned(self, nbytes: int) -> torch.Tensor:
        self._reap(block=False)
        try:
            return self.slab.take(nbytes)
        except TransferError:
            self._reap(block=True)       # views whose last copy is still queued: wait for them
            return self.slab.take(nbytes)

    def unpin(self, view: torch.Tensor, event=None) -> None:
        """Give a slab view back: now, or once ``event`` has happened (a copy may still read
        it); the host does not wait here."""
        if event is None or self.done(event):
            self.slab.give(view)
            return
        with self.unpin_lock:
            self.unpinning.append((view, event))

    def _reap(self, block: bool) -> None:
        with self.unpin_lock:
            todo, self.unpinning = self.unpinning, []
        keep = []
        for view, ev in todo:
            if block:
                self.host_wait(ev)
            if block or self.done(ev):
                self.slab.give(view)
            else:
                keep.append((view, ev))
        with self.unpin_lock:
            self.unpinning = keep + self.unpinning

    def done(self, event) -> bool:
        """Whether ``event`` has happened (without waiting)."""
        raise NotImplementedError

    def _alloc_pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def use(self, tensor: torch.Tensor) -> torch.Tensor:
        """The compute stream is about to read ``tensor`` (the recording backend checks it)."""
        return tensor

    # -- files (on the caller's thread: the runtime's I/O worker)
    def read(self, fd: int, offset: int, view, sums=None) -> None:
        self.read_many(fd, [(offset, view)], sums)

    def write(self, fd: int, offset: int, view, sums=None) -> None:
        self.write_many(fd, [(offset, view)], sums)

    def read_many(self, fd: int, items, sums=None) -> None:
        """``read`` of each ``(offset, view)``: ranges that follow each other in the file in
        few requests (many small tensors of a unit)."""
        pread_many(fd, items, sums if sums is not None else "")

    def write_many(self, fd: int, items, sums=None) -> None:
        pwrite_many(fd, items, sums)

    # -- device memory counters (None: the backend has none)
    def allocated(self):
        return None

    def reset_peak(self) -> None:
        pass

    def peak(self):
        return None
