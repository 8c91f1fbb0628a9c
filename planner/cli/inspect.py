"""``plan inspect PLAN``: what a plan decides, what it predicts, and where the time goes.

Everything comes from ``planner.cli.table`` (one per-unit table, one per-stage table) and the
simulator's replay: the step is the sum of the stages' durations, each stage lasts as long as
its busiest resource, so the time above compute-only is, stage by stage, the time a link, the
drive or the host CPU kept the stage open beyond its compute, plus the recompute, plus the
optimizer phase beyond the device's own optimizer step. ``--report`` puts a runtime report's
measured figures beside the prediction; ``--plot`` draws the memory per tier and the streams.
A profile can be inspected too (its per-unit figures only).
"""
from __future__ import annotations

import dataclasses
import json
from collections import Counter

from planner.costmodel import decision_choice
from planner.errors import UserError
from planner.formats import RESIDENT, Activation, LayerDecision, Plan, Profile
from planner.plans.load import load_any
from planner.sizes import fmt_bytes, fmt_rate, fmt_seconds
from planner.cli.table import decision_label, stage_table, unit_table

LINK_NAMES = {"d2h": "D2H", "h2d": "H2D", "duplex": "PCIe both ways", "nvme": "NVMe",
              "host": "host CPU", "compute": "compute"}


def time_breakdown(plan: Plan, sim) -> dict:
    """Where the step's time above compute-only goes, in seconds per optimizer step."""
    K = sim.micro_batches
    passes = 1 if plan.micro_batch_order == "layer-major" else K   # stage sequences per step
    out = {"recompute": sim.recompute_s * passes,
           "optimizer updates in the backward (paced)": sim.paced_compute_s}
    for r in sim.stages:
        if r.phase == "optimizer":
            continue
        extra = r.seconds - r.loads.get("compute", 0.0)
        extra_rest = r.seconds_rest - r.loads.get("compute", 0.0)
        if extra > 1e-12 or extra_rest > 1e-12:
            key = f"waiting on {LINK_NAMES.get(r.bound, r.bound)}"
            out[key] = out.get(key, 0.0) + extra + (passes - 1) * extra_rest
    floor = sim.compute_s - K * sum(u.fwd_s + u.bwd_s for u in plan.units)
    out["optimizer phase above its floor"] = sim.optimizer_s - floor
    return {k: v for k, v in out.items() if abs(v) > 1e-12}


def fmt_count(n) -> str:
    """A count with its unit, three significant digits: ``512``, ``199K``, ``1.5M``, ``7B``
    (a 199,232-parameter model printed "0 M params")."""
    n = float(n)
    for div, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= div * 0.9995:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


# The fewest savings undone, one at a time, to see whether memory is what forced them.
MAX_UNDO_TRIES = 8


def _savings(plan: Plan) -> list[tuple[int, str, LayerDecision, int]]:
    """The plan's memory savings, each to be undone alone: ``(bytes it would put back on the
    device, what undoing it means, the decision undone, the unit's index)``, smallest first. A
    saving is a block's activations not kept (recomputed or offloaded), or a unit's tensors
    homed off the device."""
    out = []
    for i, (u, d) in enumerate(zip(plan.units, plan.layers)):
        if d.activation is not Activation.KEEP:
            out.append((int(u.activation_bytes), f"keeping {u.name}'s activations "
                        f"instead of {decision_label(d)}",
                        dataclasses.replace(d, activation=Activation.KEEP, checkpoint=None), i))
        if not d.home.resident:
            out.append((int(u.static_bytes), f"homing {u.name} on the device "
                        f"instead of {d.home.label()}", dataclasses.replace(d, home=RESIDENT), i))
    return sorted(out, key=lambda x: (x[0], x[3]))


def _undo_peaks(plan: Plan, limit: int = MAX_UNDO_TRIES):
    """``(peak GPU bytes, what)`` for each of the ``limit`` smallest savings undone alone (the
    schedule placed greedily), valid changes only; and how many savings the plan has."""
    from planner.costmodel.schedule import build_schedule
    from planner.plans.simulate import cost_model_of, simulate
    cm = cost_model_of(plan)
    savings = _savings(plan)
    got = []
    for _, what, alt, i in savings:
        if len(got) >= limit:
            break
        layers = list(plan.layers)
        layers[i] = alt
        try:
            sched = build_schedule(cm, layers, None)
        except UserError:          # not a valid plan alone (a checkpoint chain broken)
            continue
        r = simulate(dataclasses.replace(plan, layers=layers, schedule=sched))
        got.append((r.peak_gpu_bytes, what))
    return got, len(savings)


def binding(plan: Plan, sim) -> list[str]:
    """One line per constraint that binds (or per tier that does not).

    GPU memory binds when the plan's peak fills the budget (less the spec's reserve), and
    also when it does not but no saving can be undone within it: a plan that recomputes 2 of
    3 blocks because a third kept block would not fit is bound by memory, though its peak may
    be 75% of the budget (each decision moves the peak by a whole block's activations)."""
    lines = []
    for tier in ("gpu", "cpu", "nvme"):
        peak, budget = getattr(sim, f"peak_{tier}_bytes"), plan.budgets.of(tier)
        if not budget:
            continue
        # the GPU budget keeps the spec's reserve free: the plan has the rest
        reserve = int((plan.hardware or {}).get("reserved_bytes") or 0) if tier == "gpu" else 0
        usable = max(1, budget - reserve)
        share = peak / usable
        of = fmt_bytes(budget) + (f" less the spec's reserve {fmt_bytes(reserve)}" if reserve
                                  else "")
        name = {"gpu": "GPU", "cpu": "host", "nvme": "NVMe"}[tier]
        if share >= 0.99:
            at = [r for r in sim.stages if r.memory[tier] >= 0.99 * usable]
            lines.append(f"{name} memory binds: peak {fmt_bytes(peak)} of {of} "
                         f"(in {len(at)} stage(s), first {at[0].phase} of {at[0].unit or '-'})")
        elif tier == "gpu":
            lines.append(_gpu_below_budget(plan, peak, share, usable, of))
    by = Counter(r.bound for r in sim.stages if r.bound != "compute" and r.phase != "optimizer")
    for res, n in by.most_common():
        lines.append(f"{LINK_NAMES.get(res, res)} sets the duration of {n} stage(s)")
    opt = [r for r in sim.stages if r.phase == "optimizer"]
    if opt and opt[0].seconds > 0:
        lines.append(f"the optimizer phase ({fmt_seconds(opt[0].seconds)}) is bound by "
                     f"{LINK_NAMES.get(opt[0].bound, opt[0].bound)}")
    return lines


def _gpu_below_budget(plan: Plan, peak, share, usable, of) -> str:
    """The GPU line for a peak under 99% of the usable budget: whether any saving the plan
    makes could be undone within the budget."""
    head = f"peak {fmt_bytes(peak)} is {share:.0%} of {of}"
    tried, n = _undo_peaks(plan)
    if not tried:
        return f"GPU memory does not bind: {head}" + (
            "" if not n else f" (none of its {n} saving(s) can be undone alone)")
    fits = [(p, what) for p, what in tried if p <= usable]
    if fits:
        p, what = fits[0]
        return (f"GPU memory does not bind: {head}; {what} would still fit (peak "
                f"{fmt_bytes(p)})")
    p, what = tried[0]
    some = (f"any of its {n} saving(s)" if len(tried) == n else
            f"any of the {len(tried)} smallest of its {n} savings")
    return (f"GPU memory binds: {head}, and undoing {some} alone does not fit (the smallest, "
            f"{what}, would peak at {fmt_bytes(p)})")


def _fmt_table(df, cols, fmts) -> str:
    shown = df[cols].copy()
    for c, f in fmts.items():
        if c in shown:
            shown[c] = shown[c].map(f)
    return shown.to_string()


def render(plan: Plan, sim, source: str, report=None) -> str:
    m = plan.model
    hw = plan.hardware
    b = plan.budgets
    s = plan.solver
    lines = [f"plan {source}",
             f"  model     {m.get('name')}  batch {m.get('batch')}  seq {m.get('seq')}  "
             f"{m.get('dtype')}  {fmt_count(int(m.get('param_count', 0)))} params  "
             f"{plan.micro_batches} micro-batch(es) per optimizer step ({plan.micro_batch_order}"
             f"; optimizer {plan.optimizer_overlap}, clip {plan.clip}"
             + (f", state read ahead {fmt_bytes(plan.optimizer_prefetch_bytes)}"
                if plan.optimizer_prefetch_bytes else "") + ")",
             f"  hardware  {hw.get('name')}  ({hw.get('description')})",
             f"  budgets   GPU {fmt_bytes(b.gpu_bytes)}  host {fmt_bytes(b.cpu_bytes)}  NVMe "
             f"{fmt_bytes(b.nvme_bytes)}" + (f"  (nvme dir {plan.nvme_dir})" if plan.nvme_dir else ""),
             f"  solver    {s.name}  {s.status}  origin {s.origin or '-'}  gap "
             f"{'-' if s.gap is None else f'{s.gap:.2%}'}  {s.solve_s:.2f} s  policy {plan.policy}",
             ""]
    ratio = sim.step_s / sim.compute_s if sim.compute_s else float("nan")
    lines.append(f"step time {fmt_seconds(sim.step_s)} predicted vs {fmt_seconds(sim.compute_s)} "
                 f"compute-only ({ratio:.3f}x), {fmt_rate(sim.flops, sim.step_s)}; "
                 f"pass {fmt_seconds(sim.pass_s)}, optimizer phase "
                 f"{fmt_seconds(sim.optimizer_s)}")
    br = time_breakdown(plan, sim)
    extra = sim.step_s - sim.compute_s
    if br:
        lines.append(f"  the {fmt_seconds(extra)} above compute-only:")
        for k, v in sorted(br.items(), key=lambda kv: -kv[1]):
            lines.append(f"    {k:<40} {fmt_seconds(v):>10}")
    lines.append("")
    lines.append(f"peaks     GPU {fmt_bytes(sim.peak_gpu_bytes)} of {fmt_bytes(b.gpu_bytes)}  host "
                 f"{fmt_bytes(sim.peak_cpu_bytes)} of {fmt_bytes(b.cpu_bytes)}  NVMe "
                 f"{fmt_bytes(sim.peak_nvme_bytes)} of {fmt_bytes(b.nvme_bytes)}")
    df = unit_table(plan, sim)
    lines.append("moved     activations out " + fmt_bytes(df["act_out_bytes"].sum()) +
                 "  weights in " + fmt_bytes(df["weight_in_bytes"].sum()) +
                 "  gradients out " + fmt_bytes(df["grad_out_bytes"].sum()) +
                 "  optimizer state (NVMe) " + fmt_bytes(df["state_io_bytes"].sum()) + " per step")
    counts = Counter(zip(df["decision"], df["home"]))
    lines.append("decisions " + ", ".join(f"{n} {d}" + ("" if h == "gpu" else f" [{h}]")
                                         for (d, h), n in sorted(counts.items())))
    lines.append("")
    lines.append("binding constraints:")
    lines += [f"  - {x}" for x in binding(plan, sim)]
    if report is not None:
        lines.append("")
        lines += _measured(plan, report)
    lines.append("")
    cols = ["kind", "decision", "home", "A_bytes", "on_gpu_bytes", "act_out_bytes",
            "weight_in_bytes", "fwd_s", "bwd_s", "fwd_stage_s", "fwd_bound", "bwd_stage_s",
            "bwd_bound"]
    fb = lambda n: fmt_bytes(n) if n else "-"    # noqa: E731
    fs = lambda t: f"{t * 1e3:.2f}"              # noqa: E731
    lines.append(_fmt_table(df, cols, {"A_bytes": fb, "on_gpu_bytes": fb, "act_out_bytes": fb,
                                       "weight_in_bytes": fb, "fwd_s": fs, "bwd_s": fs,
                                       "fwd_stage_s": fs, "bwd_stage_s": fs}))
    lines.append("(times in ms; act_out and weight_in per optimizer step)")
    return "\n".join(lines)


def _measured(plan: Plan, rep) -> list[str]:
    med = rep.measured
    p = plan.predicted
    if med is None:
        return ["measured  (the report has no complete step)"]
    out = [f"measured  step {fmt_seconds(med.step_s)} vs predicted {fmt_seconds(p.step_s)} "
           f"({(med.step_s / p.step_s - 1) * 100 if p.step_s else 0:+.1f}%), peak device "
           f"{fmt_bytes(med.peak_gpu_bytes)} ({rep.gpu_measure}) vs predicted "
           f"{fmt_bytes(rep.predicted_gpu_rise_bytes)}, over {med.steps} step(s)"]
    rows = unit_comparison(plan, rep)
    if rows is None:
        return out + ["  (the report's units are not this plan's: no per-unit comparison)"]
    if not rows:
        return out
    out.append("  per unit, ms per pass (predicted: the plan's profile; measured: median over "
               "the steps, the first left out):")
    head = ("unit", "decision", "fwd pred", "fwd meas", "bwd pred", "bwd meas", "recompute",
            "stall")
    ms = lambda t: "-" if t is None else f"{t * 1e3:.2f}"    # noqa: E731
    table = [head] + [(r["unit"], r["decision"], ms(r["fwd_s"]), ms(r["measured_fwd_s"]),
                       ms(r["bwd_s"]), ms(r["measured_bwd_s"]), ms(r["measured_recompute_s"]),
                       ms(r["measured_stall_s"])) for r in rows]
    w = [max(len(r[i]) for r in table) for i in range(len(head))]
    out += ["  " + "  ".join(c.rjust(w[i]) if i > 1 else c.ljust(w[i]) for i, c in enumerate(r))
            for r in table]
    links = rep.link_rates()
    for k, v in sorted(links.items()):
        spec = plan.hardware.get(f"{k}_bandwidth")
        rate = v["bytes_per_s"]
        out.append(f"  {k}: {fmt_bytes(v['bytes'])} in {fmt_seconds(v['busy_s'])} busy = "
                   f"{rate / 1e9 if rate else 0:.3f} GB/s measured vs {spec / 1e9 if spec else 0:.3f}"
                   " GB/s in the spec")
    return out


def unit_comparison(plan: Plan, rep) -> list | None:
    """Per unit: the plan's fwd_s/bwd_s beside the report's medians (None when the report's
    units are not the plan's; [] when it has no per-unit times)."""
    names = [u.name for u in plan.units]
    if rep.units and rep.units != names:
        return None
    times = rep.unit_times()
    if not times:
        return []
    dec = {d.name: d for d in plan.layers}
    out = []
    for u in plan.units:
        t = times.get(u.name, {})
        d = dec[u.name]
        out.append({"unit": u.name, "decision": decision_choice(d), "fwd_s": u.fwd_s,
                    "bwd_s": u.bwd_s, "measured_fwd_s": t.get("fwd_s"),
                    "measured_bwd_s": t.get("bwd_s"),
                    "measured_recompute_s": t.get("recompute_s"),
                    "measured_stall_s": t.get("stall_s")})
    return out


def to_json(plan: Plan, sim) -> dict:
    df = unit_table(plan, sim)
    return {"summary": sim.summary(), "time_above_compute": time_breakdown(plan, sim),
            "binding": binding(plan, sim),
            "units": json.loads(df.reset_index().to_json(orient="records")),
            "stages": json.loads(stage_table(sim).reset_index().to_json(orient="records"))}


def render_profile(prof: Profile, source: str) -> str:
    m = prof.model
    lines = [f"profile {source}: {m.get('name')} batch {m.get('batch')} seq {m.get('seq')} "
             f"{m.get('dtype')} on {prof.hardware.get('name')} ({prof.timing} times)",
             f"  static {fmt_bytes(prof.static_bytes)}, saved activations "
             f"{fmt_bytes(sum(u.saved_bytes for u in prof.layers))}", ""]
    rows = [("unit", "kind", "params", "static", "saved", "input", "workspace", "fwd ms", "bwd ms")]
    for u in prof.layers:
        rows.append((u.name, u.kind, f"{u.param_count:,}", fmt_bytes(u.static_bytes),
                     fmt_bytes(u.saved_bytes), fmt_bytes(u.input_bytes),
                     fmt_bytes(u.workspace_bytes), f"{u.fwd_s * 1e3:.2f}", f"{u.bwd_s * 1e3:.2f}"))
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.rjust(w[i]) if i > 1 else c.ljust(w[i]) for i, c in enumerate(r))
              for r in rows]
    return "\n".join(lines)


def cli_inspect(args) -> int:
    from planner.plans.simulate import simulate_file
    obj = load_any(args.plan)
    if isinstance(obj, Profile):
        if args.plot or args.report:
            raise UserError(f"'{args.plan}' is a profile: --plot and --report need a plan "
                            "('plan solve' writes one)")
        print(json.dumps(obj.to_dict(), sort_keys=True) if args.json else
              render_profile(obj, args.plan))
        return 0
    sim = simulate_file(obj, args.plan)
    report = None
    if args.report:
        from planner.formats.report import load_report
        report = load_report(args.report)
    if args.json:
        d = to_json(obj, sim)
        if report is not None:
            d["report"] = report.to_dict()
            d["units_measured"] = unit_comparison(obj, report)
        print(json.dumps(d, sort_keys=True))
    else:
        print(render(obj, sim, args.plan, report))
    if args.plot:
        from planner.cli.plot import plot_plan
        print(f"plot written to {plot_plan(obj, sim, args.plot)}")
    return 0
