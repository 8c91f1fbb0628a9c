"""Plan quality: step time / compute-only per policy over GPU-budget sweeps.

Profiles come from ``planner.profiler.profile_model(..., device="meta")`` (shapes and FLOPs,
times estimated from the spec). Columns: the MILP (``optimal``), ``remat-only`` (the MILP with
offloading disabled), torch's knapsack (``dp_knapsack`` on the blocks: keep the set with the
largest forward time whose activations fit, recompute the rest with a GPU checkpoint; judged by
our simulator since it ignores the backward peak), and the four baselines. "-" = does not fit.
The GPU budget is ``planner.budget.fraction_budget``: static + embedding + head + workspace +
shared + F x the blocks' saved bytes. Usage: ``python bench/quality.py [--quick]``.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

# bench/profile.py would shadow the standard library's ``profile`` (which torch imports) when
# this script runs as ``python bench/...``: drop the script's own folder from the path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from planner.baselines import BASELINES
from planner.budget import fraction_budget
from planner.errors import NoFitError
from planner.formats import Activation, LayerDecision, Tier
from planner.formulation import Budgets
from planner.hardware import load_hardware
from planner.simulate import simulate
from planner.solve import evaluate_baselines, solve_profile

warnings.filterwarnings("ignore", category=DeprecationWarning)
GiB = 1024**3


def knapsack_layers(profile, budget: int) -> list[LayerDecision]:
    """torch's dp_knapsack on the blocks: memory normalised to sum 1 (it quantises by 1e4)."""
    from torch._functorch._activation_checkpointing.knapsack import dp_knapsack
    units = profile.layers
    blocks = [i for i, u in enumerate(units) if u.kind == "block"]
    total = sum(units[i].activation_bytes for i in blocks)
    room = budget - fraction_budget(profile, 0.0) - sum(units[i].input_bytes for i in blocks)
    room = max(0.0, min(1.0, room / total))
    mem = [units[i].activation_bytes / total for i in blocks]
    run = [units[i].fwd_s for i in blocks]
    _, keep, _ = dp_knapsack(mem, run, room)
    kept = {blocks[k] for k in keep}
    out = []
    for i, u in enumerate(units):
        if u.kind != "block" or i in kept:
            out.append(LayerDecision(u.name, Activation.KEEP))
        else:
            out.append(LayerDecision(u.name, Activation.RECOMPUTE, Tier.GPU))
    return out


def row(profile, hw, budget: int, cpu: int, time_limit: float) -> dict:
    from planner.plans import make_plan
    b = Budgets(budget, cpu, 0)
    out = {}
    comp = sum(u.fwd_s + u.bwd_s for u in profile.layers) + profile.optimizer_s
    for pol in ("optimal", "remat-only"):
        try:
            o = solve_profile(profile, None, hw, b, pol, time_limit=time_limit)
            r = simulate(o.plan)
            out[pol] = r.step_s / comp if r.fits else None
            out[pol + "_gap"] = o.plan.solver.get("gap")
        except NoFitError:
            out[pol] = None
    plan = make_plan(profile, None, hw, {"gpu_bytes": budget, "cpu_bytes": cpu, "nvme_bytes": 0},
                     "knapsack", knapsack_layers(profile, budget))
    r = simulate(plan)
    out["knapsack"] = r.step_s / comp if r.fits else None
    for pol, (_, r) in evaluate_baselines(profile, None, hw, b, [p.value for p in BASELINES]).items():
        out[pol] = r.step_s / comp if r.fits else None
    return out


COLS = ["optimal", "remat-only", "knapsack", "keep-all", "recompute-all", "sqrt", "offload-all"]


def fmt(v):
    return "-" if v is None else f"{v:.3f}"


def sweep(name, batch, seq, hw_name, fractions, cpu, time_limit):
    from planner.profiler import profile_model
    hw = load_hardware(hw_name)
    p = profile_model(name, batch, seq, device="meta", hardware=hw)
    print(f"\n{name}, b={batch}, s={seq}, {hw_name}, --cpu-mem {cpu // GiB}G "
          f"({sum(u.kind == 'block' for u in p.layers)} blocks)\n")
    print("| fraction | --gpu-mem | " + " | ".join(COLS) + " | MILP gap |")
    print("|---:|---:|" + "---:|" * len(COLS) + "---:|")
    prev = None
    for fr in fractions:
        budget = fraction_budget(p, fr)
        r = row(p, hw, budget, cpu, time_limit)
        gap = r.get("optimal_gap")
        print(f"| {fr:.2f} | {budget / GiB:.1f}G | " + " | ".join(fmt(r.get(c)) for c in COLS)
              + f" | {'-' if gap is None else f'{gap:.2%}'} |", flush=True)
        if r["optimal"] is not None:
            for c in COLS[1:]:
                if r.get(c) is not None and r["optimal"] > r[c] * (1 + 1e-9):
                    print(f"  NOTE: optimal slower than {c}")
            if prev is not None and r["optimal"] > prev * 1.01:
                print("  NOTE: step rose as the budget grew")
            prev = r["optimal"]
    return p, hw


def llama_check(time_limit):
    """llama3.2-3b, b=2, s=8192, h200, 512G host, half the blocks' activations on the GPU."""
    from planner.profiler import profile_model
    hw = load_hardware("h200")
    p = profile_model("llama3.2-3b", 2, 8192, device="meta", hardware=hw)
    budget = fraction_budget(p, 0.5)
    b = Budgets(budget, 512 * GiB, 0)
    comp = sum(u.fwd_s + u.bwd_s for u in p.layers) + p.optimizer_s
    opt = solve_profile(p, None, hw, b, "optimal", time_limit=time_limit)
    rem = solve_profile(p, None, hw, b, "remat-only", time_limit=time_limit)
    ro, rr = opt.plan.predicted["step_s"] / comp, rem.plan.predicted["step_s"] / comp
    blocks = [u for u in p.layers if u.kind == "block"]
    A = sum(u.activation_bytes for u in blocks) / len(blocks)
    f = sum(u.fwd_s for u in blocks) / len(blocks)
    print(f"\nllama3.2-3b b=2 s=8192 h200 --gpu-mem {budget} ({budget / GiB:.1f}G) --cpu-mem 512G")
    print(f"optimal {ro:.4f}x compute-only, remat-only {rr:.4f}x; overhead ratio "
          f"{(ro - 1) / (rr - 1) if rr > 1 else float('nan'):.2f} (target <= 0.5)")
    print(f"per block: A = {A / 1e9:.2f} GB, fwd {f * 1e3:.2f} ms, copy at "
          f"{hw.d2h_bandwidth / 1e9:.0f} GB/s = {A / hw.d2h_bandwidth * 1e3:.2f} ms "
          f"({A / hw.d2h_bandwidth / f:.2f} forwards); forward link time fits "
          f"{hw.d2h_bandwidth * sum(u.fwd_s for u in p.layers) / A:.1f} of {len(blocks)} blocks")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="three budgets per model")
    ap.add_argument("--time-limit", type=float, default=60.0)
    args = ap.parse_args(argv)
    fr = [0.25, 0.5, 1.0] if args.quick else [0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0]
    sweep("gpt2-xl", 8, 1024, "a100-80g", fr, 512 * GiB, args.time_limit)
    sweep("llama3-8b", 1, 8192, "h200", fr, 512 * GiB, args.time_limit)
    llama_check(args.time_limit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
