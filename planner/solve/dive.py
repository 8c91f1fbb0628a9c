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
from planner.solve.outcome import NothingBetter, rel_gap
from planner.solve.race import _fork_available
from planner.solve.relaxation import _HeldLP, _fixed_lp, _relaxation
from planner.solve.rival import _Rival, _guarded
from planner.solve.rounding import _Rounder, _unit_by_unit
from planner.solve.runner import _big_mip


# re-solves a dive aims at: at 48 blocks one per unit gave plans 0.2-1.2% above the bound,
# batches of 8 gave 2.1-4.9% (batches of 16: 11.5% on gpt2-xl at a quarter of its activations)
DIVE_SOLVES = 64


def _dive(model: Model, solver: str, time_limit, gap: float, incumbent: float | None = None,
          polish_limit=None):
    """A global bound and a first plan. The LP relaxation's value bounds every plan; then,
    batch by batch along the chain, its choices are rounded (``_Rounder``) and fixed, and the
    relaxation re-solved with them fixed, so the units still open adapt to what the fixed ones
    use; the last LP, with everything fixed, times the plan. A batch that makes the relaxation
    infeasible is retried with the next offset. Why: on this project's instances the
    relaxation is within a fraction of a percent of the optimum, and what the MILP solvers
    lack is a good first plan (gpt2-xl at 30G: HiGHS's root bound is 0.2% below the optimum,
    but it finds that plan after 28 s). With HiGHS, a plan not within ``gap`` of the bound
    has the bound raised (``_count_bound``), then is polished (``_polish``), both within
    ``polish_limit`` seconds; one still not within the gap leaves ``model.rival`` (``_rins``
    from it, the count bound on every count) to race HiGHS's search. Returns (bound, values
    of the plan, its objective)."""
    t0 = time.perf_counter()

    def over():
        return time_limit is not None and time.perf_counter() - t0 > time_limit

    held = _HeldLP(model) if solver == "highs" and highs_available() else None

    def relaxation(limit, fixed):
        if held is None:
            return _relaxation(model, solver, limit, fixed)
        if limit is not None:
            limit = max(0.05, limit - (time.perf_counter() - t0))
        return held.solve(limit, fixed)
    first, lp = relaxation(time_limit, {})
    first_s = time.perf_counter() - t0
    if first is None:
        return None, None, None
    # only an LP solved to optimality bounds every plan (one the time limit stopped gave
    # gpt3-175b a 'bound' of 1,862 s where a 1,768 s plan exists); a stopped one still
    # guides the rounding: without the complete start that gives, HiGHS was handed a partial
    # one and ran 40 s past a 1.5 s limit (promises seed 1299)
    bound = first if model.lp_optimal else None
    if incumbent is not None and bound is not None and rel_gap(incumbent, bound) <= gap:
        raise NothingBetter(f"bound {bound:.6g} s, incumbent {incumbent:.6g} s")
    U = model.cm.U
    # units rounded per re-solve: one at a time where DIVE_SOLVES re-solves fit in half the
    # time left (a re-solve warm-started from the last basis taking about a quarter of the
    # first), more where they do not; never more than a sixth of the chain
    affordable = DIVE_SOLVES
    if time_limit is not None:
        affordable = min(affordable, 0.5 * (time_limit - first_s) / max(first_s / 4, 1e-3))
    batch = max(1, min(max(4, U // 6), math.ceil(U / max(1.0, affordable))))
    for offset in (0.5, 0.0, 0.25, 0.75):
        r = _Rounder(model, offset)
        fixed, cur = {}, lp
        ok = True
        for start in range(0, U, batch):
            if over():
                return bound, None, None
            units = range(start, min(U, start + batch))
            state = r.save()
            trial = dict(fixed, **r.round(units, cur))
            obj, values = relaxation(time_limit, trial)
            if obj is None and held is not None:
                # the batch as rounded does not fit: unit by unit, a unit that does not fit
                # as rounded taking the first of its other choices that does (cheap with the
                # held LP's warm re-solves; gpt3-175b's joint model failed every offset here)
                r.restore(state)
                trial, obj, values = _unit_by_unit(r, units, fixed, cur,
                                                   lambda f: relaxation(time_limit, f), over)
            if obj is None:
                ok = False
                break
            fixed, cur = trial, values
        if ok:
            # every binary is fixed now: the last relaxation is the plan's LP (held), or is
            # timed as one
            if held is None:
                obj, cur = _fixed_lp(model, solver, time_limit, fixed)
            elif obj is not None and (bound is None or rel_gap(obj, bound) > gap):
                t_pol = time.perf_counter()

                def left():              # of the polish's share
                    return None if polish_limit is None else \
                        polish_limit - (time.perf_counter() - t_pol)

                def count_bound(b, o):   # on every count, from bound b, to prove plan o
                    return lambda limit, stop: _count_bound(model, held, lp, b, o * (1 - gap),
                                                            limit, stop=stop)
                # the count bound first, on the home counts, a few LPs (0.1-0.4 s on
                # gpt2-xl), after which the polish has less to find (gpt2-xl at a quarter of
                # its activations: polish 0.58 s -> 0.16 s, plan solve 3.2 s -> 2.8 s)
                if bound is not None:
                    bound = _count_bound(model, held, lp, bound, obj * (1 - gap), left(),
                                         COUNT_LPS_FIRST, counts=model.home_counts())
                if bound is None or rel_gap(obj, bound) > gap:
                    # the count bound on every count beside the polish: where the dive's plan
                    # is already within a hair of the best, it proves it while the polish
                    # finds nothing (gpt2-xl at 38.45G: 0.5 s, where the polish took 1.8 s
                    # and the count bound after it 0.5 s more)
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
            if obj is not None:
                return bound, cur, obj
    return bound, None, None
