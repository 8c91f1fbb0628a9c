"""The Hugging Face Trainer under a plan, used the obvious way: ``apply_plan(model, plan,
optimizer=opt)`` and then ``Trainer(model=model, optimizers=(opt, None), ...)``.

A Llama from its default config (size aside) fine-tuned for 3 optimizer steps with
``gradient_accumulation_steps=2`` (the plan's ``--micro-batches 2``) and ``max_grad_norm=1.0``
(the Trainer clips with torch's own ``clip_grad_norm_``, and calls ``model.zero_grad()``) logs
the same losses and gradient norms and ends with the same weights as the same Trainer run
without a plan, under an activation-only plan and under a streaming plan whose static state is
more than four times its ``--gpu-mem``; the checkpoint the Trainer saves loads into a plain
model with equal weights.
"""
from __future__ import annotations

import copy
import os
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from planner.errors import NoFitError  # noqa: E402
from planner.formats import Budgets, Tier  # noqa: E402
from planner.hardware import load_hardware  # noqa: E402
from planner.profile import profile_module  # noqa: E402
from planner.solve import solve_profile  # noqa: E402
from runtime import PlanMismatchError, UnsupportedModelError, apply_plan  # noqa: E402

B, S, K, STEPS = 2, 16, 2, 3


@pytest.fixture(scope="module")
def setup():
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=12,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                   max_position_embeddings=64)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, cfg.vocab_size, (S,), generator=g) for _ in range(B * K * STEPS)]
    data = [{"input_ids": x, "labels": x.clone()} for x in ids]
    hw = load_hardware("cpu-host")
    batch = {k: torch.stack([d[k] for d in data[:B]]) for k in ("input_ids", "labels")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = profile_module(copy.deepcopy(base), batch, name="llama", hardware=hw,
                              timing="estimate", batch=B, seq=S)
    return base, data, hw, prof


def _train(base, data, tmp, plan=None, optimizers=True, accum=K, max_grad_norm=1.0, **more):
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    handle = apply_plan(model, plan, optimizer=opt) if plan is not None else None
    args = transformers.TrainingArguments(
        output_dir=str(tmp), per_device_train_batch_size=B, gradient_accumulation_steps=accum,
        max_steps=STEPS, max_grad_norm=max_grad_norm, learning_rate=1e-3, logging_steps=1,
        save_strategy="steps", save_steps=STEPS, report_to=[], use_cpu=True, seed=7,
        disable_tqdm=True, **more)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   optimizers=(opt, None) if optimizers else (None, None))
    try:
        trainer.train()
        logs = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
        weights = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        if handle is not None:
            handle.remove()
    return logs, weights, handle


def _solve(prof, hw, gpu, nvme_dir, stream):
    budgets = Budgets(gpu_bytes=int(gpu), cpu_bytes=0, nvme_bytes=1 << 30)
    return solve_profile(prof, None, hw, budgets, "optimal", time_limit=30,
                         nvme_dir=str(nvme_dir), micro_batches=K, stream=stream).plan


def _tightest(prof, hw, nvme_dir, stream):
    try:
        return _solve(prof, hw, hw.reserved_bytes, nvme_dir, stream)
    except NoFitError as e:
        return _solve(prof, hw, e.needed_bytes, nvme_dir, stream)


@pytest.mark.parametrize("kind", ["activations", "streaming"])
def test_the_trainer_trains_under_a_plan_exactly_as_without(setup, kind, tmp_path):
    base, data, hw, prof = setup
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_logs, ref_w, _ = _train(base, data, tmp_path / "plain")
        plan = _tightest(prof, hw, tmp_path / "nvme", "off" if kind == "activations" else "auto")
        homes = [d.home for d in plan.layers]
        if kind == "activations":
            assert all(h.resident for h in homes)
            assert any(d.activation.value != "keep" for d in plan.layers)
        else:
            static = sum(u.param_bytes + u.grad_bytes + u.optimizer_bytes for u in prof.layers)
            assert static >= 4 * plan.budgets.gpu_bytes, (static, plan.budgets.gpu_bytes)
            assert sum(h.weights is Tier.NVME for h in homes) >= len(homes) // 2
        logs, w, handle = _train(base, data, tmp_path / "planned", plan)
    assert len(logs) == STEPS
    for (loss, norm), (rl, rn) in zip(logs, ref_logs):
        assert abs(loss - rl) <= 1e-6 and abs(norm - rn) <= 1e-6, (logs, ref_logs)
    assert max((w[k] - ref_w[k]).abs().max().item() for k in ref_w) <= 1e-6
    assert len(handle.report().steps) == STEPS
    if kind == "streaming":
        # each optimizer step the Trainer makes (through accelerate's wrapper) times every
        # trainable element's update once (plan calibrate's optimizer_s)
        n = sum(p.numel() for p in base.parameters() if p.requires_grad)
        assert all(s.optimizer_elements == n and s.optimizer_compute_s > 0
                   for s in handle.report().steps)
    # the Trainer's checkpoint, saved under the plan, is a plain model's
    ckpt = tmp_path / "planned" / f"checkpoint-{STEPS}"
    plain = transformers.LlamaForCausalLM.from_pretrained(str(ckpt))
    got = plain.state_dict()
    assert max((got[k] - ref_w[k]).abs().max().item() for k in ref_w) <= 1e-6
    assert os.path.exists(ckpt / "optimizer.pt")
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").rglob("*"))


def test_a_trainer_that_makes_its_own_optimizer_is_refused_in_one_line(setup, tmp_path):
    """Given no ``optimizers=``, the Trainer builds an AdamW of its own, which would step the
    parameters the plan keeps on disk: its first step is refused, naming the documented way."""
    base, data, hw, prof = setup
    plan = _tightest(prof, hw, tmp_path / "nvme", "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(PlanMismatchError, match=r"optimizers=\(opt, None\)") as e:
            _train(base, data, tmp_path / "t", plan, optimizers=False)
    assert "\n" not in str(e.value)


def test_the_trainers_own_gradient_checkpointing_is_refused_in_one_line(setup, tmp_path):
    """``TrainingArguments(gradient_checkpointing=True)`` switches the model's own
    checkpointing on inside ``train()``, after ``apply_plan``: the first forward refuses it
    (it ran before, silently not as planned: the plan's NVMe peak 30 against 35 MiB)."""
    base, data, hw, prof = setup
    plan = _tightest(prof, hw, tmp_path / "nvme", "auto")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(UnsupportedModelError, match="gradient_checkpointing=False") as e:
            _train(base, data, tmp_path / "t", plan, gradient_checkpointing=True)
    assert "\n" not in str(e.value)
    assert not (tmp_path / "nvme").exists() or not any((tmp_path / "nvme").rglob("*"))


def test_a_plain_accelerate_loop_trains_under_a_streaming_plan_exactly(setup, tmp_path):
    """``accelerator.prepare`` wraps the optimizer; ``accumulate``, ``backward`` and
    ``clip_grad_norm_`` are Accelerate's: the weights equal the same loop without a plan."""
    accelerate = pytest.importorskip("accelerate")
    base, data, hw, prof = setup
    plan = _tightest(prof, hw, tmp_path / "nvme", "auto")
    assert any(not d.home.resident for d in plan.layers)
    out = []
    for p in (None, plan):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        handle = apply_plan(model, p, optimizer=opt) if p is not None else None
        acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=K)
        model, opt = acc.prepare(model, opt)
        norms = []
        for i in range(0, len(data), B):
            batch = {k: torch.stack([d[k] for d in data[i:i + B]]) for k in ("input_ids", "labels")}
            with acc.accumulate(model):
                acc.backward(model(**batch).loss)
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), 1.0).item())
                opt.step()
                opt.zero_grad()
        out.append((norms, {k: v.clone() for k, v in model.state_dict().items()}))
        if handle is not None:
            handle.remove()
    (n0, w0), (n1, w1) = out
    assert len(n0) == STEPS and n0 == n1
    assert max((w1[k] - w0[k]).abs().max().item() for k in w0) <= 1e-6


def test_the_trainer_under_a_paced_plan(setup, tmp_path):
    """A paced plan (each unit's step in the backward, its gradient freed by it) under the
    Trainer with one micro-batch a step: without clipping (``max_grad_norm=0``; transformers
    5 still takes the norm to log it, ``clip_grad_norm_(..., inf)``) the same losses, logged
    norms and weights as without a plan; with the Trainer's default clip (1.0, below these
    norms) the first clip is refused in one line naming --clip global, and nothing is left
    behind."""
    from planner.errors import UserError
    base, data, hw, prof = setup
    static = sum(u.param_bytes + u.grad_bytes + u.optimizer_bytes for u in prof.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        budgets = Budgets(gpu_bytes=static // 2, cpu_bytes=0, nvme_bytes=1 << 30)
        plan = solve_profile(prof, None, hw, budgets, "optimal", time_limit=30,
                             nvme_dir=str(tmp_path / "nvme"), micro_batches=1, clip="none",
                             optimizer_overlap="paced").plan
        assert plan.optimizer_overlap == "paced"
        ref_logs, ref_w, _ = _train(base, data, tmp_path / "plain", accum=1, max_grad_norm=0)
        logs, w, handle = _train(base, data, tmp_path / "planned", plan, accum=1,
                                 max_grad_norm=0)
        assert len(logs) == STEPS
        for (loss, norm), (rl, rn) in zip(logs, ref_logs):
            assert abs(loss - rl) <= 1e-6 and abs(norm - rn) <= 1e-6, (logs, ref_logs)
        assert max((w[k] - ref_w[k]).abs().max().item() for k in ref_w) <= 1e-6
        assert all(s.overlapped_units >= 1 for s in handle.report().steps)
        with pytest.raises(UserError, match="paced.*--clip global") as e:
            _train(base, data, tmp_path / "clipped", plan, accum=1)
        assert "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "nvme") or not any(
        fs for _, _, fs in os.walk(tmp_path / "nvme"))
