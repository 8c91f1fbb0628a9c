"""What a block is, how it is called, and what ties a plan to a model.

Shared by the profiler and the runtime, so that both agree on every point (docs/models.md):

- **Finding blocks** (``detect_blocks``): one forward runs with a hook on every module, which
  records the real call tree: who called whom, in what order, with which hidden state, and how
  many FLOPs each call did. Blocks are runs of consecutive calls of the same class, inside the
  same caller, each fed by the one before (a chain, not parallel projections), at any nesting
  depth; a run whose members are themselves nothing but runs (a ResNet's stages, nested stage
  lists) is replaced by the runs inside. Containers never run, so they are never blocks; a
  module that runs more than once per forward (shared weights) cannot be one.
- **Calling blocks** (``hidden_location``, ``hidden_of``, ``StateSnapshot``): where a block's
  hidden state is among its arguments and in its output, and how to put back the mutable state
  objects (key/value caches) a block updates, so that a block can be run again as it first ran.
- **Binding** (``structure_hash``, ``param_table``, ``input_table``, ``identity_hash``): the
  exact names of the blocks, the shapes and dtypes of every unit's parameters and every model
  input's shape, which a plan carries and ``apply_plan`` checks.

Imports torch lazily: the module is importable without it.
"""
from __future__ import annotations

import dataclasses
import enum
import fnmatch
import functools
import hashlib
import inspect
import json
import re
import types
from collections.abc import Mapping

from planner.errors import UserError

# A stack of blocks is "nothing but" its inner runs when they hold at least this share of its
# FLOPs: a T5 stack's blocks hold 100% (its embedding lookup, final norm and dropout count no
# FLOPs), a ResNet stage's residual blocks 100%; a decoder layer whose feed-forward experts form
# a run holds its attention apart, and experts are not a chain anyway.
STACK_SHARE = 0.9
# Runs holding less than this share of the heaviest run's FLOPs are not blocks (a pair of
# Linear layers in a classifier head, a run of parameterless Dropouts).
MIN_RUN_SHARE = 0.05
# Items of another class between two runs of one container's items join them when each is fed
# by the one before and holds at least this share of the lightest member's weight (Jamba: an
# attention layer after every seven Mamba layers, all in model.layers; a norm does not).
BRIDGE_SHARE = 0.2
# Items of one class that occur at least twice in a container, outside every run, are members
# of a stack to bridge when each holds at least this share of the container's heaviest item
# (Zamba2 with a hybrid layer after every Mamba layer: a Mamba layer holds 19% of a hybrid's
# FLOPs at hidden 64); a norm or an activation holds well under 1%.
REPEAT_SHARE = 0.05
# A run whose members each hold a chain of their own list items (each item computed from the
# one before) is replaced by those chains when they hold at least this share of each member,
# even under STACK_SHARE: the rest is code between layers (ConvNeXt's downsampling before a
# stage's layers, 10% of its last stage at hidden 128; a U-Net up block's upsampler). A
# decoder layer's experts are no chain, nor its own list items, so this does not split it.
STAGE_SHARE = 0.5
# How many of the latest calls a tensor's lineage remembers (trace_calls): enough for the code
# between two layers (a concatenated skip connection, a norm, a dropout module).
LINEAGE = 16


def _nn():
    import torch.nn as nn
    return nn


def _container_types():
    nn = _nn()
    return (nn.ModuleList, nn.Sequential, nn.ModuleDict)


# ----------------------------------------------------------------------------- calls

def _is_tensor(x) -> bool:
    import torch
    return isinstance(x, torch.Tensor)


def hidden_location(args, kwargs):
    """Where a block's hidden state is: ``(("a", i) | ("k", name), tensor)``, or ``(None,
    None)``. The first positional tensor, else ``hidden_states``, else the first tensor keyword
    (in call order). The runtime keeps every other tensor argument by reference."""
    for i, a in enumerate(args):
        if _is_tensor(a):
            return ("a", i), a
    if _is_tensor(kwargs.get("hidden_states")):
        return ("k", "hidden_states"), kwargs["hidden_states"]
    for k, v in kwargs.items():
        if _is_tensor(v):
            return ("k", k), v
    return None, None


def output_items(out) -> list:
    """The top-level items of a block's or model's output: a tensor, a tuple/list, a mapping
    (Hugging Face ``ModelOutput`` is an OrderedDict) or a dataclass; ``[]`` for anything else."""
    if _is_tensor(out):
        return [out]
    if isinstance(out, (tuple, list)):
        return list(out)
    if isinstance(out, Mapping):
        return list(out.values())
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return [getattr(out, f.name) for f in dataclasses.fields(out)]
    return []


def hidden_of(out):
    """A block's output hidden state: the output itself, or the first tensor of its items;
    ``None`` when there is none."""
    return next((o for o in output_items(out) if _is_tensor(o)), None)


def same_tensor(a, b) -> bool:
    """``a`` and ``b`` are the same values: one object, or the same view of one storage."""
    if a is b:
        return True
    if not (_is_tensor(a) and _is_tensor(b)):
        return False
    try:
        return (a.untyped_storage()._cdata == b.untyped_storage()._cdata
                and a.storage_offset() == b.storage_offset() and a.shape == b.shape
                and a.stride() == b.stride() and a.dtype == b.dtype)
    except (RuntimeError, NotImplementedError):
        return False


def _atomic(x) -> bool:
    import torch
    return isinstance(x, (int, float, complex, bool, str, bytes, type(None), enum.Enum, type,
                          torch.dtype, torch.device, torch.Size, torch.nn.Module,
                          types.FunctionType, types.MethodType, types.BuiltinFunctionType,
                          functools.partial))


class StateSnapshot:
    """The mutable state objects among a call's arguments, as they are now, to be put back.

    Hugging Face blocks update a key/value cache object (``DynamicCache``,
    ``EncoderDecoderCache``) passed to every layer: its per-layer entries are reassigned
    (``self.keys = torch.cat([self.keys, k])``) and flags set (``is_updated[layer] = True``).
    Running such a block again (a timing repeat, a recomputation) would see the entry its first
    run added and attend to twice the keys. A snapshot copies, recursively, the ``__dict__`` of
    every object and the items of every list and dict found in the arguments (tensors are kept
    by reference with their version counter), and ``restore()`` puts them back. A tensor inside
    such an object that was written in place (a preallocated static cache) cannot be put back:
    ``changed_in_place()`` names it. Modules, classes and plain values are left alone.

    With ``module`` (the block about to run), its submodules' plain tensor attributes (neither
    parameters nor buffers) are state too: RecurrentGemma's recurrent layer starts from
    ``self.recurrent_states`` and leaves its final state there (``use_cache``, the default),
    so a replay started from the state the forward left, took another path and saved 82
    tensors where the forward saved 81. Attributes that are tensors or None are kept by
    reference; ``restore()`` puts them back and drops tensor attributes added since.
    """

    MAX_DEPTH = 6   # DynamicCache -> layers list -> DynamicLayer -> keys: depth 3

    def __init__(self, args=(), kwargs=None, module=None):
        self.objects: list = []    # (obj, dict copy)
        self.lists: list = []      # (list, items)
        self.dicts: list = []      # (dict, items)
        self.tensors: list = []    # (path, tensor, version) of tensors inside state objects
        self.attrs: list = []      # (module, {name: tensor or None}) of the block's modules
        seen: set = set()
        for i, a in enumerate(args):
            self._visit(a, f"argument {i}", 0, seen, top=True)
        for k, v in (kwargs or {}).items():
            self._visit(v, f"argument '{k}'", 0, seen, top=True)
        if module is not None:
            for name, m in module.named_modules():
                d = _attributes(m)
                if d:
                    self.attrs.append((m, d))
                    self.tensors += [(f"attribute {'.'.join(filter(None, (name, k)))}", t,
                                      t._version) for k, t in d.items() if t is not None]

    def __bool__(self):
        return bool(self.objects or self.lists or self.dicts or self.attrs)

    def _visit(self, x, path, depth, seen, top=False):
        if _is_tensor(x):
            if not top:
                self.tensors.append((path, x, x._version))
            return
        if _atomic(x) or depth > self.MAX_DEPTH or id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, tuple):
            for i, v in enumerate(x):
                self._visit(v, path, depth + 1, seen, top)
        elif isinstance(x, list):
            self.lists.append((x, list(x)))
            for v in x:
                self._visit(v, path, depth + 1, seen)
        elif isinstance(x, dict):
            self.dicts.append((x, dict(x)))
            for v in list(x.values()):
                self._visit(v, path, depth + 1, seen)
        elif hasattr(x, "__dict__") and isinstance(vars(x), dict):
            self.objects.append((x, dict(vars(x))))
            for v in list(vars(x).values()):
                self._visit(v, f"{path} ({type(x).__name__})", depth + 1, seen)

    def now(self) -> "StateSnapshot":
        """A snapshot of the same objects as they are now (to put back after a replay)."""
        snap = StateSnapshot()
        snap.objects = [(o, dict(vars(o))) for o, _ in self.objects]
        snap.lists = [(lst, list(lst)) for lst, _ in self.lists]
        snap.dicts = [(d, dict(d)) for d, _ in self.dicts]
        snap.attrs = [(m, _attributes(m)) for m, _ in self.attrs]
        return snap

    def restore(self) -> None:
        for obj, d in self.objects:
            state = vars(obj)
            state.clear()
            state.update(d)
        for lst, items in self.lists:
            lst[:] = items
        for dct, items in self.dicts:
            dct.clear()
            dct.update(items)
        for m, d in self.attrs:
            state = vars(m)
            for k in [k for k, v in state.items() if _is_tensor(v) and k not in d]:
                del state[k]
            state.update(d)

    def changed_in_place(self) -> str | None:
        """The path of the first tensor inside a state object written in place since the
        snapshot, or None."""
        for path, t, v in self.tensors:
            if t._version != v:
                return path
        return None


def _attributes(m) -> dict:
    """A module's plain attributes that are tensors or None (its parameters and buffers live
    in ``_parameters`` and ``_buffers``, not here)."""
    import torch
    tensor = torch.Tensor
    return {k: v for k, v in vars(m).items() if v is None or isinstance(v, tensor)}


def state_tensor_bytes(args, kwargs) -> int:
    """Bytes of the distinct storages held inside the state objects among a call's arguments
    (a key/value cache), as they are now."""
    snap = StateSnapshot(args, kwargs)
    seen, total = set(), 0
    for _, t, _ in snap.tensors:
        try:
            key = t.untyped_storage()._cdata
            n = t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            continue
        if key not in seen:
            seen.add(key)
            total += int(n)
    return total


def meta_scalar(func, args):
    """The value a model gets when it asks a meta tensor for a Python number, or ``None`` for
    any other call.

    NB: a meta tensor has no value. Models ask for one to pick a code path, and their boolean
    questions are "is everything ordinary?" (Hugging Face's mask code asks whether all
    positions are unpacked, whether the padding mask is all ones): answer True, and 0 for
    numbers, the plain path a batch of full sequences takes.
    """
    import torch
    if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
        t = args[0]
        return True if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)
    return None


def run_op(func, args, kwargs):
    """``func(*args, **kwargs)``, also where torch's meta kernel takes fewer dtypes than the
    real ones.

    NB: the meta kernel of ``aten._grouped_mm`` (how transformers runs a mixture of experts)
    takes bf16 only, as the CUDA kernel does, and 16-byte-aligned rows; the CPU kernel also
    takes fp32 and fp16, so a Mixtral built as ``from_config`` gives it (fp32) could not be
    profiled on meta. In another dtype on meta its output is made here, with the shape the
    meta kernel gives (``_grouped_mm_shape``) and the dtype asked for: a meta tensor has no
    values to compute.
    """
    import torch
    grouped = getattr(torch.ops.aten, "_grouped_mm", None)
    if grouped is not None and func is grouped.default and len(args) >= 2 \
            and args[0].device.type == "meta" and args[0].dtype != torch.bfloat16:
        a, b = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        out_dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or a.dtype
        return torch.empty(_grouped_mm_shape(a, b, offs), dtype=out_dtype, device="meta")
    return func(*args, **kwargs)


def _grouped_mm_shape(a, b, offs) -> list:
    """The output shape of ``aten._grouped_mm(a, b, offs)``: groups of rows of a 2D ``a``
    through a 3D ``b`` (one matrix per group), a batch of matrices, or a 2D-by-2D product per
    group of the shared dimension (torch/_meta_registrations.py,
    ``_create_grouped_mm_output_tensor``)."""
    if a.dim() == 2:
        return [offs.size(0), a.size(0), b.size(1)] if b.dim() == 2 else [a.size(0), b.size(-1)]
    return [a.size(1), b.size(1)] if b.dim() == 2 else [a.size(0), a.size(1), b.size(-1)]


# ----------------------------------------------------------------------------- the call tree

@dataclasses.dataclass(eq=False)
class Call:
    """One module call of the traced forward."""

    idx: int
    name: str                       # qualified module name ("" for the model)
    module: object
    parent: int | None
    children: list = dataclasses.field(default_factory=list)
    hin: tuple | None = None        # the hidden state it received (None: no tensor argument)
    hout: tuple | None = None       # its output's hidden state
    flops: int = 0                  # its own and its callees' FLOPs
    end: int = 0                    # when it returned: 1, 2, ... in the order calls return
    # the calls (by ``end``) whose outputs its hidden state was computed from, the latest
    # LINEAGE of them: what ``_fed`` reads to tell a chain from parallel calls
    hin_from: frozenset = frozenset()


def _desc(t) -> tuple | None:
    """A tensor as (storage, offset, shape, stride, dtype): enough to tell whether two calls saw
    the same values, without keeping every intermediate of the forward alive (which holding the
    tensors would, a whole training step's activations for a large model)."""
    if not _is_tensor(t):
        return None
    try:
        key = t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        key = id(t)
    return key, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype


def _flat_tensors(x) -> list:
    from torch.utils._pytree import tree_flatten
    return [t for t in tree_flatten(x)[0] if _is_tensor(t)]


def trace_calls(model, run) -> list[Call]:
    """Run ``run()`` (one forward of ``model``) under a hook on every module and a FLOP count;
    return the calls in the order they started. Under ``no_grad``: only the call order, the
    hidden states and FLOPs matter, and nothing is kept for a backward."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from planner.profile.flops import op_flops

    names = {id(m): n for n, m in model.named_modules()}
    calls: list[Call] = []
    stack: list[int] = []
    # storage -> the calls (by end) whose outputs it was computed from: each op's outputs get
    # the union of its inputs' sets, each call's output hidden state its own end as well
    lineage: dict = {}
    ended = [0]

    def key(t):
        d = _desc(t)
        return None if d is None else d[0]

    def keep(tags):
        return tags if len(tags) <= LINEAGE else frozenset(sorted(tags)[-LINEAGE:])

    def pre(mod, args, kwargs):
        c = Call(len(calls), names[id(mod)], mod, stack[-1] if stack else None)
        h = hidden_location(args, kwargs)[1]
        c.hin = _desc(h)
        c.hin_from = lineage.get(key(h), frozenset())
        if c.parent is not None:
            calls[c.parent].children.append(c.idx)
        calls.append(c)
        stack.append(c.idx)

    def post(mod, args, kwargs, out):
        if stack and calls[stack[-1]].module is mod:
            c = calls[stack.pop()]
            h = hidden_of(out)
            c.hout = _desc(h)
            ended[0] += 1
            c.end = ended[0]
            k = key(h)
            if k is not None:
                lineage[k] = keep(lineage.get(k, frozenset()) | {c.end})

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            v = meta_scalar(func, args)
            if v is not None:
                return v
            out = run_op(func, args, kwargs)
            if stack:
                calls[stack[-1]].flops += op_flops(func, args, kwargs, out)
            tags = frozenset()
            for a in _flat_tensors((args, kwargs)):
                tags |= lineage.get(key(a), frozenset())
            tags = keep(tags)
            for t in _flat_tensors(out):
                k = key(t)
                if k is not None:
                    lineage[k] = tags
            return out

    handles = []
    try:
        for m in {id(m): m for m in model.modules()}.values():
            handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(m.register_forward_hook(post, with_kwargs=True, always_call=True))
        with torch.no_grad(), Count():
            run()
    finally:
        for h in handles:
            h.remove()
    for c in reversed(calls):          # callees come after their caller: inclusive FLOPs
        if c.parent is not None:
            calls[c.parent].flops += c.flops
    return calls


# ----------------------------------------------------------------------------- detection

@dataclasses.dataclass
class BlockSet:
    """The blocks of a model, in the order they run."""

    names: list                     # exact qualified module names
    modules: list
    paths: str                      # the containers they sit in, comma-separated (for people)

    def pairs(self):
        return list(zip(self.names, self.modules))


def _container_of(model, name: str) -> str | None:
    """The name of the ModuleList/Sequential/ModuleDict holding module ``name``, or None."""
    if not name:
        return None
    parent = name.rsplit(".", 1)[0] if "." in name else ""
    return parent if isinstance(model.get_submodule(parent), _container_types()) else None


class _Detector:
    def __init__(self, model, calls: list[Call]):
        self.model = model
        self.calls = calls
        self.counts: dict = {}
        for c in calls:
            self.counts[id(c.module)] = self.counts.get(id(c.module), 0) + 1
        total = calls[0].flops if calls else 0
        self.by_flops = total > 0
        self.container = {c.idx: _container_of(model, c.name) for c in calls}

    def weight(self, idx: int) -> int:
        c = self.calls[idx]
        if self.by_flops:
            return c.flops
        return sum(p.numel() for p in c.module.parameters())

    def _fed(self, a: Call, b: Call) -> bool:
        """``b``'s hidden state is ``a``'s output or was computed from it (a U-Net up block
        concatenates a skip connection to it before each ResNet block)."""
        return b.hin is not None and a.hout is not None and (
            b.hin == a.hout or (a.end > 0 and a.end in b.hin_from))

    def _siblings(self, ca: str | None, cb: str | None) -> bool:
        """Containers ``ca`` and ``cb`` are one, or lists side by side in one module (a U-Net
        tower's ``resnets`` and ``attentions``, whose items it calls in turn)."""
        if ca is None or cb is None:
            return False
        return ca == cb or ca.rpartition(".")[0] == cb.rpartition(".")[0]

    def _link(self, a: Call, b: Call, strong: bool, any_class: bool = False) -> bool:
        """``b`` continues a run ending with ``a``: same class (unless ``any_class``), distinct
        modules, (strong: in the same container,) and ``b`` is fed by ``a`` — its hidden state
        is ``a``'s output or computed from it, or at least not ``a``'s input (parallel
        projections such as q/k/v share their input) and has the shape of ``a``'s output.
        Strong, items of sibling lists link too, where ``b`` is computed from ``a``'s
        output."""
        if (type(a.module) is not type(b.module) and not any_class) or a.module is b.module:
            return False
        ca, cb = self.container[a.idx], self.container[b.idx]
        if strong and (ca is None or ca != cb):
            return self._siblings(ca, cb) and self._fed(a, b)
        if b.hin is None or a.hout is None:
            return False
        if self._fed(a, b):
            return True
        return b.hin != a.hin and b.hin[2] == a.hout[2]

    def runs(self, kids: list[int], strong: bool) -> list[list[int]]:
        out, cur = [], kids[:1]
        for a, b in zip(kids, kids[1:]):
            ca, cb = self.calls[a], self.calls[b]
            if self._link(ca, cb, strong) and all(self.calls[x].module is not cb.module
                                                  for x in cur):
                cur.append(b)
                continue
            if len(cur) >= 2:
                out.append(cur)
            cur = [b]
        if len(cur) >= 2:
            out.append(cur)
        return self._bridge(kids, out) if strong else out

    def _bridge(self, kids: list[int], runs: list[list[int]]) -> list[list[int]]:
        """Runs of one container's items with items of other classes between them are one
        stack: what lies between joins them when each item there is of the same container,
        in no other run, not itself a container (a stage of blocks is expanded, not bridged
        over), fed by the one before (``_link`` with any class), and holds at least
        ``BRIDGE_SHARE`` of the lightest member of the runs. Why: Jamba's model.layers holds
        Mamba layers with an attention layer after every seven; the attention layers were
        left between the runs as prologues, neither recomputed nor offloaded. A lone item of
        a run's class joins the same way, and so do the items of a class repeated in the
        container (``_repeated``), where classes alternate and there is no run to bridge.
        Runs of containers are left as they are: torchvision's Swin lists Sequential stages
        with a PatchMerging between each two, and bridged they became one run that
        ``_expand`` could not split (8 coarse units where each stage's blocks were units)."""
        pos = {k: i for i, k in enumerate(kids)}
        bridging = [r for r in runs
                    if not isinstance(self.calls[r[0]].module, _container_types())]
        fixed = [r for r in runs if not any(r is b for b in bridging)]
        kinds = {(self.container[r[0]], type(self.calls[r[0]].module)) for r in bridging}
        inside = {x for r in runs for x in r}
        kinds |= self._repeated(kids, inside)
        if not kinds:
            return runs
        # a lone item of a run's class in the run's container (a Mamba layer after the
        # attention layer that follows a run)
        lone = [[k] for k in kids if k not in inside
                and (self.container[k], type(self.calls[k].module)) in kinds]
        members = {x for r in bridging + lone for x in r}
        cands = sorted(bridging + lone, key=lambda r: pos[r[0]])
        out = cands[:1]
        for r in cands[1:]:
            prev = out[-1]
            between = kids[pos[prev[-1]] + 1:pos[r[0]]]
            chain = [prev[-1], *between, r[0]]
            light = min(self.weight(x) for x in prev + r if x in members)
            merged = prev + between + r
            if (light > 0 and not inside.intersection(between)
                    and all(self._siblings(self.container[x], self.container[prev[-1]])
                            for x in between)
                    and not any(isinstance(self.calls[x].module, _container_types())
                                for x in between)
                    and all(self._link(self.calls[a], self.calls[b], True, any_class=True)
                            for a, b in zip(chain, chain[1:]))
                    and all(self.weight(x) >= BRIDGE_SHARE * light for x in between)
                    and len({id(self.calls[x].module) for x in merged}) == len(merged)):
                out[-1] = merged
            else:
                out.append(r)
        return sorted([r for r in out if len(r) >= 2] + fixed, key=lambda r: pos[r[0]])

    def _repeated(self, kids: list[int], inside: set) -> set:
        """(container, class) of items outside every run that occur at least twice in one
        container, each holding at least ``REPEAT_SHARE`` of that container's heaviest item:
        a stack whose classes alternate has no run of one class to bridge (Zamba2 with a
        hybrid layer after every Mamba layer: its blocks were the LoRA adapters inside the
        shared transformer). A norm or activation between Linears is too light to count."""
        items: dict = {}
        for k in kids:
            if self.container[k] is not None and \
                    not isinstance(self.calls[k].module, _container_types()):
                items.setdefault(self.container[k], []).append(k)
        out = set()
        for cont, ks in items.items():
            heavy = max(self.weight(k) for k in ks)
            by_class: dict = {}
            for k in ks:
                if k not in inside:
                    by_class.setdefault(type(self.calls[k].module), []).append(k)
            out |= {(cont, cls) for cls, got in by_class.items() if len(got) >= 2 and heavy > 0
                    and all(self.weight(k) >= REPEAT_SHARE * heavy for k in got)}
        return out

    def select(self, kids: list[int], strong: bool) -> list[list[int]]:
        """Runs of blocks among the calls ``kids`` (siblings, in order) and below them."""
        runs = self.runs(kids, strong)
        first = {r[0]: r for r in runs}
        inside = {x for r in runs for x in r}
        out: list[list[int]] = []
        for k in kids:
            if k in first:
                out.extend(self._expand(first[k], strong))
            elif k not in inside:
                out.extend(self.select(self.calls[k].children, strong))
        return out

    def _expand(self, run: list[int], strong: bool) -> list[list[int]]:
        """A run whose members are each nothing but a stack of blocks (their inner runs, items
        of a ModuleList/Sequential, hold at least STACK_SHARE of them) becomes those inner
        runs. Only list items count: inside a small block, its own two Linears may hold all
        its FLOPs and still not be blocks."""
        inner = [self.select(self.calls[m].children, True) for m in run]
        for m, sub in zip(run, inner):
            got = sum(self.weight(x) for r in sub for x in r)
            w = self.weight(m)
            if not sub or w == 0 or (got < STACK_SHARE * w
                                     and not (got >= STAGE_SHARE * w and self._stage(m, sub))):
                return [run]
        return [r for sub in inner for r in sub]

    def _stage(self, m: int, sub: list[list[int]]) -> bool:
        """The runs ``sub`` found inside call ``m`` are chains of ``m``'s own list items (of
        ``m`` itself, a called Sequential, or of lists that are its attributes), each item
        computed from the one before: ``m`` is a stage of layers."""
        name = self.calls[m].name
        for r in sub:
            for x in r:
                cont = self.container[x]
                if cont is None or (cont != name and cont.rpartition(".")[0] != name):
                    return False
            if not all(self._fed(self.calls[a], self.calls[b]) for a, b in zip(r, r[1:])):
                return False
        return True

    def choose(self, kids: list[int]) -> list[int]:
        runs = self.select(kids, strong=True)
        if not runs:
            runs = self._singletons(kids)
        if not runs:
            runs = self.select(kids, strong=False)
        if not runs:
            return []
        heaviest = max(sum(self.weight(x) for x in r) for r in runs)
        keep = [r for r in runs if sum(self.weight(x) for x in r) >= MIN_RUN_SHARE * heaviest]
        return sorted(x for r in keep for x in r)

    def _singletons(self, kids: list[int]) -> list[list[int]]:
        """No run anywhere (a one-layer model): the called items of the heaviest container,
        those of the class of its heaviest item."""
        below = set()
        todo = list(kids)
        while todo:
            k = todo.pop()
            below.add(k)
            todo.extend(self.calls[k].children)
        groups: dict = {}
        for k in sorted(below):
            cont = self.container[k]
            if cont is not None:
                groups.setdefault(cont, []).append(k)
        if not groups:
            return []
        best = max(groups.values(), key=lambda g: sum(self.weight(x) for x in g))
        cls = type(self.calls[max(best, key=self.weight)].module)
        items = [x for x in best if type(self.calls[x].module) is cls]
        return [[x] for x in items] if sum(self.weight(x) for x in items) > 0 else []


def _split_patterns(spec) -> list[str]:
    if spec is None:
        return []
    if isinstance(spec, (list, tuple)):
        spec = ",".join(spec)
    return [p for p in re.split(r"[,\s]+", str(spec).strip()) if p]


def _match(pattern: str, name: str) -> bool:
    """Glob-like match of dotted names: ``*``, ``?`` and ``[...]`` within one component,
    ``**`` for any number of components (``encoder.block.*``, ``**.layers.*``)."""
    def rec(ps, ns):
        if not ps:
            return not ns
        if ps[0] == "**":
            return any(rec(ps[1:], ns[i:]) for i in range(len(ns) + 1))
        return bool(ns) and fnmatch.fnmatchcase(ns[0], ps[0]) and rec(ps[1:], ns[1:])
    return rec(pattern.split("."), name.split(".") if name else [])


def _paths(names: list[str]) -> str:
    seen = []
    for n in names:
        p = n.rsplit(".", 1)[0] if "." in n else ""
        if p not in seen:
            seen.append(p)
    return ",".join(seen)


def detect_blocks(model, run, blocks=None) -> BlockSet:
    """The blocks of ``model``: found from one traced forward (``run()``), or named by
    ``blocks`` (``--blocks``: comma/space separated qualified names or glob patterns; a single
    match that is a ModuleList/Sequential/ModuleDict means "the blocks are in there").
    Raises ``UserError`` with one line when there are none or a named one cannot be a block."""
    calls = trace_calls(model, run)
    det = _Detector(model, calls)
    called = {id(c.module) for c in calls}
    first_call = {}
    for c in calls:
        first_call.setdefault(id(c.module), c.idx)
    names = {id(m): n for n, m in model.named_modules()}
    patterns = _split_patterns(blocks)
    what = f"--blocks '{blocks if isinstance(blocks, str) else ','.join(patterns)}'"

    if patterns:
        modules = {n: m for n, m in model.named_modules() if n}
        matched: dict = {}
        for pat in patterns:
            hits = [n for n in modules if _match(pat, n)]
            if not hits:
                raise UserError(f"{what}: '{pat}' names no module of the model; give qualified "
                                "names such as 'transformer.h' or patterns such as "
                                "'encoder.block.*'")
            for n in hits:
                matched.setdefault(n, modules[n])
        if len(matched) == 1 and isinstance(next(iter(matched.values())), _container_types()):
            prefix = next(iter(matched)) + "."
            top = [c.idx for c in calls if c.name.startswith(prefix)
                   and (c.parent is None or not calls[c.parent].name.startswith(prefix))]
            idx = det.choose(top) or top
            if not idx:
                raise UserError(f"{what}: no module inside '{prefix[:-1]}' runs in the "
                                "forward; name the modules that do")
        else:
            for n, m in matched.items():
                if id(m) not in called:
                    raise UserError(f"{what}: '{n}' never runs in the forward, so it cannot be "
                                    "a block; name modules that run (the items of a ModuleList, "
                                    "not the list)")
            for n in matched:
                for other in matched:
                    if other != n and n.startswith(other + "."):
                        raise UserError(f"{what}: '{n}' is inside '{other}'; a block cannot "
                                        "contain another, name one of them")
            idx = sorted(first_call[id(m)] for m in matched.values())
    else:
        idx = det.choose(calls[0].children if calls else [])
        if not idx:
            raise UserError("found no repeated blocks in the model's forward (no run of "
                            "same-class modules each fed by the one before); name them with "
                            "--blocks, e.g. --blocks 'encoder.layers.*'")
    mods = [calls[i].module for i in idx]
    for m in mods:
        if det.counts.get(id(m), 0) > 1:
            raise UserError(f"module '{names[id(m)]}' runs {det.counts[id(m)]} times in one "
                            "forward (shared weights); tierplan plans each block once: name "
                            "other blocks with --blocks, or unroll the shared layer")
    out = [names[id(m)] for m in mods]
    return BlockSet(names=out, modules=mods, paths=_paths(out))


def find_blocks(model, path: str | None = None):
    """The rule of profiles and plans made before exact block names were recorded: return
    ``(path, [(qualified_name, module), ...])``.

    With ``path`` (``transformer.h``), that attribute must be a ModuleList or Sequential and
    its children are the blocks. Without it, the blocks are the longest run of consecutive
    children of the same class inside any ModuleList/Sequential (ties: the first in module
    order). Only plans without ``model.blocks`` are bound this way.
    """
    names = {id(m): n for n, m in model.named_modules()}
    nn = _nn()
    if path:
        obj = model
        for part in path.split("."):
            if not hasattr(obj, part):
                raise UserError(f"blocks path '{path}': the model has no attribute '{part}'; "
                                "re-profile the model (profiles now name every block)")
            obj = getattr(obj, part)
        if not isinstance(obj, (nn.ModuleList, nn.Sequential)) or len(obj) == 0:
            raise UserError(f"blocks path '{path}' is a {type(obj).__name__}, not a non-empty "
                            "ModuleList/Sequential; re-profile the model")
        return path, [(f"{path}.{i}", m) for i, m in enumerate(obj)]

    best = None
    for cname, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(container.children())
        i = 0
        while i < len(children):
            j = i
            while j + 1 < len(children) and type(children[j + 1]) is type(children[i]):
                j += 1
            if best is None or j - i + 1 > best[0]:
                best = (j - i + 1, cname, children[i:j + 1])
            i = j + 1
    if best is None:
        raise UserError("found no ModuleList/Sequential of blocks in the model; re-profile it "
                        "(profiles now name every block)")
    return best[1], [(names[id(m)], m) for m in best[2]]


# ----------------------------------------------------------------------------- binding

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
