"""PuLP expressions from the cost model's terms (``lin``) and the MILP's memory unit (``GB``),
shared by the MILP's row builders."""
from __future__ import annotations

import pulp

GB = 1e9   # the MILP counts memory in GB (its rows' coefficients stay near 1)


def lin(terms, scale: float = 1.0, constant: float = 0.0) -> pulp.LpAffineExpression:
    """A PuLP expression from cost-model terms ``(value, coef)`` where value is a variable or a
    number; repeated variables are summed (pulp's own constructor keeps the last)."""
    e = pulp.LpAffineExpression(constant=constant)
    for v, c in terms:
        if isinstance(v, (int, float)):
            e.constant += v * c * scale
        else:
            e.addterm(v, c * scale)
    return e
