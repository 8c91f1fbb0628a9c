"""A plan is bound to its model: exact block names, every unit's parameter shapes, every input's
shape, and an identity hash over them that an edited plan no longer matches. Refusals are one
line (PlanMismatchError, a UserError and a ValueError) naming what differs and the fix."""
from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch

import zoo_models as zm
from conftest import plan_for
from planner.blocks import identity_hash
from planner.errors import UserError
from planner.formats import Plan
from planner.hardware import load_hardware
from planner.models import build_model, load_config, make_inputs
from planner.plans import baseline_plan
from planner.profile import profile_module
from runtime import InputTooLargeError, PlanMismatchError, RecomputeMismatch, apply_plan

CPU = load_hardware("cpu-host")
B, S = 2, 16


def profiled_plan(factory, policy="keep-all", nvme_dir=None, batch=B, seq=S, **kw):
    model, inputs = factory(batch, seq)
    prof = profile_module(model, inputs, name=factory.__name__, hardware=CPU,
                          timing="estimate", batch=batch, seq=seq, **kw)
    budgets = {"gpu_bytes": CPU.memory_bytes, "cpu_bytes": 0, "nvme_bytes": 1 << 30}
    return baseline_plan(prof, None, CPU, budgets, policy, nvme_dir=nvme_dir)


def edited(plan: Plan, rehash=False, **model_fields) -> Plan:
    m = dict(plan.model, **model_fields)
    for k, v in model_fields.items():
        if v is None:
            del m[k]
    if rehash:
        m["identity"] = identity_hash(m)
    return dataclasses.replace(plan, model=m)


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, UserError) and isinstance(e.value, ValueError)
    return msg


# ----------------------------------------------------------------------------- identity

def test_plan_for_another_vocabulary_is_refused_naming_the_parameter():
    # Same blocks (names, shapes, structure hash), another vocabulary: the embedding and the
    # tied head differ, which the block-only structure hash never saw.
    plan = profiled_plan(zm.tied)
    other = zm.TiedLM()
    other.tok = torch.nn.Embedding(2 * zm.V, zm.D)
    other.lm_head = torch.nn.Linear(zm.D, 2 * zm.V, bias=False)
    other.lm_head.weight = other.tok.weight
    assert plan.model["structure_hash"] == plan_for(other, "keep-all", B, S).model[
        "structure_hash"]
    with pytest.raises(PlanMismatchError) as e:
        apply_plan(other, plan)
    assert one_line(e) == (
        "the plan: unit 'embedding' holds 'tok.weight' of shape [64, 32] in the plan but "
        "[128, 32] in the model (another vocabulary, width or depth); profile and solve for "
        "this model")


def test_plan_records_every_units_parameters_and_every_input():
    plan = profiled_plan(zm.tied)
    m = plan.model
    assert m["blocks"] == ["layers.0", "layers.1", "layers.2"]
    assert m["params"]["embedding"] == [["tok.weight", [64, 32], "float32"],
                                        ["pos.weight", [256, 32], "float32"]]
    assert [r[0] for r in m["params"]["head"]] == ["norm.weight", "norm.bias"]
    assert [r[0] for r in m["params"]["layers.1"]] == [
        "layers.1.norm.weight", "layers.1.norm.bias", "layers.1.up.weight", "layers.1.up.bias",
        "layers.1.down.weight", "layers.1.down.bias"]
    assert m["inputs"] == [{"name": "ids", "shape": [B, S], "dtype": "int64"},
                           {"name": "labels", "shape": [B, S], "dtype": "int64"}]
    assert m["identity"] == identity_hash(m)
    # the tied head weight is the embedding's, held once
    assert {u.name: u.tied_to for u in plan.units}["embedding"] == ("head",)


@pytest.mark.parametrize("fields", [{"batch": 0, "seq": 0}, {"batch": None, "seq": None},
                                    {"inputs": [{"name": "ids", "shape": [0, 0],
                                                 "dtype": "int64"}]}])
def test_plan_edited_to_zero_is_refused(fields):
    plan = profiled_plan(zm.tied)
    model, _ = zm.tied(B, S)
    with pytest.raises(PlanMismatchError) as e:
        apply_plan(model, edited(plan, **fields))
    assert "does not match its identity hash" in one_line(e)
    # even with the hash recomputed, no size of 0 turns the guard off
    if "inputs" in fields:
        with pytest.raises(PlanMismatchError) as e:
            apply_plan(model, edited(plan, rehash=True, **fields))
        assert "needs a shape of positive sizes" in one_line(e)
    else:
        h = apply_plan(model, edited(plan, rehash=True, **fields))    # inputs still guard
        ids = torch.zeros(B, S + 1, dtype=torch.long)
        with pytest.raises(InputTooLargeError):
            model(ids=ids, labels=ids)
        h.remove()


def test_plan_without_input_shapes_needs_batch_and_seq():
    plan = profiled_plan(zm.tied)
    model, _ = zm.tied(B, S)
    with pytest.raises(PlanMismatchError) as e:
        apply_plan(model, edited(plan, rehash=True, inputs=None, batch=0))
    assert one_line(e).startswith("the plan records no input shapes (model.inputs) and no "
                                  "batch x seq (0 x 16)")


def test_old_plan_without_block_names_is_refused_and_a_plan_without_inputs_guards_batch_x_seq():
    """The runtime binds by the plan's module names only (block detection is the profiler's):
    a plan from before ``model.blocks`` is refused in one line naming the fix; a plan that
    names its blocks but no input shapes binds and guards batch x seq."""
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    model = build_model(cfg, dtype="fp32")
    plan = plan_for(model, "recompute-all", B, S)
    assert "inputs" not in plan.model
    old = dataclasses.replace(plan, model={k: v for k, v in plan.model.items()
                                           if k not in ("blocks", "params", "identity")})
    with pytest.raises(PlanMismatchError) as e:
        apply_plan(model, old)
    assert one_line(e) == ("the plan names no blocks (model.blocks): it predates binding by "
                           "module name, which this runtime needs; profile and solve again")
    h = apply_plan(model, plan)
    assert h._r.block_names == ["blocks.0", "blocks.1", "blocks.2"]
    model(**make_inputs(cfg, B, S)).loss.backward()
    with pytest.raises(InputTooLargeError, match=f"batch {B} x seq {S + 1}, larger than"):
        model(**make_inputs(cfg, B, S + 1))
    h.remove()


def test_plan_naming_a_module_the_model_lacks():
    plan = profiled_plan(zm.nested)
    other = zm.Nested(stages=2, per_stage=2)
    with pytest.raises(PlanMismatchError) as e:
        apply_plan(other, plan)
    assert one_line(e) == ("the plan is for 6 blocks (stages.0.0 .. stages.1.2) but the model "
                           "has no module 'stages.0.2'; profile and solve for this model")


def test_plan_file_round_trip_keeps_the_binding(tmp_path):
    from planner.formats import load_plan
    from planner.plans import save_plan
    plan = profiled_plan(zm.mixed_sequential)
    path = save_plan(plan, tmp_path / "p.json")
    assert json.loads(path.read_text())["model"]["blocks"] == ["net.1", "net.2", "net.3",
                                                               "net.4"]
    model, inputs = zm.mixed_sequential(B, S)
    h = apply_plan(model, load_plan(path))
    model(**inputs).loss.backward()
    h.remove()


# ----------------------------------------------------------------------------- input guard

def _count_block_calls(model, names):
    ran = []
    hooks = [model.get_submodule(n).register_forward_pre_hook(lambda m, a: ran.append(1))
             for n in names]
    return ran, hooks


@pytest.mark.parametrize("name,bigger,needle", [
    # labels are the decoder's length (seq // 2): a longer decoder is refused as such
    ("t5", {"labels": (B, 16)}, "input 'labels' has shape [2, 16], larger than the plan's "
     "[2, 8] in dimension 1 (16 > 8)"),
    ("t5", {"input_ids": (B, 32)}, "input 'input_ids' has shape [2, 32], larger than the "
     "plan's [2, 16] in dimension 1 (32 > 16)"),
    ("vit", {"pixel_values": (B, 3, 32, 32)}, "input 'pixel_values' has shape "
     "[2, 3, 32, 32], larger than the plan's [2, 3, 16, 16] in dimension 2 (32 > 16)"),
    ("vit", {"labels": (B + 1,)}, "input 'labels' has shape [3], larger than the plan's [2]"),
])
def test_every_dimension_of_every_input_is_guarded(name, bigger, needle):
    import examples.hf_models as hf
    factory = getattr(hf, name)
    plan = profiled_plan(factory, "recompute-all")
    model, inputs = factory(B, S)
    h = apply_plan(model, plan)
    ran, hooks = _count_block_calls(model, plan.model["blocks"])
    big = dict(inputs)
    for k, shape in bigger.items():
        big[k] = (torch.randn(shape) if inputs[k].is_floating_point()
                  else torch.zeros(shape, dtype=inputs[k].dtype))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(InputTooLargeError) as e:
            model(**big)
        assert needle in one_line(e)
        assert ran == []                           # refused before any block ran
        small = {k: v[:1] for k, v in inputs.items()}   # a short last batch runs
        model(**small).loss.backward()
    for k in hooks:
        k.remove()
    h.remove()


class MaskedTied(zm.TiedLM):
    """The same model with an optional input the profile never saw."""

    def forward(self, ids, labels=None, mask=None):
        return super().forward(ids, labels)


def test_an_input_the_profile_never_saw_warns_once():
    plan = profiled_plan(zm.tied)
    _, inputs = zm.tied(B, S)
    model = MaskedTied()
    h = apply_plan(model, plan)
    with pytest.warns(UserWarning, match="input 'mask' \\[2, 16\\] was not profiled"):
        model(**inputs, mask=torch.ones(B, S)).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**inputs, mask=torch.ones(B, S))
    h.remove()


# ----------------------------------------------------------------------------- stacks

def test_t5_plans_both_stacks_and_shares_the_encoder_output():
    import examples.hf_models as hf
    plan = profiled_plan(hf.t5)
    units = {u.name: u for u in plan.units}
    assert plan.model["blocks"] == ["encoder.block.0", "encoder.block.1", "decoder.block.0",
                                    "decoder.block.1"]
    assert plan.model["chain_breaks"] == ["decoder.block.0"]
    # decoder.block.1's cross-attention saves the encoder output (B x S x d fp32, once for its
    # key and value projections), made in decoder.block.0's prologue (the encoder's final
    # norm and dropout), and kept by reference
    assert units["decoder.block.1"].shared_saved_bytes == B * S * 64 * 4
    assert units["decoder.block.1"].shared_from == "decoder.block.0"
    # the shared embedding is used by the embedding unit, the decoder's prologue and the head
    assert units["embedding"].tied_to == ("decoder.block.0", "head")


def test_checkpoint_none_across_stacks_is_refused_at_apply():
    import examples.hf_models as hf
    plan = profiled_plan(hf.t5)
    layers = list(plan.layers)
    from planner.formats import Activation, LayerDecision, Tier
    idx = [d.name for d in layers].index("decoder.block.0")
    layers[idx - 1] = LayerDecision("encoder.block.1", Activation.RECOMPUTE, Tier.GPU)
    layers[idx] = LayerDecision("decoder.block.0", Activation.RECOMPUTE, Tier.NONE)
    model, _ = hf.t5(B, S)
    # no schedule can be built for these decisions (planner/costmodel/schedule.py refuses them), so a
    # plan file that has them is refused by apply_plan's consistency check, naming the block
    from planner.errors import UserError
    from planner.costmodel.schedule import build_schedule
    from planner.plans.simulate import cost_model_of
    with pytest.raises(UserError, match="decoder.block.0.*chain_breaks"):
        build_schedule(cost_model_of(plan), layers)
    with pytest.raises(UserError) as e:
        apply_plan(model, dataclasses.replace(plan, layers=layers))
    msg = str(e.value)
    assert "\n" not in msg and "decoder.block.0" in msg and "checkpoint tier" in msg, msg


@pytest.mark.parametrize("factory,blocks", [
    (zm.nested, [f"stages.{i}.{j}" for i in range(2) for j in range(3)]),
    (zm.nested_called, [f"stages.{i}.{j}" for i in range(2) for j in range(3)]),
    (zm.mixed_sequential, ["net.1", "net.2", "net.3", "net.4"]),
])
def test_profile_and_runtime_agree_on_the_blocks(factory, blocks):
    plan = profiled_plan(factory, "recompute-all")
    assert plan.model["blocks"] == blocks
    assert [u.name for u in plan.units] == ["embedding", *blocks, "head"]
    model, inputs = factory(B, S)
    h = apply_plan(model, plan)
    assert h._r.block_names == blocks
    ran, hooks = _count_block_calls(model, blocks)
    model(**inputs).loss.backward()
    assert len(ran) == 2 * len(blocks)          # each block: its forward and its recompute
    for k in hooks:
        k.remove()
    h.remove()


# ----------------------------------------------------------------------------- replay

def test_recompute_leaves_the_models_cache_as_plain_pytorch_does():
    """use_cache at its default: the model returns a key/value cache its blocks appended to;
    the recomputation runs each block with the cache as it was, and leaves it as the forward
    did (without that, T5's replay attends to twice the keys and is refused)."""
    import examples.hf_models as hf
    for name in ("gpt2", "t5"):
        factory = getattr(hf, name)
        plan = profiled_plan(factory, "recompute-all")
        shapes = []
        for p in (None, plan):
            model, inputs = factory(B, S)
            h = apply_plan(model, p) if p else None
            out = model(**inputs)
            out.loss.backward()
            cache = out.past_key_values
            caches = cache.self_attention_cache.layers if name == "t5" else cache.layers
            shapes.append([tuple(layer.keys.shape) for layer in caches])
            if h:
                h.remove()
        assert shapes[0] == shapes[1] and shapes[0][0][2] == (S // 2 if name == "t5" else S)


def test_the_cache_use_cache_fills_is_weighed_and_warned_about():
    import examples.hf_models as hf
    plan = profiled_plan(hf.llama)
    # 3 layers x (keys + values) x [batch 2, 2 KV heads, 16 positions, head dim 16] fp32
    assert plan.model["state_bytes"] == 3 * 2 * (B * 2 * S * 16) * 4
    # and counted: the same plan without it peaks exactly that much lower at every stage
    import dataclasses

    from planner.plans.simulate import simulate
    bare = dataclasses.replace(plan, model=dict(plan.model, state_bytes=0))
    with_cache, without = simulate(plan), simulate(bare)
    assert [a.memory["gpu"] - b.memory["gpu"] for a, b in zip(with_cache.stages, without.stages)] \
        == [plan.model["state_bytes"]] * len(without.stages)
    model, _ = hf.llama(B, S)
    with pytest.warns(UserWarning, match=r"fills a key/value cache of 24576 bytes"):
        h = apply_plan(model, plan)
    h.remove()
    model.config.use_cache = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        apply_plan(model, plan).remove()


def test_block_writing_its_input_in_place_is_listed_and_replayed():
    plan = profiled_plan(zm.inplace, "recompute-all")
    assert plan.model["inplace_input"] == ["blocks.0", "blocks.1", "blocks.2"]
    # A plan that does not know it (made without a profile) is stopped at the forward with
    # one line, not trained from a changed checkpoint.
    model, inputs = zm.inplace(B, S)
    h = apply_plan(model, plan_for(model, "recompute-all", B, S))
    with pytest.raises(RecomputeMismatch) as e:
        model(**inputs)
    assert "\n" not in str(e.value) and "writes into its input in place" in str(e.value)
    h.remove()


def test_profiling_leaves_batchnorm_statistics_as_they_were():
    model, inputs = zm.convnet(B, S)
    before = [b.clone() for b in model.buffers()]
    profile_module(model, inputs, name="convnet", hardware=CPU, repeats=1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.buffers()))


class MaskedBlocks(torch.nn.Module):
    """Blocks take a mask the model scales in place after them (a side argument changed
    between the forward and the backward)."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([MaskBlock() for _ in range(2)])

    def forward(self, x):
        mask = torch.ones(x.shape[-1])
        for b in self.blocks:
            x = b(x, mask)
        mask.mul_(2)
        return x.sum()


class MaskBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(zm.D, zm.D)

    def forward(self, x, mask):
        return torch.tanh(self.lin(x)) * mask


def test_a_side_argument_written_after_the_forward_stops_the_replay():
    model = MaskedBlocks()
    x = torch.randn(2, 4, zm.D)
    h = apply_plan(model, plan_for(model, "recompute-all", 2, 4, inputs=(x,)))
    with pytest.raises(RecomputeMismatch) as e:
        model(x).backward()
    assert "\n" not in str(e.value) and "was written in place since its forward" in str(e.value)
    h.remove()
