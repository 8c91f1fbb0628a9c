"""Which blocks detection finds, on many architectures: ``python bench/blocks_sweep.py OUT.json``.

Detection only (one traced forward per model, no profile): the zoo's models, the built-in
transformers, small Hugging Face models of many architectures built from their config classes
(sizes shrunk, everything else the default), diffusers' U-Nets when diffusers imports, and
default-config models on meta with ``--defaults``. Writes ``{model: [block names] | "error:
..."}``; ``--compare BEFORE.json`` prints the models whose blocks changed. Used to check that a
change to ``planner/blocks/`` (detection) leaves the models it is not about as they were
(docs/models.md, Finding the blocks).
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/profile.py would shadow the standard library's profile (which torch._dynamo imports)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import torch  # noqa: E402

sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, vocab_size=256, d_model=64, encoder_layers=2,
             decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=128, decoder_ffn_dim=128, num_layers=2, num_decoder_layers=2,
             num_heads=4, d_ff=128, d_kv=16, n_embd=64, n_layer=2, n_head=4, n_positions=256,
             max_position_embeddings=256, num_local_experts=4, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=64, head_dim=16, state_size=8,
             expand=2, max_source_positions=256, max_target_positions=256)
CAUSAL = ("qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "gemma2", "gemma3_text", "olmo", "olmo2",
          "phi3", "stablelm", "starcoder2", "gptj", "bloom", "mpt", "codegen", "gpt_bigcode",
          "cohere", "granite", "mamba", "mamba2", "falcon_mamba", "zamba", "zamba2", "olmoe",
          "granitemoe", "exaone4", "smollm3", "persimmon", "nemotron", "bamba", "falcon_h1",
          "lfm2", "phimoe", "gpt_oss", "dbrx", "deepseek_v3", "ernie4_5_moe")
ENCODERS = ("bert", "roberta", "distilbert", "electra", "deberta-v2", "modernbert")
SEQ2SEQ = ("bart", "mbart", "pegasus", "marian", "m2m_100", "mt5", "umt5", "blenderbot-small")
VISION = ("vit", "deit", "beit", "convnext", "convnextv2", "swin", "swinv2", "vit_mae")
DEFAULTS = ("gpt2", "llama", "t5", "bert", "vit", "convnext", "swin", "mixtral", "jamba",
            "whisper", "bart", "qwen2", "mistral", "phi3", "gemma2", "mamba")


def _config(mt, **extra):
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(mt)
    for k, v in {**SMALL, **extra}.items():
        if hasattr(cfg, k):
            setattr(cfg, k, v)
    return cfg


def _vision_config(mt):
    from transformers import AutoConfig
    cfg = AutoConfig.for_model(mt)
    if mt.startswith(("convnext",)):
        cfg.hidden_sizes, cfg.depths = [16, 32, 64, 128], [2, 2, 3, 2]
    elif mt.startswith("swin"):
        cfg.image_size, cfg.embed_dim, cfg.depths, cfg.num_heads, cfg.window_size = \
            128, 16, [2, 2, 3, 2], [1, 2, 2, 4], 4
    else:
        cfg.image_size, cfg.patch_size, cfg.hidden_size, cfg.num_hidden_layers = 32, 8, 64, 2
        cfg.num_attention_heads, cfg.intermediate_size = 4, 128
        if hasattr(cfg, "decoder_num_hidden_layers"):
            cfg.decoder_num_hidden_layers, cfg.decoder_hidden_size = 2, 64
            cfg.decoder_num_attention_heads, cfg.decoder_intermediate_size = 4, 128
    return cfg


def builders(defaults: bool):
    """``{name: () -> (model, kwargs)}``."""
    import transformers as tf
    from examples import hf_models as hf
    import zoo_models as zm
    import test_zoo
    out = {}
    for name in test_zoo.EXPECTED:
        if name == "resnet18":
            continue
        f = getattr(hf, name, None) or getattr(zm, name)
        out[f"zoo:{name}"] = lambda f=f: f(2, 16)
    from planner.models import build_model, builtin_names, load_config, make_inputs
    for name in builtin_names():
        def b(name=name):
            cfg = load_config(name)
            with torch.device("meta"):
                return build_model(cfg, device="meta"), make_inputs(cfg, 1, 64, device="meta")
        out[f"builtin:{name}"] = b
    ids = lambda: torch.randint(0, 256, (2, 16))
    for mt in CAUSAL:
        out[f"hf:{mt}"] = lambda mt=mt: (tf.AutoModelForCausalLM.from_config(_config(mt)),
                                         {"input_ids": ids()})
    for mt in ENCODERS:
        out[f"hf:{mt}"] = lambda mt=mt: (tf.AutoModel.from_config(_config(mt)),
                                         {"input_ids": ids()})
    for mt in SEQ2SEQ:
        out[f"hf:{mt}"] = lambda mt=mt: (tf.AutoModelForSeq2SeqLM.from_config(_config(mt)),
                                         {"input_ids": ids(), "decoder_input_ids": ids()})
    for mt in VISION:
        def v(mt=mt):
            cfg = _vision_config(mt)
            return tf.AutoModel.from_config(cfg), {
                "pixel_values": torch.randn(2, 3, cfg.image_size, cfg.image_size)}
        out[f"hf:{mt}"] = v
    try:
        import diffusers  # noqa: F401
        out["diffusers:unet2d_condition"] = lambda: unet_condition(2)
        out["diffusers:unet2d"] = lambda: unet2d(2)
    except ImportError:
        pass
    if defaults:
        for mt in DEFAULTS:
            def d(mt=mt):
                from transformers import AutoConfig
                cfg = AutoConfig.for_model(mt)
                with torch.device("meta"):
                    if mt in ("vit", "convnext", "swin"):
                        return tf.AutoModel.from_config(cfg), {
                            "pixel_values": torch.randn(1, 3, 224, 224)}
                    if mt in ("t5", "bart"):
                        return tf.AutoModelForSeq2SeqLM.from_config(cfg), {
                            "input_ids": torch.zeros(1, 64, dtype=torch.long),
                            "decoder_input_ids": torch.zeros(1, 64, dtype=torch.long)}
                    if mt == "whisper":
                        return tf.AutoModel.from_config(cfg), {
                            "input_features": torch.randn(1, 80, 3000),
                            "decoder_input_ids": torch.zeros(1, 8, dtype=torch.long)}
                    if mt == "bert":
                        return tf.AutoModel.from_config(cfg), {
                            "input_ids": torch.zeros(1, 64, dtype=torch.long)}
                    return tf.AutoModelForCausalLM.from_config(cfg), {
                        "input_ids": torch.zeros(1, 64, dtype=torch.long)}
            out[f"default:{mt}"] = d
        try:
            import diffusers  # noqa: F401
            out["default:unet2d_condition"] = lambda: unet_condition(1, default=True)
            out["default:unet2d"] = lambda: unet2d(1, default=True)
        except ImportError:
            pass
    return out


def unet_condition(batch, default=False):
    """diffusers' UNet2DConditionModel: its default config (Stable Diffusion 1.x's shape) on
    meta, or a small one (two resolutions, 32 and 64 channels, one cross-attention tower)."""
    from diffusers import UNet2DConditionModel
    if default:
        with torch.device("meta"):
            return UNet2DConditionModel(), {
                "sample": torch.randn(batch, 4, 64, 64), "timestep": torch.tensor([10] * batch),
                "encoder_hidden_states": torch.randn(batch, 77, 1280)}
    torch.manual_seed(0)
    m = UNet2DConditionModel(
        sample_size=16, block_out_channels=(32, 64), layers_per_block=2, cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), attention_head_dim=8,
        norm_num_groups=8)
    return m, {"sample": torch.randn(batch, 4, 16, 16), "timestep": torch.tensor([10] * batch),
               "encoder_hidden_states": torch.randn(batch, 7, 32)}


def unet2d(batch, default=False):
    """diffusers' UNet2DModel: its default config on meta, or a small one."""
    from diffusers import UNet2DModel
    if default:
        with torch.device("meta"):
            return UNet2DModel(), {"sample": torch.randn(batch, 3, 64, 64),
                                   "timestep": torch.tensor([10] * batch)}
    torch.manual_seed(0)
    m = UNet2DModel(sample_size=16, block_out_channels=(32, 64), layers_per_block=2,
                    down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                    up_block_types=("AttnUpBlock2D", "UpBlock2D"), norm_num_groups=8,
                    attention_head_dim=8)
    return m, {"sample": torch.randn(batch, 3, 16, 16), "timestep": torch.tensor([10] * batch)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--defaults", action="store_true", help="default configs on meta too")
    ap.add_argument("--only", help="comma-separated names (zoo:gpt2,hf:swin,...)")
    ap.add_argument("--compare", help="an earlier OUT.json: print what changed")
    args = ap.parse_args()
    from planner.blocks import detect_blocks
    got = {}
    todo = builders(args.defaults)
    if args.only:
        todo = {k: v for k, v in todo.items() if k in args.only.split(",")}
    for name, build in todo.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model, inputs = build()
                model.train()
                call = (lambda: model(**inputs)) if isinstance(inputs, dict) else (lambda: model(*inputs))
                got[name] = detect_blocks(model, call).names
            except Exception as e:   # noqa: BLE001 -- a sweep records failures and goes on
                got[name] = f"error: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        b = got[name]
        print(name, b if isinstance(b, str) else f"{len(b)}: {b[0]} .. {b[-1]}", flush=True)
    Path(args.out).write_text(json.dumps(got, indent=1))
    if args.compare:
        before = json.loads(Path(args.compare).read_text())
        changed = [n for n in got if n in before and before[n] != got[n]]
        print(f"{len(changed)} of {len([n for n in got if n in before])} changed")
        for n in changed:
            b, a = before[n], got[n]
            print(f"  {n}: {len(b) if isinstance(b, list) else b} -> "
                  f"{len(a) if isinstance(a, list) else a}")


if __name__ == "__main__":
    main()
