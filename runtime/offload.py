"""Moving saved activations off the compute device and back, a byte range at a time.

A ``Group`` holds the tensors one unit (or one checkpoint) saved during one forward pass: one
byte stream, the tensors in the order they were saved. The plan says, stage by stage, which
share of that stream moves (``send``: out, ``fetch``: back); shares are fractions of the
planned bytes applied to the real ones, so a short last batch moves proportionally less. A
tensor leaves the device when its last byte has gone and comes back (allocated) when its first
byte arrives; ``get`` returns it whole, fetching on demand what has not come back yet (counted
as a stall). The runtime decides nothing here.

Paths:
- CPU device (unified memory, spec ``cpu-host``): the I/O thread writes each tensor's own
  memory to the group's file and reads into freshly allocated tensors; no staging.
- CUDA, ``cpu`` tier: device-to-host copies into pinned buffers on a side stream, back on
  another; the compute stream waits for a tensor's copy only where it is unpacked.
- CUDA, ``nvme`` tier: the same copies through pinned buffers, with the I/O thread writing them
  to the file after the copy's event and reading them back before the host-to-device copy.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from concurrent.futures import Future

import torch

from .files import NvmeStore, Sums, byte_view, pread_all, pwrite_all


class Counters:
    """Bytes resident per place and bytes moved per link, shared with the I/O thread."""

    LINKS = ("d2h", "h2d", "nvme_write", "nvme_read")

    def __init__(self):
        self.lock = threading.Lock()
        self.reset_all()

    def reset_all(self):
        with self.lock:
            self.act = 0            # activation bytes the runtime knows are on the device
            self.host = 0           # pinned host bytes the runtime holds
            self.nvme = 0           # bytes in the runtime's files
            self.moved = {k: 0 for k in self.LINKS}
            self.stall_s = 0.0
            self.peak_act = self.peak_host = self.peak_nvme = 0

    def reset_step(self):
        with self.lock:
            self.moved = {k: 0 for k in self.LINKS}
            self.stall_s = 0.0
            self.peak_act, self.peak_host, self.peak_nvme = self.act, self.host, self.nvme

    def add(self, place: str, n: int):
        with self.lock:
            v = getattr(self, place) + n
            setattr(self, place, v)
            peak = "peak_" + place
            if v > getattr(self, peak):
                setattr(self, peak, v)

    def moved_add(self, link: str, n: int):
        with self.lock:
            self.moved[link] += n

    def stalled(self, s: float):
        with self.lock:
            self.stall_s += s


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (works for bf16 and bool, which numpy lacks)."""
    return t.reshape(-1).view(torch.uint8)


def _gapped(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements leave gaps in memory (a slice of a wider tensor), so that no
    permutation of a dense tensor has its layout."""
    if t.is_contiguous() or t.numel() == 0:
        return False
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    return not t.permute(order).is_contiguous()


def _extent(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to one past its last, in its storage."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def _in_memory_order(t: torch.Tensor):
    """(a contiguous tensor of ``t``'s elements, the permutation that gives ``t``'s layout
    back, or None). A non-contiguous saved tensor (a transposed view, a slice) is kept with
    its dimensions in their order in memory, not in their logical order: made plainly
    contiguous, it came back with another layout, backward kernels summed in another order,
    and Jamba's gradients differed from plain PyTorch's by 1e-8 under offload. A dense
    permuted view comes back with its own strides, without a copy."""
    if t.is_contiguous() or t.dim() < 2:
        return (t if t.is_contiguous() else t.contiguous()), None
    order = sorted(range(t.dim()), key=lambda d: (-t.stride(d), d))
    src = t.permute(order).contiguous()
    back = [order.index(d) for d in range(t.dim())]
    return src, (None if order == sorted(order) else back)


class Mover:
    """Everything that moves bytes: side streams, the NVMe store, the counters."""

    def __init__(self, device: torch.device, nvme_dir: str | None, counters: Counters):
        self.device = device
        self.cuda = device.type == "cuda"
        self.counters = counters
        self.nvme_dir = nvme_dir
        self.store: NvmeStore | None = None
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)

    def nvme_store(self) -> NvmeStore:
        if self.store is None:
            if not self.nvme_dir:
                raise ValueError("the plan uses nvme but names no nvme_dir; pass "
                                 "apply_plan(..., nvme_dir=DIR) or solve with --nvme-dir")
            self.store = NvmeStore(self.nvme_dir)
        return self.store

    def close(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
        if self.store is not None:
            self.store.close()
            self.store = None


class Slot:
    """One saved tensor of a group."""

    __slots__ = ("shape", "perm", "dtype", "nbytes", "offset", "src", "sent", "disk", "host",
                 "out", "got", "ready", "refs", "read", "layout", "view")

    def __init__(self, t: torch.Tensor, offset: int, perm=None, layout=None):
        # ``t`` is contiguous; ``perm``: the saved tensor is ``t.permute(perm)`` (its
        # dimensions in their order in memory; ``_in_memory_order``); ``layout``: where a
        # slice with gaps sat in its storage, (storage key, storage offset, shape, stride)
        self.shape, self.dtype = t.shape, t.dtype
        self.perm = perm
        self.layout = layout
        self.view = None          # a slice with gaps, back in place (until released)
        self.nbytes = t.numel() * t.element_size()
        self.offset = offset
        self.src = t              # the device tensor, until its last byte has left
        self.sent = 0             # bytes sent off the device
        self.disk = 0             # bytes written to the file (CUDA nvme: after staging)
        self.host = None          # pinned copy (CUDA)
        self.out = None           # the tensor back on the device (uint8, nbytes)
        self.got = 0              # bytes back
        self.ready = None         # CUDA event: the last copy into ``out`` has been issued
        self.refs = 0
        self.read = 0             # bytes read back from the file (checksums: verified when all)

    def tensor(self, flat: torch.Tensor) -> torch.Tensor:
        """The saved tensor from ``flat`` (its elements, of its dtype, in the order kept)."""
        t = flat.view(self.shape)
        return t if self.perm is None else t.permute(self.perm)


class Group:
    """The tensors one unit (or one checkpoint) sent to ``tier`` in one forward pass."""

    def __init__(self, mover: Mover, tier: str, label: str):
        self.m = mover
        self.tier = tier
        self.label = label
        self.slots: list[Slot] = []
        self.size = 0
        self.path = None
        self.fd = None
        self.futures: list[Future] = []
        self.lock = threading.Lock()
        self.sums = None
        # slices with gaps, per (storage, dtype): [first element, one past the last, bytes of
        # the slices, the buffer they come back into, the slots not back in it yet]
        self.bases: dict = {}
        if tier == "nvme":
            store = mover.nvme_store()
            self.fd, self.path = store.open(label)
            self.sums = Sums(self.path, label)   # checksums of what is written, checked on read
            # the file goes if the group is dropped unread (an abandoned forward)
            self._fin = weakref.finalize(self, store.unlink_later, self.path)

    # -- registration (while the unit's forward saves tensors)
    def put(self, t: torch.Tensor) -> Slot:
        t = t.detach()
        src, perm = _in_memory_order(t)
        layout = None
        if _gapped(t):
            # NB: a slice with gaps (Mamba's in_proj split, an expert's rows) comes back at its
            # place in a buffer laid out as its storage was, gaps and all, with the other
            # slices of that storage this group holds: made dense, kernels read it with
            # another leading dimension and summed in another order (Zamba2's gradients were
            # 2e-6 off plain PyTorch's after one step under offload). Only its elements move;
            # the buffer spans at most the storage, which the profile counts for it.
            key = (t.untyped_storage().data_ptr(), t.dtype)
            lo, hi = t.storage_offset(), t.storage_offset() + _extent(t)
            base = self.bases.setdefault(key, [lo, hi, 0, None, 0])
            base[0], base[1] = min(base[0], lo), max(base[1], hi)
            base[2] += t.numel() * t.element_size()
            base[4] += 1
            layout = (key, t.storage_offset(), tuple(t.shape), tuple(t.stride()))
        s = Slot(src, self.size, perm, layout)
        self.size += s.nbytes
        self.slots.append(s)
        self.m.counters.add("act", s.nbytes)
        return s

    def _parts(self, a: int, b: int, by: str):
        """(slot, 0, nbytes) of the whole slots a planned share [a, b) of the stream moves: a
        slot goes with the share its first byte falls in (``by="start"``: sends, which free
        it) or its last byte (``by="end"``: fetches, which allocate it). The shares tile the
        stream, so each slot moves once and the runtime never holds more than the plan's
        fractional count."""
        for s in self.slots:
            edge = s.offset if by == "start" else s.offset + s.nbytes
            if s.nbytes and (a <= edge < b if by == "start" else a < edge <= b):
                yield s, 0, s.nbytes

    def span(self, fa: float, fb: float) -> tuple[int, int]:
        """The real bytes of the planned fraction range [fa, fb) of the stream."""
        a = int(round(fa * self.size))
        b = self.size if fb >= 1.0 - 1e-12 else int(round(fb * self.size))
        return a, b

    # -- out
    def send(self, a: int, b: int) -> None:
        """Move the stream's bytes [a, b) off the device (this stage's share)."""
        m, c = self.m, self.m.counters
        parts = [(s, lo, hi) for s, lo, hi in self._parts(a, b, "start") if s.src is not None]
        if not parts:
            return
        if self.tier == "nvme":
            c.add("nvme", sum(hi - lo for _, lo, hi in parts))
        if not m.cuda:
            self.futures.append(m.nvme_store().submit(self._write_direct, parts))
            return
        m.d2h.wait_stream(torch.cuda.current_stream(m.device))
        staged = []
        with torch.cuda.stream(m.d2h):
            for s, lo, hi in parts:
                if s.host is None:
                    s.host = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=True)
                    c.add("host", s.nbytes)
                s.host[lo:hi].copy_(as_bytes(s.src)[lo:hi], non_blocking=True)
                c.moved_add("d2h", hi - lo)
                s.sent += hi - lo
                if s.sent >= s.nbytes:
                    s.src.record_stream(m.d2h)   # freed once the copy has run, not before
                    s.src = None
                    c.add("act", -s.nbytes)
                staged.append((s, lo, hi))
            ev = torch.cuda.Event()
            ev.record(m.d2h)
        if self.tier == "nvme":
            self.futures.append(m.nvme_store().submit(self._write_staged, staged, ev))

    def _write_direct(self, parts):
        c = self.m.counters
        for s, lo, hi in parts:
            src = s.src
            if src is None:
                continue
            pwrite_all(self.fd, byte_view(as_bytes(src)[lo:hi]), s.offset + lo, self.sums)
            c.moved_add("nvme_write", hi - lo)
            s.sent += hi - lo
            if s.sent >= s.nbytes:
                s.src = None            # the tensor's memory is free once its bytes are on disk
                c.add("act", -s.nbytes)

    def _write_staged(self, parts, ev):
        ev.synchronize()
        c = self.m.counters
        for s, lo, hi in parts:
            pwrite_all(self.fd, byte_view(s.host[lo:hi]), s.offset + lo, self.sums)
            c.moved_add("nvme_write", hi - lo)
            s.disk += hi - lo
            if s.disk >= s.nbytes:
                c.add("host", -s.nbytes)
                s.host = None           # every staged byte is on disk

    # -- back
    def fetch(self, a: int, b: int) -> None:
        """Bring the stream's bytes [a, b) back to the device (this stage's share)."""
        m, c = self.m, self.m.counters
        parts = [(s, lo, hi) for s, lo, hi in self._parts(a, b, "end") if s.src is None]
        if not parts:
            return
        if not m.cuda or self.tier == "nvme":
            self.futures.append(m.nvme_store().submit(self._read, parts))
            return
        self._h2d(parts)

    def _alloc_out(self, s: Slot):
        if s.out is None:
            if self.m.cuda:
                with torch.cuda.stream(self.m.h2d):
                    s.out = torch.empty(s.nbytes, dtype=torch.uint8, device=self.m.device)
            else:
                s.out = torch.empty(s.nbytes, dtype=torch.uint8)
            self.m.counters.add("act", s.nbytes)

    def _h2d(self, parts):
        m, c = self.m, self.m.counters
        m.h2d.wait_stream(m.d2h)             # the host copy it reads must have landed
        with torch.cuda.stream(m.h2d):
            for s, lo, hi in parts:
                self._alloc_out(s)
                s.out[lo:hi].copy_(s.host[lo:hi], non_blocking=True)
                s.got += hi - lo
                c.moved_add("h2d", hi - lo)
                s.ready = torch.cuda.Event()
                s.ready.record(m.h2d)

    def _read(self, parts):
        c = self.m.counters
        for s, lo, hi in parts:
            if self.m.cuda:
                if s.host is None:
                    s.host = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=True)
                    c.add("host", s.nbytes)
                pread_all(self.fd, byte_view(s.host[lo:hi]), s.offset + lo, self.sums)
            else:
                self._alloc_out(s)
                pread_all(self.fd, byte_view(s.out[lo:hi]), s.offset + lo, self.sums)
                s.got += hi - lo
            s.read += hi - lo
            if s.read >= s.nbytes and self.sums is not None:
                # the whole tensor is back: its bytes must be those written (raises otherwise,
                # before the tensor reaches autograd: get() waits for this job)
                self.sums.verify(s.offset, byte_view(s.host if self.m.cuda else s.out), self.fd)
            c.moved_add("nvme_read", hi - lo)
            if self.tier == "nvme":
                c.add("nvme", -(hi - lo))
        if self.m.cuda:
            self._h2d(parts)

    def wait(self) -> None:
        """Block until the I/O issued so far for this group is done (and raise its errors)."""
        with self.lock:
            futs, self.futures = self.futures, []
        for f in futs:
            f.result()

    def get(self, s: Slot) -> torch.Tensor:
        """The slot's tensor on the device, whole; fetches what has not come back yet."""
        if s.view is not None:
            return s.view
        if s.src is not None and s.got == 0:  # it never fully left: no round trip needed
            return self._placed(s, s.tensor(s.src))
        t0 = time.perf_counter()
        self.wait()
        if s.src is not None:
            return self._placed(s, s.tensor(s.src))
        if s.got < s.nbytes:
            missing = [(s, 0, s.nbytes)] if s.out is None else [(s, s.got, s.nbytes)]
            if self.m.cuda and self.tier == "cpu":
                self._h2d(missing)
            else:
                self._read_sync(missing)
        self.m.counters.stalled(time.perf_counter() - t0)
        out = s.out
        if self.m.cuda:
            cur = torch.cuda.current_stream(self.m.device)
            cur.wait_event(s.ready)
            out.record_stream(cur)
        return self._placed(s, s.tensor(out.view(s.dtype)))

    def _placed(self, s: Slot, t: torch.Tensor) -> torch.Tensor:
        """``t``, or for a slice with gaps (back dense) ``t`` at its place in a buffer laid out
        as its storage was. The group holds that buffer until every slice of the storage is
        back in it; then only the slices' own views keep it."""
        if s.layout is None:
            return t
        key, offset, shape, stride = s.layout
        base = self.bases[key]
        if base[3] is None:
            base[3] = torch.empty(base[1] - base[0], dtype=t.dtype, device=t.device)
            # the gaps are held too, as long as the buffer lives
            gaps = max(0, base[3].numel() * base[3].element_size() - base[2])
            self.m.counters.add("act", gaps)
            weakref.finalize(base[3].untyped_storage(), self.m.counters.add, "act", -gaps)
        s.view = base[3].as_strided(shape, stride, offset - base[0])
        s.view.copy_(t)
        base[4] -= 1
        if base[4] == 0:
            base[3] = None
        return s.view

    def _read_sync(self, parts):
        f = self.m.nvme_store().submit(self._read, parts)
        f.result()

    def release(self, s: Slot) -> None:
        """The consumer has the tensor; forget it so its memory goes when autograd drops it."""
        s.view = None
        if s.out is not None:
            s.out = None
            self.m.counters.add("act", -s.nbytes)
        if all(x.out is None and x.src is None and x.got >= x.nbytes for x in self.slots):
            self._done()

    def _done(self, now: bool = False):
        if self.tier == "nvme" and self._fin.alive:
            self._fin.detach()
            store = self.m.store
            if store is not None:
                # discard (an exception, an abandoned pass): deleted before it returns, so no
                # file outlives the exception; after a normal read-back, off the I/O thread
                # everything queued for this file has run (callers waited): delete it now; on
                # it, behind whatever is still queued
                if now:
                    store.unlink_now(self.path)
                else:
                    (store.unlink_later if store.on_io_thread() else store.unlink)(self.path)
        for s in self.slots:
            if s.host is not None:
                self.m.counters.add("host", -s.nbytes)
                s.host = None

    def abandon(self) -> None:
        """The pass that owned this group is gone (its graph was freed, with or without a
        backward): free what is left. On the I/O thread it must not wait for its own queue."""
        store = self.m.store
        if store is not None and store.on_io_thread() and store.pool is not None:
            with contextlib.suppress(RuntimeError):
                store.pool.submit(self.discard)
                return
        self.discard()

    def discard(self) -> None:
        with contextlib.suppress(Exception):   # only waiting matters: its error reached the reader
            self.wait()
        c = self.m.counters
        for base in self.bases.values():
            base[3] = None
        for s in self.slots:
            s.view = None
            if s.out is not None:
                s.out = None
                c.add("act", -s.nbytes)
            if s.src is not None:
                c.add("act", -s.nbytes)
            s.src = None
        if self.tier == "nvme" and self._fin.alive:
            left = sum(max(0, s.sent - s.got) for s in self.slots)
            c.add("nvme", -left)
        self._done(now=True)
