"""Replay under keep-all is plain PyTorch, kernel by kernel: the same ATen operations in the
same order with bit-identical outputs, on the training thread alone, with torch's thread count
untouched.

Bit-identical training rests on this: a kernel's reduction order depends only on its inputs,
its shapes and the number of intra-op threads, so a runtime that adds no operation, starts no
thread that computes, and leaves ``torch.get_num_threads()`` alone cannot change a result. The
test records every operation the dispatcher runs (a ``TorchDispatchMode``: name and a digest of
each floating-point output) for two AdamW steps of a Hugging Face BERT with dropout on, plain
and under its keep-all plan, and compares the two logs. ``bench/determinism.py`` is the long
form: the whole zoo, round after round, beside busy processes.
"""
from __future__ import annotations

import copy
import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_zoo as tz  # noqa: E402


class _Record(TorchDispatchMode):
    """Every operation's name and a digest of its floating-point outputs (``empty*`` left out:
    their bytes are whatever the allocator hands back)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if "empty" not in name:
            digests = tuple(
                hashlib.blake2b(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy()
                                .tobytes(), digest_size=8).hexdigest()
                for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel())
            self.log.append((name, digests))
        return out


def _tasks() -> set[str]:
    return set(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else set()


def _two_steps(model, inputs, plan=None):
    from runtime import apply_plan
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = apply_plan(model, plan, optimizer=opt) if plan is not None else None
    threads, tasks, pythons = torch.get_num_threads(), _tasks(), threading.active_count()
    torch.manual_seed(1234)
    with _Record() as rec:
        for _ in range(2):
            tz.loss_of(model(**inputs)).backward()
            opt.step()
            opt.zero_grad()
    after = (torch.get_num_threads(), _tasks() - tasks, threading.active_count())
    if handle is not None:
        handle.remove()
    return rec.log, (threads, set(), pythons), after


def test_keep_all_replay_runs_exactly_plain_pytorchs_kernels():
    from conftest import plan_for
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # transformers' config chatter
        model0, inputs = tz.factory("bert")(2, 32)
        plan = plan_for(copy.deepcopy(model0), "keep-all", 2, 32, inputs=inputs)
        plain, _, _ = _two_steps(copy.deepcopy(model0), inputs)
        replay, before, after = _two_steps(copy.deepcopy(model0), inputs, plan)
    assert after == before, "the replay changed torch's thread count or started a thread"
    assert len(replay) == len(plain), "the replay ran operations plain PyTorch does not"
    diff = next((i for i, (a, b) in enumerate(zip(plain, replay)) if a != b), None)
    assert diff is None, f"operation {diff} differs: {plain[diff][0]} vs {replay[diff][0]}"
