"""Layer streaming under the loops people write: every way of zeroing gradients, torch's own
``clip_grad_norm_``, parameters that take no part in a step, state dicts of a wrapper or of one
block, and a corrupted weight home that must never reach the model.

Each test trains the same model the same way twice, plainly and under a plan whose blocks keep
their weights, gradients and optimizer state on the NVMe tier (the local disk here), and
compares what plain PyTorch gives.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

from planner.formats import Home, Tier as T
from planner.models import build_model, load_config, make_inputs
from runtime import apply_plan

from conftest import plan_for

B, S, K, STEPS = 2, 16, 2, 3
ON_DISK = Home(T.NVME, T.NVME, T.NVME, T.GPU)
GRADS_ON_DISK = Home(T.NVME, T.NVME, T.GPU, T.GPU)


def _model(extra=None):
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    torch.manual_seed(0)
    model = build_model(cfg, dtype="fp32")
    if extra is not None:
        extra(model)
    model.train()
    return cfg, model


def _data(cfg):
    return [make_inputs(cfg, B, S, seed=k) for k in range(STEPS * K)]


def _zero(model, opt, how):
    if how == "opt":
        opt.zero_grad()
    elif how == "opt-keep":
        opt.zero_grad(set_to_none=False)
    elif how == "model":
        model.zero_grad()
    elif how == "model-keep":
        model.zero_grad(set_to_none=False)
    elif how == "none":
        for p in model.parameters():
            p.grad = None
    else:
        raise AssertionError(how)


def _train(model, data, opt, *, zero="opt", clip=0.5, zero_first=False):
    torch.manual_seed(123)
    for step in range(STEPS):
        if zero_first:
            _zero(model, opt, zero)
        for k in range(K):
            (model(**data[step * K + k]).loss / K).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if not zero_first:
            _zero(model, opt, zero)


def _opt(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _files(path) -> list:
    return [f for _, _, fs in os.walk(path) for f in fs] if os.path.exists(path) else []


def _streamed(model, tmp_path, home=ON_DISK, acts="keep-all"):
    nvme = tmp_path / "nvme"
    plan = plan_for(model, acts, B, S, nvme_dir=nvme, homes={"blocks": home}, micro_batches=K)
    opt = _opt(model)
    return apply_plan(model, plan, optimizer=opt), opt, nvme


@pytest.mark.parametrize("zero", ["opt", "opt-keep", "model", "model-keep", "none"])
@pytest.mark.parametrize("where", ["after-step", "before-backward"])
def test_every_way_of_zeroing_gradients_trains_like_plain_pytorch(zero, where, tmp_path):
    """``model.zero_grad()`` (what the Hugging Face Trainer calls), ``opt.zero_grad`` with or
    without ``set_to_none`` and ``p.grad = None``, after the step or before the next backward:
    the gradients homed on disk follow, as ``p.grad`` would (``model.zero_grad()`` once left
    the home accumulator alone: 7.6e-2 off after one step, silently)."""
    cfg, model = _model()
    data = _data(cfg)
    ref = copy.deepcopy(model)
    ref_opt = _opt(ref)
    first = where == "before-backward"
    _train(ref, data, ref_opt, zero=zero, zero_first=first)
    handle, opt, nvme = _streamed(model, tmp_path)
    _train(model, data, opt, zero=zero, zero_first=first)
    assert _diff(model.state_dict(), ref.state_dict()) <= 1e-6
    handle.remove()
    assert _files(nvme) == []
    # after remove: the gradients as plain PyTorch leaves them (zeros, None or last step's)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p.grad is None) == (q.grad is None), n
        if q.grad is not None:
            assert (p.grad - q.grad).abs().max().item() <= 1e-6, n


def test_torch_clip_grad_norm_sees_gradients_on_disk_exactly(tmp_path):
    """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` itself, not only the
    handle's: the same total norm as plain PyTorch and the same scale on every gradient,
    including the norm-only call the Trainer makes (``max_norm=inf``)."""
    cfg, model = _model()
    data = _data(cfg)
    ref = copy.deepcopy(model)
    handle, opt, _ = _streamed(model, tmp_path)
    ref_opt = _opt(ref)
    torch.manual_seed(123)
    for step in range(STEPS):
        norms = []
        for m, o in ((ref, ref_opt), (model, opt)):
            torch.manual_seed(step)
            for k in range(K):
                (m(**data[step * K + k]).loss / K).backward()
            inf = torch.nn.utils.clip_grad_norm_(m.parameters(), float("inf"))
            got = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            norms.append((inf.item(), got.item()))
            o.step()
            m.zero_grad()
        assert norms[0] == norms[1]
    assert _diff(model.state_dict(), ref.state_dict()) <= 1e-6
    handle.remove()


def test_a_gradient_on_disk_reads_like_a_tensor(tmp_path):
    """Reading a gradient that lives on disk (``p.grad.norm()``, ``p.grad.clone()``,
    ``p.grad.sum()``) gives the values plain PyTorch holds; writing into it other than by
    zeroing or scaling is refused in one line."""
    cfg, model = _model()
    data = _data(cfg)
    ref = copy.deepcopy(model)
    handle, opt, _ = _streamed(model, tmp_path)
    for m in (ref, model):
        torch.manual_seed(1)
        m(**data[0]).loss.backward()
    blk = handle.plan.model["blocks"][0]
    name, p = next((n, q) for n, q in model.named_parameters() if n.startswith(blk + "."))
    q = dict(ref.named_parameters())[name]
    assert torch.equal(p.grad.clone(), q.grad)
    assert torch.equal(p.grad.sum(), q.grad.sum())
    assert torch.equal(p.grad.norm(), q.grad.norm())
    from planner.errors import UserError
    with pytest.raises(UserError, match="live on the NVMe tier"):
        p.grad.add_(1.0)
    handle.remove()


def _add_unused(model):
    blk = model.get_submodule(_first_block(model))
    blk.unused = torch.nn.Parameter(torch.randn(8, 8))
    blk.register_buffer("seen", torch.zeros(()))


def _first_block(model):
    from planner.blocks import find_blocks
    _, blocks = find_blocks(model, None)
    return blocks[0][0]


def _trained_side_by_side(tmp_path, extra=None):
    """The model trained plainly (``ref``) and under the streaming plan (``model``)."""
    cfg, model = _model(extra)
    data = _data(cfg)
    ref = copy.deepcopy(model)
    ref_opt = _opt(ref)
    _train(ref, data, ref_opt)
    handle, opt, _ = _streamed(model, tmp_path)
    _train(model, data, opt)
    return model, ref, data, handle, opt, ref_opt


def test_a_parameter_that_takes_no_part_keeps_no_gradient(tmp_path):
    """A parameter no step uses has ``grad is None`` under the plan as in plain PyTorch, so
    AdamW's weight decay leaves it alone (it once got a zero gradient and drifted 2.5e-6 in
    two steps; an expert that receives no tokens would drift the same way)."""
    model, ref, data, handle, opt, ref_opt = _trained_side_by_side(tmp_path, _add_unused)
    blk = _first_block(model)
    sd, want = model.state_dict(), ref.state_dict()
    assert torch.equal(sd[blk + ".unused"], want[blk + ".unused"])
    assert _diff(sd, want) <= 1e-6
    assert handle.gradients()[blk + ".unused"] is None
    handle.remove()
    assert dict(model.named_parameters())[blk + ".unused"].grad is None


@pytest.mark.parametrize("form", ["wrapper", "block"])
def test_state_dicts_of_a_wrapper_or_one_block_hold_the_real_weights(form, tmp_path):
    """``nn.ModuleDict({"model": m}).state_dict()`` (Lightning, PEFT and every wrapper) and
    ``block.state_dict()`` give the weights that live on disk, and loading them puts the values
    in their home (both once gave 0-byte tensors, and reading them segfaulted)."""
    model, ref, data, handle, opt, ref_opt = _trained_side_by_side(tmp_path)
    blk = _first_block(model)
    if form == "wrapper":
        outer, outer_ref = torch.nn.ModuleDict({"model": model}), torch.nn.ModuleDict({"model": ref})
    else:
        outer, outer_ref = model.get_submodule(blk), ref.get_submodule(blk)
    sd, want = outer.state_dict(), outer_ref.state_dict()
    assert _diff(sd, want) == 0.0
    # loading: values from another model reach the home, and the plan trains on from them
    fresh = {k: torch.randn_like(v) if v.is_floating_point() else v for k, v in want.items()}
    outer.load_state_dict(fresh)
    outer_ref.load_state_dict(fresh)
    assert _diff(outer.state_dict(), outer_ref.state_dict()) == 0.0
    _train(model, data, opt)
    _train(ref, data, ref_opt)
    assert _diff(model.state_dict(), ref.state_dict()) <= 1e-6
    handle.remove()


def test_a_corrupted_weight_home_is_never_trusted_after_it_is_reported(tmp_path):
    """A weight file changed on disk is reported at the forward that reads it, and again by
    every later read (``state_dict()``, the next forward): the corrupted bytes never reach the
    model as if they were its weights (they once did, after the first report, through
    ``state_dict()`` and ``remove()``: one flipped exponent bit gave a weight of 7e36)."""
    from runtime.files import OffloadCorrupted
    from test_faults import _bins, _corrupt, _drain
    cfg, model = _model()
    data = _data(cfg)
    handle, opt, nvme = _streamed(model, tmp_path, home=Home(T.NVME, T.GPU, T.GPU, T.GPU))
    model(**data[0]).loss.backward()
    opt.step()
    opt.zero_grad()
    _drain(handle)
    blk = handle.plan.model["blocks"][-1]
    (victim,) = [p for p in _bins(nvme) if p.name.startswith(f"w-{blk}")]
    _corrupt(victim, "flip")
    for read in (lambda: model(**data[1]).loss.backward(), model.state_dict,
                 lambda: model.get_submodule(blk).state_dict(), model.state_dict):
        with pytest.raises(OffloadCorrupted, match=f"weights of unit '{blk}'"):
            read()
    with pytest.raises(OffloadCorrupted, match=f"weights of unit '{blk}'"):
        handle.remove()
    handle._r.close()


class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return x + torch.relu(self.lin(self.norm(x)))


class _SharedLayer(torch.nn.Module):
    """Four residual blocks, the last reusing the first one's Linear (not adjacent, not an
    embedding tie)."""

    def __init__(self, d=32, n=4):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.blocks = torch.nn.ModuleList(_Block(d) for _ in range(n))
        self.blocks[n - 1].lin = self.blocks[0].lin
        self.out = torch.nn.Linear(d, 1)

    def forward(self, x, target):
        for b in self.blocks:
            x = b(x) if b is not self.blocks[0] else b(self.inp(x))
        return ((self.out(x) - target) ** 2).mean()


def _shared_model():
    torch.manual_seed(0)
    m = _SharedLayer()
    return m, (torch.randn(4, 8, 32), torch.randn(4, 8, 1))


def test_a_layer_shared_by_two_blocks_is_found_and_never_streamed(tmp_path):
    """A Linear used by block 0 and block 3: the profile records the tie by identity, a plan
    that would stream either is refused in one line (it once crashed with 'setStorage: ...
    storage of size 0'), and the planner's own plan at a budget that streams the other blocks
    trains like plain PyTorch."""
    from planner.formats import Budgets
    from planner.hardware import load_hardware
    from planner.profile import profile_module
    from planner.solve import solve_profile
    from runtime import PlanMismatchError

    model, (x, t) = _shared_model()
    hw = load_hardware("cpu-host")
    prof = profile_module(model, (x, t), name="shared", hardware=hw, timing="estimate",
                          batch=4, seq=8)
    tied = {u.name: u.tied_to for u in prof.layers}
    assert tied["blocks.0"] == ("blocks.3",) and tied["blocks.3"] == ("blocks.0",)
    # a hand-made plan that streams every block: refused before anything moves
    bad = plan_for(model, "keep-all", 4, 8, nvme_dir=tmp_path / "nvme", inputs=(x, t),
                   homes={"blocks": ON_DISK})
    with pytest.raises(PlanMismatchError, match="is tied to") as e:
        apply_plan(model, bad, optimizer=_opt(model))
    assert "\n" not in str(e.value) and "blocks.0.lin.weight" in str(e.value)
    # the solver's plan at the smallest GPU budget that fits: the other units stream
    from planner.errors import NoFitError

    def solve(gpu):
        budgets = Budgets(gpu_bytes=int(gpu), cpu_bytes=0, nvme_bytes=1 << 30)
        return solve_profile(prof, None, hw, budgets, "optimal", time_limit=20,
                             nvme_dir=str(tmp_path / "nvme")).plan
    with pytest.raises(NoFitError) as e:
        solve(hw.reserved_bytes)
    plan = solve(e.value.needed_bytes)
    homes = {d.name: d.home for d in plan.layers}
    assert not homes["blocks.1"].resident or not homes["blocks.2"].resident, homes
    for b in ("blocks.0", "blocks.3"):
        assert homes[b].weights is T.GPU and homes[b].grads is T.GPU, (b, homes[b])
    ref = copy.deepcopy(model)
    opt, ref_opt = _opt(model), _opt(ref)
    handle = apply_plan(model, plan, optimizer=opt)
    for _ in range(3):
        for m, o in ((ref, ref_opt), (model, opt)):
            m(x, t).backward()
            o.step()
            m.zero_grad()
    assert _diff(model.state_dict(), ref.state_dict()) <= 1e-6
    handle.remove()
    assert _files(tmp_path / "nvme") == []


@pytest.mark.parametrize("how", ["stepped", "loaded"])
def test_an_optimizer_with_state_before_apply_plan_trains_on_from_it(how, tmp_path):
    """The usual resume order (model and optimizer built, both ``load_state_dict``-ed, then
    ``apply_plan``) and steps taken before the plan: the state the optimizer holds goes to its
    home at ``apply_plan`` (the step in pieces raised ``KeyError: (0, 'exp_avg')`` before,
    half way through ``opt.step()``), and the caller's checkpoint dict keeps its tensors."""
    cfg, model = _model()
    data = _data(cfg)
    ref = copy.deepcopy(model)
    ref_opt = _opt(ref)
    _train(ref, data, ref_opt)
    first = data[:K]
    opt = _opt(model)
    if how == "stepped":
        warm, warm_opt = model, opt
    else:   # a checkpoint of a model trained one step: loaded into the fresh ones, then planned
        warm = copy.deepcopy(model)
        warm_opt = _opt(warm)
    torch.manual_seed(123)                      # _train's seed: the same dropout masks
    for k in range(K):
        (warm(**first[k]).loss / K).backward()
    torch.nn.utils.clip_grad_norm_(warm.parameters(), 0.5)
    warm_opt.step()
    warm_opt.zero_grad()
    if how == "loaded":
        osd = warm_opt.state_dict()
        model.load_state_dict(warm.state_dict())
        opt.load_state_dict(osd)
        kept = {k: {kk: v.clone() for kk, v in st.items()} for k, st in osd["state"].items()}
    nvme = tmp_path / "nvme"
    plan = plan_for(model, "keep-all", B, S, nvme_dir=nvme, homes={"blocks": ON_DISK},
                    micro_batches=K)
    handle = apply_plan(model, plan, optimizer=opt)
    rng = torch.get_rng_state()
    for step in range(1, STEPS):
        for k in range(K):
            (model(**data[step * K + k]).loss / K).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    torch.set_rng_state(rng)
    assert _diff(model.state_dict(), ref.state_dict()) <= 1e-6
    if how == "loaded":
        # the caller's tensors keep their storage (the homes took copies; freeing the
        # optimizer's own on the device emptied them before), as plain PyTorch leaves them
        for k, st in osd["state"].items():
            for kk, v in st.items():
                assert v.untyped_storage().nbytes() == v.numel() * v.element_size(), (k, kk)
                assert torch.isfinite(v).all() and v.shape == kept[k][kk].shape, (k, kk)
    handle.remove()
    assert _files(nvme) == []
