"""When no plan fits: the smallest budget for which one exists, found by the joint MILP
minimising the device's (or the host's) peak, and the one-line error (exit 3) that names it;
the GPU-minimising plan as a last candidate; the static floor no plan can go below.
"""
from __future__ import annotations

import dataclasses
import math

from planner.costmodel import CostModel
from planner.errors import NoFitError
from planner.plans import plan_and_sim
from planner.formats import SolverRecord
from planner.sizes import fmt_bytes
from planner.solve import solvers
from planner.solve.config import SolveConfig
from planner.solve.milp import GB, Model, Options
from planner.solve.strategies import BUILD_ROWS_PER_S, Candidate, _milp_size
from planner.solve.strategies import bytes_text as _size

def _min_budget(cfg: SolveConfig, cm: CostModel, clock, tier: str):
    """The smallest budget of ``tier`` for which a plan exists on ``cm`` with the other two
    as given, from the joint MILP minimising it (gap 1e-4): ``(bytes, solution)``; None when
    none exists, "no time" when the MILP would not be built in time."""
    left = clock.left()
    if left is not None and _milp_size(cm) / BUILD_ROWS_PER_S > left * 0.5:
        clock.skipped.append(f"the search for the smallest --{tier}-mem")
        return "no time"          # it would not even be built in time (docs/reliability.md)
    m = Model(cm, Options(minimise=tier))
    left = clock.left()
    try:
        out = solvers.solve(m, cfg.solver, None if left is None else max(2.0, left), 1e-4)
    except solvers.Infeasible:
        return None
    except solvers.NoIncumbent:
        raise NoFitError(f"no plan was found within --time-limit {clock.limit:g} s, and none was "
                         "proven impossible; give it more time (--time-limit) or more memory",
                         budget="time") from None
    if tier == "gpu":
        return cfg.gpu_budget_for(int(math.ceil(m.Gvar.value() * GB))), out.solution
    # twice the margin the time-minimising solve keeps below a budget, as for the device's
    return int(math.ceil(m.Hvar.value() * GB)) + 2 * cfg.margin_bytes, out.solution


def _min_gpu_candidate(profile, path, cfg: SolveConfig, cm: CostModel, clock):
    """The GPU-minimising joint MILP's plan on ``cm`` as a candidate (None if it has none)."""
    got = _min_budget(cfg, cm, clock, "gpu")
    if not isinstance(got, tuple) or got[0] > cfg.budgets.gpu_bytes:
        return None
    rec = SolverRecord(name=cfg.solver, status="smallest GPU peak (no faster plan was found in "
                       "time)", origin="min-gpu")
    plan, r = plan_and_sim(profile, path, cm.hw, cfg.budgets, "optimal", got[1].layers,
                           shares=got[1].shares, solver=rec, nvme_dir=cfg.nvme_dir, cm=cm)
    return Candidate(plan, r, "min-gpu")


def _no_fit(cfg: SolveConfig, cm: CostModel, clock, n_tried: int = 1) -> NoFitError:
    """Name the short budget of ``cfg`` and the smallest that fits on ``cm`` (found by the
    solver)."""
    budgets, stream_off = cfg.budgets, cfg.stream == "off"
    tiers = (f"--cpu-mem {_size(budgets.cpu_bytes)} and --nvme-mem {_size(budgets.nvme_bytes)}")
    got = _min_budget(cfg, cm, clock, "gpu")
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
                   + ("--policy remat-only keeps it on the device: drop --policy remat-only "
                      "to let it stream)" if cfg.policy == "remat-only" else
                      "--stream off keeps it on the device: drop --stream off and give "
                      "--cpu-mem or --nvme-mem)" if stream_off else
                      "with these budgets nothing can live off the device: give --cpu-mem or "
                      "--nvme-mem)"))
        return NoFitError(f"no plan fits --gpu-mem {_size(budgets.gpu_bytes)} with {tiers}{why}: "
                          f"the smallest --gpu-mem with a plan is {_size(need)}; raise --gpu-mem "
                          f"to that{_over_device(cm.hw, need)}", budget="gpu", needed_bytes=need)
    if not cm.unified:
        # the host's budget is what is minimised; with --cpu-mem 0 the model has no host
        # choices: the search takes the same model with a host tier
        big = cm if cm.has_cpu else dataclasses.replace(cm, cpu_bytes=10**15)
        got = _min_budget(cfg, big, clock, "cpu")
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


def _over_device(hw, need: int) -> str:
    """Where the budget exit 3 names is more than the device has (a diffusers UNet named
    144.74 GiB on an 80 GiB A100): the same line says so, and what makes the units' work
    smaller; else nothing."""
    mem = int(getattr(hw, "memory_bytes", 0) or 0)
    if not mem or need <= mem:
        return ""
    return (f"; that is more than the {hw.name}'s {fmt_bytes(mem)}: split the model into "
            "smaller units (plan profile --blocks) or profile a smaller batch")


def _static_floor(cm: CostModel) -> int:
    """Device bytes held for the whole step whatever the decisions: each unit's leanest home
    on the device, a key/value cache, an engine's own buffers (a lower bound of every plan's
    peak; the budget it is compared with is already less the spec's reserve)."""
    return (sum(min(cm.resident(i, h)["gpu"] for h in cm.homes[i]) for i in range(cm.U))
            + cm.cache + int(getattr(cm, "engine_static", 0)))

