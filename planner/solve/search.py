"""The sequence of ``plan solve`` (``solve``): from one ``SolveConfig`` and a profile, the cost
model and its variants, the strategies in order, the fastest candidate that fits, or the
one-line ``NoFitError`` naming the budget that would fit. ``solve_profile`` is the keyword
face of the Python API (tests and benchmarks): it builds the configuration and calls ``solve``.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from planner.costmodel import CostModel
from planner.costmodel.baselines import baseline_layers
from planner.errors import NoFitError
from planner.formats import Budgets, Plan, Policy, Profile, Tier
from planner.formats.enums import paced_possible
from planner.plans import plan_and_sim
from planner.solve.config import SolveConfig, warn
from planner.solve.nofit import _min_gpu_candidate, _no_fit, _static_floor
from planner.solve.strategies import (Candidate, _Clock, _pick, _seed_candidates, baselines,
                                      bytes_text, milp)


@dataclass
class SolveOutcome:
    """The written plan and what was tried on the way (for benches and tests)."""

    plan: Plan
    sim: object
    tried: dict          # origin -> (step_s, fits, peak_gpu_bytes)
    milp_objective: float | None = None


@dataclass(frozen=True)
class _Models:
    """The cost models of one solve: ``main`` from the configuration, and its variants."""

    main: CostModel      # depth cfg.optimizer_depth (3), homes off the device allowed
    lean: CostModel      # depth 1: the optimizer phase one unit at a time (the least memory)
    act: CostModel       # every tensor class at home on the device (activations only)
    # depth 1 with the optimizer beside the backward (one unit in flight during the backward,
    # so more memory than lean); None where the configuration does not overlap
    lean_ovl: CostModel | None = None


def solve_profile(profile: Profile, profile_path, hw, budgets: Budgets, policy: str = "optimal",
                  *, solver: str = "highs", time_limit: float | None = 60.0, gap: float = 0.005,
                  nvme_dir: str | None = None, progress: bool = False, micro_batches: int = 1,
                  stream: str = "auto", world_size: int = 1, ranks_per_node: int | None = None,
                  engine: str | None = None, seeds: tuple = (), clip: str = "global",
                  optimizer_overlap: str = "auto",
                  micro_batch_order: str = "batch-major",
                  shard_homes: str = "runnable") -> SolveOutcome:
    """The plan ``plan solve`` writes: fits in the simulator, or ``NoFitError``. With
    ``world_size`` N > 1 (or ``engine`` fsdp2/ddp) the plan is one rank's, every rank replaying
    it (``rank_options``: defaults, checks). ``seeds``: plans of the same profile solved under
    other budgets (``plan sweep``'s previous point), or of another profile of the same units
    (``plan search``'s previous micro-batch size: their decisions planned anew here), each a
    candidate where it fits these budgets, and so the MILP's warm start when it is the
    fastest."""
    cfg = SolveConfig.build(hw, budgets, policy, solver=solver, time_limit=time_limit, gap=gap,
                            nvme_dir=nvme_dir, progress=progress, micro_batches=micro_batches,
                            stream=stream, world_size=world_size, ranks_per_node=ranks_per_node,
                            engine=engine, clip=clip, optimizer_overlap=optimizer_overlap,
                            micro_batch_order=micro_batch_order, shard_homes=shard_homes)
    return solve(profile, profile_path, cfg, seeds)


def solve(profile: Profile, profile_path, cfg: SolveConfig, seeds: tuple = ()) -> SolveOutcome:
    """``solve_profile`` of a configuration already built. ``micro_batch_order: auto`` solves
    batch-major, then layer-major in the time left, and keeps the faster plan that fits."""
    if cfg.micro_batch_order != "auto":
        return _solve_order(profile, profile_path, cfg, seeds)
    t0, outs, refused = time.perf_counter(), [], None
    for n, order in enumerate(("batch-major", "layer-major")):
        limit = cfg.time_limit
        if limit is not None:
            limit = max(0.5, (limit - (time.perf_counter() - t0)) / (2 - n))
        try:
            outs.append(_solve_order(profile, profile_path, dataclasses.replace(
                cfg, micro_batch_order=order, time_limit=limit), seeds))
        except NoFitError as e:
            refused = e
    if not outs:
        raise refused
    return min(outs, key=lambda o: o.plan.predicted.step_s)


def _solve_order(profile: Profile, profile_path, cfg: SolveConfig, seeds: tuple = ()) -> SolveOutcome:
    """``solve`` for one micro-batch order."""
    clock = _Clock(cfg.time_limit)
    hw, budgets = cfg.hw, cfg.budgets
    if (not hw.unified_memory and hw.pinned_limit and budgets.cpu_bytes > hw.pinned_limit):
        warn(f"--cpu-mem {bytes_text(budgets.cpu_bytes)} is more than the {hw.name} spec lets the "
             f"runtime pin ({bytes_text(hw.pinned_limit)}: pinned_memory_bytes, else "
             "host_memory_bytes); every host byte it holds is pinned, so the plan uses at most "
             "that (edit the spec to raise it)")
    cm = cfg.cost_model(profile)
    if cfg.policy not in (Policy.OPTIMAL.value, Policy.REMAT_ONLY.value):
        return _baseline_policy(profile, profile_path, cfg,
                                dataclasses.replace(cm, allow_streaming=False))
    # the optimizer phase pipelined (3 units in flight: faster) and one unit at a time (1: the
    # least memory); the second is tried where homes off the device can matter
    lean = dataclasses.replace(cm, optimizer_depth=1)
    models = _Models(cm, dataclasses.replace(lean, optimizer_overlap="after-backward",
                                             prefetch_bytes=0),
                     dataclasses.replace(cm, allow_streaming=False),
                     lean if lean.overlapped else None)
    # the model whose smallest budget a refusal names: remat-only moves nothing off the
    # device, so its leanest plans are the activation-only model's
    floor = models.act if cfg.policy == Policy.REMAT_ONLY.value else models.lean
    if _static_floor(floor) > floor.budget["gpu"]:
        # what the device holds for the whole step under the leanest homes already exceeds the
        # budget: no strategy can fit, so the whole time limit goes to naming what would
        raise _no_fit(cfg, floor, clock, 0)
    cands = _first_candidates(profile, profile_path, cfg, models, clock, seeds)
    best = _search(profile, profile_path, cfg, models, clock, cands)
    if best is None and cfg.policy == Policy.OPTIMAL.value:
        # no strategy found a plan in time: the plan with the smallest GPU peak, if it fits
        low = _min_gpu_candidate(profile, profile_path, cfg, models.lean, clock)
        if low is not None:
            cands.append(low)
            best = _pick(cands)
    tried = {c.origin: (c.sim.step_s, c.sim.fits, c.sim.peak_gpu_bytes) for c in cands}
    if best is None:
        raise _no_fit(cfg, floor, clock, len(cands))
    if clock.skipped:
        warn(f"the --time-limit left out {', '.join(clock.skipped)} on this "
             f"{cm.U}-unit model; the plan is the best of the rest (raise --time-limit to try "
             "them)")
    if cfg.optimizer_overlap == "on" and best.plan.optimizer_overlap != "overlapped":
        best = _overlapped(profile, profile_path, cfg, models.main, cands)
    plan = best.plan
    if not best.origin.startswith("milp"):
        rec = dataclasses.replace(plan.solver, status=f"{plan.solver.status}: fastest candidate",
                                  origin=best.origin)
        plan = dataclasses.replace(plan, solver=rec)
    plan = dataclasses.replace(plan, policy=cfg.policy)
    milp_obj = best.plan.solver.objective if best.origin.startswith("milp") else None
    return SolveOutcome(plan, best.sim, tried, milp_obj)


def _overlapped(profile, profile_path, cfg: SolveConfig, main: CostModel,
                cands: list[Candidate]) -> Candidate:
    """``--optimizer-overlap on``: the fastest candidate whose decisions and transfer shares
    fit with the optimizer overlapped with the backward, priced by the simulator as that
    schedule (a unit's step, or under ``--clip global`` its state reads, may start once its
    last gradient is complete; a step in flight holds its bytes during the backward, so the
    fastest plan after the backward may not fit so). Under ``--clip global`` only state read
    ahead moves: as much of the NVMe-homed state as the tier holding it has room for.
    NoFitError (exit 3) naming why the fastest candidate cannot run so, where none can."""
    from planner.costmodel.schedule import shares_of
    first = None
    tried = 0
    for c in sorted((c for c in cands if c.sim.fits), key=lambda c: c.sim.step_s):
        plan = c.plan
        if plan.optimizer_overlap == "overlapped":
            return c
        tried += 1
        cm = dataclasses.replace(main, optimizer_overlap="overlapped",
                                 optimizer_depth=plan.optimizer_depth)
        shares = shares_of(cm, plan.layers, [e for evs in plan.schedule.values() for e in evs])

        def sim(pre):
            return plan_and_sim(profile, profile_path, cm.hw, cfg.budgets, plan.policy,
                                plan.layers, shares=shares, solver=plan.solver,
                                nvme_dir=cfg.nvme_dir,
                                cm=dataclasses.replace(cm, prefetch_bytes=pre),
                                keep_overlap=True)
        got, r = sim(0)
        why = r.budget_violations[0] if not r.fits else \
            "no unit's optimizer work can start before the backward ends"
        if r.fits and r.overlapped_s <= 0 and cfg.clip == "global" and not any(
                cm.reads_state_ahead(d.home) for d in plan.layers):
            why = ("under --clip global only the state reads of units stepped on the host "
                   "move into the backward, and this plan steps none there")
        elif r.fits and r.overlapped_s <= 0 and cfg.clip == "global":
            ahead = sum(u.optimizer_bytes for u, d in zip(plan.units, plan.layers)
                        if d.home.optimizer is Tier.NVME)
            tier = cm.prefetch_tier()
            room = int(cm.budget[tier] - (r.peak_gpu_bytes if tier == "gpu" else r.peak_cpu_bytes))
            if min(ahead, room) > 0:
                got, r = sim(min(ahead, room))
            else:
                why = (f"no room on the {tier} tier to read state ahead" if ahead else
                       "no unit's optimizer state lives on NVMe, so none can be read ahead")
        if r.fits and r.overlapped_s > 0:
            return Candidate(got, r, c.origin)
        first = first or (c.origin, why, not r.fits)
    origin, why, short = first or ("", "no plan fits", False)
    raise NoFitError(f"--optimizer-overlap on: none of the {tried} plan(s) found runs "
                     f"overlapped within the budgets (the fastest, {origin}: {why}); "
                     + ("raise that budget or " if short else "")
                     + "use --optimizer-overlap auto",
                     budget=why.split(":")[0] if short else "")


def _baseline_policy(profile, profile_path, cfg: SolveConfig, cm: CostModel) -> SolveOutcome:
    """``--policy`` a baseline: its plan on ``cm``, or NoFitError naming the budget it exceeds."""
    policy = cfg.policy
    layers = baseline_layers(policy, profile.layers, cm.hw, profile.model.get("chain_breaks"),
                             profile.model.get("not_replayable"))
    plan, r = plan_and_sim(profile, profile_path, cm.hw, cfg.budgets, policy, layers,
                           nvme_dir=cfg.nvme_dir, cm=cm)
    if not r.fits:
        raise NoFitError(f"the {policy} plan does not fit: {r.budget_violations[0]}; "
                         f"raise that budget to at least its peak, or use --policy optimal",
                         budget=r.budget_violations[0].split(":")[0])
    return SolveOutcome(plan, r, {f"baseline:{policy}": (r.step_s, True, r.peak_gpu_bytes)})


def _homes_matter(cfg: SolveConfig, models: _Models) -> bool:
    """Whether homes off the device are possible here (the joint MILP has something to choose)."""
    return any(len(h) > 1 for h in models.main.homes) and cfg.policy == Policy.OPTIMAL.value


def _first_candidates(profile, profile_path, cfg: SolveConfig, models: _Models, clock,
                      seeds) -> list[Candidate]:
    """The baselines (on the main model; stream-all also at depth 1 where homes matter; for
    remat-only, on the activations-only model without offload-all) and the seeds."""
    budgets, nvme_dir = cfg.budgets, cfg.nvme_dir
    if cfg.policy == Policy.OPTIMAL.value:
        cands = baselines(profile, profile_path, budgets, models.main, nvme_dir, clock,
                          clock.skipped)
        if _homes_matter(cfg, models):
            cands += [dataclasses.replace(c, origin=c.origin + "/depth1")
                      for c in baselines(profile, profile_path, budgets, models.lean, nvme_dir,
                                         clock, clock.skipped)
                      if "stream-all" in c.origin]
    else:   # remat-only: the same strategies with nothing moved off the device
        cands = [c for c in baselines(profile, profile_path, budgets, models.act, nvme_dir,
                                      clock, clock.skipped)
                 if c.origin != "baseline:offload-all"]
    return cands + _seed_candidates(seeds, budgets, profile, profile_path, models.main,
                                    nvme_dir)


def _search(profile, profile_path, cfg: SolveConfig, models: _Models, clock,
            cands: list[Candidate]) -> Candidate | None:
    """The MILPs after the first candidates (appended to ``cands``): the activation-only one,
    then, where homes matter and streaming may pay, the joint one at depth 3 and at depth 1,
    each warm-started from the best so far. The best candidate that fits, or None."""
    best = _pick(cands)
    act = milp(profile, profile_path, cfg, models.act, origin="milp-act", clock=clock,
               warm=best.plan.layers if best and all(
                   d.home.resident for d in best.plan.layers) else None,
               share=0.5 if cfg.stream != "off" else 1.0,
               incumbent=best.sim.step_s if best else None)
    if act is not None:
        cands.append(act)
    best = _pick(cands)
    if _homes_matter(cfg, models) and (best is None or cfg.stream == "on"
                                       or _streaming_may_pay(models.main, best, cfg.gap)):
        def joint(model, origin, share):
            nonlocal best
            # --optimizer-overlap on wants the overlapped model's own best plan even where it
            # is no faster than the best so far (``_overlapped`` then runs it so)
            cut = best is not None and not (cfg.optimizer_overlap == "on" and model.overlapped)
            got = milp(profile, profile_path, cfg, model, origin=origin, clock=clock,
                       warm=best.plan.layers if best else None, share=share,
                       incumbent=best.sim.step_s if cut else None)
            if got is not None:
                cands.append(got)
                best = _pick(cands)
            return got
        main = joint(models.main, "milp", 0.5)
        if _paced_too(cfg, models.main):
            # auto with one pass a step and no clip: the paced family too (the runtime runs
            # it), which frees each gradient by its update and so leaves room for state
            joint(dataclasses.replace(models.main, optimizer_overlap="paced", prefetch_bytes=0),
                  "milp/paced", 0.5)
        if models.main.paced:
            # paced offers only homes that keep gradients on the device: the same depth after
            # the backward with every home too, which the runtime executes (and can be faster:
            # on an h200 model a gradient parked on the host freed the device for state)
            joint(dataclasses.replace(models.main, optimizer_overlap="after-backward"),
                  "milp", 0.5)
        if models.main.overlapped and (main is None
                                       or main.plan.optimizer_overlap != "overlapped"):
            # the overlapped model found no plan that overlaps: the same depth after the
            # backward too. The overlapped one holds a step in flight during the backward, so
            # at a tight budget it can find none (a NanoChat plan at static/4.2:
            # --optimizer-overlap auto 10.0 s at depth 1 against off 8.9 s at depth 3, before)
            joint(dataclasses.replace(models.main, optimizer_overlap="after-backward",
                                      prefetch_bytes=0), "milp", 0.5)
        if models.lean_ovl is not None:
            joint(models.lean_ovl, "milp/depth1", 1.0)
        joint(models.lean, "milp/depth1", 1.0)
        if _state_up_may_pay(models.main):
            joint(dataclasses.replace(models.main, state_up_homes="all"), "milp/state-up", 0.5)
    return _pick(cands)


def _state_up_may_pay(cm: CostModel) -> bool:
    """Whether the state-up home, not offered to every unit here (the static state fits the
    device budget: ``_offers_state_up``), could still make a faster plan: activations do not
    all fit beside the static state, so some unit's state could make room for them. A last
    MILP then offers it, warm-started from the best plan: offered only below the static state,
    a budget just above it was slower than one just below (a Qwen2-MoE on the a100: 2940M
    0.385 s against 2920M 0.354 s). The main MILPs leave it out: there it is a near-tie with
    the host's step that slows their search."""
    if cm.unified or not cm.has_cpu or cm.static_over or cm.state_up_homes == "all":
        return False
    return cm.static_bytes + sum(cm.A) + max(cm.W, default=0) > cm.budget["gpu"]


def _paced_too(cfg: SolveConfig, main: CostModel) -> bool:
    """Whether ``--optimizer-overlap auto`` also searches the paced family: possible here (clip
    none, one pass per step, no engine) and the main model the overlapped one."""
    return cfg.optimizer_overlap == "auto" and main.overlapped and paced_possible(
        cfg.clip, cfg.engine, cfg.micro_batches, main.micro_batch_order)


def _streaming_may_pay(cm: CostModel, best: Candidate, gap: float) -> bool:
    """Whether a plan with homes off the device can beat ``best`` by more than the gap: no
    plan is faster than the passes' compute alone (K x forward and backward)."""
    floor = cm.passes * (sum(cm.f) + sum(cm.b))
    return best.sim.step_s > floor * (1 + gap)
