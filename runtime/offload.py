"""Moving saved tensors off the compute device and back: pinned host memory and NVMe files.

A ``Group`` holds the tensors one unit (or one checkpoint) sent away during one forward pass.
``put`` starts moving a tensor out and returns its ``Slot``; ``prefetch`` starts bringing the
whole group back (the plan says when); ``get`` waits for one slot and returns it on the compute
device. The runtime decides nothing here: which tensors go where and when comes from the plan.

Three paths:
- CUDA, ``cpu`` tier: device-to-host copies into pinned buffers from a reusable pool on a side
  stream; the GPU tensor is dropped once the copy's event has completed; the prefetch copies
  back on another stream and the compute stream waits for its event only where the tensor is
  unpacked.
- CUDA, ``nvme`` tier: the same device-to-host copy into pinned staging, then a background I/O
  thread writes the staging buffer to a file; reading back goes file -> pinned staging -> GPU on
  the I/O thread, and the H2D copy follows the read at once (the schedule's ``in:`` event has no
  issue point of its own: it waits only for its ``r:`` read).
- CPU device (unified memory, spec ``cpu-host``): the tensor's own memory is written to the file
  by the I/O thread (no staging: there is no other memory to stage through), and the tensor is
  dropped when the write has finished; the read allocates a fresh tensor.

Files live in a directory unique to the process under the NVMe directory; each group's file is
deleted as soon as it has been read back, when the group is discarded (an abandoned forward)
and at exit, and every directory the store created is removed again.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch


_IO_PREFIX = "tierplan-io"


class Counters:
    """Bytes resident per place and bytes moved per link, shared with the I/O threads."""

    LINKS = ("d2h", "h2d", "nvme_write", "nvme_read")

    def __init__(self):
        self.lock = threading.Lock()
        self.reset_all()

    def reset_all(self):
        with self.lock:
            self.act = 0            # activation bytes the runtime knows are on the compute device
            self.host = 0           # pinned host bytes holding offloaded tensors
            self.nvme = 0           # bytes in offload files
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


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (works for bf16 and bool, which numpy lacks)."""
    return t.reshape(-1).view(torch.uint8)


def _pwrite_all(fd: int, mv: memoryview, offset: int):
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


def _pread_all(fd: int, mv: memoryview, offset: int):
    while len(mv):
        n = os.preadv(fd, [mv], offset)
        if n == 0:
            raise IOError("offload file is shorter than what was written to it")
        mv, offset = mv[n:], offset + n


class HostPool:
    """Pinned host buffers reused by exact size (blocks repeat, so sizes repeat)."""

    def __init__(self):
        self.free: dict[int, list[torch.Tensor]] = {}
        self.lock = threading.Lock()

    def get(self, nbytes: int) -> torch.Tensor:
        with self.lock:
            lst = self.free.get(nbytes)
            if lst:
                return lst.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def put(self, buf: torch.Tensor):
        with self.lock:
            self.free.setdefault(buf.numel(), []).append(buf)

    def clear(self):
        with self.lock:
            self.free.clear()


class NvmeStore:
    """The per-process offload directory and the I/O thread pool that writes and reads it."""

    def __init__(self, base: str | os.PathLike, workers: int = 1):
        # One I/O thread: reads and writes share one device, and a single FIFO worker
        # guarantees a file's writes finish before its read or its deletion run.
        self.base = Path(base)
        self.dir: Path | None = None
        self.created: list[Path] = []       # directories we made, deepest last
        self.pool: ThreadPoolExecutor | None = None
        self.workers = workers
        self.files: set[str] = set()
        self.lock = threading.Lock()
        self._atexit = weakref.WeakMethod(self.close)
        atexit.register(_close_weak, self._atexit)

    def _ensure(self):
        if self.dir is not None:
            return
        missing = []
        p = self.base.resolve()
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            d.mkdir()
            self.created.append(d)
        d = self.base.resolve() / f"tierplan-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        d.mkdir()
        self.created.append(d)
        self.dir = d
        self.pool = ThreadPoolExecutor(self.workers, thread_name_prefix=_IO_PREFIX)

    def open(self, label: str) -> tuple[int, str]:
        self._ensure()
        path = str(self.dir / f"{label}-{uuid.uuid4().hex[:8]}.bin")
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        with self.lock:
            self.files.add(path)
        return fd, path

    def unlink(self, fd: int, path: str):
        with self.lock:
            if path not in self.files:
                return
            self.files.discard(path)
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def unlink_later(self, fd: int, path: str):
        """Delete after the writes already queued (a dropped group may still be writing)."""
        pool = self.pool
        if pool is not None:
            with contextlib.suppress(RuntimeError):   # the pool shut down meanwhile
                pool.submit(self.unlink, fd, path)
                return
        self.unlink(fd, path)

    def submit(self, fn, *args) -> Future:
        self._ensure()
        return self.pool.submit(fn, *args)

    def close(self):
        """Stop the I/O threads, delete every file and every directory this store created."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        with self.lock:
            files, self.files = list(self.files), set()
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)
        for d in reversed(self.created):
            try:
                d.rmdir()
            except OSError:
                pass   # not empty: something else was put there; never delete what we did not make
        self.created = []
        self.dir = None


def _close_weak(ref):
    m = ref()
    if m is not None:
        m()


class Slot:
    __slots__ = ("shape", "dtype", "nbytes", "offset", "src", "host", "out", "ready", "refs",
                 "write")

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype = t.shape, t.dtype
        self.nbytes = t.numel() * t.element_size()
        self.offset = 0
        self.src = None      # the device tensor until it has left
        self.host = None     # pinned copy (CUDA paths)
        self.out = None      # the tensor back on the device
        self.ready = None    # CUDA event: `out` is filled
        self.write = None    # Future of the NVMe write
        self.refs = 0


class Mover:
    """Everything that moves tensors: streams, the pinned pool, the NVMe store, the counters."""

    def __init__(self, device: torch.device, nvme_dir: str | None, counters: Counters):
        self.device = device
        self.cuda = device.type == "cuda"
        self.counters = counters
        self.nvme_dir = nvme_dir
        self.store: NvmeStore | None = None
        self.pool = HostPool() if self.cuda else None
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
        self.pending: list[tuple] = []   # (event, object to drop or buffer to return)
        self.stall_events: list[tuple] = []

    def nvme_store(self) -> NvmeStore:
        if self.store is None:
            if not self.nvme_dir:
                raise ValueError("the plan offloads to nvme but names no nvme_dir; pass "
                                 "apply_plan(..., nvme_dir=DIR) or solve with --nvme-dir")
            self.store = NvmeStore(self.nvme_dir)
        return self.store

    def group(self, tier: str, label: str) -> "Group":
        return Group(self, tier, label)

    def poll(self):
        """Drop device tensors whose copy out has completed, recycle pinned buffers."""
        keep = []
        for ev, obj, pool_buf in self.pending:
            if ev.query():
                if pool_buf is not None:
                    self.pool.put(pool_buf)
            else:
                keep.append((ev, obj, pool_buf))
        self.pending = keep

    def close(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.poll()
            self.pool.clear()
        if self.store is not None:
            self.store.close()
            self.store = None


class Group:
    """The tensors one unit (or one checkpoint) sent to ``tier`` in one forward pass."""

    def __init__(self, mover: Mover, tier: str, label: str):
        self.m = mover
        self.tier = tier
        self.label = label
        self.slots: list[Slot] = []
        self.fd = None
        self.path = None
        self.size = 0
        self.prefetched = False
        self.read: Future | None = None
        self.done = False
        if tier == "nvme":
            store = mover.nvme_store()
            self.fd, self.path = store.open(label)
            # Delete the file if the group is dropped unread (an abandoned forward).
            self._fin = weakref.finalize(self, store.unlink_later, self.fd, self.path)

    # -- out
    def put(self, t: torch.Tensor) -> Slot:
        m, c = self.m, self.m.counters
        s = Slot(t)
        self.slots.append(s)
        src = t.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        if self.tier == "nvme":
            s.offset = self.size
            self.size += s.nbytes
            c.add("nvme", s.nbytes)
        if m.cuda:
            host = m.pool.get(s.nbytes)
            m.d2h.wait_stream(torch.cuda.current_stream(m.device))
            with torch.cuda.stream(m.d2h):
                host.copy_(_as_bytes(src), non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(m.d2h)
            c.moved_add("d2h", s.nbytes)
            c.add("host", s.nbytes)
            if self.tier == "cpu":
                s.host = host
                m.pending.append((ev, src, None))   # GPU copy freed when the event completes
            else:
                s.write = m.nvme_store().submit(self._write_staged, s, host, ev, src)
        else:
            assert self.tier == "nvme", "the cpu tier exists only with a CUDA device"
            s.src = src
            c.add("act", s.nbytes)
            s.write = m.nvme_store().submit(self._write_direct, s)
        return s

    def _write_direct(self, s: Slot):
        if s.nbytes:
            _pwrite_all(self.fd, memoryview(_as_bytes(s.src).numpy()), s.offset)
        s.src = None          # the tensor's memory is free once the bytes are on disk
        self.m.counters.add("act", -s.nbytes)
        self.m.counters.moved_add("nvme_write", s.nbytes)

    def _write_staged(self, s: Slot, host: torch.Tensor, ev, src):
        ev.synchronize()
        del src               # GPU copy no longer needed
        if s.nbytes:
            _pwrite_all(self.fd, memoryview(host.numpy()), s.offset)
        self.m.pool.put(host)
        self.m.counters.add("host", -s.nbytes)
        self.m.counters.moved_add("nvme_write", s.nbytes)

    # -- back
    def prefetch(self):
        """Start bringing every slot back (the plan's issue point, or on demand)."""
        if self.prefetched:
            return
        self.prefetched = True
        m = self.m
        if self.tier == "nvme":
            self.read = m.nvme_store().submit(self._read_all)
            return
        # CUDA host tier: H2D on its own stream, awaited where each tensor is unpacked; the
        # host copies it reads must have landed (the schedule's in: waits for out:).
        m.h2d.wait_stream(m.d2h)
        for s in self.slots:
            with torch.cuda.stream(m.h2d):
                out = torch.empty(s.nbytes, dtype=torch.uint8, device=m.device)
                out.copy_(s.host, non_blocking=True)
                s.ready = torch.cuda.Event()
                s.ready.record(m.h2d)
            s.out = out.view(s.dtype).view(s.shape)
            m.pending.append((s.ready, None, s.host))
            m.counters.add("host", -s.nbytes)
            m.counters.add("act", s.nbytes)
            m.counters.moved_add("h2d", s.nbytes)
            s.host = None

    def _read_all(self):
        m = self.m
        for s in self.slots:
            s.write.result()
        for s in self.slots:
            if m.cuda:
                host = m.pool.get(s.nbytes)
                if s.nbytes:
                    _pread_all(self.fd, memoryview(host.numpy()), s.offset)
                with torch.cuda.stream(m.h2d):
                    out = torch.empty(s.nbytes, dtype=torch.uint8, device=m.device)
                    out.copy_(host, non_blocking=True)
                    ev = torch.cuda.Event()
                    ev.record(m.h2d)
                ev.synchronize()   # this is the I/O thread: the staging buffer is reusable after
                m.pool.put(host)
                m.counters.moved_add("h2d", s.nbytes)
                s.ready = ev
            else:
                out = torch.empty(s.nbytes, dtype=torch.uint8)
                if s.nbytes:
                    _pread_all(self.fd, memoryview(out.numpy()), s.offset)
            s.out = out.view(s.dtype).view(s.shape)
            m.counters.add("act", s.nbytes)
            m.counters.moved_add("nvme_read", s.nbytes)
        self.m.counters.add("nvme", -self.size)
        self._fin.detach()    # read back: the file is no longer needed
        self.m.nvme_store().unlink(self.fd, self.path)

    def get(self, s: Slot) -> torch.Tensor:
        """The slot's tensor on the compute device; waits (and counts the stall) if needed."""
        m = self.m
        if not self.prefetched:
            self.prefetch()   # the plan issued no prefetch before this point: fetch on demand
        if self.read is not None and not self.read.done():
            t0 = time.perf_counter()
            self.read.result()
            m.counters.stalled(time.perf_counter() - t0)
        elif self.read is not None:
            self.read.result()   # re-raise an I/O error
        out = s.out
        if m.cuda:
            cur = torch.cuda.current_stream(m.device)
            if not s.ready.query():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(cur)
                cur.wait_event(s.ready)
                b.record(cur)
                m.stall_events.append((a, b))
            else:
                cur.wait_event(s.ready)
            out.record_stream(cur)   # allocated on the h2d stream, used on the compute stream
        return out

    def release(self, s: Slot):
        """The consumer has the tensor; forget it so its memory goes when autograd drops it."""
        if s.out is not None:
            s.out = None
            self.m.counters.add("act", -s.nbytes)

    def abandon(self):
        """The pass that owned this group is gone (its graph was freed, with or without a
        backward): free what is left. Runs where the graph was freed; on an I/O thread it must
        not wait for that thread's own queue, so it queues the discard behind the I/O instead."""
        if self.tier == "nvme" and threading.current_thread().name.startswith(_IO_PREFIX):
            store = self.m.store
            if store is not None and store.pool is not None:
                with contextlib.suppress(RuntimeError):   # the pool shut down meanwhile
                    store.pool.submit(self.discard)
                    return
        self.discard()

    def discard(self):
        """Forget everything (an abandoned pass): wait for in-flight I/O, delete the file."""
        # Only waiting matters here: a write or read that failed has nothing left to undo, and
        # its error already reached whoever needed the data.
        for s in self.slots:
            if s.write is not None:
                with contextlib.suppress(Exception):
                    s.write.result()
        if self.read is not None:
            with contextlib.suppress(Exception):
                self.read.result()
        for s in self.slots:
            self.release(s)
        if self.tier == "nvme" and self._fin.alive:
            self.m.counters.add("nvme", -self.size)
            self._fin.detach()
            if self.m.store is not None:   # else closed: its close deleted every file
                self.m.store.unlink(self.fd, self.path)
        if self.tier == "cpu":
            for s in self.slots:
                if s.host is not None:
                    self.m.counters.add("host", -s.nbytes)
                    s.host = None
