"""A lower bound on one optimizer step, independent of the planner's schedule: how far is a plan
from what any exact schedule could reach on the same spec?

The bound is a linear program over *where each unit's bytes are*, with every resource running
at once for the whole step. It reads only the profile (per-unit bytes, FLOPs and the times the
profile gives) and the hardware spec (rates, capacities); it does not use the planner's cost
model, its stages or its schedule. So a plan's step over this bound measures both the MILP's
search and the planner's rules (stage barriers, which reorderings it can price).

What the LP assumes of any exact schedule of K micro-batches (one optimizer step, plain
AdamW-style update of every parameter once per step):

- **Compute.** The device runs every unit's forward and backward K times; a unit whose saved
  activations are neither kept nor moved runs its forward again (recompute). The device's
  optimizer step, host-side gradient accumulation and every kernel's launch cost nothing.
- **The turnaround.** At the instant a micro-batch's forward ends and its backward begins
  (batch-major: K such instants; layer-major: one, with all K micro-batches' activations
  held), each unit's weights are on the device, in host memory or on NVMe (fractions
  ``wg + wc + wn = 1``), and its saved activations are kept on the device, in host memory, on
  NVMe or to be recomputed. The device holds its share of weights, the optimizer state homed
  there and the activations kept there, plus the workspace of the unit running then (the
  last), within
  ``--gpu-mem``; the host and NVMe hold theirs within their budgets. Fractions that differ
  between the K turnarounds average to one set that satisfies the same (linear) constraints,
  so one set per unit is no loss.
- **Traffic, at least.** Weights not on the device at a turnaround cross to it for that
  backward (K times batch-major, once layer-major; from NVMe if they were there). A unit
  stepped on the host sends its gradient to the host once (accumulation on the device is free)
  and its updated weights back once. A unit stepped on the device whose state lives on the
  host or NVMe moves that state both ways. Weights on NVMe at a turnaround were written there
  once since the last update. Offloaded activations cross out and back once per micro-batch.
  Nothing else moves: forwards never re-fetch, the optimizer needs no staging.
- **Rates.** The spec's own: compute at the profile's per-unit times, H2D, D2H and both at
  once (``duplex``), NVMe reads over the read rate plus writes over the write rate (one
  array, the spec's aggregate), the host's AdamW at ``cpu_adam_params_per_s``.
- **Overlap.** Every resource is busy at once for the whole step and an update may run beside
  the backward of other units ("exact reorderings allowed": what ``--clip none`` permits).
  The step is at least the busiest resource.

The bound is the smaller of the batch-major and layer-major LPs (each a valid bound of its
order). It is a bound, not a schedule: it may be far below anything that runs.

    python bench/bound.py                       # the six cases of issue 25, plans solved here
    python bench/bound.py --cases llama3-8b/4090/k8 --time-limit 60
    python bench/bound.py --plans DIR           # plans already written by bench/capacity.py
                                                # --save-plans DIR: bound them, solve nothing
    python bench/bound.py --optimizer-overlap auto,paced   # each case under both schedules
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import pulp  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)

# issue 25's six cases (bench/capacity.py's keys)
SIX = ("gpt3-175b/a100/k1", "gpt3-175b/a100/k8", "gpt3-175b/4090/k8", "llama3-8b/4090/k1",
       "llama3-8b/4090/k8", "llama2-13b/h200/k1")
OPT_HOMES = ("g", "c", "nc", "hg", "ng")   # state on gpu / host / nvme, stepped on host (c, nc)
#                                            or on the device (g, hg, ng)
ACT = ("g", "c", "n", "r")                 # activations kept / host / nvme / recomputed


def step_bound(layers, hw, gpu: int, cpu: int, nvme: int, K: int, order: str) -> dict:
    """The LP's optimum for one micro-batch order: ``{"step_s", "busy": {resource: s}}``.
    ``layers``: the profile's unit records; budgets in bytes; ``order``: batch-major or
    layer-major."""
    m_turn = K if order == "batch-major" else 1          # turnarounds per step
    m_hold = 1 if order == "batch-major" else K          # micro-batches held at a turnaround
    lp = pulp.LpProblem("step_bound", pulp.LpMinimize)
    T = pulp.LpVariable("T", lowBound=0)
    lp += T
    w = {(i, t): pulp.LpVariable(f"w_{t}_{i}", 0, 1) for i in range(len(layers)) for t in "gcn"}
    s = {(i, t): pulp.LpVariable(f"s_{t}_{i}", 0, 1) for i in range(len(layers)) for t in OPT_HOMES}
    a = {(i, t): pulp.LpVariable(f"a_{t}_{i}", 0, 1) for i in range(len(layers)) for t in ACT}
    mem = {"gpu": [], "cpu": [], "nvme": []}
    h2d, d2h, nv_r, nv_w, comp, adam = [], [], [], [], [], []
    for i, u in enumerate(layers):
        lp += pulp.lpSum(w[i, t] for t in "gcn") == 1
        lp += pulp.lpSum(s[i, t] for t in OPT_HOMES) == 1
        lp += pulp.lpSum(a[i, t] for t in ACT) == 1
        P, G, O = u.param_bytes, u.grad_bytes, u.optimizer_bytes
        A = u.activation_bytes
        on_host_step = s[i, "c"] + s[i, "nc"]
        mem["gpu"] += [P * w[i, "g"], O * s[i, "g"], m_hold * A * a[i, "g"]]
        mem["cpu"] += [P * w[i, "c"], O * (s[i, "c"] + s[i, "hg"]), m_hold * A * a[i, "c"]]
        mem["nvme"] += [P * w[i, "n"], O * (s[i, "nc"] + s[i, "ng"]), m_hold * A * a[i, "n"]]
        comp += [K * (u.fwd_s + u.bwd_s), K * u.fwd_s * a[i, "r"]]
        adam.append(u.param_count * on_host_step)
        # weights: fetched for each backward unless on the device; a host step's update returns
        h2d += [m_turn * P * (w[i, "c"] + w[i, "n"]), P * on_host_step]
        nv_r.append(m_turn * P * w[i, "n"])
        nv_w.append(P * w[i, "n"])
        d2h.append(G * on_host_step)
        # state stepped on the device but living off it: in and out once
        off = s[i, "hg"] + s[i, "ng"]
        h2d.append(O * off)
        d2h.append(O * off)
        nv_r.append(O * (s[i, "nc"] + s[i, "ng"]))
        nv_w.append(O * (s[i, "nc"] + s[i, "ng"]))
        # activations moved: out and back once per micro-batch
        moved = a[i, "c"] + a[i, "n"]
        h2d.append(K * A * moved)
        d2h.append(K * A * moved)
        nv_r.append(K * A * a[i, "n"])
        nv_w.append(K * A * a[i, "n"])
    # the unit running at the turnaround is the last (the head): its workspace only
    lp += pulp.lpSum(mem["gpu"]) + layers[-1].workspace_bytes <= gpu
    lp += pulp.lpSum(mem["cpu"]) <= cpu
    lp += pulp.lpSum(mem["nvme"]) <= nvme
    busy = {"compute": pulp.lpSum(comp)}
    if not hw.unified_memory:
        busy["h2d"] = pulp.lpSum(h2d) * (1.0 / hw.h2d_bandwidth)
        busy["d2h"] = pulp.lpSum(d2h) * (1.0 / hw.d2h_bandwidth)
        busy["duplex"] = (pulp.lpSum(h2d) + pulp.lpSum(d2h)) * (1.0 / hw.duplex)
    rb, wb = hw.nvme_read_bandwidth, hw.nvme_write_bandwidth
    if rb and wb:
        busy["nvme"] = pulp.lpSum(nv_r) * (1.0 / rb) + pulp.lpSum(nv_w) * (1.0 / wb)
    elif nvme:
        raise ValueError(f"spec {hw.name} gives no NVMe rates but the NVMe budget is {nvme}")
    if hw.cpu_adam_params_per_s:
        busy["cpu-adam"] = pulp.lpSum(adam) * (1.0 / hw.cpu_adam_params_per_s)
    else:
        lp += pulp.lpSum(adam) == 0
    for e in busy.values():
        lp += T >= e
    status = lp.solve(_solver())
    if pulp.LpStatus[status] != "Optimal":
        return {"step_s": float("inf"), "busy": {}, "status": pulp.LpStatus[status]}
    return {"step_s": T.value(), "busy": {k: pulp.value(e) for k, e in busy.items()},
            "status": "Optimal"}


def _solver():
    """HiGHS through highspy where installed, else PuLP's CBC. HiGHS prints its banner on the
    first instance a process makes, whatever PuLP's ``msg``: that one is made quietly here."""
    from planner.solve.highs import available, quiet
    if not available():
        return pulp.PULP_CBC_CMD(msg=False)
    quiet()
    return pulp.HiGHS(msg=False)


def bound_of(layers, hw, gpu, cpu, nvme, K) -> dict:
    """The smaller of the two orders' bounds, with the order named."""
    best = None
    for order in ("batch-major", "layer-major"):
        r = step_bound(layers, hw, gpu, cpu, nvme, K, order)
        r["order"] = order
        if best is None or r["step_s"] < best["step_s"]:
            best = r
    return best


def _row(key, plan, hw, cpu_budget) -> str:
    b = plan.budgets
    K = plan.micro_batches
    # the host budget as the cost model sees it (capped at the pinned limit), as the plan ran
    r = bound_of(plan.units, hw, b.gpu_bytes, cpu_budget, b.nvme_bytes, K)
    busy = ", ".join(f"{k} {v:.1f}" for k, v in sorted(r["busy"].items(), key=lambda kv: -kv[1])
                     if v > 0.005 * r["step_s"])
    step = plan.predicted.step_s
    return (f"| {key} | {step:.2f} s | {plan.micro_batch_order}, {plan.optimizer_overlap}, "
            f"{plan.solver.origin} | {r['step_s']:.2f} s ({r['order']}) | "
            f"{step / r['step_s']:.2f} | {busy} |")


def _capacity():
    """bench/capacity.py as a module (its cases, specs and budgets); bench/ is not on the path,
    where bench/runtime.py would shadow the runtime package."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("capacity", ROOT / "bench" / "capacity.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["capacity"] = mod          # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(SIX),
                    help="bench/capacity.py case keys (default: issue 25's six)")
    ap.add_argument("--plans", default=None, metavar="DIR",
                    help="read DIR/<case>.json (bench/capacity.py --save-plans) instead of solving")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--clip", default="none", choices=["none", "global"])
    ap.add_argument("--micro-batch-order", default="auto",
                    choices=["batch-major", "layer-major", "auto"])
    ap.add_argument("--optimizer-overlap", default="auto", metavar="MODES",
                    help="as plan solve --optimizer-overlap; several, comma-separated (e.g. "
                    "auto,paced): each case solved under each, a row each (default auto)")
    args = ap.parse_args(argv)
    # plans read from --plans were solved elsewhere: one set, named by nothing here
    modes = [""] if args.plans else args.optimizer_overlap.split(",")
    if not set(modes) <= {"", "auto", "on", "off", "paced"}:
        print(f"bench/bound.py: --optimizer-overlap {args.optimizer_overlap!r}: use auto, on, "
              "off or paced, comma-separated", file=sys.stderr)
        return 2
    capacity = _capacity()
    from planner.plans.load import load_plan
    from planner.sizes import parse_size
    keys = args.cases.split(",")
    cases = [c for c in capacity.CASES if c.key in keys]
    if len(cases) != len(keys):
        known = ", ".join(c.key for c in capacity.CASES)
        print(f"bench/bound.py: unknown case in --cases {args.cases!r}; known: {known}",
              file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="tierplan-bound-") as d:
        for mode in modes:
            out = Path(args.plans) if args.plans else Path(d) / mode
            if not args.plans:
                cap_args = ["--time-limit", str(args.time_limit), "--clip", args.clip,
                            "--micro-batch-order", args.micro_batch_order,
                            "--optimizer-overlap", mode, "--save-plans", str(out),
                            "--cases", ",".join(keys)]
                capacity.main(cap_args)
            label = f" ({mode})" if len(modes) > 1 else ""
            for c in cases:
                p = out / (c.key.replace("/", "_") + ".json")
                if not p.exists():
                    rows.append(f"| {c.key}{label} | no plan (exit 3 or not solved) | - | - | - "
                                "| - |")
                    continue
                plan = load_plan(p)
                hw = capacity._spec(c)
                cpu = min(parse_size(c.cpu, "--cpu-mem"), hw.pinned_limit)
                rows.append(_row(c.key + label, plan, hw, cpu))
    print("\nStep against an independent lower bound (bench/bound.py's LP; every resource at "
          f"once, exact reorderings allowed); plans: --clip {args.clip}, --micro-batch-order "
          f"{args.micro_batch_order}, --optimizer-overlap {args.optimizer_overlap}\n")
    print("| case | plan step | plan (order, optimizer, origin) | bound (order) | step / bound "
          "| bound's busy resources, s |")
    print("|---|---:|---|---:|---:|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
