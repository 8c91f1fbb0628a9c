"""One per-unit table joining a profile, a plan, its simulation and (when given) a measured
report: what ``plan inspect`` prints and what ``plan diff`` compares.

Rows are keyed by the unit's qualified name (STYLE.md item 3), so tables of two plans of one
model join on the index.
"""
from __future__ import annotations

import pandas as pd

from planner.costmodel import KINDS, decision_choice
from planner.formats.events import Op, Stream, TensorClass
from planner.formats import Activation, LayerDecision, Plan

CHOICE_LABEL = {"keep": "keep", "cpu": "cpu", "nvme": "nvme", "rg": "recompute/gpu",
                "rc": "recompute/cpu", "rn": "recompute/nvme", "rz": "recompute/none"}


def decision_label(d: LayerDecision) -> str:
    """``keep``, ``cpu``, ``nvme`` or ``recompute/<checkpoint tier>``."""
    return CHOICE_LABEL[decision_choice(d)]


def unit_table(plan: Plan, sim=None) -> pd.DataFrame:
    """Per unit: its decisions, its bytes and times from the profile, what the schedule moves
    for it per optimizer step, and (with ``sim``) the duration and binding resource of its
    forward and backward stages."""
    from planner.plans.simulate import cost_model_of
    cm = cost_model_of(plan)
    moved = {}
    for e in plan.all_events():
        if not e.is_transfer or e.stream in (Stream.HOST, Stream.NET):
            continue         # host work, and the engine's collectives: not tiers' traffic
        # each byte once, on the link next to the device: d2h/h2d, or the drive on unified
        # memory (and the drive for optimizer state, which never touches the device on CUDA)
        if cm.unified or e.cls is TensorClass.STATE:
            if e.stream is not Stream.NVME:
                continue
        elif e.stream is Stream.NVME:
            continue
        times = 1 if e.stage == cm.L.opt_stage else \
            (cm.passes - 1 if e.passes.value == "rest" else cm.passes)
        into = e.op in (Op.PREFETCH, Op.UPLOAD, Op.READ)
        cls = "act" if e.cls in (TensorClass.ACT, TensorClass.CKPT) else e.cls.value
        key = (e.unit, cls, "in" if into else "out")
        moved[key] = moved.get(key, 0) + e.bytes * times
    stages = {r.stage: r for r in sim.stages} if sim is not None else {}
    rows = []
    for i, (u, d) in enumerate(zip(plan.units, plan.layers)):
        res = cm.resident(i, d.home)
        row = {
            "unit": u.name, "kind": u.kind, "decision": decision_label(d),
            "home": d.home.label(), "A_bytes": u.activation_bytes, "X_bytes": u.input_bytes,
            "static_bytes": u.static_bytes, "on_gpu_bytes": res["gpu"],
            "on_cpu_bytes": res["cpu"], "on_nvme_bytes": res["nvme"],
            "fwd_s": u.fwd_s, "bwd_s": u.bwd_s, "fwd_flops": u.fwd_flops, "bwd_flops": u.bwd_flops,
            "act_out_bytes": moved.get((u.name, "act", "out"), 0),
            "weight_in_bytes": moved.get((u.name, "weight", "in"), 0),
            "grad_out_bytes": moved.get((u.name, "grad", "out"), 0),
            "state_io_bytes": moved.get((u.name, "state", "in"), 0) + moved.get((u.name, "state", "out"), 0),
        }
        if stages:
            f, b = stages[cm.L.fwd(i)], stages[cm.L.bwd(i)]
            row.update(fwd_stage_s=f.seconds, fwd_bound=f.bound, bwd_stage_s=b.seconds,
                       bwd_bound=b.bound, gpu_bytes_fwd=f.memory["gpu"],
                       gpu_bytes_bwd=b.memory["gpu"])
        rows.append(row)
    return pd.DataFrame(rows).set_index("unit")


def stage_table(sim) -> pd.DataFrame:
    """Per stage: phase, unit, start, duration, binding resource, each resource's load and the
    bytes held on each tier."""
    rows = []
    for r in sim.stages:
        row = {"stage": r.stage, "phase": r.phase, "unit": r.unit, "start_s": r.start,
               "seconds": r.seconds, "bound": r.bound}
        row.update({f"{k}_s": v for k, v in r.loads.items()})
        row.update({f"{t}_bytes": n for t, n in r.memory.items()})
        rows.append(row)
    return pd.DataFrame(rows).set_index("stage")


__all__ = ["unit_table", "stage_table", "decision_label", "Activation", "KINDS"]
