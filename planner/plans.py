"""Assembling a plan: decisions + schedule + the simulator's prediction, in the plan format.

Every policy (the MILP, each baseline, a hand-written set of decisions) goes through
``make_plan``, so all plans are judged the same way: ``predicted`` is what ``simulate`` says.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from .errors import UserError
from .formats import PLAN_SCHEMA, HardwareSpec, Plan, Profile, sha256_file, write_json_atomic
from .schedule import build_schedule

BUDGET_KEYS = ("gpu_bytes", "cpu_bytes", "nvme_bytes")


def normalise_budgets(budgets: dict) -> dict:
    out = {}
    for k in BUDGET_KEYS:
        v = budgets.get(k, 0)
        v = 0 if v is None else v
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise UserError(f"budget {k} must be a non-negative integer number of bytes, got {v!r}")
        out[k] = v
    return out


def baseline_solver_info(policy: str) -> dict:
    return {"name": policy, "status": "baseline", "objective": None, "gap": 0.0, "solve_s": 0.0,
            "variables": 0, "constraints": 0}


def make_plan(profile: Profile, profile_path: str | None, hw: HardwareSpec, budgets: dict,
              policy: str, layers, prefetch_issue=None, solver_info: dict | None = None,
              nvme_dir: str | None = None) -> Plan:
    """Build the schedule of ``layers``, replay it, and return the plan with its prediction."""
    from .simulate import simulate   # the judge; imported here to keep the import graph flat

    policy = getattr(policy, "value", policy)
    units = list(profile.layers)
    schedule = build_schedule(units, list(layers), hw, prefetch_issue, profile.optimizer_s)
    sha = None
    if profile_path and Path(profile_path).is_file():
        sha = sha256_file(profile_path)
    plan = Plan(
        schema=PLAN_SCHEMA,
        profile={"path": str(profile_path) if profile_path else None, "sha256": sha},
        model=dict(profile.model), hardware=hw.to_dict(), budgets=normalise_budgets(budgets),
        policy=policy, solver=dict(solver_info or baseline_solver_info(policy)), predicted={},
        units=units, layers=list(layers), schedule=schedule, nvme_dir=nvme_dir,
        optimizer_s=float(profile.optimizer_s),
        optimizer_workspace_bytes=int(profile.optimizer_workspace_bytes))
    r = simulate(plan)
    predicted = {"step_s": r.step_s, "compute_s": r.compute_s, "peak_gpu_bytes": r.peak_gpu_bytes,
                 "peak_cpu_bytes": r.peak_cpu_bytes, "peak_nvme_bytes": r.peak_nvme_bytes}
    return dataclasses.replace(plan, predicted=predicted)


def baseline_plan(profile: Profile, profile_path: str | None, hw: HardwareSpec, budgets: dict,
                  policy: str, nvme_dir: str | None = None) -> Plan:
    """A baseline policy's plan (keep-all, recompute-all, sqrt, offload-all)."""
    from .baselines import baseline_layers
    layers = baseline_layers(policy, profile.layers, hw)
    return make_plan(profile, profile_path, hw, budgets, policy, layers, nvme_dir=nvme_dir)


def save_plan(plan: Plan, path) -> Path:
    """Write ``plan`` as sorted JSON, atomically."""
    return write_json_atomic(path, plan.to_dict())


# ----------------------------------------------------------------------------- golden plans

def golden_plans() -> dict[str, Plan]:
    """The small plans in ``plans/golden/``, from synthetic profiles (no torch, no solver).

    Together they exercise every event kind: a segment recompute, a checkpoint on the host,
    offload to host and to NVMe with a hand-placed prefetch, and NVMe on unified memory.
    """
    from .baselines import baseline_layers
    from .formats import Activation as Act, LayerDecision as LD, Tier
    from .hardware import load_hardware
    from .synthetic import uniform_profile

    h200, cpu = load_hardware("h200"), load_hardware("cpu-host")
    gib = 1024**3
    out = {}
    p = uniform_profile(4, h200, name="golden-sqrt")
    out["h200-sqrt"] = make_plan(p, None, h200, {"gpu_bytes": 64 * gib, "cpu_bytes": 0,
                                                 "nvme_bytes": 0},
                                 "sqrt", baseline_layers("sqrt", p.layers, h200))
    p = uniform_profile(6, h200, jitter=0.1, seed=3, name="golden-mixed")
    layers = [LD("embedding", Act.KEEP), LD("blocks.0", Act.RECOMPUTE, Tier.CPU),
              LD("blocks.1", Act.RECOMPUTE, Tier.NONE), LD("blocks.2", Act.CPU),
              LD("blocks.3", Act.NVME), LD("blocks.4", Act.RECOMPUTE, Tier.GPU),
              LD("blocks.5", Act.KEEP), LD("head", Act.KEEP)]
    out["h200-mixed"] = make_plan(p, None, h200, {"gpu_bytes": 64 * gib, "cpu_bytes": 16 * gib,
                                                  "nvme_bytes": 16 * gib}, "optimal", layers,
                                  prefetch_issue={"blocks.3": "F:head"},
                                  solver_info={"name": "hand", "status": "golden",
                                               "objective": None, "gap": 0.0, "solve_s": 0.0,
                                               "variables": 0, "constraints": 0},
                                  nvme_dir="/tmp/tierplan-golden")
    p = uniform_profile(3, cpu, name="golden-cpu-host")
    out["cpu-host-offload-all"] = make_plan(
        p, None, cpu, {"gpu_bytes": 20 * gib, "cpu_bytes": 0, "nvme_bytes": 16 * gib},
        "offload-all", baseline_layers("offload-all", p.layers, cpu), nvme_dir="/tmp/tierplan-golden")
    return out


def write_golden_plans(folder=None) -> list[Path]:
    """(Re)write ``plans/golden/*.json``; run once when the plan format or simulator changes:
    ``python -c 'from planner.plans import write_golden_plans; write_golden_plans()'``."""
    from . import PLANS_DIR
    folder = Path(folder) if folder else PLANS_DIR / "golden"
    return [save_plan(plan, folder / f"{name}.json") for name, plan in golden_plans().items()]
