"""``plan solve``: budgets in, a plan that the simulator says fits out.

Every plan is simulated before it is written and one that breaks a budget never is. For the
``optimal`` policy the baselines are simulated too: the best that fits warm-starts the MILP,
and the MILP's plan is written only if it is at least as fast (in the simulator) as that
baseline; otherwise the baseline's decisions are written and the solver status says so. When
the MILP's plan needs budget tightening or simulates more than 2% off its objective, the exact
prefetch-start model is solved too, in the time left (``_escalate``, docs/formulation.md).
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

from .errors import NoFitError, UserError
from .formats import Plan, Policy, Profile, load_profile, write_json_atomic
from .formulation import Budgets, Infeasible, Options, run_solver, Formulation, GB
from .sizes import fmt_bytes, fmt_seconds, parse_size

# How often an optimistic MILP plan (overflowing in the simulator) is re-solved with the GPU
# budget tightened by the overflow before we give up (exit 3).
MAX_TIGHTEN = 3
# The fast model counts a prefetch's bytes share by share, the simulator holds the whole buffer
# from its start; past this relative miss (simulated step vs objective) the exact prefetch-start
# model is solved too (8-block test profile: 215.8 ms model vs 226.5 ms simulated, 5%).
EXACT_MISS = 0.02


@dataclass
class SolveOutcome:
    """The written plan and what was tried on the way (for benches and tests)."""

    plan: Plan
    milp_objective: float | None
    baselines: dict          # policy -> (step_s, fits, peak_gpu_bytes)
    fallback: str | None     # baseline written instead of the MILP's plan, if any
    attempts: int


def _simulate(plan):
    from .simulate import simulate
    return simulate(plan)


def _make(profile, path, hw, budgets, policy, layers, issue=None, info=None, nvme_dir=None):
    from .plans import make_plan
    return make_plan(profile, path, hw, budgets, policy, layers, prefetch_issue=issue,
                     solver_info=info, nvme_dir=nvme_dir)


def _budget_dict(b: Budgets) -> dict:
    return {"gpu_bytes": b.gpu_bytes, "cpu_bytes": b.cpu_bytes, "nvme_bytes": b.nvme_bytes}


def _size(n: int) -> str:
    return f"{fmt_bytes(n)} ({n} B)"


def check_static(profile: Profile, budgets: Budgets) -> None:
    """Parameters, gradients and optimizer state stay on the GPU in this version."""
    static = profile.static_bytes + int(profile.optimizer_workspace_bytes)
    if static > budgets.gpu_bytes:
        raise NoFitError(
            f"static state (weights, grads, optimizer) needs {_size(static)} > --gpu-mem "
            f"{_size(budgets.gpu_bytes)}: the static state alone exceeds --gpu-mem, before any "
            f"activation; parameter offloading is not supported yet (a later step)",
            budget="gpu", needed_bytes=static)


def evaluate_baselines(profile, path, hw, budgets: Budgets, policies, nvme_dir=None) -> dict:
    """policy -> (plan, SimResult) for each baseline that is valid on ``hw``."""
    from .baselines import baseline_layers
    out = {}
    for pol in policies:
        try:
            layers = baseline_layers(pol, profile.layers, hw)
            plan = _make(profile, path, hw, _budget_dict(budgets), pol, layers, nvme_dir=nvme_dir)
        except UserError:
            continue
        out[pol] = (plan, _simulate(plan))
    return out


def _prefetch_key(name: str, r) -> str | None:
    """The id of the prefetch event of ``name`` in the simulator's transfers (None if none)."""
    ev = r.transfers.get(name, {})
    # the H2D copy where there is a host tier; the disk read fills device memory when unified
    for kind in ("in", "ckin", "r", "ckr"):
        if f"{kind}:{name}" in ev:
            return f"{kind}:{name}"
    return None


def _repair(profile, path, hw, bd, policy, layers, issue, info, nvme_dir, plan, r, limit):
    """Delay, one at a time, the explicitly placed prefetches whose buffer is held at the GPU
    peak (the simulator holds a prefetch's whole buffer from its start), earliest start first,
    to the schedule's default one-ahead point, until the plan fits or none is left.

    Returns (plan, r) of the last plan tried; at most ``limit`` simulations.
    """
    issue = dict(issue)
    for _ in range(limit):
        if r.fits or r.peak_gpu_bytes <= bd["gpu_bytes"]:
            break
        t = r.peak_gpu_time
        held = []
        for name in issue:
            eid = _prefetch_key(name, r)
            if eid is None:
                continue
            start = r.transfers[name][eid][0]
            # a buffer is held from its start to its consumer's end; a start after the peak
            # cannot be part of it
            if start <= t:
                held.append((start, name))
        if not held:
            break
        del issue[min(held)[1]]
        plan = _make(profile, path, hw, bd, policy, layers, issue, info, nvme_dir)
        r = _simulate(plan)
    return plan, r


def place_prefetches(profile, path, hw, budgets: Budgets, policy, layers, candidates, info=None,
                     nvme_dir=None):
    """Simulate the MILP's decisions with each candidate set of prefetch issue points (and a
    greedy repair of the one closest to fitting); return ((plan, r) of the fastest that fits
    or None, (plan, r) of the one with the smallest GPU peak)."""
    bd = _budget_dict(budgets)
    tried = []
    for issue in candidates or [{}]:
        try:
            plan = _make(profile, path, hw, bd, policy, layers, issue, info, nvme_dir)
        except UserError:   # an issue point the schedule rejects: not a candidate
            continue
        tried.append((issue, plan, _simulate(plan)))
    fitting = [(p, r) for _, p, r in tried if r.fits]
    if not fitting and tried:
        issue, plan, r = min(tried, key=lambda x: x[2].peak_gpu_bytes)
        if r.peak_cpu_bytes <= bd["cpu_bytes"] and r.peak_nvme_bytes <= bd["nvme_bytes"]:
            plan, r = _repair(profile, path, hw, bd, policy, layers, issue, info, nvme_dir,
                              plan, r, limit=len(issue) + 1)
            tried.append((None, plan, r))
            if r.fits:
                fitting = [(plan, r)]
    best = min(fitting, key=lambda x: x[1].step_s) if fitting else None
    lowest = min(((p, r) for _, p, r in tried), key=lambda x: x[1].peak_gpu_bytes, default=None)
    return best, lowest


def _min_gpu(profile, path, hw, budgets: Budgets, options: Options, solver, time_limit,
             nvme_dir=None):
    """(plan, r) of the MILP minimising the GPU peak, placed like any MILP plan; None if the
    model has no solution under the host/NVMe budgets."""
    f = Formulation(profile.layers, hw, budgets, profile.optimizer_s,
                    profile.optimizer_workspace_bytes,
                    dataclasses.replace(options, minimise="gpu"))
    try:
        res = run_solver(f, solver, time_limit, 1e-3)
    except Infeasible:
        return None
    info = res.solver_info()
    info["status"] += " (smallest GPU peak: no faster plan fitted)"
    info["objective"] = None
    best, lowest = place_prefetches(profile, path, hw, budgets, "optimal", res.layers,
                                    res.prefetch_alternatives, info, nvme_dir)
    return best or lowest


def _escalate(profile, path, hw, budgets: Budgets, policy, opts: Options, solver, gap, nvme_dir,
              progress, res, fit, time_limit, t0):
    """(res, fit) of the exact prefetch-start model when the fast model's plan needs budget
    tightening (``fit`` is None) or simulates more than EXACT_MISS off its objective, and the
    exact plan fits and simulates faster; None to keep the fast one.

    The exact model is solved in what is left of ``time_limit``, warm-started from the fast
    model's decisions (CBC 3.2 / 14.4 / >60 s at 48 / 96 / 192 blocks, docs/formulation.md).
    """
    if fit is not None and abs(fit[1].step_s - res.objective) <= EXACT_MISS * res.objective:
        return None
    left = None
    if time_limit is not None:
        left = time_limit - (time.perf_counter() - t0)
        if left < 1.0:
            return None
    try:
        ex = run_solver(Formulation(profile.layers, hw, budgets, profile.optimizer_s,
                                    profile.optimizer_workspace_bytes,
                                    dataclasses.replace(opts, exact_prefetch=True)),
                        solver, left, gap, res.layers, progress)
    except Infeasible:
        return None
    info = ex.solver_info()
    why = ("needed budget tightening" if fit is None else
           f"simulated {fit[1].step_s / res.objective - 1:+.1%} off its objective")
    info["status"] += f" (exact prefetch model: the fast model's plan {why})"
    xfit, _ = place_prefetches(profile, path, hw, budgets, policy, ex.layers,
                               ex.prefetch_alternatives, info, nvme_dir)
    if xfit is None or (fit is not None and xfit[1].step_s >= fit[1].step_s):
        return None
    return ex, xfit


def _no_fit(budgets: Budgets, tried: dict, extra) -> NoFitError:
    """Name the short budget and the smallest --gpu-mem tierplan found a plan for (a bound
    from the baselines and the GPU-minimising MILP, checked in the simulator, not a proof)."""
    best = None   # peak gpu bytes
    for plan, r in [*tried.values(), *([extra] if extra else [])]:
        if r.peak_cpu_bytes <= budgets.cpu_bytes and r.peak_nvme_bytes <= budgets.nvme_bytes:
            if best is None or r.peak_gpu_bytes < best:
                best = r.peak_gpu_bytes
    tiers = f"--cpu-mem {_size(budgets.cpu_bytes)} and --nvme-mem {_size(budgets.nvme_bytes)}"
    if best is None:
        return NoFitError(f"tierplan found no plan for --gpu-mem {_size(budgets.gpu_bytes)} with "
                          f"{tiers}, nor for any --gpu-mem with these host/NVMe budgets; raise "
                          "--cpu-mem/--nvme-mem or --gpu-mem", budget="gpu")
    return NoFitError(f"tierplan found no plan for --gpu-mem {_size(budgets.gpu_bytes)} with "
                      f"{tiers}: the smallest --gpu-mem it found a plan for is {_size(best)}; "
                      "raise --gpu-mem to that", budget="gpu", needed_bytes=best)


def _share(time_limit: float | None, t0: float, attempt: int, opts: Options) -> float | None:
    """Seconds for the fast model's solve number ``attempt`` within the one --time-limit of the
    whole ``plan solve``: the first gets half, so that the exact re-solve (``_escalate``) has the
    other half when it is needed; later ones (budget tightening) what is left, at least 2 s."""
    if time_limit is None:
        return None
    left = time_limit - (time.perf_counter() - t0)
    if attempt == 1 and not opts.exact_prefetch:
        return max(1.0, min(left, time_limit / 2))
    return max(2.0, left)


def solve_profile(profile: Profile, profile_path, hw, budgets: Budgets, policy: str = "optimal",
                  *, solver: str = "cbc", time_limit: float | None = 60.0, gap: float = 0.01,
                  nvme_dir: str | None = None, progress: bool = False,
                  options: Options | None = None) -> SolveOutcome:
    """The plan ``plan solve`` writes: fits in the simulator, or ``NoFitError``."""
    from .baselines import BASELINES
    policy = getattr(policy, "value", policy)
    check_static(profile, budgets)
    bd = _budget_dict(budgets)

    if policy not in (Policy.OPTIMAL.value, Policy.REMAT_ONLY.value):
        tried = evaluate_baselines(profile, profile_path, hw, budgets, [policy], nvme_dir)
        if policy not in tried:
            raise UserError(f"--policy {policy}: not valid on the hardware spec {hw.name!r}")
        plan, r = tried[policy]
        if not r.fits:
            raise NoFitError(f"the {policy} plan does not fit: {r.budget_violations[0]}; "
                             f"raise that budget to at least its peak, or use --policy optimal",
                             budget=r.budget_violations[0].split(":")[0])
        return SolveOutcome(plan, None, {policy: (r.step_s, r.fits, r.peak_gpu_bytes)}, None, 0)

    remat = policy == Policy.REMAT_ONLY.value
    opts = options or Options()
    if remat:
        opts = dataclasses.replace(opts, allow_offload=False)
    pols = [p.value for p in BASELINES]
    if remat:
        pols = [p for p in pols if p != Policy.OFFLOAD_ALL.value]
    tried = evaluate_baselines(profile, profile_path, hw, budgets, pols, nvme_dir)
    fitting = {p: v for p, v in tried.items() if v[1].fits}
    best = min(fitting, key=lambda p: fitting[p][1].step_s) if fitting else None
    warm = fitting[best][0].layers if best else None

    model_budgets = budgets
    cand, res, attempts = None, None, 0
    t0 = time.perf_counter()
    while attempts <= MAX_TIGHTEN:
        attempts += 1
        try:
            res = run_solver(Formulation(profile.layers, hw, model_budgets, profile.optimizer_s,
                                         profile.optimizer_workspace_bytes, opts),
                             solver, _share(time_limit, t0, attempts, opts), gap, warm, progress)
        except Infeasible:
            break
        info = res.solver_info()
        if model_budgets.gpu_bytes != budgets.gpu_bytes:
            info["status"] += f" (gpu budget tightened to {model_budgets.gpu_bytes} B)"
        # The decisions first, with other prefetch issue points; tighten only if none fits.
        fit, (plan, r) = place_prefetches(profile, profile_path, hw, budgets, policy, res.layers,
                                          res.prefetch_alternatives, info, nvme_dir)
        if attempts == 1 and not opts.exact_prefetch:
            ex = _escalate(profile, profile_path, hw, budgets, policy, opts, solver, gap,
                           nvme_dir, progress, res, fit, time_limit, t0)
            if ex is not None:
                res, fit = ex
        if fit is not None:
            cand = fit
            break
        over = r.peak_gpu_bytes - budgets.gpu_bytes
        if over <= 0:   # a host/NVMe overflow: tightening the GPU budget would not help
            break
        model_budgets = dataclasses.replace(
            model_budgets, gpu_bytes=model_budgets.gpu_bytes - over - 1)

    summary = {p: (v[1].step_s, v[1].fits, v[1].peak_gpu_bytes) for p, v in tried.items()}
    if cand is not None and (best is None or cand[1].step_s <= fitting[best][1].step_s * (1 + 1e-9)):
        return SolveOutcome(cand[0], res.objective, summary, None, attempts)
    if best is not None:
        bplan, br = fitting[best]
        why = ("MILP plan simulated slower" if cand is not None else
               "MILP plan did not fit in the simulator" if res is not None else "MILP infeasible")
        info = {"name": solver, "status": f"fallback:{best} ({why})", "objective": br.step_s,
                "gap": res.gap if res else None, "solve_s": res.solve_s if res else 0.0,
                "variables": res.variables if res else 0,
                "constraints": res.constraints if res else 0}
        plan = dataclasses.replace(bplan, policy=policy, solver=info)
        return SolveOutcome(plan, res.objective if res else None, summary, best, attempts)
    # Before exit 3: the plan with the smallest GPU peak the MILP finds; if it fits, write it.
    low = _min_gpu(profile, profile_path, hw, budgets, opts, solver, time_limit, nvme_dir)
    if low is not None and low[1].fits:
        return SolveOutcome(dataclasses.replace(low[0], policy=policy), None, summary, None,
                            attempts + 1)
    raise _no_fit(budgets, tried, low)


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
    ratio = p["step_s"] / p["compute_s"] if p["compute_s"] else float("nan")
    return (f"{plan.policy}: step {fmt_seconds(p['step_s'])} = {ratio:.3f}x compute-only "
            f"({fmt_seconds(p['compute_s'])}); peaks GPU {fmt_bytes(p['peak_gpu_bytes'])} / "
            f"{fmt_bytes(b['gpu_bytes'])}, host {fmt_bytes(p['peak_cpu_bytes'])} / "
            f"{fmt_bytes(b['cpu_bytes'])}, NVMe {fmt_bytes(p['peak_nvme_bytes'])} / "
            f"{fmt_bytes(b['nvme_bytes'])}")


def cli_solve(args) -> int:
    profile = load_profile(args.profile)
    if args.hardware:
        from .hardware import load_hardware
        hw = load_hardware(args.hardware)
        if hw.name != profile.hardware_spec.name:
            _warn(f"--hardware {args.hardware}: the profile was taken for "
                  f"{profile.hardware_spec.name!r}; times and attention bytes come from the "
                  f"profile's hardware; re-profile with --hardware {args.hardware} for exact "
                  "figures")
    else:
        hw = profile.hardware_spec
    budgets = parse_budgets(args, hw)
    if args.time_limit is not None and not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise UserError(f"--time-limit {args.time_limit}: give a positive number of seconds")
    if not (math.isfinite(args.gap) and args.gap >= 0):
        raise UserError(f"--gap {args.gap}: give a relative gap of 0 or more, e.g. 0.01")
    nvme_dir = args.nvme_dir or os.path.join(tempfile.gettempdir(), "tierplan-nvme")
    out = solve_profile(profile, args.profile, hw, budgets, args.policy, solver=args.solver,
                        time_limit=args.time_limit, gap=args.gap, nvme_dir=nvme_dir,
                        progress=sys.stderr.isatty())
    path = Path(args.output) if args.output else (
        Path("plans") / f"{Path(args.profile).stem}-{str(args.gpu_mem).strip()}.json")
    write_json_atomic(path, out.plan.to_dict())
    print(path)
    print(summary_line(out.plan))
    return 0
