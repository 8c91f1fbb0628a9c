"""``plan solve`` against every plan there is, on profiles small enough to enumerate.

A plan is its decisions (per unit: activation choice and home) and the shares of every
transfer. For each decision vector the rules allow, the best shares are an LP (the MILP with
its binaries fixed, ``exhaustive``); the smallest GPU budget it fits in is another LP.
Enumerating decision vectors therefore gives the true optimum of the plan space, and the
planner must (1) write a plan no slower than it beyond its gap, (2) exit 3 only when nothing
fits, naming a budget within 0.5% above the true minimum.
"""
from __future__ import annotations

import random

import pytest

from planner.errors import NoFitError
from exhaustive import best_plan, smallest_budget
from planner.formats import Budgets
from planner.hardware import load_hardware
from planner.solve import solve_profile
from synthetic import random_profile

GAP = 0.005


def _case(seed, spec, n_blocks, stream):
    hw = load_hardware(spec)
    prof = random_profile(seed, hw, n_blocks=n_blocks)
    cpu = 0 if hw.unified_memory else 10**12
    return hw, prof, cpu, stream


# Streaming multiplies each block's options by its homes (8 on cpu-host, 13 on a CUDA host):
# one block is fast; two on cpu-host take ~45 s (slow); bench/promises.py runs the large sweep.
CASES = [(1, "a100-80g", 2, "off"), (2, "cpu-host", 3, "off"),
         pytest.param(3, "h100-80g", 3, "off", marks=pytest.mark.slow),
         (4, "cpu-host", 1, "on"), pytest.param(5, "rtx4090", 1, "on", marks=pytest.mark.slow),
         pytest.param(6, "cpu-host", 2, "on", marks=pytest.mark.slow)]


@pytest.mark.parametrize("seed,spec,n,stream", CASES)
def test_plan_solve_matches_enumeration(seed, spec, n, stream, tmp_path):
    hw, prof, cpu, stream = _case(seed, spec, n, stream)
    nvme = 10**13
    true_min = smallest_budget(prof, hw, Budgets(0, cpu, nvme), stream=stream)
    assert true_min is not None
    # exit 3 below the minimum, naming a budget at most 0.5% above it that then fits
    with pytest.raises(NoFitError) as e:
        solve_profile(prof, None, hw, Budgets(int(true_min * 0.97), cpu, nvme), stream=stream,
                      time_limit=60, nvme_dir=str(tmp_path))
    named = e.value.needed_bytes
    assert true_min <= named <= true_min * 1.005 + 16384
    rng = random.Random(seed)
    for g in [named, int(named * rng.uniform(1.0, 1.3)), int(named * 2)]:
        b = Budgets(g, cpu, nvme)
        out = solve_profile(prof, None, hw, b, stream=stream, time_limit=60, gap=GAP,
                            nvme_dir=str(tmp_path))
        best = best_plan(prof, hw, b, stream=stream)
        assert out.sim.fits
        assert out.sim.step_s <= best * (1 + GAP) + 1e-12, (g, out.sim.step_s, best)
        assert out.sim.step_s >= best * (1 - 1e-6)     # nothing beats the enumeration
