"""Segment recomputation with saved-tensor hooks (Chen et al. 2016, arXiv:1604.06174).

The model's own loop calls its blocks one at a time, so a segment (a ``recompute`` unit with a
checkpoint and the ``none`` units after it) cannot be wrapped in one function as
``torch.utils.checkpoint`` would. Instead, like torch's non-reentrant checkpoint, the forward
runs normally under pack hooks that keep only a placeholder per saved tensor; the segment keeps
its first block's input (on the plan's checkpoint tier), each block's other arguments and the
RNG state before each block. At the first unpack in backward (the backward of the segment's last
unit, because backward runs in reverse) the whole segment is re-run from the checkpoint under
recording hooks and each placeholder is served the tensor recorded at the same position. The
gradient graph is the one built in the forward; recomputed tensors are only values.

A block is re-run as it first ran (``runtime.calls.CallState``): the state objects among its
arguments (a Hugging Face key/value cache, left on by ``use_cache``'s default) are put back as
they were before its forward for the replay and as the forward left them afterwards, and
buffers its forward wrote (BatchNorm's running statistics) are not written a second time. A
block that writes into its own input in place gets a copied checkpoint (the profile lists it).
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import saved_tensors_hooks

from .calls import CallState, RecomputeMismatch


class Placeholder:
    __slots__ = ("seg", "unit", "pos")

    def __init__(self, seg, unit, pos):
        self.seg, self.unit, self.pos = seg, unit, pos


def _no_unpack(_):
    raise RuntimeError("tierplan: the recomputation's own graph was used for backward; "
                       "this is a bug in the runtime")


class Segment:
    """One segment in one forward pass."""

    def __init__(self, runner, pass_, first: int, names: list[str], ck_tier: str):
        self.r = runner
        self.pass_ = pass_
        self.first = first                  # block index of the first unit
        self.names = names
        self.ck_tier = ck_tier              # gpu | cpu | nvme
        # per unit: (args, kwargs, hidden loc, rng cpu, rng dev, CallState)
        self.calls: list[tuple] = []
        self.saved: list[list] = []         # per unit, per pack position: (shape, dtype) or None
        self.ck = None                      # the checkpoint tensor (gpu tier)
        self.ck_group = None                # or its offload group and slot (cpu/nvme)
        self.ck_slot = None
        self.ck_requires_grad = False
        self.ck_copied = False              # the checkpoint is a copy, not the input itself
        self.ck_version = None
        self.autocast = None
        self.rec: list[list] | None = None
        self.left = 0                        # placeholders not yet served

    # -- forward
    def begin_unit(self, args, kwargs, loc, hidden: torch.Tensor):
        """Called before the forward of each unit of the segment, in order."""
        u = len(self.calls)
        r = self.r
        if u == 0:
            dev = hidden.device.type
            self.autocast = (dev, torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev),
                             torch.is_autocast_cache_enabled())
            self.ck_requires_grad = hidden.requires_grad
            x = hidden.detach()
            # A block that writes into its own input in place (the profile lists it in
            # model.inplace_input) would change its checkpoint under it: keep a copy instead.
            if self.names[0] in (r.plan.model.get("inplace_input") or ()):
                x = x.clone()
                self.ck_copied = True
            self.ck_version = x._version
            if self.ck_tier == "gpu":
                self.ck = x
                r.counters.add("act", x.numel() * x.element_size())
            else:
                from .offload import Group
                self.ck_group = Group(r.mover, self.ck_tier, "ck-" + self.names[0])
                self.ck_slot = self.ck_group.put(x)
                self.pass_.groups[("ck", self.names[0])] = self.ck_group
        # What the block's forward is about to change (a key/value cache in its arguments,
        # BatchNorm statistics in its buffers), so the replay can put it back around itself.
        state = CallState(self.names[u], r.blocks[self.first + u], args, kwargs, loc)
        args = r.strip_hidden(args, kwargs, loc)
        rng_dev = torch.cuda.get_rng_state(hidden.device) if hidden.device.type == "cuda" else None
        self.calls.append((args[0], args[1], loc, torch.get_rng_state(), rng_dev, state))
        self.saved.append([])
        return u

    def pack(self, u: int, t: torch.Tensor):
        if self.r.is_static(t):
            self.saved[u].append(None)
            return ("ref", t)
        self.saved[u].append((t.shape, t.dtype))
        self.left += 1
        return Placeholder(self, u, len(self.saved[u]) - 1)

    # -- backward
    def unpack(self, p: Placeholder) -> torch.Tensor:
        if self.rec is None:
            self._recompute()
        t = self.rec[p.unit][p.pos]
        if t is None:
            raise RuntimeError("tierplan: a recomputed tensor was unpacked twice; backward with "
                               "retain_graph=True is not supported under a recompute plan")
        self.rec[p.unit][p.pos] = None
        self.r.counters.add("act", -t.numel() * t.element_size())
        self.left -= 1
        if self.left == 0:
            self.rec = [[] for _ in self.names]
        return t

    def _checkpoint(self) -> torch.Tensor:
        if self.ck is not None:
            x, self.ck = self.ck, None
            self.r.counters.add("act", -x.numel() * x.element_size())
            if x._version != self.ck_version:
                raise RecomputeMismatch(
                    f"tierplan: the input of {self.names[0]}, kept as its recompute checkpoint, "
                    "was written in place after it was taken; the segment cannot be replayed "
                    f"from it: keep or offload {self.names[0]} instead of recomputing it")
            return x
        g, s = self.ck_group, self.ck_slot
        x = g.get(s)
        g.release(s)
        return x

    def _recompute(self):
        r = self.r
        r.trigger(self.pass_, "R:" + self.names[-1])
        x = self._checkpoint()
        dev, ac_on, ac_dtype, ac_cache = self.autocast
        devices = [x.device] if x.device.type == "cuda" else []
        rec: list[list] = []
        inplace = set(r.plan.model.get("inplace_input") or ())
        with contextlib.ExitStack() as st:
            # Leave the RNG as backward found it: plain PyTorch draws nothing in backward.
            st.enter_context(torch.random.fork_rng(devices=devices))
            st.enter_context(torch.enable_grad())
            st.enter_context(torch.autocast(dev, dtype=ac_dtype, enabled=ac_on,
                                            cache_enabled=ac_cache))
            st.enter_context(r.recomputing())
            x = x.requires_grad_(self.ck_requires_grad) if not x.requires_grad else x
            for u, (args, kwargs, loc, rng_cpu, rng_dev, state) in enumerate(self.calls):
                torch.set_rng_state(rng_cpu)
                if rng_dev is not None:
                    torch.cuda.set_rng_state(rng_dev, x.device)
                got: list = []

                def record(t, got=got):
                    got.append(t.detach())
                    return None

                if x.requires_grad and self.names[u] in inplace:
                    # A leaf may not be written in place; in the forward this input was a
                    # non-leaf (the output of the code before), so give the block one again.
                    x = x.clone()
                a, k = r.put_hidden(args, kwargs, loc, x)
                block = r.blocks[self.first + u]
                with saved_tensors_hooks(record, _no_unpack):
                    out = state.replay(lambda: block(*a, **k))
                self._check(u, got)
                rec.append([g if want is not None else None for g, want in zip(got, self.saved[u])])
                for g, want in zip(got, self.saved[u]):
                    if want is not None:
                        r.counters.add("act", g.numel() * g.element_size())
                x = r.hidden_of(out)
                if u + 1 < len(self.calls):
                    x = x.detach().requires_grad_(x.requires_grad)
                del out, got
        self.rec = rec
        self.calls = []   # inputs and RNG states are no longer needed

    def _check(self, u: int, got: list):
        want = self.saved[u]
        name = self.names[u]
        if len(got) != len(want):
            raise RecomputeMismatch(
                f"tierplan: recomputing {name} saved {len(got)} tensors where its forward saved "
                f"{len(want)}; the block does not replay the same way (data-dependent control flow "
                "or a cache?); keep it or offload it instead of recomputing")
        for i, (g, w) in enumerate(zip(got, want)):
            if w is not None and (g.shape != w[0] or g.dtype != w[1]):
                raise RecomputeMismatch(
                    f"tierplan: recomputing {name}: saved tensor {i} is {tuple(g.shape)} "
                    f"{g.dtype}, the forward saved {tuple(w[0])} {w[1]}; the block does not "
                    "replay the same way; keep it or offload it instead of recomputing")

    def discard(self):
        if self.ck is not None:
            self.r.counters.add("act", -self.ck.numel() * self.ck.element_size())
            self.ck = None
        if self.rec:
            for lst in self.rec:
                for t in lst:
                    if t is not None:
                        self.r.counters.add("act", -t.numel() * t.element_size())
        self.rec = None
        self.calls = []

    # A forward dropped without a backward: the graph held the segment (through its
    # placeholders) and frees it with itself; give back what the count still holds.
    __del__ = discard

