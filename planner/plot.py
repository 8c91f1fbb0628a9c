"""``plan inspect --plot``: memory per tier over the step, and the streams as a Gantt chart.

Top panel: GPU, host and NVMe bytes over the step (GiB against ms), each tier's budget as a
dashed line of the same colour. Bottom panel: one row per stream (compute, D2H, H2D, NVMe), a
bar per event, coloured by what it does. Both come from re-simulating the plan.

matplotlib is optional (``pip install matplotlib``) and imported only here, through its
object API on the Agg canvas: no pyplot, so no global state or display backend is touched.
"""
from __future__ import annotations

from pathlib import Path

from .errors import UserError
from .formats import Plan, Stream, write_atomic
from .sizes import fmt_bytes, fmt_seconds

GIB = 1024 ** 3
ROWS = [Stream.COMPUTE, Stream.D2H, Stream.H2D, Stream.NVME]
ROW_LABEL = {Stream.COMPUTE: "compute", Stream.D2H: "D2H", Stream.H2D: "H2D", Stream.NVME: "NVMe"}
# One colour per kind of work; colour-blind-safe Okabe–Ito palette.
OP_COLOUR = {
    "forward": "#0072B2", "backward": "#E69F00", "recompute": "#D55E00", "optimizer": "#999999",
    "offload": "#009E73", "write": "#009E73", "prefetch": "#CC79A7", "read": "#CC79A7",
}
OP_LABEL = {"forward": "forward", "backward": "backward", "recompute": "recompute",
            "optimizer": "optimizer", "offload": "offload (to host / disk)",
            "write": "offload (to host / disk)", "prefetch": "fetch back", "read": "fetch back"}
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


def plan_figure(plan: Plan, tl=None, title_path: str | None = None):
    """The two-panel figure of a plan (a ``matplotlib.figure.Figure``, not yet saved).

    ``tl`` is an ``inspect.Timeline``; it is computed by re-simulating the plan when omitted.
    """
    Figure, FigureCanvasAgg, Patch = _matplotlib()
    if tl is None:
        from .inspect import timeline
        tl = timeline(plan)
    unified = bool(plan.hardware.get("unified_memory"))
    fig = Figure(figsize=(14, 7.5), dpi=110, layout="constrained")
    FigureCanvasAgg(fig)
    ax_mem, ax_g = fig.subplots(2, 1, sharex=True, height_ratios=[1.15, 1])

    # -- memory per tier
    ms = [m[0] * 1e3 for m in tl.memory]
    tiers = ["gpu", "nvme"] if unified else ["gpu", "cpu", "nvme"]
    budgets = {"gpu": plan.budgets.get("gpu_bytes", 0), "cpu": plan.budgets.get("cpu_bytes", 0),
               "nvme": plan.budgets.get("nvme_bytes", 0)}
    # The y range follows the GPU budget and the curves: a host budget of 512 GiB beside a
    # 36 GiB GPU would flatten everything, so budgets above the range are named, not drawn.
    ytop = 1.12 * max([budgets["gpu"]] + [tl.peaks.get(t, 0) for t in tiers]) / GIB or 1.0
    for k, t in enumerate(("gpu", "cpu", "nvme")):
        if t not in tiers:
            continue
        ys = [m[1 + k] / GIB for m in tl.memory]
        if not budgets[t] and not any(ys):
            continue   # a tier with no budget and nothing in it would only add clutter
        c = TIER_COLOUR[t]
        lbl = "device" if (unified and t == "gpu") else TIER_LABEL[t]
        ax_mem.step(ms, ys, where="post", color=c, lw=1.8,
                    label=f"{lbl} (peak {fmt_bytes(tl.peaks.get(t, 0))})")
        if budgets[t]:
            off = budgets[t] / GIB > ytop
            ax_mem.axhline(budgets[t] / GIB, color=c, ls="--", lw=1.2,
                           label=f"{lbl} budget {fmt_bytes(budgets[t])}"
                                 + (" (above the chart)" if off else ""))
    if tl.memory:   # mark the GPU peak: where the budget binds, if anywhere
        tk, gk = max(((m[0], m[1]) for m in tl.memory), key=lambda x: x[1])
        ax_mem.plot([tk * 1e3], [gk / GIB], marker="v", color=TIER_COLOUR["gpu"], ms=7)
        ax_mem.annotate(f"peak {fmt_bytes(gk)}", (tk * 1e3, gk / GIB), xytext=(6, 6),
                        textcoords="offset points", fontsize=8, color=TIER_COLOUR["gpu"])
    ax_mem.set_ylabel("memory (GiB)")
    ax_mem.set_ylim(0, ytop)
    ax_mem.grid(alpha=0.3)
    # Legends sit outside the axes, right: inside they would hide a curve near its budget.
    ax_mem.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, framealpha=0.9)
    U = len(plan.units)
    fb = [v for eid, v in tl.events.items() if eid == f"B:{plan.units[-1].name}"]
    if fb:   # mark where the backward begins: the memory curve turns there
        for ax in (ax_mem, ax_g):
            ax.axvline(fb[0][3] * 1e3, color="k", lw=0.8, ls=":")
        # Half-way up: the GPU peak (annotated above) sits at the top where backward begins.
        ax_mem.annotate("backward starts", (fb[0][3] * 1e3, 0.5), xycoords=("data", "axes fraction"),
                        xytext=(4, 0), textcoords="offset points", fontsize=8)

    # -- Gantt chart of the streams
    rows = [s for s in ROWS if s is Stream.COMPUTE or plan.schedule.get(s.value)]
    seen_ops = []
    for r, stream in enumerate(rows):
        bars, colours = [], []
        for eid, (st, op, units, s, t) in tl.events.items():
            if st is not stream or t - s <= 0:
                continue
            bars.append((s * 1e3, (t - s) * 1e3))
            colours.append(OP_COLOUR.get(op, "#000000"))
            if OP_LABEL.get(op, op) not in seen_ops:
                seen_ops.append(OP_LABEL.get(op, op))
        ax_g.broken_barh(bars, (r - 0.38, 0.76), facecolors=colours, edgecolor="white", lw=0.3)
    # Where compute waits for a transfer: hatched, so stalls stand out at a glance.
    comp = sorted((s, t) for (st, op, u, s, t) in tl.events.values() if st is Stream.COMPUTE)
    gaps, prev_end = [], 0.0
    for s, t in comp:
        if s - prev_end > 1e-9:
            gaps.append((prev_end * 1e3, (s - prev_end) * 1e3))
        prev_end = max(prev_end, t)
    if gaps:
        ax_g.broken_barh(gaps, (-0.38, 0.76), facecolors="none", edgecolor="#555555",
                         hatch="///", lw=0.5)
        seen_ops.append("stall (compute waits)")
    ax_g.set_yticks(range(len(rows)), [ROW_LABEL[s] for s in rows])
    ax_g.set_ylim(len(rows) - 0.5, -0.5)
    ax_g.set_xlabel("time in the step (ms)")
    ax_g.set_ylabel("stream")
    ax_g.grid(axis="x", alpha=0.3)
    order = ["forward", "backward", "recompute", "optimizer", "offload (to host / disk)",
             "fetch back"]
    colour_of = {OP_LABEL[k]: v for k, v in OP_COLOUR.items()}
    handles = [Patch(color=colour_of[lbl], label=lbl) for lbl in order if lbl in seen_ops]
    if "stall (compute waits)" in seen_ops:
        handles.append(Patch(facecolor="none", edgecolor="#555555", hatch="///",
                             label="stall (compute waits)"))
    ax_g.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8,
                framealpha=0.9)
    ax_g.set_xlim(0, tl.step_s * 1e3 * 1.005)

    m = plan.model
    ratio = tl.step_s / tl.compute_s if tl.compute_s else float("nan")
    title = (f"{m.get('name')} (batch {m.get('batch')}, seq {m.get('seq')}) on "
             f"{plan.hardware.get('name')}, GPU budget {fmt_bytes(budgets['gpu'])}, "
             f"policy {plan.policy}: step {fmt_seconds(tl.step_s)} "
             f"= {ratio:.3f}× compute-only {fmt_seconds(tl.compute_s)}")
    fig.suptitle(title, fontsize=11)
    ax_mem.set_title(f"memory per tier ({U} units)" + (f" — {title_path}" if title_path else ""),
                     fontsize=9, loc="left")
    ax_g.set_title("streams", fontsize=9, loc="left")
    return fig


def save_plot(plan: Plan, path, tl=None, title_path: str | None = None) -> Path:
    """Draw the plan and write the PNG atomically (temporary file in the same folder, rename)."""
    path = Path(path)
    if path.suffix.lower() != ".png":
        raise UserError(f"--plot '{path}': give a file name ending in .png")
    fig = plan_figure(plan, tl, title_path)
    write_atomic(path, lambda f: fig.savefig(f, format="png"), binary=True)
    return path
