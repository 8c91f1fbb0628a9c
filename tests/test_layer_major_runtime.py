"""Layer-major plans executed (``handle.run_micro_batches``): every micro-batch of a step goes
through a unit before the next, so a streamed unit's weights are read once per step and
direction, and the weights after three AdamW steps are those of plain PyTorch's batch-major
loop, bit for bit (tied embeddings included), with nothing left on disk.

The models have dropout off: under layer-major the micro-batches' random draws interleave in
the turn order, not the plain loop's, so masks differ (docs/runtime.md, "Layer-major").
"""
from __future__ import annotations

import copy
import dataclasses
import os
import threading

import pytest
import torch

from planner.costmodel.baselines import baseline_layers
from planner.errors import UserError
from planner.formats import Budgets
from planner.hardware import load_hardware
from planner.models import build_model, load_config, make_inputs
from planner.plans import cost_model, plan_and_sim
from planner.profile import profile_module
from planner.solve import solve_profile
from planner.solve.strategies import stream_all_layers
from runtime import apply_plan
from runtime import streaming

pytestmark = pytest.mark.slow

B, S, K, STEPS = 2, 16, 2, 3
HW = load_hardware("cpu-host")


def _builtin(name):
    def build():
        cfg = dict(load_config(name), dtype="fp32", n_layers=16, vocab_size=64, dropout=0.0)
        torch.manual_seed(0)
        model = build_model(cfg, dtype="fp32")
        return model, [make_inputs(cfg, B, S, seed=k) for k in range(STEPS * K)]
    return build


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=16, n_embd=64, n_head=4, vocab_size=64, n_positions=64,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg)
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(STEPS * K):
        ids = torch.randint(0, 64, (B, S), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    return model, data


MODELS = {"gpt-tiny": _builtin("gpt-tiny"), "llama-tiny": _builtin("llama-tiny"),
          "hf-gpt2": _hf_gpt2}


def _static(prof) -> int:
    return sum(u.param_bytes + u.grad_bytes + u.optimizer_bytes for u in prof.layers)


def _plans(model, data, acts, nvme):
    """(batch-major, layer-major) plans of the same decisions, the GPU budget a quarter of the
    static state: ``solve`` is the solver's layer-major plan (it offloads activations to NVMe
    and streams); a policy name streams every block with that activation policy."""
    prof = profile_module(model, data[0], name="lm", hardware=HW, timing="estimate", batch=B,
                          seq=S)
    gpu = _static(prof) // 4
    budgets = Budgets(gpu, 0, 1 << 30)
    if acts == "solve":
        lm = solve_profile(prof, None, HW, budgets, "optimal", time_limit=20, nvme_dir=nvme,
                           micro_batches=K, micro_batch_order="layer-major").plan
        layers = lm.layers
    else:
        cm = cost_model(prof, HW, budgets, K, micro_batch_order="layer-major")
        layers = stream_all_layers(cm, baseline_layers(acts, prof.layers, HW))
    out = []
    for order in ("batch-major", "layer-major"):
        cm = cost_model(prof, HW, budgets, K, micro_batch_order=order)
        out.append(plan_and_sim(prof, None, HW, budgets, acts, layers, nvme_dir=nvme, cm=cm)[0])
    bm, lm = out
    assert lm.micro_batch_order == "layer-major" and lm.micro_batches == K
    assert _static(prof) >= 4 * lm.budgets.gpu_bytes
    return bm, lm


def _loss(model, mb):
    return model(**mb).loss / K


def _train(model, data, opt, handle=None):
    for step in range(STEPS):
        mbs = data[step * K:(step + 1) * K]
        if handle is None:
            for mb in mbs:
                _loss(model, mb).backward()
        else:
            losses = handle.run_micro_batches(mbs, _loss)
            assert len(losses) == K and all(x.requires_grad is False for x in losses)
        opt.step()
        opt.zero_grad()


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _diff(a, b) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _files(path):
    return [f for _, _, fs in os.walk(path) for f in fs] if os.path.exists(path) else []


class _WeightReads:
    """Bytes of streamed weights read from their homes, per unit."""

    def __init__(self, monkeypatch):
        self.n: dict = {}
        real = streaming.UnitStatic._read_weights

        def read(us, parts):
            for _, _, lo, hi, _ in parts:
                self.n[us.name] = self.n.get(us.name, 0) + hi - lo
            return real(us, parts)
        monkeypatch.setattr(streaming.UnitStatic, "_read_weights", read)


@pytest.mark.parametrize("name,acts", [("gpt-tiny", "solve"), ("llama-tiny", "recompute-all"),
                                       ("hf-gpt2", "keep-all")])
def test_layer_major_trains_like_plain_pytorch_reading_weights_once(name, acts, tmp_path,
                                                                    monkeypatch):
    model0, data = MODELS[name]()
    model0.train()
    nvme = str(tmp_path / "nvme")
    bm_plan, lm_plan = _plans(model0, data, acts, nvme)
    ref = copy.deepcopy(model0)
    _train(ref, data, _opt(ref))

    moved, predicted, reads = {}, {}, {}
    for plan in (bm_plan, lm_plan):
        model = copy.deepcopy(model0)
        opt = _opt(model)
        counter = _WeightReads(monkeypatch)
        handle = apply_plan(model, plan, optimizer=opt)
        streamed = {s.name: s.flat.size for s in handle._r.statics.values() if s.weights_out}
        assert len(streamed) >= 8
        counter.n.clear()
        _train(model, data, opt, handle)
        assert _diff(model.state_dict(), ref.state_dict()) == 0.0, plan.micro_batch_order
        rep = handle.report()
        assert [s.passes for s in rep.steps] == [K] * STEPS
        moved[plan.micro_batch_order] = rep.steps[-1].moved
        predicted[plan.micro_batch_order] = rep.predicted_moved
        # the weights of a streamed unit: read for its forward and again for its backward
        # (the head's stay from one to the other), once per step in layer-major, once per
        # micro-batch in batch-major; the optimizer step reads them once more, either way
        per_step = 1 if plan.micro_batch_order == "layer-major" else K
        last = plan.units[-1].name
        for u, n in streamed.items():
            assert counter.n[u] == STEPS * ((1 if u == last else 2) * per_step + 1) * n, \
                (u, counter.n[u], n)
        reads[plan.micro_batch_order] = counter.n
        handle.remove()
        assert _files(nvme) == []
    bm, lm = moved["batch-major"], moved["layer-major"]
    homes = {d.name: d.home for d in lm_plan.layers}
    last = lm_plan.units[-1].name
    w = sum(u.param_bytes * (1 if u.name == last else 2) for u in lm_plan.units
            if homes[u.name].weights.value == "nvme")
    g = sum(u.grad_bytes for u in lm_plan.units if homes[u.name].grads.value == "nvme")
    # batch-major reads each streamed weight 2K times a step (the head's K times) and each
    # gradient on NVMe back K-1 times to accumulate, layer-major the weights 2 times (1) and
    # no gradient; activations move the same bytes in both; each matches its prediction
    assert bm["nvme_read"] - lm["nvme_read"] == (K - 1) * (w + g)
    assert bm["nvme_write"] - lm["nvme_write"] == (K - 1) * g
    assert lm == predicted["layer-major"] and bm == predicted["batch-major"]


def test_a_forward_outside_run_micro_batches_is_refused_and_batch_major_runs_the_plain_loop(
        tmp_path):
    model0, data = MODELS["gpt-tiny"]()
    nvme = str(tmp_path / "nvme")
    bm_plan, lm_plan = _plans(model0, data, "keep-all", nvme)
    model = copy.deepcopy(model0)
    opt = _opt(model)
    handle = apply_plan(model, lm_plan, optimizer=opt)
    try:
        with pytest.raises(UserError, match=r"handle\.run_micro_batches") as e:
            model(**data[0])
        assert "\n" not in str(e.value)
        with torch.no_grad():               # evaluation runs as it is
            assert torch.isfinite(model(**data[0]).loss)
        with pytest.raises(UserError, match="scalar loss"):
            handle.run_micro_batches(data[:K], lambda m, mb: m(**mb).logits)
        with pytest.raises(UserError, match="did not call the model"):
            handle.run_micro_batches(data[:K], lambda m, mb: torch.ones((), requires_grad=True))
        # a failed run leaves nothing behind: the next one trains as plain PyTorch does
        opt.zero_grad()
        ref = copy.deepcopy(model0)
        handle.run_micro_batches(data[:K], _loss)
        for mb in data[:K]:
            _loss(ref, mb).backward()
        got = handle.gradients()
        assert max((got[n] - p.grad).abs().max().item()
                   for n, p in ref.named_parameters()) == 0.0
    finally:
        handle.remove()
    assert _files(nvme) == []
    # batch-major: the same call is the plain loop
    model = copy.deepcopy(model0)
    opt = _opt(model)
    handle = apply_plan(model, bm_plan, optimizer=opt)
    ref = copy.deepcopy(model0)
    _train(ref, data, _opt(ref))
    _train(model, data, opt, handle)
    assert _diff(model.state_dict(), ref.state_dict()) == 0.0
    handle.remove()


class _Skip(torch.nn.Module):
    """Blocks that also read the first block's input (an encoder-output-like side input that
    needs a gradient): refused under layer-major."""

    def __init__(self, d=16, n=4):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.out = torch.nn.Linear(d, 1)

    def forward(self, x, target):
        h = self.inp(x)
        mem = h * 2
        for b in self.blocks:
            h = b(h) + mem
        return ((self.out(h) - target) ** 2).mean()


def test_a_side_input_that_needs_a_gradient_is_refused_in_one_line(tmp_path):
    torch.manual_seed(0)
    model = _Skip()
    x, t = torch.randn(4, 8, 16), torch.randn(4, 8, 1)
    prof = profile_module(model, (x, t), name="skip", hardware=HW, timing="estimate",
                          batch=4, seq=8)
    budgets = Budgets(HW.memory_bytes, 0, 1 << 30)
    cm = cost_model(prof, HW, budgets, K, micro_batch_order="layer-major")
    plan = plan_and_sim(prof, None, HW, budgets, "keep-all",
                        baseline_layers("keep-all", prof.layers, HW), cm=cm)[0]
    handle = apply_plan(model, plan, optimizer=_opt(model))
    try:
        with pytest.raises(UserError, match="batch-major") as e:
            handle.run_micro_batches([(x, t), (x, t)], lambda m, mb: m(*mb))
        assert "\n" not in str(e.value)
        assert all(p.grad is None for p in model.parameters())
    finally:
        handle.remove()


class _Stateful(torch.nn.Module):
    """Blocks that keep a tensor of one call for the next (as Hugging Face RecurrentGemma's
    recurrent layers do with their cache on): the value is multiplied by 0, so the plain loop
    is unaffected, but under the turn order micro-batch 2's graph reaches micro-batch 1's."""

    def __init__(self, d=16, n=3):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(n))
        self.out = torch.nn.Linear(d, 1)
        self.state = [None] * n

    def forward(self, x, target):
        h = self.inp(x)
        self.state = [None] * len(self.blocks)     # reset per call, before any block runs
        for i, b in enumerate(self.blocks):
            h = b(h)
            if i == 0:
                prev = getattr(self, "_kept", None)
                if prev is not None:
                    h = h + 0 * prev
                self._kept = h[:, -1:]
        return ((self.out(h) - target) ** 2).mean()


def test_a_graph_across_micro_batches_is_refused_in_one_line():
    torch.manual_seed(0)
    model = _Stateful()
    x, t = torch.randn(4, 8, 16), torch.randn(4, 8, 1)
    prof = profile_module(model, (x, t), name="stateful", hardware=HW, timing="estimate",
                          batch=4, seq=8)
    model._kept = None
    budgets = Budgets(HW.memory_bytes, 0, 1 << 30)
    cm = cost_model(prof, HW, budgets, K, micro_batch_order="layer-major")
    plan = plan_and_sim(prof, None, HW, budgets, "keep-all",
                        baseline_layers("keep-all", prof.layers, HW), cm=cm)[0]
    handle = apply_plan(model, plan, optimizer=_opt(model))
    try:
        with pytest.raises(UserError, match="in micro-batch 2 reaches micro-batch 1's") as e:
            handle.run_micro_batches([(x, t), (x + 1, t)], lambda m, mb: m(*mb))
        msg = str(e.value)
        assert "\n" not in msg and "use_cache=False" in msg and "batch-major" in msg
        assert all(p.grad is None for p in model.parameters())
    finally:
        handle.remove()


def test_with_dropout_a_run_is_deterministic_but_draws_in_turn_order(tmp_path):
    """Dropout on: two layer-major runs from one seed give the same weights; the plain loop's
    masks differ (its draws are all of mb 1's, then mb 2's), so its weights do too."""
    cfg = dict(load_config("gpt-tiny"), dtype="fp32", n_layers=16, vocab_size=64, dropout=0.1)
    torch.manual_seed(0)
    model0 = build_model(cfg, dtype="fp32")
    model0.train()
    data = [make_inputs(cfg, B, S, seed=k) for k in range(STEPS * K)]
    nvme = str(tmp_path / "nvme")
    _, lm_plan = _plans(model0, data, "keep-all", nvme)
    got = []
    for _ in range(2):
        model = copy.deepcopy(model0)
        opt = _opt(model)
        handle = apply_plan(model, lm_plan, optimizer=opt)
        torch.manual_seed(123)
        _train(model, data, opt, handle)
        got.append(model.state_dict())
        handle.remove()
    ref = copy.deepcopy(model0)
    torch.manual_seed(123)
    _train(ref, data, _opt(ref))
    assert _diff(got[0], got[1]) == 0.0
    assert _diff(got[0], ref.state_dict()) > 0.0
    assert _files(nvme) == []


def test_an_exception_in_one_micro_batch_stops_the_run_and_deletes_its_files(tmp_path):
    """The solver's plan offloads activations to NVMe: micro-batch 2's loss_fn fails after its
    forward; the run raises that error, every micro-batch's activation files are gone, and the
    next run trains exactly."""
    model0, data = MODELS["gpt-tiny"]()
    nvme = str(tmp_path / "nvme")
    _, lm_plan = _plans(model0, data, "solve", nvme)
    assert any(d.activation.value == "nvme" for d in lm_plan.layers)
    model = copy.deepcopy(model0)
    opt = _opt(model)
    handle = apply_plan(model, lm_plan, optimizer=opt)
    def acts():                                  # not the units' homes (w-, g-, s-)
        return [f for f in _files(nvme) if not f.startswith(("w-", "g-", "s-", "."))]
    seen = []

    def bad(m, mb):
        loss = _loss(m, mb)
        seen.append(len(acts()))
        if len(seen) == 2:
            raise ValueError("boom")
        return loss
    with pytest.raises(ValueError, match="boom"):
        handle.run_micro_batches(data[:K], bad)
    assert max(seen) > 0                         # activation files were written meanwhile
    assert acts() == []
    ref = copy.deepcopy(model0)
    _train(ref, data, _opt(ref))
    _train(model, data, opt, handle)
    assert _diff(model.state_dict(), ref.state_dict()) == 0.0
    handle.remove()
    assert _files(nvme) == []


def test_the_micro_batch_threads_are_the_handles_and_carry_nothing_between_runs(tmp_path):
    """The micro-batch threads live as long as the handle: a library's per-thread buffers
    (MKL's GEMM packing buffers) are made once, as the caller's thread makes them under
    batch-major, not again inside every forward where no plan counts them. The same K
    threads run every step; an autocast region around one run does not reach the next;
    ``remove()`` ends them."""
    model0, data = MODELS["llama-tiny"]()
    _, lm_plan = _plans(model0, data, "keep-all", str(tmp_path / "nvme"))
    model = copy.deepcopy(model0)
    opt = _opt(model)
    handle = apply_plan(model, lm_plan, optimizer=opt)
    seen = []

    def loss(m, mb):
        seen.append((threading.get_ident(), torch.is_autocast_enabled("cpu")))
        return _loss(m, mb)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        handle.run_micro_batches(data[:K], loss)
    opt.step()
    opt.zero_grad()
    handle.run_micro_batches(data[K:2 * K], loss)
    opt.step()
    opt.zero_grad()
    first, second = seen[:K], seen[K:]
    assert len({t for t, _ in first}) == K and {t for t, _ in first} == {t for t, _ in second}
    assert all(a for _, a in first) and not any(a for _, a in second)
    handle.remove()
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tierplan-mb")]


def test_autocast_reaches_the_micro_batches_threads(tmp_path):
    """The caller's autocast is carried into each micro-batch's thread: bfloat16 autocast on the
    CPU around each step's micro-batches trains as the plain loop under the same autocast does,
    bit for bit (autocast's cache of cast weights lives as long as the outermost autocast
    region, so the region is one step, as the weights change at each optimizer step)."""
    model0, data = MODELS["llama-tiny"]()
    nvme = str(tmp_path / "nvme")
    _, lm_plan = _plans(model0, data, "keep-all", nvme)

    def train(model, opt, handle=None, autocast=True):
        for step in range(STEPS):
            mbs = data[step * K:(step + 1) * K]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                if handle is None:
                    for mb in mbs:
                        _loss(model, mb).backward()
                else:
                    handle.run_micro_batches(mbs, _loss)
            opt.step()
            opt.zero_grad()
    model = copy.deepcopy(model0)
    opt = _opt(model)
    handle = apply_plan(model, lm_plan, optimizer=opt)
    ref = copy.deepcopy(model0)
    train(ref, _opt(ref))
    train(model, opt, handle)
    d = _diff(model.state_dict(), ref.state_dict())
    handle.remove()
    assert d == 0.0
    # and without it the weights differ: the autocast did reach the threads
    plain = copy.deepcopy(model0)
    train(plain, _opt(plain), autocast=False)
    assert _diff(plain.state_dict(), ref.state_dict()) > 0.0
