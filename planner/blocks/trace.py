"""The call tree of one forward (``trace_calls``): every module call in the order it started,
who called it, the hidden state it received and returned, the calls its hidden state was
computed from, and the FLOPs it did. What block detection (``planner.blocks.detect``) reads.

Imports torch lazily: the module is importable without it.
"""
from __future__ import annotations

import dataclasses

from planner.formats.calls import _is_tensor, hidden_location, hidden_of
from planner.blocks.metaops import meta_scalar, run_op

# How many of the latest calls a tensor's lineage remembers (trace_calls): enough for the code
# between two layers (a concatenated skip connection, a norm, a dropout module).
LINEAGE = 16


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

    from planner.blocks.flops import op_flops

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
