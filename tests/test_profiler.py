"""The profiler: exact FLOPs and bytes, meta == cpu, saved bytes against saved_tensors_hooks,
static state, dedup of identical blocks, the CLI's errors."""
import contextlib
import dataclasses
import json
import resource
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from planner.cli import main
from planner.formats import load_profile
from planner.hardware import load_hardware
from planner.models import build_model, make_inputs
from planner.profile import profile_model, profile_module, static_bytes_per_param

CPU = load_hardware("cpu-host")
A100 = load_hardware("a100-80g")
BYTE_FIELDS = ("param_bytes", "grad_bytes", "optimizer_bytes", "input_bytes", "output_bytes",
               "saved_bytes", "shared_saved_bytes", "workspace_bytes", "fwd_flops", "bwd_flops")


def gpt_cfg(h, heads, dropout=0.0, layers=2):
    return {"name": f"gpt-h{h}", "family": "gpt", "n_layers": layers, "d_model": h,
            "n_heads": heads, "vocab_size": 512, "max_seq": 256, "dropout": dropout}


def profile_cfg(cfg, b, s, hardware, dtype="bf16", device="meta"):
    model = build_model(cfg, dtype=dtype, device=device)
    inputs = make_inputs(cfg, b, s, device=device)
    return profile_module(model, inputs, name=cfg["name"], hardware=hardware, dtype=dtype,
                          config=cfg, batch=b, seq=s)


@pytest.mark.parametrize("b,s,h,heads", [(1, 128, 256, 4), (2, 64, 128, 2), (3, 32, 512, 8),
                                         (1, 256, 64, 1)])
def test_gpt_block_flops_narayanan(b, s, h, heads):
    # Narayanan et al. 2021, Sec. 5.1: a GPT block's forward is 24 b s h^2 + 4 b s^2 h FLOPs.
    expected = 24 * b * s * h * h + 4 * b * s * s * h
    # CPU target with dropout: the math kernel; every matmul's backward is two matmuls: 2x.
    prof = profile_cfg(gpt_cfg(h, heads, dropout=0.1), b, s, CPU)
    assert prof.model["attention"] == "math"
    for u in prof.layers[1:-1]:
        assert abs(u.fwd_flops - expected) <= 0.01 * expected
        assert u.fwd_flops == expected          # biases and norms are not matmul FLOPs
        assert u.bwd_flops == 2 * u.fwd_flops
    # CUDA target: flash attention; its backward recomputes Q K^T (2 b s^2 h more).
    prof = profile_cfg(gpt_cfg(h, heads), b, s, A100)
    assert prof.model["attention"] == "flash"
    for u in prof.layers[1:-1]:
        assert u.fwd_flops == expected
        assert u.bwd_flops == 2 * expected + 2 * b * s * s * h


def test_cpu_flash_attention_flops_counted():
    # llama-tiny without dropout runs the CPU flash kernel, which flop_counter lacks.
    prof = profile_model("llama-tiny", 2, 32, device="meta", hardware=CPU)
    assert prof.model["attention"] == "cpu-flash"
    b, s, d, f, kv = 2, 32, 64, 176, 32   # kv = 2 KV heads x head dim 16
    mm = 2 * b * s * (d * d + 2 * d * kv + d * d) + 2 * b * s * 3 * d * f
    attn = 4 * b * s * s * d
    blk = prof.layers[1]
    assert blk.fwd_flops == mm + attn
    assert blk.bwd_flops == 2 * mm + 2.5 * attn


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "examples.hf_models:gpt2",
                                  "examples.hf_models:llama"])
def test_meta_and_cpu_agree_on_every_byte(name, monkeypatch):
    if ":" in name:
        pytest.importorskip("transformers")
    meta = profile_model(name, 2, 32, device="meta", hardware=CPU, repeats=1)
    cpu = profile_model(name, 2, 32, device="cpu", hardware=CPU, repeats=1)
    assert meta.model["attention"] == cpu.model["attention"]
    assert [u.name for u in meta.layers] == [u.name for u in cpu.layers]
    for m, c in zip(meta.layers, cpu.layers):
        for f in BYTE_FIELDS:
            assert getattr(m, f) == getattr(c, f), (m.name, f)
    assert cpu.timing == "measured" and all(u.samples == 1 and u.fwd_s > 0 for u in cpu.layers)
    assert meta.timing == "estimated" and all(u.samples == 0 and u.fwd_s > 0 for u in meta.layers)


def _independent_saved(model, inputs, blocks):
    """Saved bytes per unit measured with saved_tensors_hooks on real tensors, each storage once
    per unit, parameters and buffers excluded; units switched by forward hooks."""
    static = {p.untyped_storage().data_ptr() for p in model.parameters()}
    static |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    cur = ["embedding"]
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in static:
            saved.setdefault(cur[0], {})[ptr] = t.untyped_storage().nbytes()
        return t

    handles = []
    for i, (name, blk) in enumerate(blocks):
        handles.append(blk.register_forward_pre_hook(lambda m, a, n=name: cur.__setitem__(0, n)))
        if i == len(blocks) - 1:
            handles.append(blk.register_forward_hook(lambda m, a, o: cur.__setitem__(0, "head")))
    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**inputs)
    for h in handles:
        h.remove()
    out.loss.backward()
    return {k: sum(v.values()) for k, v in saved.items()}


@pytest.mark.parametrize("factory", ["gpt2", "llama"])
def test_saved_bytes_match_saved_tensor_hooks(factory):
    pytest.importorskip("transformers")
    import examples.hf_models as hf
    from planner.blocks import find_blocks
    model, inputs = getattr(hf, factory)(2, 64)
    _, blocks = find_blocks(model)
    truth = _independent_saved(model, inputs, blocks)
    model, inputs = getattr(hf, factory)(2, 64)
    prof = profile_module(model, inputs, name=factory, hardware=CPU, repeats=1)
    assert len(prof.layers) == len(blocks) + 2
    for u in prof.layers:
        assert abs(u.saved_bytes - truth[u.name]) <= 0.02 * truth[u.name], u.name
    if factory == "llama":
        # the rotary cos/sin tables come from the embedding unit and are read by every layer
        blk = prof.layers[1]
        assert blk.shared_from == "embedding"
        assert blk.shared_saved_bytes == 2 * 64 * 16 * 4      # cos and sin, [1, s, hd] fp32


def test_flash_saved_bytes_linear_in_seq():
    # CUDA flash attention saves q, k, v, output and log-sum-exp: no s^2 term (plus its
    # fixed-size RNG state).
    a, b, c = (profile_model("llama-tiny", 2, s, device="meta", hardware=A100).layers[1]
               for s in (32, 64, 128))
    assert c.saved_bytes - b.saved_bytes == 2 * (b.saved_bytes - a.saved_bytes)
    # The CPU math kernel (GPT with dropout) keeps probabilities and the dropout mask: s^2.
    a = profile_model("gpt-tiny", 1, 64, device="meta", hardware=CPU).layers[1]
    b = profile_model("gpt-tiny", 1, 128, device="meta", hardware=CPU).layers[1]
    assert b.saved_bytes > 2 * a.saved_bytes


@pytest.mark.parametrize("dtype,opt,per_param", [("bf16", "adamw", 16), ("fp32", "adamw", 16),
                                                 ("bf16", "sgd", 8), ("fp32", "sgd", 8)])
def test_static_state(dtype, opt, per_param):
    assert sum(static_bytes_per_param({"bf16": torch.bfloat16, "fp32": torch.float32}[dtype],
                                      opt)) == per_param
    prof = profile_model("gpt-tiny", 1, 16, dtype=dtype, device="meta", hardware=CPU,
                         optimizer=opt)
    n = sum(p.numel() for p in build_model("gpt-tiny", device="meta").parameters())
    assert prof.model["param_count"] == n == sum(u.param_count for u in prof.layers)
    assert prof.static_bytes == per_param * n
    assert prof.model["bytes_per_param"] == per_param
    # the tied token embedding / lm_head is charged once, to the embedding
    assert prof.layers[0].param_count == 512 * 64 + 256 * 64
    assert prof.layers[-1].param_count == 2 * 64           # final LayerNorm only


def test_identical_blocks_profiled_once():
    prof = profile_model("gpt2-xl", 1, 128, device="meta", hardware=A100)
    blocks = [u for u in prof.layers if u.kind == "block"]
    assert len(blocks) == 48 and prof.model["unique_blocks"] == 1
    first = blocks[0].to_dict()
    for u in blocks[1:]:
        assert {k: v for k, v in u.to_dict().items() if k != "name"} == \
            {k: v for k, v in first.items() if k != "name"}


def test_gpt3_175b_meta_in_a_subprocess(tmp_path):
    out = tmp_path / "g3.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    r = subprocess.run([sys.executable, "-m", "planner.cli", "profile", "gpt3-175b", "--batch",
                        "1", "--seq", "2048", "--dtype", "bf16", "--device", "meta",
                        "--hardware", "a100-80g", "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(out)
    rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert max(rss_kib, before) < 2 * 1024 * 1024         # under 2 GB: nothing allocated
    prof = load_profile(out)
    assert sum(u.kind == "block" for u in prof.layers) == 96
    b, s, h = 1, 2048, 12288
    assert prof.layers[1].fwd_flops == 24 * b * s * h * h + 4 * b * s * s * h
    assert prof.model["param_count"] == 174_604_259_328


def test_cli_writes_profile(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["profile", "gpt-tiny", "--batch", "2", "--seq", "16", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "blocks: 3 in 'blocks' (blocks.0 .. blocks.2)" in text
    assert text.strip().endswith(str(out))
    d = json.loads(out.read_text())
    assert list(d)[0] <= "schema" and d["schema"] == "tierplan.profile/1"
    prof = load_profile(out)
    assert [u.name for u in prof.layers] == ["embedding", "blocks.0", "blocks.1", "blocks.2",
                                             "head"]
    for key in ("name", "config", "batch", "seq", "dtype", "param_count", "structure_hash",
                "blocks_path", "attention", "optimizer", "bytes_per_param", "blocks", "params",
                "inputs", "identity", "chain_breaks", "inplace_input"):
        assert key in prof.model
    assert prof.model["blocks"] == ["blocks.0", "blocks.1", "blocks.2"]
    assert prof.model["inputs"] == [{"name": "input_ids", "shape": [2, 16], "dtype": "int64"},
                                    {"name": "labels", "shape": [2, 16], "dtype": "int64"}]


BAD = [
    (["profile", "gpt5-huge", "--batch", "1", "--seq", "8"], "gpt5-huge"),
    (["profile", "no_such_pkg.mod:fn", "--batch", "1", "--seq", "8"], "cannot import"),
    (["profile", "badfactory:boom", "--batch", "1", "--seq", "8"], "raised"),
    (["profile", "badfactory:missing", "--batch", "1", "--seq", "8"], "no function"),
    (["profile", "gpt-tiny", "--batch", "0", "--seq", "8"], "--batch"),
    (["profile", "gpt-tiny", "--batch", "x", "--seq", "8"], "--batch"),
    (["profile", "gpt-tiny", "--batch", "1", "--seq", "-3"], "--seq"),
    (["profile", "gpt-tiny", "--batch", "1", "--seq", "100000"], "context"),
    (["profile", "gpt-tiny", "--batch", "1", "--seq", "8", "--hardware", "tpu9"], "tpu9"),
    (["profile", "gpt-tiny", "--batch", "1", "--seq", "8", "--dtype", "int4"], "dtype"),
    (["profile", "gpt-tiny", "--batch", "1", "--seq", "8", "--device", "cpu",
      "--compute-threads", "0"], "--compute-threads"),
    (["profile", "gpt-tiny", "--batch", "1", "--seq", "8", "--device", "cpu",
      "--compute-threads", "two"], "--compute-threads"),
    (["profile", "gpt-tiny", "--batch", "1", "--seq", "8", "--device", "cpu",
      "--compute-threads", "100000"], "--compute-threads"),
]


@pytest.mark.parametrize("argv,needle", BAD)
def test_cli_errors_exit_2_one_line(argv, needle, tmp_path, monkeypatch, capsys):
    (tmp_path / "badfactory.py").write_text(
        "def boom(batch, seq):\n    raise ValueError('no weights here')\n")
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert needle in err


# A factory module written into tmp_path for the tests below: float hidden states, integer
# ids and a bool mask as inputs; the forward checks that only the float input was cast.
FACTORIES = '''
import torch, torch.nn as nn

class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.ReLU())
                                     for _ in range(2)])
    def forward(self, x, ids, mask):
        if ids.dtype != torch.long or mask.dtype != torch.bool:
            raise TypeError(f"ids {ids.dtype}, mask {mask.dtype}")
        x = x + self.emb(ids)
        for b in self.blocks:
            x = b(x)
        return x * mask[..., None]

def mixed(b, s):
    torch.manual_seed(0)
    return Mixed(), (torch.randn(b, s, 16), torch.zeros(b, s, dtype=torch.long),
                     torch.ones(b, s, dtype=torch.bool))

class Broken(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
    def forward(self, x):
        raise ValueError("boom in forward")

def broken(b, s):
    return Broken(), (torch.randn(b, 4),)

class IntOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
    def forward(self, x):
        for l in self.blocks:
            x = l(x)
        return x.argmax(-1)

def intout(b, s):
    return IntOut(), (torch.randn(b, 4),)

SEEN = []

def born(b, s):
    SEEN.append(torch.empty(1).device.type)
    return mixed(b, s)

def reads_a_value(b, s):            # as a factory that loads a checkpoint would: not on meta
    SEEN.append(torch.empty(1).device.type)
    assert torch.ones(1).item() == 1
    return mixed(b, s)
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "tp_factories.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("tp_factories", None)
    yield tmp_path
    sys.modules.pop("tp_factories", None)


@pytest.mark.parametrize("device", ["meta", "cpu"])
@pytest.mark.parametrize("dtype,size", [("bf16", 2), ("fp32", 4)])
def test_factory_float_inputs_follow_dtype(factories, device, dtype, size):
    # b=2, s=3, h=16: a block's input is the float hidden state, 2*3*16 elements; its Linear
    # saves that input and its ReLU its output, so saved = 2 * 96 * size. Ids (int64) and the
    # bool mask keep their dtype (the forward raises otherwise).
    prof = profile_model("tp_factories:mixed", 2, 3, dtype=dtype, device=device, hardware=CPU,
                         repeats=1)
    assert prof.model["dtype"] == dtype
    block = prof.layers[1]
    assert block.name == "blocks.0"
    assert block.input_bytes == 96 * size
    assert block.saved_bytes == 2 * 96 * size
    # embedding's input: x (96 elements at `size`) + ids (6 x 8 B) + mask (6 x 1 B)
    assert prof.layers[0].input_bytes == 96 * size + 6 * 8 + 6


@pytest.mark.parametrize("fn,seen", [("born", ["meta"]), ("reads_a_value", ["meta", "cpu"])])
def test_a_factory_builds_on_meta_when_the_profile_is_on_meta(factories, fn, seen):
    """With --device meta the factory runs under torch.device("meta"): a model built the usual
    way allocates nothing (MixtralConfig()'s 187 GB had the OOM killer end the profile). One
    that cannot run there runs again as it is; on cpu it runs as it is."""
    import tp_factories
    prof = profile_model(f"tp_factories:{fn}", 2, 3, device="meta", hardware=CPU, repeats=1)
    assert tp_factories.SEEN == seen and prof.layers[1].saved_bytes == 2 * 96 * 4
    tp_factories.SEEN.clear()
    profile_model(f"tp_factories:{fn}", 2, 3, device="cpu", hardware=CPU, repeats=1)
    assert tp_factories.SEEN == ["cpu"]


@pytest.mark.parametrize("fn,needle", [
    ("broken", "its forward raised ValueError: boom in forward"),
    ("intout", "the output must be differentiable"),
])
@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_model_errors_are_one_line(factories, fn, needle, device, capsys):
    argv = ["profile", f"tp_factories:{fn}", "--batch", "2", "--seq", "4", "--device", device,
            "--hardware", "cpu-host", "-o", "o.json"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert f"model 'tp_factories:{fn}'" in err and needle in err
    assert not (factories / "o.json").exists()


def test_profile_output_directory_exit_2(tmp_path, capsys):
    assert main(["profile", "gpt-tiny", "--batch", "1", "--seq", "8", "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a directory; give a file name" in err


def test_one_dtype_table():
    from planner import models
    from planner import profile as profiler
    assert profiler.DTYPES is models.DTYPES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_adamw_pure_counts_what_torch_adamw_holds(dtype):
    """--optimizer adamw-pure: the profile's static bytes are what a plain torch AdamW over the
    model's own parameters really holds after a step (weights, grads, moments); adamw counts
    mixed precision (fp32 master and moments) on top for 16-bit weights."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 8)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64, dtype=dtype)).sum().backward()
    opt.step()
    held = sum(p.numel() * p.element_size() + p.grad.numel() * p.grad.element_size()
               for p in model.parameters())
    held += sum(v.numel() * v.element_size() for st in opt.state.values()
                for k, v in st.items() if k != "step")
    n = sum(p.numel() for p in model.parameters())
    assert sum(static_bytes_per_param(dtype, "adamw-pure")) * n == held
    mixed = sum(static_bytes_per_param(dtype, "adamw")) * n
    assert mixed == (2 * held if dtype == torch.bfloat16 else held)


def test_adamw_pure_profile_has_no_master():
    pure = profile_model("gpt-tiny", 2, 32, device="meta", hardware=CPU, optimizer="adamw-pure",
                         dtype="bf16")
    mixed = profile_model("gpt-tiny", 2, 32, device="meta", hardware=CPU, dtype="bf16")
    assert pure.model["bytes_per_param"] == 8 and mixed.model["bytes_per_param"] == 16
    assert all(u.master_bytes == 0 for u in pure.layers)
    assert sum(u.master_bytes for u in mixed.layers) > 0


def test_a_mixture_of_experts_counts_its_experts_flops():
    """transformers runs experts through ``aten._grouped_mm``, for which flop_counter has no
    formula: Mixtral's block counted 47 GFLOP of at least 404 (its attention alone), so
    estimated times were far too short. A tiny Mixtral's block now counts at least its
    top-2 experts' matmuls forward, and its backward about twice that."""
    tf = pytest.importorskip("transformers")
    cfg = tf.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(cfg)
    ids = torch.randint(0, 256, (2, 16))
    prof = profile_module(model, (ids,), name="mixtral", hardware=CPU, timing="estimate",
                          batch=2, seq=16)
    block = prof.layers[1]
    experts = 2 * 32 * 2 * 3 * 64 * 128         # tokens x top-2 x (gate, up, down) matmuls
    assert block.fwd_flops >= experts
    assert 1.8 * block.fwd_flops <= block.bwd_flops <= 2.2 * block.fwd_flops


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_mixture_of_experts_in_fp32_profiles_on_meta_as_on_the_cpu(dtype):
    """torch's meta kernel of ``aten._grouped_mm`` takes bf16 only (the CPU kernel also fp32
    and fp16), so a Mixtral as from_config builds it (fp32) could not be profiled on meta. On
    meta it now runs on bf16 stand-ins: every unit's bytes and FLOPs are those of the same model
    profiled on the CPU."""
    tf = pytest.importorskip("transformers")
    cfg = tf.MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=8, num_experts_per_tok=2)
    profiles = []
    for device in ("cpu", "meta"):
        torch.manual_seed(0)
        with torch.device(device):
            model = tf.MixtralForCausalLM(cfg).to(dtype)
        ids = torch.randint(0, 256, (2, 16), device=device)
        profiles.append(profile_module(model, (ids,), name="mixtral", hardware=CPU,
                                       timing="estimate", batch=2, seq=16))
    cpu, meta = ([dataclasses.replace(u, fwd_s=0.0, bwd_s=0.0) for u in p.layers]
                 for p in profiles)
    assert meta == cpu and meta[1].fwd_flops > 0 and meta[1].saved_bytes > 0


@pytest.mark.parametrize("dtype,a,b,groups", [
    (torch.float32, (8, 12), (2, 12, 4), True), (torch.float32, (2, 5, 12), (2, 12, 4), False),
    (torch.float16, (8, 16), (2, 16, 8), True), (torch.float16, (2, 5, 16), (2, 16, 8), False)])
def test_a_grouped_matmul_on_meta_has_the_cpu_kernels_shape_and_dtype(dtype, a, b, groups):
    """fp32 and fp16, tokens through one expert each and a batch of matrices: the CPU kernel
    takes them (fp32 rows of 12 elements, 48 bytes, included); torch's meta kernel wants bf16
    and its bf16 rows would be 24 bytes, under its 16-byte alignment, so ``run_op`` makes the
    output itself."""
    from planner.blocks import run_op
    grouped = getattr(torch.ops.aten, "_grouped_mm", None)
    if grouped is None:
        pytest.skip("this torch has no _grouped_mm")
    offs = torch.tensor([3, 8], dtype=torch.int32) if groups else None
    A, B = torch.randn(a, dtype=dtype), torch.randn(b, dtype=dtype)
    cpu = grouped.default(A, B, offs)
    meta = run_op(grouped.default, (A.to("meta"), B.to("meta"),
                                    None if offs is None else offs.to("meta")), {})
    assert (meta.shape, meta.dtype, meta.device.type) == (cpu.shape, cpu.dtype, "meta")


@pytest.mark.parametrize("v_dim,kind", [(192, "flash"), (128, "efficient")])
def test_flash_is_assumed_only_where_query_key_and_value_share_a_head_dim(v_dim, kind):
    """DeepSeek-V3's attention has 192-wide queries and keys and 128-wide values; flash
    (which needs one head dim) emulated on meta gave a 192-wide output and the model's
    forward failed, blamed on the model."""
    from planner.profile.sdpa import _TargetAttention
    q = torch.empty(1, 4, 8, 192, dtype=torch.bfloat16, device="meta")
    v = torch.empty(1, 4, 8, v_dim, dtype=torch.bfloat16, device="meta")
    assert _TargetAttention._cuda_choice(q, q, v, None) == kind


def test_grouped_matmul_flops_in_every_layout():
    """``planner.blocks.flops``'s grouped matmul: tokens through one expert each (2D x 3D), batched
    (3D x 3D), groups along K (2D x 2D), and transformers' fallback backward (two matmuls
    of the forward's size; a review found it used the input gradient's shape for N)."""
    from planner.blocks.flops import _BY_NAME, _grouped_mm
    S, K, N, G = 64, 32, 96, 4
    e = torch.empty
    assert _grouped_mm((S, K), (G, K, N), (S, N)) == 2 * S * K * N
    assert _grouped_mm((G, S, K), (G, K, N), (G, S, N)) == 2 * G * S * K * N
    assert _grouped_mm((S, K), (K, N), (G, S, N)) == 2 * S * K * N
    backward = _BY_NAME["transformers::grouped_mm_fallback_backward"]
    assert backward((e(S, K), e(G, K, N), e(G), e(S, N)), (e(S, K), e(G, K, N))) == 4 * S * K * N


class _Doubled(torch.autograd.Function):
    """``sin(2x)``, keeping ``2x`` for backward as a ctx attribute (``via_ctx``) or through
    ``save_for_backward``."""

    @staticmethod
    def forward(ctx, x, via_ctx):
        y = x * 2
        if via_ctx:
            ctx.y = y
        else:
            ctx.save_for_backward(y)
        return y.sin()

    @staticmethod
    def backward(ctx, g):
        y = ctx.y if hasattr(ctx, "y") else ctx.saved_tensors[0]
        return 2 * g * y.cos(), None


class _FnBlock(nn.Module):
    def __init__(self, via_ctx):
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.via_ctx = via_ctx

    def forward(self, x):
        return x + _Doubled.apply(self.lin(x), self.via_ctx)


class _FnNet(nn.Module):
    def __init__(self, via_ctx):
        super().__init__()
        self.blocks = nn.ModuleList([_FnBlock(via_ctx) for _ in range(3)])
        self.out = nn.Linear(16, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x).sum()


def test_tensors_a_custom_function_keeps_on_ctx_are_counted_and_named():
    """A custom Function that keeps a tensor as a ctx attribute holds it until its backward
    whatever the plan: the profile counts it in the block's saved bytes, as shared (kept by
    reference under every decision), and warns once naming the block and the bytes."""
    x = torch.randn(4, 8, 16)
    kept = x.numel() * 4                      # the fp32 2x, per block
    got = {}
    for via_ctx in (False, True):
        torch.manual_seed(0)
        with pytest.warns(UserWarning) if via_ctx else contextlib.nullcontext() as w:
            got[via_ctx] = profile_module(_FnNet(via_ctx), (x,), name="fn", hardware=CPU,
                                          timing="estimate")
    plain, ctx = ([u for u in got[v].layers if u.kind == "block"] for v in (False, True))
    for a, b in zip(plain, ctx):
        assert b.saved_bytes == a.saved_bytes          # the same tensor, held either way
        assert b.shared_saved_bytes - a.shared_saved_bytes == kept
        assert b.activation_bytes == a.activation_bytes - kept
        assert b.shared_from == b.name
    assert got[False].model["warnings"] == []
    msgs = [str(m.message) for m in w if "ctx attributes" in str(m.message)]
    assert len(msgs) == 1 and "_Doubled" in msgs[0] and "blocks.0 (and 2 more blocks)" in msgs[0]
    assert got[True].model["warnings"] == [msgs[0].removeprefix("tierplan: profile: ")]


class _Wide(nn.Module):
    """Two blocks after a wide MLP that is no block (its Linears differ in shape): the
    embedding saves most of the activations."""

    def __init__(self, d=16):
        super().__init__()
        self.pre = nn.Sequential(nn.Linear(d, 32 * d), nn.GELU(), nn.Linear(32 * d, d))
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, d), nn.GELU())
                                     for _ in range(2)])
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        x = self.pre(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x).sum()


class _Lopsided(nn.Module):
    """Three blocks of one class, the last 32 times as wide inside."""

    def __init__(self, d=16):
        super().__init__()
        self.blocks = nn.ModuleList([_Inner(d, w) for w in (d, d, 32 * d)])
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.out(x).sum()


class _Inner(nn.Module):
    def __init__(self, d, w):
        super().__init__()
        self.up, self.down = nn.Linear(d, w), nn.Linear(w, d)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("model,needle", [
    (_Wide, "embedding "), (_Lopsided, "block blocks.2 holds ")])
def test_a_unit_holding_most_saved_activations_is_named_with_the_fix(model, needle, capsys,
                                                                     tmp_path, monkeypatch):
    """More than DOMINANT_SHARE of the saved activations in one unit, or in the embedding and
    head: the profile warns, naming the unit and --blocks; plan profile prints it."""
    from planner.profile.assemble import DOMINANT_SHARE
    x = torch.randn(4, 8, 16)
    with pytest.warns(UserWarning, match="--blocks") as w:
        prof = profile_module(model(), (x,), name="m", hardware=CPU, timing="estimate")
    (msg,) = prof.model["warnings"]
    assert needle in msg and "--blocks" in msg and "\n" not in msg
    assert [str(m.message) for m in w if "--blocks" in str(m.message)] == [
        "tierplan: profile: " + msg]
    total = sum(u.saved_bytes for u in prof.layers)
    top = sum(u.saved_bytes for u in prof.layers if u.kind != "block") if model is _Wide \
        else max(u.saved_bytes for u in prof.layers)
    assert top > DOMINANT_SHARE * total
    # the CLI prints it once, as its other warnings
    mod = f"wmod{model.__name__.lower()}"      # a module per case: imports are cached
    (tmp_path / f"{mod}.py").write_text(
        "import torch\nimport test_profiler as t\n"
        f"def f(b, s):\n    return t.{model.__name__}(), (torch.randn(4, 8, 16),)\n")
    monkeypatch.chdir(tmp_path)
    assert main(["profile", f"{mod}:f", "--batch", "4", "--seq", "8", "--device", "cpu",
                 "--timing", "estimate", "-o",
                 str(tmp_path / "p.json")]) == 0
    err = capsys.readouterr().err
    assert err.count(needle) == 1 and f"plan: warning: {msg}" in err


def test_balanced_models_do_not_warn():
    prof = profile_cfg(gpt_cfg(64, 4), 2, 32, CPU)
    assert prof.model["warnings"] == []


def test_a_profile_leaves_nothing_of_its_step_alive():
    """The instrumented step goes with the profile call: nothing it held (the last block's
    output, on the profiled device) waits for the cycle collector. Before, the bridge's backward
    hook and the step's last output made a cycle that kept both."""
    import gc

    from planner.hardware import load_hardware
    from planner.models import build_model, load_config, make_inputs
    from planner.profile import profile_module
    cfg = dict(load_config("gpt-tiny"), dtype="fp32", n_layers=2)
    model = build_model(cfg, dtype="fp32")
    gc.collect()
    gc.disable()
    try:
        for timing in ("measure", "estimate"):
            profile_module(model, make_inputs(cfg, 2, 16), hardware=load_hardware("cpu-host"),
                           timing=timing, name="t")
            alive = [o for o in gc.get_objects() if type(o).__name__ == "Step"]
            assert not alive, f"{len(alive)} profile step(s) alive after timing={timing}"
    finally:
        gc.enable()


def test_block_times_are_scaled_to_a_whole_step_where_it_fits(monkeypatch):
    """A measured profile times each block alone, then the whole step, and scales the blocks'
    times per direction by what the step took beyond the embedding, head and prologues
    (``timing_quality.in_step_scale``); where a plain step's activations would not fit the
    memory available, no step is run and nothing is scaled."""
    import planner.profile.step as stepmod
    lo, hi = stepmod.IN_STEP_SCALE_RANGE
    for _ in range(3):
        # a factor outside the range is a timing upset (another process took the cores
        # during the step) and is not applied: on a loaded host, profile again
        prof = profile_model("gpt-tiny", 2, 32, dtype="fp32", device="cpu", hardware=CPU,
                             repeats=2)
        scale = prof.model["timing_quality"]["in_step_scale"]
        if scale is not None:
            break
    assert isinstance(scale, list) and len(scale) == 2 and all(lo <= f <= hi for f in scale)
    monkeypatch.setattr(stepmod, "_available_bytes", lambda device: 1)
    prof = profile_model("gpt-tiny", 2, 32, dtype="fp32", device="cpu", hardware=CPU,
                         repeats=2)
    assert prof.model["timing_quality"]["in_step_scale"] is None
    meta = profile_model("gpt-tiny", 2, 32, dtype="fp32", device="meta", hardware=CPU)
    assert "timing_quality" not in meta.model
