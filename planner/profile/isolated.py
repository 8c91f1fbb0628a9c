"""One block on its own: its forward and backward on fresh leaves under the tracker
(``_profile_isolated``), what its custom autograd Functions hold as ctx attributes
(``ctx_held``), and its timed repeats outside every profiling mode (``_time_block``).
"""
from __future__ import annotations

import time

import torch
from torch.autograd.function import BackwardCFunction
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from planner.profile.calling import _leaf_copy
from planner.profile.timing import _Repeats, _sync
from planner.profile.tracker import _Paused, _storage_key, _storage_nbytes, _Unit


def ctx_held(outs, known: set) -> tuple[int, tuple]:
    """Bytes of the distinct storages that custom autograd Functions in the graph of ``outs``
    hold as ctx attributes (``ctx.x = t``, also inside a list, tuple or dict attribute), other
    than the storages in ``known``; and the Functions' names.

    NB: the ctx of a custom Function is its backward node (a ``BackwardCFunction``), and its
    attributes live in the node's ``__dict__``; what it saved with ``save_for_backward`` is
    not there. Such tensors are freed only with the graph, after the block's backward: the
    runtime's saved-tensor hooks (recompute, offload) never see them.
    """
    seen_nodes, seen, total, names = set(), set(known), 0, []
    todo = [t.grad_fn for t in outs if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        todo.extend(n for n, _ in node.next_functions)
        if not isinstance(node, BackwardCFunction):
            continue
        held = 0
        for v in vars(node).values():
            items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) \
                else (v,)
            for t in items:
                if not isinstance(t, torch.Tensor):
                    continue
                key = _storage_key(t)
                if key is None or key in seen:
                    continue
                seen.add(key)
                held += _storage_nbytes(t)
        if held:
            total += held
            name = type(node).__name__.removesuffix("Backward")
            if name not in names:
                names.append(name)
    return total, tuple(names)


def _profile_isolated(u: _Unit, fn, args, kwargs, loc, tracker, device, timing):
    """Forward then backward of one block on fresh leaves, under the tracker. Returns its
    output (detached), whether it wrote into its hidden state in place, and whether its
    output requires grad."""
    with _Paused(tracker):
        a, k, x = _leaf_copy(args, kwargs, loc)
    u.side_keys = {_storage_key(t) for t in tree_flatten((a, k))[0]
                   if isinstance(t, torch.Tensor) and t is not x}
    version = x._version if x is not None else None
    tracker.set(u, "fwd")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start_mem = torch.cuda.memory_allocated(device)
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        out = fn(*a, **k)
    mutated = x is not None and x._version != version
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    # what its custom Functions hold as ctx attributes, beyond what autograd saved and the
    # block's own inputs (kept by reference under every plan anyway)
    known = set(tracker.static_keys) | u.side_keys | {v[2] for v in u.saved.values()}
    if x is not None:
        known.add(_storage_key(x))
    u.ctx_bytes, u.ctx_functions = ctx_held(outs, known)
    with _Paused(tracker):
        grads = [torch.ones_like(t) for t in outs]
    tracker.set(u, "bwd")
    if outs:
        torch.autograd.backward(outs, grads)
    tracker.set(None)
    peak = None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - start_mem
    result = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
    for t in tree_flatten(result)[0]:
        if isinstance(t, torch.Tensor):
            tracker.adopt(t, u)
    needs = bool(outs)
    del out, outs
    if peak is not None:
        timing[u.name] = ([], [], peak)
    return result, mutated, needs


def _time_block(u: _Unit, fn, args, kwargs, loc, snap, device, repeats, timing):
    """Forward and backward seconds of one block: a warm-up, then repeats until stable.

    Runs outside every profiling mode, so the instrumentation costs nothing here. Before each
    run the state objects among its arguments (a key/value cache) and its modules' tensor
    attributes (a recurrent state) are put back as the block first found them, so every
    repeat does the same work.
    """
    def once():
        snap.restore()
        a, k, _ = _leaf_copy(args, kwargs, loc)
        _sync(device)
        t0 = time.perf_counter()
        o = fn(*a, **k)
        _sync(device)
        t1 = time.perf_counter()
        outs = [t for t in tree_flatten(o)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        _sync(device)
        return t1 - t0, time.perf_counter() - t1

    fs, bs = [], []
    with _disable_current_modes():
        once()                                 # warm-up
        rep = _Repeats(repeats)
        while not rep.done(len(fs), (fs, bs)):
            f, b = once()
            fs.append(f)
            bs.append(b)
        snap.restore()
    timing[u.name] = (fs, bs, timing.get(u.name, (None, None, None))[2])

