"""The zoo through the adversarial-order backend (runtime/transfer/recording.py): every zoo
model (tests/test_zoo.py) under the plan families the runtime executes on a device that is not
host memory, run by the staged path (the code CUDA runs) with every copy deferred and reordered
as late as its waits allow:

* ``bm-host``: batch-major, every block's activations offloaded to the host, the blocks'
  weights, gradients and optimizer state on the host (step on the CPU);
* ``bm-nvme``: the same activations, the blocks' weights and optimizer state on NVMe
  (gradients on the host);
* a block the plan maker keeps on the device (T5's and Whisper's first decoder block, charged
  the decoder's embeddings, which are tied to the head) keeps its home there (ON_DEVICE);
* ``lm-host``: layer-major (``handle.run_micro_batches``), homes and activations as
  ``bm-host``. What a model is refused with, in one line, is REFUSED.
  This family runs with the model in eval mode (dropout off) in both runs: under layer-major
  the micro-batches' random draws interleave in turn order, so masks differ by design
  (docs/runtime.md, "Layer-major").
* ``ov-none`` / ``ov-global``: batch-major with the optimizer beside the backward
  (``optimizer_overlap: overlapped``), homes and activations as ``bm-nvme``: under clip none
  the worker thread steps each block on the CPU during the last micro-batch's backward; under
  clip global (``handle.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` in the
  reference) it reads each block's state ahead and the step runs after the clip. The solver
  labels such plans ``after-backward`` (it prices the overlap only for deeper steps); the same
  decisions are relabelled ``overlapped``, as tests/test_overlap_runtime.py does.
* ``pc-none``: the optimizer paced into the backward (``optimizer_overlap: paced``, clip
  none, one micro-batch a step): the blocks' weights and gradients on the device, their state
  on the host and stepped there; the worker steps each block as its backward ends, the
  backward waits for it three stages on, and the step frees the device gradient (relabelled
  the same way). Its gradients are compared through the weights only (``handle.gradients()``
  refuses a gradient a paced step freed).
* ``lm-ov-none`` / ``lm-ov-global`` / ``lm-pc-none``: the three above under layer-major
  (``handle.run_micro_batches``, eval mode as ``lm-host``): the worker takes a block once
  its backward stage has run every micro-batch, and a paced step of K micro-batches is one
  pass.

Two AdamW steps of two micro-batches each (one under ``pc-none``); both steps' gradients (``handle.gradients()``) and
the final weights and buffers equal plain PyTorch's bit for bit (dropout on in the batch-major
families, the same seed in both runs), no consumer reads before its producer's event
(``be.missing == 0``), the slab has nothing in use and no file is left.

``python tests/test_zoo_adversarial.py`` prints the table model x family -> largest
difference, missing waits.
"""
from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from planner.errors import UserError  # noqa: E402
from planner.formats import Home, Tier as T  # noqa: E402
from test_zoo import B, MODELS, S, factory, loss_of, torchvision_problem  # noqa: E402

K, STEPS = 2, 2
FAMILIES = {
    # name: (micro-batch order, the blocks' home, model mode, the loop's clip or None, the
    #        optimizer overlap the plan is relabelled with or None)
    "bm-host": ("batch-major", Home(T.CPU, T.CPU, T.CPU, T.CPU), "train", None, None),
    "bm-nvme": ("batch-major", Home(T.NVME, T.CPU, T.NVME, T.CPU), "train", None, None),
    "lm-host": ("layer-major", Home(T.CPU, T.CPU, T.CPU, T.CPU), "eval", None, None),
    "ov-none": ("batch-major", Home(T.NVME, T.CPU, T.NVME, T.CPU), "train", "none",
                "overlapped"),
    "ov-global": ("batch-major", Home(T.NVME, T.CPU, T.NVME, T.CPU), "train", "global",
                  "overlapped"),
    "pc-none": ("batch-major", Home(T.GPU, T.GPU, T.CPU, T.CPU), "train", "none", "paced"),
    "lm-ov-none": ("layer-major", Home(T.NVME, T.CPU, T.NVME, T.CPU), "eval", "none",
                   "overlapped"),
    "lm-ov-global": ("layer-major", Home(T.NVME, T.CPU, T.NVME, T.CPU), "eval", "global",
                     "overlapped"),
    "lm-pc-none": ("layer-major", Home(T.GPU, T.GPU, T.CPU, T.CPU), "eval", "none", "paced"),
}
LAYER_MAJOR = [f for f, v in FAMILIES.items() if v[0] == "layer-major"]


def k_of(family) -> int:
    """Micro-batches a step: one under a batch-major paced plan (it needs one pass a step),
    else K (a layer-major step is one pass)."""
    return 1 if family is not None and FAMILIES[family][4] == "paced" and \
        FAMILIES[family][0] == "batch-major" else K
CLIP_NORM = 0.5

# (model, family) -> the text of the one line it is refused with.
REFUSED = {
    # encoder-decoders: the encoder's output, which needs a gradient, is read by every decoder
    # block: not a chain
    **{(m, f): "reaches a block's input another way" for m in ("t5", "whisper")
       for f in LAYER_MAJOR},
    # each recurrent layer keeps its last state on the module (use_cache on): under the turn
    # order micro-batch 2 starts from micro-batch 1's state, one graph across micro-batches
    **{("recurrent_gemma", f): "in micro-batch 2 reaches micro-batch 1's" for f in LAYER_MAJOR},
}
# The blocks whose home stays on the device (every other block's is on the host or NVMe).
EXPECT_ON_DEVICE = {"t5": ["decoder.block.0"], "whisper": ["model.decoder.layers.0"]}


def micro_batches(inputs, k_n=K):
    """``k_n`` different micro-batches from one: integer tensors rolled by k along their last
    dimension (ids and labels together), floating ones shifted by k / 4."""
    def vary(t, k):
        if not isinstance(t, torch.Tensor) or k == 0:
            return t
        if t.is_floating_point():
            return t + k / 4
        return t.roll(k, dims=-1) if t.dim() else t
    if isinstance(inputs, dict):
        return [{n: vary(t, k) for n, t in inputs.items()} for k in range(k_n)]
    return [tuple(vary(t, k) for t in inputs) for k in range(k_n)]


def _call(model, mb):
    return model(**mb) if isinstance(mb, dict) else model(*mb)


def _loss(model, mb, k_n=K):
    return loss_of(_call(model, mb)) / k_n


def _files(path) -> list:
    return [f for _, _, fs in os.walk(path) for f in fs] if os.path.exists(path) else []


def train(name, mode, family=None, nvme=None, clip=None, k_n=K, grads_too=True):
    """Two AdamW steps of ``k_n`` micro-batches: (gradients of each step, or none without
    ``grads_too``, final weights + float buffers, the backend or None); ``clip`` "global": the
    gradients clipped to CLIP_NORM before each step (the handle's clip under a plan)."""
    from runtime import apply_plan
    from runtime.transfer import using
    from runtime.transfer.recording import RecordingBackend
    model, inputs = factory(name)(B, S)
    model.train(mode == "train")
    mbs = micro_batches(inputs, k_n)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    be = handle = None
    if family is not None:
        order, home, _, clip, overlap = FAMILIES[family]
        plan = make_plan_for(name, order, home, nvme, k_n)
        if overlap is not None:
            plan = overlapped(plan, clip, overlap)
        plan.hardware["device"] = "cpu"     # the recording backend is the discrete device
        be = RecordingBackend()
    ctx = using(be) if be is not None else _Null()
    grads = []
    with ctx:
        if be is not None:
            handle = apply_plan(model, plan, optimizer=opt)
        torch.manual_seed(1234)             # dropout: the same draws in both runs
        try:
            for _ in range(STEPS):
                if handle is not None and FAMILIES[family][0] == "layer-major":
                    handle.run_micro_batches(mbs, _loss)
                else:
                    for mb in mbs:
                        _loss(model, mb, k_n).backward()
                if grads_too and handle is not None:
                    g = handle.gradients()
                    grads.append([None if g.get(n) is None else g[n].clone()
                                  for n, _ in model.named_parameters()])
                elif grads_too:
                    grads.append([None if p.grad is None else p.grad.clone()
                                  for p in model.parameters()])
                if clip == "global":
                    if handle is not None:
                        handle.clip_grad_norm_(CLIP_NORM)
                    else:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
                opt.step()
                opt.zero_grad()
            sd = model.state_dict()
            weights = [sd[n].clone() for n, _ in model.named_parameters()]
            buffers = [b.detach().clone() for b in model.buffers() if b.is_floating_point()]
        finally:
            if handle is not None:
                ov = handle._r.overlap
                be.jobs = [k for _, k, _, _ in ov.last_log] if ov is not None else []
                handle.remove()
    return grads, weights + buffers, be


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def make_plan_for(name, order, home, nvme, k_n=K):
    """A plan solved for a discrete GPU (h200) from the model's real profile (taken on a copy
    of the model of its own: the profile's forward moves a BatchNorm's running statistics):
    every block's activations on the host, the blocks' tensors at ``home``, K micro-batches in
    ``order``."""
    import dataclasses

    from planner.costmodel.baselines import baseline_layers
    from planner.formats import Activation, Budgets
    from planner.hardware import load_hardware
    from planner.plans import cost_model, make_plan
    from planner.profile import profile_module
    hw = load_hardware("h200")
    model, inputs = factory(name)(B, S)
    prof = profile_module(model, inputs, name=name, hardware=hw, timing="estimate", batch=B,
                          seq=S)
    budgets = Budgets(hw.memory_bytes, hw.host_memory_bytes or 1 << 40, hw.nvme_bytes)
    cm = cost_model(prof, hw, budgets, k_n, micro_batch_order=order)
    # a block the plan maker keeps on the device (tied weights, or parameters charged to it
    # that code between blocks uses: T5's and Whisper's first decoder block) keeps its home
    # there; its activations still go to the host
    layers = [dataclasses.replace(d, activation=Activation.CPU,
                                  home=home if home in cm.homes[i] else d.home)
              if u.kind == "block" else d
              for i, (d, u) in enumerate(zip(baseline_layers("keep-all", prof.layers, hw),
                                             prof.layers))]
    ON_DEVICE[name] = [u.name for i, u in enumerate(prof.layers)
                       if u.kind == "block" and home not in cm.homes[i]]
    return make_plan(prof, None, hw, budgets, "optimal", layers, nvme_dir=str(nvme),
                     micro_batches=k_n, cm=cm)


ON_DEVICE: dict = {}     # model -> the blocks whose home stays on the device


def overlapped(plan, clip, overlap="overlapped"):
    """The plan's decisions executed with the optimizer beside the backward (``overlap``:
    overlapped or paced) under ``clip``; under clip global every block's state on NVMe may be
    read ahead."""
    import dataclasses
    ahead = sum(u.optimizer_bytes for u, d in zip(plan.units, plan.layers)
                if d.home.optimizer is T.NVME) if clip == "global" else 0
    return dataclasses.replace(plan, optimizer_overlap=overlap, clip=clip,
                               optimizer_prefetch_bytes=ahead)


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    assert all((x is None) == (y is None) for x, y in zip(a, b)), "a gradient is missing"
    return max(((x - y).abs().max().item() for x, y in zip(a, b) if x is not None),
               default=0.0)


def check(name, family, nvme, ref=None) -> dict:
    """One model under one family: {"diff", "missing", "slab", "files"} or {"refused": line}."""
    mode, clip = FAMILIES[family][2:4]
    grads_too = FAMILIES[family][4] != "paced"
    g0, w0, _ = ref or train(name, mode, clip=clip, k_n=k_of(family), grads_too=grads_too)
    try:
        g, w, be = train(name, mode, family, nvme, k_n=k_of(family), grads_too=grads_too)
    except UserError as e:
        return {"refused": str(e)}
    diff = max(max((max_diff(a, b) for a, b in zip(g, g0)), default=0.0), max_diff(w, w0))
    return {"diff": diff, "missing": be.missing, "problems": be.problems[:3],
            "copies": {st for st, op, _ in be.log if op == "copy"},
            "slab": be.slab.in_use, "files": _files(nvme), "jobs": be.jobs}


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", MODELS)
def test_zoo_through_the_adversarial_backend(name, family, tmp_path):
    factory(name)                       # skips what this environment lacks
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = check(name, family, tmp_path / "nvme")
    if (name, family) in REFUSED:
        assert "refused" in got, f"{name} was expected to be refused under {family}"
        msg = got["refused"]
        assert "\n" not in msg and REFUSED[name, family] in msg, msg
        assert "--micro-batch-order batch-major" in msg
        if name == "recurrent_gemma":
            assert "use_cache=False" in msg
        assert _files(tmp_path / "nvme") == []
        return
    assert "refused" not in got, got.get("refused")
    if FAMILIES[family][1].weights is not T.GPU:
        assert ON_DEVICE[name] == EXPECT_ON_DEVICE.get(name, [])
    assert {"h2d", "d2h"} <= got["copies"], got["copies"]     # the staged path ran
    assert got["missing"] == 0, got["problems"]
    assert got["diff"] == 0.0, (name, family, got["diff"])
    assert got["slab"] == 0
    assert got["files"] == []
    clip = FAMILIES[family][3]
    if clip is not None:        # the worker ran the blocks' work of the last step
        assert got["jobs"] and set(got["jobs"]) == {"step" if clip == "none" else "read"}, \
            got["jobs"]


def test_recurrent_gemma_without_its_cache_trains_layer_major(tmp_path, monkeypatch):
    """The fix the refusal names: with ``use_cache=False`` RecurrentGemma keeps no state
    between calls, and layer-major trains it as plain PyTorch does."""
    from examples import hf_models as hf
    factory("recurrent_gemma")
    real = hf.recurrent_gemma

    def no_cache(b, s):
        model, inputs = real(b, s)
        model.config.use_cache = False
        return model, inputs
    monkeypatch.setattr(hf, "recurrent_gemma", no_cache)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = check("recurrent_gemma", "lm-host", tmp_path / "nvme")
    assert "refused" not in got, got.get("refused")
    assert got["missing"] == 0 and got["diff"] == 0.0 and got["files"] == []


def main():
    import tempfile
    print(f"| model | {' | '.join(FAMILIES)} |")
    print("|---|" + "---|" * len(FAMILIES))
    for name in MODELS:
        if name == "resnet18" and torchvision_problem():
            print(f"| {name} | skipped: {torchvision_problem()} |")
            continue
        cells = []
        refs = {}
        for family in FAMILIES:
            key = FAMILIES[family][2:4] + (k_of(family), FAMILIES[family][4] != "paced")
            with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if key not in refs:
                    refs[key] = train(name, key[0], clip=key[1], k_n=key[2], grads_too=key[3])
                try:
                    got = check(name, family, Path(d) / "nvme", refs[key])
                except Exception as e:   # noqa: BLE001 -- the table shows it
                    got = {"refused": f"FAILED {type(e).__name__}: {str(e)[:80]}"}
            if "refused" in got:
                cells.append(f"refused: {got['refused'][:60]}")
            else:
                cells.append(f"{got['diff']:.1e}, {got['missing']} missing")
        print(f"| {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
