"""``plan solve`` against every plan there is, on profiles small enough to enumerate.

For each small synthetic profile every decision vector the rules allow is built with
``make_plan`` (default prefetch points) and simulated; then, over a sweep of GPU budgets, the
planner must (1) exit 3 only when no enumerated plan fits, (2) write a plan that fits and is no
slower than the best enumerated fitting plan beyond its reported gap plus TOL, and (3) never get
slower as the budget grows (within the same allowance).
"""
from __future__ import annotations

import itertools

import pytest

from planner.errors import NoFitError, UserError
from planner.formats import Activation as A, LayerDecision as LD, Tier as T
from planner.formulation import Budgets
from planner.hardware import load_hardware
from planner.plans import make_plan
from planner.simulate import simulate
from planner.solve import solve_profile
from planner.synthetic import uniform_profile

# The MILP counts a prefetch share by share where the simulator holds the whole buffer from
# its start, so its best plan can sit a little off the simulator's: the review's 4-block
# profile (seed 5) shows 0.07% (373.38 vs 373.14 ms). 0.5% leaves room for that and still
# catches the defects this file guards (they cost 2-23%: 459.2 vs 387.7 ms in the review).
TOL = 0.005
GIB = 1024**3


def _choices(hw, nvme: bool, cpu: bool):
    out = [(A.KEEP, None), (A.RECOMPUTE, T.GPU), (A.RECOMPUTE, T.NONE)]
    if cpu and not hw.unified_memory:
        out += [(A.CPU, None), (A.RECOMPUTE, T.CPU)]
    if nvme:
        out += [(A.NVME, None), (A.RECOMPUTE, T.NVME)]
    return out


def _enumerate(prof, hw, cpu_b: int, nvme_b: int):
    """(peak_gpu, step_s) of every valid plan that fits the host/NVMe budgets."""
    units = prof.layers
    blocks = [u for u in units if u.kind == "block"]
    out = []
    for combo in itertools.product(_choices(hw, nvme_b > 0, cpu_b > 0), repeat=len(blocks)):
        layers = ([LD(units[0].name, A.KEEP)] + [LD(u.name, a, c) for u, (a, c) in zip(blocks, combo)]
                  + [LD(units[-1].name, A.KEEP)])
        try:
            p = make_plan(prof, None, hw, {"gpu_bytes": 10**15, "cpu_bytes": cpu_b,
                                           "nvme_bytes": nvme_b}, "x", layers)
        except UserError:   # e.g. 'none' right after a non-recompute unit
            continue
        pr = p.predicted
        if pr["peak_cpu_bytes"] <= cpu_b and pr["peak_nvme_bytes"] <= nvme_b:
            out.append((pr["peak_gpu_bytes"], pr["step_s"]))
    return out


CASES = [
    # (blocks, hardware, seed, jitter, host budget, nvme budget, fwd_s)
    (4, "h200", 5, 0.3, 512 * GIB, 0, 20e-3),          # the review's profile
    # With 7 ms forwards a block's transfer spans stages and the fast MILP splits a prefetch
    # over distant stages that no single issue point reproduces (150.1 vs 143.3 ms best):
    # solve.py's escalation to the exact prefetch-start model finds the best plan.
    (4, "h200", 1, 0.3, 512 * GIB, 0, 7e-3),
    # Known open defect (strict xfail, so a fix shows): the best plan offloads two 1.1-1.4 GB
    # blocks whose copies run on into the backward (the simulator lets them); the MILP ends
    # every offload in the forward, so it calls that plan infeasible and writes a slower one.
    pytest.param(3, "h200", 2, 0.2, 512 * GIB, 64 * GIB, 10e-3, marks=pytest.mark.xfail(
        strict=True, reason="MILP offloads end in the forward; the simulator's may not (open)")),
    (3, "cpu-host", 3, 0.2, 0, 64 * GIB, 50e-3),       # unified memory, NVMe only
]


@pytest.mark.parametrize("n,hwname,seed,jitter,cpu_b,nvme_b,fwd", CASES)
def test_solve_matches_exhaustive_search(n, hwname, seed, jitter, cpu_b, nvme_b, fwd):
    hw = load_hardware(hwname)
    prof = uniform_profile(n, hw, jitter=jitter, seed=seed, fwd_s=fwd)
    plans = _enumerate(prof, hw, cpu_b, nvme_b)
    assert plans, "keep-all always fits unbounded GPU memory"
    peaks = sorted({g for g, _ in plans})
    # every 'just fits' budget (a peak), one byte under the smallest, and one in between
    budgets = [peaks[0] - 1] + peaks[:: max(1, len(peaks) // 10)] + [peaks[-1]]
    budgets = sorted(set(budgets + [(peaks[0] + peaks[-1]) // 2]))
    prev = None   # (budget, step, allowance)
    for g in budgets:
        best = min((s for pk, s in plans if pk <= g), default=None)
        try:
            out = solve_profile(prof, None, hw, Budgets(g, cpu_b, nvme_b), "optimal",
                                time_limit=30, gap=0.01)
        except NoFitError:
            assert best is None, f"exit 3 at --gpu-mem {g} B, but a plan fits at {best * 1e3:.2f} ms"
            assert prev is None, "a larger budget must not lose a plan a smaller one had"
            continue
        r = simulate(out.plan)
        assert r.fits and r.peak_gpu_bytes <= g
        assert best is not None, "the planner wrote a plan no enumerated plan matches"
        gap = out.plan.solver.get("gap")
        allow = (gap if gap is not None else 0.01) + TOL
        assert r.step_s <= best * (1 + allow), (
            f"--gpu-mem {g} B: wrote {r.step_s * 1e3:.3f} ms, best fitting plan "
            f"{best * 1e3:.3f} ms (allowed {allow:.2%})")
        if prev is not None:
            assert r.step_s <= prev[1] * (1 + max(allow, prev[2])), (
                f"step rose from {prev[1] * 1e3:.3f} ms at {prev[0]} B to {r.step_s * 1e3:.3f} "
                f"ms at {g} B")
        prev = (g, r.step_s, allow)
