"""Progress and gap from the solvers: elapsed time, incumbent and gap on stderr (CBC's log
tailed, HiGHS's MIP callback, which also stops HiGHS when the process is interrupted), and
CBC's final gap read from its log.
"""
from __future__ import annotations

import math
import re
import sys
import threading

from planner.solve.outcome import rel_gap


_CBC_PROGRESS = re.compile(r"Cbc0010I After (\d+) nodes.*?([-\d.e+]+) best solution, best possible "
                           r"([-\d.e+]+) \(([\d.]+) seconds\)")
_CBC_BOUND = re.compile(r"best possible ([-\d.e+]+)")


def _progress_line(elapsed: float, incumbent: float, gap: float) -> None:
    print(f"  solve: {elapsed:6.1f} s  incumbent {incumbent:.5f}  gap {gap:.2%}", file=sys.stderr)


def _tail_progress(log_path: str, stop: threading.Event, scale: float = 1.0) -> None:
    """Print elapsed time, incumbent and gap from CBC's log on stderr (TTY only)."""
    pos = 0
    while not stop.wait(1.0):
        try:
            with open(log_path) as fh:
                fh.seek(pos)
                text = fh.read()
                pos = fh.tell()
        except OSError:
            continue
        for m in _CBC_PROGRESS.finditer(text):
            inc, bound = float(m.group(2)), float(m.group(3))
            _progress_line(float(m.group(4)), inc * scale, rel_gap(inc, bound))


class _HighsCallback:
    """HiGHS's MIP interrupt callback: progress once a second (when asked) and a stop when
    the process was interrupted (HiGHS runs in this process: Ctrl-C waits for it otherwise)."""

    def __init__(self, progress: bool, scale: float = 1.0):
        self.progress = progress
        self.scale = scale              # the objective's unit in seconds (Model.ts)
        self.last = -1.0
        self.stop = False

    def __call__(self, event) -> None:
        if self.stop:
            event.interrupt()
            return
        if not self.progress:
            return
        d = event.data_out
        t = float(d.running_time)
        inc, bound = float(d.mip_primal_bound), float(d.mip_dual_bound)
        if t - self.last < 1.0 or not (math.isfinite(inc) and math.isfinite(bound)):
            return
        self.last = t
        _progress_line(t, inc * self.scale, rel_gap(inc, bound))


def _cbc_gap(log_path: str, objective: float, allowed: float) -> float | None:
    """CBC's gap from its log: the last ``best possible`` bound (its final ``Lower bound`` line
    keeps 3 decimals, too coarse); a completed search proved the allowed gap at least."""
    try:
        text = open(log_path).read()
    except OSError:
        return None
    bounds = _CBC_BOUND.findall(text)
    g = rel_gap(objective, float(bounds[-1])) if bounds else None
    if "Search completed" in text or "Result - Optimal solution found" in text:
        if "tolerance" not in text:
            return 0.0
        return min(g, allowed) if g is not None else allowed
    return g
