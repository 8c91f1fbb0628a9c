"""Calling the user's model and its blocks: a block's kind and input signature (what makes
two blocks share one record), the tensors and bytes of an argument or output, the loss of an
output, the model's calls with its errors turned into one line, and a block's inputs as fresh
leaves (``_leaf_copy``).
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils._pytree import tree_flatten, tree_map

from planner.errors import UserError
from planner.profile.tracker import _storage_key


def _sig(x):
    """Hashable signature of a block's inputs: tensor shapes/dtypes, other values by type."""
    leaves, spec = tree_flatten(x)
    out = []
    for a in leaves:
        if isinstance(a, torch.Tensor):
            out.append(("T", tuple(a.shape), str(a.dtype), a.requires_grad, a.device.type))
        elif isinstance(a, (int, float, bool, str, type(None))):
            out.append(a)
        else:
            out.append(type(a).__name__)
    return str(spec), tuple(out)


def _block_kind(block):
    return (type(block).__qualname__,
            tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad)
                  for n, p in block.named_parameters()),
            tuple((n, tuple(b.shape), str(b.dtype)) for n, b in block.named_buffers()),
            block.training)


def _leaves(x) -> list:
    """Tensors in ``x``, looking inside dataclasses and Hugging Face ModelOutputs too."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = [getattr(x, f.name) for f in dataclasses.fields(x)]
    elif hasattr(x, "to_tuple"):
        x = x.to_tuple()
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _tensor_bytes(x) -> int:
    seen, total = set(), 0
    for t in _leaves(x):
        if isinstance(t, torch.Tensor):
            key = _storage_key(t)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def _first_tensor(x):
    leaves = _leaves(x)
    return leaves[0] if leaves else None


def _loss_of(out, name: str = "model"):
    loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        t = _first_tensor(out)
        if t is None:
            raise UserError(f"model '{name}': its output has neither .loss nor a tensor; return "
                            "a loss or logits from its forward")
        loss = t.float().sum()
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise UserError(f"model '{name}': its output does not require grad, so there is no "
                        "backward to profile; the output must be differentiable (a .loss or a "
                        "float tensor that requires grad, from parameters that require grad)")
    return loss


def _user_code(name: str, what: str, fn, *args, meta: bool = False):
    """Run the user's model (``fn(*args)``), turning what it raises into one UserError line.

    Our own UserErrors pass through; anything else came from the model's code or from an op
    it calls that cannot run here (``.item()`` on meta, say), and only then is profiling on
    CPU worth suggesting.
    """
    try:
        return fn(*args)
    except UserError:
        raise
    except Exception as e:   # noqa: BLE001 -- the model is user code
        msg = (str(e).strip().splitlines() or [""])[0][:200]
        # another dtype too: some of torch's meta kernels take fewer dtypes than the real
        # ones (blocks.run_op makes grouped_mm's output itself; others may refuse too)
        hint = ("fix the model, or if it only fails on meta profile it with --device cpu or "
                "another --dtype" if meta else "fix the model or its inputs")
        raise UserError(f"model '{name}': its {what} raised {type(e).__name__}: {msg}; {hint}"
                        ) from None


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _call_args(inputs):
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def _leaf_copy(args, kwargs, loc=None):
    """The block's inputs as fresh leaves (same storages), so its graph stands alone; the
    hidden state at ``loc`` is a copy made from such a leaf, so that a block that writes into
    its input in place (``ReLU(inplace=True)``) neither hits autograd's rule against in-place
    writes to leaves nor changes the model's own tensor. Returns ``(args, kwargs, copy)``."""
    a, k = tree_map(lambda t: t.detach().requires_grad_(t.requires_grad)
                    if isinstance(t, torch.Tensor) else t, (args, kwargs))
    x = None
    if loc is not None:
        a, k = list(a), dict(k)
        where = a if loc[0] == "a" else k
        x = where[loc[1]] = where[loc[1]].clone()
        a = tuple(a)
    return a, k, x

