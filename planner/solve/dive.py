"""The LP dive (``_dive``): the relaxation's bound, its choices rounded and fixed batch by
batch along the chain into a first plan, then (HiGHS) the count bound and the polish on that
plan, and the rival left to race HiGHS's search where the plan is not yet within the gap.
"""
from __future__ import annotations

import math
import time

from planner.solve.bound import COUNT_LPS_FIRST, _count_bound
from planner.solve.highs import available as highs_available
from planner.solve.milp import Model
from planner.solve.neighbourhood import _polish, _rins
from planner.solve.outcome import Infeasible, NothingBetter, rel_gap
from planner.solve.race import _fork_available
from planner.solve.relaxation import _HeldLP, _fixed_lp, _relaxation
from planner.solve.rival import _Rival, _guarded
from planner.solve.rounding import _Rounder, _unit_by_unit
from planner.solve.runner import _big_mip


# re-solves a dive aims at: rounding fewer units per re-solve gives plans nearer the bound
# (one unit per re-solve: within about 1% of it on chains of 48 blocks; batches of 8: 2-5%)
DIVE_SOLVES = 64
# what ``_round_chain`` answers when the dive's time ran out
_TIME_UP = object()
# how far past its limit a dive that ran out part-way may go to complete its plan (the rest
# of the chain as one batch, unit by unit where that does not fit)
LATE_GRACE = 1.15


def _dive(model: Model, solver: str, time_limit, gap: float, incumbent: float | None = None,
          polish_limit=None):
    """A global bound and a first plan. The LP relaxation's value bounds every plan; then,
    batch by batch along the chain, its choices are rounded (``_Rounder``) and fixed, and the
    relaxation re-solved with them fixed, so the units still open adapt to what the fixed ones
    use; the last LP, with everything fixed, times the plan. A batch that makes the relaxation
    infeasible is retried with the next offset. Why: on these chains the relaxation is
    typically within a fraction of a percent of the optimum, and what the MILP solvers lack
    is a good first plan (HiGHS's root bound can be that close long before its search finds
    a plan near it). With HiGHS, a plan not within ``gap`` of the bound is improved
    (``_improve``) within ``polish_limit`` seconds. Returns (bound, values of the plan, its
    objective); raises ``Infeasible`` where HiGHS proves the relaxation infeasible."""
    t0 = time.perf_counter()

    def over(grace=1.0):
        return time_limit is not None and time.perf_counter() - t0 > time_limit * grace

    held = _HeldLP(model) if solver == "highs" and highs_available() else None

    def relaxation(limit, fixed):
        if held is None:
            return _relaxation(model, solver, limit, fixed)
        if limit is not None:
            limit = max(0.05, limit - (time.perf_counter() - t0))
        return held.solve(limit, fixed)
    first, lp = relaxation(time_limit, {})
    first_s = time.perf_counter() - t0
    if first is None and held is not None and held.infeasible():
        # proven, not stopped: no plan of this model fits (the solver's own search would take
        # as long again to say so: 8-10 s per joint model of gpt3-175b layer-major on 24 G)
        raise Infeasible("the LP relaxation is infeasible")
    if first is None:
        return None, None, None
    # only an LP solved to optimality bounds every plan (one the time limit stopped may lie
    # above the optimum); a stopped one still guides the rounding, and so gives the search
    # a complete start
    bound = first if model.lp_optimal else None
    if incumbent is not None and bound is not None and rel_gap(incumbent, bound) <= gap:
        raise NothingBetter(f"bound {bound:.6g} s, incumbent {incumbent:.6g} s")
    batch = _batch_size(model.cm.U, time_limit, first_s)
    for offset in (0.5, 0.0, 0.25, 0.75):
        rounded = _round_chain(model, _Rounder(model, offset), batch, lp, held,
                               lambda f: relaxation(
                                   None if time_limit is None else
                                   time_limit * (LATE_GRACE if over() else 1.0), f), over,
                               late=lambda: over(LATE_GRACE))
        if rounded is _TIME_UP:
            return bound, None, None
        if rounded is None:
            continue
        fixed, cur, obj = rounded
        # every binary is fixed now: the last relaxation is the plan's LP (held), or is
        # timed as one
        if held is None:
            obj, cur = _fixed_lp(model, solver, time_limit, fixed)
        elif obj is not None and (bound is None or rel_gap(obj, bound) > gap):
            bound, cur, obj = _improve(model, held, lp, cur, obj, bound, gap, polish_limit)
        if obj is not None:
            return bound, cur, obj
    return bound, None, None


def _batch_size(U: int, time_limit, first_s: float) -> int:
    """Units rounded per re-solve: one at a time where ``DIVE_SOLVES`` re-solves fit in half
    the time left (a re-solve warm-started from the last basis taking about a quarter of the
    first LP's ``first_s``), more where they do not; never more than a sixth of the chain."""
    affordable = DIVE_SOLVES
    if time_limit is not None:
        affordable = min(affordable, 0.5 * (time_limit - first_s) / max(first_s / 4, 1e-3))
    return max(1, min(max(4, U // 6), math.ceil(U / max(1.0, affordable))))


def _round_chain(model: Model, r: _Rounder, batch: int, lp: dict, held, relax, over,
                 late=None):
    """The chain rounded by ``r`` from the relaxation ``lp`` and fixed ``batch`` units at a
    time, the relaxation re-solved (``relax(fixed)``) after each batch: (fixed, values,
    objective) of the last re-solve; None where a batch fits in no way; ``_TIME_UP`` when
    ``over()`` before the first batch, or when the rest of the chain, rounded as one batch
    once ``over()``, is not complete before ``late()``."""
    U = model.cm.U
    fixed, cur = {}, lp
    obj = None
    start = 0
    while start < U:
        end = min(U, start + batch)
        if over():
            if start == 0 or held is None:
                return _TIME_UP
            # out of time part-way: the rest in one batch, one re-solve, so that the search
            # still gets a complete plan (on the largest models the first LP takes most of
            # the dive's time and HiGHS's own search finds none after it)
            end = U
        units = range(start, end)
        state = r.save()
        trial = dict(fixed, **r.round(units, cur))
        obj, values = relax(trial)
        if obj is None and held is not None:
            # the batch as rounded does not fit: unit by unit, a unit that does not fit as
            # rounded taking the first of its other choices that does (cheap with the held
            # LP's warm re-solves, and what lets the largest joint models round at all)
            r.restore(state)
            trial, obj, values = _unit_by_unit(r, units, fixed, cur, relax,
                                               late if over() and late else over)
        if obj is None:
            return _TIME_UP if over() else None
        fixed, cur = trial, values
        start = end
    return fixed, cur, obj


def _improve(model: Model, held: _HeldLP, lp: dict, cur: dict, obj: float, bound, gap: float,
             polish_limit):
    """The dive's plan ``cur`` (objective ``obj``), not within ``gap`` of ``bound``, with
    HiGHS: the bound raised (``_count_bound`` on the home counts), then the plan polished
    (``_polish``) with the count bound on every count beside it, within ``polish_limit``
    seconds; a plan still not within the gap leaves ``model.rival`` (``_rins`` from it, the
    count bound on every count) to race HiGHS's search. Returns (bound, values, objective)."""
    t_pol = time.perf_counter()

    def left():              # of the polish's share
        return None if polish_limit is None else \
            polish_limit - (time.perf_counter() - t_pol)

    def count_bound(b, o):   # on every count, from bound b, to prove plan o
        return lambda limit, stop: _count_bound(model, held, lp, b, o * (1 - gap),
                                                limit, stop=stop)
    # the count bound first, on the home counts, a few LPs, after which the polish has less
    # to find
    if bound is not None:
        bound = _count_bound(model, held, lp, bound, obj * (1 - gap), left(),
                             COUNT_LPS_FIRST, counts=model.home_counts())
    if bound is None or rel_gap(obj, bound) > gap:
        # the count bound on every count beside the polish: where the dive's plan is already
        # within a hair of the best, it proves that while the polish finds nothing
        proof = None if bound is None else _Rival(
            None, bound, gap, model.ts, count_bound(bound, obj), (cur, obj))
        cur, obj = _guarded(_polish, model, held, lp, cur, obj, bound, gap, left(),
                            prove=None if proof is None else proof.prove)
        if proof is not None:
            bound = proof.bound
    if (bound is not None and rel_gap(obj, bound) > gap and _fork_available()
            and _big_mip(model)):
        plan, plan_obj, b = cur, obj, bound
        model.rival = _Rival(lambda limit: _rins(model, held, lp, plan, plan_obj,
                                                 b, gap, limit),
                             bound, gap, model.ts, count_bound(b, plan_obj),
                             (plan, plan_obj))
    return bound, cur, obj
