"""What ties a plan to a model: the block list's structure hash, the parameter table (every
unit's parameter names, shapes and dtypes) and its rules, the input table (every model input's
name, shape and dtype) and the identity hash over them, which a plan carries and
``apply_plan`` checks.
"""
from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Mapping

from planner.formats.calls import _is_tensor
from planner.errors import UserError


def structure_hash(blocks) -> str:
    """Hash of the block list: names, class names and parameter names/shapes (not dtypes).

    Two models with the same blocks in the same order get the same hash whatever their
    precision, so a bf16 plan is refused on a model of another depth or width, not on a cast.
    """
    desc = []
    for name, m in blocks:
        params = sorted((n, list(p.shape)) for n, p in m.named_parameters())
        desc.append([name, _class_name(m), params])
    blob = json.dumps(desc, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _class_name(m) -> str:
    """The block's class name; FSDP2's ``fully_shard`` subclasses a block's class on the fly
    (``FSDP<Name>``, then ``FSDPModule``, then the class): the block's own name is kept, so a
    sharded model binds to the plan of the unsharded one (its parameters keep their global
    shapes)."""
    names = [c.__name__ for c in type(m).__mro__]
    if "FSDPModule" in names[1:]:
        return names[names.index("FSDPModule") + 1]
    return names[0]


def dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


def param_table(model, owner: dict) -> dict:
    """``{unit: [[qualified name, shape, dtype], ...]}``: every parameter of ``model`` (tied
    ones once, under their first name), in the unit ``owner[id(param)]`` charges it to."""
    table: dict = {}
    for n, p in model.named_parameters():
        table.setdefault(owner[id(p)], []).append([n, list(p.shape), dtype_name(p.dtype)])
    return table


def check_param_table(table, units, where: str) -> None:
    """``model.params`` as ``param_table`` writes it: a map of unit name (one of ``units``) to
    rows ``[name, shape, dtype]``, every parameter in one row of one unit. A name listed twice
    (in one unit or in two) would have the runtime move, step and restore that parameter
    twice, so it is refused whatever the identity hash says (a crafted plan can recompute
    it). ``None`` (a plan from before the table) passes; one ``UserError`` line otherwise."""
    if table is None:
        return
    fix = "profile and solve again"
    if not isinstance(table, dict):
        raise UserError(f"{where}: model.params must map each unit to its parameters; {fix}")
    seen: dict = {}
    for unit, rows in table.items():
        if unit not in units:
            raise UserError(f"{where}: model.params charges parameters to {str(unit)[:60]!r}, "
                            f"which is not a unit of the plan; {fix}")
        if not isinstance(rows, list):
            raise UserError(f"{where}: model.params[{unit!r}] must be a list of [name, shape, "
                            f"dtype] rows; {fix}")
        for row in rows:
            if not (isinstance(row, list) and len(row) >= 2 and isinstance(row[0], str)
                    and isinstance(row[1], list)
                    and all(type(s) is int and s >= 0 for s in row[1])):
                raise UserError(f"{where}: model.params[{unit!r}] has the row {str(row)[:60]}, "
                                f"not [name, shape, dtype]; {fix}")
            if row[0] in seen:
                twice = f"twice in unit {unit!r}" if seen[row[0]] == unit else \
                    f"in units {seen[row[0]]!r} and {unit!r}"
                raise UserError(f"{where} lists parameter {row[0][:80]!r} {twice}; a parameter "
                                f"belongs to one unit, once: {fix}")
            seen[row[0]] = unit


def _bind_names(fn, args, kwargs, sig=None) -> list:
    """``[(name, value)]`` of a call's arguments under ``fn``'s parameter names (positional
    arguments get their names; ``*args`` become ``args.0``...), in call order."""
    try:
        bound = (sig or inspect.signature(fn)).bind(*args, **kwargs)
    except (TypeError, ValueError):
        return [(str(i), a) for i, a in enumerate(args)] + list(kwargs.items())
    out = []
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_POSITIONAL:
            out.extend((f"{name}.{i}", v) for i, v in enumerate(value))
        elif kind is inspect.Parameter.VAR_KEYWORD:
            out.extend(value.items())
        else:
            out.append((name, value))
    return out


def input_table(fn, args, kwargs, sig=None) -> list:
    """Every tensor a model is called with, by name: ``[{"name", "shape", "dtype"}]``.

    Names are ``fn``'s parameter names (``input_ids``, ``pixel_values``, ``labels``), with
    ``.key``/``.i`` for tensors inside a dict/list/tuple argument. ``sig``: ``fn``'s signature,
    when the caller keeps it (the runtime checks every forward)."""
    out = []

    def walk(name, v):
        if _is_tensor(v):
            out.append({"name": name, "shape": [int(s) for s in v.shape],
                        "dtype": dtype_name(v.dtype)})
        elif isinstance(v, Mapping):
            for k, x in v.items():
                walk(f"{name}.{k}", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{name}.{i}", x)

    for name, value in _bind_names(fn, args, kwargs, sig):
        walk(name, value)
    return out


def identity_hash(model_section: dict) -> str:
    """Hash of what ties a plan to a model: the blocks by name, every unit's parameter names
    and shapes, every input's name, shape and dtype, the batch and sequence length.

    Parameter dtypes are recorded beside it but not hashed: a plan profiled in bf16 binds an
    fp32 model (autocast training) with a warning, as before. ``apply_plan`` recomputes this
    from the plan's own fields, so an edited model section (an input shape set to 0, another
    vocabulary) no longer matches and is refused."""
    params = {u: [[n, list(s)] for n, s, *_ in rows]
              for u, rows in (model_section.get("params") or {}).items()}
    inputs = [[i.get("name"), list(i.get("shape") or []), i.get("dtype")]
              for i in (model_section.get("inputs") or [])]
    desc = {"blocks": list(model_section.get("blocks") or []), "params": params,
            "inputs": inputs, "batch": model_section.get("batch"),
            "seq": model_section.get("seq")}
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:16]
