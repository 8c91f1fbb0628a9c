"""Finding blocks from what the forward runs, ``--blocks`` names and patterns, and the call
helpers the profiler and the runtime share (hidden state, state snapshots)."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

import zoo_models as zm
from planner.blocks import (StateSnapshot, detect_blocks, hidden_location, hidden_of,
                            input_table)
from planner.cli import main
from planner.errors import UserError


def detect(model, inputs, blocks=None):
    run = (lambda: model(**inputs)) if isinstance(inputs, dict) else (lambda: model(*inputs))
    return detect_blocks(model, run, blocks).names


class Spare(nn.Module):
    """Five blocks that never run beside three that do: the old container rule took the
    longest list, the unused one."""

    def __init__(self):
        super().__init__()
        self.spare = nn.ModuleList([zm.Block() for _ in range(5)])
        self.blocks = nn.ModuleList([zm.Block() for _ in range(3)])
        self.out = nn.Linear(zm.D, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x).sum()


class Attrs(nn.Module):
    """Blocks as attributes, no container at all."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.third = zm.Block(), zm.Block(), zm.Block()
        self.out = nn.Linear(zm.D, 1)

    def forward(self, x):
        return self.out(self.third(self.second(self.first(x)))).sum()


class Shared(nn.Module):
    """One layer applied three times (ALBERT's weight sharing)."""

    def __init__(self):
        super().__init__()
        self.layer = zm.Block()
        self.out = nn.Linear(zm.D, 1)

    def forward(self, x):
        for _ in range(3):
            x = self.layer(x)
        return self.out(x).sum()


X = (torch.randn(2, 4, zm.D),)


class Mixer(nn.Module):
    """Another class of layer, as heavy as a Block (Jamba's attention among its Mamba
    layers)."""

    def __init__(self, d=zm.D):
        super().__init__()
        self.mix = nn.Linear(d, d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        return x + self.out(torch.tanh(self.mix(x)))


class Hybrid(nn.Module):
    """One list of layers: three Blocks, a Mixer, three Blocks, a LayerNorm, two Blocks, a
    Mixer at the end. The Mixers are blocks (a class repeated in the list, each as heavy as a
    Block, fed by the layer before); the norm (a sliver of the FLOPs) is not."""

    def __init__(self):
        super().__init__()
        B = zm.Block
        self.layers = nn.ModuleList([B(), B(), B(), Mixer(), B(), B(), B(), nn.LayerNorm(zm.D),
                                     B(), B(), Mixer()])
        self.out = nn.Linear(zm.D, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.out(x).sum()


def test_a_container_that_never_runs_is_never_a_block():
    assert detect(Spare(), X) == ["blocks.0", "blocks.1", "blocks.2"]


def test_layers_of_another_class_between_runs_of_one_list_are_blocks_too():
    assert detect(Hybrid(), X) == [f"layers.{i}" for i in range(7)] + ["layers.8", "layers.9",
                                                                          "layers.10"]


class Alternating(Hybrid):
    """Zamba2 with a hybrid layer after every Mamba layer: classes alternate, so no two
    neighbours share one and there is no run to bridge; its blocks were the small adapters
    inside the shared layer."""

    def __init__(self):
        super().__init__()
        B = zm.Block
        self.layers = nn.ModuleList([B(), Mixer(), B(), Mixer(), B(), Mixer()])


def test_layers_whose_classes_alternate_are_blocks():
    assert detect(Alternating(), X) == [f"layers.{i}" for i in range(6)]


class _Merge(nn.Module):
    """A Swin patch merging: halves the width and height, doubles the channels."""

    def __init__(self, d):
        super().__init__()
        self.norm, self.reduce = nn.LayerNorm(4 * d), nn.Linear(4 * d, 2 * d, bias=False)

    def forward(self, x):
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]],
                      -1)
        return self.reduce(self.norm(x))


class SwinLike(nn.Module):
    """torchvision's Swin layout: ``features`` lists a Sequential patch embedding, then
    Sequential stages of blocks with a patch merging between each two. The later stages'
    blocks are units, not the stages bridged into one run by the mergings (a review found
    8 coarse units)."""

    def __init__(self, d=8, depths=(2, 2, 4)):
        super().__init__()
        layers = [nn.Sequential(nn.Linear(3, d), nn.LayerNorm(d))]
        for i, n in enumerate(depths):
            layers.append(nn.Sequential(*[zm.Block(d, 4 * d) for _ in range(n)]))
            if i < len(depths) - 1:
                layers.append(_Merge(d))
                d *= 2
        self.features = nn.Sequential(*layers)
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        return self.out(self.features(x)).sum()


def test_stages_of_blocks_between_mergings_give_their_blocks():
    names = detect(SwinLike(), (torch.randn(2, 8, 8, 3),))
    assert names[-6:] == ["features.3.0", "features.3.1", "features.5.0", "features.5.1",
                          "features.5.2", "features.5.3"]


def test_blocks_need_no_container():
    assert detect(Attrs(), X) == ["first", "second", "third"]


def test_one_layer_models_fall_back_to_the_called_items_of_a_list():
    import examples.hf_models as hf
    model, inputs = hf.gpt2(2, 8, n_layer=1)
    assert detect(model, inputs) == ["transformer.h.0"]


def test_parallel_projections_are_not_blocks():
    # Llama's q/k/v projections are consecutive Linears fed the same input: not a chain.
    import examples.hf_models as hf
    model, inputs = hf.llama(2, 8, n_layer=1)
    assert detect(model, inputs) == ["model.layers.0"]


def test_a_layer_run_several_times_is_refused_with_one_line():
    with pytest.raises(UserError) as e:
        detect(Shared(), X, "layer")
    assert str(e.value) == ("module 'layer' runs 3 times in one forward (shared weights); "
                            "tierplan plans each block once: name other blocks with --blocks, "
                            "or unroll the shared layer")


@pytest.mark.parametrize("spec,names", [
    ("encoder.block.*,decoder.block.*", ["encoder.block.0", "encoder.block.1",
                                         "decoder.block.0", "decoder.block.1"]),
    ("decoder.block.1 encoder.block.0", ["encoder.block.0", "decoder.block.1"]),
    ("**.block.1", ["encoder.block.1", "decoder.block.1"]),
    ("encoder.block", ["encoder.block.0", "encoder.block.1"]),     # a list: what runs in it
])
def test_blocks_by_names_and_patterns_in_execution_order(spec, names):
    import examples.hf_models as hf
    model, inputs = hf.t5(2, 8)
    assert detect(model, inputs, spec) == names


@pytest.mark.parametrize("factory,spec,names", [
    (zm.mixed_sequential, "net", ["net.1", "net.2", "net.3", "net.4"]),
    (zm.nested, "stages", [f"stages.{i}.{j}" for i in range(2) for j in range(3)]),
])
def test_one_container_means_the_blocks_inside_it(factory, spec, names):
    model, inputs = factory(2, 8)
    assert detect(model, inputs, spec) == names


@pytest.mark.parametrize("spec,needle", [
    ("nope", "--blocks 'nope': 'nope' names no module of the model"),
    ("stages.*", "--blocks 'stages.*': 'stages.0' never runs in the forward, so it cannot be "
     "a block"),
    ("stages.0.0,stages.0.0.up", "'stages.0.0.up' is inside 'stages.0.0'"),
])
def test_bad_blocks_are_one_line(spec, needle):
    model, inputs = zm.nested(2, 8)
    with pytest.raises(UserError) as e:
        detect(model, inputs, spec)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_cli_blocks_option(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(__import__("pathlib").Path(__file__).parent)
    out = tmp_path / "p.json"
    assert main(["profile", "zoo_models:mixed_sequential", "--batch", "2", "--seq", "8",
                 "--blocks", "net", "-o", str(out)]) == 0
    assert "blocks: 4 in 'net' (net.1 .. net.4)" in capsys.readouterr().out
    assert main(["profile", "zoo_models:nested", "--batch", "2", "--seq", "8",
                 "--blocks", "stages.0.*,stages.1.*", "-o", str(out)]) == 0
    assert "blocks: 6 in 'stages.0,stages.1' (stages.0.0 .. stages.1.2)" in \
        capsys.readouterr().out
    assert main(["profile", "zoo_models:nested", "--batch", "2", "--seq", "8",
                 "--blocks", "nope", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'nope' names no module" in err


# ----------------------------------------------------------------------------- calls

def test_hidden_state_rules():
    x, m = torch.ones(2), torch.zeros(2)
    assert hidden_location((None, x), {"mask": m}) == (("a", 1), x)
    assert hidden_location((), {"mask": m, "hidden_states": x}) == (("k", "hidden_states"), x)
    assert hidden_location((), {"mask": m, "y": x}) == (("k", "mask"), m)
    assert hidden_location((3,), {}) == (None, None)
    assert hidden_of((x, m)) is x and hidden_of({"a": 1, "b": m}) is m and hidden_of(3) is None


class Cache:
    def __init__(self):
        self.layers = [Layer(), Layer()]
        self.is_updated = {}


class Layer:
    def __init__(self):
        self.keys = None

    def update(self, k):
        self.keys = k if self.keys is None else torch.cat([self.keys, k])


def test_state_snapshot_puts_caches_back():
    cache = Cache()
    cache.layers[0].update(torch.ones(2))
    snap = StateSnapshot((torch.ones(1),), {"cache": cache})
    cache.layers[1].update(torch.ones(3))
    cache.layers.append(Layer())
    cache.is_updated[1] = True
    later = snap.now()
    snap.restore()
    assert cache.layers[1].keys is None and len(cache.layers) == 2 and cache.is_updated == {}
    later.restore()
    assert cache.layers[1].keys.shape == (3,) and len(cache.layers) == 3
    assert cache.is_updated == {1: True}
    assert snap.changed_in_place() is None
    cache.layers[0].keys.add_(1)            # a static cache written in place: cannot go back
    assert snap.changed_in_place() == "argument 'cache' (Cache) (Layer)"


class Recurrent(nn.Module):
    """Starts from ``self.state`` and leaves its final state there, as RecurrentGemma's RG-LRU
    does with use_cache on."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.state = torch.zeros(4)

    def forward(self, x):
        y = self.lin(x) + self.state
        self.state = y.detach()[-1]
        self.extra = y.detach()
        return y


def test_state_snapshot_puts_a_blocks_tensor_attributes_back():
    block = nn.Sequential(Recurrent())
    first = block[0].state
    snap = StateSnapshot((torch.ones(2, 4),), {}, module=block)
    block(torch.ones(2, 4))
    later = snap.now()
    snap.restore()                          # as before the forward: the state it started from
    assert block[0].state is first and not hasattr(block[0], "extra")
    assert "weight" in block[0].lin._parameters     # parameters are not attributes
    later.restore()                         # as the forward left it
    assert block[0].state is not first and block[0].extra.shape == (2, 4)
    assert snap.changed_in_place() is None
    first.add_(1)                           # written in place: cannot be put back
    assert snap.changed_in_place() == "attribute 0.state"


def test_input_table_names_positional_inputs_by_the_signature():
    model, inputs = zm.raw_mlp(2, 8)
    got = input_table(model.forward, (inputs["x"],), {"target": inputs["target"]})
    assert got == [{"name": "x", "shape": [2, 8, zm.D], "dtype": "float32"},
                   {"name": "target", "shape": [2, 8], "dtype": "float32"}]
    seq = nn.Sequential(nn.Linear(4, 4))
    assert input_table(seq.forward, (torch.ones(3, 4),), {}) == [
        {"name": "input", "shape": [3, 4], "dtype": "float32"}]


# ----------------------------------------------------------------------------- stages and towers

class _Res(nn.Module):
    """A ResNet block: two 3x3 convolutions and a (1x1 where the width changes) shortcut."""

    def __init__(self, cin, cout):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(cin, cout, 3, 1, 1), nn.Conv2d(cout, cout, 3, 1, 1)
        self.short = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        return self.short(x) + self.conv2(torch.relu(self.conv1(x)))


class _Mix(nn.Module):
    """A per-pixel channel mixer standing in for a U-Net's transformer."""

    def __init__(self, c):
        super().__init__()
        self.a, self.b = nn.Linear(c, 2 * c), nn.Linear(2 * c, c)

    def forward(self, x):
        y = self.b(torch.relu(self.a(x.permute(0, 2, 3, 1))))
        return x + y.permute(0, 3, 1, 2)


class _Tower(nn.Module):
    """A U-Net tower as diffusers writes one: ``resnets`` and (optionally) ``attentions``
    called in turn, then a resampler; an up tower concatenates a skip connection before each
    ResNet block."""

    def __init__(self, cin, c, n, mix, sample=None, skips=()):
        super().__init__()
        self.resnets = nn.ModuleList([_Res((cin if i == 0 else c) + (skips[i] if skips else 0),
                                           c) for i in range(n)])
        self.attentions = nn.ModuleList([_Mix(c) for _ in range(n)]) if mix else None
        self.samplers = nn.ModuleList([sample]) if sample is not None else None
        self.up = bool(skips)

    def forward(self, x, skips=None):
        out = []
        for i, r in enumerate(self.resnets):
            if self.up:
                x = torch.cat([x, skips.pop()], 1)
            x = r(x)
            if self.attentions is not None:
                x = self.attentions[i](x)
            out.append(x)
        if self.samplers is not None:
            x = self.samplers[0](x)
            out.append(x)
        return x, out


class ToyUNet(nn.Module):
    """Two resolutions down, a middle block, two up, skips from every down layer."""

    def __init__(self, c=8):
        super().__init__()
        self.conv_in = nn.Conv2d(3, c, 3, 1, 1)
        self.down_blocks = nn.ModuleList([
            _Tower(c, c, 2, True, nn.Conv2d(c, c, 3, 2, 1)), _Tower(c, 2 * c, 2, False)])
        self.mid = _Tower(2 * c, 2 * c, 2, True)
        self.up_blocks = nn.ModuleList([
            _Tower(2 * c, 2 * c, 3, False, nn.Upsample(scale_factor=2.0),
                   skips=(2 * c, 2 * c, c)),
            _Tower(2 * c, c, 3, True, skips=(c, c, c))])
        self.conv_out = nn.Conv2d(c, 3, 3, 1, 1)

    def forward(self, x):
        skips = [self.conv_in(x)]
        x = skips[0]
        for d in self.down_blocks:
            x, s = d(x)
            skips += s
        x, _ = self.mid(x)
        for u in self.up_blocks:
            x, _ = u(x, skips)
        return self.conv_out(x).sum()


def test_the_layers_inside_u_net_towers_are_the_blocks():
    """Before: the two ResNet blocks of the one tower without attention and without
    resampler (``down_blocks.1``), everything else in the embedding and head. Now every ResNet
    block and mixer of every tower; the resamplers and the concatenations between them are
    code between blocks."""
    want = ["down_blocks.0.resnets.0", "down_blocks.0.attentions.0", "down_blocks.0.resnets.1",
            "down_blocks.0.attentions.1", "down_blocks.1.resnets.0", "down_blocks.1.resnets.1",
            "mid.resnets.0", "mid.attentions.0", "mid.resnets.1", "mid.attentions.1",
            "up_blocks.0.resnets.0", "up_blocks.0.resnets.1", "up_blocks.0.resnets.2",
            "up_blocks.1.resnets.0", "up_blocks.1.attentions.0", "up_blocks.1.resnets.1",
            "up_blocks.1.attentions.1", "up_blocks.1.resnets.2", "up_blocks.1.attentions.2"]
    assert detect(ToyUNet(), (torch.randn(2, 3, 8, 8),)) == want


class _Stage(nn.Module):
    """A ConvNeXt stage: a downsampling (here a heavy 5x5 convolution), then its layers."""

    def __init__(self, cin, c, depth):
        super().__init__()
        self.down = nn.Conv2d(cin, c, 5, 2, 2) if cin != c else nn.Identity()
        self.layers = nn.ModuleList([_Res(c, c) for _ in range(depth)])

    def forward(self, x):
        x = self.down(x)
        for layer in self.layers:
            x = layer(x)
        return x


class ToyConvNeXt(nn.Module):
    """Four stages of depths 2, 2, 3, 2, each after the first opening with a heavy
    downsampling: their layers hold 74-81% of a stage (under the 90% that made a run of
    stacks into their blocks)."""

    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList([_Stage(4, 4, 2), _Stage(4, 8, 2), _Stage(8, 16, 3),
                                     _Stage(16, 32, 2)])
        self.head = nn.Linear(32, 2)

    def forward(self, x):
        for s in self.stages:
            x = s(x)
        return self.head(x.mean((2, 3))).sum()


def test_the_layers_of_stages_are_the_blocks_though_downsampling_is_heavy():
    got = detect(ToyConvNeXt(), (torch.randn(2, 4, 32, 32),))
    assert got == [f"stages.{s}.layers.{i}" for s, d in enumerate((2, 2, 3, 2))
                   for i in range(d)]


def test_diffusers_u_nets_are_profiled_layer_by_layer():
    """UNet2DConditionModel and UNet2DModel from small configs: every ResNet block and
    transformer inside ``down_blocks``, ``mid_block`` and ``up_blocks`` (before: two blocks
    each, the rest in the embedding and head)."""
    pytest.importorskip("diffusers")
    towers = {"unet_condition": [("down_blocks.0", 2, True), ("down_blocks.1", 2, False),
                                 ("mid_block", 1, True), ("up_blocks.0", 3, False),
                                 ("up_blocks.1", 3, True)],
              "unet2d": [("down_blocks.0", 2, False), ("down_blocks.1", 2, True),
                         ("mid_block", 1, True), ("up_blocks.0", 3, True),
                         ("up_blocks.1", 3, False)]}
    for name, layout in towers.items():
        model, inputs = getattr(zm, name)(2, 16)
        want = []
        for tower, n, attn in layout:
            for i in range(n):
                want.append(f"{tower}.resnets.{i}")
                if attn:
                    want.append(f"{tower}.attentions.{i}")
            if tower == "mid_block":
                want.append("mid_block.resnets.1")
        assert detect(model, inputs) == want, name


def test_hugging_face_convnext_and_swin_stages_give_their_layers():
    """Depths 2, 2, 3, 2: nine blocks, not the four stages (ConvNeXt's downsampling held 10%
    of its last stage, over the 10% a run of stacks may hold outside its blocks)."""
    for name, prefix, inner in (("convnext", "convnext.encoder.stages", "layers"),
                                ("swin", "swin.encoder.layers", "blocks")):
        model, inputs = getattr(zm, name)(2, 16)
        assert detect(model, inputs) == [f"{prefix}.{s}.{inner}.{i}"
                                         for s, d in enumerate((2, 2, 3, 2)) for i in range(d)]


@pytest.mark.parametrize("name", zm.STAGED)
def test_staged_models_train_like_plain_pytorch_under_every_plan(name, tmp_path):
    """The zoo's four plans on the U-Nets, ConvNeXt and Swin, blocks found inside their
    stages: gradients, weights and buffers equal to plain PyTorch's; the up towers' ResNet
    blocks (fed a concatenated skip connection) and every stage's first layer after a
    downsampling are chain breaks."""
    import warnings

    from test_zoo import check_model
    if name.startswith("unet"):
        pytest.importorskip("diffusers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = check_model(name, tmp_path / "nvme")
    for plan, diff in got["diffs"].items():
        assert diff <= 1e-6, (name, plan, diff)
    breaks = got["profile"].model["chain_breaks"]
    if name.startswith("unet"):
        assert [b for b in breaks if b.startswith("up_blocks")] == [
            f"up_blocks.{t}.resnets.{i}" for t in range(2) for i in range(3)]
    else:
        assert len(breaks) == 3 and all(b.endswith(".0") for b in breaks)
    assert got["profile"].model["warnings"] == []


def test_no_plan_continues_a_segment_into_a_chain_break(tmp_path):
    """A U-Net's up-tower ResNet blocks take a concatenated skip connection, not the previous
    block's output: the solver and the sqrt baseline give them a checkpoint of their own (a
    segment cannot be replayed into them; apply_plan refuses checkpoint 'none' there), and
    the judge refuses a plan that does not."""
    from planner.costmodel.baselines import baseline_layers
    from planner.formats import Activation, Budgets, Tier
    from planner.hardware import load_hardware
    from planner.plans import make_plan
    from planner.profile import profile_module
    from planner.solve import solve_profile
    from runtime import apply_plan

    def build():
        torch.manual_seed(0)
        return ToyUNet(), (torch.randn(2, 3, 16, 16),)
    model, inputs = build()
    hw = load_hardware("cpu-host")
    prof = profile_module(model, inputs, name="unet", hardware=hw, timing="estimate")
    breaks = set(prof.model["chain_breaks"])
    assert {f"up_blocks.0.resnets.{i}" for i in range(3)} <= breaks
    roomy = Budgets(gpu_bytes=hw.memory_bytes, cpu_bytes=0, nvme_bytes=0)
    sqrt = baseline_layers("sqrt", prof.layers, hw, breaks)
    assert all(d.checkpoint is not Tier.NONE for d in sqrt if d.name in breaks)
    rec = make_plan(prof, None, hw, roomy, "recompute-all",
                    baseline_layers("recompute-all", prof.layers, hw))
    keep = make_plan(prof, None, hw, roomy, "keep-all",
                     baseline_layers("keep-all", prof.layers, hw))
    lo, hi = rec.predicted.peak_gpu_bytes, keep.predicted.peak_gpu_bytes
    seen = 0
    for f in (0.02, 0.1, 0.4):       # before: 'none' at 2-3 chain breaks at each budget
        gpu = int(lo + f * (hi - lo)) + hw.reserved_bytes
        plan = solve_profile(prof, None, hw, Budgets(gpu_bytes=gpu, cpu_bytes=0, nvme_bytes=0),
                             "optimal", time_limit=20).plan
        none = [d.name for d in plan.layers
                if d.activation is Activation.RECOMPUTE and d.checkpoint is Tier.NONE]
        seen += len(none)
        assert not breaks.intersection(none), (f, none)
        model, inputs = build()
        handle = apply_plan(model, plan)          # refused before: 'none' at a chain break
        model(*inputs).backward()
        handle.remove()
    assert seen                                   # segments do form elsewhere
    bad = [dataclasses.replace(d, activation=Activation.RECOMPUTE, checkpoint=Tier.NONE)
           if d.name == "up_blocks.0.resnets.1" else d for d in rec.layers]
    with pytest.raises(UserError, match="chain_breaks"):
        make_plan(prof, None, hw, roomy, "recompute-all", bad)
