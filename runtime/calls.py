"""How the runtime reads and rebuilds a block's call: where the hidden state is among its
arguments and in its output, taking it out and putting another in, and the state a block
changes as it runs, so that a recomputation runs it exactly as the forward did.

The rules are ``planner.formats.calls``'s, the profiler's too, so that the profile and the
runtime agree on them: the hidden state is the first positional tensor, else
``hidden_states``, else the first tensor keyword; in the output, the output itself or its
first tensor (tuples, lists, mappings such as Hugging Face ``ModelOutput``, dataclasses). Every other tensor argument is a side input, kept
by reference.

``CallState`` is what a recomputation must put back around the block it re-runs:

- the state objects among its arguments (a ``DynamicCache``/``EncoderDecoderCache`` the block
  appended its keys and values to, with ``use_cache`` at its Hugging Face default): as they
  were before the forward, for the replay, then as the forward left them, so the user's cache
  is not changed by the replay;
- the block's own buffers (BatchNorm's running statistics and batch count): as the forward left
  them, so the replay does not update them a second time. All of them are copied around the
  replay, since a kernel's in-place update does not always show in the version counter
  (``native_batch_norm`` leaves ``running_mean._version`` as it was); they are small.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from planner.formats.calls import StateSnapshot, hidden_location, hidden_of as _hidden_of

from .binding import PlanMismatchError


def find_hidden(args, kwargs):
    """``(location, tensor)`` of a block call's hidden state, or ``(None, None)``."""
    return hidden_location(args, kwargs)


def hidden_of(out) -> torch.Tensor:
    h = _hidden_of(out)
    if h is None:
        raise PlanMismatchError(f"a block returned {type(out).__name__} with no tensor in it; "
                                "tierplan needs a tensor, or a tuple, mapping or dataclass whose "
                                "first tensor is the hidden state")
    return h


def strip_hidden(args, kwargs, loc):
    """The call's arguments with the hidden state taken out (``None`` in its place)."""
    if loc[0] == "a":
        a = list(args)
        a[loc[1]] = None
        return tuple(a), dict(kwargs)
    k = dict(kwargs)
    k[loc[1]] = None
    return tuple(args), k


def put_hidden(args, kwargs, loc, x):
    """The call's arguments with ``x`` as the hidden state."""
    if loc[0] == "a":
        a = list(args)
        a[loc[1]] = x
        return tuple(a), kwargs
    k = dict(kwargs)
    k[loc[1]] = x
    return args, k



class RecomputeMismatch(RuntimeError):
    """The recomputation did not save what the forward saved (a block that is not replayable)."""


class CallState:
    """Taken just before a block's forward; ``replay()`` wraps its recomputation."""

    __slots__ = ("name", "before", "block", "sides")

    def __init__(self, name: str, block: torch.nn.Module, args, kwargs, loc=None):
        self.name = name
        self.before = StateSnapshot(args, kwargs, module=block)
        self.block = block
        # Its side arguments (masks, position tensors) with their version counters: one written
        # in place after the forward would make the replay compute something else.
        a, k = strip_hidden(args, kwargs, loc) if loc is not None else (args, kwargs)
        self.sides = [(t, t._version) for t in tree_flatten((a, k))[0]
                      if isinstance(t, torch.Tensor)]

    def replay(self, run):
        """``run()`` with the arguments' state objects as they were before the forward and the
        block's written buffers as the forward left them; afterwards everything is as the
        forward left it."""
        if any(t._version != v for t, v in self.sides):
            raise RecomputeMismatch(
                f"tierplan: recomputing {self.name}: a tensor argument of it (a mask, a position "
                "tensor) was written in place since its forward, so the forward cannot be "
                "replayed; keep or offload this block")
        written = self.before.changed_in_place()
        if written is not None:
            raise RecomputeMismatch(
                f"tierplan: recomputing {self.name}: a tensor inside its {written} was written "
                "in place since its forward (a preallocated cache?), so the forward cannot be "
                "replayed; keep or offload this block, or pass use_cache=False")
        after = self.before.now() if self.before else None
        kept = [(b, b.detach().clone()) for b in self.block.buffers()]
        self.before.restore()
        try:
            return run()
        finally:
            if after is not None:
                after.restore()
            with torch.no_grad():
                for b, v in kept:
                    b.copy_(v)
