"""Whole choices from the LP relaxation's fractional ones, unit by unit along the chain
(``_Rounder``, ``_unit_by_unit``), over the one-of groups of binaries of each unit
(``_groups``).
"""
from __future__ import annotations

import itertools

from planner.costmodel import REC
from planner.solve.milp import Model


def _groups(model: Model) -> list[tuple[list, list]]:
    """Per unit, its groups of one-of binaries: (keys, variables) for the activation choice
    and for the home, each only where there is a choice."""
    out = []
    for i in range(model.cm.U):
        g = []
        xs = [(c, v) for c, v in model.xv[i].items() if not isinstance(v, int)]
        if xs:
            g.append(("x", xs))
        hs = [(k, v) for k, v in enumerate(model.hv[i]) if not isinstance(v, int)]
        if hs:
            g.append(("h", hs))
        out.append(g)
    return out


class _Rounder:
    """Whole choices that follow the LP relaxation's fractional ones along the chain.

    The relaxation typically spreads a choice thinly (offload 30% of each of 40 blocks); any
    whole plan must instead take it for some units. Going along the units, each takes the
    choice whose running LP total most exceeds how often it was taken so far (the
    'chairman assignment'), so that at every prefix the count of each choice stays within one
    of the LP's: the chosen units end up evenly spaced, as links and memory want them.
    ``offset`` starts the running totals at different fractions, giving other evenly spaced
    picks. The state carries over from one batch of units to the next."""

    def __init__(self, model: Model, offset: float):
        self.model = model
        self.offset = offset
        self.deficit: dict = {}
        self.prev = None
        self.run = 0
        self.groups = _groups(model)

    def save(self):
        return dict(self.deficit), self.prev, self.run

    def restore(self, state) -> None:
        deficit, self.prev, self.run = state
        self.deficit = dict(deficit)

    def took(self, i: int, keys: dict) -> None:
        """Unit i was fixed to ``keys`` ({'x': choice, 'h': home index}) by someone else:
        keep the chain's state (the running segment) as if the rounder had chosen them."""
        x = keys.get("x", next(iter(self.model.xv[i])))
        self.run = self.run + 1 if x == "rz" else 0
        self.prev = x
        for kind, key in keys.items():
            self.deficit[(kind, key)] = self.deficit.get((kind, key), 0.0) - 1.0

    def round(self, units, lp: dict) -> dict:
        m = self.model
        wseg = m.cm.windows.seg
        fixed = {}
        for i in units:
            home = None
            groups = self.groups[i]
            for kind, items in groups:
                # only what the relaxation gives this unit is a candidate, and what it gives
                # whole is taken: the running totals only space out what it spreads (a total
                # carried from other units would otherwise override a whole choice of the LP
                # and place a choice where the LP has none); ``_polish`` follows where the
                # plan is not within the gap
                vals = [lp.get(var.name, 0.0) for _, var in items]
                whole = max(vals) > 1 - 1e-6
                allowed, given = [], []
                for n, (key, var) in enumerate(items):
                    d = self.deficit.get((kind, key), (self.offset * (n + 1)) % 1.0) + vals[n]
                    self.deficit[(kind, key)] = d
                    if kind == "x" and key == "rz" and (self.prev not in REC or self.run >= wseg - 1):
                        continue        # none follows a recompute unit; segments <= w_seg
                    allowed.append((d, n, key, var))
                    if vals[n] > (1 - 1e-6 if whole else 1e-6):
                        given.append((d, n, key, var))
                # what the relaxation gives may not follow the units fixed before: then any
                # allowed choice, by its running total (first on ties)
                _, _, key, var = max(given or allowed, key=lambda t: (t[0], -t[1]))
                self.deficit[(kind, key)] -= 1.0
                for _, v2 in items:
                    fixed[v2.name] = 1 if v2 is var else 0
                if kind == "h":
                    home = key
                else:
                    self.run = self.run + 1 if key == "rz" else 0
                    self.prev = key
            if not any(k == "x" for k, _ in groups):
                self.prev, self.run = next(iter(m.xv[i])), 0
            # a unit whose weights stream is recomputed only alone (c_streamed_segments)
            if home is not None and m.cm.homes[i][home].streams_weights and self.prev == "rz":
                fixed[m.xv[i]["rz"].name] = 0
                fixed[m.xv[i]["rg"].name] = 1
                self.prev, self.run = "rg", 0
        return fixed


def _unit_by_unit(r: _Rounder, units, fixed: dict, cur: dict, relax, over):
    """Fix ``units`` one at a time: each as the rounder rounds it, or, where that does not
    fit, the first of its other choice combinations (by the LP's values) that does. Returns
    (fixed, objective, values), objective None when some unit has no choice that fits."""
    obj = values = None
    for i in units:
        if over():
            return fixed, None, None
        state = r.save()
        trial = dict(fixed, **r.round([i], cur))
        obj, values = relax(trial)
        if obj is None:
            r.restore(state)
            groups = r.groups[i]
            combos = sorted(itertools.product(*[items for _, items in groups]),
                            key=lambda c: -sum(cur.get(v.name, 0.0) for _, v in c))
            for combo in combos:
                if over():
                    return fixed, None, None
                pick = {}
                for (kind, items), (key, var) in zip(groups, combo):
                    pick.update({v.name: int(v is var) for _, v in items})
                trial = dict(fixed, **pick)
                obj, values = relax(trial)
                if obj is not None:
                    r.took(i, dict(zip((k for k, _ in groups), (key for key, _ in combo))))
                    break
            if obj is None:
                return fixed, None, None
        fixed, cur = trial, values
    return fixed, obj, values
