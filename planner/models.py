"""Built-in models: one decoder-only transformer for the GPT-2/GPT-3 and LLaMA families.

A reader sees the whole model here (nanoGPT style). Configurations live in
``profiles/models/<name>.yaml``; ``load_config`` reads them and ``build_model`` builds them on
any device, ``meta`` included (nothing is allocated there, so a 175B model costs nothing).

Families:
- ``gpt``: LayerNorm, GELU (tanh approximation, as GPT-2's ``gelu_new``) MLP of 4*d, learned
  positions, biases, dropout on embeddings, attention probabilities and both residual branches,
  lm_head tied to the token embedding when ``tie_embeddings``.
- ``llama``: RMSNorm, SwiGLU MLP, rotary position embeddings (RoPE), grouped-query attention,
  no biases, no dropout unless the config sets ``dropout``.

Attention goes through ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)``, so
the kernel is whatever PyTorch picks on the device (the profiler records it). The model's
``forward(input_ids, labels=None)`` returns an object with ``.loss`` and ``.logits``; its
blocks are ``model.blocks`` (``blocks.0``, ``blocks.1``, ...), each ``block(x) -> x``: the rotary
tables are non-persistent buffers of the model read by every block, so blocks take no side
inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from planner import PROFILES_DIR
from planner.errors import UserError
from planner.hardware import read_yaml_mapping

MODELS_DIR = PROFILES_DIR / "models"

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# Keys every config must have, per family; the rest have defaults below.
_REQUIRED = ("family", "n_layers", "d_model", "n_heads", "vocab_size", "max_seq")
_DEFAULTS = {
    "gpt": {"n_kv_heads": None, "d_ff": None, "dropout": 0.1, "bias": True,
            "tie_embeddings": True, "norm_eps": 1e-5, "dtype": "bf16"},
    "llama": {"n_kv_heads": None, "d_ff": None, "dropout": 0.0, "bias": False,
              "tie_embeddings": False, "norm_eps": 1e-5, "rope_theta": 10000.0, "dtype": "bf16"},
}


# ----------------------------------------------------------------------------- configs

def builtin_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.yaml"))


def load_config(name_or_yaml: str) -> dict:
    """A built-in name (``gpt2-small``) or a path to a model YAML -> a complete config dict."""
    p = Path(name_or_yaml)
    if p.suffix in (".yaml", ".yml"):
        source = p      # read_yaml_mapping refuses a missing, special or over-long path
        return _complete(read_yaml_mapping(source, "model config", "profiles/models/*.yaml",
                                           label=f"model '{name_or_yaml}'"), str(source))
    else:
        source = MODELS_DIR / f"{name_or_yaml}.yaml"
        if name_or_yaml not in builtin_names():   # no stat: a 3,000-character name raised
            raise UserError(f"model '{name_or_yaml}' is unknown; use one of "
                            f"{', '.join(builtin_names())}, a model YAML, or package.module:function")
    cfg = read_yaml_mapping(source, "model config", "profiles/models/*.yaml")
    return _complete(cfg, str(source))


def _complete(cfg: dict, source: str) -> dict:
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise UserError(f"model config '{source}' lacks {', '.join(missing)}; "
                        "see profiles/models/gpt2-small.yaml for the fields")
    fam = cfg["family"]
    if fam not in _DEFAULTS:
        raise UserError(f"model config '{source}': family {fam!r} is unknown; use gpt or llama")
    out = dict(_DEFAULTS[fam])
    out.update(cfg)
    out.setdefault("name", Path(source).stem)
    if out["n_kv_heads"] is None:
        out["n_kv_heads"] = out["n_heads"]
    if out["d_ff"] is None:
        out["d_ff"] = 4 * out["d_model"]
    for k in ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "max_seq"):
        if not isinstance(out[k], int) or out[k] <= 0:
            raise UserError(f"model config '{source}': {k} must be a positive integer, "
                            f"got {out[k]!r}")
    if out["d_model"] % out["n_heads"] or out["n_heads"] % out["n_kv_heads"]:
        raise UserError(f"model config '{source}': d_model must divide by n_heads and n_heads "
                        "by n_kv_heads")
    if out["dtype"] not in DTYPES:
        raise UserError(f"model config '{source}': dtype {out['dtype']!r}; use bf16, fp16 or fp32")
    return out


# ----------------------------------------------------------------------------- modules

class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 as LLaMA does (Zhang & Sennrich 2019)."""

    def __init__(self, d, eps, **fk):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(d, **fk))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """RoPE tables (Su et al. 2021) for positions 0..max_seq-1, in the model's dtype.

    Non-persistent buffers: moved and cast with the model, absent from its state dict.
    """

    def __init__(self, head_dim, max_seq, theta, **fk):
        super().__init__()
        device = fk.get("device")
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device)
                               / head_dim))
        t = torch.arange(max_seq, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)          # [max_seq, head_dim]
        dtype = fk.get("dtype") or torch.float32
        self.register_buffer("cos", emb.cos().to(dtype), persistent=False)
        self.register_buffer("sin", emb.sin().to(dtype), persistent=False)

    @staticmethod
    def _rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def apply(self, q, k):
        s = q.shape[-2]
        cos, sin = self.cos[:s], self.sin[:s]
        return (q * cos + self._rotate_half(q) * sin,
                k * cos + self._rotate_half(k) * sin)


class Attention(nn.Module):
    def __init__(self, cfg, rotary, **fk):
        super().__init__()
        d, self.n_heads, self.n_kv = cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"]
        self.head_dim = d // self.n_heads
        self.dropout = float(cfg["dropout"])
        bias = bool(cfg["bias"])
        if cfg["family"] == "gpt":
            self.qkv = nn.Linear(d, 3 * d, bias=bias, **fk)      # GPT-2's fused c_attn
        else:
            self.q = nn.Linear(d, d, bias=bias, **fk)
            self.k = nn.Linear(d, self.n_kv * self.head_dim, bias=bias, **fk)
            self.v = nn.Linear(d, self.n_kv * self.head_dim, bias=bias, **fk)
        self.proj = nn.Linear(d, d, bias=bias, **fk)
        # A plain attribute, not a submodule: every block reads the model's one table.
        object.__setattr__(self, "_rotary", rotary)

    def forward(self, x):
        b, s, d = x.shape
        if hasattr(self, "qkv"):
            q, k, v = self.qkv(x).split(d, dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.n_kv, self.head_dim).transpose(1, 2)
        if self._rotary is not None:
            q, k = self._rotary.apply(q, k)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv != self.n_heads)
        y = y.transpose(1, 2).reshape(b, s, d)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg, **fk):
        super().__init__()
        d, f, bias = cfg["d_model"], cfg["d_ff"], bool(cfg["bias"])
        self.gated = cfg["family"] == "llama"
        if self.gated:                                   # SwiGLU (Shazeer 2020)
            self.gate = nn.Linear(d, f, bias=bias, **fk)
        self.up = nn.Linear(d, f, bias=bias, **fk)
        self.down = nn.Linear(f, d, bias=bias, **fk)

    def forward(self, x):
        if self.gated:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg, rotary, **fk):
        super().__init__()
        norm = _norm(cfg, **fk)
        self.norm1, self.norm2 = norm(), norm()
        self.attn = Attention(cfg, rotary, **fk)
        self.mlp = MLP(cfg, **fk)
        self.drop = nn.Dropout(cfg["dropout"])

    def forward(self, x):
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.drop(self.mlp(self.norm2(x)))


def _norm(cfg, **fk):
    if cfg["family"] == "gpt":
        return lambda: nn.LayerNorm(cfg["d_model"], eps=cfg["norm_eps"], bias=bool(cfg["bias"]), **fk)
    return lambda: RMSNorm(cfg["d_model"], cfg["norm_eps"], **fk)


@dataclass
class CausalLMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class Transformer(nn.Module):
    def __init__(self, cfg, **fk):
        super().__init__()
        self.config = cfg
        d = cfg["d_model"]
        self.tok_emb = nn.Embedding(cfg["vocab_size"], d, **fk)
        if cfg["family"] == "gpt":
            self.pos_emb = nn.Embedding(cfg["max_seq"], d, **fk)
            self.rotary = None
        else:
            self.pos_emb = None
            self.rotary = Rotary(d // cfg["n_heads"], cfg["max_seq"], float(cfg["rope_theta"]), **fk)
        self.drop = nn.Dropout(cfg["dropout"])
        self.blocks = nn.ModuleList(Block(cfg, self.rotary, **fk) for _ in range(cfg["n_layers"]))
        self.norm_f = _norm(cfg, **fk)()
        self.lm_head = nn.Linear(d, cfg["vocab_size"], bias=False, **fk)
        if cfg["tie_embeddings"]:
            self.lm_head.weight = self.tok_emb.weight

    def forward(self, input_ids, labels=None):
        b, s = input_ids.shape
        if s > self.config["max_seq"]:
            raise ValueError(f"sequence length {s} exceeds the model's max_seq "
                             f"{self.config['max_seq']}")
        x = self.tok_emb(input_ids)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(s, device=input_ids.device))
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.norm_f(x))
        loss = None
        if labels is not None:
            # fp32 loss, as Hugging Face's ForCausalLMLoss does: log-softmax over a large
            # vocabulary in 16 bits loses too much precision.
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))
        return CausalLMOutput(loss=loss, logits=logits)


def _init_weights(model: Transformer, seed: int) -> None:
    """GPT-2 initialisation (normal 0.02; residual projections scaled by 1/sqrt(2L)), seeded
    through a private generator so the global RNG is left alone."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    n_layers = model.config["n_layers"]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight", "norm_f.weight")):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                std = 0.02 / math.sqrt(2 * n_layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                cpu = torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=g)
                p.copy_(cpu)


def build_model(name_or_config, dtype: str | None = None, device="cpu", seed: int = 0) -> nn.Module:
    """Build a built-in model (name, YAML path or config dict) in ``dtype`` on ``device``.

    ``dtype`` is ``bf16``, ``fp16`` or ``fp32`` (default: the config's). On ``meta`` nothing is
    allocated and weights are left uninitialised; elsewhere they are initialised from ``seed``.
    """
    cfg = load_config(name_or_config) if isinstance(name_or_config, str) else \
        _complete(dict(name_or_config), "config")
    dtype = dtype or cfg["dtype"]
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: use bf16, fp16 or fp32")
    fk = {"device": torch.device(device), "dtype": DTYPES[dtype]}
    model = Transformer(cfg, **fk)
    if fk["device"].type != "meta":
        _init_weights(model, seed)
    return model


def make_inputs(config: dict, batch: int, seq: int, device="cpu", seed: int = 0) -> dict:
    """Synthetic tokens: ``labels`` are ``input_ids`` shifted left by one (next-token targets)."""
    device = torch.device(device)
    if device.type == "meta":
        ids = torch.empty(batch, seq + 1, dtype=torch.long, device=device)
    else:
        g = torch.Generator(device="cpu").manual_seed(seed)
        ids = torch.randint(0, config["vocab_size"], (batch, seq + 1), generator=g).to(device)
    return {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
