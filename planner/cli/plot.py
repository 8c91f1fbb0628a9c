"""``plan inspect --plot``: memory per tier over the step, and the streams as a Gantt chart.

Top panel: GPU, host and NVMe bytes stage by stage over the first pass and the optimizer phase
(GiB against ms), each tier's budget as a dashed line of the same colour. Bottom panel: one row
per stream (compute, D2H, H2D, NVMe, host CPU), a bar per event, coloured by what it does.
Both come from the simulator's replay.

matplotlib is optional (``pip install matplotlib``) and imported only here, through its
object API on the Agg canvas: no pyplot, so no global state or display backend is touched.
"""
from __future__ import annotations

from pathlib import Path

from planner.errors import UserError
from planner.formats.events import Stream
from planner.formats.fileio import write_atomic
from planner.formats import Plan
from planner.sizes import fmt_bytes, fmt_seconds

GIB = 1024 ** 3
ROWS = [Stream.COMPUTE, Stream.D2H, Stream.H2D, Stream.NVME, Stream.HOST, Stream.NET]
ROW_LABEL = {Stream.COMPUTE: "compute", Stream.D2H: "D2H", Stream.H2D: "H2D", Stream.NVME: "NVMe",
             Stream.HOST: "host CPU", Stream.NET: "interconnect"}
# One colour per kind of work; colour-blind-safe Okabe–Ito palette.
OP_COLOUR = {
    "forward": "#0072B2", "backward": "#E69F00", "recompute": "#D55E00", "step": "#999999",
    "offload": "#009E73", "write": "#009E73", "prefetch": "#CC79A7", "read": "#CC79A7",
    "upload": "#CC79A7", "accumulate": "#56B4E9", "all-gather": "#F0E442",
    "reduce-scatter": "#000000", "all-reduce": "#000000",
}
OP_LABEL = {"forward": "forward", "backward": "backward", "recompute": "recompute",
            "step": "optimizer step", "offload": "to host / disk", "write": "to host / disk",
            "prefetch": "to the device", "read": "to the device", "upload": "to the device",
            "accumulate": "gradient accumulation", "all-gather": "all-gather (weights)",
            "reduce-scatter": "reduce (gradients)", "all-reduce": "reduce (gradients)"}
TIER_COLOUR = {"gpu": "#0072B2", "cpu": "#009E73", "nvme": "#D55E00"}
TIER_LABEL = {"gpu": "GPU", "cpu": "host", "nvme": "NVMe"}


def _matplotlib():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise UserError("--plot needs matplotlib, which is not installed; "
                        "run 'pip install matplotlib' (or pip install 'tierplan[plot]')")
    return Figure, FigureCanvasAgg, Patch


def plan_figure(plan: Plan, sim=None, title_path: str | None = None):
    """The two-panel figure of a plan (a ``matplotlib.figure.Figure``, not yet saved): memory
    per tier stage by stage over the first pass and the optimizer phase, and each stream's
    events laid out from their stage's start (``SimResult.events``)."""
    Figure, FigureCanvasAgg, Patch = _matplotlib()
    if sim is None:
        from planner.plans.simulate import simulate
        sim = simulate(plan)
    unified = bool(plan.hardware.get("unified_memory"))
    fig = Figure(figsize=(14, 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_mem, ax_g = fig.subplots(2, 1, sharex=True, height_ratios=[1.15, 1])
    b = plan.budgets
    budgets = {"gpu": b.gpu_bytes, "cpu": b.cpu_bytes, "nvme": b.nvme_bytes}
    _memory_panel(ax_mem, sim, budgets, unified)
    _streams_panel(ax_g, plan, sim, Patch)
    m = plan.model
    ratio = sim.step_s / sim.compute_s if sim.compute_s else float("nan")
    title = (f"{m.get('name')} (batch {m.get('batch')}, seq {m.get('seq')}) on "
             f"{plan.hardware.get('name')}, GPU budget {fmt_bytes(budgets['gpu'])}, "
             f"policy {plan.policy}: step {fmt_seconds(sim.step_s)} "
             f"= {ratio:.3f}× compute-only {fmt_seconds(sim.compute_s)}"
             + (f", {sim.micro_batches} micro-batches" if sim.micro_batches > 1 else ""))
    fig.suptitle(title, fontsize=11)
    ax_mem.set_title(f"memory per tier ({len(plan.units)} units)" +
                     (f" — {title_path}" if title_path else ""), fontsize=9, loc="left")
    ax_g.set_title("streams", fontsize=9, loc="left")
    return fig


def _memory_panel(ax_mem, sim, budgets: dict, unified: bool) -> None:
    """Memory per tier, constant within a stage (allocations at its start, frees at its end),
    with each budget and where the backward and the optimizer phase start."""
    xs, ys = [], {t: [] for t in TIER_COLOUR}
    for r in sim.stages:
        for t0 in (r.start, r.start + r.seconds):
            xs.append(t0 * 1e3)
            for t in ys:
                ys[t].append(r.memory[t] / GIB)
    tiers = ["gpu", "nvme"] if unified else ["gpu", "cpu", "nvme"]
    ytop = 1.12 * max([budgets["gpu"] / GIB] + [max(ys[t], default=0) for t in tiers]) or 1.0
    for t in tiers:
        if not budgets[t] and not any(ys[t]):
            continue
        lbl = "device (host memory)" if (unified and t == "gpu") else TIER_LABEL[t]
        ax_mem.plot(xs, ys[t], color=TIER_COLOUR[t], lw=1.6, label=f"{lbl} in use")
        if budgets[t] and budgets[t] / GIB <= ytop:
            ax_mem.axhline(budgets[t] / GIB, color=TIER_COLOUR[t], ls="--", lw=1.2,
                           label=f"{lbl} budget {fmt_bytes(budgets[t])}")
    ax_mem.set_ylim(0, ytop)
    ax_mem.set_ylabel("GiB")
    ax_mem.grid(alpha=0.3)
    ax_mem.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, framealpha=0.9)
    starts = {r.phase: r.start for r in reversed(sim.stages)}
    for phase in ("backward", "optimizer"):
        if phase in starts:
            ax_mem.axvline(starts[phase] * 1e3, color="k", lw=0.8, ls=":")
            ax_mem.annotate(f"{phase} starts", (starts[phase] * 1e3, 0.5),
                            xycoords=("data", "axes fraction"), xytext=(4, 0),
                            textcoords="offset points", fontsize=8)


def _streams_panel(ax_g, plan: Plan, sim, Patch) -> None:
    """Each stream's events as bars from their stage's start, coloured by kind of work."""
    by_id = {e.id: e for e in plan.all_events()}
    rows = [s for s in ROWS if any(e.stream is s for e in by_id.values())]
    seen = []
    for r_i, stream in enumerate(rows):
        bars, colours = [], []
        for eid, (t0, t1) in sim.events.items():
            e = by_id[eid]
            if e.stream is not stream or t1 - t0 <= 0:
                continue
            bars.append((t0 * 1e3, (t1 - t0) * 1e3))
            colours.append(OP_COLOUR.get(e.op.value, "#000000"))
            lbl = OP_LABEL.get(e.op.value, e.op.value)
            if lbl not in seen:
                seen.append(lbl)
        ax_g.broken_barh(bars, (r_i - 0.38, 0.76), facecolors=colours, edgecolor="white", lw=0.3)
    ax_g.set_yticks(range(len(rows)), [ROW_LABEL[s] for s in rows])
    ax_g.set_ylim(len(rows) - 0.5, -0.5)
    ax_g.set_xlabel("time in the first pass and the optimizer phase (ms)")
    ax_g.set_ylabel("stream")
    ax_g.grid(axis="x", alpha=0.3)
    colour_of = {OP_LABEL[k]: v for k, v in OP_COLOUR.items()}
    handles = [Patch(color=colour_of[lbl], label=lbl) for lbl in dict.fromkeys(OP_LABEL.values())
               if lbl in seen]
    ax_g.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8,
                framealpha=0.9)
    end = sim.stages[-1].start + sim.stages[-1].seconds
    ax_g.set_xlim(0, end * 1e3 * 1.005 or 1.0)


def plot_plan(plan: Plan, sim, path, title_path: str | None = None) -> Path:
    """Draw the plan and write the PNG atomically (temporary file in the same folder, rename)."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise UserError(f"--plot '{path}': give a file name ending in .png")
    fig = plan_figure(plan, sim, title_path)
    write_atomic(path, lambda f: fig.savefig(f, format="png"), binary=True)
    return path
