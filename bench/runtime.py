"""Runtime benchmark: replay overhead against hand-written equivalents, and prediction fidelity.

    python bench/runtime.py                         # both parts, the defaults below
    python bench/runtime.py --part overhead --steps 7
    python bench/runtime.py --part fidelity --fid-steps 6
    python bench/runtime.py --part checksum          # what the offload checksums cost

Overhead (CPU, fp32): two identical models train side by side, step by step in alternation (who
goes first alternates too), and the ratio is taken pair by pair, so load from other processes
hits both sides alike; the median ratio is reported. Two block sizes: a tiny one (a step of a
few ms on an idle core, where any per-tensor Python cost is magnified) and a realistic one
(a step of well over 0.3 s). Comparisons:
- keep-all plan vs the plain model;
- recompute-all plan vs the same blocks wrapped by hand in ``torch.utils.checkpoint``
  (non-reentrant, RNG preserved).
Each step is timed twice: wall clock, and the CPU time of the process (``time.process_time``;
with one torch thread the forward, the backward and the optimizer all run on the calling thread,
so it is the step's own work and much less sensitive to other jobs on a shared host than the
wall clock, whose pair ratios spread over 0.9-1.4 there). The runtime runs with ``trim_heap=False`` (timing, not memory, is measured here); its per-step
memory probes (a ``clear_refs`` write and two ``/proc/self/status`` reads, about 40 us) stay on.

Fidelity (``cpu-host``): runs in a child process started with ``MALLOC_MMAP_THRESHOLD_=65536``
(docs/runtime.md: with glibc's default dynamic threshold, freed tensors of up to 32 MiB stay in
the heap, so RSS does not fall when the runtime frees an offloaded tensor). There a GPT whose
saved activations exceed 2 GB is profiled on this CPU (measured times, ``--fid-repeats``), planned
keep-all and offload-all (every block to the local disk), and trained; the measured peak RSS
rise of each step is set beside the plan's prediction (its peak less the static state resident
before the step), and the measured saving of the NVMe plan beside the predicted saving.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# Replace the script's folder on the path by the repository: bench/ holds runtime.py (this file,
# which would shadow the runtime package) and profile.py (which would shadow the stdlib's).
REPO = Path(__file__).resolve().parents[1]
sys.path[0] = str(REPO)

from planner.hardware import load_hardware  # noqa: E402
from planner.models import build_model, load_config, make_inputs  # noqa: E402
from planner.plans import baseline_plan  # noqa: E402
from planner.profile import profile_module  # noqa: E402
from planner.sizes import fmt_bytes, fmt_seconds  # noqa: E402
from runtime import apply_plan  # noqa: E402

MMAP_THRESHOLD = "65536"


def gpt_config(d_model: int, layers: int, seq: int, name: str = "gpt-bench") -> dict:
    """The built-in GPT at another width: heads of 64, d_ff = 4 d (GPT-2's ratios)."""
    heads = max(1, d_model // 64)
    return dict(load_config("gpt-tiny"), name=name, n_layers=layers, d_model=d_model,
                n_heads=heads, n_kv_heads=heads, d_ff=4 * d_model, max_seq=max(seq, 256),
                dtype="fp32")


def _step(model, opt, inputs, cpu=False):
    """Wall seconds of one step, or (wall, CPU seconds of this process) with ``cpu``."""
    t0, c0 = time.perf_counter(), time.process_time()
    model(**inputs).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    wall = time.perf_counter() - t0
    return (wall, time.process_time() - c0) if cpu else wall


def _wrap_checkpoint(model):
    """The hand-written equivalent of recompute-all: each block under torch.utils.checkpoint."""
    from torch.utils.checkpoint import checkpoint
    for b in model.blocks:
        orig = b.forward
        b.forward = (lambda orig: lambda *a, **k: checkpoint(orig, *a, use_reentrant=False,
                                                             **k))(orig)


def _plan(cfg, batch, seq, policy, hw, nvme_dir=None, device="meta", repeats=3):
    model = build_model(cfg, device=device)
    prof = profile_module(model, make_inputs(cfg, batch, seq, device=device), name=cfg["name"],
                          hardware=hw, dtype=cfg["dtype"], config=cfg, batch=batch, seq=seq,
                          repeats=repeats)
    budgets = {"gpu_bytes": hw.memory_bytes, "cpu_bytes": 0, "nvme_bytes": hw.nvme_bytes}
    return prof, baseline_plan(prof, None, hw, budgets, policy, nvme_dir=nvme_dir)


# ----------------------------------------------------------------------------- overhead

def overhead_case(label, cfg, batch, seq, pairs):
    hw = load_hardware("cpu-host")
    inputs = make_inputs(cfg, batch, seq)
    rows = []
    for policy, peer in (("keep-all", "plain model"), ("recompute-all", "torch.utils.checkpoint")):
        _, plan = _plan(cfg, batch, seq, policy, hw)
        a, b = build_model(cfg), build_model(cfg)
        if policy == "recompute-all":
            _wrap_checkpoint(a)
        h = apply_plan(b, plan, trim_heap=False)   # timing, not memory, is measured here
        oa, ob = torch.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters())
        for _ in range(2):                       # warm-up (the first step allocates AdamW state)
            _step(a, oa, inputs), _step(b, ob, inputs)
        ta, tb = [], []
        for k in range(pairs):
            if k % 2:                            # alternate who goes first
                tb.append(_step(b, ob, inputs, cpu=True))
                ta.append(_step(a, oa, inputs, cpu=True))
            else:
                ta.append(_step(a, oa, inputs, cpu=True))
                tb.append(_step(b, ob, inputs, cpu=True))
        h.remove()
        row = dict(size=label, comparison=f"{policy} plan vs {peer}", pairs=pairs)
        for j, kind in ((0, "wall"), (1, "cpu")):
            ratios = sorted(y[j] / x[j] for x, y in zip(ta, tb))
            row[kind] = dict(peer=statistics.median(x[j] for x in ta),
                             tierplan=statistics.median(y[j] for y in tb),
                             ratio=statistics.median(ratios), lo=ratios[0], hi=ratios[-1])
        rows.append(row)
        print(f"  {label}: {row['comparison']}: median ratio wall {row['wall']['ratio']:.4f}, "
              f"CPU time {row['cpu']['ratio']:.4f}", flush=True)
    return rows


def overhead(pairs: int, sizes: list[tuple]):
    rows = []
    for label, d, layers, batch, seq in sizes:
        rows += overhead_case(label, gpt_config(d, layers, seq), batch, seq, pairs)
    print(f"\nReplay overhead (CPU, fp32, {torch.get_num_threads()} thread(s); median of {pairs} "
          "alternating pairs, ratio pair by pair; lo/hi = smallest/largest pair ratio; cpu = "
          "process CPU time, wall = wall clock)")
    print("| size | comparison | clock | peer step | tierplan step | median ratio | lo | hi |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        for kind in ("cpu", "wall"):
            x = r[kind]
            print(f"| {r['size']} | {r['comparison']} | {kind} | {fmt_seconds(x['peer'])} | "
                  f"{fmt_seconds(x['tierplan'])} | {x['ratio']:.4f} | {x['lo']:.3f} | "
                  f"{x['hi']:.3f} |")
    return rows


# ----------------------------------------------------------------------------- checksums

def checksum_cost(pairs: int, d: int, layers: int, batch: int, seq: int, nvme_base=None):
    """What the offload checksums cost (runtime/files.py, docs/reliability.md): two identical
    models train an offload-all plan (every block's activations to the local disk and back)
    side by side, one step each in alternation, checksums on for one and off for the other
    (``runtime.files.CHECKSUM``, read when each range is written and read back, so a step runs
    wholly under one setting); the ratio is taken pair by pair, wall clock and process CPU
    time, and the median reported. Also: xxh3's own rate on this CPU."""
    import xxhash

    import runtime.files as rf
    from planner.formats import Budgets
    from planner.plans import baseline_plan

    hw = load_hardware("cpu-host")
    cfg = gpt_config(d, layers, seq, name="gpt-checksum")
    meta = build_model(cfg, device="meta")
    prof = profile_module(meta, make_inputs(cfg, batch, seq, device="meta"), name=cfg["name"],
                          hardware=hw, dtype="fp32", config=cfg, batch=batch, seq=seq,
                          timing="estimate")
    tmp = tempfile.TemporaryDirectory(prefix="tierplan-bench-", dir=nvme_base)
    plan = baseline_plan(prof, None, hw, Budgets(hw.memory_bytes, 0, hw.nvme_bytes),
                         "offload-all", nvme_dir=str(Path(tmp.name) / "nvme"))
    inputs = make_inputs(cfg, batch, seq)
    torch.manual_seed(0)
    a = build_model(cfg)
    b = build_model(cfg)
    b.load_state_dict(a.state_dict())
    ha, hb = apply_plan(a, plan), apply_plan(b, plan)
    oa, ob = torch.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters())

    def step(m, o, on):
        rf.CHECKSUM = on
        try:
            return _step(m, o, inputs, cpu=True)
        finally:
            rf.CHECKSUM = True
    for _ in range(2):                               # warm-up (AdamW state, page cache)
        step(a, oa, True), step(b, ob, False)
    on, off = [], []
    for k in range(pairs):
        if k % 2:
            off.append(step(b, ob, False))
            on.append(step(a, oa, True))
        else:
            on.append(step(a, oa, True))
            off.append(step(b, ob, False))
    moved = ha.report().steps[-1].moved
    ha.remove(), hb.remove()
    tmp.cleanup()
    buf = bytearray(os.urandom(1 << 20)) * 256       # 256 MiB
    t0 = time.perf_counter()
    for _ in range(3):
        xxhash.xxh3_64_intdigest(buf)
    rate = 3 * len(buf) / (time.perf_counter() - t0)
    hashed = moved["nvme_write"] + moved["nvme_read"]
    print(f"\nChecksum cost on an offload-all step (CPU, fp32, {torch.get_num_threads()} "
          f"thread(s); gpt d={d} x {layers} blocks, batch {batch}, seq {seq}; "
          f"{fmt_bytes(moved['nvme_write'])} written and read back per step, each byte hashed "
          f"once each way; xxh3-64 {xxhash.VERSION} hashes {rate / 1e9:.1f} GB/s here; median "
          f"of {pairs} alternating pairs)")
    print("| clock | checksums off | checksums on | median ratio | lo | hi | hashing alone |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for j, kind in ((1, "cpu"), (0, "wall")):
        ratios = sorted(x[j] / y[j] for x, y in zip(on, off))
        t_off = statistics.median(y[j] for y in off)
        row = dict(clock=kind, off=t_off, on=statistics.median(x[j] for x in on),
                   ratio=statistics.median(ratios), lo=ratios[0], hi=ratios[-1],
                   hash_share=hashed / rate / t_off)
        rows.append(row)
        print(f"| {kind} | {fmt_seconds(row['off'])} | {fmt_seconds(row['on'])} | "
              f"{row['ratio']:.4f} | {row['lo']:.3f} | {row['hi']:.3f} | "
              f"{row['hash_share']:.2%} of the step |")
    return rows


# ----------------------------------------------------------------------------- fidelity

def fidelity_child(a) -> list[dict]:
    """Runs in the child process (allocator configured by the parent's environment)."""
    hw = load_hardware("cpu-host")
    cfg = gpt_config(a.fid_d_model, a.fid_layers, a.fid_seq, name="gpt-fidelity")
    tmp = tempfile.TemporaryDirectory(prefix="tierplan-bench-", dir=a.nvme_base)
    nvme = str(Path(tmp.name) / "nvme")   # the runtime creates it and removes it again
    rows = []
    prof = None
    for policy in ("keep-all", "offload-all"):
        if prof is None:   # one profile, measured in this process under this allocator
            prof, plan = _plan(cfg, a.fid_batch, a.fid_seq, policy, hw, nvme_dir=nvme,
                               device="cpu", repeats=a.fid_repeats)
        else:
            budgets = {"gpu_bytes": hw.memory_bytes, "cpu_bytes": 0,
                       "nvme_bytes": hw.nvme_bytes}
            plan = baseline_plan(prof, None, hw, budgets, policy, nvme_dir=nvme)
        model = build_model(cfg)
        opt = torch.optim.AdamW(model.parameters())
        h = apply_plan(model, plan)
        inputs = make_inputs(cfg, a.fid_batch, a.fid_seq)
        for _ in range(a.fid_steps):
            _step(model, opt, inputs)
        rep = h.report()
        h.remove()
        print(rep, flush=True)
        med = dataclasses.asdict(rep.measured)
        rows.append(dict(policy=policy, act=sum(u.activation_bytes for u in prof.layers),
                         med=med, pred_rise=rep.predicted_gpu_rise_bytes,
                         pred=plan.predicted.to_dict(), compute_s=plan.predicted.compute_s,
                         steps=[s.step_s for s in rep.steps],
                         rises=[s.peak_gpu_bytes for s in rep.steps]))
        del model, opt, h, rep
    tmp.cleanup()
    return rows


def fidelity(a):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=MMAP_THRESHOLD)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--fidelity-child", out.name]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                if k.startswith("fid_") or k == "nvme_base" and v]
        subprocess.run(cmd, env=env, check=True)
        rows = json.loads(Path(out.name).read_text())
    print(f"\nFidelity on cpu-host (gpt d={a.fid_d_model} x {a.fid_layers} blocks, batch "
          f"{a.fid_batch}, seq {a.fid_seq}, fp32; saved activations {fmt_bytes(rows[0]['act'])}; "
          f"MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}; profile measured in the same process, "
          f"{a.fid_repeats} repeats; median of the {rows[0]['med']['steps']} steps after the "
          "first)")
    print("| plan | measured peak RSS rise | predicted rise | error | runtime's activation "
          "count | measured step | predicted step | compute-only | stall |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        med, pred = r["med"], r["pred_rise"]
        err = (med["peak_gpu_bytes"] - pred) / pred
        print(f"| {r['policy']} | {fmt_bytes(med['peak_gpu_bytes'])} | {fmt_bytes(pred)} | "
              f"{err:+.1%} | {fmt_bytes(med['peak_activation_bytes'])} | "
              f"{fmt_seconds(med['step_s'])} | {fmt_seconds(r['pred']['step_s'])} | "
              f"{fmt_seconds(r['compute_s'])} | {fmt_seconds(med['stall_s'])} |")
    saved_meas = rows[0]["med"]["peak_gpu_bytes"] - rows[1]["med"]["peak_gpu_bytes"]
    saved_pred = rows[0]["pred_rise"] - rows[1]["pred_rise"]
    print(f"\nNVMe plan lowers the peak by {fmt_bytes(saved_meas)} measured vs "
          f"{fmt_bytes(saved_pred)} predicted: {saved_meas / saved_pred:.1%} of the prediction")
    for r in rows:
        print(f"{r['policy']}: every step's rise "
              f"{[fmt_bytes(x) for x in r['rises']]}, time {[round(x, 2) for x in r['steps']]} s; "
              f"moved {r['med']['moved']}")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description="tierplan runtime benchmark")
    ap.add_argument("--part", choices=["overhead", "fidelity", "checksum", "all"], default="all")
    ap.add_argument("--ck-pairs", type=int, default=9, help="checksum part: alternating pairs")
    ap.add_argument("--ck-size", default="512,4,4,512",
                    help="checksum part: d_model,blocks,batch,seq of the offload-all GPT")
    ap.add_argument("--steps", type=int, default=7, help="overhead pairs (>= 5)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for the overhead part (1: on a shared host, a second "
                         "thread mostly measures the other jobs)")
    ap.add_argument("--sizes", default="tiny,realistic",
                    help="overhead sizes: tiny (d=128 x 4 blocks, b 4, s 128), realistic "
                         "(d=512 x 2 blocks, b 4, s 512)")
    ap.add_argument("--fid-steps", type=int, default=6, help="fidelity steps (the first is left "
                    "out of the medians)")
    ap.add_argument("--fid-batch", type=int, default=8)
    ap.add_argument("--fid-seq", type=int, default=1024)
    ap.add_argument("--fid-layers", type=int, default=4)
    ap.add_argument("--fid-d-model", type=int, default=256)
    ap.add_argument("--fid-repeats", type=int, default=3)
    ap.add_argument("--nvme-base", default=None, help="where the offload directory is made")
    ap.add_argument("--fidelity-child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    if a.fidelity_child:
        rows = fidelity_child(a)
        Path(a.fidelity_child).write_text(json.dumps(rows))
        return
    if a.part in ("overhead", "all"):
        torch.set_num_threads(a.threads)
        known = {"tiny": ("tiny: d=128 x 4, b 4, s 128", 128, 4, 4, 128),
                 "realistic": ("realistic: d=512 x 2, b 4, s 512", 512, 2, 4, 512)}
        overhead(max(5, a.steps), [known[s] for s in a.sizes.split(",")])
    if a.part in ("checksum", "all"):
        torch.set_num_threads(a.threads)
        d, layers, batch, seq = (int(x) for x in a.ck_size.split(","))
        checksum_cost(max(5, a.ck_pairs), d, layers, batch, seq, a.nvme_base)
    if a.part in ("fidelity", "all"):
        fidelity(a)


if __name__ == "__main__":
    main()
