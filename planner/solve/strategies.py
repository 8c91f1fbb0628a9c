"""The strategies of ``plan solve``, each returning ``Candidate(plan, simulation, origin)``: the
baselines (their transfers placed greedily, and stream-all where homes off the device exist),
one MILP solve, the seed plans of a sweep; the one ``--time-limit`` clock they share; and
``_pick``, the one place that chooses among candidates.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from planner.costmodel import CostModel
from planner.costmodel.baselines import BASELINES, baseline_layers
from planner.errors import UserError
from planner.formats import Activation, Budgets, LayerDecision, Plan, Policy, SolverRecord, Tier
from planner.plans import plan_and_sim
from planner.plans.simulate import simulate
from planner.sizes import fmt_bytes
from planner.solve import solvers
from planner.solve.config import SolveConfig, warn
from planner.solve.milp import Model

# A MILP of more stage rows than this is not built within a --time-limit that leaves it under
# a second per thousand units (PuLP builds ~10k rows a second on this class of host).
BUILD_ROWS_PER_S = 10_000
# What one baseline (schedule and simulation) takes per unit, before the first one says: 0.4
# ms measured at 1,000 units on the 2-core host; used only to skip what cannot finish.
BASELINE_S_PER_UNIT = 5e-4


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    sim: object          # SimResult
    origin: str          # milp | milp-act | baseline:<policy> | min-gpu


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


def bytes_text(n: int) -> str:
    """A size as ``plan`` names it: human and exact."""
    return f"{fmt_bytes(n)} ({n} B)"



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


def baselines(profile, path, budgets, cm: CostModel, nvme_dir, clock=None,
              skipped: list | None = None) -> list[Candidate]:
    """Every baseline as a candidate, on ``cm`` (its spec, K and homes) under ``budgets``.
    With ``clock``, one that would not finish in the time left (judged by the one before it;
    the first by ``BASELINE_S_PER_UNIT``) is skipped and named in ``skipped``: on 10,000 units
    each takes seconds."""
    hw = cm.hw
    out = []
    est = [BASELINE_S_PER_UNIT * cm.U]
    breaks = profile.model.get("chain_breaks")
    kept = profile.model.get("not_replayable")

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
            layers = baseline_layers(pol, profile.layers, hw, breaks, kept)
            plan, r = timed(lambda: plan_and_sim(profile, path, hw, budgets, pol, layers,
                                                 nvme_dir=nvme_dir, cm=cm))
        except UserError:
            continue                      # not valid on this spec / these budgets
        out.append(Candidate(plan, r, f"baseline:{pol.value}"))
    streamed, recomputed = [], None
    for pol in (Policy.RECOMPUTE_ALL, Policy.KEEP_ALL):
        layers = stream_all_layers(cm, baseline_layers(pol, profile.layers, hw, breaks, kept))
        if layers is None:
            break
        if pol is Policy.RECOMPUTE_ALL:
            recomputed = layers
        if not room(f"stream-all+{pol.value}"):
            continue
        try:
            plan, r = timed(lambda: plan_and_sim(profile, path, hw, budgets, "stream-all",
                                                 layers, nvme_dir=nvme_dir, cm=cm))
        except UserError:
            continue
        streamed.append(Candidate(plan, r, f"baseline:stream-all+{pol.value}"))
    out += streamed
    if streamed and not any(c.sim.fits for c in streamed):
        out += _checkpoints_off_device(profile, path, budgets, cm, recomputed, nvme_dir, room,
                                       timed)
    return out


def _checkpoints_off_device(profile, path, budgets, cm: CostModel, layers, nvme_dir, room,
                            timed) -> list[Candidate]:
    """``layers`` (stream-all+recompute-all) with every block's checkpoint on the host, then on
    NVMe: the plans that still fit when the device cannot hold one checkpoint per block (a large
    batch on a model streamed whole). Tried only when the stream-all baselines do not fit."""
    hw = cm.hw
    out = []
    for tier in (Tier.CPU, Tier.NVME):
        name = f"stream-all+recompute-all/checkpoints-{tier.value}"
        if layers is None or not cm.budget[tier.value] or not room(name):
            continue
        moved = [LayerDecision(d.name, d.activation, tier, d.home)
                 if d.activation is Activation.RECOMPUTE and d.checkpoint is Tier.GPU else d
                 for d in layers]
        try:
            plan, r = timed(lambda: plan_and_sim(profile, path, hw, budgets, "stream-all", moved,
                                                 nvme_dir=nvme_dir, cm=cm))
        except UserError:
            continue
        out.append(Candidate(plan, r, f"baseline:{name}"))
        if r.fits:
            break
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


def milp(profile, path, cfg: SolveConfig, cm: CostModel, *, origin, clock, warm,
         share: float = 1.0, incumbent: float | None = None) -> Candidate | None:
    """One MILP strategy on ``cm`` (with ``cfg``'s margin below the device budget): solve
    within ``share`` of the time left; None if it has no solution or no time, or if its LP
    relaxation proves that it cannot beat ``incumbent`` (the best candidate's step) by more
    than the gap."""
    left = clock.left()
    if left is not None:
        if _milp_size(cm) / BUILD_ROWS_PER_S > left * 0.5:
            clock.skipped.append("the activation-only MILP" if origin == "milp-act" else
                                 "the joint MILP")
            return None               # it would not even be built in time: baselines only
        left = max(1.0, left * share)
    t0 = time.perf_counter()
    m = Model(cfg.milp_model(cm))
    if clock.left() is not None:
        left = max(0.5, min(left, clock.left() - clock.sim_s))
    try:
        out = solvers.solve(m, cfg.solver, left, cfg.gap, warm=warm, progress=cfg.progress,
                            incumbent=incumbent)
    except (solvers.Infeasible, solvers.NoIncumbent, solvers.NothingBetter):
        return None
    except solvers.SolverFailed as e:
        # one strategy lost: the others' candidates still stand
        warn(f"{e}; the {origin} strategy is left out")
        return None
    rec = SolverRecord(name=cfg.solver, status=out.status, origin=origin,
                       objective=out.solution.objective, gap=out.gap,
                       solve_s=round(time.perf_counter() - t0, 4), variables=out.variables,
                       constraints=out.constraints)
    if out.solution.prefetch_bytes:
        cm = dataclasses.replace(cm, prefetch_bytes=out.solution.prefetch_bytes)
    plan, r = plan_and_sim(profile, path, cm.hw, cfg.budgets, "optimal", out.solution.layers,
                           shares=out.solution.shares, solver=rec, nvme_dir=cfg.nvme_dir, cm=cm)
    return Candidate(plan, r, origin)


def _seed_candidates(seeds, budgets: Budgets, profile=None, profile_path=None,
                     cm: CostModel | None = None, nvme_dir=None) -> list[Candidate]:
    """Each seed plan under ``budgets``: a candidate where it fits. A seed of this profile
    (``plan sweep``'s previous point) is replayed again by the simulator, its decisions and
    schedule unchanged; one of another profile of the same units, or of another K or
    micro-batch order (``plan search``'s fastest cell so far), gives its decisions, planned
    anew on ``cm`` (its transfers placed greedily), where they are valid here."""
    out = []
    for plan in seeds:
        same = profile is None or (list(plan.units) == list(profile.layers) and (
            plan.micro_batches, plan.micro_batch_order) == (cm.K, cm.micro_batch_order))
        if same:
            plan = dataclasses.replace(plan, budgets=budgets)
            r = simulate(plan)
        elif [d.name for d in plan.layers] == [u.name for u in profile.layers]:
            try:
                plan, r = plan_and_sim(profile, profile_path, cm.hw, budgets, plan.policy,
                                       plan.layers, nvme_dir=nvme_dir, cm=cm)
            except UserError:
                continue              # a decision not valid here (a home this spec lacks)
        else:
            continue
        if r.fits:
            out.append(Candidate(plan, r, "seed"))
    return out


def _pick(cands: list[Candidate]) -> Candidate | None:
    """The fastest candidate that fits (ties: the MILP's, then the first tried)."""
    fitting = [c for c in cands if c.sim.fits]
    if not fitting:
        return None
    return min(fitting, key=lambda c: (c.sim.step_s, not c.origin.startswith("milp")))


