"""The true optimum of a small profile's plan space, by enumeration (tests and benchmarks).

A plan is its decisions (per unit: activation choice and home) and the shares of every
transfer. For fixed decisions the best shares are a linear program: the MILP of
``planner.solve.milp`` with those binaries fixed. Enumerating the blocks' decisions, and solving each
(the embedding's and head's homes left to the solver, at gap 0), gives the best step under a
budget, and the smallest GPU budget any plan fits in; both optimizer depths where homes can
leave the device. Exponential in the number of blocks:
meant for two or three.
"""
from __future__ import annotations

import itertools
import math

from planner.costmodel import REC
from planner.formats import Budgets, Profile, UnitKind
from planner.solve.milp import GB, Model, Options
from planner.plans import cost_model
from planner.solve.outcome import Infeasible
from planner.solve.runner import _run


def _vectors(cm):
    """Per block (choice, home index) combinations in order, skipping what the rules forbid
    (``none`` only after a recompute unit, streamed units recomputed only alone)."""
    blocks = [i for i, u in enumerate(cm.units) if u.kind == UnitKind.BLOCK.value]
    opts = [[(c, k) for c in cm.choices[i] for k in range(len(cm.homes[i]))] for i in blocks]
    for combo in itertools.product(*opts):
        ok = True
        prev = None
        for (c, k), i in zip(combo, blocks):
            streams = cm.homes[i][k].streams_weights
            if c == "rz" and (prev is None or prev[0] not in REC or prev[1] or streams):
                ok = False
                break
            prev = (c, streams)
        if ok:
            yield dict(zip(blocks, combo))


def _fix(m: Model, vec: dict):
    saved = []
    for i, (c, k) in vec.items():
        for cc, var in m.xv[i].items():
            if not isinstance(var, int):
                saved.append((var, var.lowBound, var.upBound))
                var.lowBound = var.upBound = 1 if cc == c else 0
        for kk, var in enumerate(m.hv[i]):
            if not isinstance(var, int):
                saved.append((var, var.lowBound, var.upBound))
                var.lowBound = var.upBound = 1 if kk == k else 0
    return saved


def _solve_each(m: Model, cm, value):
    best = math.inf
    for vec in _vectors(cm):
        saved = _fix(m, vec)
        try:
            _, obj, _ = _run(m, "highs", None, 0.0)
            if obj is not None:
                best = min(best, value())
        except Infeasible:
            pass
        finally:
            for v, lo, up in saved:
                v.lowBound, v.upBound = lo, up
    return best


def _models(prof, hw, budgets, stream, micro_batches):
    """One cost model per optimizer depth and schedule the planner may choose (depth 1 and
    the optimizer overlapped with the backward, under its default --clip global, matter only
    where a unit's home can leave the device)."""
    cm = cost_model(prof, hw, budgets, micro_batches, allow_streaming=stream != "off")
    yield cm
    if any(len(h) > 1 for h in cm.homes):
        for depth, overlap in ((1, "after-backward"), (3, "overlapped"), (1, "overlapped")):
            yield cost_model(prof, hw, budgets, micro_batches, allow_streaming=stream != "off",
                             optimizer_depth=depth, optimizer_overlap=overlap)


def best_plan(prof: Profile, hw, budgets: Budgets, stream: str = "on",
              micro_batches: int = 1) -> float:
    """The shortest step of any plan that fits ``budgets`` (inf if none does)."""
    best = math.inf
    for cm in _models(prof, hw, budgets, stream, micro_batches):
        m = Model(cm)
        best = min(best, _solve_each(m, cm, m.step_s))
    return best


def smallest_budget(prof: Profile, hw, budgets: Budgets, stream: str = "on",
                    micro_batches: int = 1) -> int | None:
    """The smallest GPU budget any plan fits in, with ``budgets``' host and NVMe (None if no
    GPU budget does); it includes the spec's reserve."""
    g = math.inf
    for cm in _models(prof, hw, budgets, stream, micro_batches):
        m = Model(cm, Options(minimise="gpu"))
        g = min(g, _solve_each(m, cm, lambda: float(m.Gvar.value())))
    return None if math.isinf(g) else int(math.ceil(g * GB)) + int(hw.reserved_bytes)
