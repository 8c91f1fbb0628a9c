"""What one GPU can train under a streaming plan: model sizes, predicted step time and TFLOPS.

For each case (model, batch, sequence, hardware spec, budgets, K micro-batches) this builds the
profile without weights (``device="meta"``: shapes and FLOPs counted, times estimated from the
spec), runs ``plan solve`` with layer streaming allowed (``--stream auto``) under a time limit,
and prints one markdown row: where the homes went, the simulator's step time, the TFLOPS it
implies, the peaks per tier and how long the solve took. A case that no plan fits is reported
as exit 3 with the tier ``plan solve`` names as short; nothing is hard-coded.

    python bench/capacity.py                          # the default cases, 120 s per solve
    python bench/capacity.py --time-limit 60 --cases gpt3-175b/a100
    python bench/capacity.py --list                   # the cases and their CLI equivalents

TFLOPS: two figures. ``6NT`` is 6 x N x T / step, with N every parameter of the model
(embeddings included, a tied embedding/head counted once: the profile's ``param_count``) and
T = batch x seq x K tokens per optimizer step; it ignores attention's own FLOPs and any
recompute (the usual "model FLOPs" convention). ``counted`` is the planner's own figure
(``plan.predicted.flops`` / step): the forward and backward FLOPs the meta profile counted per
unit (attention included), K times, recompute not counted.

These are predictions of the planner's cost model on spec-sheet numbers, not measurements.
The published anchors printed under the table are measured systems on their own hardware.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/runtime.py and bench/profile.py would shadow the runtime package and the standard
# library's profile module: import from the repository root, never from bench/
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from planner.errors import NoFitError, UserError  # noqa: E402
from planner.formats import Budgets  # noqa: E402
from planner.hardware import load_hardware  # noqa: E402
from planner.sizes import fmt_bytes, parse_size  # noqa: E402
from planner.solve import default_solver, solve_profile  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)

# A LLaMA-2-13B-shaped model (Touvron et al. 2023, "Llama 2", Table 1 / the released
# config.json: 40 layers, hidden 5120, 40 heads, no grouped KV, FFN 13824, vocabulary 32000,
# context 4096, untied embeddings). Not under profiles/models/: written to a temporary YAML.
LLAMA2_13B = """\
name: llama2-13b
family: llama
n_layers: 40
d_model: 5120
n_heads: 40
n_kv_heads: 40
d_ff: 13824
vocab_size: 32000
max_seq: 4096
rope_theta: 10000.0
norm_eps: 1.0e-5
tie_embeddings: false
dtype: bf16
"""


@dataclasses.dataclass(frozen=True)
class Case:
    key: str                 # short name for --cases
    model: str               # built-in name or a key of EXTRA_MODELS
    batch: int
    seq: int
    hardware: str
    gpu: str                 # --gpu-mem
    cpu: str                 # --cpu-mem
    nvme: str                # --nvme-mem
    K: int
    host_is_budget: bool = False   # the spec's host_memory_bytes raised to --cpu-mem (below)
    stream: str = "auto"


EXTRA_MODELS = {"llama2-13b": LLAMA2_13B}

# host_is_budget: the cost model caps --cpu-mem at the spec's pinned limit, which is its
# host_memory_bytes unless pinned_memory_bytes is given; rtx4090.yaml says 64 GiB (a typical
# workstation), so a 256 GiB host is a copy of that spec with host_memory_bytes = --cpu-mem
# and every rate unchanged (the anchors' machines had more DRAM than the shipped spec).
CASES = [
    Case("gpt3-175b/a100/k1", "gpt3-175b", 1, 2048, "a100-80g", "80G", "512G", "4T", 1),
    Case("gpt3-175b/a100/k8", "gpt3-175b", 1, 2048, "a100-80g", "80G", "512G", "4T", 8),
    Case("gpt3-175b/4090/k1", "gpt3-175b", 1, 2048, "rtx4090", "24G", "256G", "4T", 1,
         host_is_budget=True),
    Case("gpt3-175b/4090/k8", "gpt3-175b", 1, 2048, "rtx4090", "24G", "256G", "4T", 8,
         host_is_budget=True),
    Case("gpt3-175b/4090-spec/k8", "gpt3-175b", 1, 2048, "rtx4090", "24G", "256G", "4T", 8),
    Case("llama3-8b/4090/k1", "llama3-8b", 1, 2048, "rtx4090", "24G", "64G", "1T", 1),
    Case("llama3-8b/4090/k8", "llama3-8b", 1, 2048, "rtx4090", "24G", "64G", "1T", 8),
    Case("llama3-8b/a100/off", "llama3-8b", 1, 8192, "a100-80g", "80G", "512G", "0", 1,
         stream="off"),
    Case("llama3-8b/a100/k1", "llama3-8b", 1, 8192, "a100-80g", "80G", "512G", "0", 1),
    Case("llama3-8b/a100/k8", "llama3-8b", 1, 8192, "a100-80g", "80G", "512G", "0", 8),
    Case("llama2-13b/h200/k1", "llama2-13b", 1, 4096, "h200", "140G", "1536G", "0", 1),
    Case("llama2-13b/h200/k8", "llama2-13b", 1, 4096, "h200", "140G", "1536G", "0", 8),
]

ANCHORS = [
    ("SynergyScale", "114B trained on one A100-80G", "-",
     "figure as given in tierplan issue 9; no primary source found by us, unverified"),
    ("MegaTrain (Yuan, Sun, Sun, Ye 2026)", "up to 120B on one H200 with 1.5 TB host memory; "
     "1.84x the throughput of DeepSpeed ZeRO-3 with CPU offload at 14B",
     "264 TFLOPS at 14B on a GH200 (issue 9's figure; not in the abstract)",
     "arXiv:2604.05091, abstract"),
    ("Fuyou / LoHan (Liao et al. 2024)", "GPT-3 175B fine-tuned on one RTX 4090 with 256 GB "
     "main memory and NVMe SSDs (ZeRO-Infinity cannot)",
     "87 TFLOPS at 175B on the 4090 (172 on an A100-80G); 156 TFLOPS at 13B vs "
     "ZeRO-Infinity's 45", "arXiv:2403.06504 (v1 'Fuyou', later 'LoHan'), abstract"),
]


def _model_spec(name: str, tmp: Path) -> str:
    if name in EXTRA_MODELS:
        p = tmp / f"{name}.yaml"
        if not p.exists():
            p.write_text(EXTRA_MODELS[name])
        return str(p)
    return name


def _spec(case: Case):
    hw = load_hardware(case.hardware)
    if case.host_is_budget:
        hw = dataclasses.replace(hw, host_memory_bytes=parse_size(case.cpu, "--cpu-mem"))
    return hw


def cli_of(case: Case, time_limit: float) -> str:
    """The equivalent ``plan`` commands (without the host_is_budget spec copy)."""
    m = case.model if case.model not in EXTRA_MODELS else f"{case.model}.yaml"
    prof = f"/tmp/{case.model}-b{case.batch}-s{case.seq}-{case.hardware}.json"
    return (f"plan profile {m} --batch {case.batch} --seq {case.seq} --device meta "
            f"--hardware {case.hardware} -o {prof} && plan solve {prof} --gpu-mem {case.gpu} "
            f"--cpu-mem {case.cpu} --nvme-mem {case.nvme} --micro-batches {case.K} "
            f"--stream {case.stream} --time-limit {time_limit:g}")


_PROFILES: dict = {}


def run_case(case: Case, args, tmp: Path) -> dict:
    from planner.profile import profile_model
    hw = _spec(case)
    key = (case.model, case.batch, case.seq, case.hardware, case.host_is_budget)
    t0 = time.perf_counter()
    if key not in _PROFILES:
        _PROFILES[key] = profile_model(_model_spec(case.model, tmp), case.batch, case.seq,
                                       device="meta", hardware=hw)
    prof = _PROFILES[key]
    t_prof = time.perf_counter() - t0
    b = Budgets(parse_size(case.gpu, "--gpu-mem"), parse_size(case.cpu, "--cpu-mem"),
                parse_size(case.nvme, "--nvme-mem"))
    n = int(prof.model["param_count"])
    tokens = case.batch * case.seq * case.K
    row = dict(case=case, params=n, static=prof.static_bytes, units=len(prof.layers),
               profile_s=t_prof, tokens=tokens)
    t1 = time.perf_counter()
    try:
        out = solve_profile(prof, None, hw, b, "optimal", solver=args.solver,
                            time_limit=args.time_limit, gap=args.gap, micro_batches=case.K,
                            stream=case.stream, nvme_dir=str(tmp / "nvme"),
                            clip=args.clip, micro_batch_order=args.micro_batch_order,
                            optimizer_overlap=getattr(args, "optimizer_overlap", "auto"))
    except NoFitError as e:
        row.update(exit=3, short=getattr(e, "budget", "?"), msg=str(e),
                   solve_s=time.perf_counter() - t1)
        return row
    except UserError as e:
        row.update(exit=2, short="-", msg=str(e), solve_s=time.perf_counter() - t1)
        return row
    solve_s = time.perf_counter() - t1
    plan, sim = out.plan, out.sim
    if getattr(args, "save_plans", None):
        from planner.plans import save_plan
        save_plan(plan, Path(args.save_plans) / (case.key.replace("/", "_") + ".json"))
    homes = {k: Counter() for k in ("weights", "grads", "optimizer", "step")}
    for d in plan.layers:
        for k in homes:
            homes[k][getattr(d.home, k).value] += 1
    p = plan.predicted
    row.update(exit=0, solve_s=solve_s, step_s=p.step_s, compute_s=p.compute_s,
               pass_s=p.pass_s, opt_s=p.optimizer_s, flops=p.flops,
               tflops_6nt=6.0 * n * tokens / p.step_s / 1e12,
               tflops_counted=p.flops / p.step_s / 1e12,
               peak_gpu=p.peak_gpu_bytes, peak_cpu=p.peak_cpu_bytes,
               peak_nvme=p.peak_nvme_bytes, homes=homes,
               origin=f"{plan.solver.origin}; {plan.micro_batch_order}, {plan.optimizer_overlap}",
               status=plan.solver.status, gap=plan.solver.gap,
               acts=Counter(d.activation.value for d in plan.layers),
               host_cap=min(b.cpu_bytes, hw.pinned_limit))
    return row


def _homes(c: Counter) -> str:
    return "/".join(str(c.get(t, 0)) for t in ("gpu", "cpu", "nvme"))


def _gib(n) -> str:
    return fmt_bytes(int(n))


def table(rows) -> str:
    out = ["| model | params | hardware | GPU / host / NVMe budget | K | exit | weights g/c/n "
           "| optimizer g/c/n | step on gpu/cpu | step time | TFLOPS 6NT (counted) "
           "| peak GPU / host / NVMe | origin (gap) | solve |",
           "|---|---:|---|---|---:|---|---|---|---|---:|---:|---|---|---:|"]
    for r in rows:
        c = r["case"]
        hw = c.hardware + (f" (host {c.cpu})" if c.host_is_budget else "")
        bud = f"{c.gpu} / {c.cpu} / {c.nvme}"
        k = f"{c.K}" + (f" (--stream {c.stream})" if c.stream != "auto" else "")
        head = (f"| {c.model} b{c.batch} s{c.seq} | {r['params'] / 1e9:.1f}B | {hw} | {bud} "
                f"| {k} ")
        if r["exit"] != 0:
            # exit 3 names a short budget only when the smallest-budget search finished
            why = ("no plan found in the time limit" if "within the --time-limit" in r["msg"]
                   else f"{r['short']} short")
            out.append(head + f"| exit {r['exit']} ({why}) | - | - | - | - | - | - "
                       f"| - | {r['solve_s']:.0f} s |")
            continue
        gap = "-" if r["gap"] is None else f"{r['gap']:.2%}"
        st = r["homes"]["step"]
        out.append(head + f"| plan | {_homes(r['homes']['weights'])} | "
                   f"{_homes(r['homes']['optimizer'])} | {st.get('gpu', 0)}/{st.get('cpu', 0)} | "
                   f"{r['step_s']:.2f} s | {r['tflops_6nt']:.1f} ({r['tflops_counted']:.1f}) | "
                   f"{_gib(r['peak_gpu'])} / {_gib(r['peak_cpu'])} / {_gib(r['peak_nvme'])} | "
                   f"{r['origin']} ({gap}) | {r['solve_s']:.0f} s |")
    return "\n".join(out)


def details(rows) -> str:
    out = []
    for r in rows:
        c = r["case"]
        if r["exit"] != 0:
            out.append(f"- {c.key}: exit {r['exit']}: {r['msg']}")
            continue
        out.append(f"- {c.key}: static state {_gib(r['static'])}, {r['units']} units, "
                   f"{r['tokens']} tokens/step; step {r['step_s']:.3f} s = "
                   f"{r['step_s'] / r['compute_s']:.2f}x compute-only {r['compute_s']:.3f} s "
                   f"(first pass {r['pass_s']:.3f} s, optimizer phase {r['opt_s']:.3f} s); "
                   f"host budget as the cost model sees it {_gib(r['host_cap'])}; "
                   f"activations {dict(r['acts'])}; grads g/c/n "
                   f"{_homes(r['homes']['grads'])}; solver: {r['status']}")
    return "\n".join(out)


def anchors() -> str:
    out = ["| system | capacity (published) | throughput (published) | source |",
           "|---|---|---|---|"]
    out += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in ANCHORS]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--time-limit", type=float, default=120.0,
                    help="seconds per plan solve (default 120)")
    ap.add_argument("--gap", type=float, default=0.005)
    ap.add_argument("--clip", choices=["global", "none"], default="global",
                    help="as plan solve --clip (none: updates may run beside the backward)")
    ap.add_argument("--micro-batch-order", choices=["batch-major", "layer-major", "auto"],
                    default="batch-major", help="as plan solve --micro-batch-order")
    ap.add_argument("--optimizer-overlap", choices=["auto", "on", "off", "paced"],
                    default="auto", help="as plan solve --optimizer-overlap")
    ap.add_argument("--solver", default=None, help="cbc or highs (default: as plan solve)")
    ap.add_argument("--cases", default=None,
                    help="comma-separated case keys or prefixes (default: all)")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--save-plans", metavar="DIR", default=None,
                    help="also write each case's plan to DIR/<case>.json (to compare versions)")
    args = ap.parse_args(argv)
    args.solver = args.solver or default_solver()
    cases = CASES
    if args.cases:
        want = args.cases.split(",")
        cases = [c for c in CASES if any(c.key == w or c.key.startswith(w) for w in want)]
    if args.list:
        for c in cases:
            print(f"{c.key}: {cli_of(c, args.time_limit)}"
                  + ("  [spec copy: host_memory_bytes = --cpu-mem]" if c.host_is_budget else ""))
        return 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="tierplan-capacity-") as d:
        tmp = Path(d)
        for c in cases:
            print(f"{c.key}: solving (limit {args.time_limit:g} s) ...", file=sys.stderr,
                  flush=True)
            r = run_case(c, args, tmp)
            rows.append(r)
            print(f"  -> exit {r['exit']}" + (f", step {r['step_s']:.3f} s, "
                                              f"{r['tflops_6nt']:.1f} TFLOPS (6NT), "
                                              f"{r['solve_s']:.0f} s" if r['exit'] == 0 else
                                              f": {r['msg'][:200]}"),
                  file=sys.stderr, flush=True)
    print(f"Capacity on one GPU: solver {args.solver}, --time-limit {args.time_limit:g} s, "
          f"--gap {args.gap:g}, --stream auto unless said, meta profiles (estimated times)\n")
    print(table(rows))
    print("\nPer case:\n")
    print(details(rows))
    print("\nPublished anchors (measured systems on their own hardware; ours are predictions):\n")
    print(anchors())
    return 0


if __name__ == "__main__":
    sys.exit(main())
