"""Direct I/O for the runtime's NVMe files: the drive used the way ``plan hardware`` measured it.

The planner prices the NVMe tier at the spec's rates, which ``plan hardware`` measures with
``O_DIRECT`` requests, several in flight. Buffered writes would instead go through the page
cache: on a host with memory to spare they run at memory speed and come back from memory (the
plan's time is then wrong the other way, and the host memory they take is counted nowhere),
and on a host without they stall in write-back. So every file range the runtime moves is cut
at multiples of ``request`` bytes of the file into requests of at most that size, up to
``in_flight`` of them at once (the figures are the plan's, ``executor.io_request_bytes`` and
``io_in_flight``), each issued with ``O_DIRECT``:

- a request whose file range covers whole blocks and whose memory starts on a block boundary
  moves straight from or into the caller's memory;
- any other goes through a bounce buffer (page aligned, ``request`` bytes): its bytes are
  copied in or out, and a block it covers only in part is read first and written whole
  (under the file's lock, so two ranges sharing a block never lose each other's bytes).

Bounce buffers are made as needed, never more than ``in_flight`` (a semaphore hands them out),
so the engine holds at most ``in_flight * request`` bytes of them: the figure the plan prices
as the staging pool of a CPU host (docs/formulation.md, "Staging"). A file ends on a block
boundary (its last block padded with zeros); what was written where is the caller's to know.
"""
from __future__ import annotations

import bisect
import contextlib
import ctypes
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from planner.formats import IO_BLOCK_BYTES as BLOCK   # O_DIRECT: offsets, sizes, addresses

DISK_THREAD_PREFIX = "tierplan-disk"


class ShortRead(OSError):
    """The file ended before the bytes asked for (truncated on disk)."""


def direct_flag() -> int:
    """``os.O_DIRECT``, or 0 where this platform has none or ``TIERPLAN_NVME_IO=buffered``
    asks for the page cache (to measure what direct I/O changes, or on a file system where it
    is slow)."""
    if os.environ.get("TIERPLAN_NVME_IO", "direct").strip().lower() == "buffered":
        return 0
    return getattr(os, "O_DIRECT", 0)


def accepts_direct(fd: int) -> bool:
    """Whether a new, empty file opened with O_DIRECT takes a direct write and read of one
    block (some file systems open with the flag and refuse the I/O). The file is left empty."""
    buf = mmap.mmap(-1, BLOCK)
    try:
        os.pwrite(fd, buf, 0)
        os.preadv(fd, [buf], 0)
        os.ftruncate(fd, 0)
        return True
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        return False
    finally:
        buf.close()


def _address(mv: memoryview) -> int | None:
    """The address of a writable buffer's first byte; None for a read-only one."""
    if mv.readonly:
        return None
    return ctypes.addressof(ctypes.c_char.from_buffer(mv))


class DiskIO:
    """Direct reads and writes of file ranges in requests of ``request`` bytes, up to
    ``in_flight`` at once: the caller and ``in_flight - 1`` threads, each taking the next
    request of a range until none is left (``pwrite``/``preadv`` release the GIL)."""

    def __init__(self, request: int, in_flight: int):
        if request < BLOCK or request % BLOCK or in_flight < 1:
            raise ValueError(f"request {request} (whole {BLOCK}-byte blocks), in_flight "
                             f"{in_flight} (at least 1)")
        self.request, self.in_flight = int(request), int(in_flight)
        self._slots = threading.BoundedSemaphore(self.in_flight)
        self._free: list[mmap.mmap] = []        # bounce buffers not in use
        self._lock = threading.Lock()
        self._file_locks: dict[int, threading.Lock] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.made = 0                           # bounce buffers made so far (<= in_flight)

    # -- files and buffers
    def opened(self, fd: int) -> None:
        with self._lock:
            self._file_locks[fd] = threading.Lock()

    def closing(self, fd: int) -> None:
        with self._lock:
            self._file_locks.pop(fd, None)

    @contextlib.contextmanager
    def _bounce(self):
        with self._slots:
            with self._lock:
                if self._free:
                    buf = self._free.pop()
                else:
                    buf = mmap.mmap(-1, self.request)
                    self.made += 1
            try:
                yield buf
            finally:
                with self._lock:
                    self._free.append(buf)

    def close(self) -> None:
        """Stop the request threads and free the bounce buffers (none in use)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        with self._lock:
            bufs, self._free = self._free, []
        for b in bufs:
            with contextlib.suppress(BufferError):
                b.close()

    # -- ranges
    def write(self, fd: int, mv: memoryview, offset: int) -> None:
        """Write all of ``mv`` at ``offset`` (raises OSError)."""
        self.write_many(fd, [(offset, mv)])

    def read(self, fd: int, mv: memoryview, offset: int) -> None:
        """Fill ``mv`` from ``offset`` (raises OSError; ``ShortRead`` where the file ends
        before ``offset + len(mv)``)."""
        self.read_many(fd, [(offset, mv)])

    def write_many(self, fd: int, items) -> None:
        """Write each ``(offset, mv)`` in turn: items that follow each other in the file go
        as one run of requests (many small tensors in a few requests, not one each)."""
        for run in _runs(items):
            self._run(lambda a, b, r=run: self._write(fd, r, a, b), run.start, run.end)

    def read_many(self, fd: int, items) -> None:
        """Fill each ``(offset, mv)``; items that follow each other in the file are read as one
        run of requests."""
        for run in _runs(items):
            self._run(lambda a, b, r=run: self._read(fd, r, a, b), run.start, run.end)

    def _requests(self, start: int, end: int):
        """``[start, end)`` as requests: one where its blocks fit one bounce buffer, else cut
        at the file's multiples of ``request``."""
        r = self.request
        if -(-end // BLOCK) * BLOCK - (start - start % BLOCK) <= r:
            yield start, end
            return
        a = start
        while a < end:
            b = min(end, (a // r + 1) * r)
            yield a, b
            a = b

    def _run(self, fn, start: int, end: int) -> None:
        """``fn(a, b)`` for each request of ``[start, end)``; several at once where there are
        several. Every request has ended when this returns or raises (none still reads or
        writes the caller's memory)."""
        reqs = list(self._requests(start, end))
        if len(reqs) == 1:
            fn(*reqs[0])
            return
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.in_flight - 1 or 1,
                                                thread_name_prefix=DISK_THREAD_PREFIX)
            pool = self._pool
        # the caller and up to in_flight - 1 threads each take the next request until none is
        # left (one task per thread, not one per request); after an error none is started
        todo, lock, errors = iter(reqs), threading.Lock(), []

        def drain():
            while not errors:
                with lock:
                    req = next(todo, None)
                if req is None:
                    return
                try:
                    fn(*req)
                except BaseException as e:
                    errors.append(e)
        helpers = [pool.submit(drain) for _ in range(min(self.in_flight, len(reqs)) - 1)]
        drain()
        for f in helpers:
            f.result()                        # every request has ended before we return
        if errors:
            raise errors[0]

    def _write(self, fd: int, run: "_Run", a: int, b: int) -> None:
        A, B = a - a % BLOCK, -(-b // BLOCK) * BLOCK
        whole = run.whole(a, b)
        if whole is not None and A == a and B == b:
            _pwrite_full(fd, whole, a)
            return
        with self._bounce() as buf:
            view = memoryview(buf)
            try:
                blocks = view[:B - A]
                lock = self._file_locks.get(fd) if (A < a or B > b) else None
                with lock or contextlib.nullcontext():
                    if A < a:
                        _pread_block(fd, blocks[:BLOCK], A)
                    if B > b and (B - BLOCK > A or A == a):
                        _pread_block(fd, blocks[B - A - BLOCK:], B - BLOCK)
                    run.gather(blocks, A, a, b)
                    _pwrite_full(fd, blocks, A)
            finally:
                view.release()

    def _read(self, fd: int, run: "_Run", a: int, b: int) -> None:
        A, B = a - a % BLOCK, -(-b // BLOCK) * BLOCK
        whole = run.whole(a, b)
        if whole is not None and A == a and B == b:
            if _pread_full(fd, whole, a) < b - a:
                raise ShortRead("the file is shorter than the range read")
            return
        with self._bounce() as buf:
            view = memoryview(buf)
            try:
                if _pread_full(fd, view[:B - A], A) < b - A:
                    raise ShortRead("the file is shorter than the range read")
                run.scatter(view, A, a, b)
            finally:
                view.release()


class _Run:
    """Items ``(offset, mv)`` that follow each other in the file: ``[start, end)``."""

    __slots__ = ("start", "end", "offs", "mvs", "addrs")

    def __init__(self, offset: int, mv: memoryview):
        self.start, self.end = offset, offset
        self.offs, self.mvs, self.addrs = [], [], []
        self.add(offset, mv)

    def add(self, offset: int, mv: memoryview) -> None:
        self.offs.append(offset)
        self.mvs.append(mv)
        self.addrs.append(_address(mv))
        self.end = offset + len(mv)

    def _overlapping(self, a: int, b: int):
        k = max(0, bisect.bisect_right(self.offs, a) - 1)
        while k < len(self.offs) and self.offs[k] < b:
            off, mv = self.offs[k], self.mvs[k]
            lo, hi = max(a, off), min(b, off + len(mv))
            if lo < hi:
                yield k, lo, hi
            k += 1

    def whole(self, a: int, b: int) -> memoryview | None:
        """The caller's memory of ``[a, b)`` where one item holds it all, starting on a block
        boundary (a direct request can use it as it is), else None."""
        parts = list(self._overlapping(a, b))
        if len(parts) != 1:
            return None
        k, lo, hi = parts[0]
        addr = self.addrs[k]
        if lo != a or hi != b or addr is None or (addr + a - self.offs[k]) % BLOCK:
            return None
        return self.mvs[k][a - self.offs[k]:b - self.offs[k]]

    def gather(self, blocks: memoryview, A: int, a: int, b: int) -> None:
        """The items' bytes of ``[a, b)`` into ``blocks`` (which starts at file offset A)."""
        dst = _address(blocks)
        for k, lo, hi in self._overlapping(a, b):
            src, off = self.addrs[k], self.offs[k]
            if src is None:
                blocks[lo - A:hi - A] = self.mvs[k][lo - off:hi - off]
            else:
                ctypes.memmove(dst + lo - A, src + lo - off, hi - lo)

    def scatter(self, blocks: memoryview, A: int, a: int, b: int) -> None:
        """``blocks`` (file offset A on) into the items' memory of ``[a, b)``."""
        src = _address(blocks)
        for k, lo, hi in self._overlapping(a, b):
            ctypes.memmove(self.addrs[k] + lo - self.offs[k], src + lo - A, hi - lo)


def _runs(items) -> list[_Run]:
    """Consecutive items whose bytes follow each other in the file, as runs (empty items
    dropped; items out of order or overlapping start a new run, so writes keep their order)."""
    runs: list[_Run] = []
    for off, mv in items:
        if not len(mv):
            continue
        if runs and runs[-1].end == off:
            runs[-1].add(off, mv)
        else:
            runs.append(_Run(off, mv))
    return runs


def _pwrite_full(fd: int, mv: memoryview, offset: int) -> None:
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


def _pread_full(fd: int, mv: memoryview, offset: int) -> int:
    """Bytes read into ``mv`` from ``offset``: fewer than ``len(mv)`` where the file ends
    first (a short read of a regular file is its end; a direct read cannot go on from an
    offset inside a block anyway)."""
    got = 0
    while got < len(mv):
        n = os.preadv(fd, [mv[got:]], offset + got)
        got += n
        if n == 0 or got % BLOCK:
            break
    return got


def _pread_block(fd: int, mv: memoryview, offset: int) -> None:
    """One block as the file holds it; zeros past its end (a block not written yet)."""
    got = _pread_full(fd, mv, offset)
    if got < len(mv):
        ctypes.memset(_address(mv) + got, 0, len(mv) - got)
