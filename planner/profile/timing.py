"""Timing statistics: the median and spread of repeats, how many repeats to run (``_Repeats``),
the CPU load other processes put on this machine meanwhile (``_LoadMeter``, ``usable_cpus``),
and the ``timing_quality`` section that says how far measured times can be trusted.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch

# A unit's timing is stable when its relative spread, the interquartile range over the median,
# is at most this; repeats continue (up to MAX_REPEAT_FACTOR x --repeats, and for at most
# TIMING_BUDGET_S per unit) until it is. Units still above WIDE_SPREAD are named in a warning.
STABLE_SPREAD = 0.10
WIDE_SPREAD = 0.25
# ... and only when that unit's interquartile range, in seconds, is at least this share of the
# step's compute: a 5 ms head whose backward varies by 40% does not move a 1.8 s step.
WIDE_SHARE = 0.05
MAX_REPEAT_FACTOR = 4
TIMING_BUDGET_S = 2.0
# Other processes using this many CPUs on average while we time (from /proc/stat), beyond the
# cores our own threads leave idle, make the timings unreliable. A busy core slows every
# OpenMP barrier (each waits for the thread that shares a core) by the same amount on every
# repeat: a steady wrong time with a small spread, which no spread check can reveal.
LOAD_CPUS = 0.25
# Backward over forward time against backward over forward FLOPs, for units whose forward is
# at least COMPUTE_BOUND arithmetic at the spec's achievable rate: outside this factor either
# way the times are suspect. Units further from the arithmetic are not checked: there the
# FLOP ratio says nothing (a small model's forward time is mostly fresh allocations and
# dropout masks, not arithmetic).
RATIO_FACTOR = 3.0
COMPUTE_BOUND = 0.5


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(xs):
    return float(statistics.median(xs)) if xs else 0.0


def _spread(xs) -> float:
    """Interquartile range over the median (0 for fewer than 2 samples)."""
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    med = statistics.median(xs)
    return float((q3 - q1) / med) if med > 0 else 0.0


class _Repeats:
    """How many timed repeats to run: at least ``repeats``, then until every sample list is
    stable, at most ``MAX_REPEAT_FACTOR * repeats`` or ``TIMING_BUDGET_S`` seconds."""

    def __init__(self, repeats: int):
        self.min, self.max = repeats, MAX_REPEAT_FACTOR * repeats
        self.t0 = time.perf_counter()

    def done(self, n: int, lists) -> bool:
        if n < self.min:
            return False
        if n >= self.max or time.perf_counter() - self.t0 > TIMING_BUDGET_S:
            return True
        return all(_spread(xs) <= STABLE_SPREAD for xs in lists if xs)


PROC_STAT = "/proc/stat"


def usable_cpus() -> set[int]:
    """The CPUs this process's threads may run on (``os.cpu_count()`` counts the whole
    machine's): every thread's, not only the calling one's, since with ``OMP_PROC_BIND`` the
    main thread is pinned to one CPU while torch's workers run on the others."""
    cpus: set[int] = set()
    with contextlib.suppress(AttributeError, OSError):      # no /proc, no sched_getaffinity
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
                cpus |= os.sched_getaffinity(int(tid))
    if not cpus:
        with contextlib.suppress(AttributeError, OSError):
            cpus = set(os.sched_getaffinity(0))
    return cpus or set(range(os.cpu_count() or 1))


class _LoadMeter:
    """CPU time other processes used (and the hypervisor stole) while we measured, in CPUs:
    /proc/stat's busy time of the CPUs this process's threads may run on (at the start or
    the end: torch starts its workers lazily), less this process's own. ``None`` where
    /proc/stat cannot be read."""

    def __init__(self):
        self.cpus = usable_cpus()
        self.start = self._read()

    @staticmethod
    def _read():
        """(busy seconds per /proc/stat line, ``cpu`` being all CPUs, our own CPU seconds,
        wall seconds), or None."""
        busy = {}
        try:
            with open(PROC_STAT) as f:
                for line in f:
                    fields = line.split()
                    if fields and fields[0].startswith("cpu"):
                        # user nice system idle iowait irq softirq steal (guest is inside user)
                        busy[fields[0]] = sum(int(x) for i, x in enumerate(fields[1:9])
                                              if i not in (3, 4))
        except (OSError, ValueError):
            return None
        if not busy:
            return None
        tick = os.sysconf("SC_CLK_TCK")
        t = os.times()
        return {k: v / tick for k, v in busy.items()}, t.user + t.system, time.perf_counter()

    def other_cpus(self) -> float | None:
        end = self._read()
        if self.start is None or end is None:
            return None
        wall = end[2] - self.start[2]
        if wall < 0.2:      # /proc/stat counts in 10 ms ticks: too coarse below that
            return None
        # Only the CPUs our threads may run on (taskset, a container's cpuset): others' work
        # elsewhere does not touch our timings. Where /proc/stat has no line for each of
        # them, its first line (all CPUs).
        lines = [f"cpu{i}" for i in self.cpus | usable_cpus()]
        if not all(k in self.start[0] and k in end[0] for k in lines):
            lines = ["cpu"]
        if not all(k in self.start[0] and k in end[0] for k in lines):
            return None
        busy = sum(end[0][k] - self.start[0][k] for k in lines)
        other = busy - (end[1] - self.start[1])
        return max(0.0, other / wall)



def _timing_quality(records, spreads, ratios, repeats, load, threads=None) -> dict:
    """How far the measured times can be trusted: the spread of every unit, the units whose
    spread is wide or whose backward/forward time ratio disagrees with their FLOP ratio, the
    load other processes put on the CPUs meanwhile, and the warnings that follow."""
    step = sum(r.fwd_s + r.bwd_s for r in records) or 1.0
    secs = {r.name: (r.fwd_s, r.bwd_s) for r in records}
    wide = [n for n, (f, b) in spreads.items() if max(f, b) > WIDE_SPREAD
            and f * secs[n][0] + b * secs[n][1] >= WIDE_SHARE * step]
    odd = {n: [round(m, 2), round(f, 2)] for n, (m, f) in ratios.items()
           if not f / RATIO_FACTOR <= m <= f * RATIO_FACTOR}
    cpus = len(usable_cpus())
    threads = threads or torch.get_num_threads()
    idle = max(0, cpus - threads)          # cores our threads leave to others
    warnings = []
    if load is not None and load >= LOAD_CPUS + idle:
        warnings.append(f"other processes used {load:.2f} CPUs on average while timing "
                        f"(this machine has {cpus}, {threads} used here), so the measured "
                        "times are not this model's; profile on a quiet machine or use "
                        "--timing estimate")
    if wide:
        warnings.append(f"timings of {_names(wide)} vary by more than "
                        f"{WIDE_SPREAD:.0%} between repeats (interquartile range over median), "
                        f"at least {WIDE_SHARE:.0%} of the step; profile on a quiet machine, "
                        "raise --repeats or use --timing estimate")
    if odd:
        warnings.append("backward/forward time ratio of " + ", ".join(
            f"{n} is {m} against a FLOP ratio of {f}" for n, (m, f) in odd.items())
            + f" (more than {RATIO_FACTOR:g}x off for compute-bound units); re-profile on a "
            "quiet machine or use --timing estimate")
    return {"statistic": "median", "repeats": int(repeats),
            "max_repeats": int(MAX_REPEAT_FACTOR * repeats),
            "samples": {r.name: r.samples for r in records},
            "spread": {n: [round(f, 4), round(b, 4)] for n, (f, b) in spreads.items()},
            "other_load_cpus": None if load is None else round(load, 3),
            "threads": int(threads), "ratio_checked": sorted(ratios),
            "wide_spread": wide, "ratio_mismatch": odd, "reliable": not warnings,
            "warnings": warnings}


def _names(names, limit=6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")

