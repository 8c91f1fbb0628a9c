"""The planner's promises (issue 8), measured on a population of random profiles.

Four parts, each printed as a table (docs/promises.md has the figures and the command):

1. objective = simulation: for random (profile, budget) pairs, the written plan's
   ``plan.solver.objective`` (when a MILP wrote it) against ``simulate(plan).step_s``;
2. monotonicity: GPU budget scans; the written plan's simulated step must not rise by more
   than the gap as the budget grows;
3. exhaustive: on profiles of at most four blocks, the written plan against
   ``exhaustive.best_plan`` (true optimum) and exit 3's named budget against
   ``exhaustive.smallest_budget`` (true minimum);
4. the gpt2-xl scan: ``--gpu-mem`` 30G..46G in 1.25G steps on the a100-80g spec.

Profiles come from ``synthetic.random_profile(seed, hw, n_blocks=...)`` over the shipped
specs. Every case is drawn from ``random.Random(seed)`` alone (spec, blocks, streaming mode,
budgets), and every failure is printed with its seed, so

    .venv/bin/python bench/promises.py                       # full run (docs/promises.md)
    .venv/bin/python bench/promises.py --quick               # a few minutes
    .venv/bin/python bench/promises.py --parts 1 --seeds 1017   # one pair again, verbosely

reruns it. Exit code 1 when a promise failed.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# not bench/ itself: bench/profile.py would shadow the standard library's profile module
sys.path = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]     # tests/: the synthetic profiles, the brute force

from planner.costmodel.baselines import baseline_layers                      # noqa: E402
from planner.errors import NoFitError                              # noqa: E402
from planner.formats import Budgets                                # noqa: E402
from planner.hardware import load_hardware                         # noqa: E402
from planner.plans import cost_model, plan_and_sim                 # noqa: E402
from planner.plans.simulate import simulate                              # noqa: E402
from planner.solve import baselines, default_solver, solve_profile  # noqa: E402
from synthetic import random_profile                       # noqa: E402

SPECS = ("a100-80g", "h100-80g", "h200", "rtx4090", "cpu-host")
GAP = 0.005            # plan solve's default --gap
OBJ_TOL = 0.01         # part 1: |objective - simulated| / simulated beyond this is a failure
MONO_TOL = 0.005       # part 2: a rise beyond this (the gap) is a failure
NAMED_TOL = 0.005      # part 3: named budget beyond the true minimum by this is a failure
BASE = {1: 1000, 2: 2000, 3: 3000}   # first seed of each part (seed = BASE + index)
NVME_DIR = tempfile.mkdtemp(prefix="tierplan-promises-")
VERBOSE = False


def log(*a):
    print(*a, flush=True)


def quiet(fn, *a, **k):
    """Run ``fn`` with the planner's stderr warnings captured (counted, not printed)."""
    buf = io.StringIO()
    with contextlib.redirect_stderr(buf):
        try:
            return fn(*a, **k)
        finally:
            if VERBOSE and buf.getvalue():
                sys.stdout.write(buf.getvalue())


def solve(prof, hw, b, **kw):
    """``solve_profile`` timed: (outcome or NoFitError, seconds)."""
    t0 = time.perf_counter()
    try:
        out = quiet(solve_profile, prof, None, hw, b, nvme_dir=NVME_DIR, **kw)
    except NoFitError as e:
        out = e
    except Exception as e:          # noqa: BLE001 -- a crash is a finding, recorded by seed
        out = Crash(f"{type(e).__name__}: {e}")
    return out, time.perf_counter() - t0


class Crash:
    """``solve_profile`` raised something other than NoFitError (a broken promise)."""

    def __init__(self, msg):
        self.msg = msg

    def __repr__(self):
        return self.msg


def host_budget(hw, rng, scale_bytes):
    """A host budget the spec allows (0 on unified memory; at most what it lets the runtime
    pin), drawn like tests/test_milp.py: 0.2x to 2x the keep-all GPU peak."""
    if hw.unified_memory:
        return 0
    return min(int(hw.pinned_limit), int(scale_bytes * rng.uniform(0.2, 2.0)))


def budget_range(prof, hw, cpu, nvme, stream, K=1):
    """(lo, hi) as GPU budgets (the spec's reserve included): lo, the smallest GPU peak of any
    baseline that fits the host and NVMe budgets (so every GPU budget from lo up has a plan),
    hi, keep-all's peak."""
    big = Budgets(10**15, cpu, nvme)
    cm = cost_model(prof, hw, big, K, allow_streaming=stream != "off")
    cands = quiet(baselines, prof, None, hw, big, cm, NVME_DIR, K)
    lo = min((c.sim.peak_gpu_bytes for c in cands if c.sim.fits), default=None)
    keep = quiet(plan_and_sim, prof, None, hw, big, "keep-all",
                 baseline_layers("keep-all", prof.layers, hw), micro_batches=K)[1]
    res = int(hw.reserved_bytes)
    return (None if lo is None else lo + res), keep.peak_gpu_bytes + res


def keep_peak(prof, hw, K=1):
    big = Budgets(10**15, 0 if hw.unified_memory else 10**15, 10**15)
    return quiet(plan_and_sim, prof, None, hw, big, "keep-all",
                 baseline_layers("keep-all", prof.layers, hw), micro_batches=K)[1].peak_gpu_bytes


def table(head, rows):
    cols = [[str(h)] + [str(r[i]) for r in rows] for i, h in enumerate(head)]
    w = [max(len(x) for x in c) for c in cols]
    log("| " + " | ".join(h.ljust(w[i]) for i, h in enumerate(head)) + " |")
    log("|" + "|".join("-" * (x + 2) for x in w) + "|")
    for r in rows:
        log("| " + " | ".join(str(x).ljust(w[i]) for i, x in enumerate(r)) + " |")


def g(x):
    return f"{x:.3g}" if isinstance(x, float) else str(x)


# ----------------------------------------------------------------------------- part 1

def part1_case(seed, time_limit):
    rng = random.Random(seed)
    spec = rng.choice(SPECS)
    hw = load_hardware(spec)
    n = rng.randint(3, 40)
    stream = rng.choice(["auto", "auto", "on", "off"])
    K = rng.choice([1, 1, 2])
    prof = random_profile(seed, hw, n_blocks=n)
    cpu = host_budget(hw, rng, keep_peak(prof, hw, K))
    nvme = rng.choice([0, 10**13])
    lo, hi = budget_range(prof, hw, cpu, nvme, stream, K)
    rec = dict(seed=seed, spec=spec, n=n, stream=stream, K=K, cpu=cpu, nvme=nvme)
    if lo is None:
        rec["skip"] = "no baseline fits the host/NVMe budgets"
        return rec
    gpu = int(rng.uniform(lo, max(lo, hi)))
    rec["gpu"] = gpu
    out, s = solve(prof, hw, Budgets(gpu, cpu, nvme), stream=stream, micro_batches=K,
                   time_limit=time_limit, gap=GAP)
    rec["solve_s"] = round(s, 3)
    if isinstance(out, Crash):
        rec["crash"] = out.msg
        return rec
    if isinstance(out, NoFitError):
        rec["exit3"] = str(out)
        return rec
    sim = simulate(out.plan)
    rec.update(origin=out.plan.solver.origin, objective=out.plan.solver.objective,
               sim=sim.step_s, fits=sim.fits, status=out.plan.solver.status)
    if out.plan.solver.objective is not None:
        rec["diff"] = abs(out.plan.solver.objective - sim.step_s) / sim.step_s
    return rec


def pmap(fn, args, jobs):
    """``fn(*a)`` for each ``a``, in order; in ``jobs`` forked workers when jobs > 1."""
    if jobs <= 1:
        for a in args:
            yield fn(*a)
        return
    import multiprocessing as mp
    with mp.get_context("fork").Pool(jobs) as pool:
        yield from pool.imap(_star, [(fn, a) for a in args])


def _star(fa):
    return fa[0](*fa[1])


def part1(seeds, time_limit, jobs=1):
    log(f"\n## 1. Objective vs simulation ({len(seeds)} pairs, seeds {seeds[0]}..{seeds[-1]}, "
        f"--time-limit {time_limit:g} s, --gap {GAP}, {jobs} worker(s))")
    recs = []
    t0 = time.perf_counter()
    for i, r in enumerate(pmap(part1_case, [(s, time_limit) for s in seeds], jobs)):
        recs.append(r)
        if (VERBOSE or "diff" in r and r["diff"] > OBJ_TOL or "exit3" in r or "crash" in r
                or r.get("fits") is False):
            log(f"  {json.dumps(r)}")
        if (i + 1) % 25 == 0:
            log(f"  ... {i + 1}/{len(seeds)} pairs, {time.perf_counter() - t0:.0f} s")
    origins = {}
    for r in recs:
        key = r.get("origin") or ("exit 3" if "exit3" in r else
                                  "crash" if "crash" in r else "skipped")
        key = key.split(":")[0] + (":" + key.split(":")[1].split("/")[0] if ":" in key else "")
        origins.setdefault(key, [0, 0, 0, 0.0])
        o = origins[key]
        o[0] += 1
        if "diff" in r:
            o[1] += 1
            o[2] += r["diff"] > OBJ_TOL
            o[3] = max(o[3], r["diff"])
    rows = [[k, v[0], v[1], v[2], f"{100 * v[3]:.4f}%" if v[1] else "-"]
            for k, v in sorted(origins.items(), key=lambda kv: -kv[1][0])]
    withobj = [r for r in recs if "diff" in r]
    bad = [r for r in withobj if r["diff"] > OBJ_TOL]
    worst = max(withobj, key=lambda r: r["diff"], default=None)
    rows.append(["all", len(recs), len(withobj), len(bad),
                 f"{100 * worst['diff']:.4f}%" if worst else "-"])
    table(["origin", "plans", "with objective", "|diff| > 1%", "max |diff|"], rows)
    n05 = sum(r["diff"] > 0.001 for r in withobj)
    log(f"plans whose objective differs from the simulated step by > 0.1%: {n05}")
    if worst:
        log(f"largest |diff|: {100 * worst['diff']:.4f}% (seed {worst['seed']}, {worst['spec']}, "
            f"{worst['n']} blocks, --stream {worst['stream']}, K={worst['K']}, origin "
            f"{worst['origin']}: objective {worst['objective']:.6g} s, simulated "
            f"{worst['sim']:.6g} s)")
    nofit = [r for r in recs if r.get("fits") is False]
    ex3 = [r for r in recs if "exit3" in r]
    log(f"written plans that do not fit in the simulator: {len(nofit)}; exit 3 at a budget a "
        f"baseline fits: {len(ex3)}" + (f" (seeds {[r['seed'] for r in ex3]})" if ex3 else ""))
    log(f"solve seconds: median {sorted(r.get('solve_s', 0) for r in recs)[len(recs) // 2]:.2f}, "
        f"max {max(r.get('solve_s', 0) for r in recs):.2f}; streaming "
        f"on/auto/off {sum(r['stream'] == 'on' for r in recs)}/"
        f"{sum(r['stream'] == 'auto' for r in recs)}/{sum(r['stream'] == 'off' for r in recs)}; "
        f"part took {time.perf_counter() - t0:.0f} s")
    crash = [r for r in recs if "crash" in r]
    log(f"solve_profile raised something other than exit 3: {len(crash)}"
        + "".join(f"\n  seed {r['seed']} ({r['spec']}, {r['n']} blocks, --stream {r['stream']}, "
                  f"K={r['K']}, --gpu-mem {r['gpu']} --cpu-mem {r['cpu']} --nvme-mem "
                  f"{r['nvme']}): {r['crash']}" for r in crash))
    failed = [r["seed"] for r in bad + nofit + ex3 + crash]
    return {"records": recs, "failed_seeds": failed}


# ----------------------------------------------------------------------------- part 2

def part2_profile(seed, steps, time_limit, nmax):
    rng = random.Random(seed)
    spec = rng.choice(SPECS)
    hw = load_hardware(spec)
    n = rng.randint(3, nmax)
    prof = random_profile(seed, hw, n_blocks=n)
    cpu = host_budget(hw, rng, keep_peak(prof, hw))
    nvme = rng.choice([0, 10**13])
    lo, hi = budget_range(prof, hw, cpu, nvme, "auto")
    rec = dict(seed=seed, spec=spec, n=n, cpu=cpu, nvme=nvme, points=[])
    if lo is None:
        rec["skip"] = "no baseline fits the host/NVMe budgets"
        return rec
    hi = max(hi * 1.02, lo * 1.05)
    for k in range(steps):
        gb = int(lo + (hi - lo) * k / (steps - 1))
        out, s = solve(prof, hw, Budgets(gb, cpu, nvme), time_limit=time_limit, gap=GAP)
        if isinstance(out, Crash):
            rec["points"].append(dict(gpu=gb, crash=out.msg, solve_s=round(s, 3)))
        elif isinstance(out, NoFitError):
            rec["points"].append(dict(gpu=gb, exit3=True, solve_s=round(s, 3)))
        else:
            rec["points"].append(dict(gpu=gb, step=simulate(out.plan).step_s,
                                      origin=out.plan.solver.origin, solve_s=round(s, 3)))
    rises, worst = [], None
    best_so_far = math.inf
    prev = None
    for p in rec["points"]:
        if "crash" in p:
            continue
        if "exit3" in p:
            if prev is not None:
                rises.append(dict(gpu=p["gpu"], rise=math.inf, exit3_after_fit=True))
            continue
        if prev is not None and p["step"] > prev["step"] * (1 + 1e-12):
            r = p["step"] / prev["step"] - 1
            rises.append(dict(gpu=p["gpu"], prev_gpu=prev["gpu"], rise=r,
                              vs_best=p["step"] / best_so_far - 1))
        best_so_far = min(best_so_far, p["step"])
        prev = p
    rec["rises"] = rises
    return rec


def part2(seeds, steps, time_limit, nmax, jobs=1):
    log(f"\n## 2. Monotonicity ({len(seeds)} profiles x {steps} GPU budgets, seeds "
        f"{seeds[0]}..{seeds[-1]}, 3-{nmax} blocks, --stream auto, --time-limit {time_limit:g} s,"
        f" --gap {GAP}, {jobs} worker(s))")
    t0 = time.perf_counter()
    recs = []
    for r in pmap(part2_profile, [(s, steps, time_limit, nmax) for s in seeds], jobs):
        seed = r["seed"]
        recs.append(r)
        big = [x for x in r.get("rises", []) if x["rise"] > MONO_TOL]
        log(f"  seed {seed} {r['spec']} {r['n']} blocks: "
            + (r["skip"] if "skip" in r else
               f"{len(r['points'])} points, {len(r['rises'])} rise(s), {len(big)} > 0.5%, "
               f"{sum('exit3' in p for p in r['points'])} exit 3, "
               f"{sum('crash' in p for p in r['points'])} crash(es), "
               f"{sum(p['solve_s'] for p in r['points']):.0f} s"))
    pts = sum(len(r.get("points", [])) for r in recs)
    all_rises = [(r, x) for r in recs for x in r.get("rises", [])]
    big = [(r, x) for r, x in all_rises if x["rise"] > MONO_TOL]
    worst = max(all_rises, key=lambda rx: rx[1]["rise"], default=None)
    rows = [[len([r for r in recs if "skip" not in r]), pts, len(all_rises), len(big),
             (f"{100 * worst[1]['rise']:.3f}%" if worst and math.isfinite(worst[1]["rise"])
              else ("exit 3 after a fit" if worst else "-"))]]
    table(["profiles", "solves", "rises (any)", "rises > 0.5%", "largest rise"], rows)
    if worst:
        r, x = worst
        log(f"largest rise: seed {r['seed']} ({r['spec']}, {r['n']} blocks, --cpu-mem {r['cpu']},"
            f" --nvme-mem {r['nvme']}): --gpu-mem {x.get('prev_gpu')} -> {x['gpu']} B, "
            f"step +{100 * x['rise']:.3f}% (vs the best at any smaller budget "
            f"+{100 * x.get('vs_best', float('nan')):.3f}%)")
    crash = [(r, p) for r in recs for p in r.get("points", []) if "crash" in p]
    log(f"solves that raised something other than exit 3: {len(crash)}"
        + "".join(f"\n  seed {r['seed']} --gpu-mem {p['gpu']}: {p['crash']}" for r, p in crash))
    log(f"part took {time.perf_counter() - t0:.0f} s")
    return {"records": recs,
            "failed_seeds": sorted({r["seed"] for r, _ in big} | {r["seed"] for r, _ in crash})}


# ----------------------------------------------------------------------------- part 3

def part3_case(seed, stream_on):
    from exhaustive import best_plan, smallest_budget
    rng = random.Random(seed)
    spec = rng.choice(SPECS)
    hw = load_hardware(spec)
    n = 1 if stream_on else rng.choice([1, 2, 2, 3, 3, 4])
    stream = "on" if stream_on else "off"
    prof = random_profile(seed, hw, n_blocks=n)
    cpu = 0 if hw.unified_memory else min(10**12, int(hw.pinned_limit))
    nvme = 10**13
    rec = dict(seed=seed, spec=spec, n=n, stream=stream, cpu=cpu, nvme=nvme)
    t0 = time.perf_counter()
    true_min = quiet(smallest_budget, prof, hw, Budgets(0, cpu, nvme), stream=stream)
    rec["true_min"] = true_min
    if true_min is None:
        rec["skip"] = "no GPU budget fits"
        return rec
    out, _ = solve(prof, hw, Budgets(int(true_min * 0.97), cpu, nvme), stream=stream,
                   time_limit=60, gap=GAP)
    if isinstance(out, Crash):
        rec["crash"] = out.msg
        out = None
    if isinstance(out, NoFitError):
        rec["named"] = out.needed_bytes
        rec["named_tier"] = out.budget
        if out.needed_bytes is not None and out.budget == "gpu":
            rec["excess"] = out.needed_bytes / true_min - 1
    elif out is not None:
        rec["below_min"] = simulate(out.plan).step_s      # a plan below the true minimum
    base = rec.get("named") if rec.get("named_tier") == "gpu" else true_min
    budgets = [base, int(base * rng.uniform(1.0, 1.3))]
    rec["plans"] = []
    for gb in budgets:
        b = Budgets(gb, cpu, nvme)
        out, s = solve(prof, hw, b, stream=stream, time_limit=60, gap=GAP)
        best = quiet(best_plan, prof, hw, b, stream=stream)
        if isinstance(out, Crash):
            rec["plans"].append(dict(gpu=gb, crash=out.msg, best=best))
            continue
        if isinstance(out, NoFitError):
            rec["plans"].append(dict(gpu=gb, exit3=True, best=best))
            continue
        step = simulate(out.plan).step_s
        rec["plans"].append(dict(gpu=gb, step=step, best=best, origin=out.plan.solver.origin,
                                 slower=step / best - 1 if math.isfinite(best) else None))
    rec["seconds"] = round(time.perf_counter() - t0, 1)
    return rec


def part3(seeds_off, seeds_on):
    log(f"\n## 3. Exhaustive ({len(seeds_off)} profiles of 1-4 blocks --stream off, seeds "
        f"{seeds_off[0] if seeds_off else '-'}..{seeds_off[-1] if seeds_off else '-'}; "
        f"{len(seeds_on)} of 1 block --stream on, seeds "
        f"{seeds_on[0] if seeds_on else '-'}..{seeds_on[-1] if seeds_on else '-'}; --gap {GAP},"
        f" --time-limit 60 s)")
    t0 = time.perf_counter()
    recs = []
    for seed, on in [(s, False) for s in seeds_off] + [(s, True) for s in seeds_on]:
        r = part3_case(seed, on)
        recs.append(r)
        log(f"  {json.dumps(r)}" if VERBOSE else
            f"  seed {seed} {r['spec']} {r['n']} block(s) --stream {r['stream']}: "
            + (r["skip"] if "skip" in r else
               f"named {('+%.4f%%' % (100 * r['excess'])) if 'excess' in r else r.get('named_tier', 'none (a plan was written)')}, "
               f"slower than best {[('%.4f%%' % (100 * p['slower'])) if p.get('slower') is not None else ('exit 3' if p.get('exit3') else '-') for p in r['plans']]}, "
               f"{r['seconds']} s"))
    rows = []
    for label, sel in (("--stream off", [r for r in recs if r["stream"] == "off"]),
                       ("--stream on (1 block)", [r for r in recs if r["stream"] == "on"]),
                       ("all", recs)):
        plans = [p for r in sel for p in r.get("plans", [])]
        sl = [p["slower"] for p in plans if p.get("slower") is not None]
        ex = [r["excess"] for r in sel if "excess" in r]
        rows.append([label, len(sel), len(plans), sum(x > GAP + 1e-9 for x in sl),
                     f"{100 * max(sl):.4f}%" if sl else "-",
                     sum(p.get("exit3", False) for p in plans),
                     len(ex), sum(x > NAMED_TOL for x in ex),
                     f"{100 * max(ex):.4f}%" if ex else "-",
                     sum("below_min" in r for r in sel)
                     + sum(1 for r in sel if "named" in r and "excess" not in r)])
    table(["profiles", "n", "plans", "slower > gap", "max slower", "exit 3 though a plan fits",
           "exit-3 cases", "named > min + 0.5%", "max excess", "other (plan below min / "
           "non-GPU budget named)"], rows)
    beat = [(r["seed"], p["gpu"]) for r in recs for p in r.get("plans", [])
            if p.get("slower") is not None and p["slower"] < -1e-6]
    log(f"plans faster than the enumeration (should be none): {len(beat)} {beat if beat else ''}")
    log(f"part took {time.perf_counter() - t0:.0f} s")
    crash = [r for r in recs if "crash" in r or any("crash" in p for p in r.get("plans", []))]
    log(f"profiles where a solve raised something other than exit 3: {len(crash)} "
        f"{[r['seed'] for r in crash] if crash else ''}")
    failed = sorted({r["seed"] for r in recs
                     if r.get("excess", 0) > NAMED_TOL or "below_min" in r or r in crash
                     or any((p.get("slower") or 0) > GAP + 1e-9 or p.get("exit3")
                            for p in r.get("plans", []))} | {s for s, _ in beat})
    return {"records": recs, "failed_seeds": failed}


# ----------------------------------------------------------------------------- part 4

def part4(step_g, time_limit):
    from planner.profile import profile_model
    from planner.sizes import parse_size
    solver = default_solver()
    log(f"\n## 4. gpt2-xl scan (batch 8, seq 1024, --device meta, a100-80g; --gpu-mem 30G.."
        f"46G in {step_g:g}G steps, --cpu-mem 512G, solver {solver}, --time-limit "
        f"{time_limit:g} s, --gap {GAP})")
    t0 = time.perf_counter()
    hw = load_hardware("a100-80g")
    prof = quiet(profile_model, "gpt2-xl", 8, 1024, device="meta", hardware=hw)
    cpu = parse_size("512G")
    rows, pts = [], []
    x = 30.0
    while x <= 46.0 + 1e-9:
        size = f"{x:g}G"
        out, s = solve(prof, hw, Budgets(parse_size(size), cpu, 0), solver=solver,
                       time_limit=time_limit, gap=GAP)
        if isinstance(out, Crash):
            pts.append(dict(gpu=size, crash=out.msg, solve_s=s))
            rows.append([size, "crash", "-", "-", "-", f"{s:.1f}"])
            log(f"  {size}: {out.msg}")
        elif isinstance(out, NoFitError):
            pts.append(dict(gpu=size, exit3=str(out), solve_s=s))
            rows.append([size, "exit 3", "-", "-", "-", f"{s:.1f}"])
        else:
            sim = simulate(out.plan).step_s
            obj = out.plan.solver.objective
            d = abs(obj - sim) / sim if obj is not None else None
            pts.append(dict(gpu=size, step=sim, objective=obj, diff=d, solve_s=s,
                            origin=out.plan.solver.origin, status=out.plan.solver.status))
            rows.append([size, out.plan.solver.origin, f"{sim:.6f}",
                         f"{obj:.6f}" if obj is not None else "-",
                         f"{100 * d:.5f}%" if d is not None else "-", f"{s:.1f}"])
        log(f"  {' | '.join(map(str, rows[-1]))}")
        x += step_g
    table(["--gpu-mem", "origin", "simulated step s", "objective s", "|diff|", "solve s"], rows)
    steps = [p["step"] for p in pts if "step" in p]
    rises = [(a, b) for a, b in zip(pts, pts[1:]) if "step" in a and "step" in b
             and b["step"] > a["step"] * (1 + 1e-12)]
    big = [(a, b) for a, b in rises if b["step"] > a["step"] * (1 + MONO_TOL)]
    exit_after = any("exit3" in b for a, b in zip(pts, pts[1:]) if "step" in a)
    mono = not rises and not exit_after
    log(f"monotone (no rise at all): {'yes' if mono else 'no'}; rises {len(rises)}, of which > "
        f"0.5%: {len(big)}" + "".join(f"; {a['gpu']} -> {b['gpu']}: +"
                                    f"{100 * (b['step'] / a['step'] - 1):.3f}%"
                                    for a, b in rises))
    if steps:
        log(f"step {steps[0]:.4f} s at {pts[0]['gpu']} -> {steps[-1]:.4f} s at {pts[-1]['gpu']}")
    log(f"part took {time.perf_counter() - t0:.0f} s")
    bad_diff = [p["gpu"] for p in pts if (p.get("diff") or 0) > OBJ_TOL or "crash" in p]
    return {"points": pts, "monotone": mono,
            "failed": [b["gpu"] for _, b in big] + bad_diff + (["exit 3 after a fit"]
                                                               if exit_after else [])}


# ----------------------------------------------------------------------------- main

def main(argv=None) -> int:
    global VERBOSE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="1,2,3,4", help="which parts, e.g. 1,3 (default all)")
    ap.add_argument("--quick", action="store_true",
                    help="a small run: 40 pairs, 5x10 scans, 6+2 exhaustive cases, 5G steps")
    ap.add_argument("--n", type=int, default=None, help="part 1 pairs (default 400)")
    ap.add_argument("--t1", type=float, default=20.0,
                    help="part 1 --time-limit per solve, s (default 20)")
    ap.add_argument("--scans", type=int, default=None, help="part 2 profiles (default 25)")
    ap.add_argument("--steps", type=int, default=None, help="part 2 budgets per scan (25)")
    ap.add_argument("--t2", type=float, default=20.0,
                    help="part 2 --time-limit per solve, s (default 20)")
    ap.add_argument("--nmax2", type=int, default=10, help="part 2 most blocks (default 10)")
    ap.add_argument("--exh", type=int, default=None,
                    help="part 3 profiles with --stream off (default 20)")
    ap.add_argument("--exh-on", type=int, default=None,
                    help="part 3 one-block profiles with --stream on (default 6)")
    ap.add_argument("--step-g", type=float, default=None, help="part 4 step in G (1.25)")
    ap.add_argument("--t4", type=float, default=60.0,
                    help="part 4 --time-limit, s (default 60, plan solve's)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="parts 1 and 2: cases in this many forked workers (default 1)")
    ap.add_argument("--seeds", default=None,
                    help="rerun these seeds only (comma-separated; of the parts chosen), verbose")
    ap.add_argument("--out", default=None, help="write every record as JSON here")
    a = ap.parse_args(argv)
    q = a.quick
    n1 = a.n if a.n is not None else (40 if q else 400)
    scans = a.scans if a.scans is not None else (5 if q else 25)
    steps = a.steps if a.steps is not None else (10 if q else 25)
    exh = a.exh if a.exh is not None else (6 if q else 20)
    exh_on = a.exh_on if a.exh_on is not None else (2 if q else 6)
    step_g = a.step_g if a.step_g is not None else (5.0 if q else 1.25)
    parts = {int(p) for p in a.parts.split(",") if p.strip()}
    only = [int(s) for s in a.seeds.split(",")] if a.seeds else None
    VERBOSE = only is not None

    def pick(part, count, offset=0):
        seeds = list(range(BASE[part] + offset, BASE[part] + offset + count))
        return [s for s in seeds if s in only] if only is not None else seeds

    log(f"# tierplan promises: solver {default_solver()}, started "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}, argv {sys.argv[1:]}")
    t0 = time.perf_counter()
    res, failed = {}, {}
    if 1 in parts and pick(1, n1):
        res[1] = part1(pick(1, n1), a.t1, a.jobs)
        failed[1] = res[1]["failed_seeds"]
    if 2 in parts and pick(2, scans):
        res[2] = part2(pick(2, scans), steps, a.t2, a.nmax2, a.jobs)
        failed[2] = res[2]["failed_seeds"]
    if 3 in parts and (pick(3, exh) or pick(3, exh_on, 500)):
        res[3] = part3(pick(3, exh), pick(3, exh_on, 500))
        failed[3] = res[3]["failed_seeds"]
    if 4 in parts and only is None:
        res[4] = part4(step_g, a.t4)
        failed[4] = res[4]["failed"]
    log(f"\n## Summary ({time.perf_counter() - t0:.0f} s)")
    for p, f in sorted(failed.items()):
        log(f"part {p}: " + ("held" if not f else
                             f"FAILED: {f} (rerun: bench/promises.py --parts {p}"
                             + (f" --seeds {','.join(map(str, f))})" if p != 4 else ")")))
    if a.out:
        Path(a.out).write_text(json.dumps({str(k): v for k, v in res.items()}, indent=1,
                                          default=str))
    return 1 if any(failed.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
