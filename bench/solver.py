"""Solver scaling: depth 12..192 -> solve seconds, variables, constraints, gap, for CBC and HiGHS.

Synthetic near-uniform chains (design brief calibration: 7 ms forward, 1.27 GB saved per block,
2% jitter) on the h200 spec, GPU budget = static + embedding + head + workspace + half of the
blocks' saved bytes, 512 GiB host. Usage: ``python bench/solver.py [--depths 12,24,48,96,192]
[--solvers cbc,highs] [--time-limit 120]``; prints a markdown table.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

# bench/profile.py would shadow the standard library's ``profile`` (which torch imports) when
# this script runs as ``python bench/...``: drop the script's own folder from the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from planner.formulation import Budgets, Formulation, Infeasible, run_solver
from planner.hardware import load_hardware
from planner.synthetic import uniform_profile

warnings.filterwarnings("ignore", category=DeprecationWarning)


def half_budget(p) -> int:
    blocks = sum(u.activation_bytes for u in p.layers if u.kind == "block")
    fixed = (p.static_bytes + p.layers[0].activation_bytes + p.layers[-1].activation_bytes
             + max(u.workspace_bytes for u in p.layers))
    return int(fixed + blocks / 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--depths", default="12,24,48,96,192")
    ap.add_argument("--solvers", default="cbc,highs")
    ap.add_argument("--time-limit", type=float, default=120.0)
    ap.add_argument("--hardware", default="h200")
    args = ap.parse_args(argv)
    hw = load_hardware(args.hardware)
    print("| blocks | solver | solve s | status | gap | variables | constraints | step / compute-only |")
    print("|---:|---|---:|---|---:|---:|---:|---:|")
    for n in [int(x) for x in args.depths.split(",")]:
        p = uniform_profile(n, hw, jitter=0.02, seed=n)
        b = Budgets(half_budget(p), 512 * 1024**3, 0)
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
