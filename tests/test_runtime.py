"""The runtime replays plans exactly: gradients and weights equal plain PyTorch, nothing left
behind, mismatches refused with one line."""
from __future__ import annotations

import gc
import json
import statistics
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import plan_for
from planner.models import build_model, load_config, make_inputs
from runtime import (InputTooLargeError, PlanMismatchError, RecomputeMismatch,
                     UnsupportedModelError, apply_plan)
from runtime.apply import _Runner
from runtime.offload import Group

REPO = Path(__file__).resolve().parents[1]
B, S, LAYERS = 2, 16, 5
# Every decision kind in one plan: keep, a two-unit segment checkpointed on NVMe, NVMe offload,
# recompute with the checkpoint on the compute device.
MIXED = [("keep", None), ("recompute", "nvme"), ("recompute", "none"), ("nvme", None),
         ("recompute", "gpu")]


def _builtin(name):
    def make():
        cfg = dict(load_config(name), n_layers=LAYERS, dtype="fp32")
        m = build_model(cfg, dtype="fp32")
        batches = [make_inputs(cfg, B, S, seed=k) for k in range(2)]
        return m, batches
    return make


def _hf(fname):
    def make():
        from examples import hf_models
        m, inputs = getattr(hf_models, fname)(B, S, n_layer=LAYERS)
        m.config.use_cache = False
        g = torch.Generator().manual_seed(5)
        ids = torch.randint(0, hf_models.VOCAB, (B, S), generator=g)
        return m, [inputs, {"input_ids": ids, "labels": ids.clone()}]
    return make


MODELS = {"gpt-tiny": _builtin("gpt-tiny"), "llama-tiny": _builtin("llama-tiny"),
          "hf-gpt2": _hf("gpt2"), "hf-llama": _hf("llama")}
POLICIES = {"keep-all": "keep-all", "recompute-all": "recompute-all", "sqrt": "sqrt",
            "offload-all": "offload-all", "mixed": MIXED}


def _train(make, layers, nvme_dir, steps=2, eval_between=True):
    """Two AdamW steps (dropout on, an eval forward under no_grad in between); returns the
    gradients of every step and the final weights."""
    model, batches = make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = apply_plan(model, plan_for(model, layers, B, S, nvme_dir=nvme_dir)) if layers else None
    torch.manual_seed(1234)
    grads = []
    for k in range(steps):
        loss = model(**batches[k % len(batches)]).loss
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        if eval_between:
            with torch.no_grad():
                model(**batches[0])
    weights = [p.detach().clone() for p in model.parameters()]
    report = handle.report() if handle else None
    if handle:
        handle.remove()
    return grads, weights, report


def _maxdiff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def _bins(d: Path):
    """The files under ``d`` but the runtime directory's own markers (who made it, what it
    made: runtime/files.py), which live as long as the directory."""
    from runtime.files import MANIFEST, OWNER
    return sorted(p for p in d.rglob("*") if p.is_file() and p.name not in (OWNER, MANIFEST))


def test_views_of_one_storage_move_once_and_come_back_laid_out_as_saved(tmp_path):
    """A projection and two slices of it (Mamba's in_proj split into parts), a slice of
    another, and a transposed view go to NVMe and come back laid out as they were saved: the
    views of one storage at their places in one buffer (same strides, same distances apart),
    each storage's saved bytes moved once. Made dense one by one, slices were read with
    another leading dimension and kernels summed in another order (Zamba2's gradients 2e-6
    off plain PyTorch's after one step), and a tensor with slices of it saved beside it moved
    twice (a Jamba Mamba layer moved 837 KB of the 701 KB its profile counts). Conjugate and
    negative views keep their bits; a group of empty tensors deletes its file."""
    from runtime.offload import Counters, Mover
    counters = Counters()
    mover = Mover(torch.device("cpu"), str(tmp_path), counters)
    g = Group(mover, "nvme", "u")
    proj = torch.randn(2, 16, 280)
    other = torch.randn(4, 100)
    tr = torch.randn(8, 4).t()
    saved = (proj, proj[..., :128], proj[..., 128:200], other[:, 10:20], tr)
    views = [g.put(t) for t in saved]
    # held: all of proj, other's bytes from the 64-byte line before its slice's first to its
    # last, and the transposed view
    held = proj.numel() * 4 + (3 * 100 + 20) * 4 + tr.numel() * 4
    assert counters.act == held
    g.send(*g.span(0.0, 1.0))
    g.wait()
    assert counters.act == 0 and g.size == held
    assert counters.moved["nvme_write"] == held
    g.fetch(*g.span(0.0, 1.0))
    got = [g.get(v) for v in views]
    for t, x in zip(saved, got):
        assert torch.equal(t, x) and x.stride() == t.stride() and x.shape == t.shape
    p0, pa, pb = got[:3]
    assert pa.untyped_storage().data_ptr() == p0.untyped_storage().data_ptr() == \
        pb.untyped_storage().data_ptr()
    assert (pa.storage_offset() - p0.storage_offset(), pb.storage_offset() - pa.storage_offset()) \
        == (0, 128)
    assert counters.act == held
    assert g.get(views[1]).data_ptr() == pa.data_ptr()     # unpacked again: the same bytes
    for v in views:
        g.release(v)
    assert counters.act == 0
    # a lazily conjugated or negated view (``x.conj()`` of a complex activation) reads its
    # storage conjugated: it comes back so, beside the plain view of the same bytes
    g = Group(mover, "nvme", "c")
    c = torch.randn(4, 3, dtype=torch.complex64)
    saved = (c, c.conj(), torch._neg_view(c), torch.empty(0, 5))
    views = [g.put(t) for t in saved]
    assert g.size == 0 and len(g.slots) == 1
    g.send(*g.span(0.0, 1.0))
    g.wait()
    g.fetch(*g.span(0.0, 1.0))
    for t, v in zip(saved, views):
        x = g.get(v)
        assert torch.equal(x, t) and (x.is_conj(), x.is_neg(), x.shape) == \
            (t.is_conj(), t.is_neg(), t.shape)
        g.release(v)
    # read back: the file is kept for the next group of its label (``NvmeStore.recycle``)
    assert counters.act == 0 and mover.store.spare["c"] == [g.path]
    # a group of nothing but empty tensors keeps its file too
    g = Group(mover, "nvme", "e")
    v = g.put(torch.empty(0, 5))
    assert g.get(v).shape == (0, 5)
    g.release(v)
    assert mover.store.spare["e"] == [g.path]
    paths = [p for ps in mover.store.spare.values() for p in ps]
    mover.close()
    assert not any(Path(p).exists() for p in paths)


def test_a_read_back_file_is_written_again_by_the_next_group_of_its_unit(tmp_path):
    """Overwriting a file's blocks is cheaper than allocating new ones (O_DIRECT into a fresh
    file ran at 1.3-1.5 GB/s against 2.0-2.3 overwriting on the development host, and each
    delete cost 0.4 ms on the training thread), so a group read back leaves its file to the
    next group of the same unit. That group may be larger or smaller: what it reads is what
    it wrote (the checksums say so), never the older bytes past its end; another unit's
    group never gets it; and closing the store deletes them all."""
    from runtime.offload import Counters, Mover
    mover = Mover(torch.device("cpu"), str(tmp_path), Counters())

    def round_trip(label, n):
        g = Group(mover, "nvme", label)
        t = torch.randn(n)
        v = g.put(t)
        g.send(*g.span(0.0, 1.0))
        g.wait()
        g.fetch(*g.span(0.0, 1.0))
        assert torch.equal(g.get(v), t)
        g.release(v)
        return g.path

    first = round_trip("blocks.0", 300_000)
    other = round_trip("blocks.1", 300_000)
    assert other != first
    assert round_trip("blocks.0", 1000) == first            # smaller: its own bytes only
    assert round_trip("blocks.0", 700_000) == first         # larger: the file grows
    made = sorted(p.name for p in _bins(tmp_path))
    assert made == sorted(Path(p).name for p in (first, other))
    # two groups of one unit alive at once (two forwards before a backward): two files
    a, b = Group(mover, "nvme", "blocks.0"), Group(mover, "nvme", "blocks.0")
    assert {a.path, b.path} - {first} and first in (a.path, b.path)
    for g in (a, b):
        g.discard()                                          # dropped: deleted, not kept
    assert not Path(a.path).exists() and not Path(b.path).exists()
    # the files kept take no more of the disk than was free beyond the plan's need when the
    # store was prepared (spare_room): past it, a file read back is deleted
    store = mover.store
    assert store.kept_bytes == store.kept[other] >= 300_000 * 4
    store.spare_room = store.kept_bytes + 4096
    third = round_trip("blocks.2", 300_000)
    assert not Path(third).exists() and third not in store.kept
    assert store.spare["blocks.1"] == [other]
    mover.close()
    assert _bins(tmp_path) == [] and store.kept_bytes == 0


@pytest.mark.parametrize("model_name", list(MODELS))
def test_gradients_and_weights_equal_plain_pytorch(model_name, tmp_path):
    make = MODELS[model_name]
    g0, w0, _ = _train(make, None, None)
    nvme = tmp_path / "nvme"     # does not exist: the runtime creates it and removes it again
    for pname, layers in POLICIES.items():
        g, w, rep = _train(make, layers, nvme)
        for k in range(2):
            assert _maxdiff(g[k], g0[k]) <= 1e-6, (model_name, pname, k)
        assert _maxdiff(w, w0) <= 1e-6, (model_name, pname)
        assert len(rep.steps) == 2
        assert not nvme.exists(), (pname, list(nvme.rglob("*")))
        if pname in ("offload-all", "mixed"):
            st = rep.steps[-1]
            # Every byte written came back, and only what the runtime moved is counted.
            assert st.moved["nvme_write"] == st.moved["nvme_read"] > 0
            assert st.moved["d2h"] == st.moved["h2d"] == 0


def test_bf16_autocast_recompute_and_offload_match(tmp_path):
    make = MODELS["llama-tiny"]

    def run(layers):
        model, batches = make()
        h = apply_plan(model, plan_for(model, layers, B, S, nvme_dir=tmp_path)) if layers else None
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batches[0]).loss
        loss.backward()
        out = [p.grad.clone() for p in model.parameters()]
        if h:
            h.remove()
        return out

    g0 = run(None)
    assert _maxdiff(run("recompute-all"), g0) <= 1e-6
    assert _maxdiff(run(MIXED), g0) <= 1e-6


def test_gradient_accumulation_and_short_last_batch_keep_parity(tmp_path):
    cfg = dict(load_config("gpt-tiny"), n_layers=LAYERS, dtype="fp32")
    data = [make_inputs(cfg, 2, S, seed=1), make_inputs(cfg, 2, S, seed=2),
            make_inputs(cfg, 1, S - 5, seed=3)]        # the last batch is short in both ways

    def run(layers):
        model = build_model(cfg, dtype="fp32")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        h = apply_plan(model, plan_for(model, layers, 2, S, nvme_dir=tmp_path)) if layers else None
        torch.manual_seed(3)
        for inp in data[:2]:                  # two micro-batches, one optimizer step
            (model(**inp).loss / 2).backward()
        opt.step()
        opt.zero_grad()
        model(**data[2]).loss.backward()      # the short last batch
        grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        steps = len(h.report().steps) if h else None
        if h:
            h.remove()
        return grads, [p.detach().clone() for p in model.parameters()], steps

    g0, w0, _ = run(None)
    for layers in ("sqrt", MIXED):
        g, w, steps = run(layers)
        assert _maxdiff(g, g0) <= 1e-6 and _maxdiff(w, w0) <= 1e-6
        assert steps == 2


# ----------------------------------------------------------------------------- refusals

def test_plan_for_other_depth_or_model_is_refused():
    gpt = build_model(dict(load_config("gpt-tiny"), n_layers=3), dtype="fp32")
    deeper = build_model(dict(load_config("gpt-tiny"), n_layers=4), dtype="fp32")
    llama = build_model(dict(load_config("llama-tiny"), n_layers=3), dtype="fp32")
    with pytest.raises(PlanMismatchError,
                       match="is for 4 blocks .* but the model has no module 'blocks.3'") as e:
        apply_plan(gpt, plan_for(deeper, "keep-all", B, S))
    assert "\n" not in str(e.value)
    with pytest.raises(PlanMismatchError, match="structure hash") as e:
        apply_plan(gpt, plan_for(llama, "keep-all", B, S))
    assert "\n" not in str(e.value)
    assert isinstance(e.value, ValueError)


def test_larger_input_refused_before_any_block_runs():
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    model = build_model(cfg, dtype="fp32")
    h = apply_plan(model, plan_for(model, "recompute-all", B, S))
    ran = []
    hooks = [b.register_forward_pre_hook(lambda m, a: ran.append(1)) for b in model.blocks]
    for b, s in ((B + 1, S), (B, S + 1)):
        with pytest.raises(InputTooLargeError, match=f"batch {b} x seq {s}, larger than") as e:
            model(**make_inputs(cfg, b, s))
        assert "\n" not in str(e.value)
    assert ran == []
    model(**make_inputs(cfg, B - 1, S - 3)).loss.backward()    # smaller runs
    # each block ran once forward and once recomputed (its hooks run again, as under
    # torch.utils.checkpoint)
    assert len(ran) == 2 * cfg["n_layers"]
    with torch.no_grad():                                       # no hooks act without grad
        model(**make_inputs(cfg, B + 1, S))
    for k in hooks:
        k.remove()
    h.remove()


def test_unsupported_wrappers_are_refused():
    from examples.hf_models import gpt2
    model = build_model("gpt-tiny", dtype="fp32")
    plan = plan_for(model, "keep-all", B, S)
    with pytest.raises(UnsupportedModelError, match="torch.compile"):
        apply_plan(torch.compile(model), plan)
    with pytest.raises(UnsupportedModelError, match="DataParallel"):
        apply_plan(torch.nn.DataParallel(model), plan)
    hf, _ = gpt2(B, S)
    hf.gradient_checkpointing_enable()
    with pytest.raises(UnsupportedModelError, match="gradient checkpointing"):
        apply_plan(hf, plan_for(hf, "keep-all", B, S))
    h = apply_plan(model, plan)
    with pytest.raises(PlanMismatchError, match="already applied"):
        apply_plan(model, plan)
    h.remove()


def test_recompute_that_does_not_replay_is_caught():
    class Flaky(torch.nn.Module):
        """Saves a different number of tensors on its second call (not replayable)."""

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            y = self.lin(x)
            return y.tanh() * y.sigmoid() if self.calls == 2 else y.tanh()

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Linear(8, 8)
            self.blocks = torch.nn.ModuleList([Flaky(), Flaky()])
            self.out = torch.nn.Linear(8, 1)

        def forward(self, x):
            x = self.emb(x)
            for b in self.blocks:
                x = b(x)
            return self.out(x).sum()

    net = Net()
    h = apply_plan(net, plan_for(net, "recompute-all", 4, 8))
    with pytest.raises(RecomputeMismatch, match="recomputing blocks.1 saved"):
        net(torch.randn(4, 8, 8)).backward()
    h.remove()


def test_remove_leaves_the_model_as_it_was(tmp_path):
    from examples.hf_models import llama
    model, inputs = llama(B, S)
    model.config.use_cache = False

    def snapshot(m):
        return [(n, sorted(mod.__dict__), len(mod._forward_hooks), len(mod._forward_pre_hooks),
                 len(mod._backward_hooks)) for n, mod in m.named_modules()]

    before = snapshot(model)
    torch.manual_seed(0)
    ref = model(**inputs).loss.item()
    h = apply_plan(model, plan_for(model, "offload-all", B, S, nvme_dir=tmp_path / "x"))
    model(**inputs).loss.backward()
    h.remove()
    assert snapshot(model) == before
    torch.manual_seed(0)
    assert model(**inputs).loss.item() == ref
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------- files

def test_existing_nvme_dir_left_exactly_as_found(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    model = build_model(cfg, dtype="fp32")
    h = apply_plan(model, plan_for(model, "offload-all", B, S, nvme_dir=tmp_path))
    model(**make_inputs(cfg, B, S)).loss.backward()
    # read back: the files left are kept for the next step's groups (in the runtime's own
    # folder), and go with the handle
    store = h._r.mover.store
    spare = sorted(Path(p) for ps in store.spare.values() for p in ps)
    assert spare and [p for p in _bins(tmp_path) if p.suffix == ".bin"] == spare
    # within what apply_plan found free beyond the plan's NVMe need
    assert store.spare_room is not None and 0 < store.kept_bytes <= store.spare_room
    h.remove()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_no_file_left_after_exception_inside_a_block(tmp_path):
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    model = build_model(cfg, dtype="fp32")
    h = apply_plan(model, plan_for(model, MIXED[:3], B, S, nvme_dir=tmp_path / "n"))

    def boom(mod, args):
        raise RuntimeError("boom")
    k = model.blocks[2].register_forward_pre_hook(boom)
    with pytest.raises(RuntimeError, match="boom"):
        model(**make_inputs(cfg, B, S))
    assert [p for p in _bins(tmp_path)] == []
    k.remove()
    model(**make_inputs(cfg, B, S)).loss.backward()   # still usable afterwards
    h.remove()
    assert not (tmp_path / "n").exists()


def test_dropped_forward_deletes_its_files_with_its_graph(tmp_path):
    """A forward with gradients whose output is dropped without a backward (a validation loss
    computed with grad on): its files live exactly as long as its autograd graph. Training
    afterwards (two forwards, one backward of the summed loss, then a plain step) keeps parity."""
    cfg = dict(load_config("gpt-tiny"), n_layers=LAYERS, dtype="fp32")
    val, data = make_inputs(cfg, B, S, seed=9), [make_inputs(cfg, B, S, seed=k) for k in (1, 2)]
    nvme = tmp_path / "n"

    def run(layers, n_files):
        model = build_model(cfg, dtype="fp32")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        h = apply_plan(model, plan_for(model, layers, B, S, nvme_dir=nvme)) if layers else None
        torch.manual_seed(11)
        for _ in range(3):
            out = model(**val)
            if h:
                assert len(_bins(nvme)) == n_files    # one per offloaded unit while it lives
            del out
            gc.collect()
            if h:
                assert _bins(nvme) == []
                c = h._r.counters
                assert (c.act, c.nvme) == (0, 0)      # nothing counted as resident either
        (model(**data[0]).loss + model(**data[1]).loss).backward()
        opt.step()
        opt.zero_grad()
        model(**data[0]).loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        if h:
            # read back: what is left is the files kept for the next groups of their units,
            # two per unit (two forwards were alive at once), nothing counted as resident
            spare = sorted(Path(p) for ps in h._r.mover.store.spare.values() for p in ps)
            assert _bins(nvme) == spare and len(spare) == 2 * n_files
            assert (h._r.counters.act, h._r.counters.nvme) == (0, 0)
            h.remove()
            assert not nvme.exists()
        return grads

    g0 = run(None, 0)
    # offload-all: 5 unit files; MIXED: blocks.1's checkpoint and blocks.3's activations.
    for layers, n_files in (("offload-all", LAYERS), (MIXED, 2)):
        assert _maxdiff(run(layers, n_files), g0) <= 1e-6, layers


def test_every_stage_runs_once_in_order_however_the_backward_starts(tmp_path, monkeypatch):
    """The stage barrier is entered for each stage of a pass exactly once, in order, whether
    the backward starts at the model's loss, at a loss the user computes from the logits,
    with two forwards before one backward, or from an output the runtime cannot look into;
    gradients equal plain PyTorch's every time."""
    from runtime.stages import StageDriver
    cfg = dict(load_config("gpt-tiny"), n_layers=LAYERS, dtype="fp32")
    data = [make_inputs(cfg, B, S, seed=k) for k in (1, 2)]
    entered = []
    real_enter = StageDriver.enter

    def enter(self, stage):
        before = self.stage
        real_enter(self, stage)
        if self.stage is not None and self.stage != before:
            start = 0 if before is None else before + 1
            entered.extend(range(start, self.stage + 1))
    monkeypatch.setattr(StageDriver, "enter", enter)

    class Opaque:
        """An output the runtime cannot look into (no tensor, tuple, mapping or dataclass)."""

        def __init__(self, out):
            self.out = out

    def run(mode, planned):
        model = build_model(cfg, dtype="fp32")
        if mode == "opaque":
            model.forward = lambda **kw: Opaque(type(model).forward(model, **kw))
        h = apply_plan(model, plan_for(model, "offload-all", B, S, nvme_dir=tmp_path / "n")) \
            if planned else None
        entered.clear()
        torch.manual_seed(3)
        if mode == "accumulate":          # two forwards, one backward of the summed loss
            outs = [model(**d) for d in data]
            loss = outs[0].loss + outs[1].loss
        elif mode == "outside":           # the loss is computed from the logits by the user
            out = model(input_ids=data[0]["input_ids"])
            loss = torch.nn.functional.cross_entropy(
                out.logits.view(-1, cfg["vocab_size"]), data[0]["labels"].reshape(-1))
        else:
            out = model(**data[0])
            loss = (out.out if mode == "opaque" else out).loss
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        stages = list(entered)
        if h:
            h.remove()
        return grads, stages

    U = LAYERS + 2
    for mode in ("model", "outside", "accumulate", "opaque"):
        g0, _ = run(mode, False)
        g, stages = run(mode, True)
        assert _maxdiff(g, g0) <= 1e-6, mode
        passes = 2 if mode == "accumulate" else 1
        # each pass: stages 0..2U once, in order (a later forward finishes the pass before it
        # when the two share one backward)
        assert sorted(stages) == sorted(list(range(0, 2 * U + 1)) * passes), mode
        assert stages[:U + 1] == list(range(U + 1)), mode


# ----------------------------------------------------------------------------- report

def test_more_passes_a_step_than_the_plan_was_solved_for_is_said_once(tmp_path):
    """A --micro-batches 1 plan run with two backward passes a step: its predictions no longer
    hold, and the runtime says so once (the report records the passes)."""
    import warnings as w
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    model = build_model(cfg, dtype="fp32")
    opt = torch.optim.AdamW(model.parameters())
    h = apply_plan(model, plan_for(model, "offload-all", B, S, nvme_dir=tmp_path / "n"))
    with w.catch_warnings(record=True) as got:
        w.simplefilter("always")
        model(**make_inputs(cfg, B, S, seed=0)).loss.backward()
        opt.step()
        opt.zero_grad()
        assert not [x for x in got if "micro-batches" in str(x.message)]
        for step in range(2):
            for k in range(2):
                model(**make_inputs(cfg, B, S, seed=k)).loss.backward()
            opt.step()
            opt.zero_grad()
    said = [x for x in got if "micro-batches" in str(x.message)]
    h.remove()
    assert len(said) == 1 and "ran 2 forward pass(es) with gradients" in str(said[0].message)
    assert [s.passes for s in h.report().steps] == [1, 2, 2]


def test_gradients_kept_into_the_next_forward_are_said_once(tmp_path):
    """With --micro-batches 1 the plan counts a gradient from its unit's backward to the
    optimizer step; a loop that keeps gradients alive into the next forward
    (``zero_grad(set_to_none=False)``) holds more than that, and the runtime says so once.
    The default ``zero_grad()`` says nothing."""
    import warnings as w
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    for keep, expected in ((False, 0), (True, 1)):
        model = build_model(cfg, dtype="fp32")
        opt = torch.optim.AdamW(model.parameters())
        h = apply_plan(model, plan_for(model, "offload-all", B, S, nvme_dir=tmp_path / str(keep)))
        with w.catch_warnings(record=True) as got:
            w.simplefilter("always")
            for k in range(3):
                model(**make_inputs(cfg, B, S, seed=k)).loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=not keep)
        h.remove()
        said = [x for x in got if "gradients exist as a step's forward starts" in str(x.message)]
        assert len(said) == expected, keep

def test_report_counts_and_saves(tmp_path):
    from planner.formats.report import load_report
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    model = build_model(cfg, dtype="fp32")
    plan = plan_for(model, "offload-all", B, S, nvme_dir=tmp_path / "n")
    opt = torch.optim.AdamW(model.parameters())
    h = apply_plan(model, plan)
    for k in range(3):
        model(**make_inputs(cfg, B, S, seed=k)).loss.backward()
        opt.step()
        opt.zero_grad()
    rep = h.report()
    h.remove()
    assert len(rep.steps) == 3 and all(s.passes == 1 for s in rep.steps)
    st = rep.steps[-1]
    assert st.peak_nvme_bytes == st.moved["nvme_write"] == st.moved["nvme_read"] > 0
    assert st.peak_gpu_bytes is not None and st.step_s > 0
    # static state before step 2: fp32 params + AdamW's two moments (+ step counters)
    n = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    assert 12 * n <= st.static_bytes <= 12 * n + 4 * 64
    path = rep.save(tmp_path / "r.json")
    back = load_report(path)
    assert back.measured.steps == 2 and back.predicted_moved["nvme_write"] > 0
    assert json.loads(path.read_text())["schema"] == "tierplan.report/1"
    text = str(rep)
    assert "peak RSS rise" in text
    # where the time went: the passes and the phase after them add up to the step, beside
    # the plan's figures, and each disk link's busy time with its rate
    rows = [ln.strip() for ln in text.splitlines()]
    assert any(r.startswith("passes (to the last backward)") for r in rows)
    assert any(r.startswith("optimizer phase (after it)") for r in rows)
    after = back.after_backward_s()
    passes = statistics.median(s.step_s - s.after_backward_s for s in rep.steps[1:])
    assert after is not None and after + passes == pytest.approx(back.measured.step_s, rel=0.2)
    assert any(ln.strip().startswith("busy nvme_write per step (") for ln in text.splitlines())


def test_keep_runs_unhooked_and_counts_the_plans_bytes():
    """A kept block runs with no saved-tensor hook (it would only cost time); the report counts
    the plan's A_i per kept block from its forward until its backward has run."""
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    model = build_model(cfg, dtype="fp32")
    plan = plan_for(model, "keep-all", B, S)
    a_blocks = [u.activation_bytes for u in plan.units if u.kind == "block"]
    opt = torch.optim.AdamW(model.parameters())
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**make_inputs(cfg, B, S)).loss
    plain, packed[:] = len(packed), []
    h = apply_plan(model, plan)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**make_inputs(cfg, B, S)).loss
    # The outer hook saw every saved tensor, the blocks' included: no runtime hook took them.
    assert len(packed) == plain > 0
    loss.backward()
    opt.step()
    st = h.report().steps[-1]
    assert st.peak_activation_bytes == sum(a_blocks) > 0
    assert h._r.counters.act == 0    # every kept block's count released by its backward
    h.remove()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_host_and_nvme_offload_match(tmp_path):
    cfg = dict(load_config("gpt-tiny"), n_layers=LAYERS, dtype="fp32")

    def run(layers):
        model = build_model(cfg, dtype="fp32", device="cuda")
        h = None
        if layers:
            h = apply_plan(model, plan_for(model, layers, B, S, hardware="h200",
                                           nvme_dir=tmp_path / "n"))
        torch.manual_seed(0)
        inp = make_inputs(cfg, B, S, device="cuda")
        model(**inp).loss.backward()
        g = [p.grad.clone() for p in model.parameters()]
        if h:
            h.remove()
        return g

    g0 = run(None)
    mixed = [("cpu", None), ("recompute", "cpu"), ("recompute", "none"), ("nvme", None),
             ("recompute", "nvme")]
    for layers in ("offload-all", "recompute-all", mixed):
        assert _maxdiff(run(layers), g0) <= 1e-6
    assert not (tmp_path / "n").exists()



def test_plan_of_another_precision_warns_but_runs():
    """A plan profiled in fp32 on a bf16 model: same structure, other bytes — warned, not refused."""
    import warnings
    model, batches = _builtin("gpt-tiny")()
    plan = plan_for(model, "keep-all", B, S)
    model.to(torch.bfloat16)
    with pytest.warns(UserWarning, match="profiled in fp32 but the model's blocks hold bfloat16"):
        h = apply_plan(model, plan)
    model(**batches[0]).loss.backward()
    h.remove()
    same, _ = _builtin("gpt-tiny")()
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the matching precision says nothing
        apply_plan(same, plan).remove()


def test_a_cpu_plan_computes_with_the_threads_its_profile_was_timed_with(tmp_path):
    """The profile records the intra-op threads its times were measured with; under the plan
    a CPU model computes with as many (the report says so) and ``remove()`` puts torch's count
    back. A profile on meta records none, and its plan leaves the count alone."""
    from planner.cli import main
    from runtime import apply_plan
    was = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
        assert main(["profile", "gpt-tiny", "--batch", "2", "--seq", "16", "--dtype", "fp32",
                     "--device", "cpu",
                     "--compute-threads", "1", "--repeats", "1", "-o", str(prof)]) == 0
        assert json.loads(prof.read_text())["model"]["compute_threads"] == 1
        assert main(["solve", str(prof), "--gpu-mem", "1G", "-o", str(plan)]) == 0
        assert json.loads(plan.read_text())["executor"]["compute_threads"] == 1
        model = build_model("gpt-tiny", "fp32", "cpu")
        inputs = make_inputs(load_config("gpt-tiny"), 2, 16, "cpu")
        handle = apply_plan(model, str(plan))
        assert torch.get_num_threads() == 1
        model(**inputs).loss.backward()
        assert handle.report().compute_threads == 1
        handle.remove()
        assert torch.get_num_threads() == 2
        meta, mplan = tmp_path / "m.json", tmp_path / "mplan.json"
        assert main(["profile", "gpt-tiny", "--batch", "2", "--seq", "16", "--dtype", "fp32",
                     "-o", str(meta)]) == 0
        assert "compute_threads" not in json.loads(meta.read_text())["model"]
        assert main(["solve", str(meta), "--gpu-mem", "1G", "-o", str(mplan)]) == 0
        with apply_plan(build_model("gpt-tiny", "fp32", "cpu"), str(mplan)):
            assert torch.get_num_threads() == 2
        # a count beyond the cores this process may use (an edited plan, or a profile from a
        # larger host) computes with those cores, said once (torch's pool at 100000 threads
        # crashed the process); so does a model built on the meta device and loaded from a
        # checkpoint, whose device is known only inside apply_plan
        cores = len(os.sched_getaffinity(0))
        d = json.loads(plan.read_text())
        d["executor"]["compute_threads"] = 100000
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(d))
        with pytest.warns(UserWarning, match=f"computed with 100000 threads.*computing with {cores}"):
            with apply_plan(build_model("gpt-tiny", "fp32", "cpu"), str(bad)) as h:
                assert torch.get_num_threads() == cores and h.report().compute_threads == cores
        assert torch.get_num_threads() == 2
        # and disk requests whose bounce buffers would pass 1 GiB are refused when read
        d["executor"].update(compute_threads=1, io_request_bytes=2**30, io_in_flight=1024)
        bad.write_text(json.dumps(d))
        from planner.formats import UserError, load_plan
        with pytest.raises(UserError, match="io_in_flight must be at most 1 GiB"):
            load_plan(bad)
    finally:
        torch.set_num_threads(was)
