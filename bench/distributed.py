"""Distributed benchmark: per-rank plans under FSDP2 on H100s, and measured per-rank memory on
this CPU host with two gloo ranks.

    python bench/distributed.py --part table        # llama3-8b / llama3-70b, s=8192, h100-80g
    python bench/distributed.py --part table --homes off on --nvme-mem 3.84T \
        --models llama3-8b llama3-70b gpt3-175b --world-sizes 1 8 16 32 64   # issue 29's table
    python bench/distributed.py --part fidelity     # 2 ranks, FSDP2 and DDP, measured vs predicted

Table: each model is profiled on the meta device (batch 1 per rank, seq 8192, bf16, flash
attention assumed: ``plan profile MODEL --batch 1 --seq 8192 --device meta --hardware h100-80g``)
and solved as ``plan solve PROFILE --gpu-mem 80G --world-size N --ranks-per-node min(N, 8)
--engine fsdp2`` (host memory: the spec's 2 TiB per node, shared by its ranks; no NVMe) for
N = 1, 2, 4, 8, 16. Beside each solve, the plain FSDP2 run (the keep-all plan under the same
cost model: every activation kept): its per-rank peak and the activation bytes in it.
``--homes off on`` solves each cell twice: homes off the device not offered (``--stream off``)
and offered (``--stream auto``: a rank's shards of weights, gradients and optimizer state may
live on the host or, with ``--nvme-mem`` per node, on NVMe); each row then has its homes and
its TFLOPS per GPU (6 N T / step, N the model's parameters, T the tokens of one rank's batch).

Fidelity: runs in child processes started with ``MALLOC_MMAP_THRESHOLD_=65536`` (so RSS follows
the live tensors; docs/runtime.md). A GPT (d=256, 4 blocks, batch 8, seq 512, fp32) is
profiled on this CPU (bytes measured, times estimated); every rank trains 4 steps under each
plan and the median RSS rise of steps 2-4 is set beside the plan's per-rank prediction (its
peak less the static state resident before the step).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)          # bench/ holds runtime.py and profile.py: put the repo first
sys.path.insert(1, str(REPO / "tests"))

from planner.errors import UserError  # noqa: E402
from planner.sizes import fmt_bytes  # noqa: E402

GIB = 1024**3


# ----------------------------------------------------------------------------- table

def _summary(plan) -> str:
    """What the plan does with the blocks' activations, counted by decision."""
    from collections import Counter
    c = Counter()
    for u, d in zip(plan.units, plan.layers):
        if u.kind != "block":
            continue
        key = d.activation.value
        if key == "recompute":
            key = f"recompute({(d.checkpoint.value if d.checkpoint else 'gpu')})"
        c[key] += 1
    return ", ".join(f"{n} {k}" for k, n in sorted(c.items(), key=lambda kv: -kv[1]))


def _homes_summary(plan) -> str:
    """Where the blocks' shards live, counted by home (weights/grads/optimizer tiers)."""
    from collections import Counter
    c = Counter(d.home.label() for u, d in zip(plan.units, plan.layers)
                if u.kind == "block" and not d.home.resident)
    return ", ".join(f"{n} {k}" for k, n in sorted(c.items(), key=lambda kv: -kv[1])) or "none"


def table(a) -> list[dict]:
    from planner.costmodel.baselines import baseline_layers
    from planner.formats import Budgets, write_json_atomic
    from planner.hardware import load_hardware
    from planner.plans import cost_model, plan_and_sim
    from planner.profile import profile_model
    from planner.solve import solve_profile
    from planner.sizes import parse_size
    hw = load_hardware(a.hardware)
    nvme = parse_size(a.nvme_mem) if a.nvme_mem else 0
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for model in a.models:
        t0 = time.perf_counter()
        seq = a.seq or (2048 if "gpt" in Path(model).stem else 8192)
        prof = profile_model(model, 1, seq, device="meta", hardware=hw)
        path = out_dir / f"{Path(model).stem}-b1-s{seq}.json"
        params = sum(u.param_count for u in prof.layers)
        write_json_atomic(path, prof.to_dict())
        print(f"# {model}: profiled in {time.perf_counter() - t0:.1f} s, "
              f"{len(prof.layers)} units, static {fmt_bytes(prof.static_bytes)}", flush=True)
        for n, homes in [(n, h) for n in a.world_sizes for h in a.homes]:
            ranks = {"world_size": n, "ranks_per_node": min(n, 8), "engine": "fsdp2"}
            budgets = Budgets(80 * GIB, int(hw.host_memory_bytes), nvme if homes == "on" else 0)
            cm = cost_model(prof, hw, budgets, **ranks)
            plain, ps = plan_and_sim(prof, None, hw, budgets, "keep-all",
                                     baseline_layers("keep-all", prof.layers, hw), cm=cm)
            act = sum(u.saved_bytes for u in prof.layers)
            row = {"model": Path(model).stem, "N": n, "homes": homes, "seq": seq,
                   "plain_peak": ps.peak_gpu_bytes,
                   "plain_fits": ps.fits, "activations": act,
                   "static_per_rank": ps.static_bytes}
            t1 = time.perf_counter()
            try:
                got = solve_profile(prof, str(path), hw, budgets, "optimal",
                                    time_limit=a.time_limit,
                                    stream="auto" if homes == "on" else "off",
                                    shard_homes="all", **ranks)
                p = got.plan
                row.update(exit=0, step=p.predicted.step_s, compute=p.predicted.compute_s,
                           ratio=p.predicted.step_s / p.predicted.compute_s,
                           peak=p.predicted.peak_gpu_bytes, host=p.predicted.peak_cpu_bytes,
                           nvme=p.predicted.peak_nvme_bytes,
                           tflops=6 * params * seq / p.predicted.step_s / 1e12,
                           what=_summary(p), where=_homes_summary(p), origin=p.solver.origin)
                write_json_atomic(out_dir / f"{Path(model).stem}-n{n}-{homes}.json",
                                  p.to_dict())
            except UserError as e:
                row.update(exit=e.exit_code, needed=getattr(e, "needed_bytes", None),
                           why=str(e))
            row["solve_s"] = time.perf_counter() - t1
            rows.append(row)
            _print_row(row)
    (out_dir / "table.json").write_text(json.dumps(rows, indent=1))
    print()
    print(markdown(rows))
    return rows


def _print_row(r):
    head = (f"{r['model']:<11} N={r['N']:<3} homes {r['homes']:<3} plain FSDP2 peak {fmt_bytes(r['plain_peak']):>11}"
            f" ({'fits' if r['plain_fits'] else 'OOM'})")
    if r["exit"] == 0:
        print(f"{head}  plan: {r['ratio']:.3f}x compute-only, {r['tflops']:.0f} TFLOPS/GPU, "
              f"peak {fmt_bytes(r['peak'])}, host {fmt_bytes(r['host'])}, NVMe "
              f"{fmt_bytes(r['nvme'])}: {r['what']}; homes {r['where']}  "
              f"[{r['solve_s']:.1f} s]", flush=True)
    else:
        need = f", needs --gpu-mem {fmt_bytes(r['needed'])}" if r.get("needed") else ""
        print(f"{head}  plan: exit {r['exit']}{need}  [{r['solve_s']:.1f} s]", flush=True)


def markdown(rows) -> str:
    lines = ["| model | ranks | homes | static / rank | plain FSDP2: peak / rank (activations) | "
             "tierplan `plan solve` | step (s) / compute-only | TFLOPS / GPU | peak / rank | "
             "host / rank | NVMe / rank | blocks' activations | blocks' homes off the device |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        plain = (f"{fmt_bytes(r['plain_peak'])} ({fmt_bytes(r['activations'])})"
                 f"{'' if r['plain_fits'] else ' — OOM'}")
        if r["exit"] == 0:
            lines.append(f"| {r['model']} | {r['N']} | {r['homes']} | "
                         f"{fmt_bytes(r['static_per_rank'])} | {plain} | fits | "
                         f"{r['step']:.3f} / {r['ratio']:.3f}x | {r['tflops']:.0f} | "
                         f"{fmt_bytes(r['peak'])} | {fmt_bytes(r['host'])} | "
                         f"{fmt_bytes(r['nvme'])} | {r['what']} | {r['where']} |")
        else:
            need = f" (needs {fmt_bytes(r['needed'])})" if r.get("needed") else ""
            lines.append(f"| {r['model']} | {r['N']} | {r['homes']} | "
                         f"{fmt_bytes(r['static_per_rank'])} | {plain} | exit {r['exit']}{need}"
                         " | — | — | — | — | — | — | — |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- fidelity

FIDELITY_PLANS = ("keep-all", "recompute-all", "offload-all", "optimal", "nvme-homes")

def fidelity_child(a) -> None:
    """In a child with the fixed mmap threshold: plans, then 2 ranks per engine."""
    import dist_harness as H
    import dataclasses
    from planner.formats import Budgets, Home, Tier
    from planner.hardware import load_hardware
    from planner.plans import cost_model, make_plan, save_plan
    from planner.costmodel.baselines import baseline_layers
    from planner.profile import profile_module
    from planner.solve import solve_profile

    cfg = {"name": "gpt-fid", "family": "gpt", "n_layers": a.layers, "d_model": a.d_model,
           "n_heads": a.d_model // 64, "vocab_size": 512, "max_seq": a.seq, "dropout": 0.1,
           "tie_embeddings": True, "dtype": "fp32"}
    H.B, H.S = a.batch, a.seq
    H.CONFIG = cfg
    hw = load_hardware("cpu-host")
    model, batches = H.build("config")
    prof = profile_module(model, batches[0], name="gpt-fid", hardware=hw, timing="estimate",
                          batch=a.batch, seq=a.seq)
    del model, batches
    out = Path(a.out)
    rows = []
    for engine in a.engines:
        ranks = {"world_size": 2, "ranks_per_node": 2, "engine": engine}
        loose = Budgets(hw.memory_bytes, 0, 8 * GIB)
        cm = cost_model(prof, hw, loose, **ranks)
        cases, peaks = [], {}
        for pol in a.plans:
            nvme = str(out / f"nvme-{engine}-{pol}")
            if pol == "nvme-homes":
                if engine != "fsdp2":
                    continue
                # keep-all, every block's weight and optimizer-state shards on NVMe (the
                # gradient shards on the device): runtime/sharded.py NvmeShards
                home = Home(Tier.NVME, Tier.GPU, Tier.NVME, Tier.GPU)
                layers = [dataclasses.replace(d, home=home) if u.kind == "block" else d
                          for d, u in zip(baseline_layers("keep-all", prof.layers, hw),
                                          prof.layers)]
                plan = make_plan(prof, None, hw, loose, "optimal", layers, nvme_dir=nvme, cm=cm)
            elif pol == "optimal":
                low = min(peaks.values())
                tight = Budgets(int(low + 0.4 * (peaks["keep-all"] - low)), 0, 8 * GIB)
                # activations only, as measured in docs/distributed.md ("Fidelity")
                plan = solve_profile(prof, None, hw, tight, "optimal", time_limit=60,
                                     nvme_dir=nvme, stream="off", **ranks).plan
            else:
                plan = make_plan(prof, None, hw, loose, pol,
                                 baseline_layers(pol, prof.layers, hw), nvme_dir=nvme, cm=cm)
                peaks[pol] = plan.predicted.peak_gpu_bytes
            path = out / f"fid-{engine}-{pol}.json"
            save_plan(plan, path)
            cases.append(("config", pol, str(path), nvme))
        res = H.run(engine, cases, out / f"ranks-{engine}", steps=a.steps, compare=False)
        for rank, per in enumerate(res):
            for key, x in per.items():
                rep = x["report"]
                rise = [s["peak_gpu_bytes"] for s in rep["steps"][1:]]
                pred = rep["predicted_gpu_rise_bytes"]
                med = statistics.median(rise)
                # the whole per-rank peak: the static state resident before the step (what
                # homes on NVMe take away) plus the rise over it
                static = statistics.median(s["static_bytes"] for s in rep["steps"][1:])
                static_pred = rep["predicted_static_bytes"]
                rows.append({"engine": engine, "rank": rank, "plan": key.split("/")[1],
                             "measured": med, "predicted": pred, "err": med / pred - 1,
                             "steps": len(rise), "spread": max(rise) - min(rise),
                             "static": static, "static_pred": static_pred,
                             "peak": static + med, "peak_pred": static_pred + pred,
                             "what": _summary_from(rep, path)})
    (out / "fidelity.json").write_text(json.dumps(rows, indent=1))


def _summary_from(rep, path):
    return rep.get("policy", "")


def fidelity(a) -> None:
    import subprocess
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(REPO))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, __file__, "--part", "fidelity-child", "--out", str(out),
            "--d-model", str(a.d_model), "--layers", str(a.layers), "--batch", str(a.batch),
            "--seq", str(a.seq), "--steps", str(a.steps), "--engines", *a.engines,
            "--plans", *a.plans]
    t0 = time.perf_counter()
    subprocess.run(argv, env=env, check=True)
    rows = json.loads((out / "fidelity.json").read_text())
    print(f"# 2 ranks, gloo, MALLOC_MMAP_THRESHOLD_=65536, gpt d={a.d_model} x {a.layers} "
          f"blocks, batch {a.batch} per rank, seq {a.seq}, fp32; median of steps 2-{a.steps} "
          f"({time.perf_counter() - t0:.0f} s)")
    print("| engine | rank | plan | measured RSS rise | predicted | error | spread over steps | "
          "static state before the step (measured / predicted) | peak = static + rise "
          "(measured / predicted) | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r['rank']} | {r['plan']} | {fmt_bytes(r['measured'])} | "
              f"{fmt_bytes(r['predicted'])} | {r['err'] * 100:+.1f}% | "
              f"{fmt_bytes(r['spread'])} | {fmt_bytes(r['static'])} / "
              f"{fmt_bytes(r['static_pred'])} | {fmt_bytes(r['peak'])} / "
              f"{fmt_bytes(r['peak_pred'])} | {(r['peak'] / r['peak_pred'] - 1) * 100:+.1f}% |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=["table", "fidelity", "fidelity-child"], default="table")
    ap.add_argument("--models", nargs="+", default=["llama3-8b", "llama3-70b"])
    ap.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--seq", type=int, default=None,
                    help="tokens per sequence (default: 8192 for llama, 2048 for gpt models)")
    ap.add_argument("--homes", nargs="+", choices=["off", "on"], default=["off"],
                    help="homes off the device not offered (off) and/or offered (on)")
    ap.add_argument("--hardware", default="h100-80g")
    ap.add_argument("--nvme-mem", default=None, help="NVMe per node with --homes on (e.g. 3.84T)")
    ap.add_argument("--time-limit", type=float, default=60.0)
    ap.add_argument("--out", default="/tmp/tierplan-bench-distributed")
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--engines", nargs="+", default=["fsdp2", "ddp"])
    ap.add_argument("--plans", nargs="+", default=list(FIDELITY_PLANS), choices=FIDELITY_PLANS,
                    help="fidelity: the plans measured (optimal after the three baselines; "
                         "nvme-homes: keep-all with every block's weight and optimizer-state "
                         "shards on NVMe, fsdp2 only)")
    a = ap.parse_args()
    if a.part == "table":
        table(a)
    elif a.part == "fidelity":
        a.seq = a.seq or 512
        fidelity(a)
    else:
        fidelity_child(a)


if __name__ == "__main__":
    main()
