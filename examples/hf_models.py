"""Tiny Hugging Face models built from configs (nothing is downloaded), as factories for
``plan profile examples.hf_models:gpt2 --batch 2 --seq 64`` and for the tests' model zoo.

Each factory is called as ``factory(batch, seq)`` and returns ``(model, inputs)``, ``inputs`` a
dict of keyword arguments with the labels that make the model return ``.loss``. Weights and
inputs come from a fixed seed under ``torch.random.fork_rng``, so two calls give identical
models and inputs and the caller's RNG is left as it was.

Every config is the library's default apart from size (hidden 64, 4 heads, 2-3 layers, a
vocabulary of 256) and dropout: where the architecture has dropout, it is 0.1, so that
recomputation must restore the RNG state to reproduce it. Nothing else is set for our
convenience: ``use_cache`` stays at its default (on, for the decoders), and the attention
implementation is whatever ``from_config`` picks (``sdpa`` where the model supports it).
"""
from __future__ import annotations

import math

import torch

SEED = 0
VOCAB = 256
HIDDEN = 64
HEADS = 4
FFN = 128
P = 0.1          # every dropout the architecture has


def _seeded(build, make_inputs):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = build()
        inputs = make_inputs()
    model.train()
    return model, inputs


def _lm_inputs(batch: int, seq: int):
    def make():
        ids = torch.randint(0, VOCAB, (batch, seq))
        # Hugging Face causal-LM heads shift labels internally, so labels are the input ids.
        return {"input_ids": ids, "labels": ids.clone()}
    return make


def _causal(config_cls, model_cls, batch, seq, **cfg):
    def build():
        config = config_cls(vocab_size=VOCAB, **cfg)
        return model_cls._from_config(config) if hasattr(model_cls, "_from_config") \
            else model_cls(config)
    return _seeded(build, _lm_inputs(batch, seq))


def gpt2(batch: int, seq: int, n_layer: int = 3):
    """GPT2LMHeadModel: 3 layers, hidden 64, 4 heads, dropout 0.1 (its default), tied head."""
    from transformers import GPT2Config, GPT2LMHeadModel
    return _causal(GPT2Config, GPT2LMHeadModel, batch, seq, n_positions=max(256, seq),
                   n_embd=HIDDEN, n_layer=n_layer, n_head=HEADS, bos_token_id=VOCAB - 1,
                   eos_token_id=VOCAB - 1)


def gpt2_default(batch: int, seq: int):
    """GPT2LMHeadModel exactly as ``GPT2Config()`` gives it: 12 layers, hidden 768, vocabulary
    50257, dropout 0.1, tied head, use_cache on -- 124M parameters, 2 GB of fp32 AdamW state
    (the layer-streaming benchmark's model nobody here wrote)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    def build():
        return GPT2LMHeadModel._from_config(GPT2Config())

    def make():
        ids = torch.randint(0, GPT2Config().vocab_size, (batch, seq))
        return {"input_ids": ids, "labels": ids.clone()}
    return _seeded(build, make)


def nanochat_default(batch: int, seq: int, **overrides):
    """NanoChatForCausalLM exactly as ``NanoChatConfig()`` gives it: 12 layers, hidden 768,
    MLP 8192, vocabulary 50304, untied head, attention dropout 0.0, use_cache on -- 257M
    parameters, 4.1 GB of fp32 AdamW state (a default-config model without a tied
    embedding, for the layer-streaming benchmark)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("nanochat", **overrides)

    def build():
        return AutoModelForCausalLM.from_config(config)

    def make():
        ids = torch.randint(0, config.vocab_size, (batch, seq))
        return {"input_ids": ids, "labels": ids.clone()}
    return _seeded(build, make)


def nanochat_default_dropout(batch: int, seq: int):
    """``nanochat_default`` with its one dropout (attention, 0.0 by default) at 0.1, so that
    a streamed run must replay dropout masks."""
    return nanochat_default(batch, seq, attention_dropout=P)


def llama(batch: int, seq: int, n_layer: int = 3):
    """LlamaForCausalLM: 3 layers, hidden 64, 4 heads sharing 2 KV heads, SwiGLU 176, RoPE,
    attention dropout 0.1, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM
    return _causal(LlamaConfig, LlamaForCausalLM, batch, seq, hidden_size=HIDDEN,
                   intermediate_size=176, num_hidden_layers=n_layer, num_attention_heads=HEADS,
                   num_key_value_heads=2, max_position_embeddings=max(256, seq),
                   attention_dropout=P, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)


def mistral(batch: int, seq: int, n_layer: int = 2):
    """MistralForCausalLM: grouped-query attention, RoPE, attention dropout 0.1."""
    from transformers import MistralConfig, MistralForCausalLM
    return _causal(MistralConfig, MistralForCausalLM, batch, seq, hidden_size=HIDDEN,
                   intermediate_size=FFN, num_hidden_layers=n_layer, num_attention_heads=HEADS,
                   num_key_value_heads=2, head_dim=HIDDEN // HEADS,
                   max_position_embeddings=max(256, seq), attention_dropout=P,
                   bos_token_id=1, eos_token_id=2)


def jamba(batch: int, seq: int, n_layer: int = 4):
    """JambaForCausalLM: Mamba layers with an attention layer among them (here the third of
    four), two classes of layer in one list; the library's 16 experts in every other layer
    (transformers runs them through ``aten._grouped_mm``). Mamba's projections and the experts
    save slices with gaps, which offload brings back laid out as saved."""
    from transformers import JambaConfig, JambaForCausalLM
    return _causal(JambaConfig, JambaForCausalLM, batch, seq, hidden_size=HIDDEN,
                   intermediate_size=FFN, num_hidden_layers=n_layer, num_attention_heads=HEADS,
                   num_key_value_heads=2, attn_layer_period=n_layer, attn_layer_offset=2,
                   mamba_d_state=8, mamba_dt_rank=8, attention_dropout=P)


def recurrent_gemma(batch: int, seq: int, n_layer: int = 3):
    """RecurrentGemmaForCausalLM: two recurrent (RG-LRU) layers, then local attention (its
    default pattern); each recurrent layer keeps its state in module attributes, which it starts
    from and leaves its final state in (``use_cache`` on, the default). Attention dropout 0.1."""
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM
    return _causal(RecurrentGemmaConfig, RecurrentGemmaForCausalLM, batch, seq,
                   hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=n_layer,
                   num_attention_heads=HEADS, num_key_value_heads=1, lru_width=HIDDEN,
                   attention_window_size=max(256, seq), attention_dropout=P, pad_token_id=0,
                   bos_token_id=1, eos_token_id=2)


def qwen2(batch: int, seq: int, n_layer: int = 2):
    """Qwen2ForCausalLM: QKV biases, grouped-query attention, attention dropout 0.1."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _causal(Qwen2Config, Qwen2ForCausalLM, batch, seq, hidden_size=HIDDEN,
                   intermediate_size=FFN, num_hidden_layers=n_layer, num_attention_heads=HEADS,
                   num_key_value_heads=2, max_position_embeddings=max(256, seq),
                   attention_dropout=P)


def phi(batch: int, seq: int, n_layer: int = 2):
    """PhiForCausalLM: parallel attention and MLP, partial rotary, dropout 0.1 everywhere."""
    from transformers import PhiConfig, PhiForCausalLM
    return _causal(PhiConfig, PhiForCausalLM, batch, seq, hidden_size=HIDDEN,
                   intermediate_size=FFN, num_hidden_layers=n_layer, num_attention_heads=HEADS,
                   max_position_embeddings=max(256, seq), resid_pdrop=P, embd_pdrop=P,
                   attention_dropout=P)


def gpt_neox(batch: int, seq: int, n_layer: int = 2):
    """GPTNeoXForCausalLM: parallel residual, 25% rotary, dropout 0.1."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return _causal(GPTNeoXConfig, GPTNeoXForCausalLM, batch, seq, hidden_size=HIDDEN,
                   intermediate_size=FFN, num_hidden_layers=n_layer, num_attention_heads=HEADS,
                   max_position_embeddings=max(256, seq), attention_dropout=P,
                   hidden_dropout=P, bos_token_id=0, eos_token_id=2)


def opt(batch: int, seq: int, n_layer: int = 2):
    """OPTForCausalLM: learned positions (offset 2), ReLU MLP, dropout 0.1, tied head."""
    from transformers import OPTConfig, OPTForCausalLM
    return _causal(OPTConfig, OPTForCausalLM, batch, seq, hidden_size=HIDDEN, ffn_dim=FFN,
                   word_embed_proj_dim=HIDDEN, num_hidden_layers=n_layer,
                   num_attention_heads=HEADS, max_position_embeddings=max(256, seq),
                   dropout=P, attention_dropout=P)


def falcon(batch: int, seq: int, n_layer: int = 2):
    """FalconForCausalLM: multi-query attention, parallel attention/MLP, RoPE, dropout 0.1."""
    from transformers import FalconConfig, FalconForCausalLM
    return _causal(FalconConfig, FalconForCausalLM, batch, seq, hidden_size=HIDDEN,
                   num_hidden_layers=n_layer, num_attention_heads=HEADS,
                   max_position_embeddings=max(256, seq), hidden_dropout=P,
                   attention_dropout=P, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)


def gemma(batch: int, seq: int, n_layer: int = 2):
    """GemmaForCausalLM: GeGLU, RMSNorm (1 + w), scaled embeddings, tied head, attention
    dropout 0.1."""
    from transformers import GemmaConfig, GemmaForCausalLM
    return _causal(GemmaConfig, GemmaForCausalLM, batch, seq, hidden_size=HIDDEN,
                   intermediate_size=FFN, num_hidden_layers=n_layer, num_attention_heads=HEADS,
                   num_key_value_heads=1, head_dim=HIDDEN // HEADS,
                   max_position_embeddings=max(256, seq), attention_dropout=P)


def nanochat(batch: int, seq: int, n_layer: int = 2):
    """NanoChatForCausalLM: parameter-free RMSNorm, QK norm, squared-ReLU MLP, logit
    soft-capping, untied head, attention dropout 0.1."""
    from transformers import NanoChatConfig, NanoChatForCausalLM
    return _causal(NanoChatConfig, NanoChatForCausalLM, batch, seq, hidden_size=HIDDEN,
                   intermediate_size=FFN, num_hidden_layers=n_layer, num_attention_heads=HEADS,
                   num_key_value_heads=HEADS, max_position_embeddings=max(256, seq),
                   attention_dropout=P)


def bert(batch: int, seq: int, n_layer: int = 2):
    """BertForMaskedLM: bidirectional encoder, absolute positions, token types, dropout 0.1
    (its default), decoder tied to the word embeddings."""
    from transformers import BertConfig, BertForMaskedLM

    def build():
        return BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN,
                                          num_hidden_layers=n_layer, num_attention_heads=HEADS,
                                          intermediate_size=FFN,
                                          max_position_embeddings=max(256, seq)))
    return _seeded(build, _lm_inputs(batch, seq))


def t5_lengths(seq: int) -> int:
    """The decoder length the T5 factory uses for an encoder length ``seq``: half of it (at
    least 2), so the two stacks run at different lengths."""
    return max(2, seq // 2)


def t5(batch: int, seq: int, n_layer: int = 2):
    """T5ForConditionalGeneration: encoder and decoder stacks of ``n_layer`` blocks each,
    relative position bias (computed in each stack's first block and passed on), dropout 0.1
    (its default), shared embedding. Inputs: ``input_ids`` [batch, seq] and ``labels``
    [batch, seq // 2] (the decoder's length)."""
    from transformers import T5Config, T5ForConditionalGeneration

    def build():
        return T5ForConditionalGeneration(T5Config(
            vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=FFN,
            num_layers=n_layer, num_heads=HEADS, decoder_start_token_id=0))

    def make():
        return {"input_ids": torch.randint(0, VOCAB, (batch, seq)),
                "labels": torch.randint(0, VOCAB, (batch, t5_lengths(seq)))}
    return _seeded(build, make)


def whisper(batch: int, seq: int, n_layer: int = 2):
    """WhisperForConditionalGeneration: a speech encoder (two convolutions, then ``n_layer``
    blocks, fixed sinusoidal positions that take no gradient) and a decoder of ``n_layer``
    blocks; dropout 0.1. Inputs: ``input_features`` [batch, 8 mel bins, 2 * seq] (the
    convolutions halve it to seq positions) and ``labels`` [batch, seq // 2]."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    mel = 8

    def build():
        return WhisperForConditionalGeneration(WhisperConfig(
            vocab_size=VOCAB, num_mel_bins=mel, d_model=HIDDEN, encoder_layers=n_layer,
            decoder_layers=n_layer, encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
            encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, max_source_positions=seq,
            max_target_positions=max(256, seq), dropout=P, attention_dropout=P,
            pad_token_id=VOCAB - 1, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1,
            decoder_start_token_id=VOCAB - 2))

    def make():
        return {"input_features": torch.randn(batch, mel, 2 * seq),
                "labels": torch.randint(0, VOCAB - 2, (batch, t5_lengths(seq)))}
    return _seeded(build, make)


def vit_side(seq: int, patch: int = 4) -> int:
    """Image side for about ``seq`` patches of ``patch`` pixels: the ViT factory's image is
    ``patch * round(sqrt(seq))`` pixels square."""
    return patch * max(1, round(math.sqrt(seq)))


def vit(batch: int, seq: int, n_layer: int = 2):
    """ViTForImageClassification: ``seq`` is the number of 4x4 patches (rounded to a square),
    10 classes, dropout 0.1 on hidden states and attention."""
    from transformers import ViTConfig, ViTForImageClassification
    side = vit_side(seq)

    def build():
        return ViTForImageClassification(ViTConfig(
            hidden_size=HIDDEN, num_hidden_layers=n_layer, num_attention_heads=HEADS,
            intermediate_size=FFN, image_size=side, patch_size=4, num_labels=10,
            hidden_dropout_prob=P, attention_probs_dropout_prob=P))

    def make():
        return {"pixel_values": torch.randn(batch, 3, side, side),
                "labels": torch.randint(0, 10, (batch,))}
    return _seeded(build, make)


def resnet18(batch: int, seq: int):
    """torchvision's ResNet-18 (10 classes) on ``seq`` x ``seq`` images: BatchNorm, in-place
    ReLU, stages of two residual blocks. Needs torchvision; returns ``(model, (images,))``."""
    import torchvision

    def make():
        return (torch.randn(batch, 3, seq, seq),)
    return _seeded(lambda: torchvision.models.resnet18(num_classes=10), make)


def available(name: str) -> bool:
    """Whether the installed transformers has zoo entry ``name``'s architecture (NanoChat
    arrived in transformers 5; the others are older than the 4.40 the project needs)."""
    if not name.startswith("nanochat"):
        return True
    from transformers import CONFIG_MAPPING
    return "nanochat" in CONFIG_MAPPING


ZOO = ("gpt2", "llama", "mistral", "qwen2", "phi", "gpt_neox", "opt", "falcon", "gemma",
       "nanochat", "jamba", "recurrent_gemma", "bert", "t5", "whisper", "vit")
