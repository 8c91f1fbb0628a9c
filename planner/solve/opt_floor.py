"""The optimizer phase's floor over whole units (``opt_floor_int``, the MILP's row
``timeo_int``), and the groups of units alike in every home (``home_groups``) that it and
the count bound's home counts are built on. Read from the cost model alone, without a MILP.
"""
from __future__ import annotations

from planner.costmodel import CostModel, View
from planner.solve.highs import available as highs_available, quiet as _quiet_highs


class _HomeTags(View):
    """A view whose home variables are their own (unit, home) indices: reads the optimizer
    phase's coefficients out of the cost model without building a model."""

    def h(self, i, k):
        return (i, k)


# seconds the integer optimizer floor may search (its proven bound is valid wherever it stops)
OPT_FLOOR_S = 0.2


def _opt_coefficients(cm: CostModel):
    """The optimizer phase per (unit, home): the number of resources, {(j, k): seconds on each
    resource}, {(j, k): its chain}."""
    tags = _HomeTags()
    loads = [t for t in cm.opt_loads(tags).values() if t]
    chain = {jk: c for terms in cm.opt_chains(tags) for jk, c in terms}
    coef = {}
    for r, terms in enumerate(loads):
        for jk, c in terms:
            coef.setdefault(jk, [0.0] * len(loads))[r] += c
    return len(loads), coef, chain


def home_groups(cm: CostModel, coefficients=None) -> list:
    """Units alike in every home (the same optimizer-phase seconds and the same bytes held on
    each tier), as lists of unit indices: a model's blocks are usually one group.
    ``coefficients``: ``_opt_coefficients(cm)`` where the caller has them already."""
    n, coef, chain = coefficients or _opt_coefficients(cm)
    groups: dict = {}
    for j in range(cm.U):
        sig = tuple((tuple(coef.get((j, k), [0.0] * n)), chain.get((j, k), 0.0),
                     tuple(sorted(cm.resident(j, h).items()))) for k, h in enumerate(cm.homes[j]))
        groups.setdefault(sig, []).append(j)
    return list(groups.values())


def opt_floor_int(cm: CostModel) -> float | None:
    """A lower bound on the pipelined optimizer phase (depth 3) over whole units: the least,
    over integer homes, of max(busiest resource, longest chain). The LP relaxation balances
    host against device steps with fractions of units, which no plan can (on a joint model
    the relaxed phase can be 8% shorter than the best plan's, half the root gap). Units with
    the same coefficients in every home form one group with an integer count per home, so
    the MIP has a few columns per distinct unit; HiGHS solves it within ``OPT_FLOOR_S`` and
    its proven bound is returned. None with depth 1 (the sum of chains: the relaxation is
    already integral), where no unit has a choice of home, or without highspy."""
    if cm.opt_depth == 1 or not any(len(h) > 1 for h in cm.homes):
        return None
    if not highs_available():
        return None
    import highspy
    coefficients = _opt_coefficients(cm)
    nres, coef, chain = coefficients
    # in units of the largest coefficient: HiGHS' tolerances are absolute (1e-7 .. 1e-6), and
    # a phase of 10 us in seconds would sit inside them
    unit = max([c for v in coef.values() for c in v] + list(chain.values()) + [0.0])
    if unit <= 0:
        return None
    groups = {}                             # per-home coefficients -> how many units have them
    for units in home_groups(cm, coefficients):
        j = units[0]
        sig = tuple((tuple(c / unit for c in coef.get((j, k), [0.0] * nres)),
                     chain.get((j, k), 0.0) / unit) for k in range(len(cm.homes[j])))
        groups[sig] = groups.get(sig, 0) + len(units)
    h = _quiet_highs()
    for opt, val in (("output_flag", False), ("time_limit", OPT_FLOOR_S),
                     ("mip_rel_gap", 0.0), ("mip_abs_gap", 0.0), ("threads", 1)):
        h.setOptionValue(opt, val)
    inf, integer = highspy.kHighsInf, highspy.HighsVarType.kInteger

    def column(lo, hi, cost=0.0, is_int=True):
        h.addVar(lo, hi)
        c = h.getNumCol() - 1
        if cost:
            h.changeColCost(c, cost)
        if is_int:
            h.changeColIntegrality(c, integer)
        return c

    T = column(0.0, inf, 1.0, is_int=False)     # min T
    rows = [[] for _ in range(nres)]             # T >= Σ coef_r n      per resource r
    for sig, n in groups.items():
        counts = []
        for res, ch in sig:
            c = column(0.0, float(n))            # n_{g,k}: units of group g at home k
            counts.append(c)
            for r, x in enumerate(res):
                if x:
                    rows[r].append((c, x))
            if ch:
                u = column(0.0, 1.0)             # u_{g,k} >= n_{g,k} / N_g, T >= chain u
                h.addRow(0.0, inf, 2, [u, c], [float(n), -1.0])
                h.addRow(0.0, inf, 2, [T, u], [1.0, -ch])
        h.addRow(float(n), float(n), len(counts), counts, [1.0] * len(counts))
    for terms in rows:
        h.addRow(0.0, inf, len(terms) + 1, [T] + [c for c, _ in terms],
                 [1.0] + [-x for _, x in terms])
    h.run()
    bound = h.getInfo().mip_dual_bound
    if not (0.0 < bound < inf):
        return None
    return bound * unit * (1 - 1e-6)      # a hair below what it proved: HiGHS' tolerances
