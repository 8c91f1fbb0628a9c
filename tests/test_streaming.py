"""Layer streaming on a CPU host: weights, gradients and optimizer state homed on the NVMe tier
(the local disk here) train exactly like plain PyTorch, state dicts give and take the real
values wherever they live, and nothing is left on disk.

The user's loop is the ordinary one: gradient accumulation over micro-batches, clipping through
the handle, an LR scheduler, AdamW with weight decay, dropout on (gpt-tiny has 0.1).
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from planner.formats import Home, Tier as T
from planner.models import build_model, load_config, make_inputs
from runtime import apply_plan
from runtime.streaming import OffloadedGrad

from conftest import plan_for

B, S, K, STEPS = 2, 16, 2, 3
HOMES = {
    "all-on-disk": Home(T.NVME, T.NVME, T.NVME, T.GPU),
    "state-on-disk": Home(T.GPU, T.GPU, T.NVME, T.GPU),
    "weights-and-grads-on-disk": Home(T.NVME, T.NVME, T.GPU, T.GPU),
}


def _model():
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    torch.manual_seed(0)
    model = build_model(cfg, dtype="fp32")
    model.train()
    return cfg, model


def _train(model, data, opt, sched, handle=None, steps=STEPS):
    torch.manual_seed(123)               # dropout masks: the same draws in both runs
    for step in range(steps):
        for k in range(K):
            (model(**data[step * K + k]).loss / K).backward()
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


@pytest.fixture(scope="module")
def reference():
    cfg, model = _model()
    data = [make_inputs(cfg, B, S, seed=k) for k in range(STEPS * K)]
    ref = copy.deepcopy(model)
    opt, sched = _optimizer(ref)
    _train(ref, data, opt, sched)
    return cfg, model, data, ref, opt


@pytest.mark.parametrize("home", list(HOMES))
@pytest.mark.parametrize("acts", ["keep-all", "recompute-all"])
def test_streamed_training_equals_plain_pytorch(reference, home, acts, tmp_path):
    cfg, model0, data, ref, ref_opt = reference
    model = copy.deepcopy(model0)
    nvme = tmp_path / "nvme"
    plan = plan_for(model, acts, B, S, nvme_dir=nvme, homes={"blocks": HOMES[home]},
                    micro_batches=K)
    opt, sched = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    _train(model, data, opt, sched, handle)
    # weights and optimizer state, read wherever they live
    assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-6
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert (got[i][key] - want[i][key]).abs().max().item() <= 1e-6, (i, key)
    assert _files(nvme), "a plan with homes on disk wrote no file"
    # every byte the schedule moves per step is moved, and counted (weights written back
    # after the step were once left out of the count)
    rep = handle.report()
    for link in ("nvme_write", "nvme_read"):
        assert rep.measured.moved[link] == rep.predicted_moved[link] > 0, (link, home, acts)
    # the state on the device before a step, the handle's optimizer's included (it was left
    # out: it ends the step itself, so it was never among the optimizers seen stepping)
    assert rep.measured.static_bytes == pytest.approx(rep.predicted_static_bytes, rel=0.01)
    handle.remove()
    assert _files(nvme) == []
    # after remove the model is a plain model holding the trained values
    assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-6


def test_state_dict_round_trip_between_streamed_and_plain_models(reference, tmp_path):
    cfg, model0, data, ref, _ = reference
    model = copy.deepcopy(model0)
    plan = plan_for(model, "keep-all", B, S, nvme_dir=tmp_path / "nvme",
                    homes={"blocks": HOMES["all-on-disk"]}, micro_batches=K)
    opt, sched = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    _train(model, data, opt, sched, handle)
    # save under the plan, load into a plain model: the same weights as plain training
    path = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, path)
    ck = torch.load(path)
    plain = copy.deepcopy(model0)
    plain.load_state_dict(ck["model"])
    assert _max_diff(plain.state_dict(), ref.state_dict()) <= 1e-6
    popt, _ = _optimizer(plain)
    popt.load_state_dict(ck["opt"])

    # and back: a streamed model loads the plain one's values into its homes, and both then
    # take the same next step
    fresh = copy.deepcopy(model0)
    plan2 = plan_for(fresh, "keep-all", B, S, nvme_dir=tmp_path / "nvme2",
                     homes={"blocks": HOMES["all-on-disk"]}, micro_batches=K)
    fopt, fsched = _optimizer(fresh)
    h2 = apply_plan(fresh, plan2, optimizer=fopt)
    ck = torch.load(path)      # its own tensors: an optimizer keeps the loaded ones it can
    fresh.load_state_dict(ck["model"])
    fopt.load_state_dict(ck["opt"])
    assert _max_diff(fresh.state_dict(), ref.state_dict()) <= 1e-6
    more = [make_inputs(cfg, B, S, seed=100 + k) for k in range(K)]
    _train(plain, more, popt, torch.optim.lr_scheduler.StepLR(popt, 1), steps=1)
    _train(fresh, more, fopt, torch.optim.lr_scheduler.StepLR(fopt, 1), h2, steps=1)
    assert _max_diff(fresh.state_dict(), plain.state_dict()) <= 1e-6
    for h in (handle, h2):
        h.remove()
    assert _files(tmp_path / "nvme") == [] and _files(tmp_path / "nvme2") == []


def test_gradients_on_disk_are_read_through_the_handle_not_used_by_mistake(reference,
                                                                         tmp_path):
    cfg, model0, data, _, _ = reference
    model = copy.deepcopy(model0)
    plain = copy.deepcopy(model0)
    plan = plan_for(model, "keep-all", B, S, nvme_dir=tmp_path / "nvme",
                    homes={"blocks": HOMES["all-on-disk"]})
    opt, _ = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    torch.manual_seed(5)
    model(**data[0]).loss.backward()
    torch.manual_seed(5)
    plain(**data[0]).loss.backward()
    grads = handle.gradients()
    for n, p in plain.named_parameters():
        assert (grads[n] - p.grad).abs().max().item() <= 1e-6, n
    offloaded = [(n, q) for n, q in model.named_parameters() if isinstance(q.grad, OffloadedGrad)]
    assert offloaded, "no gradient was left on disk"
    # a gradient on disk reads as the tensor it stands for; writing into it is refused
    n, q = offloaded[0]
    assert torch.equal(q.grad.sum(), dict(plain.named_parameters())[n].grad.sum())
    with pytest.raises(Exception, match="handle.gradients"):
        q.grad.copy_(torch.zeros_like(q))
    handle.remove()
    assert _files(tmp_path / "nvme") == []


def test_exception_mid_step_leaves_no_file(reference, tmp_path):
    cfg, model0, data, _, _ = reference
    model = copy.deepcopy(model0)
    nvme = tmp_path / "nvme"
    plan = plan_for(model, "keep-all", B, S, nvme_dir=nvme, homes={"blocks": HOMES["all-on-disk"]})
    opt, _ = _optimizer(model)
    boom = RuntimeError("injected")

    def fail(*_):
        raise boom
    with pytest.raises(RuntimeError, match="injected"):
        with apply_plan(model, plan, optimizer=opt):
            model.blocks[1].register_forward_hook(fail)
            model(**data[0]).loss.backward()
    assert _files(nvme) == []


class _ReadLog:
    """Wraps ``UnitStatic._read_slices``: the most state bytes one piece read at once."""

    def __init__(self, monkeypatch):
        from runtime import streaming
        self.most = 0
        real = streaming.UnitStatic._read_slices

        def read(us, reads):
            self.most = max(self.most, sum(t.numel() * t.element_size() for _, t in reads))
            return real(us, reads)
        monkeypatch.setattr(streaming.UnitStatic, "_read_slices", read)


@pytest.mark.parametrize("make,piece,align", [
    (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True), 512, 16),
    (lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True), 512, 16),
    # slices at no alignment: 382 elements on the first step (state guessed at 8 B per
    # element), 255 once it is known (12 B): the layout changes between steps, and a
    # 256-element tensor ends in a one-element slice
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
                 3060, 1, marks=pytest.mark.slow),          # ~2,400 pieces: a minute
], ids=["adamw-amsgrad", "sgd-nesterov", "unaligned-slices"])
def test_state_on_disk_is_stepped_in_pieces_exactly(reference, make, piece, align, tmp_path,
                                                    monkeypatch):
    """A unit's optimizer state on disk is read, stepped and written one piece at a time
    (whole small tensors, slices of a large one) and the training equals plain PyTorch: here
    the pieces are made tiny (hundreds of bytes of state) so that every tensor of gpt-tiny,
    the tied embedding too, is cut into many; the step count and LR schedule hold."""
    from runtime import streaming
    monkeypatch.setattr(streaming, "STEP_PIECE_BYTES", piece)
    monkeypatch.setattr(streaming, "STEP_PIECE_ALIGN", align)
    log = _ReadLog(monkeypatch)
    cfg, model0, data, _, _ = reference
    ref, model = copy.deepcopy(model0), copy.deepcopy(model0)
    ref_opt = make(ref.parameters())
    _train(ref, data, ref_opt, torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5))
    nvme = tmp_path / "nvme"
    plan = plan_for(model, "keep-all", B, S, nvme_dir=nvme, micro_batches=K,
                    homes={"blocks": HOMES["all-on-disk"],
                           "embedding": Home(T.GPU, T.GPU, T.NVME, T.GPU)})
    opt = make(model.parameters())
    handle = apply_plan(model, plan, optimizer=opt)
    _train(model, data, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), handle)
    assert _max_diff(model.state_dict(), ref.state_dict()) == 0.0
    got, want = opt.state_dict()["state"], ref_opt.state_dict()["state"]
    assert got.keys() == want.keys()
    for i in want:
        assert want[i].keys() == got[i].keys()
        for key in want[i]:
            assert torch.equal(torch.as_tensor(got[i][key]), torch.as_tensor(want[i][key])), (i, key)
    per = max(sum(v.element_size() for v in st.values()         # state bytes per element
                  if isinstance(v, torch.Tensor) and v.numel() > 1)
              for st in ref_opt.state.values())
    assert 0 < log.most <= max(piece, align * per), log.most
    handle.remove()
    assert _files(nvme) == []


def test_an_optimizer_not_known_elementwise_is_stepped_whole_with_a_warning(reference,
                                                                            tmp_path):
    class MyAdamW(torch.optim.AdamW):
        """A subclass: its step may differ from AdamW's, so it is not stepped in pieces."""
    cfg, model0, data, ref, ref_opt = reference
    model = copy.deepcopy(model0)
    plan = plan_for(model, "keep-all", B, S, nvme_dir=tmp_path / "nvme", micro_batches=K,
                    homes={"blocks": HOMES["state-on-disk"]})
    opt = MyAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    with pytest.warns(UserWarning, match="not one of the elementwise"):
        handle = apply_plan(model, plan, optimizer=opt)
    _train(model, data, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5), handle)
    assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-6
    handle.remove()


def _save(model, path):
    from safetensors.torch import save_model
    save_model(model, str(path))          # a tied weight is stored once, under one of its names


def test_a_model_built_on_meta_is_filled_from_a_checkpoint_into_its_homes(reference, tmp_path):
    """Parameters on the meta device (buffers real: the rotary tables are computed at
    construction), filled by apply_plan from a safetensors file, streamed units straight into
    their files: training then equals plain PyTorch's from the same weights."""
    from runtime import meta_parameters
    cfg, model0, data, ref, ref_opt = reference
    ck = tmp_path / "model.safetensors"
    _save(model0, ck)
    with meta_parameters():
        torch.manual_seed(0)
        model = build_model(cfg, dtype="fp32")
    model.train()
    assert all(p.device.type == "meta" for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    nvme = tmp_path / "nvme"
    plan = plan_for(model0, "keep-all", B, S, nvme_dir=nvme, micro_batches=K,
                    homes={"blocks": HOMES["all-on-disk"]})
    opt, sched = _optimizer(model)              # built on the meta parameters: the same objects
    handle = apply_plan(model, plan, optimizer=opt, checkpoint=ck)
    streamed = [p for n, p in model.named_parameters() if n.startswith("blocks.")]
    assert streamed and all(p.untyped_storage().nbytes() == 0 for p in streamed)
    assert all(p.device.type == "cpu" for p in model.parameters())
    _train(model, data, opt, sched, handle)
    assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-6
    handle.remove()
    assert _files(nvme) == []


def test_a_meta_models_plan_with_more_threads_than_cores_computes_with_the_cores(reference,
                                                                                tmp_path):
    """The threads a plan computes with are checked on the device the model ends up on: a
    model built on meta and filled from a checkpoint is a CPU model only inside apply_plan."""
    import dataclasses
    import os

    from runtime import meta_parameters
    cfg, model0, data, ref, ref_opt = reference
    ck = tmp_path / "model.safetensors"
    _save(model0, ck)
    with meta_parameters():
        model = build_model(cfg, dtype="fp32")
    plan = plan_for(model0, "keep-all", B, S, nvme_dir=tmp_path / "nvme", micro_batches=K,
                    homes={"blocks": HOMES["all-on-disk"]})
    plan = dataclasses.replace(plan, executor=dataclasses.replace(plan.executor,
                                                                  compute_threads=100000))
    cores, was = len(os.sched_getaffinity(0)), torch.get_num_threads()
    opt, _ = _optimizer(model)
    with pytest.warns(UserWarning, match=f"computing with {cores}"):
        handle = apply_plan(model, plan, optimizer=opt, checkpoint=ck)
    try:
        assert torch.get_num_threads() == cores
    finally:
        handle.remove()
    assert torch.get_num_threads() == was and _files(tmp_path / "nvme") == []


def test_a_checkpoint_that_does_not_match_is_one_line_and_leaves_no_file(reference, tmp_path):
    from planner.errors import UserError
    from runtime import PlanMismatchError, meta_parameters
    cfg, model0, _, _, _ = reference
    nvme = tmp_path / "nvme"
    plan = plan_for(model0, "keep-all", B, S, nvme_dir=nvme, homes={"blocks": HOMES["all-on-disk"]})

    def meta_model():
        with meta_parameters():
            return build_model(cfg, dtype="fp32")
    m = meta_model()
    with pytest.raises(PlanMismatchError, match="meta device.*checkpoint="):
        apply_plan(m, plan, optimizer=torch.optim.AdamW(m.parameters()))
    sd = {k: v.clone() for k, v in model0.state_dict().items()}
    from safetensors.torch import save_file
    short = {k: v for k, v in sd.items() if k != "blocks.1.mlp.up.weight"}
    if len(short) == len(sd):
        short.pop(next(k for k in sd if k.startswith("blocks.1.")))
    save_file(short, str(tmp_path / "short.safetensors"))
    bad = dict(sd)
    k0 = next(k for k in sd if k.startswith("blocks.0.") and sd[k].dim() == 2)
    bad[k0] = torch.zeros(3, 3)
    save_file(bad, str(tmp_path / "bad.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    for name, match in (("short.safetensors", "has no tensor"), ("bad.safetensors", "has shape"),
                        ("junk.safetensors", "cannot be read"), ("none.safetensors", "no such")):
        m = meta_model()
        with pytest.raises(UserError, match=match) as e:
            apply_plan(m, plan, optimizer=torch.optim.AdamW(m.parameters()),
                       checkpoint=tmp_path / name)
        assert "\n" not in str(e.value)
        assert _files(nvme) == []


@pytest.mark.parametrize("factory", ["gpt2", "qwen2", "nanochat"])
def test_a_hugging_face_model_built_on_meta_trains_like_its_checkpoint(factory, tmp_path):
    """Hugging Face models nobody here wrote (GPT-2 with its tied head, Qwen2 with rotary
    buffers, NanoChat with an untied head and parameter-free norms), built under
    meta_parameters and filled from a checkpoint saved from the same model, train two steps
    exactly as the model itself does."""
    pytest.importorskip("transformers")
    from safetensors.torch import save_model

    import examples.hf_models as hf
    from runtime import meta_parameters
    if not hf.available(factory):
        pytest.skip(f"this transformers has no {factory}")
    b, s = 2, 32
    model, inputs = getattr(hf, factory)(b, s)
    model.train()
    ref = copy.deepcopy(model)
    save_model(model, str(tmp_path / "m.safetensors"))
    with meta_parameters():
        meta, _ = getattr(hf, factory)(b, s)
    meta.train()
    assert all(p.device.type == "meta" for p in meta.parameters())
    nvme = tmp_path / "nvme"
    plan = plan_for(model, "keep-all", b, s, inputs=inputs, nvme_dir=nvme,
                    homes={"blocks": HOMES["all-on-disk"]})
    opt = torch.optim.AdamW(meta.parameters(), lr=1e-3)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    handle = apply_plan(meta, plan, optimizer=opt, checkpoint=tmp_path / "m.safetensors")
    for step in range(2):
        for m, o in ((meta, opt), (ref, ropt)):
            torch.manual_seed(step)               # dropout: the same draws in both
            m(**inputs).loss.backward()
            o.step()
            o.zero_grad()
    assert _max_diff(meta.state_dict(), ref.state_dict()) == 0.0
    handle.remove()
    assert _files(nvme) == []


class _Between(torch.nn.Module):
    """Two stacks of two blocks with a Linear run between them: the profile charges it to
    the second stack's first block (LLaVA's projector between its vision tower and its
    language model, CLIP's text embeddings, ViTMAE's decoder_embed)."""

    def __init__(self, d=16):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(d, d),
                                                              torch.nn.GELU())
                                          for _ in range(4))
        self.mid = torch.nn.Linear(d, d)

    def forward(self, x):
        for b in self.blocks[:2]:
            x = b(x)
        x = self.mid(x)
        for b in self.blocks[2:]:
            x = b(x)
        return x.sum()


def test_a_block_charged_parameters_used_between_blocks_keeps_them_on_the_device(tmp_path):
    """Streamed, such a block's weights were read by the code between blocks before they had
    arrived, and their gradients left before that code's backward wrote them (ViTMAE:
    OffloadCorrupted; CLIP: gradients off by up to 41, run to run). The profile counts them
    (``outside_params``), the planner offers such a block only homes that keep its weights
    and gradients on the device (its optimizer state may still leave), and a plan file that
    streams them anyway is refused at ``apply_plan``."""
    import dataclasses

    from planner.costmodel.baselines import baseline_layers
    from planner.errors import UserError
    from planner.formats import load_plan, write_json_atomic
    from planner.hardware import load_hardware
    from planner.plans import cost_model, make_plan
    from planner.profile import profile_module
    torch.manual_seed(0)
    model, x = _Between(), torch.randn(4, 16)
    prof = profile_module(model, (x,), name="between", hardware=load_hardware("cpu-host"),
                          timing="estimate", batch=4, seq=1)
    assert {u.name: u.outside_params for u in prof.layers} == {
        "embedding": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": 16 * 16 + 16, "blocks.3": 0,
        "head": 0}
    cm = cost_model(prof, load_hardware("cpu-host"),
                    {"gpu_bytes": 1 << 30, "cpu_bytes": 0, "nvme_bytes": 1 << 30})
    i = [u.name for u in prof.layers].index("blocks.2")
    assert {(h.weights, h.grads) for h in cm.homes[i]} == {(T.GPU, T.GPU)}
    assert Home(T.GPU, T.GPU, T.NVME, T.GPU) in cm.homes[i]
    assert Home(T.NVME, T.NVME, T.NVME, T.GPU) in cm.homes[i - 1]
    hw = load_hardware("cpu-host")
    budgets = {"gpu_bytes": hw.memory_bytes, "cpu_bytes": 0, "nvme_bytes": 1 << 30}

    def plan(streamed):
        layers = [dataclasses.replace(d, home=HOMES["all-on-disk"]) if d.name == streamed
                  else d for d in baseline_layers("keep-all", prof.layers, hw)]
        return make_plan(prof, None, hw, budgets, "keep-all", layers, nvme_dir=str(tmp_path))
    with pytest.raises(UserError, match="weights used between blocks, stay on the device"):
        plan("blocks.2")
    # a plan file edited to stream it
    d = plan("blocks.1").to_dict()
    for layer in d["layers"]:
        if layer["name"] == "blocks.2":
            layer.update(weights="nvme", grads="nvme")
    write_json_atomic(tmp_path / "p.json", d)
    # refused by the plan's own check (apply_plan runs check_homes), which knows the unit's
    # outside_params, before the binding's check of the table
    with pytest.raises(UserError, match="weights used between blocks, stay on the device"):
        apply_plan(model, load_plan(tmp_path / "p.json"),
                   optimizer=torch.optim.AdamW(model.parameters()))


@pytest.mark.parametrize("depth", [1, 3])
def test_a_depth_3_plan_pipelines_its_optimizer_phase(reference, depth, tmp_path, monkeypatch):
    """With the plan's optimizer depth 3 the phase runs as the plan prices it: the next
    unit's weights are read while one steps (their read issued before this unit's weights are
    written back) and a unit's state pieces are read one ahead (a piece's read issued before
    the one before it has stepped); at depth 1 neither, one thing after another. The weights
    are plain PyTorch's either way."""
    import dataclasses

    from runtime import files, streaming
    monkeypatch.setattr(streaming, "STEP_PIECE_BYTES", 4096)
    monkeypatch.setattr(streaming, "STEP_PIECE_ALIGN", 16)
    log, in_phase = [], [False]
    real_submit, real_writes = files.NvmeStore.submit, streaming.UnitStatic._piece_writes

    def submit(store, fn, *args):
        if in_phase[0]:
            log.append((getattr(fn, "__name__", ""), getattr(getattr(fn, "__self__", None),
                                                              "name", None)))
        return real_submit(store, fn, *args)

    def piece_writes(us, *args):
        log.append(("stepped", us.name))
        return real_writes(us, *args)
    monkeypatch.setattr(files.NvmeStore, "submit", submit)
    monkeypatch.setattr(streaming.UnitStatic, "_piece_writes", piece_writes)
    cfg, model0, data, ref, _ = reference
    model = copy.deepcopy(model0)
    plan = plan_for(model, "keep-all", B, S, nvme_dir=tmp_path / "nvme", micro_batches=K,
                    homes={"blocks": HOMES["all-on-disk"]})
    assert plan.optimizer_depth == 3
    plan = dataclasses.replace(plan, optimizer_depth=depth)
    real_step = streaming.OptimizerPhase.step

    def step(*a, **kw):
        in_phase[0] = True
        try:
            return real_step(*a, **kw)
        finally:
            in_phase[0] = False
    monkeypatch.setattr(streaming.OptimizerPhase, "step", step)
    opt, sched = _optimizer(model)
    handle = apply_plan(model, plan, optimizer=opt)
    _train(model, data, opt, sched, handle)
    assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-6
    # state pieces: reads issued and not yet stepped, at most
    open_reads, most = 0, 0
    for what, _ in log:
        open_reads += (what == "_read_slices") - (what == "stepped")
        most = max(most, open_reads)
    # the next unit's weights asked for before this unit's go home
    order = [(w, u) for w, u in log if w in ("_read_weights", "_write_all_weights")]
    early = any(a[0] == "_read_weights" and b[0] == "_write_all_weights" and a[1] != b[1]
                for a, b in zip(order, order[1:]))
    assert (most, early) == ((2, True) if depth == 3 else (1, False)), (most, order[:6])
    handle.remove()
