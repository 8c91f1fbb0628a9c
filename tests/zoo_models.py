"""Custom models for the zoo: shapes people write that are not a Hugging Face stack.

Each factory is ``factory(batch, seq) -> (model, inputs)`` like ``examples.hf_models``, seeded,
with dropout 0.1 inside every block; importable as ``plan profile zoo_models:nested`` from
``tests/``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

D, V = 32, 64


class Out(dict):
    """A minimal output with ``.loss`` (what training loops and the profiler look for)."""

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError:
            raise AttributeError(k) from None


class Block(nn.Module):
    """Pre-norm residual MLP with dropout: ``x + drop(W2 gelu(W1 norm(x)))``."""

    def __init__(self, d=D, hidden=2 * D):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return x + self.drop(self.down(F.gelu(self.up(self.norm(x)))))


def _lm_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def _seeded(build, inputs):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build()
        inp = inputs()
    model.train()
    return model, inp


def _ids(batch, seq):
    def make():
        ids = torch.randint(0, V, (batch, seq))
        return {"ids": ids, "labels": ids.roll(-1, dims=1)}
    return make


class Nested(nn.Module):
    """A ModuleList of 2 stages, each a ModuleList of 3 blocks: the lists never run, the six
    blocks do (``stages.0.0`` .. ``stages.1.2``)."""

    def __init__(self, stages=2, per_stage=3, called_stages=False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        def stage():
            blocks = [Block() for _ in range(per_stage)]
            return nn.Sequential(*blocks) if called_stages else nn.ModuleList(blocks)
        self.stages = nn.ModuleList([stage() for _ in range(stages)])
        self.called = called_stages
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V)

    def forward(self, ids, labels=None):
        x = self.emb(ids)
        for stage in self.stages:
            if self.called:
                x = stage(x)
            else:
                for blk in stage:
                    x = blk(x)
        logits = self.head(self.norm(x))
        return Out(loss=_lm_loss(logits, labels), logits=logits)


def nested(batch, seq):
    return _seeded(Nested, _ids(batch, seq))


def nested_called(batch, seq):
    """The same 2 x 3 blocks with each stage an ``nn.Sequential`` that runs as a whole."""
    return _seeded(lambda: Nested(called_stages=True), _ids(batch, seq))


class MixedSeq(nn.Module):
    """``self.net = nn.Sequential(Embedding, Block x 4, LayerNorm, Linear)``: the blocks are
    ``net.1`` .. ``net.4``, not the Sequential's seven children."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(V, D), *[Block() for _ in range(4)],
                                 nn.LayerNorm(D), nn.Linear(D, V))

    def forward(self, ids, labels=None):
        logits = self.net(ids)
        return Out(loss=_lm_loss(logits, labels), logits=logits)


def mixed_sequential(batch, seq):
    return _seeded(MixedSeq, _ids(batch, seq))


def bare_sequential(batch, seq):
    """The model *is* ``nn.Sequential(Linear, Block x 3, Linear)`` on float input: the blocks
    are ``1`` .. ``3`` (names with no prefix) and the scalar is the output's sum."""
    def build():
        return nn.Sequential(nn.Linear(D, D), *[Block() for _ in range(3)], nn.Linear(D, 4))
    return _seeded(build, lambda: (torch.randn(batch, seq, D),))


def only_blocks(batch, seq):
    """``nn.Sequential(Block x 3)`` on the raw input: no parameter outside the blocks, so
    nothing but the blocks makes the output require grad."""
    return _seeded(lambda: nn.Sequential(*[Block() for _ in range(3)]),
                   lambda: (torch.randn(batch, seq, D),))


class RawMLP(nn.Module):
    """Residual MLP blocks applied straight to the raw float input, which does not require
    grad: the first block's input is the user's tensor."""

    def __init__(self, n=3):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(n)])
        self.out = nn.Linear(D, 1)

    def forward(self, x, target=None):
        for b in self.blocks:
            x = b(x)
        y = self.out(x).squeeze(-1)
        return Out(loss=F.mse_loss(y, target), y=y)


def raw_mlp(batch, seq):
    return _seeded(RawMLP, lambda: {"x": torch.randn(batch, seq, D),
                                    "target": torch.randn(batch, seq)})


class InplaceBlock(nn.Module):
    """Starts with ``ReLU(inplace=True)`` on its own input (legal: the Linear that made the
    input does not need its output for backward)."""

    def __init__(self):
        super().__init__()
        self.act = nn.ReLU(inplace=True)
        self.lin = nn.Linear(D, D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        return self.drop(self.lin(self.act(x)))


class Inplace(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.blocks = nn.ModuleList([InplaceBlock() for _ in range(n)])
        self.out = nn.Linear(D, 1)

    def forward(self, x, target=None):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        y = self.out(x).squeeze(-1)
        return Out(loss=F.mse_loss(y, target), y=y)


def inplace(batch, seq):
    return _seeded(Inplace, lambda: {"x": torch.randn(batch, seq, D),
                                     "target": torch.randn(batch, seq)})


class StateCache:
    """A per-forward state object as transformers 5.25's ``LinearAttentionLayer`` is: its
    tensors allocated up front and written in place (``copy_``, ``add_``) by the layers that
    use it, a counter shared by all of them."""

    def __init__(self, batch, n, device, k=3):
        self.seen = torch.zeros((), dtype=torch.long, device=device)
        self.conv = [torch.zeros(batch, D, k, device=device) for _ in range(n)]


class CacheMixer(nn.Module):
    """A short causal convolution over time that starts from its cached state (zeros in a
    first forward) and leaves its last inputs there, in place."""

    def __init__(self, idx, k=3):
        super().__init__()
        self.idx, self.k = idx, k
        self.norm = nn.LayerNorm(D)
        self.conv = nn.Conv1d(D, D, k, groups=D)
        self.proj = nn.Linear(D, D)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, cache):
        h = self.norm(x).transpose(1, 2)                        # b, D, s
        full = torch.cat([cache.conv[self.idx], h], dim=-1)
        y = self.conv(full)[..., -h.shape[-1]:].transpose(1, 2)
        with torch.no_grad():
            cache.conv[self.idx].copy_(full[..., -self.k:])
            cache.seen.add_(h.shape[-1])
        return x + self.drop(self.proj(F.silu(y)))


class CachedLM(nn.Module):
    """Mixers that write the cache in place, with plain MLP blocks (which never see the
    cache) between them: only the mixers cannot be run again as they first ran."""

    def __init__(self, n=4):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.layers = nn.ModuleList([CacheMixer(i) if i % 2 == 0 else Block() for i in range(n)])
        self.lm_head = nn.Linear(D, V)

    def forward(self, ids, labels=None):
        x = self.tok(ids)
        cache = StateCache(ids.shape[0], len(self.layers), ids.device)
        for layer in self.layers:
            x = layer(x, cache) if isinstance(layer, CacheMixer) else layer(x)
        logits = self.lm_head(x)
        return Out(loss=_lm_loss(logits, labels), logits=logits, cache=cache)


def cached(batch, seq):
    return _seeded(CachedLM, _ids(batch, seq))


class TiedLM(nn.Module):
    """Token embedding tied to the output projection, learned positions, 3 blocks."""

    def __init__(self, n=3):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Embedding(256, D)
        self.layers = nn.ModuleList([Block() for _ in range(n)])
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
        self.lm_head.weight = self.tok.weight

    def forward(self, ids, labels=None):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.tok(ids) + self.pos(pos)
        for blk in self.layers:
            x = blk(x)
        logits = self.lm_head(self.norm(x))
        return Out(loss=_lm_loss(logits, labels), logits=logits)


def tied(batch, seq):
    return _seeded(TiedLM, _ids(batch, seq))


class ConvBlock(nn.Module):
    """A ResNet basic block as torchvision writes it: conv-BN-ReLU(inplace)-conv-BN, a strided
    1x1 downsample where the shape changes, ``out += identity``, ReLU(inplace)."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ConvNet(nn.Module):
    """A two-stage ResNet (stages of two ConvBlocks, the second stage strided): its blocks
    are the four ConvBlocks, whose BatchNorm statistics a recomputation must not update
    twice."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8),
                                  nn.ReLU(inplace=True))
        self.layer1 = nn.Sequential(ConvBlock(8, 8), ConvBlock(8, 8))
        self.layer2 = nn.Sequential(ConvBlock(8, 16, 2), ConvBlock(16, 16))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(self.pool(x), 1))


def convnet(batch, seq):
    """``seq`` x ``seq`` images; the scalar is the logits' sum."""
    return _seeded(ConvNet, lambda: (torch.randn(batch, 3, seq, seq),))


CUSTOM = ("nested", "nested_called", "mixed_sequential", "bare_sequential", "only_blocks",
          "raw_mlp", "inplace", "tied", "convnet")


# Models from other libraries whose blocks sit inside stages and U-Net towers. Each is built
# from its config class with small sizes, dropout 0.1 where it has any; the diffusers ones need
# diffusers (the tests skip without it).

def unet_condition(batch, seq):
    """diffusers' UNet2DConditionModel: two resolutions, one cross-attention tower each way,
    two layers per block: ResNet blocks and transformers inside ``down_blocks``,
    ``mid_block`` and ``up_blocks``, skip connections concatenated in the up blocks. ``seq``
    x ``seq`` latents; the scalar is the output's sum."""
    from diffusers import UNet2DConditionModel

    def build():
        return UNet2DConditionModel(
            sample_size=seq, block_out_channels=(16, 32), layers_per_block=2,
            cross_attention_dim=16, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8,
            norm_num_groups=8, dropout=0.1)
    return _seeded(build, lambda: {"sample": torch.randn(batch, 4, seq, seq),
                                   "timestep": torch.tensor([10] * batch),
                                   "encoder_hidden_states": torch.randn(batch, 5, 16)})


def unet2d(batch, seq):
    """diffusers' UNet2DModel: a plain tower and one with self-attention, each way."""
    from diffusers import UNet2DModel

    def build():
        return UNet2DModel(
            sample_size=seq, block_out_channels=(16, 32), layers_per_block=2,
            down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
            attention_head_dim=8, dropout=0.1)
    return _seeded(build, lambda: {"sample": torch.randn(batch, 3, seq, seq),
                                   "timestep": torch.tensor([10] * batch)})


def convnext(batch, seq):
    """Hugging Face ConvNeXt, stages of depths 2, 2, 3, 2 (each after the first opens with a
    downsampling layer), drop path 0.1; ``4 seq`` x ``4 seq`` images and labels."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    def build():
        cfg = ConvNextConfig(hidden_sizes=[8, 16, 32, 64], depths=[2, 2, 3, 2], num_labels=10,
                             drop_path_rate=0.1)
        return ConvNextForImageClassification(cfg)
    return _seeded(build, lambda: {"pixel_values": torch.randn(batch, 3, 4 * seq, 4 * seq),
                                   "labels": torch.arange(batch) % 10})


def swin(batch, seq):
    """Hugging Face Swin, stages of depths 2, 2, 3, 2 with a patch merging between each two,
    dropout and drop path 0.1; ``8 seq`` x ``8 seq`` images and labels."""
    from transformers import SwinConfig, SwinForImageClassification

    def build():
        cfg = SwinConfig(image_size=8 * seq, patch_size=4, embed_dim=8, depths=[2, 2, 3, 2],
                         num_heads=[1, 2, 2, 4], window_size=4, num_labels=10,
                         hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                         drop_path_rate=0.1)
        return SwinForImageClassification(cfg)
    return _seeded(build, lambda: {"pixel_values": torch.randn(batch, 3, 8 * seq, 8 * seq),
                                   "labels": torch.arange(batch) % 10})


STAGED = ("unet_condition", "unet2d", "convnext", "swin")
