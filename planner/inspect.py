"""``plan inspect``: explain a plan (or a profile) so that a person can decide to trust it.

For a plan: its settings (model, shape, hardware, budgets, solver, policy); the predicted step
time beside the compute-only ideal and where the difference goes (recompute, stalls per link);
a per-unit table (decision, bytes kept on the GPU or moved to host/NVMe, when each transfer
runs, times); and the constraints that bind. Everything comes from the plan file alone: the
simulator is re-run on it to get event times, stalls and the memory timeline (the plan's own
``predicted`` section is shown beside, and a disagreement is flagged).

For a profile: the per-unit table of bytes, FLOPs and times, and totals.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass

from .errors import UserError
from .formats import (REPORT_SCHEMA, Activation, Plan, Profile,
                      Stream, Tier, load_any, read_json)
from .sizes import fmt_bytes, fmt_seconds

# A tier is "full" when its peak reaches this share of the budget. 99% rather than 100%: a plan
# is made of whole decisions per unit, so at a binding budget the peak usually sits a little
# below it. 1% of a 36 GiB budget is 369 MiB, less than one GPT-2 XL block's 451 MiB of
# activations at batch 8, seq 1024 (our meta profile), so a stage this close could not have
# kept one more block.
FULL = 0.99
# Host and NVMe are reported as "near budget" from this share on (they bound placement only).
NEAR = 0.95
# A link is the bottleneck of a stage when its busy time in the stage reaches the stage's own
# compute time (the stage then lasts as long as the link, DESIGN.md "Cost model"); the 1% slack
# absorbs float rounding of bytes / bandwidth.
LINK_BOUND = 0.99
EPS_S = 1e-9

TRANSFER_STREAMS = (Stream.D2H, Stream.H2D, Stream.NVME)
LINK_LABEL = {"d2h": "D2H", "h2d": "H2D", "nvme": "NVMe", "compute": "compute",
              "issue": "a late prefetch issue"}


# ----------------------------------------------------------------------------- simulation view

@dataclass
class Timeline:
    """What inspect and the plot need from a simulation, in one shape.

    ``events``: event id -> (stream, op, units, start_s, end_s); ``memory``: samples
    ``(t_s, gpu_bytes, cpu_bytes, nvme_bytes)`` in time order; ``stage_of``: event id -> stage.
    """

    step_s: float
    compute_s: float
    recompute_s: float
    peaks: dict            # gpu/cpu/nvme -> bytes
    fits: bool
    violations: list       # strings
    events: dict
    memory: list
    stage_of: dict
    after: dict            # event id -> ids it waits for (from the schedule)
    prev: dict             # event id -> the event before it on its stream


def timeline(plan: Plan, sim=None) -> Timeline:
    """Gather event times, peaks and the memory curve from the simulator (re-run when ``sim``
    is not given): ``planner.simulate`` is the judge, inspect only reads what it replays."""
    if sim is None:
        from .simulate import simulate
        sim = simulate(plan)
    events, stage_of, after, prev = {}, {}, {}, {}
    for evs in plan.schedule.values():
        for a, b in zip(evs, evs[1:]):
            prev[b.id] = a.id
        for e in evs:
            stage_of[e.id] = e.stage
            after[e.id] = tuple(e.after)
            s, t = sim.events[e.id]
            events[e.id] = (e.stream, e.op, tuple(e.units), float(s), float(t))
    return Timeline(
        step_s=sim.step_s, compute_s=sim.compute_s, recompute_s=sim.recompute_s,
        peaks={"gpu": sim.peak_gpu_bytes, "cpu": sim.peak_cpu_bytes, "nvme": sim.peak_nvme_bytes},
        fits=sim.fits, violations=list(sim.budget_violations), events=events,
        memory=[tuple(m) for m in sim.timeline], stage_of=stage_of, after=after, prev=prev)


# ----------------------------------------------------------------------------- analysis

def _span(tl: Timeline, ids) -> tuple | None:
    got = [tl.events[i] for i in ids if i in tl.events]
    if not got:
        return None
    return (min(g[3] for g in got), max(g[4] for g in got))


def _fmt_span(span) -> str:
    if span is None:
        return "-"
    return f"{span[0] * 1e3:.1f}–{span[1] * 1e3:.1f}"


def unit_rows(plan: Plan, tl: Timeline | None) -> list[dict]:
    """One record per unit: decision, bytes per tier, transfer windows (ms) and times."""
    rows = []
    for u, d in zip(plan.units, plan.layers):
        A, X = u.activation_bytes, u.input_bytes
        act, ck = d.activation, d.checkpoint
        gpu = cpu = nvme = 0
        if act is Activation.KEEP:
            gpu = A
        elif act is Activation.CPU:
            cpu = A
        elif act is Activation.NVME:
            nvme = A
        elif act is Activation.RECOMPUTE:
            if ck in (Tier.GPU, None):
                gpu = X
            elif ck is Tier.CPU:
                cpu = X
            elif ck is Tier.NVME:
                nvme = X
        n = u.name
        row = {
            "unit": n, "kind": u.kind, "decision": act.value,
            "checkpoint": (ck.value if ck else "") if act is Activation.RECOMPUTE else "",
            "A_bytes": A, "X_bytes": X, "gpu_bytes": gpu, "cpu_bytes": cpu, "nvme_bytes": nvme,
            "fwd_s": u.fwd_s, "bwd_s": u.bwd_s,
            "offload_start_s": None, "offload_end_s": None,
            "prefetch_start_s": None, "prefetch_end_s": None,
        }
        if tl is not None:
            out = _span(tl, [f"out:{n}", f"w:{n}", f"ckout:{n}", f"ckw:{n}"])
            back = _span(tl, [f"r:{n}", f"in:{n}", f"ckr:{n}", f"ckin:{n}"])
            if out:
                row["offload_start_s"], row["offload_end_s"] = out
            if back:
                row["prefetch_start_s"], row["prefetch_end_s"] = back
        rows.append(row)
    return rows


def _stage_windows(tl: Timeline, n_stages: int) -> list[tuple | None]:
    """Per stage: (window start, window end, compute seconds of the stage's own events).

    A stage's window runs from the start of its first compute event to the start of the next
    stage's (the optimizer or the step's end for the last), so it includes any stall before
    the next stage could start.
    """
    first, comp = {}, {}
    for eid, (stream, op, units, s, t) in tl.events.items():
        if stream is not Stream.COMPUTE or op == "optimizer":
            continue
        k = tl.stage_of[eid]
        first[k] = min(first.get(k, s), s)
        comp[k] = comp.get(k, 0.0) + (t - s)
    out = []
    starts = sorted(first.values())
    for k in range(n_stages):
        if k not in first:
            out.append(None)
            continue
        later = [x for x in starts if x > first[k]]
        end = later[0] if later else max(t for (_, _, _, _, t) in tl.events.values())
        out.append((first[k], end, comp[k]))
    return out


def _busy_in(tl: Timeline, stream: Stream, a: float, b: float) -> float:
    busy = 0.0
    for (st, op, units, s, t) in tl.events.values():
        if st is stream:
            busy += max(0.0, min(t, b) - max(s, a))
    return busy


def stage_names(plan: Plan) -> list[str]:
    """Stage s is F:<unit s> for s < U and B:<unit 2U-1-s> after (docs/file-formats.md)."""
    names = [u.name for u in plan.units]
    return [f"F:{n}" for n in names] + [f"B:{n}" for n in reversed(names)]


def _blocker(tl: Timeline, eid: str) -> str | None:
    """The event whose completion (or, for ``issue``, start) let ``eid`` start, if any."""
    s = tl.events[eid][3]
    cands = [a for a in (*tl.after.get(eid, ()), tl.prev.get(eid)) if a in tl.events
             and abs(tl.events[a][4] - s) <= EPS_S]
    if cands:
        # Prefer a transfer: on a tie with the stream predecessor the link is what held it.
        cands.sort(key=lambda a: tl.events[a][0] is Stream.COMPUTE)
        return cands[0]
    return None


def stalls(tl: Timeline) -> dict:
    """Compute-stream idle time, charged to the links that held it up.

    When a compute event starts after the previous one ended, the gap is walked back along the
    critical chain: the dependency that finished last covers the end of the gap and is charged
    for its share; if it had itself started inside the gap, whatever it waited for (an NVMe
    read before a host-to-GPU copy, the previous transfer on its link) is charged for the part
    before, and so on. So an NVMe read that feeds an H2D prefetch is charged to NVMe for its own
    time and to H2D for the copy. Returns ``by_link`` (link -> seconds) and ``by_event``
    (compute event -> (gap seconds, link charged most)).
    """
    comp = sorted(((s, t, eid) for eid, (st, op, u, s, t) in tl.events.items()
                   if st is Stream.COMPUTE), key=lambda x: x[0])
    by_link, by_event = {}, {}
    prev_end = 0.0
    for s, t, eid in comp:
        gap = s - prev_end
        lo = prev_end
        prev_end = max(prev_end, t)
        if gap <= EPS_S:
            continue
        charged, hi = {}, s
        cur = _blocker(tl, eid)
        while cur is not None and hi > lo + EPS_S:
            stream, _, _, cs, ce = tl.events[cur]
            if stream is Stream.COMPUTE:
                break
            part = max(0.0, min(hi, ce) - max(lo, cs))
            charged[stream.value] = charged.get(stream.value, 0.0) + part
            hi = min(hi, max(lo, cs))
            cur = _blocker(tl, cur)
        if hi > lo + EPS_S:   # no transfer ran then (a late issue point): the schedule's own
            charged["issue"] = charged.get("issue", 0.0) + (hi - lo)
        for k, v in charged.items():
            by_link[k] = by_link.get(k, 0.0) + v
        by_event[eid] = (gap, max(charged, key=charged.get))
    return {"by_link": by_link, "by_event": by_event}


def _runs(flags: list, names: list) -> list[tuple[str, str, int]]:
    """Consecutive True stages as (first name, last name, count)."""
    runs, start = [], None
    for k, f in enumerate(flags + [False]):
        if f and start is None:
            start = k
        elif not f and start is not None:
            runs.append((names[start], names[k - 1], k - start))
            start = None
    return runs


def _range(a: str, b: str) -> str:
    return a if a == b else f"{a}–{b}"


def _merged_runs(flags: list, names: list, slack: int = 2) -> list[tuple[str, str, int, list]]:
    """Runs of True stages, joined across gaps of at most ``slack`` stages, which are listed
    as exceptions: "F:blocks.1–F:blocks.45 except F:blocks.31" reads better than three runs."""
    runs = []
    for a, b, n in _runs(flags, names):
        ia, ib = names.index(a), names.index(b)
        if runs and ia - runs[-1][1] - 1 <= slack:
            runs[-1][1] = ib
        else:
            runs.append([ia, ib])
    out = []
    for ia, ib in runs:
        skip = [names[k] for k in range(ia, ib + 1) if not flags[k]]
        out.append((names[ia], names[ib], ib - ia + 1 - len(skip), skip))
    return out


def binding(plan: Plan, tl: Timeline) -> list[dict]:
    """Which constraints bind: full tiers, link-bound stages, budget violations."""
    out = []
    names = stage_names(plan)
    U = len(plan.units)
    budgets = {"gpu": plan.budgets.get("gpu_bytes", 0), "cpu": plan.budgets.get("cpu_bytes", 0),
               "nvme": plan.budgets.get("nvme_bytes", 0)}
    windows = _stage_windows(tl, 2 * U)
    dev = "device" if plan.hardware.get("unified_memory") else "GPU"   # no GPU on a CPU host

    # GPU memory per stage: the highest sample inside the stage's window.
    gpu_budget = budgets["gpu"]
    if gpu_budget and tl.memory:
        stage_peak = []
        for w in windows:
            if w is None:
                stage_peak.append(0)
                continue
            vals = [m[1] for m in tl.memory if w[0] - EPS_S <= m[0] <= w[1] + EPS_S]
            stage_peak.append(max(vals) if vals else 0)
        full = [p >= FULL * gpu_budget for p in stage_peak]
        for a, b, n in _runs(full, names):
            top = max(stage_peak[names.index(a):names.index(b) + 1])
            where = f"at stage{'s' if n > 1 else ''} {_range(a, b)}"
            text = (f"{dev} memory is over its budget ({fmt_bytes(top)} > {fmt_bytes(gpu_budget)}) "
                    f"{where}" if top > gpu_budget else
                    f"{dev} memory is full (≥ {FULL:.0%} of {fmt_bytes(gpu_budget)}) {where}")
            out.append({"constraint": "gpu_memory", "stages": [a, b], "count": n, "text": text})
    peak_gpu = tl.peaks.get("gpu", 0)
    if gpu_budget and not any(o["constraint"] == "gpu_memory" for o in out):
        out.append({"constraint": "gpu_memory", "stages": [], "count": 0,
                    "text": f"{dev} memory does not bind: peak {fmt_bytes(peak_gpu)} is "
                            f"{peak_gpu / gpu_budget:.0%} of {fmt_bytes(gpu_budget)}"})

    # Links: busy time within each stage's window against that stage's compute time.
    for link in TRANSFER_STREAMS:
        if not plan.schedule.get(link.value):
            continue
        bound = []
        for w in windows:
            bound.append(w is not None and w[2] > 0
                         and _busy_in(tl, link, w[0], w[1]) >= LINK_BOUND * w[2])
        for phase, lo, hi in (("forward", 0, U), ("backward", U, 2 * U)):
            for a, b, n, skip in _merged_runs(bound[lo:hi], names[lo:hi]):
                out.append({"constraint": f"{link.value}_link", "stages": [a, b], "count": n,
                            "except": skip,
                            "text": f"{LINK_LABEL[link.value]} is the bottleneck in {phase} "
                                    f"stage{'s' if a != b else ''} {_range(a, b)}"
                                    + (f" (except {', '.join(skip)})" if skip else "")})

    for tier, label in (("cpu", "host"), ("nvme", "NVMe")):
        bud, pk = budgets[tier], tl.peaks.get(tier, 0)
        if bud and pk >= NEAR * bud:
            out.append({"constraint": f"{tier}_memory", "stages": [], "count": 0,
                        "text": f"{label} memory is near its budget: peak {fmt_bytes(pk)} of "
                                f"{fmt_bytes(bud)} ({pk / bud:.0%})"})
    for v in tl.violations:
        out.append({"constraint": "violation", "stages": [], "count": 0,
                    "text": f"BUDGET BROKEN: {v}"})
    return out


def analyse(plan: Plan, path: str = "plan", tl: Timeline | None = None) -> dict:
    """Everything ``plan inspect`` shows, as one JSON-ready dict."""
    tl = tl or timeline(plan)
    st = stalls(tl)
    stall_total = sum(st["by_link"].values())
    overhead = tl.step_s - tl.compute_s
    rows = unit_rows(plan, tl)
    worst = sorted(st["by_event"].items(), key=lambda kv: -kv[1][0])[:5]
    moved = {}
    for stream, evs in plan.schedule.items():
        if stream != Stream.COMPUTE.value:
            n = int(sum(e.bytes for e in evs))
            if n:
                moved[stream] = n
    counts = {}
    for d in plan.layers:
        key = d.activation.value
        counts[key] = counts.get(key, 0) + 1
    m = plan.model
    return {
        "schema": "tierplan.inspect/1",
        "plan": path,
        "model": {k: m.get(k) for k in ("name", "batch", "seq", "dtype", "param_count",
                                        "structure_hash")},
        "hardware": {k: plan.hardware.get(k) for k in ("name", "description", "device",
                                                       "unified_memory")},
        "budgets": dict(plan.budgets),
        "solver": dict(plan.solver),
        "policy": plan.policy,
        "profile": dict(plan.profile),
        "nvme_dir": plan.nvme_dir,
        "time": {
            "step_s": tl.step_s, "compute_s": tl.compute_s, "overhead_s": overhead,
            "recompute_s": tl.recompute_s, "stall_s": stall_total,
            "stall_by_link_s": dict(sorted(st["by_link"].items())),
            "other_s": overhead - tl.recompute_s - stall_total,
            "worst_stalls": [{"event": eid, "stall_s": g, "link": link}
                             for eid, (g, link) in worst],
        },
        "plan_predicted": dict(plan.predicted),
        "peaks": {t: tl.peaks.get(t, 0) for t in ("gpu", "cpu", "nvme")},
        "fits": tl.fits,
        "bytes_moved": moved,
        "decision_counts": dict(sorted(counts.items())),
        "binding": binding(plan, tl),
        "units": rows,
    }


# ----------------------------------------------------------------------------- report

def _num(x):
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def predicted_moved(plan: Plan) -> dict:
    """Bytes the schedule moves per link, keyed as the runtime report keys them."""
    out = {"d2h": 0, "h2d": 0, "nvme_write": 0, "nvme_read": 0}
    for stream, evs in plan.schedule.items():
        for e in evs:
            if stream == "nvme":
                out["nvme_write" if e.op == "write" else "nvme_read"] += e.bytes
            elif stream in ("d2h", "h2d"):
                out[stream] += e.bytes
    return out


def compare_report(report_path: str, plan: Plan, r: dict) -> list[dict]:
    """Measured beside predicted, per tier, per link and in total, from a runtime report.

    The report (``tierplan.report/1``, written by ``runtime.report.Report.save``) holds the
    median of the measured steps under ``measured``. Read defensively: a figure missing on
    either side shows as ``-``. On a CPU host the runtime measures device memory as the rise of
    peak RSS over the step, which excludes the static state resident before it, so it is set
    beside ``predicted_gpu_rise_bytes`` (the predicted peak less that state) when present.
    """
    rep = read_json(report_path, "report")
    if rep.get("schema") != REPORT_SCHEMA:
        raise UserError(f"report '{report_path}' has schema {rep.get('schema')!r}, expected "
                        f"{REPORT_SCHEMA!r}; save it with handle.report().save(path)")
    meas = rep.get("measured")
    if not isinstance(meas, dict) or _num(meas.get("step_s")) is None:
        raise UserError(f"report '{report_path}' has no measured step; save it after at least "
                        "one complete training step (forward, backward, optimizer step)")
    rp = rep.get("predicted") if isinstance(rep.get("predicted"), dict) else {}
    own = {"step_s": r["time"]["step_s"], "compute_s": r["time"]["compute_s"],
           "stall_s": r["time"]["stall_s"],
           **{f"peak_{t}_bytes": r["peaks"][t] for t in ("gpu", "cpu", "nvme")}}
    if rp.get("step_s") is not None and abs(rp["step_s"] - own["step_s"]) > 1e-9 * own["step_s"]:
        # The report was taken under another plan (or an older simulator): say so, but keep
        # comparing against this plan's figures, which is what the user asked to inspect.
        r.setdefault("warnings", []).append(
            f"the report's predicted step {fmt_seconds(rp['step_s'])} differs from this plan's "
            f"{fmt_seconds(own['step_s'])}: was it measured under another plan?")
    gpu_pred, gpu_label = own["peak_gpu_bytes"], "peak GPU memory"
    if rep.get("device") == "cpu" and _num(rep.get("predicted_gpu_rise_bytes")) is not None:
        gpu_pred, gpu_label = rep["predicted_gpu_rise_bytes"], "peak RSS rise over step"
    rows = [("step time", "step_s", own["step_s"], meas.get("step_s")),
            (gpu_label, "peak_gpu_bytes", gpu_pred, meas.get("peak_gpu_bytes")),
            ("peak host memory", "peak_cpu_bytes", own["peak_cpu_bytes"],
             meas.get("peak_cpu_bytes")),
            ("peak NVMe", "peak_nvme_bytes", own["peak_nvme_bytes"], meas.get("peak_nvme_bytes")),
            ("compute stalls", "stall_s", own["stall_s"], meas.get("stall_s"))]
    mm = meas.get("moved") if isinstance(meas.get("moved"), dict) else {}
    for link, v in predicted_moved(plan).items():
        rows.append((f"moved {link}", f"moved_{link}_bytes", v, mm.get(link)))
    out = []
    for label, key, p, m in rows:
        p, m = _num(p), _num(m)
        out.append({"quantity": key, "label": label, "predicted": p, "measured": m,
                    "ratio": (m / p) if (p and m is not None) else None})
    return out


# ----------------------------------------------------------------------------- profiles

def profile_rows(prof: Profile) -> list[dict]:
    return [{"unit": u.name, "kind": u.kind, "param_bytes": u.param_bytes,
             "static_bytes": u.static_bytes, "input_bytes": u.input_bytes,
             "saved_bytes": u.saved_bytes, "A_bytes": u.activation_bytes,
             "workspace_bytes": u.workspace_bytes, "fwd_flops": u.fwd_flops,
             "bwd_flops": u.bwd_flops, "fwd_s": u.fwd_s, "bwd_s": u.bwd_s}
            for u in prof.layers]


def analyse_profile(prof: Profile, path: str = "profile") -> dict:
    rows = profile_rows(prof)
    tot = {k: sum(r[k] for r in rows) for k in ("param_bytes", "static_bytes", "saved_bytes",
                                                  "A_bytes", "fwd_flops", "bwd_flops", "fwd_s",
                                                  "bwd_s")}
    tot["optimizer_s"] = prof.optimizer_s
    tot["compute_s"] = tot["fwd_s"] + tot["bwd_s"] + prof.optimizer_s
    tot["max_workspace_bytes"] = max(r["workspace_bytes"] for r in rows)
    return {"schema": "tierplan.inspect-profile/1", "profile": path,
            "model": {k: prof.model.get(k) for k in ("name", "batch", "seq", "dtype",
                                                     "param_count", "structure_hash",
                                                     "attention")},
            "device": prof.device, "timing": prof.timing,
            "hardware": prof.hardware.get("name"), "totals": tot, "units": rows}


# ----------------------------------------------------------------------------- text

def _frame(rows, columns, fmt):
    import pandas as pd
    df = pd.DataFrame(rows, columns=columns)
    for col, f in fmt.items():
        if col in df:
            df[col] = [f(v) for v in df[col]]
    return df


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.2f}"


def _bytes0(x):
    return "-" if not x else fmt_bytes(x)


def _count(n: int) -> str:
    """``1.56 B``, ``124 M``, ``199 K``: parameter counts to three significant digits."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return str(n)


def format_plan(r: dict, report_rows: list | None = None) -> str:
    m, b, s, t = r["model"], r["budgets"], r["solver"], r["time"]
    L = []
    L.append(f"plan {r['plan']}")
    L.append(f"  model     {m['name']}  batch {m['batch']}  seq {m['seq']}  {m['dtype']}"
             + (f"  {_count(m['param_count'])} params" if m.get("param_count") else ""))
    L.append(f"  hardware  {r['hardware']['name']}  ({r['hardware'].get('description') or ''})")
    unified = bool(r["hardware"].get("unified_memory"))
    L.append(f"  budgets   {'device' if unified else 'GPU'} {fmt_bytes(b.get('gpu_bytes'))}"
             + ("" if unified else f"  host {fmt_bytes(b.get('cpu_bytes'))}")
             + f"  NVMe {fmt_bytes(b.get('nvme_bytes'))}"
             + (f"  (nvme dir {r['nvme_dir']})" if r.get("nvme_dir") else ""))
    gap = s.get("gap")
    L.append(f"  solver    {s.get('name')}  status {s.get('status')}"
             + (f"  gap {gap:.2%}" if isinstance(gap, (int, float)) else "")
             + (f"  {s['solve_s']:.2f} s" if isinstance(s.get("solve_s"), (int, float)) else "")
             + (f"  {s.get('variables')} vars / {s.get('constraints')} constraints"
                if s.get("variables") else "")
             + f"  policy {r['policy']}")
    obj = s.get("objective")
    if isinstance(obj, (int, float)) and r["policy"] in ("optimal", "remat-only") and obj > 0:
        # The MILP's objective is its own estimate of the step; the simulator is the judge.
        L.append(f"            MILP objective {fmt_seconds(obj)}, simulator "
                 f"{fmt_seconds(t['step_s'])} ({round((t['step_s'] / obj - 1) * 100, 1) + 0.0:+.1f}%)")
    L.append("")
    ratio = t["step_s"] / t["compute_s"] if t["compute_s"] else float("nan")
    L.append(f"step time {fmt_seconds(t['step_s'])} predicted vs {fmt_seconds(t['compute_s'])} "
             f"compute-only ({ratio:.3f}x); the {fmt_seconds(t['overhead_s'])} difference:")
    parts = [("recompute", t["recompute_s"])]
    parts += [(f"stall waiting on {LINK_LABEL.get(k, k)}", v)
              for k, v in t["stall_by_link_s"].items()]
    if abs(t["other_s"]) > 1e-6:
        parts.append(("other (transfers after the last compute)", t["other_s"]))
    w = max(len(p[0]) for p in parts)
    for label, v in parts:
        share = f"{v / t['overhead_s']:6.1%}" if t["overhead_s"] > 1e-12 else ""
        L.append(f"  {label:<{w}}  {fmt_seconds(v) if v else 'none':>10}  {share}")
    if not t["stall_by_link_s"]:
        L.append("  no stalls: every transfer hides behind compute")
    if t["worst_stalls"]:
        L.append("  longest stalls: " + ", ".join(
            f"{w['event']} {fmt_seconds(w['stall_s'])} ({LINK_LABEL.get(w['link'], w['link'])})"
            for w in t["worst_stalls"]))
    pp = r["plan_predicted"]
    if pp.get("step_s") and abs(pp["step_s"] - t["step_s"]) > 1e-6 * max(1.0, t["step_s"]):
        L.append(f"  NOTE: the plan file records step {fmt_seconds(pp['step_s'])}; the simulator "
                 "now gives the figure above")
    L.append("")
    pk = r["peaks"]
    tiers = (("gpu", "device"), ("nvme", "NVMe")) if unified else \
        (("gpu", "GPU"), ("cpu", "host"), ("nvme", "NVMe"))
    L.append("peaks     " + "  ".join(
        f"{lbl} {fmt_bytes(pk[t_])} of {fmt_bytes(b.get(t_ + '_bytes'))}" for t_, lbl in tiers)
        + ("" if r["fits"] else "   DOES NOT FIT"))
    L.append("moved     " + ("  ".join(f"{LINK_LABEL.get(k, k)} {fmt_bytes(v)}"
                                       for k, v in r["bytes_moved"].items())
                             or "nothing"))
    L.append("decisions " + ", ".join(f"{k} {v}" for k, v in r["decision_counts"].items()))
    L.append("")
    L.append("binding constraints:")
    for c in r["binding"]:
        L.append(f"  - {c['text']}")
    L.append("")
    cols = ["unit", "decision", "checkpoint", "A_bytes", "gpu_bytes", "cpu_bytes", "nvme_bytes",
            "offload_ms", "prefetch_ms", "fwd_ms", "bwd_ms"]
    rows = []
    for u in r["units"]:
        rows.append(dict(u, offload_ms=_fmt_span((u["offload_start_s"], u["offload_end_s"])
                                                 if u["offload_start_s"] is not None else None),
                         prefetch_ms=_fmt_span((u["prefetch_start_s"], u["prefetch_end_s"])
                                               if u["prefetch_start_s"] is not None else None),
                         fwd_ms=u["fwd_s"], bwd_ms=u["bwd_s"]))
    df = _frame(rows, cols, {"A_bytes": fmt_bytes, "gpu_bytes": _bytes0, "cpu_bytes": _bytes0,
                             "nvme_bytes": _bytes0, "fwd_ms": _ms, "bwd_ms": _ms})
    if unified:
        df = df.drop(columns=["cpu_bytes"])
    df = df.rename(columns={"A_bytes": "A_i", "gpu_bytes": "on device" if unified else "on GPU",
                            "cpu_bytes": "to host",
                            "nvme_bytes": "to NVMe", "offload_ms": "offload (ms)",
                            "prefetch_ms": "fetch back (ms)", "fwd_ms": "fwd ms",
                            "bwd_ms": "bwd ms"})
    L.append(df.to_string(index=False))
    if report_rows:
        L.append("")
        L.append(format_report(report_rows))
    for w in r.get("warnings", []):
        L.append(f"warning: {w}")
    return "\n".join(L)


def format_report(rows: list[dict]) -> str:
    w = max(len(row["label"]) for row in rows)
    L = ["measured vs predicted:", f"  {'':<{w}}  {'predicted':>12}  {'measured':>12}  ratio"]
    for row in rows:
        f = fmt_seconds if row["quantity"].endswith("_s") else fmt_bytes
        ratio = f"{row['ratio']:.3f}x" if row["ratio"] is not None else "-"
        L.append(f"  {row['label']:<{w}}  {f(row['predicted']):>12}  {f(row['measured']):>12}  "
                 f"{ratio}")
    return "\n".join(L)


def format_profile(r: dict) -> str:
    m, t = r["model"], r["totals"]
    L = [f"profile {r['profile']}",
         f"  model     {m['name']}  batch {m['batch']}  seq {m['seq']}  {m['dtype']}  "
         f"attention {m.get('attention')}",
         f"  device    {r['device']} ({r['timing']} times)  hardware {r['hardware']}",
         f"  totals    static {fmt_bytes(t['static_bytes'])}  saved {fmt_bytes(t['saved_bytes'])}"
         f"  (actionable A {fmt_bytes(t['A_bytes'])})  max workspace "
         f"{fmt_bytes(t['max_workspace_bytes'])}",
         f"            forward {t['fwd_flops'] / 1e12:.2f} TFLOP  backward "
         f"{t['bwd_flops'] / 1e12:.2f} TFLOP  compute-only step {fmt_seconds(t['compute_s'])}",
         ""]
    cols = ["unit", "kind", "param_bytes", "input_bytes", "saved_bytes", "A_bytes",
            "workspace_bytes", "fwd_flops", "bwd_flops", "fwd_s", "bwd_s"]
    tf = lambda x: f"{x / 1e9:.1f}"  # noqa: E731
    df = _frame(r["units"], cols, {"param_bytes": _bytes0, "input_bytes": fmt_bytes,
                                   "saved_bytes": fmt_bytes, "A_bytes": fmt_bytes,
                                   "workspace_bytes": fmt_bytes, "fwd_flops": tf,
                                   "bwd_flops": tf, "fwd_s": _ms, "bwd_s": _ms})
    df = df.rename(columns={"param_bytes": "params", "input_bytes": "X_i", "saved_bytes": "saved",
                            "A_bytes": "A_i", "workspace_bytes": "workspace",
                            "fwd_flops": "fwd GFLOP", "bwd_flops": "bwd GFLOP",
                            "fwd_s": "fwd ms", "bwd_s": "bwd ms"})
    L.append(df.to_string(index=False))
    return "\n".join(L)


# ----------------------------------------------------------------------------- CLI

def cli_inspect(args) -> int:
    obj = load_any(args.plan)
    if isinstance(obj, Profile):
        if args.plot or args.report:
            raise UserError(f"'{args.plan}' is a profile: --plot and --report need a plan; run "
                            f"'plan solve {args.plan} --gpu-mem SIZE' first")
        r = analyse_profile(obj, args.plan)
        text = None if args.json else format_profile(r)
    else:
        tl = timeline(obj)
        r = analyse(obj, args.plan, tl)
        report_rows = None
        if args.report:
            report_rows = compare_report(args.report, obj, r)
            r["report"] = {"path": args.report, "rows": report_rows}
        if args.plot:
            from .plot import save_plot
            save_plot(obj, args.plot, tl, title_path=args.plan)
            r["plot"] = args.plot
        text = None if args.json else format_plan(r, report_rows)
    if args.json:
        json.dump(r, sys.stdout, sort_keys=True, indent=1)
        sys.stdout.write("\n")
    else:
        print(text)
        if getattr(args, "plot", None) and isinstance(obj, Plan):
            print(f"\nwrote {args.plot}")
    return 0
