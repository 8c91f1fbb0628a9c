"""Binding a plan to a model: which modules are the plan's blocks, whether the model is the one
the plan was made for, and whether an input fits the shapes the plan was made for.

A plan made from a current profile names its blocks exactly (``model.blocks``), lists every
parameter with the unit it is charged to (``model.params``: name, shape, dtype), every model
input's shape (``model.inputs``) and a hash of all three with the batch and sequence length
(``model.identity``). ``bind`` finds the blocks by those names (``get_submodule``: no forward,
no guessing), refuses the plan when the model's parameters differ in name or shape (another
vocabulary, width or depth) or when the plan's own fields no longer match its identity hash
(edited by hand), and warns when only the precision differs. ``InputGuard`` refuses, before any
block runs, an input larger than the plan's in any dimension of any input.

The runtime binds by those names only and never detects blocks: detection traces a forward and
is the profiler's (``planner.blocks``), and the plan already says which modules its units are.
A plan without ``model.blocks`` (made before exact names were recorded) is refused, naming the
fix (profile and solve again); a plan without input shapes is guarded on ``batch`` x ``seq``,
and one that records no input size at all is refused rather than run unguarded.

Every refusal is a ``PlanMismatchError`` (a ``UserError`` and a ``ValueError``): one line
naming what differs and what to do.
"""
from __future__ import annotations

import inspect
import warnings

import torch

from planner.formats import Plan, Tier, UnitKind, UserError
from planner.formats.identity import (check_param_table, dtype_name, identity_hash, input_table,
                                      structure_hash)

_FIX = "profile and solve for this model"


class PlanMismatchError(UserError, ValueError):
    """The plan does not fit this model or this input (one line: what differs, what to do)."""


class InputTooLargeError(PlanMismatchError):
    """An input is larger than the plan's in some dimension."""


def _shape(s) -> str:
    return "[" + ", ".join(str(int(x)) for x in s) + "]"


def bind(model: torch.nn.Module, plan: Plan, src: str) -> list[tuple[str, torch.nn.Module]]:
    """The plan's blocks in ``model`` as ``[(name, module)]`` in execution order, after checking
    that ``model`` is the model the plan was made for. ``src`` names the plan in messages."""
    m = plan.model
    want = [u.name for u in plan.units if u.kind == UnitKind.BLOCK.value]
    if m.get("blocks") is None:
        raise PlanMismatchError(f"{src} names no blocks (model.blocks): it predates binding by "
                                "module name, which this runtime needs; profile and solve again")
    blocks = _bind_named(model, m, src, want, {u.name for u in plan.units})
    h = structure_hash(blocks)
    if m.get("structure_hash") != h:
        raise PlanMismatchError(f"{src} has structure hash {m.get('structure_hash')} but "
                                f"the model's blocks hash to {h} (different widths or layers); "
                                f"{_FIX}")
    _check_params(model, m, src)
    _check_ties(model, plan, blocks, src)
    _warn_precision(blocks, m, src)
    cache = m.get("state_bytes") or 0
    if cache and getattr(getattr(model, "config", None), "use_cache", False):
        warnings.warn(f"{src}: the model fills a key/value cache of {cache} bytes per forward "
                      "(use_cache is on), held until its output is dropped; the plan counts it "
                      "for the whole step; set model.config.use_cache = False to train without "
                      "it", stacklevel=3)
    return blocks


def _bind_named(model, m, src, want, units):
    names = m["blocks"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise PlanMismatchError(f"{src}: model.blocks must be a list of module names; "
                                "regenerate the plan with 'plan profile' and 'plan solve'")
    _check_table(m, src, units)
    try:
        identity = identity_hash(m)
    except (TypeError, ValueError, AttributeError):
        identity = None                          # model.inputs malformed: not what was hashed
    if identity is None or m.get("identity") != identity:
        raise PlanMismatchError(f"{src}: its model section (blocks, parameters or input shapes) "
                                f"does not match its identity hash {m.get('identity')!r}, so it "
                                "was edited after profiling; profile and solve again")
    if names != want:
        raise PlanMismatchError(f"{src}: its units name blocks {want[:2]}... but model.blocks "
                                f"says {names[:2]}...; regenerate the plan")
    if len(set(names)) != len(names):
        raise PlanMismatchError(f"{src} names a block twice; regenerate the plan")
    modules = dict(model.named_modules())
    blocks = []
    for n in names:
        mod = modules.get(n)
        if mod is None:
            raise PlanMismatchError(f"{src} is for {len(names)} blocks ({names[0]} .. "
                                    f"{names[-1]}) but the model has no module {n!r}; {_FIX}")
        blocks.append((n, mod))
    for n, mod in blocks:
        for other, _ in blocks:
            if other != n and n.startswith(other + "."):
                raise PlanMismatchError(f"{src}: block {n!r} is inside block {other!r}; "
                                        "regenerate the plan")
    return blocks


def _check_table(m, src, units):
    """The parameter table's own rules (``planner.formats.identity.check_param_table``: each
    parameter in one unit, once), as a ``PlanMismatchError``."""
    try:
        check_param_table(m.get("params"), units, src)
    except UserError as e:
        raise PlanMismatchError(str(e)) from None


def _check_params(model, m, src):
    """Every parameter the plan charges to a unit (embedding and head included) exists in the
    model with the same shape, and the model has no other."""
    table = m.get("params")
    if not isinstance(table, dict):
        raise PlanMismatchError(f"{src} records no parameter shapes (model.params); it predates "
                                "exact binding: profile and solve again")
    planned = {}
    for unit, rows in table.items():
        for name, shape, *_ in rows:
            planned[name] = (unit, list(shape))
    have = {n: list(p.shape) for n, p in model.named_parameters()}
    for n, shape in have.items():
        if n not in planned:
            raise PlanMismatchError(f"{src}: the model's parameter {n!r} {_shape(shape)} is in "
                                    f"no unit of the plan (another architecture?); {_FIX}")
        unit, want = planned[n]
        if shape != want:
            raise PlanMismatchError(f"{src}: unit {unit!r} holds {n!r} of shape {_shape(want)} "
                                    f"in the plan but {_shape(shape)} in the model (another "
                                    f"vocabulary, width or depth); {_FIX}")
    missing = [n for n in planned if n not in have]
    if missing:
        unit = planned[missing[0]][0]
        alias = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
        if missing[0] in alias:
            first = next(n for n, p in model.named_parameters() if p is alias[missing[0]])
            raise PlanMismatchError(f"{src}: unit {unit!r} holds {missing[0]!r}, which in the "
                                    f"model is the same parameter as {first!r} (tied); the plan "
                                    f"must list it once; {_FIX}")
        raise PlanMismatchError(f"{src}: unit {unit!r} holds {missing[0]!r}, which the model "
                                f"does not have; {_FIX}")


def _check_ties(model, plan: Plan, blocks, src):
    """A parameter the model knows by names in two units (a tied embedding and head, a weight
    shared by two blocks) is used by both, so the unit that owns it must keep its weights and
    gradients on the device, as the planner plans them: streamed, the other unit would find
    it without storage. A name belongs to the block it is under; a name outside every block
    to the embedding's side when the model registers it before the first block's
    parameters, to the head's side otherwise."""
    homes = {d.name: d.home for d in plan.layers}
    owner = {row[0]: unit for unit, rows in plan.model["params"].items() for row in rows}
    prefixes = [n + "." for n, _ in blocks]
    side, seen_block, names = {}, False, {}
    for n, p in model.named_parameters(remove_duplicate=False):
        blk = next((b for b in prefixes if n.startswith(b)), None)
        seen_block = seen_block or blk is not None
        side[n] = blk or ("after the blocks" if seen_block else "before the blocks")
        names.setdefault(id(p), []).append(n)
    for ns in names.values():
        if len({side[n] for n in ns}) < 2:
            continue
        unit = owner.get(ns[0])
        home = homes.get(unit)
        if home is not None and (home.weights is not Tier.GPU or home.grads is not Tier.GPU):
            raise PlanMismatchError(
                f"{src}: unit {unit!r} homes its weights or gradients off the device, but its "
                f"{ns[0]!r} is tied to {ns[1]!r}, which another unit uses; a tied weight stays "
                f"on the device: {_FIX}")
    # a use the names do not show (a block calling another's layer through a reference): the
    # profile saw it and recorded the tie
    for u in plan.units:
        home = homes.get(u.name)
        if u.tied_to and home is not None and (home.weights is not Tier.GPU
                                               or home.grads is not Tier.GPU):
            raise PlanMismatchError(
                f"{src}: unit {u.name!r} homes its weights or gradients off the device, but it "
                f"shares a parameter with {u.tied_to[0]!r} (tied_to); a tied weight stays on "
                f"the device: {_FIX}")


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _warn_precision(blocks, m, src):
    """Not refused: fp32 weights under autocast are a normal way to train a bf16 plan. But a
    plan profiled at another precision predicts other bytes, so say so once."""
    want = _DTYPES.get(m.get("dtype"))
    have = {q.dtype for _, b in blocks for q in b.parameters() if q.is_floating_point()}
    if want is not None and have and want not in have:
        warnings.warn(f"{src} was profiled in {m.get('dtype')} but the model's blocks hold "
                      f"{', '.join(sorted(dtype_name(d) for d in have))} parameters; gradients "
                      "are unaffected, but its predicted bytes and times are for the profiled "
                      "precision (unless autocast makes them so)", stacklevel=3)


class InputGuard:
    """Checks a forward's inputs against the shapes the plan was profiled with, before any block
    runs: every dimension of every recorded input may be smaller (a short last batch, shorter
    sequences), none larger; an input of another rank is refused; an input the profile never
    saw is run with one warning (its bytes are not in the plan)."""

    def __init__(self, model: torch.nn.Module, plan: Plan, src: str):
        self.src = src
        self.fn = model.forward
        m = plan.model
        self.inputs = m.get("inputs")
        self.warned: set = set()
        if self.inputs is None:
            self.batch, self.seq = _positive(m.get("batch")), _positive(m.get("seq"))
            if not (self.batch and self.seq):
                raise PlanMismatchError(f"{src} records no input shapes (model.inputs) and no "
                                        f"batch x seq ({m.get('batch')!r} x {m.get('seq')!r}), "
                                        "so no input could be checked against it; profile and "
                                        "solve again")
            return
        if not isinstance(self.inputs, list) or not self.inputs:
            raise PlanMismatchError(f"{src}: model.inputs must list the profiled inputs; "
                                    "profile and solve again")
        self.want = {}
        for i in self.inputs:
            shape = i.get("shape") if isinstance(i, dict) else None
            if not (isinstance(shape, list) and all(_positive(s) for s in shape)):
                raise PlanMismatchError(f"{src}: input {i!r} needs a shape of positive sizes; "
                                        "profile and solve again")
            self.want[i["name"]] = shape
        try:
            self.sig = inspect.signature(self.fn)
        except (TypeError, ValueError):
            self.sig = None

    def __call__(self, args, kwargs) -> None:
        if self.inputs is None:
            return self._legacy(args, kwargs)
        for got in input_table(self.fn, args, kwargs, self.sig):
            name, shape = got["name"], got["shape"]
            want = self.want.get(name)
            if want is None:
                if name not in self.warned:
                    self.warned.add(name)
                    warnings.warn(f"{self.src}: input {name!r} {_shape(shape)} was not profiled "
                                  f"(the plan knows {', '.join(self.want)}); its bytes are not "
                                  "in the plan's prediction: profile with the inputs you train "
                                  "with", stacklevel=4)
                continue
            if len(shape) != len(want):
                raise InputTooLargeError(
                    f"input {name!r} has shape {_shape(shape)} but the plan ({self.src}) was "
                    f"profiled with {_shape(want)}; give it {len(want)} dimensions or profile "
                    "and solve for this shape")
            for d, (a, b) in enumerate(zip(shape, want)):
                if a > b:
                    raise InputTooLargeError(
                        f"input {name!r} has shape {_shape(shape)}, larger than the plan's "
                        f"{_shape(want)} in dimension {d} ({a} > {b}) ({self.src}); split it "
                        "or profile and solve for this shape")

    def _legacy(self, args, kwargs):
        key, t = None, None
        for k in ("input_ids", "inputs_embeds"):
            if isinstance(kwargs.get(k), torch.Tensor):
                key, t = k, kwargs[k]
                break
        if t is None:
            t = next((a for a in args if isinstance(a, torch.Tensor)), None)
            key = "input"
        if t is None:
            key, t = next(((k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)),
                          (None, None))
        if t is None or t.dim() == 0:
            return
        b = t.shape[0]
        s = t.shape[1] if t.dim() >= 2 else None
        if b > self.batch or (s is not None and s > self.seq):
            raise InputTooLargeError(
                f"input '{key}' has batch {b} x seq {s}, larger than the plan's batch "
                f"{self.batch} x seq {self.seq} ({self.src}); split the batch or re-plan with "
                f"--batch {b} --seq {s}")


def _positive(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0
