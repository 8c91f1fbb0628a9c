"""Plan quality: step time / compute-only per policy over GPU-budget sweeps.

Profiles come from ``planner.profile.profile_model(..., device="meta")`` (shapes and FLOPs,
times estimated from the spec). Columns: ``optimal`` and ``remat-only`` (the MILP with
offloading disabled) through ``plan solve``'s own path (``planner.solve.solve_profile``:
baselines, MILPs, the pick), with the strategy that won (``origin``) and the MILP's gap;
torch's knapsack (``dp_knapsack`` on the blocks: keep the set with the largest forward time
whose activations fit, recompute the rest with a GPU checkpoint; judged by our simulator since
it ignores the backward peak); and the baselines of ``planner.solve.baselines`` (keep-all,
recompute-all, sqrt, offload-all, and the best stream-all variant where the host budget
allows homes off the device), each simulated. "-" = does not fit. The GPU budget is
``planner.solve.budget.fraction_budget``: static + embedding + head + workspace + shared + F x the
blocks' saved bytes + the spec's reserve.

    python bench/quality.py                 # three budgets per model, a few minutes
    python bench/quality.py --full          # seven budgets per model
    python bench/quality.py --models gpt2-xl --fractions 0.25,0.5

Every row is checked: a NOTE is printed when ``optimal`` is slower than any other column, when
its step rises as the budget grows, or when the winning MILP's objective differs from the
simulated step by more than 1e-6.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/profile.py and bench/runtime.py would shadow the standard library's ``profile`` and
# the runtime package: import from the repository root, never from bench/
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from planner.solve.budget import fraction_budget  # noqa: E402
from planner.errors import NoFitError  # noqa: E402
from planner.formats import Activation, Budgets, LayerDecision, Tier  # noqa: E402
from planner.hardware import load_hardware  # noqa: E402
from planner.plans import cost_model, plan_and_sim  # noqa: E402
from planner.solve import baselines, default_solver, solve_profile  # noqa: E402

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


COLS = ["optimal", "remat-only", "knapsack", "keep-all", "recompute-all", "sqrt", "offload-all",
        "stream-all"]


def compute_only(profile, hw, budgets) -> float:
    """Every plan's floor, as ``plan.predicted.compute_s`` has it: forward and backward of every
    unit and the optimizer phase at its shortest (the host's CPU may step a share of it)."""
    return cost_model(profile, hw, budgets).compute_only()


SAVE_PLANS: Path | None = None     # --save-plans: every solved plan written here


def row(profile, hw, budget: int, cpu: int, solver: str, time_limit: float) -> dict:
    b = Budgets(budget, cpu, 0)
    out = {"notes": []}
    comp = compute_only(profile, hw, b)
    for pol in ("optimal", "remat-only"):
        t0 = time.perf_counter()
        try:
            o = solve_profile(profile, None, hw, b, pol, solver=solver, time_limit=time_limit)
        except NoFitError:
            out[pol] = None
            out[pol + "_s"] = time.perf_counter() - t0
            continue
        out[pol + "_s"] = time.perf_counter() - t0
        if SAVE_PLANS is not None:
            from planner.plans import save_plan
            save_plan(o.plan, SAVE_PLANS / f"{profile.model.get('name', 'model')}-b{budget}-{pol}.json")
        out[pol] = o.sim.step_s / comp if o.sim.fits else None
        out[pol + "_origin"] = o.plan.solver.origin
        out[pol + "_gap"] = o.plan.solver.gap
        if o.milp_objective is not None and abs(o.milp_objective / o.sim.step_s - 1) > 1e-6:
            out["notes"].append(f"{pol}: MILP objective {o.milp_objective:.6g} s vs simulated "
                                f"{o.sim.step_s:.6g} s ({o.milp_objective / o.sim.step_s - 1:+.4%})")
        if not o.sim.fits:
            out["notes"].append(f"{pol}: the written plan does not fit in the simulator")
    _, r = plan_and_sim(profile, None, hw, b, "knapsack", knapsack_layers(profile, budget))
    out["knapsack"] = r.step_s / comp if r.fits else None
    cm = cost_model(profile, hw, b)
    for c in baselines(profile, None, b, cm, None):
        name = c.origin.split(":", 1)[1]
        key = "stream-all" if name.startswith("stream-all") else name
        v = c.sim.step_s / comp if c.sim.fits else None
        if v is not None and (out.get(key) is None or v < out[key]):
            out[key] = v
    return out


def fmt(v):
    return "-" if v is None else f"{v:.3f}"


def sweep(name, batch, seq, hw_name, fractions, cpu, solver, time_limit):
    from planner.profile import profile_model
    hw = load_hardware(hw_name)
    p = profile_model(name, batch, seq, device="meta", hardware=hw)
    print(f"\n{name}, b={batch}, s={seq}, {hw_name}, --cpu-mem {cpu // GiB}G, {solver} "
          f"({sum(u.kind == 'block' for u in p.layers)} blocks)\n")
    print("| fraction | --gpu-mem | " + " | ".join(COLS) + " | optimal's origin | MILP gap | "
          "solve s (opt / remat) |")
    print("|---:|---:|" + "---:|" * len(COLS) + "---|---:|---:|")
    prev = None
    notes = []
    for fr in fractions:
        budget = fraction_budget(p, fr)
        r = row(p, hw, budget, cpu, solver, time_limit)
        gap = r.get("optimal_gap")
        print(f"| {fr:.3f} | {budget / GiB:.1f}G | " + " | ".join(fmt(r.get(c)) for c in COLS)
              + f" | {r.get('optimal_origin', '-')} | {'-' if gap is None else f'{gap:.2%}'} | "
              f"{r['optimal_s']:.1f} / {r['remat-only_s']:.1f} |", flush=True)
        notes += [f"F={fr}: {n}" for n in r["notes"]]
        if r["optimal"] is not None:
            for c in COLS[1:]:
                if r.get(c) is not None and r["optimal"] > r[c] * (1 + 1e-9):
                    notes.append(f"F={fr}: optimal ({r['optimal']:.4f}) slower than {c} "
                                 f"({r[c]:.4f})")
            if prev is not None and r["optimal"] > prev * (1 + 1e-9):
                notes.append(f"F={fr}: optimal's step rose as the budget grew ({prev:.4f} -> "
                             f"{r['optimal']:.4f})")
            prev = r["optimal"]
        else:
            fitting = [c for c in COLS[1:] if r.get(c) is not None]
            if fitting:
                notes.append(f"F={fr}: optimal found no plan but {', '.join(fitting)} fit")
    for n in notes:
        print(f"  NOTE: {n}")
    return p, hw


def llama_check(solver, time_limit):
    """llama3.2-3b, b=2, s=8192, h200, 512G host, half the blocks' activations on the GPU."""
    from planner.profile import profile_model
    hw = load_hardware("h200")
    p = profile_model("llama3.2-3b", 2, 8192, device="meta", hardware=hw)
    budget = fraction_budget(p, 0.5)
    b = Budgets(budget, 512 * GiB, 0)
    comp = compute_only(p, hw, b)
    opt = solve_profile(p, None, hw, b, "optimal", solver=solver, time_limit=time_limit)
    rem = solve_profile(p, None, hw, b, "remat-only", solver=solver, time_limit=time_limit)
    ro, rr = opt.plan.predicted.step_s / comp, rem.plan.predicted.step_s / comp
    blocks = [u for u in p.layers if u.kind == "block"]
    A = sum(u.activation_bytes for u in blocks) / len(blocks)
    f = sum(u.fwd_s for u in blocks) / len(blocks)
    print(f"\nllama3.2-3b b=2 s=8192 h200 --gpu-mem {budget} ({budget / GiB:.1f}G) --cpu-mem 512G")
    print(f"optimal {ro:.4f}x compute-only ({opt.plan.solver.origin}), remat-only {rr:.4f}x "
          f"({rem.plan.solver.origin}); overhead ratio "
          f"{(ro - 1) / (rr - 1) if rr > 1 else float('nan'):.2f} (target <= 0.5)")
    print(f"per block: A = {A / 1e9:.2f} GB, fwd {f * 1e3:.2f} ms, copy at "
          f"{hw.d2h_bandwidth / 1e9:.0f} GB/s = {A / hw.d2h_bandwidth * 1e3:.2f} ms "
          f"({A / hw.d2h_bandwidth / f:.2f} forwards); forward link time fits "
          f"{hw.d2h_bandwidth * sum(u.fwd_s for u in p.layers) / A:.1f} of {len(blocks)} blocks")


MODELS = {"gpt2-xl": ("gpt2-xl", 8, 1024, "a100-80g"), "llama3-8b": ("llama3-8b", 1, 8192, "h200")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="seven budgets per model")
    ap.add_argument("--fractions", help="comma-separated F values (overrides --full)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"of {', '.join(MODELS)}")
    ap.add_argument("--no-llama-check", action="store_true")
    ap.add_argument("--solver", default=None, help="cbc or highs (default: plan solve's)")
    ap.add_argument("--time-limit", type=float, default=30.0, help="per plan solve")
    ap.add_argument("--save-plans", metavar="DIR", default=None,
                    help="also write every solved plan to DIR (to compare versions)")
    args = ap.parse_args(argv)
    global SAVE_PLANS
    SAVE_PLANS = Path(args.save_plans) if args.save_plans else None
    solver = args.solver or default_solver()
    if args.fractions:
        fr = [float(x) for x in args.fractions.split(",")]
    else:
        fr = [0.0, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0] if args.full else [0.25, 0.5, 1.0]
    for m in [m for m in args.models.split(",") if m]:
        name, b, s, hw = MODELS[m]
        sweep(name, b, s, hw, fr, 512 * GiB, solver, args.time_limit)
    if not args.no_llama_check:
        llama_check(solver, args.time_limit)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
