"""The judge of every plan: a replay of its schedule, stage by stage (``plan simulate``).

It trusts only the plan's decisions, its units (times and bytes from the profile), its
hardware spec and its events. It rebuilds the cost model for the plan's budgets, reads every
transfer's share back from the events, checks that the schedule is exactly the one the
decisions and those shares imply (``planner.costmodel.schedule.build_schedule``), and then evaluates
the cost model with these numbers: each stage lasts as long as its longest resource, memory
per tier is carried from stage to stage (allocations at a stage's start, frees at its end).
The MILP evaluates the same functions with its variables, so its objective and this replay
agree by construction; what this module adds is the check that a plan file is consistent,
and the timeline (``plan inspect``, ``--plot``).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from planner.formats.identity import check_param_table
from planner.costmodel import RESOURCES, TIERS, CostModel, View, decision_choice, evaluate
from planner.errors import NoFitError, UserError
from planner.formats.events import Op, Stream
from planner.formats import Executor, Plan, Tier, io_requests, write_json_atomic
from planner.plans.load import load_plan
from planner.costmodel.options import moot_homes_for, state_up_homes_for
from planner.costmodel.schedule import build_schedule, event_ids, segments, shares_of
from planner.sizes import fmt_bytes, fmt_rate, fmt_seconds


class PlanInconsistent(UserError):
    """The plan's schedule is not what its decisions imply (an edited or corrupted file)."""


@dataclass(frozen=True)
class StageRecord:
    """One stage as replayed (the first pass, then the optimizer phase)."""

    stage: int
    phase: str                    # prologue | forward | backward | optimizer
    unit: str | None              # whose compute opens it (or whose step runs in it)
    start: float
    seconds: float
    seconds_rest: float           # in the passes after the first (== seconds unless they differ)
    loads: dict                   # resource -> seconds
    bound: str                    # the resource that sets its duration
    memory: dict                  # tier -> bytes held during it (the later passes' figure)


@dataclass(frozen=True)
class SimResult:
    step_s: float
    compute_s: float                 # K x (fwd + bwd) + device optimizer: no recompute, no waits
    pass_s: float                    # the first pass
    rest_pass_s: float               # each later pass
    optimizer_s: float               # the optimizer phase
    recompute_s: float               # per pass
    micro_batches: int
    peak_gpu_bytes: int
    peak_cpu_bytes: int
    peak_nvme_bytes: int
    budgets: dict
    fits: bool
    budget_violations: tuple
    busy_s: dict                     # resource -> busy seconds per step
    stall_s: float                   # time stages last beyond their compute, per step
    static_bytes: int                # resident on the device
    staging_bytes: int
    stages: tuple                    # StageRecord per stage
    events: dict                     # event id -> (start, end) in the first pass / the optimizer phase
    flops: float                     # model FLOPs of one step (no recompute)
    overlapped_s: float = 0.0        # optimizer seconds run beside the backward (busiest resource)
    paced_compute_s: float = 0.0     # paced: the device's update seconds in the backward stages

    @property
    def overhead(self) -> float | None:
        return self.step_s / self.compute_s if self.compute_s > 0 else None

    def summary(self) -> dict:
        """The scalar figures (what ``plan simulate --json`` prints)."""
        return {"step_s": self.step_s, "compute_s": self.compute_s, "pass_s": self.pass_s,
                "rest_pass_s": self.rest_pass_s, "optimizer_s": self.optimizer_s,
                "recompute_s": self.recompute_s, "micro_batches": self.micro_batches,
                "overhead": self.overhead, "peak_gpu_bytes": self.peak_gpu_bytes,
                "peak_cpu_bytes": self.peak_cpu_bytes, "peak_nvme_bytes": self.peak_nvme_bytes,
                "budgets": dict(self.budgets), "fits": self.fits,
                "budget_violations": list(self.budget_violations), "busy_s": dict(self.busy_s),
                "stall_s": self.stall_s, "static_bytes": self.static_bytes,
                "staging_bytes": self.staging_bytes, "flops": self.flops,
                "overlapped_s": self.overlapped_s, "paced_compute_s": self.paced_compute_s,
                "tflops": self.flops / self.step_s / 1e12 if self.step_s > 0 else 0.0}


class PlanView(View):
    """The cost model's questions, answered from a plan's decisions and events."""

    def __init__(self, cm: CostModel, layers, shares: dict):
        self.cm = cm
        self._x = [decision_choice(d) for d in layers]
        self._h = [cm.homes[i].index(d.home) for i, d in enumerate(layers)]
        self._s = shares
        self._at: dict = {}
        for kind, i, s in shares:
            self._at.setdefault(s, []).append((kind, i))
        self._e, self._q, self._y, self._rec, self._ck = {}, {}, {}, {}, {}
        for seg in segments(layers):
            first, last = seg[0], seg[-1]
            self._e[last] = 1
            for k in seg[:-1]:
                self._q[k, last] = 1
                self._rec.setdefault(last, []).append(k)
            c = self._x[first]
            if c in ("rc", "rn"):
                self._y[c, first, last] = 1
                self._ck.setdefault(cm.ck_return_stage(first, last), []).append((first, last, c))

    def x(self, i, c):
        return 1 if self._x[i] == c else 0

    def h(self, i, k):
        return 1 if self._h[i] == k else 0

    def share(self, kind, i, s):
        return self._s.get((kind, i, s), 0.0)

    def e(self, i):
        return self._e.get(i, 0)

    def q(self, k, i):
        return self._q.get((k, i), 0)

    def y(self, c, k, e):
        return self._y.get((c, k, e), 0)

    def at(self, s):
        return self._at.get(s, ())

    def recomputed_at(self, i):
        return self._rec.get(i, ())

    def ck_returns(self, s):
        return self._ck.get(s, ())


def cost_model_of(plan: Plan) -> CostModel:
    """The cost model a plan was made under (its budgets, micro-batches and windows)."""
    return CostModel(plan.units, plan.hardware_spec, gpu_bytes=plan.budgets.gpu_bytes,
                     cpu_bytes=plan.budgets.cpu_bytes, nvme_bytes=plan.budgets.nvme_bytes,
                     micro_batches=plan.micro_batches, optimizer_s=plan.optimizer_s,
                     optimizer_workspace_bytes=plan.optimizer_workspace_bytes,
                     optimizer_depth=plan.optimizer_depth,
                     cache_bytes=int(plan.model.get("state_bytes") or 0),
                     chain_breaks=plan.model.get("chain_breaks") or (),
                     not_replayable=plan.model.get("not_replayable") or (),
                     world_size=plan.world_size, ranks_per_node=plan.ranks_per_node,
                     engine=plan.engine, optimizer_overlap=plan.optimizer_overlap,
                     clip=plan.clip, prefetch_bytes=plan.optimizer_prefetch_bytes,
                     micro_batch_order=plan.micro_batch_order,
                     state_up_homes=state_up_homes_for(plan.layers),
                     moot_homes=moot_homes_for(plan.units, plan.layers))


def _check_schedule(plan: Plan, cm: CostModel, shares: dict) -> None:
    """The plan's events must be exactly those its decisions and shares imply."""
    want = event_ids(build_schedule(cm, plan.layers, shares))
    got = event_ids(plan.schedule)
    if set(want) != set(got):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise PlanInconsistent(f"plan: its schedule does not match its layers (missing "
                               f"{missing[:3]}, unexpected {extra[:3]}); regenerate it with "
                               "'plan solve'")
    for eid, w in want.items():
        if got[eid] != w:
            raise PlanInconsistent(f"plan: event {eid} should be {w[1]} bytes on {w[0].value} "
                                   f"({w[2].value} passes), the plan says {got[eid][1]} bytes "
                                   f"on {got[eid][0].value}; regenerate it with 'plan solve'")


def _stage_seconds(cm: CostModel, s: int, v: View, rest: bool) -> tuple[float, dict]:
    if s in cm.L.pass_stages:
        vals = {r: evaluate(t) for r, t in cm.loads(s, v, rest).items()}
        return max(vals.values(), default=0.0), vals
    vals = {r: evaluate(t) for r, t in cm.opt_loads(v).items()}
    chains = [evaluate(t) for t in cm.opt_chains(v)]
    if cm.opt_depth == 1:
        return sum(chains), vals
    return max([max(chains, default=0.0), *vals.values()]), vals


def _overlapped_phase(cm: CostModel, v: View, last: dict) -> tuple[float, dict, float]:
    """The optimizer phase under ``optimizer_overlap: overlapped`` (``OverlapRules``): its
    duration, its loads per resource, and the seconds of optimizer work (on the busiest
    resource) that ran beside the backward. ``last`` maps each backward stage to the last
    pass's (duration, loads)."""
    entries, fixed = cm.opt_work(v, by_release=True)
    rels = [c for c, _ in entries]
    mov = [{r: evaluate(t) for r, t in m.items()} for _, m in entries]
    fixed = {r: evaluate(t) for r, t in fixed.items()}
    rem = cm.overlap_remainder(mov, {s: ld for s, (_, ld) in last.items()},
                               {s: d for s, (d, _) in last.items()}, rels,
                               [q for q in cm.serial_resources() if any(m[q] for _, m in entries)])
    loads = {r: rem[r] + fixed[r] for r in rem}
    # at depth 1 the one worker's chains left for the phase (the worker is no physical
    # resource: its seconds bound the phase but are not a stage load)
    worker = loads.pop("worker", 0.0)
    # each unit's read, step and write back to back fit between its release and the phase's
    # end (with clip global its step and write are in the phase: the whole chain is a floor)
    chain = []
    for j in range(cm.U):
        for rel, t in cm.chain_classes(v, j):
            after = sum(last[s][0] for s in range(rel + 1, 2 * cm.U + 1)) \
                if cm.clip == "none" else 0.0
            chain.append(evaluate(t) - after)
    moved = max((sum(m.get(r, 0.0) for m in mov) - rem[r] for r in rem if r != "worker"),
                default=0.0)
    return max([*chain, *loads.values(), worker, 0.0]), loads, max(0.0, moved)


def check_plan(plan: Plan, source: str | None = None) -> tuple[CostModel, dict]:
    """A plan's own consistency, which every reader checks before using it (the verbs
    through ``simulate``, ``apply_plan`` directly): its parameter table (each parameter in
    one unit, once), every decision and home possible for its unit under the plan's spec and
    budgets, and its events exactly those the decisions imply (``_check_schedule``). A plan
    edited by hand, homes changed and the schedule left as it was, is refused here in one
    line (naming ``source``) before anything acts on its events. Returns the cost model and
    the transfer shares read from the events."""
    name = f"plan '{source}'" if source else "plan"
    try:
        check_param_table(plan.model.get("params"), {u.name for u in plan.units}, name)
    except UserError as e:
        raise PlanInconsistent(str(e)) from None
    try:
        cm = cost_model_of(plan)
        events = [e for evs in plan.schedule.values() for e in evs]
        shares = shares_of(cm, plan.layers, events)
        _check_schedule(plan, cm, shares)
    except NoFitError:
        raise
    except UserError as e:
        msg = str(e)
        msg = msg[len("plan: "):] if msg.startswith("plan: ") else msg
        if ";" not in msg:
            msg += " (its schedule is not what its decisions imply); regenerate it with 'plan solve'"
        raise PlanInconsistent(f"{name}: {msg}") from None
    return cm, shares


def simulate(plan: Plan) -> SimResult:
    """Replay ``plan`` stage by stage under its own cost model: each stage's duration and
    loads, the memory held per tier, the step time, the peaks against the budgets. Refuses
    (``PlanInconsistent``) a plan whose events are not what its decisions imply."""
    cm, shares = check_plan(plan)
    v = PlanView(cm, plan.layers, shares)
    L, K, n_pass = cm.L, cm.K, cm.passes
    rest = cm.needs_rest_pass()

    base = {t: evaluate(x) for t, x in cm.base(v).items()}
    base_opt = {t: evaluate(x) for t, x in cm.base(v, optimizer_phase=True).items()}
    staging = max((evaluate(n) for n in cm.staging_needs(v)), default=0.0)
    pool_tier = "gpu" if cm.unified else "cpu"
    stages, mem_peak = [], {t: 0.0 for t in TIERS}
    carried = {t: 0.0 for t in TIERS}
    prev_free = {t: 0.0 for t in TIERS}
    t0 = 0.0
    pass_s = rest_s = opt_s = recompute_s = stall = overlapped_s = in_backward_s = 0.0
    busy = {r: 0.0 for r in RESOURCES}
    last = {}                       # backward stage -> the last pass's (seconds, loads)
    held, opt_ws = _largest(cm.opt_transients(v)), _largest(cm.opt_workspaces(v))
    for s in range(L.n_stages):
        in_pass = s in L.pass_stages
        if in_pass:
            alloc = {t: evaluate(x) for t, x in cm.alloc(s, v, rest).items()}
            for t in TIERS:
                carried[t] += alloc[t] - prev_free[t]
            prev_free = {t: evaluate(x) for t, x in cm.free(s, v, rest).items()}
            ws = max(evaluate(c) for c in cm.transient(s, v))
            mem = {t: base[t] + carried[t] for t in TIERS}
            mem["gpu"] += cm.shared[s] + ws
            if cm.overlapped and s > cm.U:
                _overlap_memory(cm, mem, held, opt_ws)
        else:
            mem = _opt_memory(cm, base_opt, held, opt_ws)
        if staging:
            mem[pool_tier] += staging
        for t in TIERS:
            mem_peak[t] = max(mem_peak[t], mem[t])
        if in_pass or not cm.overlapped:
            dur, loads = _stage_seconds(cm, s, v, False)
        else:
            dur, loads, overlapped_s = _overlapped_phase(cm, v, last)
        dur_r = _stage_seconds(cm, s, v, True)[0] if (in_pass and rest) else dur
        if in_pass and s > cm.U:
            last[s] = _stage_seconds(cm, s, v, True) if cm.last_pass_rest() else (dur, loads)
        if in_pass:
            pass_s += dur
            rest_s += dur_r
            i = L.unit_of(s)
            if s > cm.U and i is not None:
                paced = evaluate(cm.paced_compute(s, v))     # paced updates: no recompute
                recompute_s += loads["compute"] - cm.b[i] - paced
                in_backward_s += paced
            stall += (dur - loads["compute"]) + (n_pass - 1) * (dur_r - loads["compute"])
        else:
            opt_s += dur
            stall += dur - max(loads["compute"], loads["host"])
        for r, x in loads.items():          # RESOURCES, and net under a sharded engine
            busy[r] = busy.get(r, 0.0) + x * (n_pass if in_pass else 1)
        i = L.unit_of(s)
        stages.append(StageRecord(stage=s, phase=L.phase(s),
                                  unit=None if i is None else cm.units[i].name, start=t0,
                                  seconds=dur, seconds_rest=dur_r, loads=loads,
                                  bound=_bound(loads),
                                  memory={t: int(round(mem[t])) for t in TIERS}))
        t0 += dur
    step = pass_s + (n_pass - 1) * rest_s + opt_s
    budgets = plan.budgets
    peaks = {t: int(round(mem_peak[t])) for t in TIERS}
    violations = _violations(cm, budgets, peaks)
    flops = K * sum(u.fwd_flops + u.bwd_flops for u in cm.units)
    return SimResult(
        step_s=step, compute_s=cm.compute_only(), pass_s=pass_s, rest_pass_s=rest_s,
        optimizer_s=opt_s, recompute_s=recompute_s, micro_batches=K,
        peak_gpu_bytes=peaks["gpu"], peak_cpu_bytes=peaks["cpu"], peak_nvme_bytes=peaks["nvme"],
        budgets=budgets.to_dict(), fits=not violations, budget_violations=tuple(violations),
        busy_s=busy, stall_s=stall, static_bytes=int(base["gpu"]), staging_bytes=int(staging),
        stages=tuple(stages), events=_event_times(plan, cm, stages), flops=float(flops),
        overlapped_s=overlapped_s, paced_compute_s=in_backward_s)


def _largest(per_tier: dict) -> dict:
    """Per tier, the largest of its Lins (one per unit) as evaluated under the plan."""
    return {t: max((evaluate(x) for x in per), default=0.0) for t, per in per_tier.items()}


def _opt_memory(cm: CostModel, base_opt: dict, held: dict, opt_ws: dict) -> dict:
    """Bytes per tier in the optimizer phase: every home's resident bytes (gradients on the
    device included), ``opt_depth`` units' steps in flight, the largest step's workspace
    where it runs, and under clip global the state read ahead during the backward."""
    mem = {t: base_opt[t] + cm.opt_depth * held[t] + opt_ws[t] for t in TIERS}
    if cm.overlapped and cm.clip == "global":
        mem[cm.prefetch_tier()] += cm.prefetch_bytes
    return mem


def _overlap_memory(cm: CostModel, mem: dict, held: dict, opt_ws: dict) -> None:
    """What the optimizer work beside a backward stage holds (``OverlapRules``): with clip
    none, ``opt_depth`` units' steps in flight and the device step's workspace (as in the
    optimizer phase); with clip global,
    the state read ahead, held until the phase. Counted in every pass's backward (the last
    pass's figure, the largest). (Paced steps are the stages' own allocations: ``alloc``.)"""
    if cm.clip == "none":
        for t in TIERS:
            mem[t] += cm.opt_depth * held[t] + opt_ws[t]    # a step's own workspace
    else:
        mem[cm.prefetch_tier()] += cm.prefetch_bytes


def _bound(loads: dict) -> str:
    """The resource that sets a stage's duration: compute unless another exceeds it (beyond
    rounding: the MILP sets link loads exactly equal to compute where it can)."""
    top = max(loads.values(), default=0.0)
    return "compute" if loads.get("compute", 0.0) >= top * (1 - 1e-9) else \
        max(loads, key=loads.get)


def _violations(cm: CostModel, budgets, peaks: dict) -> list[str]:
    """One line per tier whose peak exceeds what the plan may use there: the budget, less
    the spec's reserve on the device, and at most the pinned-memory limit on the host."""
    violations = []
    for t in TIERS:
        cap = cm.budget[t]
        if peaks[t] > cap:
            what = "the budget"
            if cap < budgets.of(t):
                what = "the pinned-memory limit" if t == "cpu" else \
                    f"the budget less the spec's reserved_bytes {fmt_bytes(budgets.of(t) - cap)}"
            if cap == 0:
                violations.append(f"{t}: budget 0 means the tier stays unused, but the plan "
                                  f"peaks at {fmt_bytes(peaks[t])} ({peaks[t]} B)")
            else:
                violations.append(f"{t}: peak {fmt_bytes(peaks[t])} ({peaks[t]} B) exceeds "
                                  f"{what} {fmt_bytes(cap)} ({cap} B) by "
                                  f"{fmt_bytes(peaks[t] - cap)}")
    return violations


def _event_times(plan: Plan, cm: CostModel, stages) -> dict:
    """(start, end) of every event in the first pass and the optimizer phase: each stream
    runs its events of a stage back to back from the stage's start (for plots and tables;
    the stage's duration is what the cost model says)."""
    start = {r.stage: r.start for r in stages}
    hw = cm.hw
    out, cursor = {}, {}
    for e in plan.all_events():
        if e.stage not in start:
            continue
        key = (e.stream, e.stage)
        t = cursor.get(key, start[e.stage])
        if e.is_transfer:
            rate = {Stream.D2H: hw.d2h_bandwidth, Stream.H2D: hw.h2d_bandwidth,
                    Stream.NVME: hw.nvme_write_bandwidth if e.op is Op.WRITE else hw.nvme_read_bandwidth}.get(e.stream)
            d = e.bytes / rate if rate else e.seconds
        else:
            d = e.seconds
        out[e.id] = (t, t + d)
        cursor[key] = t + d
    return out


# ----------------------------------------------------------------------------- CLI

def format_summary(plan: Plan, r: SimResult, source: str = "plan") -> str:
    lines = [f"{source}: policy {plan.policy}, {len(plan.units)} units, hardware "
             f"{plan.hardware.get('name')}, {r.micro_batches} micro-batch(es) per optimizer step"
             + (" (layer-major: one pass)" if plan.micro_batch_order == "layer-major" else "")]
    lines.append(f"step {fmt_seconds(r.step_s)}   compute-only {fmt_seconds(r.compute_s)}   "
                 f"({r.overhead or 0:.3f}x; recompute {fmt_seconds(r.recompute_s)} per pass, "
                 f"waiting on transfers {fmt_seconds(r.stall_s)})")
    lines.append(f"  pass {fmt_seconds(r.pass_s)}"
                 + (f" (later passes {fmt_seconds(r.rest_pass_s)})" if r.rest_pass_s != r.pass_s else "")
                 + f"   optimizer phase {fmt_seconds(r.optimizer_s)}   "
                 f"{fmt_rate(r.flops, r.step_s)}")
    for tier in TIERS:
        peak, budget = getattr(r, f"peak_{tier}_bytes"), r.budgets[f"{tier}_bytes"]
        ok = "ok" if peak <= budget else "OVER"
        lines.append(f"  {tier:<5} peak {fmt_bytes(peak):>11} / budget {fmt_bytes(budget):>11}  {ok}")
    lines.append(f"  {'resource':<8} {'busy per step':>14}")
    for res, b in r.busy_s.items():
        if b:
            lines.append(f"  {res:<8} {fmt_seconds(b):>14}")
    pred = plan.predicted.step_s
    if pred:
        lines.append(f"plan predicted step {fmt_seconds(pred)} "
                     f"({(r.step_s / pred - 1) * 100:+.2f}% in this replay)")
    if r.fits:
        lines.append("FITS: every peak is within its budget")
    else:
        lines.append("DOES NOT FIT: " + "; ".join(r.budget_violations))
    return "\n".join(lines)


def simulate_file(plan: Plan, source: str) -> SimResult:
    """``simulate(plan)`` for a plan read from ``source``: a schedule that is not what the
    plan's decisions imply is refused naming the file (exit 2), as every loader does."""
    try:
        return simulate(plan)
    except PlanInconsistent as e:
        msg = str(e)                       # "plan: ..." or "plan lists ...": name the file
        msg = msg[len("plan"):] if msg.startswith(("plan:", "plan ")) else ": " + msg
        raise PlanInconsistent(f"plan '{source}'{msg}") from None


def cli_simulate(args) -> int:
    """``plan simulate PLAN [--json]``. Exits 0 whether or not the plan fits (the replay itself
    succeeded); ``fits`` and the DOES NOT FIT line say which."""
    plan = load_plan(args.plan)
    r = simulate_file(plan, args.plan)
    if getattr(args, "json", False):
        print(json.dumps(r.summary(), sort_keys=True))
    else:
        print(format_summary(plan, r, args.plan))
    return 0


def executor_of(cm: CostModel, plan: Plan, sim: SimResult) -> Executor:
    """The plan's ``executor`` section: what the runtime acts on that the cost model computes
    (``sim``: the plan's simulation, for the staging pool it prices). The static bytes are
    what is on the device before a step: every home's resident bytes there, less gradients on
    the device (``zero_grad`` frees them; they belong to the step's rise), plus the engine's."""
    static = sum(cm.resident(i, d.home)["gpu"] - (cm.G[i] if d.home.grads is Tier.GPU else 0)
                 for i, d in enumerate(plan.layers)) + cm.engine_static
    threads = plan.model.get("compute_threads") if plan.hardware.get("device") == "cpu" else 0
    request, in_flight = io_requests(cm.unified or cm.hw.device == "cpu", cm.hw.nvme_drives)
    return Executor(grads_from_backward=bool(cm.grads_from_backward()),
                    static_device_bytes=int(static), staging_bytes=int(sim.staging_bytes),
                    compute_threads=int(threads or 0), io_request_bytes=request,
                    io_in_flight=in_flight)


def with_executor(plan: Plan) -> Plan:
    """``plan`` with its ``executor`` section, computed from its own cost model when it has
    none (a plan written before the section)."""
    if plan.executor is not None:
        return plan
    return dataclasses.replace(plan, executor=executor_of(cost_model_of(plan), plan,
                                                          simulate(plan)))


def cli_upgrade(args) -> int:
    """``plan upgrade PLAN -o NEW``: a plan of any schema this version reads, checked by the
    simulator (``check_plan``) and written as today's with its ``executor`` section (what
    ``apply_plan`` reads instead of the cost model)."""
    plan = load_plan(args.plan)
    check_plan(plan, args.plan)
    had = plan.executor is not None
    write_json_atomic(args.output, with_executor(plan).to_dict())
    print(f"wrote {args.output} ({plan.schema}; executor section {'kept' if had else 'added'})")
    return 0


__all__ = ["SimResult", "StageRecord", "check_plan", "simulate", "cost_model_of", "Tier"]
