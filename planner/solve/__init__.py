"""``plan solve``: budgets in, the fastest plan that the simulator says fits out.

Plans come from strategies, each returning ``Candidate(plan, simulation, origin)``:

- the baselines (keep-all, recompute-all, sqrt, offload-all, and stream-all where the spec and
  budgets allow homes off the device), their transfers placed greedily;
- the activation-only MILP (every tensor class at home on the device), always (it finds no
  plan when the static state does not fit);
- the joint MILP (activations and the home of every tensor class), with the optimizer phase
  pipelined (depth 3) and then one unit at a time (depth 1), each warm-started from the best
  candidate so far, when homes off the device are possible and no candidate fits, or
  ``--stream on``, or the best is slower than the compute floor (K forward and backward
  passes) by more than the gap;
- when no strategy found a fitting plan in time, the GPU-minimising joint MILP's plan if it fits.

``_pick`` is the one place that chooses: the fastest candidate that fits; the plan records
which strategy won (``solver.origin``). The MILP and the simulator evaluate the same cost
model, so a MILP plan's objective is its simulated step. When nothing fits, the GPU-minimising
joint MILP names the smallest ``--gpu-mem`` that fits (or the host/NVMe budget that is short).
``docs/formulation.md`` ("Solving") documents the sequence.
"""
from __future__ import annotations

import dataclasses
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from planner.solve import solvers
from planner.costmodel import CostModel, evaluate
from planner.errors import NoFitError, UserError
from planner.formats.fileio import _shown, path_problem
from planner.formats import (Activation, Budgets, Home, LayerDecision, Plan, Policy, Profile,
                      SolverRecord, Tier, load_profile, write_json_atomic)
from planner.solve.milp import GB, Model, Options
from planner.plans import cost_model, plan_and_sim
from planner.sizes import fmt_bytes, fmt_rate, fmt_seconds, parse_size

STREAM_MODES = ("auto", "on", "off")
# The MILP's rows bound memory in GB with the solvers' feasibility tolerance (1e-6 on the row,
# i.e. a kilobyte) and bytes are rounded to whole numbers when written: solve against the
# budget less this margin, so that every written plan fits to the byte.
MARGIN_BYTES = 4096
# A MILP of more stage rows than this is not built within a --time-limit that leaves it under
# a second per thousand units (PuLP builds ~10k rows a second on this class of host).
BUILD_ROWS_PER_S = 10_000
# What one baseline (schedule and simulation) takes per unit, before the first one says: 0.4
# ms measured at 1,000 units on the 2-core host; used only to skip what cannot finish.
BASELINE_S_PER_UNIT = 5e-4
WRITE_S_PER_UNIT = 1e-4


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    sim: object          # SimResult
    origin: str          # milp | milp-act | baseline:<policy> | min-gpu


@dataclass
class SolveOutcome:
    """The written plan and what was tried on the way (for benches and tests)."""

    plan: Plan
    sim: object
    tried: dict          # origin -> (step_s, fits, peak_gpu_bytes)
    milp_objective: float | None = None


class _Clock:
    """The one --time-limit of the whole ``plan solve``."""

    def __init__(self, limit: float | None):
        self.t0 = time.perf_counter()
        self.limit = limit
        self.skipped: list[str] = []     # what the time limit left out (said on stderr)
        self.sim_s = 0.0                  # the longest plan_and_sim so far: a MILP keeps it
        #                                   back from its limit to judge its own plan after

    def left(self) -> float | None:
        if self.limit is None:
            return None
        return self.limit - (time.perf_counter() - self.t0)


def _size(n: int) -> str:
    return f"{fmt_bytes(n)} ({n} B)"


# ----------------------------------------------------------------------------- strategies

def stream_all_layers(cm: CostModel, base: list[LayerDecision]) -> list[LayerDecision] | None:
    """``base``'s activation decisions with every unit's tensors as far off the device as its
    homes allow (a tied embedding keeps its weights and gradients there, but not its optimizer
    state): first each unit gets, of the homes that leave the least on the device, the one
    that needs the least host memory (NVMe takes the rest); then, unit by unit while host
    memory lasts, the one that leaves the least on NVMe (host transfers are the faster). None
    when no such home exists here."""
    units = [i for i in range(cm.U) if len(cm.homes[i]) > 1]
    if not units:
        return None
    # host room for homes: the budget less the optimizer phase's pipeline (three units' state
    # in flight) and a tenth for staging and offloaded activations
    transient = max((cm.step_transient(i, h) for i in units for h in cm.homes[i]), default=0)
    room = cm.budget["cpu"] * 0.9 - cm.opt_depth * transient

    def off(i):
        hs = cm.homes[i]
        least = min(cm.resident(i, h)["gpu"] for h in hs)
        return [h for h in hs if cm.resident(i, h)["gpu"] == least]
    pick = {i: min(off(i), key=lambda h, i=i: (cm.resident(i, h)["cpu"], cm.resident(i, h)["nvme"]))
            for i in units}
    used = sum(cm.resident(i, pick[i])["cpu"] for i in units)
    for i in units:
        better = sorted(off(i), key=lambda h, i=i: cm.resident(i, h)["nvme"])
        for h in better:
            extra = cm.resident(i, h)["cpu"] - cm.resident(i, pick[i])["cpu"]
            if cm.resident(i, h)["nvme"] < cm.resident(i, pick[i])["nvme"] and used + extra <= room:
                used += extra
                pick[i] = h
                break
    out = []
    for i, d in enumerate(base):
        if i not in pick:
            out.append(d)
            continue
        act, ck = d.activation, d.checkpoint
        if pick[i].streams_weights and act is Activation.RECOMPUTE and ck is Tier.NONE:
            ck = Tier.GPU
        out.append(LayerDecision(d.name, act, ck, pick[i]))
    return out


def baselines(profile, path, hw, budgets, cm: CostModel, nvme_dir, K, clock=None,
              skipped: list | None = None) -> list[Candidate]:
    """Every baseline as a candidate. With ``clock``, one that would not finish in the time
    left (judged by the one before it; the first by ``BASELINE_S_PER_UNIT``) is skipped and
    named in ``skipped``: on 10,000 units each takes seconds."""
    from planner.costmodel.baselines import BASELINES, baseline_layers
    out = []
    est = [BASELINE_S_PER_UNIT * cm.U]
    breaks = profile.model.get("chain_breaks")

    def room(name) -> bool:
        left = clock.left() if clock is not None else None
        if left is not None and left < est[0]:
            if skipped is not None:
                skipped.append(name)
            return False
        return True

    def timed(fn):
        t0 = time.perf_counter()
        try:
            return fn()
        finally:
            est[0] = time.perf_counter() - t0
            if clock is not None:
                clock.sim_s = max(clock.sim_s, est[0])

    for pol in BASELINES:
        if not room(pol.value):
            continue
        try:
            layers = baseline_layers(pol, profile.layers, hw, breaks)
            plan, r = timed(lambda: plan_and_sim(profile, path, hw, budgets, pol, layers,
                                                 nvme_dir=nvme_dir, micro_batches=K, cm=cm))
        except UserError:
            continue                      # not valid on this spec / these budgets
        out.append(Candidate(plan, r, f"baseline:{pol.value}"))
    for pol in (Policy.RECOMPUTE_ALL, Policy.KEEP_ALL):
        layers = stream_all_layers(cm, baseline_layers(pol, profile.layers, hw, breaks))
        if layers is None:
            break
        if not room(f"stream-all+{pol.value}"):
            continue
        try:
            plan, r = timed(lambda: plan_and_sim(profile, path, hw, budgets, "stream-all",
                                                 layers, nvme_dir=nvme_dir, micro_batches=K,
                                                 cm=cm))
        except UserError:
            continue
        out.append(Candidate(plan, r, f"baseline:stream-all+{pol.value}"))
    return out


def _milp_size(cm: CostModel) -> int:
    """Rows the MILP will have, roughly (memory and time per stage, shares, segments), plus
    its static terms in rows' worth: with homes to choose, each of the 2U stages' memory rows
    sums every unit's home choices (O(U^2) terms: 4.4 M at 500 units). A row builds at ~11k/s,
    a term at ~600k/s on this project's 2-core host (measured at 250-1000 units: the estimate
    is within 25% of the real build time), so 55 terms count as a row."""
    per_unit = 8 + sum(len(cm.window(k, i)) for i in range(cm.U) for k in cm.kinds_of(i)) / max(cm.U, 1)
    rows = int(cm.U * (20 + per_unit))
    homes = sum(len(h) for h in cm.homes if len(h) > 1)
    return rows + 2 * cm.U * homes // 55


def milp(profile, path, hw, budgets, cm: CostModel, *, origin, solver, gap, clock, warm,
         nvme_dir, K, progress, share: float = 1.0,
         incumbent: float | None = None) -> Candidate | None:
    """One MILP strategy: solve within ``share`` of the time left; None if it has no
    solution or no time, or if its LP relaxation proves that it cannot beat ``incumbent``
    (the best candidate's step) by more than the gap."""
    left = clock.left()
    if left is not None:
        if _milp_size(cm) / BUILD_ROWS_PER_S > left * 0.5:
            clock.skipped.append("the activation-only MILP" if origin == "milp-act" else
                                 "the joint MILP")
            return None               # it would not even be built in time: baselines only
        left = max(1.0, left * share)
    t0 = time.perf_counter()
    tight = dataclasses.replace(budgets, gpu_bytes=max(0, budgets.gpu_bytes - MARGIN_BYTES))
    m = Model(_with_budget(cm, tight))
    if clock.left() is not None:
        left = max(0.5, min(left, clock.left() - clock.sim_s))
    try:
        out = solvers.solve(m, solver, left, gap, warm=warm, progress=progress,
                            incumbent=incumbent)
    except (solvers.Infeasible, solvers.NoIncumbent, solvers.NothingBetter):
        return None
    except solvers.SolverFailed as e:
        # one strategy lost: the others' candidates still stand (seen once from CBC at 96
        # blocks, not reproduced)
        _warn(f"{e}; the {origin} strategy is left out")
        return None
    rec = SolverRecord(name=solver, status=out.status, origin=origin,
                       objective=out.solution.objective, gap=out.gap,
                       solve_s=round(time.perf_counter() - t0, 4), variables=out.variables,
                       constraints=out.constraints)
    plan, r = plan_and_sim(profile, path, hw, budgets, "optimal", out.solution.layers,
                        shares=out.solution.shares, solver=rec, nvme_dir=nvme_dir,
                        micro_batches=K, cm=cm)
    return Candidate(plan, r, origin)


def _seed_candidates(seeds, budgets: Budgets) -> list[Candidate]:
    """Each seed plan under ``budgets``, replayed again by the simulator (its decisions and
    schedule unchanged): a candidate where it fits."""
    from planner.plans.simulate import simulate
    out = []
    for plan in seeds:
        plan = dataclasses.replace(plan, budgets=budgets)
        r = simulate(plan)
        if r.fits:
            out.append(Candidate(plan, r, "seed"))
    return out


def _with_budget(cm: CostModel, b: Budgets) -> CostModel:
    """The same cost model under other budgets (homes and windows unchanged)."""
    c = object.__new__(CostModel)
    c.__dict__.update(cm.__dict__)
    c.budget = dict(cm.budget, gpu=max(0, b.gpu_bytes - int(cm.hw.reserved_bytes)))
    return c


def _pick(cands: list[Candidate]) -> Candidate | None:
    """The fastest candidate that fits (ties: the MILP's, then the first tried)."""
    fitting = [c for c in cands if c.sim.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda c: (c.sim.step_s, not c.origin.startswith("milp")))


# ----------------------------------------------------------------------------- no plan fits

def _min_budget(profile, path, hw, budgets, cm, solver, clock, tier: str):
    """The smallest budget of ``tier`` for which a plan exists with the other two as given,
    from the joint MILP minimising it (gap 1e-4); None when none exists."""
    left = clock.left()
    if left is not None and _milp_size(cm) / BUILD_ROWS_PER_S > left * 0.5:
        clock.skipped.append(f"the search for the smallest --{tier}-mem")
        return "no time"          # it would not even be built in time (docs/reliability.md)
    m = Model(cm, Options(minimise=tier))
    left = clock.left()
    try:
        out = solvers.solve(m, solver, None if left is None else max(2.0, left), 1e-4)
    except solvers.Infeasible:
        return None
    except solvers.NoIncumbent:
        raise NoFitError(f"no plan was found within --time-limit {clock.limit:g} s, and none was "
                         "proven impossible; give it more time (--time-limit) or more memory",
                         budget="time") from None
    # twice the margin the time-minimising solve keeps below a budget: at the named budget
    # that solve has the GPU-minimising plan's room and a little more
    need = int(math.ceil((m.Gvar if tier == "gpu" else m.Hvar).value() * GB)) + 2 * MARGIN_BYTES
    if tier == "gpu":
        need += int(hw.reserved_bytes)       # the budget must also hold the spec's reserve
    return need, out.solution


def _min_gpu_candidate(profile, path, hw, budgets, cm, solver, clock, nvme_dir, K):
    """The GPU-minimising joint MILP's plan as a candidate (None if it has none)."""
    got = _min_budget(profile, path, hw, budgets, cm, solver, clock, "gpu")
    if not isinstance(got, tuple) or got[0] > budgets.gpu_bytes:
        return None
    rec = SolverRecord(name=solver, status="smallest GPU peak (no faster plan was found in "
                       "time)", origin="min-gpu")
    plan, r = plan_and_sim(profile, path, hw, budgets, "optimal", got[1].layers,
                           shares=got[1].shares, solver=rec, nvme_dir=nvme_dir,
                           micro_batches=K, cm=cm)
    return Candidate(plan, r, "min-gpu")


def _no_fit(profile, path, hw, budgets, cm, solver, clock, n_tried: int = 1, *,
            rebuild=None, stream_off: bool = False) -> NoFitError:
    """Name the short budget and the smallest that fits (found by the solver). ``rebuild(b)``
    makes the same cost model under budgets ``b`` (the host search needs host choices that a
    ``--cpu-mem 0`` model does not have)."""
    tiers = (f"--cpu-mem {_size(budgets.cpu_bytes)} and --nvme-mem {_size(budgets.nvme_bytes)}")
    got = _min_budget(profile, path, hw, budgets, cm, solver, clock, "gpu")
    # one rank's static state (sharded under FSDP2; DDP's buckets included)
    static = sum(cm.P[i] + cm.G[i] + cm.O[i] for i in range(cm.U)) + cm.engine_static
    if got == "no time":
        return NoFitError(f"no plan found within the --time-limit for --gpu-mem "
                          f"{_size(budgets.gpu_bytes)} with {tiers}: "
                          f"{'none of the plans tried fits, and ' if n_tried else ''}"
                          f"{', '.join(dict.fromkeys(clock.skipped))} did not fit in the time left "
                          f"({cm.U} units); raise --time-limit, or the budgets (the model's "
                          f"static state is {_size(static)})", budget="gpu")
    if got is not None:
        need = got[0]
        why = ""
        if static > budgets.gpu_bytes and len({h for hs in cm.homes for h in hs}) == 1:
            why = (f" (the static state alone, {_size(static)}, exceeds it, and "
                   + ("--stream off keeps it on the device: drop --stream off and give "
                      "--cpu-mem or --nvme-mem)" if stream_off else
                      "with these budgets nothing can live off the device: give --cpu-mem or "
                      "--nvme-mem)"))
        return NoFitError(f"no plan fits --gpu-mem {_size(budgets.gpu_bytes)} with {tiers}{why}: "
                          f"the smallest --gpu-mem with a plan is {_size(need)}; raise --gpu-mem "
                          "to that", budget="gpu", needed_bytes=need)
    if not cm.unified:
        if cm.has_cpu or rebuild is None:
            big = _with_budget(cm, budgets)
        else:
            # with --cpu-mem 0 the model has no host choices: build it with a host tier
            big = rebuild(dataclasses.replace(budgets, cpu_bytes=10**15))
        big.budget = dict(cm.budget, cpu=10**15)
        got = _min_budget(profile, path, hw, budgets, big, solver, clock, "cpu")
        if got == "no time":
            return NoFitError(f"no plan found within the --time-limit: none fits "
                              f"--gpu-mem {_size(budgets.gpu_bytes)} with {tiers}, and "
                              f"{', '.join(dict.fromkeys(clock.skipped))} did not fit in the time left; raise "
                              "--time-limit or --cpu-mem", budget="cpu")
        if got is not None:
            # the model's host budget is one rank's; --cpu-mem is the node's
            need = got[0] * int(getattr(cm, "rpn", 1))
            return NoFitError(f"no plan fits --gpu-mem {_size(budgets.gpu_bytes)} with {tiers}, "
                              f"whatever the GPU budget: host memory is short; the smallest "
                              f"--cpu-mem with a plan at this --gpu-mem is {_size(need)}",
                              budget="cpu", needed_bytes=need)
    return NoFitError(f"no plan fits --gpu-mem {_size(budgets.gpu_bytes)} with {tiers}, whatever "
                      "the GPU budget: raise --cpu-mem and/or --nvme-mem (the model's static "
                      f"state is {_size(static)})", budget="cpu")


# ----------------------------------------------------------------------------- plan solve

def solve_profile(profile: Profile, profile_path, hw, budgets: Budgets, policy: str = "optimal",
                  *, solver: str = "highs", time_limit: float | None = 60.0, gap: float = 0.005,
                  nvme_dir: str | None = None, progress: bool = False, micro_batches: int = 1,
                  stream: str = "auto", world_size: int = 1, ranks_per_node: int | None = None,
                  engine: str | None = None, seeds: tuple = ()) -> SolveOutcome:
    """The plan ``plan solve`` writes: fits in the simulator, or ``NoFitError``. With
    ``world_size`` N > 1 (or ``engine`` fsdp2/ddp) the plan is one rank's, every rank replaying
    it (``ranks``: defaults, checks). ``seeds``: plans of the same profile solved under other
    budgets (``plan sweep``'s previous point), each a candidate here where it fits these
    budgets, and so the MILP's warm start when it is the fastest."""
    policy = getattr(policy, "value", policy)
    if stream not in STREAM_MODES:
        raise UserError(f"--stream {stream!r}: use {', '.join(STREAM_MODES)}")
    ranks = rank_options(world_size, ranks_per_node, engine)
    if ranks["engine"] != "none" and stream == "on":
        raise UserError(f"--stream on: homes off the device are not supported with "
                        f"--engine {ranks['engine']} yet; use --stream auto or off")
    clock = _Clock(time_limit)
    K = int(micro_batches)
    offload = policy != Policy.REMAT_ONLY.value
    # the optimizer phase pipelined (3 units in flight: faster) and one unit at a time (1: the
    # least memory); the second is tried where homes off the device can matter
    if (not hw.unified_memory and hw.pinned_limit and budgets.cpu_bytes > hw.pinned_limit):
        _warn(f"--cpu-mem {_size(budgets.cpu_bytes)} is more than the {hw.name} spec lets the "
              f"runtime pin ({_size(hw.pinned_limit)}: pinned_memory_bytes, else "
              "host_memory_bytes); every host byte it holds is pinned, so the plan uses at most "
              "that (edit the spec to raise it)")
    cm = cost_model(profile, hw, budgets, K, allow_streaming=stream != "off",
                    allow_offload=offload, optimizer_depth=3, **ranks)
    cm1 = cost_model(profile, hw, budgets, K, allow_streaming=stream != "off",
                     allow_offload=offload, optimizer_depth=1, **ranks)
    act_cm = cost_model(profile, hw, budgets, K, allow_streaming=False, allow_offload=offload,
                        **ranks)

    if policy not in (Policy.OPTIMAL.value, Policy.REMAT_ONLY.value):
        from planner.costmodel.baselines import baseline_layers
        layers = baseline_layers(policy, profile.layers, hw,
                                 profile.model.get("chain_breaks"))
        plan, r = plan_and_sim(profile, profile_path, hw, budgets, policy, layers,
                            nvme_dir=nvme_dir, micro_batches=K, cm=act_cm)
        if not r.fits:
            raise NoFitError(f"the {policy} plan does not fit: {r.budget_violations[0]}; "
                             f"raise that budget to at least its peak, or use --policy optimal",
                             budget=r.budget_violations[0].split(":")[0])
        return SolveOutcome(plan, r, {f"baseline:{policy}": (r.step_s, True, r.peak_gpu_bytes)})

    homes_matter = any(len(h) > 1 for h in cm.homes) and policy == Policy.OPTIMAL.value
    rebuild = lambda b: cost_model(profile, hw, b, K,  # noqa: E731
                                   allow_streaming=stream != "off", allow_offload=offload,
                                   optimizer_depth=1, **ranks)
    if _static_floor(cm1) > cm1.budget["gpu"]:
        # what the device holds for the whole step under the leanest homes already exceeds the
        # budget: no strategy can fit, so the whole time limit goes to naming what would
        raise _no_fit(profile, profile_path, hw, budgets, cm1, solver, clock, 0,
                      rebuild=rebuild, stream_off=stream == "off")
    if policy == Policy.OPTIMAL.value:
        cands = baselines(profile, profile_path, hw, budgets, cm, nvme_dir, K, clock,
                          clock.skipped)
        if homes_matter:
            cands += [dataclasses.replace(c, origin=c.origin + "/depth1")
                      for c in baselines(profile, profile_path, hw, budgets, cm1, nvme_dir, K,
                                         clock, clock.skipped)
                      if "stream-all" in c.origin]
    else:   # remat-only: the same strategies with nothing moved off the device
        cands = [c for c in baselines(profile, profile_path, hw, budgets, act_cm, nvme_dir, K,
                                      clock, clock.skipped)
                 if c.origin != "baseline:offload-all"]
    cands += _seed_candidates(seeds, budgets)
    best = _pick(cands)
    act = milp(profile, profile_path, hw, budgets, act_cm, origin="milp-act", solver=solver,
               gap=gap, clock=clock, warm=best.plan.layers if best and all(
                   d.home.resident for d in best.plan.layers) else None,
               nvme_dir=nvme_dir, K=K, progress=progress, share=0.5 if stream != "off" else 1.0,
               incumbent=best.sim.step_s if best else None)
    if act is not None:
        cands.append(act)
    best = _pick(cands)
    if homes_matter and (best is None or stream == "on" or _streaming_may_pay(cm, best, gap)):
        for model, origin, share in ((cm, "milp", 0.5), (cm1, "milp/depth1", 1.0)):
            joint = milp(profile, profile_path, hw, budgets, model, origin=origin,
                         solver=solver, gap=gap, clock=clock,
                         warm=best.plan.layers if best else None, nvme_dir=nvme_dir, K=K,
                         progress=progress, share=share,
                         incumbent=best.sim.step_s if best else None)
            if joint is not None:
                cands.append(joint)
                best = _pick(cands)
    best = _pick(cands)
    if best is None and policy == Policy.OPTIMAL.value:
        # no strategy found a plan in time: the plan with the smallest GPU peak, if it fits
        low = _min_gpu_candidate(profile, profile_path, hw, budgets, cm1, solver, clock,
                                 nvme_dir, K)
        if low is not None:
            cands.append(low)
            best = _pick(cands)
    tried = {c.origin: (c.sim.step_s, c.sim.fits, c.sim.peak_gpu_bytes) for c in cands}
    if best is None:
        raise _no_fit(profile, profile_path, hw, budgets, cm1, solver, clock, len(cands),
                      rebuild=rebuild, stream_off=stream == "off")
    if clock.skipped:
        _warn(f"the --time-limit left out {', '.join(clock.skipped)} on this "
              f"{cm.U}-unit model; the plan is the best of the rest (raise --time-limit to try "
              "them)")
    plan = best.plan
    if not best.origin.startswith("milp"):
        rec = dataclasses.replace(plan.solver, status=f"{plan.solver.status}: fastest candidate",
                                  origin=best.origin)
        plan = dataclasses.replace(plan, solver=rec)
    plan = dataclasses.replace(plan, policy=policy)
    milp_obj = best.plan.solver.objective if best.origin.startswith("milp") else None
    return SolveOutcome(plan, best.sim, tried, milp_obj)


def rank_options(world_size: int = 1, ranks_per_node: int | None = None,
                 engine: str | None = None) -> dict:
    """``world_size``, ``ranks_per_node``, ``engine`` checked, with their defaults: engine
    fsdp2 for N > 1 ranks (none for one), min(N, 8) ranks per node (an HGX/DGX node's
    eight GPUs). One UserError line (exit 2) per bad combination."""
    N = world_size
    if not isinstance(N, int) or not 1 <= N <= 65536:
        raise UserError(f"--world-size {N}: give the number of ranks, 1 to 65536")
    if engine is None:
        engine = "fsdp2" if N > 1 else "none"
    if engine not in ("none", "fsdp2", "ddp"):
        raise UserError(f"--engine {engine!r}: use fsdp2, ddp or none")
    if engine == "none" and N > 1:
        raise UserError(f"--world-size {N} with --engine none: several ranks need an engine "
                        "that shares the work; use --engine fsdp2 or ddp")
    R = min(N, 8) if ranks_per_node is None else ranks_per_node
    if not isinstance(R, int) or not 1 <= R <= N or N % R:
        raise UserError(f"--ranks-per-node {R}: give a divisor of --world-size {N} "
                        "(ranks on each node)")
    return {"world_size": N, "ranks_per_node": R, "engine": engine}


def _static_floor(cm: CostModel) -> int:
    """Device bytes held for the whole step whatever the decisions: each unit's leanest home
    on the device, a key/value cache, an engine's own buffers (a lower bound of every plan's
    peak; the budget it is compared with is already less the spec's reserve)."""
    return (sum(min(cm.resident(i, h)["gpu"] for h in cm.homes[i]) for i in range(cm.U))
            + cm.cache + int(getattr(cm, "engine_static", 0)))


def _streaming_may_pay(cm: CostModel, best: Candidate, gap: float) -> bool:
    """Whether a plan with homes off the device can beat ``best`` by more than the gap: no
    plan is faster than the passes' compute alone (K x forward and backward)."""
    floor = cm.K * (sum(cm.f) + sum(cm.b))
    return best.sim.step_s > floor * (1 + gap)


# ----------------------------------------------------------------------------- CLI

def _warn(msg: str) -> None:
    print(f"plan: warning: {msg}", file=sys.stderr)


def parse_budgets(args, hw) -> Budgets:
    """Sizes from the command line, checked against the spec (docs: sizes, unified memory)."""
    gpu = parse_size(args.gpu_mem, "--gpu-mem")
    nvme = parse_size(args.nvme_mem if args.nvme_mem is not None else "0", "--nvme-mem")
    if hw.unified_memory:
        cpu = parse_size(args.cpu_mem, "--cpu-mem") if args.cpu_mem is not None else 0
        if cpu != 0:
            raise UserError(f"--cpu-mem {args.cpu_mem}: the spec {hw.name!r} has unified memory "
                            "(no separate host tier); give --cpu-mem 0 or leave it out")
    else:
        cpu = (parse_size(args.cpu_mem, "--cpu-mem") if args.cpu_mem is not None
               else int(hw.host_memory_bytes))
    if gpu > hw.memory_bytes:
        _warn(f"--gpu-mem {args.gpu_mem} is more than the {fmt_bytes(hw.memory_bytes)} of {hw.name}")
    if not hw.unified_memory and cpu > hw.host_memory_bytes:
        _warn(f"--cpu-mem {args.cpu_mem} is more than the {fmt_bytes(hw.host_memory_bytes)} "
              f"host memory of {hw.name}")
    if hw.nvme_bytes and nvme > hw.nvme_bytes:
        _warn(f"--nvme-mem {args.nvme_mem} is more than the {fmt_bytes(hw.nvme_bytes)} NVMe "
              f"of {hw.name}")
    return Budgets(gpu, cpu, nvme)


def summary_line(plan: Plan) -> str:
    p, b = plan.predicted, plan.budgets
    ratio = p.step_s / p.compute_s if p.compute_s else float("nan")
    streamed = sum(1 for d in plan.layers if not d.home.resident)
    tail = f"; {streamed} unit(s) with tensors off the device" if streamed else ""
    if plan.engine != "none":
        tail += (f"; per rank of {plan.world_size} ({plan.engine}, {plan.ranks_per_node} per "
                 "node; host and NVMe budgets per node)")
    return (f"{plan.policy} ({plan.solver.origin}): step {fmt_seconds(p.step_s)} = {ratio:.3f}x "
            f"compute-only ({fmt_seconds(p.compute_s)}), {fmt_rate(p.flops, p.step_s)}; peaks GPU "
            f"{fmt_bytes(p.peak_gpu_bytes)} / {fmt_bytes(b.gpu_bytes)}, host "
            f"{fmt_bytes(p.peak_cpu_bytes)} / {fmt_bytes(b.cpu_bytes)}, NVMe "
            f"{fmt_bytes(p.peak_nvme_bytes)} / {fmt_bytes(b.nvme_bytes)}{tail}")


def default_solver() -> str:
    """HiGHS where highspy is installed (``bash setup.sh`` installs it): on this project's
    benchmarks it proves the same gap 1-4x sooner than CBC (docs/formulation.md, Solving);
    else PuLP's bundled CBC."""
    return "highs" if solvers.highs_available() else "cbc"


def check_nvme_dir(args) -> None:
    """``--nvme-dir`` as a path the OS can make (one line, exit 2, before anything is read)."""
    if getattr(args, "nvme_dir", None) is not None:
        why = path_problem(args.nvme_dir)
        if why:
            raise UserError(f"--nvme-dir '{_shown(args.nvme_dir)}': {why}; give a directory "
                            "path (or leave --nvme-dir out for the default)")


def solve_options(args, profile: Profile) -> tuple:
    """``(hw, keyword arguments of solve_profile)`` from ``plan solve``'s options (also those
    of ``plan sweep``), each checked: one UserError line per bad value."""
    check_nvme_dir(args)
    if args.hardware:
        from planner.hardware import load_hardware
        hw = load_hardware(args.hardware)
        if hw.name != profile.hardware_spec.name:
            _warn(f"--hardware {args.hardware}: the profile was taken for "
                  f"{profile.hardware_spec.name!r}; times and attention bytes come from the "
                  f"profile's hardware; re-profile with --hardware {args.hardware} for exact "
                  "figures")
    else:
        hw = profile.hardware_spec
    if args.time_limit is not None and not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise UserError(f"--time-limit {args.time_limit}: give a positive number of seconds")
    if not (math.isfinite(args.gap) and 0 <= args.gap < 1):
        raise UserError(f"--gap {args.gap}: give a relative gap from 0 to below 1, e.g. 0.005")
    if not 1 <= args.micro_batches <= 4096:
        raise UserError(f"--micro-batches {args.micro_batches}: give 1 to 4096 passes per "
                        "optimizer step")
    nvme_dir = args.nvme_dir or os.path.join(tempfile.gettempdir(), "tierplan-nvme")
    return hw, dict(policy=args.policy, solver=args.solver or default_solver(),
                    time_limit=args.time_limit, gap=args.gap, nvme_dir=nvme_dir,
                    progress=sys.stderr.isatty(), micro_batches=args.micro_batches,
                    stream=args.stream, world_size=args.world_size,
                    ranks_per_node=args.ranks_per_node, engine=args.engine)


def cli_solve(args) -> int:
    t_start = time.perf_counter()     # --time-limit bounds the whole command, loading included
    check_nvme_dir(args)
    profile = load_profile(args.profile)
    hw, kw = solve_options(args, profile)
    budgets = parse_budgets(args, hw)
    if kw["time_limit"] is not None:
        # what loading took, and what writing the plan will (~1 s per 10,000 units, measured)
        kw["time_limit"] = max(0.5, kw["time_limit"] - (time.perf_counter() - t_start)
                               - WRITE_S_PER_UNIT * len(profile.layers))
    out = solve_profile(profile, args.profile, hw, budgets, **kw)
    path = Path(args.output) if args.output else (
        Path("plans") / f"{Path(args.profile).stem}-{str(args.gpu_mem).strip()}.json")
    write_json_atomic(path, out.plan.to_dict())
    print(path)
    print(summary_line(out.plan))
    return 0
