"""Searches in a neighbourhood of a plan, as MIPs on the held instance (``_SubMIP``): the
polish (windows of units re-optimised worst first, ``_polish``) and the relaxation-induced
neighbourhood search (``_rins``).
"""
from __future__ import annotations

import math
import time

from planner.solve.milp import Model
from planner.solve.outcome import rel_gap
from planner.solve.relaxation import _HeldLP
from planner.solve.rounding import _groups


def _windows(model: Model, lp: dict, cur: dict, width: int) -> list:
    """Windows of ``width`` consecutive units to re-optimise, worst first: each pass stage
    that the plan ``cur`` makes longer than the relaxation ``lp`` does names the units whose
    decisions load it (its own unit, the two after it and the ``width`` − 3 before it, whose
    offloads, prefetches and segments reach it), scored by how much longer; then every window
    of a stride of half the width along the chain, so that a search that finds nothing
    guided still covers it all."""
    U = model.cm.U
    score: dict = {}
    for T in (model.T, model.T2):
        for s, var in T.items():
            d = cur.get(var.name, 0.0) - lp.get(var.name, 0.0)
            if d <= 1e-9 or s == 0:
                continue
            u = s - 1 if s <= U else 2 * U - s
            lo = max(0, min(u - width + 3, U - width))
            score[lo] = score.get(lo, 0.0) + d
    guided = sorted(score, key=lambda lo: -score[lo])
    step = max(1, width // 2)
    rest = [lo for lo in range(0, max(1, U - width + step), step) if lo not in score]
    return [range(lo, min(U, lo + width)) for lo in guided + rest]


# binaries set free in one window of ``_polish`` (its width in units follows from it): a
# window of ~40 solves in a fraction of a second, and one or two windows placed where the
# dive's plan is slow typically take it to within the gap of the bound
POLISH_BINARIES = 40
# the most one window's search may take: the search finds a window's better plan early and
# spends the rest proving it, which can take seconds
POLISH_WINDOW_S = 0.3
# a window's plan counts as better (and makes every other window worth another try) only
# when it gains this much: smaller gains would send the search round the chain again for
# next to nothing
POLISH_MIN_GAIN = 1e-4
# windows in a row that gain nothing end the polish, and the time left goes to the MIP
# search: gains typically come within a few windows of the last one, and where a pass of the
# chain finds nothing the time is better spent in HiGHS's search
POLISH_BARREN_RUN = 6


class _SubMIP:
    """The held instance as a MIP over the model's binaries, for searches in a neighbourhood
    of a plan: ``run`` holds every binary outside ``free`` at the plan's value and solves
    the rest, the plan as its start. A context: on leaving, the instance is the dive's LP
    again."""

    def __init__(self, model: Model, held: _HeldLP, gap: float):
        np = held.np
        self.model, self.held = model, held
        groups = _groups(model)
        self.cols = [[held.col[v.name] for _, items in groups[i] for _, v in items]
                     for i in range(model.cm.U)]
        self.ints = np.array(sorted(c for cs in self.cols for c in cs), np.int32)
        self.every = np.arange(len(held.names), dtype=np.int32)
        self.gap = gap
        # seconds: a plan this fast ends a run (``_rins``); after ``patience_s`` seconds of
        # the run, one as fast as ``later`` does
        self.target = None
        self.later = None
        self.patience_s = math.inf
        self.started = 0.0

    def __enter__(self):
        np, hs, h = self.held.np, self.held.hs, self.held.h
        h.changeColsIntegrality(len(self.ints), self.ints,
                                np.full(len(self.ints), hs.HighsVarType.kInteger))
        h.setOptionValue("solver", "choose")
        # a neighbourhood's search stops well inside the gap asked of the whole plan; without
        # HiGHS's own neighbourhood searches (RINS, RENS), which in a window of ~40 binaries
        # take most of its time and run it past its time limit
        h.setOptionValue("mip_rel_gap", max(1e-4, self.gap / 4))
        h.setOptionValue("mip_heuristic_run_rins", False)
        h.setOptionValue("mip_heuristic_run_rens", False)
        h.cbMipInterrupt.subscribe(self._reached)
        return self

    def __exit__(self, *exc):
        np, hs, h, held = self.held.np, self.held.hs, self.held.h, self.held
        h.cbMipInterrupt.unsubscribe(self._reached)
        h.changeColsIntegrality(len(self.ints), self.ints,
                                np.full(len(self.ints), hs.HighsVarType.kContinuous))
        h.changeColsBounds(len(self.every), self.every, held.lo, held.up)
        h.setOptionValue("mip_heuristic_run_rins", True)
        h.setOptionValue("mip_heuristic_run_rens", True)
        held.fixed = {}

    def _reached(self, event) -> None:
        if self.target is None:
            return
        target = self.target
        if self.later is not None and time.perf_counter() - self.started >= self.patience_s:
            target = self.later
        inc = float(event.data_out.mip_primal_bound)
        if math.isfinite(inc) and self.model.objective_value(inc + self.held.constant) \
                <= target:
            event.interrupt()

    def run(self, values: dict, free, time_limit: float):
        """(objective, values) of the best plan found with the binaries in ``free`` (column
        indices) open, or None when the search found none."""
        held, hs, h = self.held, self.held.hs, self.held.h
        lo, up = held.lo.copy(), held.up.copy()
        free = set(free)
        for c in self.ints:
            if c not in free:
                lo[c] = up[c] = round(values[held.names[c]])
        h.changeColsBounds(len(self.every), self.every, lo, up)
        sol = hs.HighsSolution()
        sol.col_value = [float(values[n]) for n in held.names]
        sol.value_valid = True
        h.setSolution(sol)
        h.setOptionValue("time_limit", h.getRunTime() + time_limit)
        self.started = time.perf_counter()
        h.run()
        info = h.getInfo()
        if info.primal_solution_status != 2:
            return None
        # the objective of the point returned, not the one HiGHS reports for it: with the
        # start set and the search ended at the root, HiGHS 1.16 reported 0.0015 GB for a
        # point worth 0.0104 GB, below the relaxation's own bound (0.0084), and the plan
        # passed as proven (gpt-tiny on 2 FSDP2 ranks with NVMe homes: a plan fits 9 MiB,
        # yet exit 3 at 8 MiB named 10.79 MiB). ``_reached`` still stops on HiGHS's figure:
        # at worst a search ends early, with the point's own value returned here
        x = h.getSolution().col_value
        return held.value_of(x), dict(zip(held.names, x))


def _polish(model: Model, held: _HeldLP, lp: dict, values: dict, obj: float,
            bound: float | None, gap: float, time_limit):
    """Large-neighbourhood search from the dive's plan: all but a window of units held at the
    plan's choices, the MIP over the window solved (``_SubMIP``), windows taken worst first
    (``_windows``) until the plan is within ``gap`` of ``bound``, ``POLISH_BARREN_RUN``
    windows in a row (or a pass over the chain) improve nothing, or the time is up. Returns
    (values, objective) of the best plan. Why: the dive rounds where the relaxation spreads a
    choice over many units, and a rounding that overloads one stage's link costs a percent or
    more; re-deciding a few units around that stage together recovers it, in a fraction of
    what the whole MIP's search takes to find the same plan."""
    t0 = time.perf_counter()
    U = model.cm.U
    with _SubMIP(model, held, gap) as sub:
        if not len(sub.ints):
            return values, obj
        per_unit = max(1.0, len(sub.ints) / max(1, U))
        width = max(3, min(U, int(POLISH_BINARIES / per_unit)))
        tried: set = set()
        dry = 0                     # windows tried since the last gain
        # windows that gained nothing go after the others when the plan changes: they may
        # pay again, but seldom do (on gpt-like chains the last units' windows run to their
        # limit after each gain elsewhere, for gains under POLISH_MIN_GAIN)
        barren: set = set()
        order = _windows(model, lp, values, width)      # again only when the plan changes
        while True:
            w = next((w for w in order if w.start not in tried), None)
            left = None if time_limit is None else time_limit - (time.perf_counter() - t0)
            if ((bound is not None and rel_gap(obj, bound) <= gap) or w is None
                    or (left is not None and left < 0.05) or dry >= POLISH_BARREN_RUN):
                break
            tried.add(w.start)
            dry += 1
            per = POLISH_WINDOW_S if left is None else max(0.05, min(POLISH_WINDOW_S, left / 2))
            got = sub.run(values, (c for i in w for c in sub.cols[i]), per)
            if got is not None and got[0] < obj * (1 - POLISH_MIN_GAIN):
                obj, values = got
                tried = {w.start}     # the plan changed: every other window may pay again
                dry = 0
                barren.discard(w.start)
                order = sorted(_windows(model, lp, values, width),
                               key=lambda x: x.start in barren)
                continue
            barren.add(w.start)
    return values, obj


# a binary whose relaxed value is this far from the plan's counts as a disagreement (``_rins``)
RINS_TOL = 0.01
# ``_rins`` stops at the first plan within half the gap of the bound, after this many seconds
# at the first within the gap
RINS_PATIENCE_S = 1.0


def _rins(model: Model, held: _HeldLP, lp: dict, values: dict, obj: float, bound: float,
          gap: float, time_limit):
    """One search over the binaries where the plan and the relaxation ``lp`` disagree, all
    the others held (relaxation-induced neighbourhood search, Danna, Rothberg & Le Pape 2005),
    stopped as soon as a plan is within half the ``gap`` of ``bound``, or after
    ``RINS_PATIENCE_S`` seconds within the gap. Returns (values, objective).
    Why: the plans the windows miss can differ from the dive's all along the chain (half
    its units, say), and where the relaxation is whole the two agree: the open part is a
    fraction of the binaries, searched in a fraction of the time HiGHS's whole search takes
    to find the same plans. Half the gap first: the first plan within the gap is often not
    the best one the search is about to find; patience: waiting for half the gap alone can
    take seconds more."""
    with _SubMIP(model, held, gap) as sub:
        free = [c for c in sub.ints
                if abs(lp.get(held.names[c], 0.0) - round(values[held.names[c]])) > RINS_TOL]
        if not free:
            return values, obj
        sub.target = bound / (1 - gap / 2)
        sub.later, sub.patience_s = bound / (1 - gap), RINS_PATIENCE_S
        got = sub.run(values, free, math.inf if time_limit is None else time_limit)
    if got is not None and got[0] < obj:
        obj, values = got
    return values, obj
