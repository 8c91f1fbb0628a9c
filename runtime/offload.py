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

Every byte moves through the transfer engine's backend (``runtime.transfer``); nothing here
knows which device it is. Paths:
- Unified memory (a CPU device, spec ``cpu-host``): the I/O thread writes each tensor's own
  memory to the group's file and reads into freshly allocated tensors; no staging.
- Staged (a device that is not host memory), ``cpu`` tier: copies into views of the pinned
  slab on the ``d2h`` stream, back on the ``h2d`` stream; each waits explicitly for the event
  of what produced its source (the compute stream, the ``d2h`` copy) and the compute stream
  waits for a slot's ``h2d`` event only where it is unpacked. Buffers a copy stream still
  reads are held until its event (``Backend.keep``), never ``record_stream``; a slot's buffer
  back on the device is allocated on the training thread for the compute stream, and the
  ``h2d`` copy waits for the event recorded after that allocation.
- Staged, ``nvme`` tier: the same copies through the slab, with the I/O thread writing them to
  the file after the copy's event and reading them back before the ``h2d`` copy.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from concurrent.futures import Future

import torch

from .files import NvmeStore, Sums, byte_view
from .transfer import ByteStream, backend_for


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
    """Everything that moves bytes: the backend and its copy streams, the NVMe store, the
    counters. ``pinned_bytes``: the size of the backend's pinned slab (the plan's figure)."""

    def __init__(self, device: torch.device, nvme_dir: str | None, counters: Counters,
                 pinned_bytes: int = 0, io: tuple[int, int] | None = None):
        self.device = device
        self.io = io                 # (request bytes, in flight) of the NVMe store's disk I/O
        self.be = backend_for(device)
        if pinned_bytes:
            self.be.size_pinned(pinned_bytes)
        self.staged = not self.be.unified
        self.counters = counters
        self.nvme_dir = nvme_dir
        self.store: NvmeStore | None = None
        if self.staged:
            self.d2h = self.be.stream("d2h")
            self.h2d = self.be.stream("h2d")

    def barrier(self) -> None:
        """The compute stream waits for everything issued on the copy streams so far."""
        if self.staged:
            for s in (self.d2h, self.h2d):
                ev = self.be.event()
                self.be.record(ev, s)
                self.be.wait(None, ev)

    def nvme_store(self) -> NvmeStore:
        if self.store is None:
            if not self.nvme_dir:
                raise ValueError("the plan uses nvme but names no nvme_dir; pass "
                                 "apply_plan(..., nvme_dir=DIR) or solve with --nvme-dir")
            self.store = NvmeStore(self.nvme_dir, self.io)
        return self.store

    def close(self):
        if self.staged:
            self.be.synchronize()
            self.be.release_pinned()
        if self.store is not None:
            self.store.close()
            self.store = None


class Slot:
    """The saved bytes of one storage in a group: from the first byte any of its saved views
    uses (rounded down to ``SLOT_ALIGN``) to one past the last, gaps included. Views of one
    storage (a tensor and slices of it, Mamba's projection split into parts) move once and
    come back laid out as they were, each view at its place."""

    __slots__ = ("base", "lo", "hi", "nbytes", "offset", "src", "sent", "disk", "host", "out",
                 "got", "ready", "read", "views", "sent_ev", "alloc_ev")

    def __init__(self, base: torch.Tensor | None, lo: int, hi: int):
        self.base = base          # the whole storage as bytes, until the group is sealed
        self.lo, self.hi = lo, hi
        self.nbytes = hi - lo
        self.offset = 0           # in the group's stream (set when sealed)
        self.src = None           # the bytes on the device, until the last has left
        self.sent = 0             # bytes sent off the device
        self.disk = 0             # bytes written to the file (CUDA nvme: after staging)
        self.host = None          # pinned copy (a slab view; staged paths)
        self.out = None           # the bytes back on the device (uint8, nbytes)
        self.got = 0              # bytes back
        self.ready = None         # event: the last copy into ``out`` (staged paths)
        self.sent_ev = None       # event: the last copy into ``host`` (staged paths)
        self.alloc_ev = None      # event: ``out`` allocated, on the compute stream
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
        self.stream = ByteStream()    # the slots, once sealed, as one byte stream
        self.path = None
        self.fd = None
        self.futures: list[Future] = []
        self.lock = threading.Lock()
        self.sums = None
        self.by_storage: dict = {}    # (device, storage address) -> its slot, until sealed
        self.sealed = False
        if tier == "nvme":
            store = mover.nvme_store()
            self.fd, self.path = store.open(label, reuse=True)
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
        slot.offset = self.stream.append(slot, slot.nbytes)

    @property
    def size(self) -> int:
        return self.stream.size

    def seal(self) -> None:
        """Fix the stream: every slot's place in it. The first send, fetch or get seals."""
        if self.sealed:
            return
        self.sealed = True
        self.by_storage = {}
        for slot in self.slots:
            self._seal_slot(slot)

    def _parts(self, a: int, b: int, by: str):
        """(slot, 0, nbytes) of the whole slots the planned share [a, b) moves
        (``ByteStream.parts``: a slot goes with the share of its first byte for sends, of its
        last for fetches)."""
        for _, s, _, n in self.stream.parts(a, b, by):
            yield s, 0, n

    def span(self, fa: float, fb: float) -> tuple[int, int]:
        """The real bytes of the planned fraction range [fa, fb) of the stream."""
        self.seal()
        return self.stream.span(fa, fb)

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
        if not m.staged:
            self.futures.append(m.nvme_store().submit(self._write_direct, parts))
            return
        be = m.be
        produced = be.event()                # the compute stream has written what is sent
        be.record(produced, None)
        be.wait(m.d2h, produced)
        staged, gone = [], []
        for s, lo, hi in parts:
            if s.host is None:
                s.host = be.pinned(s.nbytes)
                c.add("host", s.nbytes)
            be.copy(s.host[lo:hi], as_bytes(s.src)[lo:hi], m.d2h)
            c.moved_add("d2h", hi - lo)
            s.sent += hi - lo
            if s.sent >= s.nbytes:
                gone.append(s.src)
                s.src = None
                c.add("act", -s.nbytes)
            staged.append((s, lo, hi))
        ev = be.event()
        be.record(ev, m.d2h)
        for t in gone:
            be.keep(t, ev)                   # freed once the copy has run, not before
        for s, _, _ in staged:
            s.sent_ev = ev
        if self.tier == "nvme":
            self.futures.append(m.nvme_store().submit(self._write_staged, staged, ev))

    def _write_direct(self, parts):
        c = self.m.counters
        parts = [(s, lo, hi) for s, lo, hi in parts if s.src is not None]
        self.m.be.write_many(self.fd, [(s.offset + lo, byte_view(as_bytes(s.src)[lo:hi]))
                                       for s, lo, hi in parts], self.sums)
        for s, lo, hi in parts:
            c.moved_add("nvme_write", hi - lo)
            s.sent += hi - lo
            if s.sent >= s.nbytes:
                s.src = None            # the tensor's memory is free once its bytes are on disk
                c.add("act", -s.nbytes)

    def _write_staged(self, parts, ev):
        be = self.m.be
        be.host_wait(ev)
        c = self.m.counters
        be.write_many(self.fd, [(s.offset + lo, byte_view(s.host[lo:hi])) for s, lo, hi in parts],
                      self.sums)
        for s, lo, hi in parts:
            c.moved_add("nvme_write", hi - lo)
            s.disk += hi - lo
            if s.disk >= s.nbytes:
                c.add("host", -s.nbytes)
                host, s.host = s.host, None   # every staged byte is on disk
                be.unpin(host)

    # -- back
    def fetch(self, a: int, b: int) -> None:
        """Bring the stream's bytes [a, b) back to the device (this stage's share)."""
        self.seal()
        m, c = self.m, self.m.counters
        parts = [(s, lo, hi) for s, lo, hi in self._parts(a, b, "end") if s.src is None]
        if not parts:
            return
        if m.staged:
            for s, _, _ in parts:             # on the training thread, for the compute stream
                self._alloc_out(s)
        if not m.staged or self.tier == "nvme":
            self.futures.append(m.nvme_store().submit(self._read, parts))
            return
        self._h2d(parts)

    def _alloc_out(self, s: Slot):
        if s.out is None:
            be = self.m.be
            s.out = be.empty(s.nbytes) if self.m.staged else torch.empty(s.nbytes,
                                                                        dtype=torch.uint8)
            self.m.counters.add("act", s.nbytes)
            if self.m.staged:
                s.alloc_ev = be.event()      # the copy into it waits for this
                be.record(s.alloc_ev, None)

    def _h2d(self, parts):
        m, c, be = self.m, self.m.counters, self.m.be
        for s, lo, hi in parts:
            if s.alloc_ev is not None:
                be.wait(m.h2d, s.alloc_ev)
            if self.tier == "cpu" and s.sent_ev is not None:
                be.wait(m.h2d, s.sent_ev)    # the host copy it reads must have landed
            be.copy(s.out[lo:hi], s.host[lo:hi], m.h2d)
            s.got += hi - lo
            c.moved_add("h2d", hi - lo)
            s.ready = be.event()
            be.record(s.ready, m.h2d)

    def _read(self, parts):
        c, be, staged = self.m.counters, self.m.be, self.m.staged
        for s, _, _ in parts:                 # every buffer of the share, then one read
            if not staged:
                self._alloc_out(s)
            elif s.host is None:
                s.host = be.pinned(s.nbytes)
                c.add("host", s.nbytes)
        be.read_many(self.fd, [(s.offset + lo, byte_view((s.host if staged else s.out)[lo:hi]))
                               for s, lo, hi in parts], self.sums)
        for s, lo, hi in parts:
            if not staged:
                s.got += hi - lo
            s.read += hi - lo
            if s.read >= s.nbytes and self.sums is not None:
                # the whole tensor is back: its bytes must be those written (raises otherwise,
                # before the tensor reaches autograd: get() waits for this job)
                self.sums.verify(s.offset, byte_view(s.host if staged else s.out), self.fd)
            c.moved_add("nvme_read", hi - lo)
            if self.tier == "nvme":
                c.add("nvme", -(hi - lo))
        if staged:
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
            if self.m.staged:
                self._alloc_out(s)
            if self.m.staged and self.tier == "cpu":
                self._h2d(missing)
            else:
                self._read_sync(missing)
        self.m.counters.stalled(time.perf_counter() - t0)
        out = s.out
        if self.m.staged:
            # out was allocated for the compute stream: once it waited for the copy's event,
            # the allocator's stream is the one that reads and frees it (no record_stream)
            self.m.be.wait(None, s.ready)
            out = self.m.be.use(out)
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
                # file outlives the exception; after a normal read-back (off the I/O thread
                # everything queued for this file has run: callers waited) kept for the next
                # group of this label, deleted with the store
                if now:
                    store.unlink_now(self.path)
                else:
                    store.recycle(self.path, self.label)
        for s in self.slots:
            if s.host is not None:
                self.m.counters.add("host", -s.nbytes)
                host, s.host = s.host, None
                self.m.be.unpin(host, s.ready)   # after the last copy out of it

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
                if s.ready is not None:
                    self.m.be.keep(s.out, s.ready)   # a copy into it may still be queued
                s.out = None
                c.add("act", -s.nbytes)
            if s.src is not None:
                c.add("act", -s.nbytes)
            s.src = None
        if self.tier == "nvme" and self._fin.alive:
            left = sum(max(0, s.sent - s.got) for s in self.slots)
            c.add("nvme", -left)
        self._done(now=True)
