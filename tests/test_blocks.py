"""Finding blocks from what the forward runs, ``--blocks`` names and patterns, and the call
helpers the profiler and the runtime share (hidden state, state snapshots)."""
from __future__ import annotations

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
