"""The model zoo: published shapes, parameter counts, the forward contract, the HF examples."""
import pytest
import torch

from planner.errors import UserError
from planner.models import build_model, builtin_names, load_config, make_inputs

# Parameter counts of the released checkpoints (sum of numel over named_parameters, tied
# weights once), as Hugging Face reports them for openai-community/gpt2, gpt2-xl and
# meta-llama/Meta-Llama-3-8B, Meta-Llama-3-70B, Llama-3.2-3B.
PUBLISHED = {
    "gpt2-small": 124_439_808,
    "gpt2-xl": 1_557_611_200,
    "llama3.2-3b": 3_212_749_824,
    "llama3-8b": 8_030_261_248,
    "llama3-70b": 70_553_706_496,
}


def test_builtins_present():
    for name in ("gpt-tiny", "llama-tiny", "gpt2-small", "gpt2-xl", "gpt3-175b",
                 "llama3.2-3b", "llama3-8b", "llama3-70b"):
        assert name in builtin_names()


@pytest.mark.parametrize("name,count", sorted(PUBLISHED.items()))
def test_param_counts_match_published(name, count):
    model = build_model(name, device="meta")
    assert sum(p.numel() for p in model.parameters()) == count


def test_gpt3_175b_shape():
    cfg = load_config("gpt3-175b")
    assert (cfg["n_layers"], cfg["d_model"], cfg["n_heads"], cfg["max_seq"]) == (96, 12288, 96, 2048)
    model = build_model(cfg, device="meta")
    n = sum(p.numel() for p in model.parameters())
    # 12 L d^2 (blocks) + V d + n_ctx d (embeddings) + small terms: 174.6e9, "175B" in Brown et al.
    assert 174.5e9 < n < 174.7e9
    assert len(model.blocks) == 96
    assert all(p.device.type == "meta" for p in model.parameters())


def test_llama3_8b_config():
    cfg = load_config("llama3-8b")
    assert (cfg["n_layers"], cfg["d_model"], cfg["n_heads"], cfg["n_kv_heads"], cfg["d_ff"],
            cfg["vocab_size"], cfg["rope_theta"], cfg["tie_embeddings"]) == \
        (32, 4096, 32, 8, 14336, 128256, 500000.0, False)


def test_tied_embeddings():
    m = build_model("gpt-tiny", device="meta")
    assert m.lm_head.weight is m.tok_emb.weight
    m = build_model("llama-tiny", device="meta")
    assert m.lm_head.weight is not m.tok_emb.weight
    m = build_model("llama3.2-3b", device="meta")
    assert m.lm_head.weight is m.tok_emb.weight


def test_unknown_model_is_user_error():
    with pytest.raises(UserError, match="gpt2-small"):
        load_config("gpt5-huge")


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_forward_contract(name, dtype):
    cfg = load_config(name)
    model = build_model(name, dtype=dtype)
    inputs = make_inputs(cfg, 2, 16, seed=1)
    assert inputs["input_ids"].shape == (2, 16) and inputs["labels"].shape == (2, 16)
    out = model(**inputs)
    assert out.logits.shape == (2, 16, cfg["vocab_size"])
    assert out.logits.dtype == {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model(inputs["input_ids"]).loss is None
    # blocks are model.blocks, each block(x) -> x
    x = torch.randn(2, 16, cfg["d_model"], dtype=out.logits.dtype)
    assert model.blocks[0](x).shape == x.shape
    # seeded: the same build twice has identical weights
    again = build_model(name, dtype=dtype)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  again.state_dict().values()))


def test_dropout_defaults():
    assert load_config("gpt2-small")["dropout"] == 0.1
    assert load_config("llama3-8b")["dropout"] == 0.0
    m = build_model("gpt-tiny", dtype="fp32")
    inputs = make_inputs(load_config("gpt-tiny"), 1, 8)
    m.eval()
    with torch.no_grad():
        assert torch.equal(m(**inputs).logits, m(**inputs).logits)   # no dropout in eval
    m.train()
    torch.manual_seed(0)
    with torch.no_grad():
        a, b = m(**inputs).logits, m(**inputs).logits
    assert not torch.equal(a, b)                                    # dropout on in training


@pytest.mark.parametrize("factory", ["gpt2", "llama"])
def test_hf_examples_deterministic(factory):
    pytest.importorskip("transformers")
    import examples.hf_models as hf
    f = getattr(hf, factory)
    m1, i1 = f(2, 16)
    m2, i2 = f(2, 16)
    assert set(i1) == {"input_ids", "labels"} and i1["input_ids"].shape == (2, 16)
    assert torch.equal(i1["input_ids"], i2["input_ids"])
    for a, b in zip(m1.state_dict().values(), m2.state_dict().values()):
        assert torch.equal(a, b)
    m1.eval()
    assert torch.isfinite(m1(**i1).loss)


# Config fields the zoo factories may set: sizes, dropout (0.1 wherever the architecture has
# it), token ids that must fall inside the small vocabulary, class labels. Everything else,
# use_cache and the attention implementation included, is the library's default.
ZOO_SET = {"vocab_size", "hidden_size", "n_embd", "d_model", "d_kv", "d_ff", "head_dim",
           "intermediate_size", "ffn_dim", "ffn_hidden_size", "word_embed_proj_dim",
           "num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "layer_types",
           "num_attention_heads", "n_head", "num_heads", "num_key_value_heads", "num_kv_heads",
           "max_position_embeddings", "n_positions", "image_size", "patch_size",
           "pooler_output_size", "attention_dropout", "hidden_dropout", "resid_pdrop",
           "embd_pdrop", "hidden_dropout_prob", "attention_probs_dropout_prob",
           "bos_token_id", "eos_token_id", "decoder_start_token_id", "id2label", "label2id",
           "mamba_d_state", "mamba_dt_rank", "attn_layer_period", "attn_layer_offset",
           # RecurrentGemma's sizes, and an init scale it derives from the layer count
           "lru_width", "attention_window_size", "final_w_init_variance_scale",
           # Whisper's sizes (encoder and decoder apart), dropout, and its padding token
           "num_mel_bins", "encoder_layers", "decoder_layers", "encoder_attention_heads",
           "decoder_attention_heads", "encoder_ffn_dim", "decoder_ffn_dim",
           "max_source_positions", "max_target_positions", "dropout", "pad_token_id"}


def test_zoo_factories_keep_the_librarys_defaults():
    pytest.importorskip("transformers")
    import examples.hf_models as hf
    for name in filter(hf.available, hf.ZOO):
        model, _ = getattr(hf, name)(2, 16)
        got, default = model.config.to_dict(), type(model.config)().to_dict()
        changed = {k for k in set(got) | set(default) if got.get(k) != default.get(k)}
        assert changed <= ZOO_SET, (name, changed - ZOO_SET)
        for k in ("dropout", "attention_dropout", "hidden_dropout", "resid_pdrop",
                  "hidden_dropout_prob", "dropout_rate", "attn_pdrop"):
            if isinstance(got.get(k), float):
                assert got[k] == 0.1, (name, k)
