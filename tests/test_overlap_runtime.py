"""The overlapped executor (runtime/overlap.py): plans with ``optimizer_overlap: overlapped``
train exactly like plain PyTorch, with each unit's optimizer work really started beside the
backward, under ``clip none`` (the whole step) and ``clip global`` (the state reads; the step
after the user's clip).

Models: the built-in GPT and LLaMA and a Hugging Face Llama from its default config (sizes
aside), each profiled and solved on the cpu-host spec at the smallest GPU budget that fits, so
that its static state is at least four times ``--gpu-mem`` and most units stream. The loop is
the ordinary one: 3 optimizer steps of 2 micro-batches, AdamW with weight decay, a StepLR
scheduler stepped after each ``opt.step()``, ``opt.zero_grad()`` and ``model.zero_grad()`` in
turn.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import threading
import warnings

import pytest
import torch

from planner.errors import NoFitError, UserError
from planner.formats import Budgets, Tier
from planner.hardware import load_hardware
from planner.models import build_model, load_config, make_inputs
from planner.profile import profile_module
from planner.solve import solve_profile
from runtime import apply_plan
from runtime.overlap import WORKER_THREAD

B, S, K, STEPS = 2, 16, 2, 3


def _builtin(name, **over):
    def make():
        cfg = dict(load_config(name), dtype="fp32", **over)
        torch.manual_seed(0)
        model = build_model(cfg, dtype="fp32")
        data = [make_inputs(cfg, B, S, seed=k) for k in range(STEPS * K)]
        return model, data
    return make


def _hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=10,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                   max_position_embeddings=64, use_cache=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    data = []
    for _ in range(STEPS * K):
        ids = torch.randint(0, cfg.vocab_size, (B, S), generator=g)
        data.append({"input_ids": ids, "labels": ids.clone()})
    return model, data


MODELS = {
    "gpt": _builtin("gpt-tiny", n_layers=16, d_model=128),
    "llama": _builtin("llama-tiny", n_layers=12, d_model=128, d_ff=352),
    "hf-llama": _hf_llama,
}


def _solve(prof, hw, nvme, clip):
    def at(gpu):
        budgets = Budgets(gpu_bytes=int(gpu), cpu_bytes=0, nvme_bytes=1 << 30)
        return solve_profile(prof, None, hw, budgets, "optimal", time_limit=20,
                             nvme_dir=str(nvme), micro_batches=K, clip=clip,
                             optimizer_overlap="auto").plan
    try:
        return at(hw.reserved_bytes)
    except NoFitError as e:
        return at(e.needed_bytes)


_PLANS: dict = {}


@pytest.fixture(autouse=True)
def one_compute_thread():
    """Every run here at one intra-op thread, the reference included. Plain PyTorch itself is
    not bitwise reproducible from process to process at two threads on a 2-core host: the
    reference loop alone (no tierplan) ended at 3 different weight sums in 12 processes; after
    one AdamW step, 32,745 of the 65,536 elements of ``tok_emb.weight`` (one thread's half)
    differed in 1 process of 10, on identical gradients. At one thread, 10 of 10 agreed. These
    tests compare bits, so they take what is reproducible."""
    was = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(was)


def _setup(name, clip, nvme):
    """The model, its data and the solver's plan. At the smallest budget that fits, the plan
    that wins steps one unit at a time (``optimizer_depth`` 1: three units in flight need more
    memory), and the planner prices the overlap for depth 3 only, so it labels the plan
    ``after-backward``; the same decisions are then executed as ``overlapped`` (a schedule
    every such plan admits), with the state of every streamed unit allowed ahead under clip
    global."""
    model, data = MODELS[name]()
    if (name, clip) in _PLANS:
        return model, data, dataclasses.replace(_PLANS[name, clip], nvme_dir=str(nvme))
    hw = load_hardware("cpu-host")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = profile_module(copy.deepcopy(model), data[0], name=name, hardware=hw,
                              timing="estimate", batch=B, seq=S)
    plan = _solve(prof, hw, nvme, clip)
    static = sum(u.param_bytes + u.grad_bytes + u.optimizer_bytes for u in prof.layers)
    assert static >= 4 * plan.budgets.gpu_bytes, (static, plan.budgets.gpu_bytes)
    homes = [d.home for d in plan.layers]
    assert sum(h.grads is Tier.NVME for h in homes) >= len(homes) // 2, homes
    assert plan.clip == clip
    if plan.optimizer_overlap != "overlapped" or clip == "global":
        # (under clip global the solver may read ahead a little already, on a unified-memory
        # host as much as the budget leaves: here all of it, to run the read of every unit)
        ahead = sum(u.optimizer_bytes for u, h in zip(plan.units, homes)
                    if h.optimizer is Tier.NVME)
        plan = dataclasses.replace(plan, optimizer_overlap="overlapped",
                                   optimizer_prefetch_bytes=ahead if clip == "global" else 0)
    _PLANS[name, clip] = plan
    return model, data, plan


def _optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


def _train(model, data, opt, sched, clip, handle=None, steps=STEPS):
    model.train()
    torch.manual_seed(123)               # dropout masks: the same draws in both runs
    for step in range(steps):
        for k in range(K):
            (model(**data[step * K + k]).loss / K).backward()
        if clip == "global":
            if handle is not None:
                handle.clip_grad_norm_(0.5)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        # both idioms: the optimizer's (through the plan) and the model's (a plain nn.Module
        # call that the placeholders of gradients at home follow)
        (opt.zero_grad if step % 2 == 0 else model.zero_grad)()


def _files(path) -> list:
    return [f for _, _, fs in os.walk(path) for f in fs] if os.path.exists(path) else []


def _workers() -> list:
    return [t for t in threading.enumerate() if t.name == WORKER_THREAD]


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("clip", ["none", "global"])
@pytest.mark.parametrize("name", list(MODELS))
def test_overlapped_training_equals_plain_pytorch(name, clip, tmp_path):
    nvme = tmp_path / "nvme"
    model, data, plan = _setup(name, clip, nvme)
    ref = copy.deepcopy(model)
    ref_opt, ref_sched = _optimizer(ref)
    _train(ref, data, ref_opt, ref_sched, clip)

    opt, sched = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    try:
        _train(model, data, opt, sched, clip, handle)
        diff = _diff(model.state_dict(), ref.state_dict())
        assert diff <= 1e-6
        got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        assert got.keys() == want.keys()
        for i in want:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert (got[i][key] - want[i][key]).abs().max().item() <= 1e-6, (i, key)
        rep = handle.report()
        steps = rep.steps
        assert len(steps) == STEPS
        # the units the worker takes: every home but the resident one whose gradient goes
        # home, or stays on the device with nothing tied to it (stepped at its backward's end)
        early_units = [d for u, d in zip(plan.units, plan.layers) if not d.home.resident and (
            d.home.grads is not Tier.GPU or not (u.tied_to or u.outside_params))]
        streamed = len(early_units) if clip == "none" else \
            sum(d.home.optimizer is Tier.NVME for d in early_units)
        early = [s.overlapped_units for s in steps]
        log = handle._r.overlap.last_log        # the last step's jobs: (unit, kind, early, s)
        if clip == "none":
            # every unit whose gradient goes home was stepped by the worker, and in every
            # step some of those steps began before the step's last backward had ended (the
            # rest queued behind them: one worker)
            assert [k for _, k, _, _ in log] == ["step"] * streamed
            assert all(1 <= n <= streamed for n in early), (early, streamed)
        else:
            # no state before the first step; then each streamed unit's state is read ahead,
            # some of it before the backward ended
            assert early[0] == 0
            assert [k for _, k, _, _ in log] == ["read"] * streamed
            assert all(1 <= n <= streamed for n in early[1:]), (early, streamed)
        print(f"{name} clip {clip}: units started before the backward ended {early} of "
              f"{streamed}; step {rep.measured.step_s:.4f} s measured, "
              f"{rep.predicted['step_s']:.4f} s predicted; weights differ by {diff:.1e}")
        # the schedule's bytes, all moved and counted (what is read ahead is not read again)
        for link in ("nvme_write", "nvme_read"):
            assert rep.measured.moved[link] == rep.predicted_moved[link] > 0, link
        # measured against predicted, as for every plan
        assert rep.measured.step_s > 0 and rep.predicted["step_s"] > 0
        assert "step" in str(rep)
        assert _files(nvme)
        assert _workers() == []           # the worker ends with its last job
    finally:
        handle.remove()
    assert _files(nvme) == []
    assert _workers() == []
    assert _diff(model.state_dict(), ref.state_dict()) <= 1e-6


def _one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_a_clip_under_clip_none_is_refused_in_one_line(tmp_path):
    model, data, plan = _setup("gpt", "none", tmp_path / "nvme")
    opt, _ = _optimizer(model)
    with apply_plan(model, plan, optimizer=opt) as handle:
        for k in range(K):
            (model(**data[k]).loss / K).backward()
        with pytest.raises(UserError, match="--clip global") as e:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        assert "--clip none" in _one_line(e)
        with pytest.raises(UserError, match="--clip global") as e:
            handle.clip_grad_norm_(0.5)
        _one_line(e)
        opt.step()
        opt.zero_grad()
        model.zero_grad()
    assert _files(tmp_path / "nvme") == [] and _workers() == []


def test_a_learning_rate_changed_after_the_backward_is_refused_in_one_line(tmp_path):
    """Under clip none the units' steps ran during the backward with the lr of that time: a
    change before ``opt.step()`` cannot reach them."""
    model, data, plan = _setup("gpt", "none", tmp_path / "nvme")
    opt, _ = _optimizer(model)
    with apply_plan(model, plan, optimizer=opt):
        for k in range(K):
            (model(**data[k]).loss / K).backward()
        opt.param_groups[0]["lr"] = 5e-3
        with pytest.raises(UserError, match="'lr' of param group 0 changed.*"
                           "--optimizer-overlap off") as e:
            opt.step()
        _one_line(e)
    assert _files(tmp_path / "nvme") == [] and _workers() == []


def test_a_scheduler_between_steps_is_seen(tmp_path):
    """The lr a scheduler sets after one ``opt.step()`` is the one the next step's units,
    stepped during the backward, use (bit for bit the plain run's)."""
    model, data, plan = _setup("gpt", "none", tmp_path / "nvme")
    ref = copy.deepcopy(model)
    out = []
    for m, p in ((ref, None), (model, plan)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: [1.0, 0.0, 3.0][s % 3])
        handle = apply_plan(m, p, optimizer=opt) if p is not None else None
        _train(m, data, opt, sched, "none", handle)
        out.append({k: v.clone() for k, v in m.state_dict().items()})
        if handle is not None:
            handle.remove()
    assert _diff(out[0], out[1]) == 0.0


class Boom(RuntimeError):
    pass


def test_an_error_in_a_units_step_surfaces_at_opt_step_as_it_was(tmp_path, monkeypatch):
    model, data, plan = _setup("gpt", "none", tmp_path / "nvme")
    opt, _ = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    phase = handle._r.phase
    victim = phase.subs[2][0]
    real = phase.step_unit
    err = Boom("a unit's step failed")

    def step_unit(u, subs, hypers=None):
        if u is victim:
            raise err
        return real(u, subs, hypers)
    monkeypatch.setattr(phase, "step_unit", step_unit)
    try:
        for k in range(K):
            (model(**data[k]).loss / K).backward()
        with pytest.raises(Boom) as e:
            opt.step()
        assert e.value is err
        assert _workers() == []
    finally:
        handle.remove()
    assert _files(tmp_path / "nvme") == [] and _workers() == []


def test_an_exception_in_the_loop_leaves_no_thread_and_no_file(tmp_path):
    """The loop dies after the last backward, its units' steps under way: ``remove`` (the
    ``with`` block) waits for them and deletes every file."""
    model, data, plan = _setup("llama", "none", tmp_path / "nvme")
    opt, _ = _optimizer(model)
    with pytest.raises(KeyboardInterrupt):
        with apply_plan(model, plan, optimizer=opt):
            for k in range(K):
                (model(**data[k]).loss / K).backward()
            raise KeyboardInterrupt
    assert _files(tmp_path / "nvme") == [] and _workers() == []


def test_a_forward_beyond_the_plans_micro_batches_is_refused(tmp_path):
    """Under clip none the units were stepped in the K-th backward: a pass K+1 before
    ``opt.step()`` is refused in one line."""
    model, data, plan = _setup("gpt", "none", tmp_path / "nvme")
    opt, _ = _optimizer(model)
    with apply_plan(model, plan, optimizer=opt):
        for k in range(K):
            (model(**data[k]).loss / K).backward()
        with pytest.raises(UserError, match="opt.step\\(\\) every 2 micro-batches") as e:
            model(**data[K])
        _one_line(e)
    assert _files(tmp_path / "nvme") == [] and _workers() == []


def test_a_pass_beyond_the_plans_micro_batches_trains_exactly_under_clip_global(tmp_path):
    """Under clip global only state was read ahead, which a later pass does not change: K+1
    passes then a clipped step give plain PyTorch's weights (and the usual warning that the
    prediction is for K passes)."""
    model, data, plan = _setup("gpt", "global", tmp_path / "nvme")
    ref = copy.deepcopy(model)
    out = []
    for m, p in ((ref, None), (model, plan)):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        handle = apply_plan(m, p, optimizer=opt) if p is not None else None
        torch.manual_seed(5)
        for step in range(2):
            for k in range(K + (step == 1)):
                (m(**data[step * K + k]).loss / K).backward()
            if handle is not None:
                handle.clip_grad_norm_(0.5)
            else:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                opt.step()
            if handle is not None and step == 1:
                assert any("--micro-batches 3" in str(x.message) for x in w)
            opt.zero_grad()
        out.append({k: v.clone() for k, v in m.state_dict().items()})
        if handle is not None:
            assert handle.report().steps[1].overlapped_units >= 1
            handle.remove()
    assert _diff(out[0], out[1]) == 0.0
    assert _files(tmp_path / "nvme") == [] and _workers() == []


@pytest.mark.parametrize("clip", ["none", "global", "none-but-clipping"])
def test_the_trainer_under_an_overlapped_plan(clip, tmp_path):
    """The Hugging Face Trainer, used the documented way (``optimizers=(opt, None)``): its
    linear schedule steps the lr after every ``opt.step()``, it zeroes with
    ``model.zero_grad()``, accumulates K micro-batches and clips with torch's own
    ``clip_grad_norm_`` where ``max_grad_norm`` > 0. Under clip none (no clipping) and clip
    global (clipping at 1.0) it logs the same losses and ends with the same weights as without a
    plan; clipping under a clip-none plan is refused in one line."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    plan_clip = "global" if clip == "global" else "none"
    model, data, plan = _setup("hf-llama", plan_clip, tmp_path / "nvme")
    rows = [{"input_ids": d["input_ids"][i], "labels": d["labels"][i]}
            for d in data for i in range(B)]
    norm = 0.0 if clip == "none" else 1.0

    def run(p, out):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
        handle = apply_plan(m, p, optimizer=opt) if p is not None else None
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), per_device_train_batch_size=B,
            gradient_accumulation_steps=K, max_steps=STEPS, max_grad_norm=norm,
            learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[],
            use_cpu=True, seed=7, disable_tqdm=True)
        trainer = transformers.Trainer(model=m, args=args, train_dataset=rows,
                                       optimizers=(opt, None))
        try:
            trainer.train()
            logs = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            return logs, {k: v.clone() for k, v in m.state_dict().items()}, \
                (handle.report() if handle is not None else None)
        finally:
            if handle is not None:
                handle.remove()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if clip == "none-but-clipping":
            with pytest.raises(UserError, match="--clip global") as e:
                run(plan, "planned")
            _one_line(e)
            assert _files(tmp_path / "nvme") == [] and _workers() == []
            return
        ref_logs, ref_w, _ = run(None, "plain")
        logs, w, rep = run(plan, "planned")
    assert len(logs) == STEPS and logs == ref_logs, (logs, ref_logs)
    assert _diff(w, ref_w) == 0.0
    assert len(rep.steps) == STEPS and all(s.overlapped_units >= 1 for s in rep.steps[1:])
    assert _files(tmp_path / "nvme") == [] and _workers() == []


@pytest.mark.parametrize("name", ["gpt", "hf-llama"])
def test_a_clip_that_does_not_clip_runs_under_clip_none(name, tmp_path):
    """torch's ``clip_grad_norm_`` at ``inf`` or above the total norm scales every gradient by
    exactly 1, which changes no step that ran: accepted (gradients at home and kept on the
    device alike), the same norms and weights as plain PyTorch."""
    model, data, plan = _setup(name, "none", tmp_path / "nvme")
    ref = copy.deepcopy(model)
    out, norms = [], []
    for m, p in ((ref, None), (model, plan)):
        opt, _ = _optimizer(m)
        handle = apply_plan(m, p, optimizer=opt) if p is not None else None
        got = []
        torch.manual_seed(123)
        for step in range(STEPS):
            for k in range(K):
                (m(**data[step * K + k]).loss / K).backward()
            got.append(torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf")).item())
            got.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 1e9).item())
            opt.step()
            opt.zero_grad()
        if handle is not None:
            handle.remove()
        out.append({k: v.clone() for k, v in m.state_dict().items()})
        norms.append(got)
    assert norms[0] == norms[1], norms
    assert _diff(*out) <= 1e-6
    assert _files(tmp_path / "nvme") == [] and _workers() == []


def test_a_forward_after_a_failed_last_backward_says_why_in_one_line(tmp_path):
    """The K-th backward stops (a hook raises) after units were stepped beside it: a loop that
    skips the batch would keep those updates, so the next forward before ``opt.step()`` is
    refused in one line saying so; ``opt.step()`` then finishes the step."""
    nvme = tmp_path / "nvme"
    model, data, plan = _setup("llama", "none", nvme)
    opt, _ = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    stem = model.tok_emb.weight
    armed = []

    def boom(g):
        if armed:
            raise Boom("boom")
        return g
    hook = stem.register_hook(boom)
    try:
        (model(**data[0]).loss / K).backward()
        armed.append(1)
        with pytest.raises(Boom):
            (model(**data[1]).loss / K).backward()
        with pytest.raises(UserError) as e:
            model(**data[2])
        line = _one_line(e)
        assert "the last backward stopped after" in line and "opt.step()" in line, line
        hook.remove()
        opt.step()
        opt.zero_grad()
        (model(**data[2]).loss / K).backward()
    finally:
        hook.remove()
        handle.remove()
    assert _files(nvme) == [] and _workers() == []


def test_a_failed_last_forward_hands_nothing_over_and_a_retry_trains_exactly(tmp_path):
    """The K-th forward raises (a block's forward hook, once): the stages the runtime then
    finishes are not a backward, so no unit goes to the worker (they used to, with the
    gradients of K - 1 micro-batches), and the loop that retries the micro-batch trains as
    plain PyTorch does."""
    nvme = tmp_path / "nvme"
    model, data, plan = _setup("llama", "none", nvme)
    ref = copy.deepcopy(model)

    def run(m, handle=None):
        opt, _ = _optimizer(m)
        h = apply_plan(m, plan, optimizer=opt) if handle else None
        armed = []

        def boom(mod, args):
            if armed:
                armed.clear()
                raise Boom("boom")
        hook = m.blocks[3].register_forward_pre_hook(boom)
        try:
            torch.manual_seed(123)
            for step in range(2):
                for k in range(K):
                    armed[:] = [1] if (step, k) == (1, K - 1) else []
                    try:
                        (m(**data[step * K + k]).loss / K).backward()
                    except Boom:
                        if h is not None:
                            assert h._r.overlap.jobs == []
                        (m(**data[step * K + k]).loss / K).backward()
                opt.step()
                opt.zero_grad()
        finally:
            hook.remove()
            if h is not None:
                h.remove()
    run(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")       # the retried pass is one more than the plan's K
        run(model, handle=True)
    assert _diff(model.state_dict(), ref.state_dict()) == 0.0
    assert _files(nvme) == [] and _workers() == []


def test_model_zero_grad_waits_for_the_worker_and_is_unwrapped_by_remove(tmp_path):
    """``model.zero_grad()`` between the K-th backward and ``opt.step()`` waits for the
    worker's steps (as ``opt.zero_grad()`` does), so it never sets ``.grad`` under a step that
    reads it; ``remove()`` gives the model its own ``zero_grad`` back."""
    nvme = tmp_path / "nvme"
    model, data, plan = _setup("llama", "none", nvme)
    opt, _ = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    ov = handle._r.overlap
    try:
        for k in range(K):
            (model(**data[k]).loss / K).backward()
        assert ov.jobs
        model.zero_grad()
        assert all(j.future.done() for j in ov.jobs)
        opt.step()
    finally:
        handle.remove()
    assert "zero_grad" not in model.__dict__
    assert _files(nvme) == [] and _workers() == []
