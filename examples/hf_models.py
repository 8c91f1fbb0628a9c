"""Tiny Hugging Face models built from configs (nothing is downloaded), as factories for
``plan profile examples.hf_models:gpt2 --batch 2 --seq 64`` and for the runtime's tests.

Each factory is called as ``factory(batch, seq)`` and returns ``(model, inputs)`` with
``inputs = dict(input_ids=..., labels=...)``. Weights and tokens come from a fixed seed under
``torch.random.fork_rng``, so two calls give identical models and inputs and the caller's RNG
is left as it was. Attention uses ``attn_implementation="sdpa"`` (PyTorch's fused kernels, the
ones a real training job runs); GPT-2 keeps its dropout (0.1 on embeddings, attention and
residuals), so recomputation must restore the RNG state to reproduce it. ``use_cache=False``:
a training step keeps no key/value cache.
"""
from __future__ import annotations

import torch

SEED = 0
VOCAB = 256


def _inputs(batch: int, seq: int) -> dict:
    ids = torch.randint(0, VOCAB, (batch, seq))
    # Hugging Face causal-LM heads shift labels internally, so labels are the input ids.
    return {"input_ids": ids, "labels": ids.clone()}


def gpt2(batch: int, seq: int, n_layer: int = 3):
    """GPT2LMHeadModel: 3 layers, hidden 64, 4 heads, vocab 256, dropout 0.1, tied head."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=max(256, seq), n_embd=64, n_layer=n_layer,
                     n_head=4, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1,
                     bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, use_cache=False,
                     attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = GPT2LMHeadModel(cfg)
        inputs = _inputs(batch, seq)
    model.loss_type = "ForCausalLM"   # the class name does not match the loss table
    model.train()
    return model, inputs


def llama(batch: int, seq: int, n_layer: int = 3):
    """LlamaForCausalLM: 3 layers, hidden 64, 4 heads sharing 2 KV heads, SwiGLU 176, RoPE,
    vocab 256, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176,
                      num_hidden_layers=n_layer, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max(256, seq), rope_theta=500000.0,
                      tie_word_embeddings=False, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1,
                      pad_token_id=None, use_cache=False, attn_implementation="sdpa")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(cfg)
        inputs = _inputs(batch, seq)
    model.loss_type = "ForCausalLM"   # the class name does not match the loss table
    model.train()
    return model, inputs
