"""Solver scaling: solve seconds, size, gap, and MILP objective against the simulated step,
across depths, for CBC and HiGHS.

Cases: synthetic near-uniform chains (``synthetic.uniform_profile``, design brief
calibration: 7 ms forward, 1.27 GB saved per block, 2% jitter) on the h200 spec at each of
``--depths``, and built-in models profiled on the meta device (``--models``, default gpt2-xl at
b=8, s=1024 on a100-80g). GPU budget = ``planner.solve.budget.fraction_budget(profile, 0.5)`` (static
+ embedding + head + workspace + shared + half of the blocks' saved bytes + the spec's
reserve), ``--cpu-mem`` 512 GiB, no NVMe.

    python bench/solver.py                               # the MILP alone, a few minutes
    python bench/solver.py --depths 12,24,48,96,192 --time-limit 120
    python bench/solver.py --end-to-end                  # what plan solve does
    python bench/solver.py --end-to-end --depths 48,96,192 --fractions 0.25,0.5 --solvers highs

The default times one MILP: the activation-only model ``plan solve`` always runs
(``solve_profile``'s ``milp-act``: every tensor class at home on the device), built from
``planner.plans.cost_model`` and solved by ``planner.solve.solvers.solve`` with the GPU budget less
``MARGIN_BYTES``, as ``plan solve`` does. Its plan is then built and simulated
(``plan_and_sim``): the MILP and the simulator evaluate the same cost model, so the objective
should equal the simulated step; the column says by how much it does not. ``--joint`` times the
joint model (homes off the device allowed) instead.

``--end-to-end`` times ``solve_profile`` (``plan solve`` without reading and writing files):
baselines, the activation-only MILP, the joint MILP when it may pay, the pick; it prints the
winning strategy, the simulated step and the MILP objective beside it.

Prints markdown tables. "compute-only" = ``plan.predicted.compute_s`` (forward and backward of
every unit plus the optimizer at device speed).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/profile.py and bench/runtime.py would shadow the standard library's ``profile`` and
# the runtime package: import from the repository root, never from bench/
sys.path[:] = [str(ROOT), str(ROOT / "tests")] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from planner.solve import solvers  # noqa: E402
from planner.solve.budget import fraction_budget  # noqa: E402
from planner.errors import NoFitError, UserError  # noqa: E402
from planner.formats import Budgets  # noqa: E402
from planner.hardware import load_hardware  # noqa: E402
from planner.solve.milp import Model  # noqa: E402
from planner.plans import cost_model, plan_and_sim  # noqa: E402
from planner.solve import MARGIN_BYTES, solve_profile  # noqa: E402
from synthetic import uniform_profile  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)
GiB = 1024**3


def cases(args):
    """(label, profile, hw) for every synthetic depth and built-in model asked for."""
    hw = load_hardware(args.hardware)
    for n in [int(x) for x in args.depths.split(",") if x]:
        yield f"synthetic {n}", uniform_profile(n, hw, jitter=0.02, seed=n), hw
    for spec in [m for m in args.models.split(",") if m]:
        parts = spec.split(":")
        name, b, s, hw_name = parts + [None, "8", "1024", "a100-80g"][len(parts):]
        from planner.profile import profile_model
        mhw = load_hardware(hw_name)
        p = profile_model(name, int(b), int(s), device="meta", hardware=mhw)
        yield f"{name} b{b} s{s} {hw_name}", p, mhw


def blocks(p) -> int:
    return sum(u.kind == "block" for u in p.layers)


def milp_alone(label, p, hw, solver, time_limit, gap, joint) -> str:
    b = Budgets(fraction_budget(p, 0.5), 512 * GiB, 0)
    tight = dataclasses.replace(b, gpu_bytes=b.gpu_bytes - MARGIN_BYTES)
    t0 = time.perf_counter()
    cm = cost_model(p, hw, tight, allow_streaming=joint)
    m = Model(cm)
    build = time.perf_counter() - t0
    try:
        out = solvers.solve(m, solver, time_limit, gap)
    except (solvers.Infeasible, solvers.NoIncumbent) as e:
        return f"| {label} | {blocks(p)} | {solver} | {build:.2f} | - | {type(e).__name__} | | | | | | |"
    plan, r = plan_and_sim(p, None, hw, b, "optimal", out.solution.layers,
                           shares=out.solution.shares, cm=cost_model(p, hw, b, allow_streaming=joint))
    comp = plan.predicted.compute_s
    obj = out.solution.objective
    g = "-" if out.gap is None else f"{out.gap:.2%}"
    fits = "" if r.fits else " (does not fit!)"
    return (f"| {label} | {blocks(p)} | {solver} | {build:.2f} | {out.solve_s:.2f} | {out.status} | "
            f"{g} | {out.variables} | {out.constraints} | {obj / comp:.4f} | "
            f"{r.step_s / comp:.4f}{fits} | {obj / r.step_s - 1:+.3%} |")


def end_to_end(label, p, hw, solver, time_limit, gap, fraction=0.5) -> str:
    b = Budgets(fraction_budget(p, fraction), 512 * GiB, 0)
    label = f"{label} @{fraction:g}"
    t0 = time.perf_counter()
    try:
        o = solve_profile(p, None, hw, b, "optimal", solver=solver, time_limit=time_limit, gap=gap)
    except NoFitError as e:
        return f"| {label} | {blocks(p)} | {solver} | {time.perf_counter() - t0:.2f} | no fit: {e} | | | | | |"
    except UserError as e:       # plan solve's exit 2 (a solver that failed, for one)
        return (f"| {label} | {blocks(p)} | {solver} | {time.perf_counter() - t0:.2f} | "
                f"error (exit 2): {str(e).replace('|', '/')} | | | | | |")
    wall = time.perf_counter() - t0
    plan = o.plan
    comp = plan.predicted.compute_s
    step = o.sim.step_s
    obj = o.milp_objective
    agree = "-" if obj is None else f"{obj / step - 1:+.3%}"
    g = "-" if plan.solver.gap is None else f"{plan.solver.gap:.2%}"
    # the best baseline, for comparison
    base = [v[0] for k, v in o.tried.items() if k.startswith("baseline") and v[1]]
    best_base = f"{min(base) / comp:.4f}" if base else "-"
    return (f"| {label} | {blocks(p)} | {solver} | {wall:.2f} | {plan.solver.origin} | "
            f"{plan.solver.status} | {step / comp:.4f} | {best_base} | {agree} | {g} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--depths", default="12,24,48,96", help="synthetic chain depths")
    ap.add_argument("--models", default="gpt2-xl:8:1024:a100-80g",
                    help="built-in models as NAME[:BATCH[:SEQ[:HARDWARE]]], comma-separated")
    ap.add_argument("--solvers", default="cbc,highs")
    ap.add_argument("--time-limit", type=float, default=30.0)
    ap.add_argument("--gap", type=float, default=0.005, help="relative gap (plan solve's default)")
    ap.add_argument("--hardware", default="h200", help="spec of the synthetic chains")
    ap.add_argument("--joint", action="store_true",
                    help="time the joint MILP (homes off the device allowed)")
    ap.add_argument("--end-to-end", action="store_true", help="time plan solve's whole work")
    ap.add_argument("--fractions", default="0.5",
                    help="end to end: GPU budgets as fractions of the blocks' activations "
                         "(planner.solve.budget.fraction_budget), comma-separated")
    args = ap.parse_args(argv)
    names = [s for s in args.solvers.split(",") if s]
    if "highs" in names and not solvers.highs_available():
        print("highspy is not installed: HiGHS rows skipped", file=sys.stderr)
        names.remove("highs")
    if args.end_to_end:
        print("| case | blocks | solver | plan solve s | origin | status | simulated step / "
              "compute-only | best baseline | MILP objective vs simulated | gap |")
        print("|---|---:|---|---:|---|---|---:|---:|---:|---:|")
        for label, p, hw in cases(args):
            for f in (float(x) for x in args.fractions.split(",") if x):
                for s in names:
                    print(end_to_end(label, p, hw, s, args.time_limit, args.gap, f), flush=True)
        return 0
    print(f"{'joint' if args.joint else 'activation-only'} MILP, gap {args.gap:g}, "
          f"time limit {args.time_limit:g} s")
    print("| case | blocks | solver | build s | solve s | status | gap | variables | constraints "
          "| objective / compute-only | simulated / compute-only | objective vs simulated |")
    print("|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for label, p, hw in cases(args):
        for s in names:
            print(milp_alone(label, p, hw, s, args.time_limit, args.gap, args.joint), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
