"""Functions in forked children with hard deadlines: ``_in_child`` (one, killed at its
deadline) and ``_race`` (a search and its rival side by side, the first to decide ending the
other), and ``hard_deadline``, how long a HiGHS MIP run may take before it is killed.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import select
import signal
import sys
import time

import pulp

from planner.solve.sandbox import _die_with_parent


def hard_deadline(time_limit: float, overrun_s: float) -> float:
    """How long a HiGHS MIP run in its child may take before it is killed: its own limit,
    what handing it the model costs (``overrun_s``, of which ``solve`` keeps 1.5x back from
    the run's limit), and a twentieth more (at least 0.5 s) for the node that is running
    when the limit strikes: the whole solve then ends within about that much of
    ``--time-limit``."""
    return time_limit + max(0.5, 0.05 * time_limit) + 1.5 * overrun_s


def _fork_available() -> bool:
    return sys.platform.startswith("linux") and hasattr(os, "fork")


def _child(fn, fd: int) -> None:
    """In the forked child: run ``fn``, write back ("ok", its result) or ("failed", why),
    pickled, and leave without running any of the parent's exit handlers."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # the parent decides; it kills us
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_parent()
        try:
            msg = ("ok", fn())
        except pulp.PulpSolverError as e:
            msg = ("failed", str(e))
        except BaseException as e:                       # noqa: BLE001 -- reported, not lost
            msg = ("failed", f"{type(e).__name__}: {e}")
        with os.fdopen(fd, "wb") as fh:
            pickle.dump(msg, fh)
    finally:
        os._exit(0)


def _spawn(fn, nice: int = 0) -> tuple[int, int]:
    """``fn()`` in a forked child (``_child``) at ``nice`` more niceness: (its pid, the pipe
    it answers on)."""
    r, w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:                                    # the child
        os.close(r)
        if nice:
            with contextlib.suppress(OSError):
                os.nice(nice)
        _child(fn, w)
    os.close(w)
    return pid, r


def _reap(pid: int, fd: int) -> None:
    """Close the pipe of child ``pid`` and kill it (it may have finished: then only reaped)."""
    os.close(fd)
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.waitpid(pid, 0)


def _answer(data: bytes | None):
    """What a child wrote (``_child``): its result; ``pulp.PulpSolverError`` if it failed."""
    try:
        msg = pickle.loads(data)
    except Exception:                               # noqa: BLE001 -- died mid-write
        msg = ("failed", "the HiGHS process ended without an answer")
    if msg[0] == "failed":
        raise pulp.PulpSolverError(msg[1])
    return msg[1]


def _in_child(fn, hard_s: float | None):
    """``fn()`` run in a forked child that is killed after ``hard_s`` seconds: its (pickled)
    result, or ``None`` when the deadline killed it; ``pulp.PulpSolverError`` when it failed.

    Why: HiGHS checks its time limit and its interrupt callback only at points of its own;
    its MIP presolve of a model of several hundred binaries can run for minutes past the
    limit reaching neither, and in-process nothing can stop it, Ctrl-C included. A child can
    be killed: the caller then keeps the plan it already has. ``os.fork``, not
    ``multiprocessing``: this may run inside a pool's daemonic worker, which may not have
    multiprocessing children."""
    return _race(fn, None, hard_s, lambda _: False, nice=0)[0]


# niceness added to the whole search in a ``_race``
RACE_NICE = 10


def _race(fn, rival, hard_s: float | None, wins, meanwhile=None, nice: int = RACE_NICE):
    """``fn()`` and ``rival()`` side by side, each in a forked child (``_in_child``'s rules;
    ``fn``'s niceness raised by ``nice``): (``fn``'s result or None, ``rival``'s or None). It
    ends when ``fn`` answers, at ``hard_s``, or when ``rival`` answers with a result that
    ``wins(result)`` accepts (``fn`` is then killed). A rival that fails or answers nothing
    counts as None; ``rival`` may be None (``fn`` alone, against ``meanwhile``).
    ``meanwhile(poll)``, if given, runs in this process once both have started, calling
    ``poll()`` between its steps (it reads what the children wrote; True: the race is
    decided, stop); a result it returns that ``wins`` accepts is the rival's answer."""
    deadline = None if hard_s is None else time.monotonic() + hard_s
    kids = {}
    try:
        # ``fn`` (the whole search, the slowest to decide where a race pays) yields the CPU
        # to the other two where cores are short: at equal niceness on two cores the race
        # took about twice as long as the rival's search alone
        for name, f, up in (("fn", fn, nice), ("rival", rival, 0)):
            if f is not None:
                pid, r = _spawn(f, up)
                kids[r] = (name, pid, [])
        got = {}

        def decided() -> bool:
            return "fn" in got or (got.get("rival") is not None and wins(got["rival"]))

        def drain(wait) -> bool:
            """Read what the children wrote within ``wait`` seconds, and all they write on
            meanwhile (an answer can be bigger than the pipe's buffer: one read per poll
            would leave ``meanwhile`` running on past the answer); whether it is decided."""
            while True:
                open_fds = [r for r, (name, _, _) in kids.items() if name not in got]
                ready, _, _ = select.select(open_fds, [], [], wait)
                if not ready:
                    return decided()
                wait = 0.0
                for r in ready:
                    name, _, chunks = kids[r]
                    chunk = os.read(r, 1 << 20)
                    if chunk:
                        chunks.append(chunk)
                        continue
                    if name == "fn":
                        got["fn"] = _answer(b"".join(chunks))
                    else:
                        try:
                            got["rival"] = _answer(b"".join(chunks))
                        except pulp.PulpSolverError:
                            got["rival"] = None
        if meanwhile is not None:
            early = meanwhile(lambda: drain(0.0))
            if not decided() and early is not None and wins(early):
                return got.get("fn"), early
        while not decided():
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if wait == 0.0:
                break                               # the deadline
            drain(wait)
    finally:
        for r, (_, pid, _) in kids.items():
            _reap(pid, r)
    return got.get("fn"), got.get("rival")
