"""The runtime's files on the NVMe tier: one directory per process, one I/O thread.

Every file the runtime writes lives in ``<nvme_dir>/tierplan-<pid>-<random>/`` and is deleted
as soon as it is not needed (an offload file once read back, a home file when the handle is
removed), at exit, on SIGTERM (what torchrun sends the other ranks when one fails), and when
the process that made the directory is gone (``sweep``, at the next start). Directories the
store created are removed again; nothing it did not create is ever deleted. Several processes
(the ranks of one node) may share ``nvme_dir``: a directory a store creates holds an empty
marker directory, and whichever process leaves it empty last removes it. Reads and writes go through one
FIFO worker thread: they share one drive, and a single worker guarantees that a file's writes
finish before its reads or its deletion run.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import signal
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

IO_THREAD_PREFIX = "tierplan-io"
# In a directory a store created: removed with it by whichever process leaves it empty last.
# An empty directory, not a file: the directory holds no file of ours but the offload files.
MARKER = ".tierplan-created"
_LIVE: "weakref.WeakSet" = weakref.WeakSet()     # stores with a directory
_PREV_TERM = None                                 # SIGTERM's handler before ours


def byte_view(t) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes. Not ``t.numpy()``: exporting
    to numpy marks the storage as not resizable for good, and the runtime resizes the storage
    of streamed parameters to free them."""
    import ctypes
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def pwrite_all(fd: int, mv: memoryview, offset: int) -> None:
    while len(mv):
        n = os.pwrite(fd, mv, offset)
        mv, offset = mv[n:], offset + n


def pread_all(fd: int, mv: memoryview, offset: int, label: str = "") -> None:
    while len(mv):
        n = os.preadv(fd, [mv], offset)
        if n == 0:
            raise OSError(f"tierplan: offload file {label} is shorter than what was written "
                          "to it (truncated on disk)")
        mv, offset = mv[n:], offset + n


class NvmeStore:
    """The per-process directory under ``base`` and the I/O thread that reads and writes it."""

    def __init__(self, base: str | os.PathLike):
        self.base = Path(base)
        self.dir: Path | None = None
        self.created: list[Path] = []       # directories we made, outermost first
        self.pool: ThreadPoolExecutor | None = None
        self.files: dict[str, int] = {}     # path -> fd
        self.lock = threading.Lock()
        self._atexit = weakref.WeakMethod(self.close)
        atexit.register(_close_weak, self._atexit)

    def _ensure(self) -> None:
        if self.dir is not None:
            return
        for attempt in range(3):
            try:
                self._make_dirs()
                break
            except FileNotFoundError:
                # another rank removed a shared parent it left empty just now: make it again
                if attempt == 2:
                    raise
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=IO_THREAD_PREFIX)
        _LIVE.add(self)
        _catch_sigterm()

    def _make_dirs(self) -> None:
        missing = []
        p = self.base.resolve()
        while not p.exists():
            missing.append(p)
            p = p.parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):   # another process made it meanwhile
                d.mkdir()
                (d / MARKER).mkdir()
        sweep(self.base.resolve())
        d = self.base.resolve() / f"tierplan-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        d.mkdir()
        self.created.append(d)
        self.dir = d

    def open(self, label: str) -> tuple[int, str]:
        """A new empty file for ``label`` (fd, path)."""
        self._ensure()
        path = str(self.dir / f"{label}-{uuid.uuid4().hex[:8]}.bin")
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
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
        for d in reversed(self.created):
            with contextlib.suppress(OSError):   # not empty: never delete what we did not make
                d.rmdir()
        if self.created:
            _remove_marked(self.created[0].parent)
        self.created = []
        self.dir = None
        _LIVE.discard(self)


def _remove_marked(d: Path) -> None:
    """Remove ``d`` and its parents while each was made by a store (it holds the marker) and
    holds nothing else: the last process out of a shared directory removes it."""
    while (d / MARKER).exists():
        try:
            if set(os.listdir(d)) != {MARKER}:
                return
            (d / MARKER).rmdir()
            d.rmdir()
        except OSError:     # another process got there first, or put something in meanwhile
            return
        d = d.parent


def sweep(base: Path) -> None:
    """Delete the directories of stores whose process is gone (killed before it could clean
    up): ``tierplan-<pid>-<random>`` under ``base`` with no live process ``pid``. Only the
    runtime's ``*.bin`` files are deleted, then the directory if that empties it.
    NB: a directory on storage shared between hosts may name a pid of another host; give each
    host its own --nvme-dir there."""
    with contextlib.suppress(OSError):
        for d in base.iterdir():
            parts = d.name.split("-")
            if len(parts) != 3 or parts[0] != "tierplan" or not parts[1].isdigit():
                continue
            pid = int(parts[1])
            if pid == os.getpid() or _alive(pid):
                continue
            for f in d.glob("*.bin"):
                with contextlib.suppress(OSError):
                    f.unlink()
            with contextlib.suppress(OSError):
                d.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _catch_sigterm() -> None:
    """On SIGTERM, close every store (its files deleted), then let the signal do what it did
    before. Installed only where nothing else handles SIGTERM (the default action kills the
    process without running atexit), and only from the main thread (Python's rule)."""
    global _PREV_TERM
    if threading.current_thread() is not threading.main_thread():
        return
    with contextlib.suppress(ValueError, OSError):
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            _PREV_TERM = signal.SIG_DFL
            signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    for store in list(_LIVE):
        with contextlib.suppress(Exception):
            store.close()
    signal.signal(signal.SIGTERM, _PREV_TERM or signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _close_weak(ref):
    m = ref()
    if m is not None:
        m()
