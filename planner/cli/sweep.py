"""``plan sweep``: solve along one budget axis and show what each step of memory buys.

The axis is one of ``--gpu-mem``, ``--cpu-mem``, ``--nvme-mem`` given as ``A:B:STEP``; the other
budgets and every solve option are those of ``plan solve`` (``command.parse_budgets``, one
``SolveConfig`` and ``search.solve`` per point, so every point's plan goes through the same
strategies and the same simulator check). Points are solved from the smallest budget up, and
each fitting plan is handed to the next solve as a seed (``solve(seeds=...)``): it fits
the larger budget unchanged, so it is a candidate there and, when it is the fastest, the MILP's
warm start. A point therefore never predicts a slower step than the point below it.

The knee is the point of greatest distance below the chord of the normalised curve (the
"kneedle" rule, Satopää et al. 2011, for a decreasing convex curve): with budgets scaled to
[0, 1] and step times scaled to [0, 1] between the fastest and the slowest fitting point, the
point where ``(1 - x) - y`` is largest. Past it, each further byte buys less than the average
byte of the whole range. ``docs/sweep.md`` documents the table.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field

from planner.errors import NoFitError, UserError
from planner.formats import Plan, load_profile
from planner.sizes import fmt_bytes, fmt_seconds, parse_size
from planner.solve.command import parse_budgets, solve_options
from planner.solve.config import SolveConfig
from planner.solve.search import solve

AXES = ("gpu", "cpu", "nvme")
MAX_POINTS = 200


@dataclass
class Point:
    """One budget on the axis: its plan's prediction, or why no plan fits there."""

    budget: int
    plan: Plan | None = None
    step_s: float | None = None
    compute_s: float | None = None
    tokens_per_s: float | None = None
    peak_gpu_bytes: int | None = None
    origin: str | None = None
    no_fit: str | None = None
    changes: list = field(default_factory=list)
    knee: bool = False

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def to_dict(self, axis: str) -> dict:
        return {f"{axis}_bytes": self.budget, "fits": self.fits, "step_s": self.step_s,
                "compute_s": self.compute_s, "tokens_per_s": self.tokens_per_s,
                "peak_gpu_bytes": self.peak_gpu_bytes, "origin": self.origin,
                "no_fit": self.no_fit, "changes": list(self.changes), "knee": self.knee}


def parse_axis(args) -> tuple[str, list[int]]:
    """The swept tier and its budgets, ascending: exactly one of the three budget flags is
    ``A:B:STEP`` (B included when the steps land on it)."""
    swept = [t for t in AXES if ":" in str(getattr(args, f"{t}_mem") or "")]
    if len(swept) != 1:
        raise UserError("plan sweep: give exactly one budget as A:B:STEP, e.g. --gpu-mem "
                        f"30G:80G:5G (got {len(swept) or 'none'}"
                        f"{': ' + ', '.join('--' + t + '-mem' for t in swept) if swept else ''})")
    tier = swept[0]
    flag = f"--{tier}-mem"
    text = str(getattr(args, f"{tier}_mem"))
    parts = text.split(":")
    if len(parts) != 3:
        raise UserError(f"{flag} {text}: give the range as A:B:STEP, e.g. 30G:80G:5G")
    a, b, step = (parse_size(p, f"{flag} ({name})") for p, name in
                  zip(parts, ("start", "end", "step")))
    if step <= 0:
        raise UserError(f"{flag} {text}: the step must be more than 0, e.g. 30G:80G:5G")
    lo, hi = min(a, b), max(a, b)
    n = (hi - lo) // step + 1
    if n > MAX_POINTS:
        raise UserError(f"{flag} {text}: {n} points; give a larger step (at most {MAX_POINTS} "
                        "points)")
    return tier, [lo + k * step for k in range(n)]


def _point_args(args, tier: str, budget: int):
    """The command's arguments as ``plan solve`` would get them at one point."""
    a = argparse.Namespace(**vars(args))
    setattr(a, f"{tier}_mem", str(budget))
    return a


def _kind(d) -> str:
    a = d.activation.value
    return f"recompute@{d.checkpoint.value}" if a == "recompute" else a


def changes(prev: Plan | None, plan: Plan) -> list[str]:
    """What differs at this point from the previous fitting one: units per activation choice
    where that count changed (``recompute@none 14->6``, ``cpu 3->0``), and how many units'
    homes moved."""
    if prev is None:
        return []
    before: dict[str, int] = {}
    after: dict[str, int] = {}
    for d in prev.layers:
        before[_kind(d)] = before.get(_kind(d), 0) + 1
    for d in plan.layers:
        after[_kind(d)] = after.get(_kind(d), 0) + 1
    order = ["keep", "recompute@gpu", "recompute@cpu", "recompute@nvme", "recompute@none",
             "cpu", "nvme"]
    out = [f"{k} {before.get(k, 0)}->{after.get(k, 0)}"
           for k in order + sorted((set(before) | set(after)) - set(order))
           if before.get(k, 0) != after.get(k, 0)]
    moved = sum(1 for a, b in zip(prev.layers, plan.layers) if _kind(a) != _kind(b))
    if moved and not out:
        out.append(f"{moved} unit(s) swapped choices")
    homes = sum(1 for a, b in zip(prev.layers, plan.layers) if a.home != b.home)
    if homes:
        out.append(f"{homes} home(s) moved")
    return out


def knee(points: list[Point]) -> Point | None:
    """The kneedle point of the fitting points (module docstring); None with fewer than three
    fitting points or a flat curve."""
    fit = [p for p in points if p.fits]
    if len(fit) < 3:
        return None
    x0, x1 = fit[0].budget, fit[-1].budget
    t = [p.step_s for p in fit]
    lo, hi = min(t), max(t)
    if hi - lo <= hi * 1e-9 or x1 == x0:
        return None
    score = [(1 - (p.budget - x0) / (x1 - x0)) - (p.step_s - lo) / (hi - lo) for p in fit]
    best = max(range(len(fit)), key=lambda k: (score[k], -k))
    return fit[best] if score[best] > 1e-9 else None


def sweep(profile, profile_path, hw, tier: str, budgets: list, args, solve_kw: dict,
          progress=None) -> list[Point]:
    """Solve every point of the axis (ascending), each seeded with the last fitting plan;
    ``solve_kw``: the options of ``SolveConfig.build`` but the budgets (``solve_options``)."""
    tokens = int(profile.model.get("batch") or 0) * int(profile.model.get("seq") or 0) * int(
        solve_kw.get("micro_batches", 1))
    out, prev = [], None
    for b in budgets:
        pt = Point(b)
        bud = parse_budgets(_point_args(args, tier, b), hw)
        try:
            got = solve(profile, profile_path, SolveConfig.build(hw, bud, **solve_kw),
                        seeds=(prev,) if prev is not None else ())
        except NoFitError as e:
            pt.no_fit = str(e)
        else:
            p = got.plan
            pt.plan, pt.step_s, pt.compute_s = p, p.predicted.step_s, p.predicted.compute_s
            pt.peak_gpu_bytes = p.predicted.peak_gpu_bytes
            pt.origin = p.solver.origin
            pt.tokens_per_s = tokens / pt.step_s if tokens and pt.step_s else None
            pt.changes = changes(prev, p)
            prev = p
        out.append(pt)
        if progress is not None:
            progress(pt)
    k = knee(out)
    if k is not None:
        k.knee = True
    return out


# ----------------------------------------------------------------------------- output

def table(points: list[Point], tier: str) -> str:
    """The memory-time table: one row per point."""
    label = {"gpu": "--gpu-mem", "cpu": "--cpu-mem", "nvme": "--nvme-mem"}[tier]
    rows = [(label, "step", "x compute", "tokens/s", "ms saved/GB", "peak GPU", "strategy",
             "changes")]
    last = None
    for p in points:
        if not p.fits:
            rows.append((fmt_bytes(p.budget), "no plan fits", "", "", "", "", "",
                         _short_reason(p.no_fit)))
            continue
        gain = ""
        if last is not None:
            gain = f"{1e3 * (last.step_s - p.step_s) / ((p.budget - last.budget) / 1e9):.2f}"
        rows.append((fmt_bytes(p.budget), fmt_seconds(p.step_s),
                     f"{p.step_s / p.compute_s:.3f}" if p.compute_s else "",
                     f"{p.tokens_per_s:,.0f}" if p.tokens_per_s else "", gain,
                     fmt_bytes(p.peak_gpu_bytes), p.origin or "",
                     ("KNEE; " if p.knee else "") + (", ".join(p.changes) or
                                                    ("first plan" if last is None else "same"))))
        last = p
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {1, 2, 3, 4, 5}
    return "\n".join("  ".join(c.rjust(w[i]) if i in right else c.ljust(w[i])
                               for i, c in enumerate(r)).rstrip() for r in rows)


def _short_reason(msg: str | None) -> str:
    m = re.search(r"the smallest --(\w+)-mem with a plan is ([^ ;(]+ ?[KMGT]?i?B)", msg or "")
    if m:
        return f"needs --{m.group(1)}-mem >= {m.group(2)}"
    return (msg or "")[:80]


def plot(points: list[Point], tier: str, path, title: str):
    """Step time and tokens/s against the budget; the knee marked, no-fit points as crosses."""
    from pathlib import Path

    from planner.formats.fileio import write_atomic
    from planner.cli.plot import _matplotlib
    Figure, FigureCanvasAgg, _ = _matplotlib()
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise UserError(f"--plot '{path}': give a file name ending in .png")
    fig = Figure(figsize=(9, 5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    gib = 1024 ** 3
    fit = [p for p in points if p.fits]
    xs = [p.budget / gib for p in fit]
    ax.plot(xs, [p.step_s * 1e3 for p in fit], "o-", color="#0072B2", label="predicted step")
    if fit and fit[0].compute_s:
        ax.axhline(min(p.compute_s for p in fit) * 1e3, color="#999999", ls="--", lw=1,
                   label="compute only")
    miss = [p for p in points if not p.fits]
    if miss and fit:
        y = max(p.step_s for p in fit) * 1e3
        ax.plot([p.budget / gib for p in miss], [y] * len(miss), "x", color="#D55E00", ms=9,
                label="no plan fits")
    for p in fit:
        if p.knee:
            ax.annotate(f"knee: {fmt_bytes(p.budget)}, {fmt_seconds(p.step_s)}",
                        (p.budget / gib, p.step_s * 1e3), xytext=(12, 18),
                        textcoords="offset points", arrowprops={"arrowstyle": "->"}, fontsize=9)
    ax.set_xlabel(f"{tier.upper() if tier != 'nvme' else 'NVMe'} budget (GiB)"
                  if tier != "cpu" else "host budget (GiB)")
    ax.set_ylabel("predicted step (ms)")
    ax.grid(alpha=0.3)
    if any(p.tokens_per_s for p in fit):
        ax2 = ax.twinx()
        ax2.plot(xs, [p.tokens_per_s or 0 for p in fit], "s:", color="#009E73", ms=4,
                 label="tokens/s")
        ax2.set_ylabel("tokens/s")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="center right", fontsize=8)
    else:
        ax.legend(loc="center right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    write_atomic(path, lambda f: fig.savefig(f, format="png"), binary=True)
    return path


def cli_sweep(args) -> int:
    profile = load_profile(args.profile)
    tier, budgets = parse_axis(args)
    hw, kw = solve_options(args, profile)
    kw["progress"] = False            # one line per point instead (--time-limit is per point)
    interactive = sys.stderr.isatty() and not args.json

    def progress(p):
        if interactive:
            state = fmt_seconds(p.step_s) if p.fits else "no plan fits"
            print(f"plan sweep: --{tier}-mem {fmt_bytes(p.budget)}: {state}", file=sys.stderr)
    points = sweep(profile, args.profile, hw, tier, budgets, args, kw, progress)
    m = profile.model
    title = (f"{m.get('name')} b{m.get('batch')} s{m.get('seq')} on {hw.name}: predicted step "
             f"against --{tier}-mem")
    if args.plot and any(p.fits for p in points):
        plot(points, tier, args.plot, title)
    if not any(p.fits for p in points):
        # the largest point's reason names the smallest budget that would fit
        raise NoFitError(f"no plan fits at any point of --{tier}-mem "
                         f"{getattr(args, tier + '_mem')}; at the largest: {points[-1].no_fit}",
                         budget=tier)
    if args.json:
        k = next((p for p in points if p.knee), None)
        print(json.dumps({"schema": "tierplan.sweep/1", "profile": str(args.profile),
                          "axis": tier, "hardware": hw.name,
                          "knee_bytes": k.budget if k else None,
                          "rows": [p.to_dict(tier) for p in points]}, sort_keys=True, indent=1))
    else:
        print(title)
        print(table(points, tier))
        k = next((p for p in points if p.knee), None)
        if k is not None:
            print(f"knee at --{tier}-mem {fmt_bytes(k.budget)} (kneedle rule: past it each "
                  "further GB buys less than the range's average GB)")
        if args.plot:
            print(args.plot)
    return 0
