"""The runtime's files on the NVMe tier: one directory per process, one I/O thread, checksums.

Every file the runtime writes lives in ``<nvme_dir>/tierplan-<pid>-<random>/`` and is deleted
as soon as it is not needed (an offload file once read back, a home file when the handle is
removed), at exit, on SIGTERM (unwound like Ctrl-C where the process had no handler of its
own), and when the process that made the directory is gone: a process holds an exclusive
``flock`` on its directory for as long as it lives, and the next store to start under the same
``nvme_dir`` removes every such directory whose lock it can take (its owner died, even by
SIGKILL). Folders of ``nvme_dir`` the runtime created are removed by the last process to
leave them; nothing it did not create is ever deleted. Processes sharing one ``nvme_dir``
never collide: each has its own directory, and a folder the last user removes while another
process starts is made again.

Reads and writes go through one FIFO worker thread: they share one drive, and a single worker
guarantees that a file's writes finish before its reads or its deletion run.

Every byte range written carries an xxh3-64 checksum (``Sums``), verified when the range is
read back whole; a mismatch or a short read stops training with ``OffloadCorrupted``, one line
naming the file and the unit, instead of gradients computed from whatever the disk returned.
xxh3 hashes at ~20 GB/s per core, several times faster than the drive (bench/runtime.py
measures its cost on an offload-all step).
"""
from __future__ import annotations

import atexit
import bisect
import contextlib
import errno
import fcntl
import os
import re
import signal
import threading
import time
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import xxhash

from planner.errors import UserError
from planner.fileio import lock_dir

from .timing import LINKS

IO_THREAD_PREFIX = "tierplan-io"
# Checksums on every offload (set False only to measure what they cost: bench/runtime.py).
CHECKSUM = True
_DIR_RE = re.compile(r"^tierplan-(\d+)-[0-9a-f]{8}$")
_STAGING_RE = re.compile(r"^\.tierplan-(\d+)-[0-9a-f]{8}\.new$")
_FILE_RE = re.compile(r"^.+-[0-9a-f]{8}\.bin$")
# A staging directory (made, not yet locked and renamed) older than this is a dead process's.
STAGING_STALE_S = 60.0


class OffloadError(RuntimeError):
    """An offload file cannot be trusted or written: training stops (one line, file and unit)."""


class OffloadCorrupted(OffloadError):
    """An offload file read back is not what was written (changed or truncated on disk)."""


class NvmeDirError(UserError):
    """The NVMe directory cannot hold the plan's files (not a directory, not writable, full)."""


def describe(label: str) -> str:
    """What a file holds, from the label it was opened with."""
    for prefix, what in (("ck-", "the recompute checkpoint of unit"), ("w-", "the weights of unit"),
                         ("g-", "the gradients of unit"), ("s-", "the optimizer state of unit")):
        if label.startswith(prefix):
            return f"{what} {label[len(prefix):]!r}"
    return f"the activations of unit {label!r}"


def byte_view(t) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes. Not ``t.numpy()``: exporting
    to numpy marks the storage as not resizable for good, and the runtime resizes the storage
    of streamed parameters to free them."""
    import ctypes
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


# ----------------------------------------------------------------------------- checksums

def digest(mv) -> int:
    return xxhash.xxh3_64_intdigest(mv)


class Sums:
    """Checksums of the byte ranges written to one file, verified when they are read back.

    ``wrote(off, mv)`` records ``[off, off + len(mv))`` (a rewrite of bytes replaces the ranges
    it overlaps: gradient accumulators and weights are rewritten every step). ``verify(off,
    mv)`` checks every recorded range that overlaps ``[off, off + len(mv))``: from ``mv`` where
    it lies inside, else by reading the whole range from the file (callers verify whole
    tensors or aligned parts, so this fallback is rare)."""

    __slots__ = ("path", "what", "starts", "ranges", "lock")

    def __init__(self, path: str, label: str):
        self.path = path
        self.what = describe(label)
        self.starts: list[int] = []          # sorted
        self.ranges: dict[int, tuple] = {}   # start -> (end, digest)
        self.lock = threading.Lock()

    def _overlapping(self, a: int, b: int) -> list[int]:
        k = bisect.bisect_right(self.starts, a)
        if k and self.ranges[self.starts[k - 1]][0] > a:
            k -= 1
        out = []
        while k < len(self.starts) and self.starts[k] < b:
            out.append(self.starts[k])
            k += 1
        return out

    def wrote(self, off: int, mv) -> None:
        if not CHECKSUM or not len(mv):
            return
        d = digest(mv)
        end = off + len(mv)
        with self.lock:
            for s in self._overlapping(off, end):
                del self.ranges[s]
                self.starts.pop(bisect.bisect_left(self.starts, s))
            bisect.insort(self.starts, off)
            self.ranges[off] = (end, d)

    def verify(self, off: int, mv, fd: int | None = None) -> None:
        if not CHECKSUM or not len(mv):
            return
        end = off + len(mv)
        with self.lock:
            todo = [(s, *self.ranges[s]) for s in self._overlapping(off, end)]
        for s, e, d in todo:
            if s >= off and e <= end:
                got = digest(mv[s - off:e - off])
            elif fd is not None:
                buf = bytearray(e - s)
                pread_all(fd, memoryview(buf), s, self)
                got = digest(buf)
            else:
                continue        # part of a range: verified when the rest has been read
            if got != d:
                raise OffloadCorrupted(
                    f"tierplan: offload file '{self.path}' ({self.what}) changed on disk after "
                    f"it was written: bytes {s}..{e} fail their checksum; training stopped "
                    "before using them")


# ----------------------------------------------------------------------------- I/O

def _label(where) -> tuple[str, str]:
    if isinstance(where, Sums):
        return where.path, f" ({where.what})"
    return str(where), ""


def pwrite_all(fd: int, mv: memoryview, offset: int, sums: Sums | str | None = None) -> None:
    """Write all of ``mv`` at ``offset``; record its checksum in ``sums``. A failed write (a
    full disk) is one line naming the file."""
    with LINKS.busy_with("nvme_write", len(mv)):
        _pwrite_all(fd, mv, offset, sums)


def _pwrite_all(fd: int, mv: memoryview, offset: int, sums) -> None:
    whole, start = mv, offset
    try:
        while len(mv):
            n = os.pwrite(fd, mv, offset)
            mv, offset = mv[n:], offset + n
    except OSError as e:
        path, what = _label(sums)
        hint = ("the disk is full: free space or give apply_plan(..., nvme_dir=) a larger disk"
                if e.errno in (errno.ENOSPC, errno.EDQUOT) else "check the NVMe directory")
        raise OffloadError(f"tierplan: cannot write offload file '{path}'{what}: "
                           f"{e.strerror or e}; {hint}") from None
    if isinstance(sums, Sums):
        sums.wrote(start, whole)


def pread_all(fd: int, mv: memoryview, offset: int, label: Sums | str = "") -> None:
    """Read exactly ``len(mv)`` bytes at ``offset``; a short file (truncated on disk) is one
    line naming the file and what it holds."""
    with LINKS.busy_with("nvme_read", len(mv)):
        _pread_all(fd, mv, offset, label)


def _pread_all(fd: int, mv: memoryview, offset: int, label) -> None:
    while len(mv):
        try:
            n = os.preadv(fd, [mv], offset)
        except OSError as e:
            path, what = _label(label)
            raise OffloadCorrupted(f"tierplan: cannot read offload file '{path}'{what}: "
                                   f"{e.strerror or e}; training stopped") from None
        if n == 0:
            path, what = _label(label)
            raise OffloadCorrupted(f"tierplan: offload file '{path}'{what} is shorter than "
                                   "what was written to it (truncated on disk); training "
                                   "stopped")
        mv, offset = mv[n:], offset + n


# ----------------------------------------------------------------------------- directories

def sweep(base: str | os.PathLike) -> list[str]:
    """Remove the directories of processes that are gone (their lock is free) under ``base``:
    only the runtime's own files in them, then the directory if that left it empty. Returns
    what was removed."""
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    now = time.time()
    for ent in entries:
        if not ent.is_dir(follow_symlinks=False):
            continue
        staging = _STAGING_RE.match(ent.name)
        if not (_DIR_RE.match(ent.name) or staging):
            continue
        if staging:
            with contextlib.suppress(OSError):
                if now - ent.stat(follow_symlinks=False).st_mtime < STAGING_STALE_S:
                    continue
        fd = lock_dir(Path(ent.path))
        if fd is None:
            continue                      # its process is alive
        try:
            for f in os.scandir(ent.path):
                if f.is_file(follow_symlinks=False) and _FILE_RE.match(f.name):
                    with contextlib.suppress(OSError):
                        os.unlink(f.path)
            with contextlib.suppress(OSError):
                os.rmdir(ent.path)
                removed.append(ent.path)
        finally:
            os.close(fd)
    return removed


def free_bytes(path: str | os.PathLike) -> int:
    st = os.statvfs(path)
    return int(st.f_bavail * st.f_frsize)


# ----------------------------------------------------------------------------- SIGTERM

class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while the runtime had files on disk: unwound like Ctrl-C, so that the
    training loop's ``finally`` blocks and the store's exit handler delete every file."""


_LIVE: "weakref.WeakSet[NvmeStore]" = weakref.WeakSet()
_SIGTERM = {"installed": False, "previous": None}


def _on_sigterm(signum, frame):
    raise Terminated("SIGTERM")


def _install_sigterm() -> None:
    """Handle SIGTERM like SIGINT while a store has files, where the process has no SIGTERM
    handler of its own (the default one kills without unwinding, leaving every file)."""
    if _SIGTERM["installed"] or threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
            _SIGTERM["installed"] = True


def _restore_sigterm() -> None:
    if not _SIGTERM["installed"] or any(s.dir is not None for s in list(_LIVE)):
        return
    if threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _SIGTERM["installed"] = False


# ----------------------------------------------------------------------------- the store

MADE = ".tierplan-made"   # marks a folder the runtime created (a folder: no file to trip over)


class NvmeStore:
    """The per-process directory under ``base`` and the I/O thread that reads and writes it.

    Folders of ``base`` that were missing are created, each marked with an empty ``MADE``
    folder, and removed again by the last process to leave them: every user of ``base`` holds
    a shared flock on it, and one that can take it exclusively on leaving knows no other
    process uses it. So processes sharing a missing ``nvme_dir`` neither collide nor leave it
    behind, and a folder that existed is never removed."""

    def __init__(self, base: str | os.PathLike):
        self.base = Path(base)
        self.dir: Path | None = None
        self.root: Path | None = None       # base, resolved
        self.pool: ThreadPoolExecutor | None = None
        self.files: dict[str, int] = {}     # path -> fd
        self.lock = threading.Lock()
        self._lock_fd: int | None = None    # our flock on self.dir, held while we live
        self._base_fd: int | None = None    # a shared flock on the base, held while we use it
        self._atexit = weakref.WeakMethod(self.close)
        atexit.register(_close_weak, self._atexit)

    def _where(self) -> str:
        return f"nvme_dir '{self.base}'"

    def _make_base(self) -> Path:
        """Create the missing folders of ``base``, each marked as made by the runtime."""
        try:
            root = self.base.resolve()
        except (OSError, RuntimeError) as e:
            raise NvmeDirError(f"{self._where()}: cannot resolve it ({e}); give a directory "
                               "on a local disk") from None
        missing = []
        p = root
        while not os.path.lexists(p):
            missing.append(p)
            p = p.parent
        if not p.is_dir():
            raise NvmeDirError(f"{self._where()}: '{p}' is not a directory; give a directory")
        for d in reversed(missing):
            try:
                d.mkdir(mode=0o755)
            except FileExistsError:
                continue                      # another process made it meanwhile
            except OSError as e:
                raise NvmeDirError(f"{self._where()}: cannot create '{d}' ({e.strerror}); give "
                                   "a writable directory") from None
            with contextlib.suppress(OSError):
                (d / MADE).mkdir()
        return root

    def _use_base(self, root: Path) -> bool:
        """Take a shared flock on ``root``; False if it was removed meanwhile (try again)."""
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise NvmeDirError(f"{self._where()} cannot be opened ({e.strerror}); give a "
                               "directory") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)    # waits while a last user removes it
            if os.fstat(fd).st_ino != os.stat(root).st_ino:
                raise FileNotFoundError
        except OSError:
            os.close(fd)
            return False
        self._base_fd = fd
        return True

    def _ensure(self) -> None:
        if self.dir is not None:
            return
        # A last user may remove the base (it made it and is done) while we start: then make
        # it again (a few tries).
        for attempt in range(20):
            root = self._make_base()
            if not self._use_base(root):
                continue
            if attempt == 0:
                sweep(root)
            tag = f"tierplan-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            staging, final = root / f".{tag}.new", root / tag
            try:
                staging.mkdir(mode=0o700)
            except OSError as e:
                self._leave_base()
                if isinstance(e, FileNotFoundError):
                    continue
                raise NvmeDirError(f"{self._where()} is not writable ({e.strerror}); give a "
                                   "writable directory") from None
            # Locked before it gets the name sweep looks for: a sweeper never sees it unlocked.
            fd = lock_dir(staging)
            if fd is None:
                with contextlib.suppress(OSError):
                    staging.rmdir()
                self._leave_base()
                raise NvmeDirError(f"{self._where()}: cannot lock a directory in it (flock); "
                                   "give a directory on a local file system")
            try:
                os.rename(staging, final)
            except OSError as e:
                os.close(fd)
                with contextlib.suppress(OSError):
                    staging.rmdir()
                self._leave_base()
                raise NvmeDirError(f"{self._where()}: cannot create a directory in it "
                                   f"({e.strerror})") from None
            self._lock_fd = fd
            self.root = root
            self.dir = final
            break
        else:
            raise NvmeDirError(f"{self._where()}: it kept disappearing while being created (20 "
                               "tries); give a directory no other process removes")
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=IO_THREAD_PREFIX)
        _LIVE.add(self)
        _install_sigterm()

    def _leave_base(self) -> None:
        """Stop using the base; the last user removes the folders the runtime made (those
        holding nothing but their ``MADE`` mark), innermost first."""
        fd, self._base_fd = self._base_fd, None
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)                      # another process still uses it: it will
            return
        try:
            d = self.root or self.base.resolve()
            while True:
                try:
                    names = os.listdir(d)
                except OSError:
                    break
                if names != [MADE]:
                    break
                try:
                    os.rmdir(d / MADE)
                    os.rmdir(d)
                except OSError:
                    break
                d = d.parent
        finally:
            os.close(fd)

    def prepare(self, need_bytes: int, src: str = "the plan") -> None:
        """Up front (``apply_plan``): the directory exists and is writable (ours is made now)
        and its disk has room for ``need_bytes``, the plan's peak on the NVMe tier."""
        try:
            self._ensure()
            free = free_bytes(self.dir)
        except OSError as e:
            self.close()
            raise NvmeDirError(f"{self._where()}: cannot read its free space ({e.strerror})") from None
        except BaseException:
            self.close()
            raise
        if need_bytes > free:
            self.close()
            raise NvmeDirError(
                f"{self._where()} has {free} bytes free but {src} needs up to {need_bytes} bytes "
                "on the NVMe tier (its predicted peak); free space, give a larger disk with "
                "apply_plan(..., nvme_dir=DIR), or solve with a smaller --nvme-mem")

    def open(self, label: str) -> tuple[int, str]:
        """A new empty file for ``label`` (fd, path)."""
        self._ensure()
        path = str(self.dir / f"{label}-{uuid.uuid4().hex[:8]}.bin")
        try:
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        except OSError as e:
            raise OffloadError(f"tierplan: cannot create offload file '{path}' "
                               f"({describe(label)}): {e.strerror}; check the NVMe directory") from None
        with self.lock:
            self.files[path] = fd
        return fd, path

    def unlink(self, path: str) -> None:
        with self.lock:
            fd = self.files.pop(path, None)
        if fd is None:
            return
        with contextlib.suppress(OSError):
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def unlink_later(self, path: str) -> None:
        """Delete after the I/O already queued (a dropped group may still be writing)."""
        pool = self.pool
        if pool is not None:
            with contextlib.suppress(RuntimeError):   # the pool shut down meanwhile
                pool.submit(self.unlink, path)
                return
        self.unlink(path)

    def unlink_now(self, path: str) -> None:
        """Delete after the I/O already queued, and wait for it (on the I/O thread itself the
        queue before this job has run: delete at once)."""
        pool = self.pool
        if pool is None or self.on_io_thread():
            self.unlink(path)
            return
        try:
            fut = pool.submit(self.unlink, path)
        except RuntimeError:                          # the pool shut down meanwhile
            self.unlink(path)
            return
        fut.result()

    def submit(self, fn, *args) -> Future:
        self._ensure()
        return self.pool.submit(fn, *args)

    @staticmethod
    def on_io_thread() -> bool:
        return threading.current_thread().name.startswith(IO_THREAD_PREFIX)

    def close(self) -> None:
        """Stop the I/O thread, delete every file and every directory this store created."""
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        with self.lock:
            files, self.files = dict(self.files), {}
        for path, fd in files.items():
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if self.dir is not None:
            with contextlib.suppress(OSError):   # not empty: never delete what we did not make
                self.dir.rmdir()
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None
        self._leave_base()
        self.dir = None
        _LIVE.discard(self)
        _restore_sigterm()


def _close_weak(ref):
    m = ref()
    if m is not None:
        m()
