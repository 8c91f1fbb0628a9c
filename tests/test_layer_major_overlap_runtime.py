"""Layer-major plans with the optimizer beside the backward: ``micro_batch_order: layer-major``
with ``optimizer_overlap: overlapped`` (clip none and clip global) or ``paced``, run by
``handle.run_micro_batches``. A step is one pass of the stages, every micro-batch through a
unit before the next, so a unit's gradient is complete when its backward stage has run all K
micro-batches: the overlapped scheduler (runtime/overlap.py) is armed by the run that brings
the step's passes to K and hands the unit over at the stage after it, as in the K-th pass of a
batch-major step.

Models: the built-in GPT (dropout off: under layer-major the micro-batches' random draws come
in turn order) and LLaMA, and a Hugging Face Llama from its default config (``use_cache`` on),
each profiled on the cpu-host spec and solved with ``--micro-batch-order layer-major`` and the
family's own flags at the first of a few budgets where the solver writes that family. Three
AdamW steps of two micro-batches with a StepLR scheduler, ``opt.zero_grad()`` and
``model.zero_grad()`` in turn, and under clip global ``handle.clip_grad_norm_`` against
``torch.nn.utils.clip_grad_norm_``: weights and optimizer state equal plain PyTorch's
batch-major loop bit for bit.
"""
from __future__ import annotations

import copy
import dataclasses
import time

import pytest
import torch

from planner.errors import UserError
from runtime import apply_plan
# helpers shared with the batch-major executors' tests; the fixture runs both runs of a test at
# one intra-op thread (plain PyTorch is not bitwise reproducible across runs at two here)
from test_overlap_runtime import (_builtin, _diff, _files, _one_line, _workers,  # noqa: F401
                                  one_compute_thread)
from test_paced_runtime import _hf_llama, check_paced_waits, solve_for_family

pytestmark = pytest.mark.slow

B, S, K, STEPS = 2, 16, 2, 3
MODELS = {
    "gpt": _builtin("gpt-tiny", n_layers=16, d_model=128, dropout=0.0),
    "llama": _builtin("llama-tiny", n_layers=12, d_model=128, d_ff=352),
    "hf-llama": _hf_llama,
}
# family: (clip, --optimizer-overlap, the plan's label)
FAMILIES = {"overlapped-none": ("none", "on", "overlapped"),
            "overlapped-global": ("global", "on", "overlapped"),
            "paced": ("none", "paced", "paced")}
_PLANS: dict = {}


def _model(name):
    model, data = MODELS[name]()
    while len(data) < STEPS * K:          # the paced tests' factory makes fewer batches
        data = data + data
    return model, data[:STEPS * K]


def _setup(name, family, nvme):
    model, data = _model(name)
    if (name, family) not in _PLANS:
        clip, flag, label = FAMILIES[family]
        plan = solve_for_family(model, data[0], name, label, (4.2, 3.0, 2.0, 1.5), nvme,
                                micro_batches=K, clip=clip, optimizer_overlap=flag,
                                micro_batch_order="layer-major")
        assert plan.micro_batch_order == "layer-major" and plan.micro_batches == K
        _PLANS[name, family] = plan
    return model, data, dataclasses.replace(_PLANS[name, family], nvme_dir=str(nvme))


def _optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


def _loss(model, mb):
    return model(**mb).loss / K


def _train(model, data, opt, sched, clip, handle=None, per_run=K):
    model.train()
    for step in range(STEPS):
        mbs = data[step * K:(step + 1) * K]
        if handle is None:
            for mb in mbs:
                _loss(model, mb).backward()
        else:
            for i in range(0, K, per_run):
                handle.run_micro_batches(mbs[i:i + per_run], _loss)
        if clip == "global":
            if handle is not None:
                handle.clip_grad_norm_(0.5)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        (opt.zero_grad if step % 2 == 0 else model.zero_grad)()


def _reference(model, data, clip):
    ref = copy.deepcopy(model)
    opt, sched = _optimizer(ref)
    _train(ref, data, opt, sched, clip)
    return ref, opt


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("name", list(MODELS))
def test_layer_major_with_the_optimizer_beside_the_backward_equals_plain_pytorch(
        name, family, tmp_path):
    nvme = tmp_path / "nvme"
    model, data, plan = _setup(name, family, nvme)
    clip = plan.clip
    ref, ref_opt = _reference(model, data, clip)

    opt, sched = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    try:
        _train(model, data, opt, sched, clip, handle)
        diff = _diff(model.state_dict(), ref.state_dict())
        assert diff == 0.0, diff
        got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
        assert got.keys() == want.keys()
        for i in want:
            for key in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(got[i][key], want[i][key]), (i, key)
        rep = handle.report()
        assert len(rep.steps) == STEPS
        log = handle._r.overlap.last_log        # the last step's jobs: (unit, kind, early, s)
        kinds = {k for _, k, _, _ in log}
        assert kinds == ({"read"} if clip == "global" else {"step"}), log
        # the worker's work of every step (after the first, under clip global: no state
        # before the first step) began before that step's backward had ended
        early = [s.overlapped_units for s in rep.steps]
        assert handle._r.overlap.backward_end is not None    # "early" is against the end
        assert all(n >= 1 for n in (early[1:] if clip == "global" else early)), early
        for link in ("nvme_write", "nvme_read"):
            # the Llama of transformers with use_cache on moves a few KiB a step more than
            # predicted (docs/benchmarks.md notes it, under every family)
            slack = 64 << 10 if name == "hf-llama" else 0
            assert 0 < rep.predicted_moved[link] <= rep.measured.moved[link] \
                <= rep.predicted_moved[link] + slack, link
        print(f"{name} {family}: units begun before the backward ended {early}; step "
              f"{rep.measured.step_s:.4f} s measured, {rep.predicted['step_s']:.4f} s "
              "predicted")
        assert _files(nvme)
        assert _workers() == []
    finally:
        handle.remove()
    assert _files(nvme) == []
    assert _workers() == []


@pytest.mark.parametrize("family", ["overlapped-none", "paced"])
def test_a_step_split_over_two_runs_hands_units_over_in_the_last(family, tmp_path):
    """``run_micro_batches`` takes at most K micro-batches a call: a step given as two calls of
    one is the same training, and the units are stepped beside the second call's backward
    (where the step's gradients are complete), none in the first."""
    nvme = tmp_path / "nvme"
    model, data, plan = _setup("llama", family, nvme)
    ref, _ = _reference(model, data, "none")
    opt, sched = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    seen = []
    real = handle._r.overlap.pass_starts

    def spy(n):
        real(n)
        seen.append((n, handle._r.overlap.armed))
    handle._r.overlap.pass_starts = spy
    try:
        _train(model, data, opt, sched, "none", handle, per_run=1)
        assert _diff(model.state_dict(), ref.state_dict()) == 0.0
        assert seen == [(1, False), (2, True)] * STEPS
        assert all(s.overlapped_units >= 1 for s in handle.report().steps)
    finally:
        handle.remove()
    assert _files(nvme) == [] and _workers() == []


@pytest.mark.parametrize("family", ["overlapped-none", "paced"])
def test_a_run_returns_with_every_step_beside_its_backward_done(family, tmp_path):
    """Under clip none ``run_micro_batches`` returns, as a batch-major backward does, once the
    steps beside its backward have run: none still reads a gradient the loop gets back (the
    embedding's paced step, five units' overlapped ones, were still running)."""
    model, data, plan = _setup("llama", family, tmp_path / "nvme")
    opt, _ = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    try:
        handle.run_micro_batches(data[:K], _loss)
        jobs = list(handle._r.overlap.jobs)
        assert jobs and all(j.future.done() for j in jobs), \
            [j.unit.name for j in jobs if not j.future.done()]
        opt.step()
        opt.zero_grad()
    finally:
        handle.remove()
    assert _files(tmp_path / "nvme") == [] and _workers() == []


@pytest.mark.parametrize("family", ["overlapped-none", "paced"])
def test_a_second_run_before_opt_step_is_refused_in_one_line(family, tmp_path):
    """The units were stepped beside the first run's backward: more micro-batches before
    ``opt.step()`` cannot reach those steps, so the second run is refused before it starts."""
    nvme = tmp_path / "nvme"
    model, data, plan = _setup("gpt", family, nvme)
    opt, _ = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    try:
        handle.run_micro_batches(data[:K], _loss)
        with pytest.raises(UserError) as e:
            handle.run_micro_batches(data[K:2 * K], _loss)
        line = _one_line(e)
        assert f"forward pass {2 * K} began before opt.step()" in line, line
        opt.step()                     # the first run's step completes
        opt.zero_grad()
        handle.run_micro_batches(data[K:2 * K], _loss)
        opt.step()
    finally:
        handle.remove()
    assert _files(nvme) == [] and _workers() == []


@pytest.mark.parametrize("family", ["overlapped-none", "overlapped-global"])
def test_a_run_that_fails_after_units_were_stepped_is_not_run_again_before_opt_step(
        family, tmp_path):
    """An exception in the middle of a run's backward (here a gradient hook, once): under clip
    none the units above it were already stepped with this step's gradients, so another run
    before ``opt.step()`` is refused in one line (as a batch-major pass K + 1 is), and
    ``opt.step()`` then ``zero_grad()`` lets training go on; under clip global only state was
    read ahead, and the run may be taken again. Nothing is left behind."""
    nvme = tmp_path / "nvme"
    model, data, plan = _setup("llama", family, nvme)
    clip = plan.clip
    opt, _ = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    mid = list(model.blocks[len(model.blocks) // 2].parameters())[0]
    fired = []

    def boom(g):
        if not fired:
            fired.append(1)
            raise RuntimeError("boom")
        return g
    hook = mid.register_hook(boom)
    try:
        with pytest.raises(RuntimeError, match="boom"):
            handle.run_micro_batches(data[:K], _loss)
        stepped = handle._r.overlap.stepped()
        assert stepped == (clip == "none")
        if stepped:
            with pytest.raises(UserError) as e:
                handle.run_micro_batches(data[:K], _loss)
            line = _one_line(e)
            assert "the last backward stopped after" in line and "opt.step()" in line, line
            opt.step()
            opt.zero_grad()
        handle.run_micro_batches(data[K:2 * K], _loss)
        if clip == "global":
            handle.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()
    finally:
        hook.remove()
        handle.remove()
    assert _files(nvme) == [] and _workers() == []


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_run_that_fails_before_its_backward_hands_nothing_over(family, tmp_path):
    """``loss_fn`` raises for the last micro-batch of a step (the run's other forwards done): the
    stages the run then finishes are not a backward, so no unit is handed to the worker, and a
    loop that skips the batch trains exactly as plain PyTorch skipping it."""
    nvme = tmp_path / "nvme"
    model, data, plan = _setup("llama", family, nvme)
    clip = plan.clip
    calls = []

    def loss(m, mb):
        calls.append(1)
        if len(calls) == 2 * K:              # step 1's last micro-batch
            raise RuntimeError("bad batch")
        return _loss(m, mb)

    def train(m, opt, handle=None):
        calls.clear()
        for step in range(STEPS):
            mbs = data[step * K:(step + 1) * K]
            try:
                if handle is None:
                    for mb in mbs:
                        loss(m, mb).backward()
                else:
                    handle.run_micro_batches(mbs, loss)
            except RuntimeError:
                opt.zero_grad()
                continue
            if clip == "global":
                (handle.clip_grad_norm_ if handle else
                 lambda x: torch.nn.utils.clip_grad_norm_(m.parameters(), x))(0.5)
            opt.step()
            opt.zero_grad()
    ref = copy.deepcopy(model)
    ref_opt, _ = _optimizer(ref)
    train(ref, ref_opt)
    opt, _ = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    try:
        train(model, opt, handle)
        assert _diff(model.state_dict(), ref.state_dict()) == 0.0
        # the two steps that ran handed units over beside their backward (clip global: the
        # second, once there is state to read)
        early = [s.overlapped_units for s in handle.report().steps]
        assert len(early) == STEPS - 1 and early[-1] >= 1, early
    finally:
        handle.remove()
    assert _files(nvme) == [] and _workers() == []


def test_a_layer_major_paced_backward_waits_where_the_plan_priced_each_write(tmp_path,
                                                                            monkeypatch):
    """Layer-major paced: a slow update (20 ms a unit) still frees unit j's gradient before
    stage bwd(j) + 3 begins and ends before bwd(j) + 4 (the training thread waits there), as
    under K = 1."""
    model, data, plan = _setup("llama", "paced", tmp_path / "nvme")
    opt, _ = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    r = handle._r
    real = r.phase.step_unit

    def slow(*a, **kw):
        time.sleep(0.02)
        return real(*a, **kw)
    try:
        handle.run_micro_batches(data[:K], _loss)     # the optimizer state exists after it
        opt.step()
        opt.zero_grad()
        monkeypatch.setattr(r.phase, "step_unit", slow)
        handle.run_micro_batches(data[K:2 * K], _loss)
        check_paced_waits(r, plan)
        opt.step()
    finally:
        handle.remove()
