"""Calling a block: where its hidden state is among its arguments and in its output, and the
mutable state objects (key/value caches, recurrent state attributes) a call updates, so that a
block can be run again as it first ran (``StateSnapshot``). Shared by the profiler and the
runtime.

Imports torch lazily: the module is importable without it.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import types
from collections.abc import Mapping


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
    and a replay started from the state the forward left would take another path and save
    other tensors than the forward did. Attributes that are tensors or None are kept by
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
