"""Runtime benchmark: replay overhead against hand-written equivalents, and prediction fidelity.

    python bench/runtime.py                 # both parts
    python bench/runtime.py --part overhead --steps 7
    python bench/runtime.py --part fidelity --fid-batch 16 --fid-seq 1024

Overhead (CPU, fp32): two identical models train side by side, step by step in alternation, and
the ratio is taken pair by pair (so load from other processes hits both sides alike), then the
median ratio is reported:
- keep-all plan vs the plain model;
- recompute-all plan vs the same blocks wrapped by hand in ``torch.utils.checkpoint``
  (non-reentrant, RNG preserved).

Fidelity (``cpu-host``): a GPT whose saved activations exceed 2 GB is profiled on this CPU
(measured times), planned keep-all and offload-all (every block to the local disk), and trained;
the measured peak RSS rise of each step is set beside the plan's prediction (its peak less the
static state resident before the step, docs/runtime.md), and the measured saving of the NVMe
plan beside the predicted saving.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# Replace the script's folder on the path by the repository: bench/ holds runtime.py (this file,
# which would shadow the runtime package) and profile.py (which would shadow the stdlib's).
sys.path[0] = str(Path(__file__).resolve().parents[1])

from planner.hardware import load_hardware  # noqa: E402
from planner.models import build_model, load_config, make_inputs  # noqa: E402
from planner.plans import baseline_plan  # noqa: E402
from planner.profiler import profile_module  # noqa: E402
from planner.sizes import fmt_bytes, fmt_seconds  # noqa: E402
from runtime import apply_plan  # noqa: E402


def _step(model, opt, inputs):
    t0 = time.perf_counter()
    model(**inputs).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


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


def overhead(steps: int, batch: int, seq: int, layers: int):
    hw = load_hardware("cpu-host")
    cfg = dict(load_config("gpt-tiny"), n_layers=layers, d_model=128, dtype="fp32")
    inputs = make_inputs(cfg, batch, seq)
    rows = []
    for policy, peer in (("keep-all", "plain model"), ("recompute-all", "torch.utils.checkpoint")):
        _, plan = _plan(cfg, batch, seq, policy, hw)
        a, b = build_model(cfg), build_model(cfg)
        if policy == "recompute-all":
            _wrap_checkpoint(a)
        h = apply_plan(b, plan, trim_heap=False)   # timing, not memory, is measured here
        oa, ob = torch.optim.AdamW(a.parameters()), torch.optim.AdamW(b.parameters())
        for _ in range(2):                       # warm-up
            _step(a, oa, inputs), _step(b, ob, inputs)
        ta, tb = [], []
        for k in range(steps):
            if k % 2:                            # alternate who goes first
                tb.append(_step(b, ob, inputs))
                ta.append(_step(a, oa, inputs))
            else:
                ta.append(_step(a, oa, inputs))
                tb.append(_step(b, ob, inputs))
        h.remove()
        ratios = [y / x for x, y in zip(ta, tb)]
        rows.append((f"{policy} plan vs {peer}", statistics.median(ta), statistics.median(tb),
                     statistics.median(ratios), len(ratios)))
    print(f"\nReplay overhead (CPU, fp32, gpt d=128 x {layers} blocks, batch {batch}, seq {seq})")
    print(f"{'comparison':<45} {'peer':>10} {'tierplan':>10} {'median ratio':>13} {'pairs':>6}")
    for name, x, y, r, n in rows:
        print(f"{name:<45} {fmt_seconds(x):>10} {fmt_seconds(y):>10} {r:>13.4f} {n:>6}")
    return rows


def fidelity(steps: int, batch: int, seq: int, layers: int, d_model: int, profile_device: str):
    hw = load_hardware("cpu-host")
    cfg = dict(load_config("gpt-tiny"), n_layers=layers, d_model=d_model, max_seq=seq,
               dtype="fp32", name="gpt-fidelity")
    tmp = tempfile.TemporaryDirectory(prefix="tierplan-bench-")
    nvme = str(Path(tmp.name) / "nvme")   # the runtime creates it and removes it again
    rows = []
    for policy in ("keep-all", "offload-all"):
        prof, plan = _plan(cfg, batch, seq, policy, hw, nvme_dir=nvme, device=profile_device,
                           repeats=1)
        act = sum(u.activation_bytes for u in prof.layers)
        model = build_model(cfg)
        opt = torch.optim.AdamW(model.parameters())
        h = apply_plan(model, plan)
        inputs = make_inputs(cfg, batch, seq)
        for _ in range(steps):
            _step(model, opt, inputs)
        rep = h.report()
        h.remove()
        med = rep.median()
        pred_rise = rep.predicted_gpu_rise(med["static_bytes"])
        rows.append((policy, act, med, pred_rise, plan.predicted["step_s"]))
        print(rep, flush=True)
    print(f"\nFidelity on cpu-host (gpt d={d_model} x {layers} blocks, batch {batch}, seq {seq}, "
          f"fp32; saved activations {fmt_bytes(rows[0][1])}; median of {rows[0][2]['steps']} "
          "step(s) after the first)")
    print(f"{'plan':<12} {'meas. peak rise':>16} {'pred. rise':>12} {'error':>8} "
          f"{'meas. step':>11} {'pred. step':>11}")
    for policy, _, med, pred, pstep in rows:
        err = (med["peak_gpu_bytes"] - pred) / pred
        print(f"{policy:<12} {fmt_bytes(med['peak_gpu_bytes']):>16} {fmt_bytes(pred):>12} "
              f"{err:>+8.1%} {fmt_seconds(med['step_s']):>11} {fmt_seconds(pstep):>11}")
    tmp.cleanup()
    saved_meas = rows[0][2]["peak_gpu_bytes"] - rows[1][2]["peak_gpu_bytes"]
    saved_pred = rows[0][3] - rows[1][3]
    print(f"NVMe plan lowers the peak by {fmt_bytes(saved_meas)} measured vs "
          f"{fmt_bytes(saved_pred)} predicted: {saved_meas / saved_pred:.1%} of the prediction")
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description="tierplan runtime benchmark")
    ap.add_argument("--part", choices=["overhead", "fidelity", "all"], default="all")
    ap.add_argument("--steps", type=int, default=7, help="overhead pairs (>= 5)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--fid-steps", type=int, default=3)
    ap.add_argument("--fid-batch", type=int, default=16)
    ap.add_argument("--fid-seq", type=int, default=1024)
    ap.add_argument("--fid-layers", type=int, default=4)
    ap.add_argument("--fid-d-model", type=int, default=256)
    ap.add_argument("--profile-device", choices=["meta", "cpu"], default="cpu")
    a = ap.parse_args(argv)
    torch.manual_seed(0)
    if a.part in ("overhead", "all"):
        overhead(max(5, a.steps), a.batch, a.seq, a.layers)
    if a.part in ("fidelity", "all"):
        fidelity(a.fid_steps, a.fid_batch, a.fid_seq, a.fid_layers, a.fid_d_model,
                 a.profile_device)


if __name__ == "__main__":
    main()
