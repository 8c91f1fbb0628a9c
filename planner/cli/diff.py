"""``plan diff A B``: what two plans of the same model disagree on.

Plans of different budgets, solvers, policies, hardware or shapes compare; the join is by unit
name (STYLE.md item 3), so two plans must be of the same model: same name, same structure hash
and the same units in the same order. A profile where a plan is expected, or two plans of
different models, is bad input (exit 2).

Only the plan files are read: a plan stands alone, and its ``predicted`` section is what
``plan solve`` measured with the simulator before writing it.
"""
from __future__ import annotations

import json
import sys

from planner.errors import UserError
from planner.formats import PLAN_SCHEMA, PLAN_SCHEMA_V1, PLAN_SCHEMA_V2, PROFILE_SCHEMA, Plan, read_json
from planner.plans.load import plan_from_dict
from planner.sizes import fmt_bytes, fmt_seconds
from planner.cli.table import unit_table

PREDICTED_KEYS = ("step_s", "compute_s", "pass_s", "optimizer_s", "peak_gpu_bytes",
                  "peak_cpu_bytes", "peak_nvme_bytes")


def load_plan_for(path: str, role: str) -> Plan:
    """Load a plan, refusing a profile (or anything else) with one line that says what to do."""
    d = read_json(path, f"plan {role}")
    schema = d.get("schema")
    if schema == PROFILE_SCHEMA:
        raise UserError(f"plan {role} '{path}' is a profile, not a plan; run 'plan solve {path} "
                        "--gpu-mem SIZE' and diff the plans it writes")
    if schema not in (PLAN_SCHEMA, PLAN_SCHEMA_V2, PLAN_SCHEMA_V1):
        raise UserError(f"plan {role} '{path}' has schema {schema!r}, expected {PLAN_SCHEMA!r}; "
                        "give a plan written by 'plan solve'")
    return plan_from_dict(d, path)


def _check_same_model(a: Plan, b: Plan, pa: str, pb: str) -> None:
    na, nb = a.model.get("name"), b.model.get("name")
    if na != nb:
        raise UserError(f"'{pa}' plans model {na!r} but '{pb}' plans {nb!r}; "
                        "diff compares plans of one model")
    ha, hb = a.model.get("structure_hash"), b.model.get("structure_hash")
    if ha != hb:
        raise UserError(f"'{pa}' and '{pb}' plan models of different structure (hash {ha} vs "
                        f"{hb}); diff compares plans of one model")
    ua, ub = [u.name for u in a.units], [u.name for u in b.units]
    if ua != ub:
        only = sorted(set(ua) ^ set(ub))[:3]
        raise UserError(f"'{pa}' and '{pb}' have different units ({len(ua)} vs {len(ub)}; "
                        f"e.g. {only or 'same names, other order'}); diff compares plans of one model")


def _flat(prefix: str, d) -> dict:
    """Flatten nested dicts into ``a.b.c`` keys (lists and scalars are leaves)."""
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flat(f"{prefix}.{k}" if prefix else str(k), v))
    else:
        out[prefix] = d
    return out


def _setting_sections(p: Plan) -> dict:
    """Everything about a plan other than its decisions, schedule and units, flattened."""
    model = {k: v for k, v in p.model.items() if k != "config"}
    return _flat("", {
        "budgets": p.budgets.to_dict(), "hardware": p.hardware, "profile": p.profile,
        "model": model, "solver": p.solver.to_dict(), "policy": p.policy,
        "nvme_dir": p.nvme_dir, "micro_batches": p.micro_batches,
    })


def diff_plans(a: Plan, b: Plan, path_a: str = "A", path_b: str = "B") -> dict:
    """The differences between two plans of one model, as a JSON-ready dict.

    ``settings``: every differing field of budgets, hardware, profile, model, solver, policy;
    ``changed``: the units whose decision differs, in execution order, old → new;
    ``predicted``: A, B and B − A for step time, compute-only time and each peak.
    """
    _check_same_model(a, b, path_a, path_b)
    fa, fb = _setting_sections(a), _setting_sections(b)
    settings = [{"field": k, "a": fa.get(k), "b": fb.get(k)}
                for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]
    # the per-unit tables of both plans, joined on the unit's name
    ta, tb = unit_table(a), unit_table(b)
    # suffixes added before the join: join's lsuffix/rsuffix are deprecated from pandas 3
    joined = ta[["decision", "home"]].add_suffix("_a").join(tb[["decision", "home"]].add_suffix("_b"))
    changed = []
    for i, (name, r) in enumerate(joined.iterrows()):
        la = r["decision_a"] + ("" if r["home_a"] == "gpu" else f" [{r['home_a']}]")
        lb = r["decision_b"] + ("" if r["home_b"] == "gpu" else f" [{r['home_b']}]")
        if la != lb:
            changed.append({"index": i, "name": name, "a": la, "b": lb})
    predicted = {}
    pa, pb = a.predicted.to_dict(), b.predicted.to_dict()
    for k in PREDICTED_KEYS:
        va, vb = pa.get(k), pb.get(k)
        delta = vb - va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) else None
        predicted[k] = {"a": va, "b": vb, "delta": delta}
    counts = {}
    for role, t in (("a", ta), ("b", tb)):
        labels = [d + ("" if h == "gpu" else f" [{h}]") for d, h in zip(t["decision"], t["home"])]
        counts[role] = {k: labels.count(k) for k in sorted(set(labels))}
    return {"a": path_a, "b": path_b, "model": a.model.get("name"), "units": len(a.units),
            "settings": settings, "changed": changed, "predicted": predicted,
            "decision_counts": counts}


def _fmt_value(field: str, v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int) and (field.endswith("_bytes") or field.endswith("bytes")):
        return fmt_bytes(v)
    if isinstance(v, float) and field.endswith("_s"):
        return fmt_seconds(v)
    if isinstance(v, (int, float)) and field.endswith(".gap"):
        return f"{v:.2%}"
    if isinstance(v, float):
        return f"{v:.6g}"
    return str(v)


def format_diff(d: dict) -> str:
    lines = [f"diff of two plans of {d['model']} ({d['units']} units)",
             f"  A: {d['a']}", f"  B: {d['b']}", ""]
    if d["settings"]:
        lines.append("settings that differ:")
        w = max(len(s["field"]) for s in d["settings"])
        for s in d["settings"]:
            lines.append(f"  {s['field']:<{w}}  {_fmt_value(s['field'], s['a'])}  →  "
                         f"{_fmt_value(s['field'], s['b'])}")
    else:
        lines.append("settings: identical")
    lines.append("")
    n = len(d["changed"])
    lines.append(f"decisions: {n} of {d['units']} units changed" + (":" if n else ""))
    if n:
        # Runs of three or more neighbours with the same change print as one line (a sqrt
        # plan's segments would otherwise fill a screen); --json always lists every unit.
        groups = []
        for c in d["changed"]:
            g = groups[-1] if groups else None
            if g and c["index"] == g[-1]["index"] + 1 and (c["a"], c["b"]) == (g[0]["a"], g[0]["b"]):
                g.append(c)
            else:
                groups.append([c])
        rows = []
        for g in groups:
            if len(g) >= 3:
                rows.append((f"{g[0]['name']}–{g[-1]['name']} ({len(g)})", g[0]))
            else:
                rows.extend((c["name"], c) for c in g)
        w = max(len(r[0]) for r in rows)
        for label, c in rows:
            lines.append(f"  {label:<{w}}  {c['a']:>14} → {c['b']}")
    for role in ("a", "b"):
        counts = ", ".join(f"{k} {v}" for k, v in d["decision_counts"][role].items())
        lines.append(f"  {role.upper()}: {counts}")
    lines.append("")
    lines.append("predicted:")
    for k, v in d["predicted"].items():
        fmt = fmt_seconds if k.endswith("_s") else fmt_bytes
        if v["delta"] is None:
            lines.append(f"  {k:<16} {fmt(v['a']):>12}  {fmt(v['b']):>12}")
            continue
        if v["delta"] == 0:
            change = "unchanged"
        else:
            rel = f" ({v['delta'] / v['a'] * 100:+.1f}%)" if v["a"] else ""
            change = ("+" if v["delta"] > 0 else "") + fmt(v["delta"]) + rel
        lines.append(f"  {k:<16} {fmt(v['a']):>12}  →  {fmt(v['b']):>12}   {change}")
    return "\n".join(lines)


def cli_diff(args) -> int:
    from planner.plans.simulate import simulate_file
    a = load_plan_for(args.a, "A")
    b = load_plan_for(args.b, "B")
    # A plan whose schedule is not what its decisions imply is refused here as by simulate
    # and inspect (diff compares 'predicted', which such a plan cannot be trusted for).
    simulate_file(a, args.a)
    simulate_file(b, args.b)
    d = diff_plans(a, b, args.a, args.b)
    if args.json:
        json.dump(d, sys.stdout, sort_keys=True, indent=1)
        sys.stdout.write("\n")
    else:
        print(format_diff(d))
    return 0
