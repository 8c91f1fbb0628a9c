"""Moving saved activations off the compute device and back, a byte range at a time.

A ``Group`` holds the tensors one unit (or one checkpoint) saved during one forward pass: one
byte stream of ``Slot``s, one per storage the saved tensors view, in the order first saved.
A slot is the storage's bytes from the first any saved view uses to one past the last, gaps
included, as the profile counts a saved storage: a tensor and slices of it move once, and each
view (``View``) comes back at its place, with its strides. The plan says, stage by stage,
which share of that stream moves (``send``: out, ``fetch``: back); shares are fractions of the
planned bytes applied to the real ones, so a short last batch moves proportionally less. A
slot leaves the device when its last byte has gone and comes back (allocated) when its first
byte arrives; ``get`` returns a view whole, fetching on demand what has not come back yet
(counted as a stall). The runtime decides nothing here.

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


# A slot's first byte is its storage's first saved byte rounded down to this, so that every
# view's offset within the slot stays a multiple of its element size.
SLOT_ALIGN = 64


def _extent_bytes(t: torch.Tensor) -> tuple[int, int]:
    """[first, one past the last) byte of ``t``'s elements in its storage."""
    lo = t.storage_offset() * t.element_size()
    n = 1 + sum((d - 1) * st for d, st in zip(t.shape, t.stride()))
    return lo, lo + n * t.element_size()


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
    """The saved bytes of one storage in a group: from the first byte any of its saved views
    uses (rounded down to ``SLOT_ALIGN``) to one past the last, gaps included. Views of one
    storage (a tensor and slices of it, Mamba's projection split into parts) move once and
    come back laid out as they were, each view at its place."""

    __slots__ = ("base", "lo", "hi", "nbytes", "offset", "src", "sent", "disk", "host", "out",
                 "got", "ready", "read", "views")

    def __init__(self, base: torch.Tensor | None, lo: int, hi: int):
        self.base = base          # the whole storage as bytes, until the group is sealed
        self.lo, self.hi = lo, hi
        self.nbytes = hi - lo
        self.offset = 0           # in the group's stream (set when sealed)
        self.src = None           # the bytes on the device, until the last has left
        self.sent = 0             # bytes sent off the device
        self.disk = 0             # bytes written to the file (CUDA nvme: after staging)
        self.host = None          # pinned copy (CUDA)
        self.out = None           # the bytes back on the device (uint8, nbytes)
        self.got = 0              # bytes back
        self.ready = None         # CUDA event: the last copy into ``out`` has been issued
        self.read = 0             # bytes read back from the file (checksums: verified when all)
        self.views = 0            # views not released yet


class View:
    """One saved tensor: its slot, where it starts (bytes from its storage's start), its
    shape, strides and dtype, and its lazy conjugate and negative bits (a view that reads its
    storage conjugated or negated: ``x.conj()`` of a complex tensor). ``refs``: the packer's
    count of unpacks to come."""

    __slots__ = ("slot", "byte_off", "shape", "stride", "dtype", "conj", "neg", "refs")

    def __init__(self, slot, t: torch.Tensor, byte_off: int):
        self.slot, self.byte_off = slot, byte_off
        self.shape, self.stride, self.dtype = tuple(t.shape), tuple(t.stride()), t.dtype
        self.conj, self.neg = t.is_conj(), t.is_neg()
        self.refs = 0

    def over(self, buf: torch.Tensor, lo: int) -> torch.Tensor:
        """This tensor over ``buf`` (bytes), whose first byte is its storage's byte ``lo``."""
        off = buf.storage_offset() + self.byte_off - lo
        x = torch.empty(0, dtype=self.dtype, device=buf.device).set_(
            buf.untyped_storage(), off // self.dtype.itemsize, self.shape, self.stride)
        if self.neg:
            x = torch._neg_view(x)
        return x.conj() if self.conj else x


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
        self.by_storage: dict = {}    # (device, storage address) -> its slot, until sealed
        self.sealed = False
        if tier == "nvme":
            store = mover.nvme_store()
            self.fd, self.path = store.open(label)
            self.sums = Sums(self.path, label)   # checksums of what is written, checked on read
            # the file goes if the group is dropped unread (an abandoned forward)
            self._fin = weakref.finalize(self, store.unlink_later, self.path)

    # -- registration (while the unit's forward saves tensors)
    def put(self, t: torch.Tensor) -> View:
        """Register a saved tensor. Its storage is held (not copied) until its bytes leave."""
        t = t.detach()
        if t.numel() == 0:
            return View(None, t, 0)
        st = t.untyped_storage()
        lo, hi = _extent_bytes(t)
        key = (t.device, st.data_ptr())
        slot = None if self.sealed else self.by_storage.get(key)
        if slot is None:
            slot = Slot(None, lo - lo % SLOT_ALIGN, hi)
            slot.base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
                st, 0, (st.nbytes(),))
            self.slots.append(slot)
            if self.sealed:            # a tensor saved after the group began to move
                self._seal_slot(slot)
                self.size += slot.nbytes
            else:
                self.by_storage[key] = slot
            self.m.counters.add("act", slot.nbytes)
        else:
            new_lo = min(slot.lo, lo - lo % SLOT_ALIGN)
            new_hi = max(slot.hi, hi)
            self.m.counters.add("act", (new_hi - new_lo) - slot.nbytes)
            slot.lo, slot.hi, slot.nbytes = new_lo, new_hi, new_hi - new_lo
        slot.views += 1
        return View(slot, t, lo)

    def _seal_slot(self, slot: Slot) -> None:
        slot.src = slot.base[slot.lo:slot.hi]
        slot.base = None
        slot.offset = self.size

    def seal(self) -> None:
        """Fix the stream: every slot's place in it. The first send, fetch or get seals."""
        if self.sealed:
            return
        self.sealed = True
        self.by_storage = {}
        for slot in self.slots:
            self._seal_slot(slot)
            self.size += slot.nbytes

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
        self.seal()
        a = int(round(fa * self.size))
        b = self.size if fb >= 1.0 - 1e-12 else int(round(fb * self.size))
        return a, b

    # -- out
    def send(self, a: int, b: int) -> None:
        """Move the stream's bytes [a, b) off the device (this stage's share)."""
        self.seal()
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
        self.seal()
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
        """Block until the I/O issued so far for this group is done (and raise its errors).
        In a process forked from the one that issued it, nothing: the I/O thread that would
        finish those futures (and may have held this lock at the fork) is the parent's."""
        store = self.m.store
        if store is not None and store.forked():
            self.futures = []
            return
        with self.lock:
            futs, self.futures = self.futures, []
        for f in futs:
            f.result()

    def get(self, v: View) -> torch.Tensor:
        """The view's tensor on the device, laid out as it was saved; fetches what of its
        slot has not come back yet."""
        s = v.slot
        if s is None:
            return torch.empty_strided(v.shape, v.stride, dtype=v.dtype, device=self.m.device)
        self.seal()
        if s.src is not None and s.got == 0:  # it never fully left: no round trip needed
            return v.over(s.src, s.lo)
        t0 = time.perf_counter()
        self.wait()
        if s.src is not None:
            return v.over(s.src, s.lo)
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
        return v.over(out, s.lo)

    def _read_sync(self, parts):
        f = self.m.nvme_store().submit(self._read, parts)
        f.result()

    def release(self, v: View) -> None:
        """The consumer has the view's tensor; once every view of its slot has been taken,
        forget the slot's bytes so their memory goes when autograd drops the views."""
        s = v.slot
        if s is not None:
            s.views -= 1
            if s.views > 0:
                return
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
        store = self.m.store
        if store is not None and store.forked():
            # a forked child: the I/O, the files and the counters are the parent's (its I/O
            # thread may have held their locks at the fork); the child only lets go
            self.futures, self.slots, self.segments = [], [], []
            return
        with contextlib.suppress(Exception):   # only waiting matters: its error reached the reader
            self.wait()
        c = self.m.counters
        for s in self.slots:
            if s.base is not None:        # never sealed: the storage was held, not moved
                s.base = None
                c.add("act", -s.nbytes)
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
