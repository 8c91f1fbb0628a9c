"""Layer streaming on a device that is not host memory (the staged path, runtime/staged.py),
run through the recording backend: the code a CUDA device runs, every copy deferred and
reordered as late as its waits allow. Plans solved for a discrete GPU (h200) whose blocks'
weights, gradients and optimizer state live on the host or on NVMe train exactly like plain
PyTorch (3 optimizer steps of 2 micro-batches, AdamW with weight decay, an LR scheduler,
clipping through the handle), no consumer reads a buffer before its producer's event, and no
file or slab view is left behind. A removed wait is caught."""
from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

from conftest import plan_for
from planner.formats import Home, Tier as T
from planner.models import build_model, load_config, make_inputs
from runtime import apply_plan
from runtime.transfer import using
from runtime.transfer.recording import RecordingBackend

B, S, K, STEPS = 2, 16, 2, 3
# name -> (hardware the plan is solved for, the blocks' home). A discrete GPU's solver puts a
# gradient on NVMe with K > 1 only where the host cannot hold them all, so the gradients'
# accumulation on NVMe runs under a cpu-host plan's homes (its step on the device there is
# taken on the CPU here: the state lives on NVMe).
HOMES = {
    "host": ("h200", Home(T.CPU, T.CPU, T.CPU, T.CPU)),
    "nvme": ("h200", Home(T.NVME, T.CPU, T.NVME, T.CPU)),
    "mixed": ("h200", Home(T.CPU, T.CPU, T.NVME, T.CPU)),
    "state-only": ("h200", Home(T.GPU, T.GPU, T.CPU, T.CPU)),
    # the state on the host, stepped on the device piece by piece (``StagedUnit.step_device``)
    "state-up": ("h200", Home(T.GPU, T.GPU, T.CPU, T.GPU)),
    "grads-on-nvme": ("cpu-host", Home(T.NVME, T.NVME, T.NVME, T.GPU)),
}


def _builtin(name):
    def make():
        cfg = dict(load_config(name), dtype="fp32")
        torch.manual_seed(0)
        model = build_model(cfg, dtype="fp32")
        model.train()
        return model, [make_inputs(cfg, B, S, seed=k) for k in range(STEPS * K)]
    return make


def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97,
                                  n_positions=S)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    model.train()
    data = []
    for k in range(STEPS * K):
        g = torch.Generator().manual_seed(k)
        ids = torch.randint(0, 97, (B, S), generator=g)
        data.append({"input_ids": ids, "labels": ids})
    return model, data


MODELS = {"gpt": _builtin("gpt-tiny"), "llama": _builtin("llama-tiny"), "hf-gpt2": _gpt2}


def _train(model, data, opt, sched, handle=None, clip=True):
    torch.manual_seed(123)               # dropout: the same draws in both runs
    for step in range(STEPS):
        for k in range(K):
            (model(**data[step * K + k]).loss / K).backward()
        if clip:
            if handle is not None:
                handle.clip_grad_norm_(0.5)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()


def _optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _files(path) -> list:
    return [f for _, _, fs in os.walk(path) for f in fs] if os.path.exists(path) else []


def _staged_run(model, data, home, nvme, acts="keep-all", clip=True, be=None):
    be = be or RecordingBackend()
    inputs = data[0]
    hw, h = HOMES[home]
    plan = plan_for(model, acts, B, S, inputs=inputs, nvme_dir=nvme, hardware=hw,
                    homes={"blocks": h}, micro_batches=K)
    plan.hardware["device"] = "cpu"      # the recording backend is the discrete device
    opt, sched = _optimizer(model)
    with using(be):
        handle = apply_plan(model, plan, optimizer=opt)
        _train(model, data, opt, sched, handle, clip=clip)
    return be, handle, opt


def _keep_all_setup(model, ref, data, home, tmp_path):
    """A keep-all plan with ``home`` for every block, run on this CPU through the recording
    backend: (plan, optimizer, the reference's optimizer, backend)."""
    hw, h = HOMES[home]
    plan = plan_for(model, "keep-all", B, S, inputs=data[0], nvme_dir=tmp_path / "nvme",
                    hardware=hw, homes={"blocks": h}, micro_batches=K)
    plan.hardware["device"] = "cpu"
    ropt, _ = _optimizer(ref)
    opt, _ = _optimizer(model)
    return plan, opt, ropt, RecordingBackend()


def _assert_as_plain(model, ref, opt, ropt, be) -> None:
    """Weights and AdamW state exactly plain PyTorch's, and no read before its producer."""
    assert _max_diff(model.state_dict(), ref.state_dict()) == 0.0
    got, want = opt.state_dict()["state"], ropt.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(got[i][key], want[i][key]), (i, key)
    assert be.missing == 0, be.problems[:3]


@pytest.mark.parametrize("home", list(HOMES))
@pytest.mark.parametrize("name", list(MODELS))
def test_staged_streaming_equals_plain_pytorch(name, home, tmp_path):
    model0, data = MODELS[name]()
    ref = copy.deepcopy(model0)
    ropt, rsched = _optimizer(ref)
    _train(ref, data, ropt, rsched)
    model = copy.deepcopy(model0)
    nvme = tmp_path / "nvme"
    be, handle, opt = _staged_run(model, data, home, nvme)
    with using(be):
        _assert_as_plain(model, ref, opt, ropt, be)
        copies = [s for s, op, _ in be.log if op == "copy"]
        assert {"h2d", "d2h"} <= set(copies) and be.ran_ops == sum(c != "compute"
                                                                   for c in copies)
        hw, h = HOMES[home]
        if hw == "h200":
            # every byte the schedule moves per step is moved, and counted, on every link
            rep = handle.report()
            extra = {}
            if h.weights is T.GPU and h.step is T.CPU:
                # weights at home on the device are copied down for the CPU step each step (a
                # load_state_dict between steps is then never undone by a stale host copy):
                # once more than the plan, which keeps the fp32 master on the host
                extra["d2h"] = sum(u.flat.size for u in handle._r.statics.values())
            for link in ("d2h", "h2d", "nvme_write", "nvme_read"):
                assert rep.measured.moved[link] == rep.predicted_moved[link] + extra.get(link, 0), \
                    (link, home)
        if T.NVME in (h.weights, h.grads, h.optimizer):
            assert _files(nvme), "a plan with homes on disk wrote no file"
        handle.remove()
    assert _files(nvme) == []
    assert be.slab.in_use == 0
    # after remove, a plain model: one more step each, the same values
    _train_one = [(model, opt), (ref, ropt)]
    for m, o in _train_one:
        torch.manual_seed(5)
        m(**data[0]).loss.backward()
        o.step()
        o.zero_grad()
    assert _max_diff(model.state_dict(), ref.state_dict()) == 0.0


@pytest.mark.parametrize("acts,home", [("recompute-all", "nvme"), ("cpu", "host"),
                                       ("nvme", "mixed")])
def test_staged_streaming_with_recompute_and_offloaded_activations(acts, home, tmp_path):
    """Streamed weights beside activations recomputed, or offloaded to the host or NVMe, all
    on the same copy streams and the same slab."""
    model0, data = MODELS["gpt"]()
    ref = copy.deepcopy(model0)
    ropt, rsched = _optimizer(ref)
    _train(ref, data, ropt, rsched)
    model = copy.deepcopy(model0)
    if acts in ("cpu", "nvme"):
        acts = [(acts, None)] * len(model0.blocks)
    be, handle, _ = _staged_run(model, data, home, tmp_path / "nvme", acts=acts)
    with using(be):
        assert _max_diff(model.state_dict(), ref.state_dict()) == 0.0
        assert be.missing == 0, be.problems[:3]
        handle.remove()
    assert _files(tmp_path / "nvme") == []
    assert be.slab.in_use == 0


def _staged_plan(model, home, nvme, inputs, micro_batches=K):
    hw, h = HOMES[home]
    plan = plan_for(model, "keep-all", B, S, inputs=inputs, nvme_dir=nvme, hardware=hw,
                    homes={"blocks": h}, micro_batches=micro_batches)
    plan.hardware["device"] = "cpu"
    return plan


@pytest.mark.parametrize("home", ["host", "nvme"])
def test_state_dicts_and_gradients_through_the_staged_path(home, tmp_path):
    """Save under the plan and load into a plain model; load a plain model's values into a
    streamed one (weights into their homes, the optimizer's state onto the host or NVMe) and
    both take the same next step; ``handle.gradients()`` and a placeholder's read give the
    accumulated gradient."""
    model0, data = MODELS["gpt"]()
    ref = copy.deepcopy(model0)
    ropt, rsched = _optimizer(ref)
    _train(ref, data, ropt, rsched)
    model = copy.deepcopy(model0)
    be = RecordingBackend()
    with using(be):
        _, handle, opt = _staged_run(model, data, home, tmp_path / "a", be=be)
        path = tmp_path / "ckpt.pt"
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
        plain = copy.deepcopy(model0)
        ck = torch.load(path)
        plain.load_state_dict(ck["model"])
        assert _max_diff(plain.state_dict(), ref.state_dict()) == 0.0
        popt, _ = _optimizer(plain)
        popt.load_state_dict(ck["opt"])

        fresh = copy.deepcopy(model0)
        fopt, _ = _optimizer(fresh)
        h2 = apply_plan(fresh, _staged_plan(fresh, home, tmp_path / "b", data[0]),
                        optimizer=fopt)
        ck = torch.load(path)
        fresh.load_state_dict(ck["model"])
        fopt.load_state_dict(ck["opt"])
        assert _max_diff(fresh.state_dict(), ref.state_dict()) == 0.0
        # one more step each, the gradients compared before it
        more = [make_inputs(load_config("gpt-tiny"), B, S, seed=100 + k) for k in range(K)]
        for m in (plain, fresh):
            torch.manual_seed(9)
            for d in more:
                (m(**d).loss / K).backward()
        grads = h2.gradients()
        for n, p in plain.named_parameters():
            assert torch.equal(grads[n], p.grad), n
        from runtime.streaming import OffloadedGrad
        held = [(n, q) for n, q in fresh.named_parameters() if isinstance(q.grad, OffloadedGrad)]
        assert held, "no gradient was left at its home"
        n, q = held[0]
        assert torch.equal(q.grad.sum(), dict(plain.named_parameters())[n].grad.sum())
        from planner.errors import UserError
        with pytest.raises(UserError, match="live in host memory under this plan"):
            q.grad.add_(1.0)
        for o in (popt, fopt):
            o.step()
            o.zero_grad()
        assert _max_diff(fresh.state_dict(), plain.state_dict()) == 0.0
        assert be.missing == 0, be.problems[:3]
        for h in (handle, h2):
            h.remove()
    assert _files(tmp_path / "a") == [] and _files(tmp_path / "b") == []
    assert be.slab.in_use == 0


@pytest.mark.parametrize("home", ["host", "nvme", "state-up"])
def test_an_optimizer_with_state_before_apply_plan_through_the_staged_path(home, tmp_path):
    """The state an optimizer holds when the plan is applied (a step taken before it) goes to
    its homes on the staged path too: training goes on as plain PyTorch's, every copy waits
    for its producer, and state at home on the host counts as host bytes from the start."""
    model, data = MODELS["gpt"]()
    ref = copy.deepcopy(model)
    plan, opt, ropt, be = _keep_all_setup(model, ref, data, home, tmp_path)
    for m, o in ((model, opt), (ref, ropt)):
        torch.manual_seed(123)
        for k in range(K):
            (m(**data[k]).loss / K).backward()
        o.step()
        o.zero_grad()
    with using(be):
        handle = apply_plan(model, plan, optimizer=opt)
        try:
            if HOMES[home][1].optimizer is T.CPU:
                state = sum(v.numel() * v.element_size() for s in handle._r.statics.values()
                            for _, p in s.params for v in opt.state[p].values()
                            if isinstance(v, torch.Tensor) and v.numel() > 1)
                assert state and handle._r.counters.host >= state
            for m, o in ((model, opt), (ref, ropt)):
                torch.manual_seed(7)
                for step in range(1, STEPS):
                    for k in range(K):
                        (m(**data[step * K + k]).loss / K).backward()
                    o.step()
                    o.zero_grad()
            _assert_as_plain(model, ref, opt, ropt, be)
        finally:
            handle.remove()
    assert _files(tmp_path / "nvme") == []


def test_a_model_built_on_meta_fills_its_staged_homes_from_a_checkpoint(tmp_path):
    from safetensors.torch import save_model

    from runtime import meta_parameters
    model0, data = MODELS["llama"]()
    ref = copy.deepcopy(model0)
    ropt, rsched = _optimizer(ref)
    _train(ref, data, ropt, rsched)
    ck = tmp_path / "m.safetensors"
    save_model(model0, str(ck))
    with meta_parameters():
        torch.manual_seed(0)
        model = build_model(dict(load_config("llama-tiny"), dtype="fp32"), dtype="fp32")
    model.train()
    be = RecordingBackend()
    opt, sched = _optimizer(model)
    with using(be):
        handle = apply_plan(model, _staged_plan(model0, "nvme", tmp_path / "nv", data[0]),
                            optimizer=opt, checkpoint=ck)
        _train(model, data, opt, sched, handle)
        assert _max_diff(model.state_dict(), ref.state_dict()) == 0.0
        assert be.missing == 0, be.problems[:3]
        handle.remove()
    assert _files(tmp_path / "nv") == []


def test_a_failed_apply_gives_the_host_homes_back(tmp_path, monkeypatch):
    """A checkpoint whose last block cannot be read fails ``apply_plan`` after the first
    block's host homes were taken: one line, and the slab has nothing left in use (its
    memory can go)."""
    from safetensors.torch import save_model

    import runtime.checkpoint as ckpt
    from planner.errors import UserError
    from runtime import meta_parameters
    model0, data = MODELS["gpt"]()
    ck = tmp_path / "m.safetensors"
    save_model(model0, str(ck))
    last = f"blocks.{len(model0.blocks) - 1}."
    fill = ckpt.fill

    def failing(c, name, p):
        if any(n.startswith(last) for n in name):
            raise UserError(f"{ck}: {name} cannot be read (the test's failure)")
        return fill(c, name, p)
    monkeypatch.setattr(ckpt, "fill", failing)
    with meta_parameters():
        torch.manual_seed(0)
        model = build_model(dict(load_config("gpt-tiny"), dtype="fp32"), dtype="fp32")
    be = RecordingBackend()
    with using(be):
        with pytest.raises(UserError, match="the test's failure"):
            apply_plan(model, _staged_plan(model0, "host", tmp_path / "nv", data[0]),
                       optimizer=torch.optim.AdamW(model.parameters()), checkpoint=ck)
    assert be.slab.peak > 0 and be.slab.in_use == 0


class _MyAdamW(torch.optim.AdamW):
    """Not one of the elementwise classes by name: its state on NVMe is stepped whole."""


def test_an_optimizer_not_known_elementwise_steps_its_state_whole(tmp_path):
    model0, data = MODELS["gpt"]()
    ref = copy.deepcopy(model0)
    ropt = _MyAdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    _train(ref, data, ropt, torch.optim.lr_scheduler.StepLR(ropt, 1, gamma=0.5))
    model = copy.deepcopy(model0)
    be = RecordingBackend()
    plan = plan_for(model, "keep-all", B, S, inputs=data[0], nvme_dir=tmp_path / "nvme",
                    hardware="h200", homes={"blocks": HOMES["mixed"][1]}, micro_batches=K)
    plan.hardware["device"] = "cpu"
    opt = _MyAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with using(be):
        with pytest.warns(UserWarning, match="not one of the elementwise"):
            handle = apply_plan(model, plan, optimizer=opt)
        _train(model, data, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), handle)
        assert _max_diff(model.state_dict(), ref.state_dict()) == 0.0
        got, want = opt.state_dict()["state"], ropt.state_dict()["state"]
        assert all(torch.equal(got[i]["exp_avg_sq"], want[i]["exp_avg_sq"]) for i in want)
        assert be.missing == 0, be.problems[:3]
        handle.remove()
    assert _files(tmp_path / "nvme") == []


@pytest.mark.parametrize("home", ["host", "state-up"])
def test_a_dropped_wait_is_caught(home, tmp_path):
    """The compute stream no longer waits for the ``h2d`` copies: of the weights (host home),
    or, for state on the host stepped on the device (state up: the weights never move), of
    the step's state pieces. The check counts missing waits (whatever is then read)."""
    model, data = MODELS["gpt"]()
    be = RecordingBackend()
    be.drop_waits.add("compute")
    # garbage may reach autograd and raise: the count of missing waits is the check
    with contextlib.suppress(Exception):
        _staged_run(model, data, home, tmp_path / "nvme", be=be)
    assert be.missing > 0
    assert any("compute use" in p or (home == "host" and "freed before it ran" in p)
               for p in be.problems), be.problems[:3]


def test_a_host_home_on_a_cpu_device_is_refused_in_one_line():
    from runtime.binding import PlanMismatchError
    model, data = MODELS["gpt"]()
    plan = plan_for(model, "keep-all", B, S, inputs=data[0], hardware="h200",
                    homes={"blocks": HOMES["host"][1]}, micro_batches=K)
    plan.hardware["device"] = "cpu"
    with pytest.raises(PlanMismatchError, match="host memory, which needs a device"):
        apply_plan(model, plan, optimizer=torch.optim.AdamW(model.parameters()))


def test_state_on_the_device_with_weights_off_it_is_refused_on_a_staged_device(tmp_path):
    """A unified spec's home that keeps the state on the device and the weights on NVMe has no
    staged step (a discrete spec's solver never offers it): one line naming the fix."""
    from planner.errors import UserError
    model, data = MODELS["gpt"]()
    plan = plan_for(model, "keep-all", B, S, inputs=data[0], nvme_dir=tmp_path / "nv",
                    homes={"blocks": Home(T.NVME, T.NVME, T.GPU, T.GPU)}, micro_batches=K)
    plan.hardware["device"] = "cpu"
    with using(RecordingBackend()):
        with pytest.raises(UserError, match="re-solve the plan for this hardware"):
            apply_plan(model, plan, optimizer=torch.optim.AdamW(model.parameters()))
    assert _files(tmp_path / "nv") == []


@pytest.mark.cuda
def test_staged_streaming_on_cuda(tmp_path):
    """The same loop on a CUDA device, the real copy streams: weights within float tolerance
    of plain PyTorch on the same device (the step runs on the CPU there, or for the state-up
    home on the device, its state coming up from pinned host memory)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for home in ("host", "nvme", "state-up"):
        model0, data = MODELS["gpt"]()
        model0 = model0.cuda()
        data = [{k: v.cuda() for k, v in d.items()} for d in data]
        ref = copy.deepcopy(model0)
        ropt, rsched = _optimizer(ref)
        _train(ref, data, ropt, rsched)
        model = copy.deepcopy(model0)
        plan = plan_for(model, "keep-all", B, S, inputs=data[0], nvme_dir=tmp_path / home,
                        hardware="h200", homes={"blocks": HOMES[home][1]}, micro_batches=K)
        opt, sched = _optimizer(model)
        handle = apply_plan(model, plan, optimizer=opt)
        _train(model, data, opt, sched, handle)
        assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-4
        handle.remove()
        assert _files(tmp_path / home) == []


def _overlapped_run(model, data, home, nvme, clip, be):
    """A discrete device's plan for ``home``, executed with the optimizer beside the backward
    (``optimizer_overlap`` relabelled: a schedule every plan admits), under ``clip``; under
    clip global every streamed unit's state on NVMe may be read ahead."""
    import dataclasses
    hw, h = HOMES[home]
    plan = plan_for(model, "keep-all", B, S, inputs=data[0], nvme_dir=nvme, hardware=hw,
                    homes={"blocks": h}, micro_batches=K)
    plan.hardware["device"] = "cpu"      # the recording backend is the discrete device
    ahead = sum(u.optimizer_bytes for u, d in zip(plan.units, plan.layers)
                if d.home.optimizer is T.NVME) if clip == "global" else 0
    plan = dataclasses.replace(plan, optimizer_overlap="overlapped", clip=clip,
                               optimizer_prefetch_bytes=ahead)
    opt, sched = _optimizer(model)
    with using(be):
        handle = apply_plan(model, plan, optimizer=opt)
        _train(model, data, opt, sched, handle, clip=clip == "global")
    return plan, handle, opt


@pytest.mark.parametrize("clip", ["none", "global"])
@pytest.mark.parametrize("name,home", [("gpt", "host"), ("gpt", "nvme"), ("llama", "mixed"),
                                       ("llama", "nvme"), ("hf-gpt2", "nvme"),
                                       ("gpt", "state-only"), ("llama", "state-up")])
def test_overlapped_staged_training_equals_plain_pytorch(name, home, clip, tmp_path):
    """The optimizer beside the backward on the staged path: the worker thread steps each
    unit on the CPU over its host weights (clip none) or reads its state ahead (clip global)
    while the training thread's backward goes on; weights and state bit for bit those of
    plain PyTorch, no missing wait, no file, slab view or worker thread left."""
    from runtime.overlap import WORKER_THREAD
    import threading
    model0, data = MODELS[name]()
    ref = copy.deepcopy(model0)
    ropt, rsched = _optimizer(ref)
    _train(ref, data, ropt, rsched, clip=clip == "global")
    model = copy.deepcopy(model0)
    nvme = tmp_path / "nvme"
    be = RecordingBackend()
    plan, handle, opt = _overlapped_run(model, data, home, nvme, clip, be)
    with using(be):
        log = handle._r.overlap.last_log
        kinds = {k for _, k, _, _ in log}
        h = HOMES[home][1]
        # a unit whose gradients stay on the device is stepped beside the backward too, once
        # its backward stage is over
        want_kinds = {"step"} if clip == "none" else \
            ({"read"} if h.optimizer is T.NVME else set())
        assert kinds == want_kinds, log
        # what was read ahead was used by the step and let go there: none of it is held into
        # the next step's forward (a host-stepped unit once kept it)
        assert not [u.name for u in handle._r.statics.values() if u.ahead]
        _assert_as_plain(model, ref, opt, ropt, be)
        assert not [t for t in threading.enumerate() if t.name == WORKER_THREAD]
        handle.remove()
    assert _files(nvme) == []
    assert be.slab.in_use == 0


@pytest.mark.parametrize("home", ["state-up", "state-only"])
def test_a_clip_of_gradients_kept_on_the_device_after_their_early_step_is_refused(home,
                                                                                tmp_path):
    """Under clip none a unit whose gradients stay on the device is stepped once its
    backward is over; torch's clip in the loop after that would change gradients the step
    already used: opt.step() refuses in one line naming --clip global."""
    import dataclasses
    from planner.formats import UserError
    model, data = MODELS["gpt"]()
    be = RecordingBackend()
    with pytest.raises(UserError, match="changed after its unit's backward.*--clip global"):
        with using(be):
            hw, h = HOMES[home]
            plan = plan_for(model, "keep-all", B, S, inputs=data[0], nvme_dir=tmp_path / "n",
                            hardware=hw, homes={"blocks": h}, micro_batches=K)
            plan.hardware["device"] = "cpu"
            plan = dataclasses.replace(plan, optimizer_overlap="overlapped", clip="none")
            opt, sched = _optimizer(model)
            handle = apply_plan(model, plan, optimizer=opt)
            try:
                _train(model, data, opt, sched, None, clip=True)   # torch's own clip
            finally:
                handle.remove()


def test_a_dropped_wait_is_caught_under_an_overlapped_plan(tmp_path):
    """Under clip none the worker steps host-homed weights in place; the next step's forward
    must wait for their ``h2d`` copies up. Dropped there, the check counts it."""
    model, data = MODELS["gpt"]()
    be = RecordingBackend()
    be.drop_waits.add("compute")
    # garbage may reach autograd and raise: the count of missing waits is the check
    with contextlib.suppress(Exception):
        _overlapped_run(model, data, "host", tmp_path / "nvme", "none", be)
    assert be.missing > 0, be.problems[:3]


@pytest.mark.parametrize("fail_at", ["weights", "gradients"])
def test_a_failed_disk_read_gives_the_staging_views_back(fail_at, tmp_path, monkeypatch):
    """A read of the NVMe tier that fails mid-step (a weight fetch, or a gradient accumulator
    read back) raises; once the handle is removed nothing of the slab is in use and no file
    is left (a view lost on that path kept the pinned slab for the process's life)."""
    from runtime import staged
    model0, data = MODELS["gpt"]()
    model = copy.deepcopy(model0)
    nvme = tmp_path / "nvme"
    plan = _staged_plan(model0, "nvme" if fail_at == "weights" else "grads-on-nvme", nvme,
                        data[0])
    be = RecordingBackend()
    opt, _ = _optimizer(model)
    real = staged.StagedUnit._pread
    calls = {"n": 0}

    def flaky(self, fd, mv, off, sums):
        which = "gradients" if fd == self.g_fd else "weights"
        if which == fail_at:
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(5, "Input/output error (the test's failure)")
        return real(self, fd, mv, off, sums)
    monkeypatch.setattr(staged.StagedUnit, "_pread", flaky)
    with using(be):
        handle = apply_plan(model, plan, optimizer=opt)
        with pytest.raises(Exception, match="the test's failure"):
            for k in range(STEPS * K):
                (model(**data[k]).loss / K).backward()
                if k % K == K - 1:
                    opt.step()
                    opt.zero_grad()
        handle.remove()
    assert calls["n"] >= 3
    assert be.slab.in_use == 0
    assert not _files(nvme)


def test_a_capturable_optimizer_is_refused_where_units_step_on_the_cpu(tmp_path):
    """capturable=True is for device tensors: the staged path's CPU step would fail half way
    through opt.step() with some units stepped; apply_plan refuses it in one line instead."""
    from planner.errors import UserError
    model, data = MODELS["gpt"]()
    plan = _staged_plan(model, "host", tmp_path / "nvme", data[0])
    opt = torch.optim.AdamW(model.parameters(), capturable=True)
    with using(RecordingBackend()), pytest.raises(UserError) as e:
        apply_plan(model, plan, optimizer=opt)
    assert "\n" not in str(e.value) and "capturable" in str(e.value)


def test_more_micro_batches_than_a_layer_major_plan_holds_are_refused(tmp_path):
    """Layer-major holds each unit's activations of every micro-batch at once: a call with
    more than the plan's K is refused in one line naming both fixes."""
    import dataclasses

    from planner.errors import UserError
    model, data = MODELS["llama"]()
    plan = dataclasses.replace(_staged_plan(model, "host", tmp_path / "nvme", data[0]),
                               micro_batch_order="layer-major")
    opt, _ = _optimizer(model)
    with using(RecordingBackend()):
        handle = apply_plan(model, plan, optimizer=opt)
        try:
            with pytest.raises(UserError) as e:
                handle.run_micro_batches(data[:K + 1], lambda m, mb: m(**mb).loss)
            assert "\n" not in str(e.value) and f"--micro-batches {K + 1}" in str(e.value)
            handle.run_micro_batches(data[:K], lambda m, mb: m(**mb).loss / K)   # K is fine
            opt.step()
        finally:
            handle.remove()


@pytest.mark.parametrize("home", ["host", "grads-on-nvme"])
def test_a_gradient_zeroed_in_place_accumulates_as_pytorch_does(home, tmp_path):
    """``opt.zero_grad(set_to_none=False)`` zeroes the gradients in place; PyTorch's next
    backward adds into those zeros, so a -0.0 of the new gradient (dropout's masked entries
    times a negative upstream gradient; here a hook on every parameter puts a -0.0 in its
    first entry) becomes +0.0. The gradient at home has the same bits, signs of zeros
    included."""
    model0, data = MODELS["gpt"]()
    ref, model = copy.deepcopy(model0), copy.deepcopy(model0)

    def negzero(g):
        g = g.clone()
        g.view(-1)[0] = -0.0
        return g
    for m in (ref, model):
        for p in m.parameters():
            p.register_hook(negzero)
    plan, opt, ropt, be = _keep_all_setup(model, ref, data, home, tmp_path)

    def grads(m, handle=None):
        for step in range(2):
            torch.manual_seed(7 + step)
            for k in range(K):
                (m(**data[k]).loss / K).backward()
            if step == 0:
                (opt if handle is not None else ropt).zero_grad(set_to_none=False)
        if handle is not None:
            g = handle.gradients()
            return {n: g[n].clone() for n, _ in m.named_parameters() if g.get(n) is not None}
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    want = grads(ref)
    with using(be):
        handle = apply_plan(model, plan, optimizer=opt)
        got = grads(model, handle)
        handle.remove()
    assert got.keys() == want.keys()
    for n in want:
        assert not torch.signbit(want[n].view(-1)[0]), n      # PyTorch: +0.0
        assert torch.equal(got[n], want[n]), n
        assert torch.equal(torch.signbit(got[n]), torch.signbit(want[n])), n
    assert be.missing == 0, be.problems[:3]


@pytest.mark.parametrize("home", ["host", "grads-on-nvme"])
def test_a_clip_between_micro_batches_scales_the_accumulator_exactly(home, tmp_path,
                                                                    monkeypatch):
    """A clip after the first micro-batch scales the gradients at home; the scale (a device
    tensor) reaches the host job on ``d2h`` behind the gradients' event, and the second
    micro-batch accumulates into the scaled value: bits equal to plain PyTorch's, no missing
    wait."""
    model0, data = MODELS["gpt"]()
    ref, model = copy.deepcopy(model0), copy.deepcopy(model0)
    plan, opt, ropt, be = _keep_all_setup(model, ref, data, home, tmp_path)

    def run(m, o, clip):
        for step in range(2):
            torch.manual_seed(11 + step)
            for k in range(K):
                (m(**data[k]).loss / K).backward()
                clip(0.05)               # after every micro-batch: the next adds into it
            o.step()
            o.zero_grad()
    run(ref, ropt, lambda c: torch.nn.utils.clip_grad_norm_(ref.parameters(), c))
    from runtime.staged import StagedUnit
    real, seen = StagedUnit._accumulate_staged, []

    def spy(self, staged, ev, last, scales):
        seen.extend(f for fs in scales.values() for f in fs if isinstance(f, torch.Tensor))
        return real(self, staged, ev, last, scales)
    monkeypatch.setattr(StagedUnit, "_accumulate_staged", spy)
    with using(be):
        handle = apply_plan(model, plan, optimizer=opt)
        run(model, opt, handle.clip_grad_norm_)
        assert seen, "no scale reached a host job"
        assert _max_diff(model.state_dict(), ref.state_dict()) == 0.0
        handle.remove()
    assert be.missing == 0, be.problems[:3]
    assert be.slab.in_use == 0


class _GatedBlock(torch.nn.Module):
    """A block with a 0-dim parameter (a ReZero gate) and a one-element one."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)
        self.gate = torch.nn.Parameter(torch.tensor(0.5))
        self.shift = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return x + self.gate * torch.tanh(self.lin(x)) + self.shift


class _GatedNet(torch.nn.Module):
    def __init__(self, d=8, n=3):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.blocks = torch.nn.ModuleList(_GatedBlock(d) for _ in range(n))
        self.out = torch.nn.Linear(d, 1)

    def forward(self, x, y):
        import types
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return types.SimpleNamespace(loss=((self.out(h).squeeze(-1) - y) ** 2).mean())


def _gated_optimizer(model, kind):
    if kind == "adafactor":        # not elementwise: a matrix's second moment is factored
        return torch.optim.Adafactor(model.parameters(), lr=1e-2)
    mats = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() != 2]
    return torch.optim.AdamW([{"params": mats, "lr": 1e-2, "amsgrad": True},
                              {"params": rest, "lr": 3e-3, "weight_decay": 0.0}])


def _gated_case(device, tmp_path):
    """(reference, model, data, the state-up plan for every block) on ``device``."""
    torch.manual_seed(0)
    model0 = _GatedNet().to(device)
    data = []
    for k in range(STEPS * K):
        g = torch.Generator().manual_seed(k)
        data.append({"x": torch.randn(B, S, 8, generator=g).to(device),
                     "y": torch.randn(B, S, generator=g).to(device)})
    ref, model = copy.deepcopy(model0), copy.deepcopy(model0)
    plan = plan_for(model, "keep-all", B, S, inputs=data[0], nvme_dir=tmp_path / "nvme",
                    hardware="h200", homes={"blocks": HOMES["state-up"][1]}, micro_batches=K)
    return ref, model, data, plan


def _gated_train(m, opt, data):
    """STEPS steps of K micro-batches, a load_state_dict of the optimizer after the second."""
    for step in range(STEPS):
        for k in range(K):
            (m(**data[step * K + k]).loss / K).backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            opt.load_state_dict(opt.state_dict())


@pytest.mark.parametrize("kind", ["adamw-groups", "adafactor"])
def test_state_up_steps_as_plain_pytorch_for_scalars_groups_and_factored_state(kind, tmp_path):
    """The state-up home with 0-dim and one-element parameters, two param groups (amsgrad in
    one) or an optimizer that is not elementwise (Adafactor), and a load_state_dict between
    steps: weights and every state tensor (values, shapes, devices) as plain PyTorch's, and
    after ``remove`` a plain step of each still agrees."""
    ref, model, data, plan = _gated_case("cpu", tmp_path)
    plan.hardware["device"] = "cpu"
    ropt = _gated_optimizer(ref, kind)
    _gated_train(ref, ropt, data)
    opt, be = _gated_optimizer(model, kind), RecordingBackend()
    with using(be):
        import warnings
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            handle = apply_plan(model, plan, optimizer=opt)
        # a whole unit's state on the device at once: more than the plan's one piece, said
        assert any("whole state comes to the device" in str(w.message) for w in seen) == \
            (kind == "adafactor")
        _gated_train(model, opt, data)
        assert _max_diff(model.state_dict(), ref.state_dict()) == 0.0
        got, want = opt.state_dict()["state"], ropt.state_dict()["state"]
        assert got.keys() == want.keys()
        for i in want:
            assert got[i].keys() == want[i].keys(), i
            for key, w in want[i].items():
                g = got[i][key]
                if isinstance(w, torch.Tensor):
                    assert g.shape == w.shape and g.device == w.device, (i, key)
                    assert torch.equal(g, w), (i, key)
                else:
                    assert g == w, (i, key)
        assert be.missing == 0, be.problems[:3]
        # after the load_state_dict the state is back in its pinned homes, one per tensor
        units = [u for u in handle._r.statics.values() if getattr(u, "state_up", False)]
        assert units and all(u.state_slots for u in units)
        for u in units:
            for (k, key), home in u.state_slots.items():
                assert opt.state[u.params[k][1]][key] is home, (u.name, k, key)
        handle.remove()
    for m, o in ((model, opt), (ref, ropt)):
        m(**data[0]).loss.backward()
        o.step()
        o.zero_grad()
    assert _max_diff(model.state_dict(), ref.state_dict()) == 0.0


@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["adamw-groups", "adafactor"])
def test_state_up_with_scalars_and_factored_state_on_cuda(kind, tmp_path):
    """The same on a CUDA device, the real copy streams: weights and state values within
    float tolerance of plain PyTorch on the device (the state lives on the host by the plan),
    one more plain step after ``remove`` still agrees."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    ref, model, data, plan = _gated_case("cuda", tmp_path)
    ropt = _gated_optimizer(ref, kind)
    _gated_train(ref, ropt, data)
    opt = _gated_optimizer(model, kind)
    handle = apply_plan(model, plan, optimizer=opt)
    _gated_train(model, opt, data)
    assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-6
    got, want = opt.state_dict()["state"], ropt.state_dict()["state"]
    for i in want:
        for key, w in want[i].items():
            if isinstance(w, torch.Tensor):
                assert got[i][key].shape == w.shape, (i, key)
                assert torch.allclose(got[i][key].to(w.device), w, atol=1e-6), (i, key)
    handle.remove()
    for m, o in ((model, opt), (ref, ropt)):
        m(**data[0]).loss.backward()
        o.step()
        o.zero_grad()
    assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-6


@pytest.mark.parametrize("name,home", [("gpt", "state-only"), ("llama", "state-up"),
                                       ("llama", "host")])
def test_paced_staged_training_equals_plain_pytorch(name, home, tmp_path):
    """The paced optimizer on the staged path, one pass per step: each unit stepped by the
    worker as its backward ends (on the host over its host weights, or its state brought up),
    the backward waiting for it three stages on, its device gradient freed by the step; bits
    those of plain PyTorch, no missing wait, no file, slab view or worker thread left."""
    import dataclasses
    import threading
    from runtime.overlap import WORKER_THREAD, SteppedGrad
    model0, data = MODELS[name]()

    def train(m, opt, sched, seen=None, handle=None):
        torch.manual_seed(123)
        for step in range(STEPS):
            m(**data[step]).loss.backward()
            if seen is not None:
                handle._r.quiesce()          # the steps not yet due are ended too
                seen.append(sum(isinstance(p.grad, SteppedGrad) for p in m.parameters()))
            opt.step()
            sched.step()
            opt.zero_grad()
    ref = copy.deepcopy(model0)
    ropt, rsched = _optimizer(ref)
    train(ref, ropt, rsched)
    model = copy.deepcopy(model0)
    nvme = tmp_path / "nvme"
    be = RecordingBackend()
    h = HOMES[home][1]
    plan = dataclasses.replace(_staged_plan(model, home, nvme, data[0], micro_batches=1),
                               optimizer_overlap="paced", clip="none")
    opt, sched = _optimizer(model)
    seen: list = []
    with using(be):
        handle = apply_plan(model, plan, optimizer=opt)
        handle._r.quiesce()
        train(model, opt, sched, seen, handle)
        log = handle._r.overlap.last_log
        assert {k for _, k, _, _ in log} == {"step"} and len(log) >= 2, log
        # a gradient kept on the device is freed by its step; one sent home has none there
        stepped = {n for n, _, _, _ in log}
        kept = sum(len(u.params) for u in handle._r.statics.values()
                   if u.name in stepped and not u.grads_out)
        assert seen == [kept] * STEPS and (kept > 0) == (h.grads is T.GPU), (seen, kept)
        _assert_as_plain(model, ref, opt, ropt, be)
        assert not [t for t in threading.enumerate() if t.name == WORKER_THREAD]
        handle.remove()
    assert _files(nvme) == []
    assert be.slab.in_use == 0


@pytest.mark.parametrize("home", ["state-up", "state-only"])
def test_a_clip_that_does_not_clip_gradients_kept_on_the_device_is_accepted(home, tmp_path,
                                                                            monkeypatch):
    """The same loop as above with a max_norm above the total norm: torch's clip scales each
    kept gradient by exactly 1 (its version moves, its norm does not), which changes no step
    that ran: accepted, bit for bit plain PyTorch."""
    import dataclasses
    model0, data = MODELS["gpt"]()
    ref = copy.deepcopy(model0)
    ropt, rsched = _optimizer(ref)
    model = copy.deepcopy(model0)
    be = RecordingBackend()
    plan = dataclasses.replace(_staged_plan(model, home, tmp_path / "n", data[0]),
                               optimizer_overlap="overlapped", clip="none")
    opt, sched = _optimizer(model)
    real = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_",
                        lambda ps, _n, *a, **k: real(ps, 1e9, *a, **k))
    _train(ref, data, ropt, rsched, None, clip=True)
    with using(be):
        handle = apply_plan(model, plan, optimizer=opt)
        try:
            _train(model, data, opt, sched, None, clip=True)   # torch's own clip, max 1e9
        finally:
            handle.remove()
    _assert_as_plain(model, ref, opt, ropt, be)
