"""Reading plans of an older schema (``tierplan.plan/1``) as today's.

A ``/1`` plan has no homes (every tensor class lived on the device) and its schedule used
free-running streams with issue points, which today's stage model has no words for. So the
upgrade keeps the decisions, puts every class at home on the device, and lays the transfers
out again with ``planner.costmodel.schedule.greedy_shares``; its prediction is re-derived by whoever
simulates it (``plan simulate`` does). The profile, model, units and budgets carry over.
``planner.plans.load`` calls it; the formats layer reads only the current schema.
"""
from __future__ import annotations

from planner.costmodel import CostModel
from planner.costmodel.schedule import build_schedule
from planner.errors import UserError
from planner.formats import (PLAN_SCHEMA, Budgets, HardwareSpec, LayerDecision, UnitRecord,
                             check_units)


def plan_v1_to_v2(d: dict, source: str) -> dict:
    """The dict of a ``/1`` plan as a ``/2`` plan dict (schedule rebuilt)."""
    fix = "regenerate it with 'plan solve'"
    where = f"plan '{source}'"
    for k in ("units", "layers", "hardware", "budgets"):
        if not isinstance(d.get(k), (list, dict)):
            raise UserError(f"{where} (schema /1) lacks a valid '{k}'; {fix}")
    units = [UnitRecord.from_dict(u, source, "plan") for u in d["units"]]
    check_units(units, where, fix)
    layers = [LayerDecision.from_dict(x, source) for x in d["layers"]]
    hw = HardwareSpec.from_dict(d["hardware"], source + " (hardware)")
    b = Budgets.from_dict(d["budgets"], where, fix)
    cm = CostModel(units, hw, gpu_bytes=b.gpu_bytes, cpu_bytes=b.cpu_bytes,
                   nvme_bytes=b.nvme_bytes, optimizer_s=float(d.get("optimizer_s", 0.0)),
                   optimizer_workspace_bytes=int(d.get("optimizer_workspace_bytes", 0)),
                   optimizer_depth=1)
    schedule = build_schedule(cm, layers)
    pred = d.get("predicted") if isinstance(d.get("predicted"), dict) else {}
    solver = d.get("solver") if isinstance(d.get("solver"), dict) else {}
    out = dict(d)
    out.update(
        schema=PLAN_SCHEMA,
        layers=[x.to_dict() for x in layers],
        schedule={s: [e.to_dict() for e in evs] for s, evs in schedule.items()},
        solver={"name": str(solver.get("name", "unknown")),
                "status": f"upgraded from tierplan.plan/1 ({solver.get('status', '')})",
                "origin": "plan/1", "objective": None, "gap": None, "solve_s": 0.0,
                "variables": 0, "constraints": 0},
        predicted={k: pred.get(k, 0) for k in ("step_s", "compute_s", "peak_gpu_bytes",
                                               "peak_cpu_bytes", "peak_nvme_bytes")},
        micro_batches=1, optimizer_depth=1, world_size=1, ranks_per_node=1, engine="none")
    return out
