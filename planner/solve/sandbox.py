"""The run around one solver: every solve cleans up after itself on every path (done,
infeasible, failed, interrupted). Its temporary directory (PuLP's MPS/solution files, CBC's
log) is locked while it runs and removed after, the directories of processes that died are
swept, and a CBC child process still running is killed (and made to die with its parent).
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

from planner.formats.fileio import lock_dir
from planner.solve.backends import make_solver
from planner.solve.progress import _HighsCallback, _tail_progress


def _die_with_parent() -> None:
    """In the solver's child, before exec: SIGKILL it when this process dies, however it dies
    (SIGKILL included), so that no CBC runs on to its time limit after its parent is gone
    (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)      # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _Children:
    """Records the processes PuLP starts during one solve (it keeps no handle we could reach
    when the solve is interrupted), so that ``kill`` can end one left running; each is also
    made to die with this process (``_die_with_parent``)."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []

    def Popen(self, *a, **k):          # noqa: N802 -- stands in for subprocess.Popen
        if sys.platform.startswith("linux") and "preexec_fn" not in k:
            k["preexec_fn"] = _die_with_parent
        p = subprocess.Popen(*a, **k)
        self.procs.append(p)
        return p

    def __getattr__(self, name):       # everything else PuLP uses from subprocess
        return getattr(subprocess, name)

    def kill(self):
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(OSError):
                    p.kill()
                with contextlib.suppress(Exception):
                    p.wait(timeout=5)


_PATCH_LOCK = threading.Lock()


@contextlib.contextmanager
def _tracked_children():
    """Route PuLP's ``subprocess.Popen`` (in its CBC module) through ``_Children`` for the
    duration of one solve."""
    from pulp.apis import coin_api
    children = _Children()
    with _PATCH_LOCK:
        saved = coin_api.subprocess
        coin_api.subprocess = children
        try:
            yield children
        finally:
            coin_api.subprocess = saved
            children.kill()


_SOLVE_DIR = re.compile(r"^tierplan-solve-(\d+)-")


def _solve_dir() -> tuple[str, int]:
    """A temporary directory for one solve, locked (flock) while this process lives, and the
    lock's fd. Made under another name and renamed once locked, so that ``_sweep_solve_dirs``
    never sees it unlocked."""
    staging = tempfile.mkdtemp(prefix=".tierplan-solve-new-")
    fd = lock_dir(staging)
    final = os.path.join(os.path.dirname(staging),
                         f"tierplan-solve-{os.getpid()}-{os.path.basename(staging)[-8:]}")
    try:
        os.rename(staging, final)
    except OSError:
        final = staging
    return final, fd


def _sweep_solve_dirs() -> None:
    """Remove the solve directories of processes that died without cleaning up (SIGKILL):
    those whose lock is free."""
    base = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for ent in os.scandir(base):
            if not _SOLVE_DIR.match(ent.name) or not ent.is_dir(follow_symlinks=False):
                continue
            fd = lock_dir(ent.path)
            if fd is None:
                continue                      # its solve is running
            try:
                shutil.rmtree(ent.path, ignore_errors=True)
            finally:
                os.close(fd)


@contextlib.contextmanager
def _solver_run(solver, time_limit, gap, warm, start, progress, scale: float = 1.0):
    """A solver and the run around it: its own temp directory, its children killed and the
    directory removed on every path (also SIGTERM, which ``plan`` unwinds like Ctrl-C; after
    a SIGKILL the next solve sweeps it); yields (pulp solver, CBC log path, HiGHS callback)."""
    _sweep_solve_dirs()
    tmp, lock_fd = _solve_dir()
    log_path = os.path.join(tmp, "cbc.log") if solver == "cbc" else None
    stop = threading.Event()
    th = None
    callback = _HighsCallback(progress, scale) if solver == "highs" else None
    try:
        if progress and solver == "cbc":
            open(log_path, "w").close()
            th = threading.Thread(target=_tail_progress, args=(log_path, stop, scale),
                                  daemon=True)
            th.start()
        s = make_solver(solver, time_limit, gap, warm, tmp, log_path, callback, start)
        with _tracked_children():
            yield s, log_path, callback
    finally:
        stop.set()
        if th:
            th.join(timeout=2)
        shutil.rmtree(tmp, ignore_errors=True)
        if lock_fd is not None:
            os.close(lock_fd)
