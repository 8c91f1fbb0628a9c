"""Solver scaling: depth 12..192 -> solve seconds, variables, constraints, gap, for CBC and HiGHS.

Synthetic near-uniform chains (design brief calibration: 7 ms forward, 1.27 GB saved per block,
2% jitter) on the h200 spec, GPU budget = static + embedding + head + workspace + half of the
blocks' saved bytes, 512 GiB host. Usage: ``python bench/solver.py [--depths 12,24,48,96,192]
[--solvers cbc,highs] [--time-limit 120] [--end-to-end]``; prints a markdown table.

The default times the fast MILP alone. ``--end-to-end`` times what ``plan solve`` does: the
baselines, the MILP, the prefetch placement, the escalation to the exact prefetch model when the
fast plan misses the simulator by more than 2%, and the final simulation; it prints the MILP's
objective beside the simulated step of the plan it writes.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

# bench/profile.py would shadow the standard library's ``profile`` (which torch imports) when
# this script runs as ``python bench/...``: drop the script's own folder from the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import time

from planner.budget import fraction_budget
from planner.errors import NoFitError
from planner.formulation import Budgets, Formulation, Infeasible, run_solver
from planner.hardware import load_hardware
from planner.solve import solve_profile
from planner.synthetic import uniform_profile

warnings.filterwarnings("ignore", category=DeprecationWarning)


def end_to_end(n: int, solver: str, hw, time_limit: float) -> str:
    p = uniform_profile(n, hw, jitter=0.02, seed=n)
    b = Budgets(fraction_budget(p, 0.5), 512 * 1024**3, 0)
    comp = sum(u.fwd_s + u.bwd_s for u in p.layers)
    t0 = time.perf_counter()
    try:
        plan = solve_profile(p, None, hw, b, "optimal", solver=solver, time_limit=time_limit).plan
    except NoFitError as e:
        return f"| {n} | {solver} | {time.perf_counter() - t0:.2f} | no fit: {e} | | | |"
    wall = time.perf_counter() - t0
    obj, step = plan.solver.get("objective"), plan.predicted["step_s"]
    agree = "-" if obj is None else f"{obj / step - 1:+.2%}"
    return (f"| {n} | {solver} | {wall:.2f} | {plan.solver['status']} | {step / comp:.4f} | "
            f"{agree} | {plan.solver['gap']:.2%} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--depths", default="12,24,48,96,192")
    ap.add_argument("--solvers", default="cbc,highs")
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--end-to-end", action="store_true", help="time plan solve's whole work")
    args = ap.parse_args(argv)
    hw = load_hardware(args.hardware)
    if args.end_to_end:
        print("| blocks | solver | plan solve s | status | simulated step / compute-only | "
              "MILP objective vs simulated | gap |")
        print("|---:|---|---:|---|---:|---:|---:|")
        for n in [int(x) for x in args.depths.split(",")]:
            for s in args.solvers.split(","):
                print(end_to_end(n, s, hw, args.time_limit), flush=True)
        return 0
    print("| blocks | solver | solve s | status | gap | variables | constraints | step / compute-only |")
    print("|---:|---|---:|---|---:|---:|---:|---:|")
    for n in [int(x) for x in args.depths.split(",")]:
        p = uniform_profile(n, hw, jitter=0.02, seed=n)
        b = Budgets(fraction_budget(p, 0.5), 512 * 1024**3, 0)
        comp = sum(u.fwd_s + u.bwd_s for u in p.layers)
        for s in args.solvers.split(","):
            f = Formulation(p.layers, hw, b)
            try:
                r = run_solver(f, s, args.time_limit, 0.01)
            except Infeasible as e:
                print(f"| {n} | {s} | - | infeasible ({e}) | | | | |")
                continue
            gap = "-" if r.gap is None else f"{r.gap:.2%}"
            print(f"| {n} | {s} | {r.solve_s:.2f} | {r.status} | {gap} | {r.variables} | "
                  f"{r.constraints} | {r.objective / comp:.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
