"""The runtime's files on the NVMe tier: one directory per process, one I/O thread, checksums.

Every file the runtime writes lives in ``<nvme_dir>/tierplan-<pid>-<random>/`` and is deleted
as soon as it is not needed (an offload file once read back, a home file when the handle is
removed), at exit, on SIGTERM (unwound like Ctrl-C where the process had no handler of its
own), and when the process that made the directory is gone. The directory carries its own
proof of creation: an owner file (the pid, that process's start time from /proc/PID/stat, the
boot) and a manifest of every file created in it; its process holds an exclusive ``flock``
on it for as long as it lives. The next store to start under the same ``nvme_dir`` sweeps a
directory only when its lock is free and the process its owner file names is gone (a reused
pid has another start time), and deletes in it only the files the manifest lists, each only
while it is the file that was created (same inode); a file anyone else put there is left, and
the directory with it. Folders of ``nvme_dir`` the runtime created are removed by the last
process to leave them. Nothing the runtime did not create is deleted. Processes sharing one
``nvme_dir`` never collide: each has its own directory, and a folder the last user removes
while another process starts is made again. Only the process that made the directory deletes
in it: a forked child's exit leaves the parent's files alone.

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
import stat
import sys
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import xxhash

from planner.formats import UserError, io_requests
from planner.formats.fileio import _is_dir, _shown, lock_dir, path_problem

from .disk import DiskIO, ShortRead, accepts_direct, direct_flag
from .timing import LINKS

IO_THREAD_PREFIX = "tierplan-io"
# Checksums on every offload (set False only to measure what they cost: bench/runtime.py).
CHECKSUM = True
# fd -> the DiskIO of its store, for every open file the runtime reads and writes with O_DIRECT
_DIRECT: dict[int, DiskIO] = {}
_DIR_RE = re.compile(r"^tierplan-(\d+)-[0-9a-f]{8}$")
_STAGING_RE = re.compile(r"^\.tierplan-(\d+)-[0-9a-f]{8}\.new$")


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
    pwrite_many(fd, [(offset, mv)], sums)


def pwrite_many(fd: int, items, sums: Sums | str | None = None) -> None:
    """Write each ``(offset, mv)``, in order, each with its own checksum in ``sums``; items
    that follow each other in the file go to the drive together (runtime/disk.py)."""
    _timed("nvme_write", _pwrite_many, fd, list(items), sums)


def _timed(link: str, fn, fd: int, items: list, where) -> None:
    """``fn(fd, items, where)``, the link busy meanwhile with the items' bytes."""
    if items:
        with LINKS.busy_with(link, sum(len(mv) for _, mv in items)):
            fn(fd, items, where)


def _pwrite_many(fd: int, items, sums) -> None:
    try:
        disk = _DIRECT.get(fd)
        if disk is not None:
            disk.write_many(fd, items)
        else:
            for off, mv in items:
                while len(mv):
                    n = os.pwrite(fd, mv, off)
                    mv, off = mv[n:], off + n
    except OSError as e:
        path, what = _label(sums)
        hint = ("the disk is full: free space or give apply_plan(..., nvme_dir=) a larger disk"
                if e.errno in (errno.ENOSPC, errno.EDQUOT) else "check the NVMe directory")
        raise OffloadError(f"tierplan: cannot write offload file '{path}'{what}: "
                           f"{e.strerror or e}; {hint}") from None
    if isinstance(sums, Sums):
        for off, mv in items:
            sums.wrote(off, mv)


def pread_all(fd: int, mv: memoryview, offset: int, label: Sums | str = "") -> None:
    """Read exactly ``len(mv)`` bytes at ``offset``; a short file (truncated on disk) is one
    line naming the file and what it holds."""
    pread_many(fd, [(offset, mv)], label)


def pread_many(fd: int, items, label: Sums | str = "") -> None:
    """Fill each ``(offset, mv)`` exactly (not verified: ``Sums.verify`` does that); items
    that follow each other in the file come from the drive together."""
    _timed("nvme_read", _pread_many, fd, list(items), label)


def _pread_many(fd: int, items, label) -> None:
    disk = _DIRECT.get(fd)
    try:
        if disk is not None:
            disk.read_many(fd, items)
        else:
            for off, mv in items:
                while len(mv):
                    n = os.preadv(fd, [mv], off)
                    if n == 0:
                        raise ShortRead
                    mv, off = mv[n:], off + n
    except ShortRead:
        path, what = _label(label)
        raise OffloadCorrupted(f"tierplan: offload file '{path}'{what} is shorter than "
                               "what was written to it (truncated on disk); training "
                               "stopped") from None
    except OSError as e:
        path, what = _label(label)
        raise OffloadCorrupted(f"tierplan: cannot read offload file '{path}'{what}: "
                               f"{e.strerror or e}; training stopped") from None


# ----------------------------------------------------------------------------- directories

# Every directory the runtime makes under an nvme_dir carries two files of its own:
OWNER = ".tierplan-owner"       # who made it: pid, that process's start time, the boot
MANIFEST = ".tierplan-files"    # every file it created there: "+name inode", "-name" once gone
_OWNER_HEAD = "tierplan-nvme-owner/1"
_MANIFEST_HEAD = "tierplan-nvme-files/1"
_BOOKKEEPING = (OWNER, MANIFEST, MANIFEST + ".new")
_MAX_OWNER_BYTES = 4096
_MAX_MANIFEST_BYTES = 64 * 1024**2


# The manifest is rewritten whole (live files only) before it holds this many lines, so its
# size stays bounded however long training runs; a line is ~60 bytes for usual unit names.
def _manifest_bound(live: int) -> int:
    return 64 + 3 * live


_MANIFEST_LINE_BYTES = 128


def _proc_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks after boot, field 22 of
    /proc/PID/stat), or None if there is no such process or no /proc. With the pid it names
    a process for good: a pid reused by a later process has another start time."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(4096)
        return data[data.rindex(b")") + 2:].split()[19].decode()
    except (OSError, ValueError, IndexError):
        return None


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read(64).strip()
    except OSError:
        return ""


def _owner_text(pid: int) -> str:
    return (f"{_OWNER_HEAD}\npid={pid}\nstart={_proc_start(pid) or '-'}\n"
            f"boot={_boot_id() or '-'}\n")


def _alive(owner: dict) -> bool:
    """Whether the process an owner file names may still run (when unsure: yes)."""
    try:
        pid = int(owner["pid"])
    except (KeyError, ValueError):
        return True
    boot, start = owner.get("boot", "-"), owner.get("start", "-")
    here = _boot_id()
    if boot != "-" and here and boot != here:
        return False                      # made before this machine last booted
    if start != "-" and os.path.isdir("/proc/self"):
        return _proc_start(pid) == start  # gone, or the pid is another process's now
    try:                                  # no /proc: whether the pid exists at all
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True


def _ours(owner: dict) -> bool:
    """Whether an owner file names this process (pid, start time and boot)."""
    pid = os.getpid()
    return (owner.get("pid") == str(pid) and owner.get("start") == (_proc_start(pid) or "-")
            and owner.get("boot") == (_boot_id() or "-"))


def _read_small(dir_fd: int, name: str, limit: int) -> str | None:
    """The text of regular file ``name`` in the directory (no symbolic link followed, at
    most ``limit`` bytes), or None."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks, n = [], 0
        while n <= limit:
            b = os.read(fd, 1 << 20)
            if not b:
                break
            chunks.append(b)
            n += len(b)
        return b"".join(chunks).decode("utf-8", "replace") if n <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _read_owner(dir_fd: int) -> dict | None:
    text = _read_small(dir_fd, OWNER, _MAX_OWNER_BYTES)
    if text is None or not text.startswith(_OWNER_HEAD + "\n"):
        return None
    return dict(line.split("=", 1) for line in text.splitlines()[1:] if "=" in line)


def _created(text: str | None) -> dict[str, int]:
    """name -> inode of the files a manifest says were created and not deleted."""
    out: dict[str, int] = {}
    if text is None or not text.startswith(_MANIFEST_HEAD + "\n"):
        return out
    for line in text.splitlines()[1:]:
        if line.startswith("+"):
            name, _, ino = line[1:].rpartition(" ")
            if _plain_name(name) and ino.isdigit():
                out[name] = int(ino)
        elif line.startswith("-"):
            out.pop(line[1:], None)
    return out


def _plain_name(name: str) -> bool:
    return (bool(name) and "/" not in name and "\x00" not in name and name not in (".", "..")
            and name not in _BOOKKEEPING)


def _is_ours(dir_fd: int, name: str, head: str) -> bool:
    text = _read_small(dir_fd, name, _MAX_MANIFEST_BYTES)
    return text is not None and text.startswith(head + "\n")


def _sweep_dir(path: str, pid_in_name: int) -> bool:
    """Clean one directory of a process that is gone: True if it was removed."""
    fd = lock_dir(path)
    if fd is None:
        return False                      # its process holds the lock: alive
    try:
        owner = _read_owner(fd)
        if owner is None or owner.get("pid") != str(pid_in_name):
            return False                  # not made by the runtime
        if _ours(owner):
            # this very process made it: swept once no store of ours uses it (a handle whose
            # removal could not delete everything, retried by the next apply_plan)
            if any(s.dir is not None and os.path.samefile(s.dir, path) for s in list(_LIVE)
                   if s.dir is not None and os.path.exists(s.dir)):
                return False
        elif _alive(owner):
            return False                  # its maker still runs
        created = _created(_read_small(fd, MANIFEST, _MAX_MANIFEST_BYTES))
        for name, ino in created.items():
            with contextlib.suppress(OSError):
                st = os.lstat(name, dir_fd=fd)
                if stat.S_ISREG(st.st_mode) and st.st_ino == ino:
                    os.unlink(name, dir_fd=fd)
        try:
            left = set(os.listdir(fd))
        except OSError:
            return False
        if left - set(_BOOKKEEPING):
            return False                  # a file it did not create: the folder stays too
        # the bookkeeping last (the owner file the very last): until the folder is gone it
        # stays recognisable, so an interrupted sweep is finished by the next
        for name, head in ((MANIFEST + ".new", _MANIFEST_HEAD), (MANIFEST, _MANIFEST_HEAD),
                           (OWNER, _OWNER_HEAD)):
            if name in left:
                if not _is_ours(fd, name, head):
                    return False
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
        try:
            os.rmdir(path)
        except OSError:
            return False
        return True
    finally:
        os.close(fd)


def sweep(base: str | os.PathLike) -> list[str]:
    """Remove under ``base`` the directories of runtime processes that are gone, deleting
    only what each one recorded creating. A directory is swept only when its flock is free
    (no process holds it open), its owner file says the runtime made it, and the process that
    file names (pid and start time, this boot) no longer runs. In it only the files its
    manifest lists are deleted, each only if it is still the same file (inode); the directory
    goes only if that leaves nothing but its bookkeeping. Returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    for ent in entries:
        m = _DIR_RE.match(ent.name) or _STAGING_RE.match(ent.name)
        if not m:
            continue
        with contextlib.suppress(OSError):
            if not ent.is_dir(follow_symlinks=False):
                continue
            if _sweep_dir(ent.path, int(m.group(1))):
                removed.append(ent.path)
    return removed


def free_bytes(path: str | os.PathLike) -> int:
    st = os.statvfs(path)
    return int(st.f_bavail * st.f_frsize)


def block_bytes(path: str | os.PathLike) -> int:
    """The file system's allocation unit under ``path`` (statvfs ``f_frsize``, the unit its
    free-space counts are in): every file takes a whole number of them."""
    st = os.statvfs(path)
    return int(st.f_frsize or st.f_bsize or 4096)


def planned_files(plan) -> int:
    """How many files the plan may keep on the NVMe tier at once, at most: one per home
    (weights, gradients, optimizer state) and one per micro-batch for each unit's offloaded
    activations or recompute checkpoint."""
    from planner.formats import Activation, Tier
    k = max(1, int(getattr(plan, "micro_batches", 1) or 1))
    n = 0
    for d in plan.layers:
        n += sum(t is Tier.NVME for t in (d.home.weights, d.home.grads, d.home.optimizer))
        n += k * ((d.activation is Activation.NVME) + (d.checkpoint is Tier.NVME))
    return n


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


def _lock_own(path: Path) -> int | None:
    """An exclusive flock on a directory this process just made (waiting: a sweeper may hold
    it for the moment it takes to see the directory has no owner file yet), or None where
    the file system has no flock."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError:
        os.close(fd)
        return None
    return fd


def _remove_made(d: Path, stop: Path | None = None) -> None:
    """Remove ``d`` and the folders above it while each holds nothing but its ``MADE`` mark
    (innermost first), not going above ``stop``."""
    while True:
        try:
            names = os.listdir(d)
        except OSError:
            return
        if names != [MADE]:
            return
        try:
            os.rmdir(d / MADE)
            os.rmdir(d)
        except OSError:
            return
        if stop is not None and d == stop:
            return
        d = d.parent


class NvmeStore:
    """The per-process directory under ``base`` and the I/O thread that reads and writes it.

    Folders of ``base`` that were missing are created, each marked with an empty ``MADE``
    folder, and removed again by the last process to leave them: every user of ``base`` holds
    a shared flock on it, and one that can take it exclusively on leaving knows no other
    process uses it. So processes sharing a missing ``nvme_dir`` neither collide nor leave it
    behind, and a folder that existed is never removed. A ``mkdir`` that fails part way
    removes the folders this store made before it.

    The per-process directory holds an ``OWNER`` file (this process's pid, its start time,
    the boot) and a ``MANIFEST`` of every file created in it: what ``sweep`` needs to delete
    exactly those once this process is gone.

    Only the process that made the directory deletes anything in it: a child forked from it
    (a DataLoader worker, ``os.fork``) inherits the store but never deletes, writes or reads
    through it, whether it exits normally (``atexit``), drops the handle or calls
    ``close``."""

    def __init__(self, base: str | os.PathLike, io: tuple[int, int] | None = None):
        self.base = Path(base)
        # the files' reads and writes (runtime/disk.py) in ``io`` = (request bytes, in flight),
        # a CPU host's without: direct, unless the file system refuses O_DIRECT (``direct``
        # False, ``buffered_why`` says why); None: no file yet
        self.disk = DiskIO(*(io or io_requests(True, 0)))
        self.direct: bool | None = None
        self.buffered_why = ""
        self.dir: Path | None = None
        self.root: Path | None = None       # base, resolved
        self.pool: ThreadPoolExecutor | None = None
        # path -> fd (None once closed) of every file created and not yet deleted: a file
        # whose deletion failed stays listed (close tries it again; the manifest keeps it)
        self.files: dict[str, int | None] = {}
        # label -> files whose group was read back, kept open for the next group of that label
        # (``open(label, reuse=True)``, ``recycle``); every file kept once, spare or in use
        # again, with the bytes it takes on disk, within ``spare_room`` (None: no bound, a
        # store ``prepare`` did not check)
        self.spare: dict[str, list[str]] = {}
        self.kept: dict[str, int] = {}
        self.kept_bytes = 0
        self.spare_room: int | None = None
        self.block = 4096                   # the file system's allocation unit (``prepare``)
        self.failed: dict[str, str] = {}    # path -> why its deletion failed
        self.lock = threading.Lock()
        self.pid: int | None = None         # the process that made self.dir
        self._lock_fd: int | None = None    # our flock on self.dir, held while we live
        self._base_fd: int | None = None    # a shared flock on the base, held while we use it
        self._manifest_fd: int | None = None
        self._manifest_lines = 0            # lines in the manifest after its header
        self._inos: dict[str, int] = {}     # path -> inode, for rewriting the manifest
        self._atexit = weakref.WeakMethod(self.close)
        atexit.register(_close_weak, self._atexit)

    def io_mode(self) -> str:
        """How this store reads and writes its files, for the report ("" before any file)."""
        if self.direct is None:
            return ""
        if self.direct:
            return (f"O_DIRECT, {self.disk.request // 1024} KiB requests, up to "
                    f"{self.disk.in_flight} in flight")
        return f"buffered, through the page cache ({self.buffered_why})"

    def _where(self) -> str:
        return f"nvme_dir '{_shown(self.base)}'"

    def forked(self) -> bool:
        """Whether this process is a child forked from the one that owns the store."""
        return self.pid is not None and self.pid != os.getpid()

    _forked = forked

    def _refuse_forked(self) -> None:
        if self._forked():
            raise OffloadError(
                f"tierplan: process {os.getpid()} was forked from process {self.pid}, which "
                f"applied the plan and owns its NVMe files in '{self.dir}'; a forked child "
                "cannot train under that handle: apply the plan in the child itself")

    def _make_base(self) -> Path:
        """Create the missing folders of ``base``, each marked as made by the runtime; on a
        failure, remove again the ones made here."""
        why = path_problem(os.fspath(self.base))
        if why:
            raise NvmeDirError(f"{self._where()}: {why}; give another directory")
        try:
            root = self.base.resolve()
        except (OSError, RuntimeError, ValueError) as e:
            raise NvmeDirError(f"{self._where()}: cannot resolve it ({e}); give a directory "
                               "on a local disk") from None
        for _ in range(20):
            missing = []
            p = root
            while not os.path.lexists(p):
                missing.append(p)
                p = p.parent
            if not _is_dir(p):
                raise NvmeDirError(f"{self._where()}: '{_shown(p)}' is not a directory; give a "
                                   "directory")
            made: list[Path] = []
            try:
                for d in reversed(missing):
                    try:
                        d.mkdir(mode=0o755)
                    except FileExistsError:
                        continue              # another process made it meanwhile
                    made.append(d)
                    with contextlib.suppress(OSError):
                        (d / MADE).mkdir()
            except FileNotFoundError:
                # a folder above vanished meanwhile (its last user removed it): walk again
                if made:
                    _remove_made(made[-1], stop=made[0])
                continue
            except BaseException as e:
                if made:
                    _remove_made(made[-1], stop=made[0])
                if isinstance(e, OSError):
                    raise NvmeDirError(f"{self._where()}: cannot create '{_shown(e.filename or d)}' "
                                       f"({e.strerror}); give a writable directory") from None
                raise
            return root
        raise NvmeDirError(f"{self._where()}: its folders kept disappearing while being "
                           "created (20 tries); give a directory no other process removes")

    def _use_base(self, root: Path) -> bool:
        """Take a shared flock on ``root``; False if it was removed meanwhile (try again)."""
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            return False
        except OSError as e:
            _remove_made(root)
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
        self._refuse_forked()
        if self.dir is not None:
            return
        # A last user may remove the base (it made it and is done) while we start: then make
        # it again (a few tries).
        for attempt in range(20):
            root = self._make_base()
            if not self._use_base(root):
                continue
            self.root = root
            try:
                if attempt == 0:
                    sweep(root)
                if self._make_own(root):
                    break
            except BaseException:
                self._leave_base()
                raise
            self._leave_base()
        else:
            if self.root is not None and Path(self.root).is_dir():
                # there all along, yet no directory could be made in it: a file system that
                # answers "no such file" to mkdir (/proc), not another process removing it
                raise NvmeDirError(f"{self._where()}: no directory can be created in it (its "
                                   "file system answers 'no such file or directory'); give a "
                                   "directory on a local disk")
            raise NvmeDirError(f"{self._where()}: it kept disappearing while being created (20 "
                               "tries); give a directory no other process removes")
        self.pool = ThreadPoolExecutor(1, thread_name_prefix=IO_THREAD_PREFIX)
        _LIVE.add(self)
        _install_sigterm()

    def _make_own(self, root: Path) -> bool:
        """Make this process's directory: as ``.<tag>.new``, locked, given its owner file and
        manifest, then renamed to ``<tag>`` (so a directory with the name sweep looks for
        is never seen unlocked while its process lives). False if ``root`` vanished."""
        tag = f"tierplan-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging, final = root / f".{tag}.new", root / tag
        try:
            staging.mkdir(mode=0o700)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise NvmeDirError(f"{self._where()} is not writable ({e.strerror}); give a "
                               "writable directory") from None
        fd = mfd = None
        try:
            fd = _lock_own(staging)
            if fd is None:
                raise NvmeDirError(f"{self._where()}: cannot lock a directory in it (flock); "
                                   "give a directory on a local file system")
            try:
                ofd = os.open(OWNER, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600, dir_fd=fd)
                try:
                    os.write(ofd, _owner_text(os.getpid()).encode())
                finally:
                    os.close(ofd)
                mfd = os.open(MANIFEST, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_APPEND,
                              0o600, dir_fd=fd)
                os.write(mfd, f"{_MANIFEST_HEAD}\n".encode())
                os.rename(staging, final)
            except OSError as e:
                raise NvmeDirError(f"{self._where()}: cannot create a directory in it "
                                   f"({e.strerror}); give a writable directory") from None
        except BaseException:
            if mfd is not None:
                os.close(mfd)
            for name in (MANIFEST, OWNER):
                with contextlib.suppress(OSError):
                    os.unlink(staging / name)
            with contextlib.suppress(OSError):
                staging.rmdir()
            if fd is not None:
                os.close(fd)
            raise
        self._lock_fd, self._manifest_fd = fd, mfd
        self._manifest_lines = 0
        self.pid = os.getpid()
        self.dir = final
        return True

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
            _remove_made(self.root or self.base.resolve())
        finally:
            os.close(fd)

    def prepare(self, need_bytes: int, src: str = "the plan", files: int = 0) -> None:
        """Up front (``apply_plan``): the directory exists and is writable (ours is made now)
        and its disk has room for ``need_bytes``, the plan's peak on the NVMe tier, in
        ``files`` files: each may take up to one block of the file system more than its bytes
        (files take whole blocks), and so may the directory's own bookkeeping."""
        try:
            self._ensure()
            free = free_bytes(self.dir)
            block = block_bytes(self.dir)
        except OSError as e:
            self._close_quietly()
            raise NvmeDirError(f"{self._where()}: cannot read its free space ({e.strerror})") from None
        except BaseException:
            self._close_quietly()
            raise
        # free space is read with the owner file and the manifest already made; the
        # manifest may still grow to _manifest_bound lines before it is rewritten
        grow = -(-_MANIFEST_LINE_BYTES * (_manifest_bound(int(files)) + 1) // block) * block
        need = int(need_bytes) + int(files) * block + grow if need_bytes else 0
        if need > free:
            self._close_quietly()
            raise NvmeDirError(
                f"{self._where()} has {free} bytes free but {src} needs up to {need} bytes "
                f"on the NVMe tier (its predicted peak of {int(need_bytes)} bytes in up to "
                f"{int(files)} files, each rounded up to the disk's {block}-byte blocks); free "
                "space, give a larger disk with apply_plan(..., nvme_dir=DIR), or solve with a "
                "smaller --nvme-mem")
        # files kept for reuse take only what is free beyond the plan's own need
        self.spare_room = free - need if need_bytes else 0
        self.block = block

    # -- files -----------------------------------------------------------------------------
    def _record(self, line: str) -> None:
        """Append one line to the manifest (under ``self.lock``); rewrite it whole once it
        holds many more lines than live files."""
        mfd = self._manifest_fd
        if mfd is None:
            return
        os.write(mfd, (line + "\n").encode("utf-8", "surrogateescape"))
        self._manifest_lines += 1
        if self._manifest_lines + 1 >= _manifest_bound(len(self.files)):
            self._rewrite_manifest()

    def _rewrite_manifest(self) -> None:
        """The manifest as the live files alone: written beside it, then renamed over it."""
        dfd = self._lock_fd
        new = MANIFEST + ".new"
        try:
            fd = os.open(new, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | os.O_APPEND, 0o600,
                         dir_fd=dfd)
        except OSError:
            return                        # keep appending to the old one
        try:
            body = [_MANIFEST_HEAD] + [f"+{os.path.basename(p)} {self._inos[p]}"
                                        for p in self.files if p in self._inos]
            os.write(fd, ("\n".join(body) + "\n").encode("utf-8", "surrogateescape"))
            os.rename(new, MANIFEST, src_dir_fd=dfd, dst_dir_fd=dfd)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(new, dir_fd=dfd)
            return
        os.close(self._manifest_fd)
        self._manifest_fd = fd
        self._manifest_lines = len(body) - 1

    def open(self, label: str, reuse: bool = False) -> tuple[int, str]:
        """A new empty file for ``label`` (fd, path), recorded in the manifest; with ``reuse``,
        a file an earlier group of the same label was read back from, where one is spare
        (its old bytes are overwritten, never read: a group reads only what it wrote)."""
        self._ensure()
        if reuse:
            with self.lock:
                while self.spare.get(label):
                    path = self.spare[label].pop()
                    if self.files.get(path) is not None:
                        return self.files[path], path
        path = str(self.dir / f"{label}-{uuid.uuid4().hex[:8]}.bin")
        flag = direct_flag() if self.direct is not False else 0
        try:
            try:
                fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL | flag, 0o600)
            except OSError as e:
                if not flag or e.errno != errno.EINVAL:
                    raise
                flag = 0                      # the file system refuses the flag itself
                self.direct, self.buffered_why = False, "the file system refuses O_DIRECT"
                fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_EXCL, 0o600)
        except OSError as e:
            raise OffloadError(f"tierplan: cannot create offload file '{path}' "
                               f"({describe(label)}): {e.strerror}; check the NVMe directory") from None
        if flag and self.direct is None:
            self.direct = accepts_direct(fd)
            if not self.direct:
                self.buffered_why = "the file system refuses O_DIRECT reads or writes"
        if flag and not self.direct:
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~flag)
        elif not flag and self.direct is None:
            self.direct, self.buffered_why = False, ("TIERPLAN_NVME_IO=buffered" if hasattr(
                os, "O_DIRECT") else "this platform has no O_DIRECT")
        if self.direct:
            self.disk.opened(fd)
            _DIRECT[fd] = self.disk
        with self.lock:
            self.files[path] = fd
            try:
                ino = os.fstat(fd).st_ino
                self._inos[path] = ino
                self._record(f"+{os.path.basename(path)} {ino}")
            except OSError as e:
                self.files.pop(path, None)
                self._inos.pop(path, None)
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink(path)
                raise OffloadError(f"tierplan: cannot record offload file '{path}' in "
                                   f"'{self.dir / MANIFEST}': {e.strerror}; check the NVMe "
                                   "directory") from None
        return fd, path

    def _delete(self, path: str) -> bool:
        """Delete one listed file (closing its fd); False, the file still listed and the
        reason kept in ``failed``, where the OS refuses (a read-only directory)."""
        with self.lock:
            if path not in self.files:
                return True
            fd, self.files[path] = self.files[path], None
        if fd is not None:
            self._forget_fd(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass                              # gone already (removed by hand)
        except OSError as e:
            with self.lock:
                self.failed[path] = e.strerror or type(e).__name__
            return False
        with self.lock:
            self.files.pop(path, None)
            self.failed.pop(path, None)
            self._inos.pop(path, None)
            self.kept_bytes -= self.kept.pop(path, 0)
            with contextlib.suppress(OSError):
                self._record(f"-{os.path.basename(path)}")
        return True

    def _forget_fd(self, fd: int) -> None:
        """``fd`` is about to be closed: its number may name another file next."""
        if _DIRECT.get(fd) is self.disk:
            del _DIRECT[fd]
            self.disk.closing(fd)

    def unlink(self, path: str) -> None:
        """Delete a file of this store. A failure is not raised here (this runs on the I/O
        thread and in finalizers): the file stays listed and ``close`` reports it."""
        if self._forked():
            return                            # the parent's file: never a child's to delete
        self._delete(path)

    def recycle(self, path: str, label: str) -> None:
        """Keep a file whose bytes were all read back (no I/O on it is queued or running) for
        the next group of ``label`` instead of deleting it: overwriting a file's blocks is
        cheaper than allocating new ones, and the delete leaves the training thread
        (docs/runtime.md, "Files"). It is deleted with the rest at ``close``, or now where
        the files kept would take more of the disk than ``prepare`` found free beyond the
        plan's need (``spare_room``). From the I/O thread: behind whatever is still queued."""
        if self._forked():
            return
        if self.on_io_thread() and self.pool is not None:
            with contextlib.suppress(RuntimeError):   # the pool shut down meanwhile
                self.pool.submit(self._keep_spare, path, label)
                return
        self._keep_spare(path, label)

    def _keep_spare(self, path: str, label: str) -> None:
        with self.lock:
            fd = self.files.get(path)
            if fd is None:
                return
            try:
                st = os.fstat(fd)
                size = max(-(-st.st_size // self.block) * self.block, st.st_blocks * 512)
            except OSError:
                size = None
            grow = None if size is None else size - self.kept.get(path, 0)
            if grow is not None and (self.spare_room is None
                                     or self.kept_bytes + grow <= self.spare_room):
                self.kept[path] = size
                self.kept_bytes += grow
                self.spare.setdefault(label, []).append(path)
                return
        self.unlink(path)

    def unlink_later(self, path: str) -> None:
        """Delete after the I/O already queued (a dropped group may still be writing)."""
        if self._forked():
            return
        pool = self.pool
        if pool is not None:
            with contextlib.suppress(RuntimeError):   # the pool shut down meanwhile
                pool.submit(self.unlink, path)
                return
        self.unlink(path)

    def unlink_now(self, path: str) -> None:
        """Delete after the I/O already queued, and wait for it (on the I/O thread itself the
        queue before this job has run: delete at once)."""
        if self._forked():
            return
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

    # -- closing ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the I/O thread, delete every file and every directory this store created.

        Everything that can be deleted is; if some file cannot be (a directory made
        read-only), the rest is still cleaned up, the file stays in the manifest (so the
        next ``sweep`` under this ``nvme_dir`` deletes it once it can), and one
        ``OffloadError`` line says so. In a forked child nothing on disk is touched."""
        if self._forked():
            self._abandon()
            return
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        self.disk.close()
        with self.lock:
            paths = list(self.files)
        for path in paths:
            self._delete(path)
        with self.lock:
            left = {p: self.failed.get(p, "unknown error") for p in self.files}
        d = self.dir
        if d is not None and not left:
            dfd = self._lock_fd
            try:
                foreign = set(os.listdir(dfd if dfd is not None else d)) - set(_BOOKKEEPING)
            except OSError:
                foreign = {"?"}
            if not foreign:        # else never delete what we did not make: the folder stays
                if self._manifest_fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(self._manifest_fd)
                    self._manifest_fd = None
                for name in (MANIFEST + ".new", MANIFEST, OWNER):
                    with contextlib.suppress(OSError):
                        os.unlink(d / name)
                with contextlib.suppress(OSError):
                    d.rmdir()
        self._release()
        if left:
            path, why = next(iter(left.items()))
            more = f" and {len(left) - 1} more" if len(left) > 1 else ""
            raise OffloadError(
                f"tierplan: cannot delete offload file '{path}'{more} ({why}); it is recorded "
                f"in '{d / MANIFEST}' and the next apply_plan under this nvme_dir deletes it "
                "once the directory is writable again")

    def _close_quietly(self) -> None:
        """``close`` for a path that is already raising another error."""
        with contextlib.suppress(OffloadError):
            self.close()

    def _release(self) -> None:
        """Let go of the manifest, the directory's lock and the base (nothing deleted)."""
        with self.lock:
            self.files.clear()
            self.failed.clear()
            self._inos.clear()
            self.spare.clear()
            self.kept.clear()
            self.kept_bytes = 0
        if self._manifest_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._manifest_fd)
            self._manifest_fd = None
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
            self._lock_fd = None
        self._leave_base()
        self.dir = None
        self.pid = None
        _LIVE.discard(self)
        _restore_sigterm()

    def _abandon(self) -> None:
        """In a forked child: close the child's copies of the parent's descriptors, touching
        nothing on disk and no lock (flock locks belong to the open file, shared with the
        parent: unlocking here would unlock the parent's). The store stays refused: every
        later use raises, so no descriptor number is reused for the wrong file."""
        fds = [fd for fd in list(self.files.values()) if fd is not None]
        for fd in fds:
            self._forget_fd(fd)
        self.disk = DiskIO(self.disk.request, self.disk.in_flight)   # its threads stayed behind
        fds += [fd for fd in (self._manifest_fd, self._lock_fd, self._base_fd) if fd is not None]
        self.files, self.failed, self._inos, self.spare, self.kept = {}, {}, {}, {}, {}
        self.kept_bytes = 0
        self._manifest_fd = self._lock_fd = self._base_fd = None
        self.pool = None                      # its thread was not forked
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _after_fork_in_child() -> None:
    for s in list(_LIVE):
        if s._forked():
            s._abandon()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _close_weak(ref):
    m = ref()
    if m is None:
        return
    try:
        m()
    except OffloadError as e:     # at exit: one line, not a traceback
        print(str(e), file=sys.stderr)
