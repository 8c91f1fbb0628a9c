"""A bound above the LP relaxation's (``_count_bound``): branch and bound on sums of
binaries that are whole in every plan, on the held relaxation.
"""
from __future__ import annotations

import heapq
import math
import time

from planner.solve.milp import Model
from planner.solve.relaxation import _HeldLP


# LP re-solves the count bound may take: before the polish (one split), and beside HiGHS's
# search (``_Rival.prove``) and beside the polish (enough to prove a plan within a gap of
# 0.5% where the plan is that close)
COUNT_LPS_FIRST = 4
COUNT_LPS = 96
# counts tried per split (strong branching), most fractional first
STRONG = 2


def _count_bound(model: Model, held: _HeldLP, lp: dict, bound: float, target: float,
                 time_limit, max_lps: int = COUNT_LPS, stop=None, counts=None) -> float:
    """A bound above the relaxation's, by branch and bound on counts: every sum of binaries
    (``Model.counts``: the units at a home in a group of alike units, the units taking an
    activation choice, the recompute segments) is a whole number in any plan, so a region
    whose relaxed count n is fractional splits into n <= floor(n) and n >= ceil(n), each
    bounded by its own relaxation (rows added to the held instance). The region with the
    lowest bound is split first (strong branching over its ``STRONG`` most fractional
    counts); the least bound over the open regions bounds every plan (``counts``: lists of
    variables, by default ``Model.counts``). Stops when that reaches ``target``, after
    ``max_lps`` LPs, at the time limit, when ``stop()`` says so, or at a region whose counts
    are all whole. A side proven infeasible holds no plan; a side the time limit stopped ends
    the search (a point is not a bound).

    Why: on joint models the relaxation lies below the best plans mostly because it spreads
    whole decisions (a fractional number of blocks with their optimizer state on the host,
    or recomputed); HiGHS's cuts do not raise that bound, and its tree takes hundreds of
    nodes, where a few dozen LPs on the counts prove a plan within the gap. Each region's
    LPs start from its parent's basis: from the last region's they take longer."""
    t0 = time.perf_counter()
    counts = [[v.name for v in vs] for vs in (model.counts() if counts is None else counts)]
    heap = [(bound, 0, (), lp, None)]
    lps, tick = 0, 1
    best = bound
    while heap:
        b, _, rows, values, basis = heap[0]
        best = max(bound, b)
        left = None if time_limit is None else time_limit - (time.perf_counter() - t0)
        if (b >= target or lps + 2 * STRONG > max_lps or (left is not None and left <= 0.05)
                or (stop is not None and stop())):
            return best
        fractional = []
        for names in counts:
            n = sum(values.get(x, 0.0) for x in names)
            f = n - math.floor(n)
            if 1e-6 < f < 1 - 1e-6:
                fractional.append((abs(f - 0.5), n, names))
        if not fractional:
            return best              # whole in every count: this region's bound is the bound
        heapq.heappop(heap)
        # strong branching: of the STRONG most fractional counts, split on the one whose
        # weaker side bounds highest (the relaxation's vertex, and so which count looks most
        # fractional, changes with the basis it starts from)
        pick = None
        for _, n, names in sorted(fractional)[:STRONG]:
            sides = []
            for lo, up in ((0.0, float(math.floor(n))),
                           (float(math.ceil(n)), float(len(names)))):
                left = None if time_limit is None else time_limit - (time.perf_counter() - t0)
                if stop is not None and stop():
                    return best          # asked between LPs too: a split takes four (0.4 s)
                side = rows + ((names, lo, up),)
                obj, got, got_basis = held.solve_with_rows(side, left, basis)
                lps += 1
                if obj is None and held.infeasible():
                    continue                    # no plan on this side
                if obj is None or not model.lp_optimal:
                    return best      # stopped early: the region split still bounds at b
                sides.append((obj, side, got, got_basis))
            weaker = min((o for o, _, _, _ in sides), default=math.inf)
            if pick is None or weaker > pick[0]:
                pick = (weaker, sides)
        for obj, side, got, got_basis in pick[1]:
            heapq.heappush(heap, (obj, tick, side, got, got_basis))
            tick += 1
    return best
