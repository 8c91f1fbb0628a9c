"""Assembling a plan: decisions + schedule + the simulator's prediction, in the plan format.

Every strategy (the MILP, each baseline, a hand-written set of decisions) goes through
``make_plan``, so all plans are judged the same way: ``predicted`` is what ``simulate`` says.

Modules: this ``__init__`` (``make_plan``, ``plan_and_sim``, ``baseline_plan``, ``save_plan``,
``cost_model``); ``simulate`` (the judge: a plan's replay and its consistency check, ``plan
simulate``); ``load`` (reading a plan of either schema, or a plan or a profile); ``upgrade``
(a ``tierplan.plan/1`` plan as today's).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from planner.costmodel import CostModel
from planner.formats import (PLAN_SCHEMA, Budgets, HardwareSpec, Plan, Prediction, Profile,
                             SolverRecord, sha256_file, write_json_atomic)
from planner.costmodel.options import moot_homes_for, state_up_homes_for
from planner.costmodel.ranks import node_spec
from planner.costmodel.schedule import build_schedule
from planner.formats.plan import check_homes


def cost_model(profile: Profile, hw: HardwareSpec, budgets, micro_batches: int = 1,
               **kw) -> CostModel:
    """The cost model of ``profile`` on ``hw`` under ``budgets`` (what the MILP optimises and
    the simulator replays)."""
    budgets = as_budgets(budgets)
    return CostModel(profile.layers, hw, gpu_bytes=budgets.gpu_bytes, cpu_bytes=budgets.cpu_bytes,
                     nvme_bytes=budgets.nvme_bytes, micro_batches=micro_batches,
                     optimizer_s=profile.optimizer_s,
                     optimizer_workspace_bytes=profile.optimizer_workspace_bytes,
                     cache_bytes=int(profile.model.get("state_bytes") or 0),
                     chain_breaks=profile.model.get("chain_breaks") or (),
                     not_replayable=profile.model.get("not_replayable") or (), **kw)


def baseline_record(policy: str) -> SolverRecord:
    return SolverRecord(name=policy, status="baseline", origin=f"baseline:{policy}")


def as_budgets(b) -> Budgets:
    """A ``Budgets`` from itself or from a dict of ``gpu_bytes``/``cpu_bytes``/``nvme_bytes``."""
    if isinstance(b, Budgets):
        return b
    return Budgets(int(b.get("gpu_bytes", 0)), int(b.get("cpu_bytes", 0) or 0),
                   int(b.get("nvme_bytes", 0) or 0))


def make_plan(profile: Profile, profile_path: str | None, hw: HardwareSpec, budgets,
              policy: str, layers, shares: dict | None = None,
              solver: SolverRecord | None = None, nvme_dir: str | None = None,
              micro_batches: int = 1, cm: CostModel | None = None) -> Plan:
    """Build the schedule of ``layers`` (with ``shares``, or placed greedily), replay it, and
    return the plan with its prediction filled in."""
    return plan_and_sim(profile, profile_path, hw, budgets, policy, layers, shares, solver,
                        nvme_dir, micro_batches, cm)[0]


def plan_and_sim(profile: Profile, profile_path: str | None, hw: HardwareSpec, budgets,
                 policy: str, layers, shares: dict | None = None,
                 solver: SolverRecord | None = None, nvme_dir: str | None = None,
                 micro_batches: int = 1, cm: CostModel | None = None,
                 keep_overlap: bool = False) -> tuple[Plan, object]:
    """``make_plan`` and the simulation that filled its prediction: ``(plan, SimResult)``.
    An overlapped ``cm`` gives an overlapped plan only where that is faster than the same
    decisions after the backward, unless ``keep_overlap`` (``--optimizer-overlap on``)."""
    # the judge; imported here to keep the import graph flat
    from planner.plans.simulate import executor_of, simulate

    policy = getattr(policy, "value", policy)
    budgets = as_budgets(budgets)
    hw = node_spec(hw)          # a rank's share of a node (``cm.hw``) records the node's spec
    cm = cm or cost_model(profile, hw, budgets, micro_batches,
                          state_up_homes=state_up_homes_for(layers),
                          moot_homes=moot_homes_for(profile.layers, layers))
    schedule = build_schedule(cm, list(layers), shares)
    sha = sha256_file(profile_path) if profile_path and Path(profile_path).is_file() else None
    plan = Plan(
        schema=PLAN_SCHEMA,
        profile={"path": str(profile_path) if profile_path else None, "sha256": sha},
        model=dict(profile.model), hardware=hw.to_dict(), budgets=budgets,
        policy=policy, solver=solver or baseline_record(policy),
        predicted=Prediction(0.0, 0.0, 0, 0, 0),
        units=list(profile.layers), layers=list(layers), schedule=schedule, nvme_dir=nvme_dir,
        micro_batches=cm.K, optimizer_depth=cm.opt_depth,
        world_size=cm.world, ranks_per_node=cm.rpn, engine=cm.engine,
        optimizer_s=float(profile.optimizer_s),
        optimizer_workspace_bytes=int(profile.optimizer_workspace_bytes),
        optimizer_overlap=cm.optimizer_overlap, clip=cm.clip,
        optimizer_prefetch_bytes=int(cm.prefetch_bytes) if cm.overlapped else 0,
        micro_batch_order=cm.micro_batch_order)
    r = simulate(plan)
    if (cm.overlapped or cm.paced) and not keep_overlap:
        # the plan is overlapped only where that is faster than the same decisions after the
        # backward (what today's runtime executes, and never more memory); paced, where those
        # fit too (after the backward every gradient waits for the phase) and are no slower
        after = plan_and_sim(profile, profile_path, hw, budgets, policy, layers, shares, solver,
                             nvme_dir, micro_batches,
                             dataclasses.replace(cm, optimizer_overlap="after-backward",
                                                 prefetch_bytes=0))
        if cm.paced:
            if after[1].fits and (not r.fits or after[1].step_s <= r.step_s * (1 + 1e-9)):
                return after
        elif r.overlapped_s <= 0.0 or after[1].step_s <= r.step_s * (1 + 1e-9):
            return after
    # the runtime's own check (no cost model there) must accept every plan the planner makes
    check_homes(plan, "a plan being made")
    predicted = Prediction(step_s=r.step_s, compute_s=r.compute_s,
                           peak_gpu_bytes=r.peak_gpu_bytes, peak_cpu_bytes=r.peak_cpu_bytes,
                           peak_nvme_bytes=r.peak_nvme_bytes, pass_s=r.pass_s,
                           optimizer_s=r.optimizer_s, flops=r.flops,
                           stage_gpu_bytes=tuple(x.memory["gpu"] for x in r.stages))
    return dataclasses.replace(plan, predicted=predicted, executor=executor_of(cm, plan, r)), r


def baseline_plan(profile: Profile, profile_path: str | None, hw: HardwareSpec, budgets,
                  policy: str, nvme_dir: str | None = None, micro_batches: int = 1) -> Plan:
    """A baseline policy's plan (keep-all, recompute-all, sqrt, offload-all)."""
    from planner.costmodel.baselines import baseline_layers
    layers = baseline_layers(policy, profile.layers, hw, profile.model.get("chain_breaks"),
                             kept=profile.model.get("not_replayable"))
    return make_plan(profile, profile_path, hw, budgets, policy, layers, nvme_dir=nvme_dir,
                     micro_batches=micro_batches)


def save_plan(plan: Plan, path) -> Path:
    """Write ``plan`` as sorted JSON, atomically."""
    return write_json_atomic(path, plan.to_dict())
