"""Layer streaming on this CPU host, end to end: models whose static state (weights, gradients,
AdamW state) is at least RATIO times the device budget are profiled, solved and trained for a
few optimizer steps under the plan, beside plain PyTorch.

    python bench/streaming.py                       # built-in GPT and LLaMA; GPT-2 as
                                                    # GPT2Config() gives it (124M, tied
                                                    # embedding) and NanoChat as
                                                    # NanoChatConfig() does (257M), the
                                                    # latter also with attention dropout
    python bench/streaming.py --models gpt          # one of them

Per model: ``plan profile`` (device cpu, spec cpu-host), ``plan solve --gpu-mem static/RATIO
--micro-batches K``, then two fresh processes train STEPS optimizer steps of K micro-batches
each (AdamW with weight decay, a cosine LR schedule, gradient clipping at 0.5, dropout on),
one plainly and one under the plan. The table shows:

  diff       the largest absolute difference of any weight after the steps (plan vs plain)
  peak       measured peak RSS rise over a step (median of the steps after the first) and the
             plan's predicted rise (its device peak less the static state resident before a
             step), with the measured total beside the budget; the check asks the measured
             total (resident state + rise) to be within 10% of the predicted peak, either way,
             and under the budget
  files      files left in the plan's NVMe directory after ``handle.remove()``

Both processes run with MALLOC_MMAP_THRESHOLD_=65536 so that glibc maps every tensor of 64 KiB
or more on its own and returns it when freed: the RSS then follows the bytes that are alive,
not what the heap kept from earlier steps (runtime.md, "Measuring memory on a CPU host").
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/runtime.py would shadow the runtime package: import from the repository root
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
MODELS = {
    # name: (model spec, batch, seq)
    "gpt": (str(ROOT / "bench/models/gpt-stream.yaml"), 2, 64),
    "llama": (str(ROOT / "bench/models/llama-stream.yaml"), 2, 64),
    "hf-gpt2": ("examples.hf_models:gpt2_default", 1, 128),
    "hf-nanochat": ("examples.hf_models:nanochat_default", 1, 128),
    "hf-nanochat-drop": ("examples.hf_models:nanochat_default_dropout", 1, 128),
}
MiB = 2 ** 20


def _run(cmd, env=None):
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return r


def _batches(spec, model_cfg, inputs, B, S, n):
    """n input dicts: the built-in models' own token batches, or the factory's inputs with
    fresh token ids of the same shape (labels are the ids: Hugging Face shifts them)."""
    import torch

    from planner.models import make_inputs
    if model_cfg is not None and not spec.count(":"):
        return [make_inputs(model_cfg, B, S, seed=k) for k in range(n)]
    ids = inputs["input_ids"]
    vocab = int(model_cfg.get("vocab_size", 0)) if isinstance(model_cfg, dict) else 0
    out = []
    for k in range(n):
        g = torch.Generator().manual_seed(k)
        new = torch.randint(0, vocab or int(ids.max()) + 1, ids.shape, generator=g)
        out.append({**inputs, "input_ids": new, "labels": new.clone()})
    return out


def worker(args) -> None:
    """One training run in this process: plainly (saving the weights) or under the plan
    (comparing with them); writes a JSON result."""
    import torch

    from planner.profile import resolve_model
    from runtime import apply_plan

    torch.manual_seed(0)
    model, inputs, _, cfg, _ = resolve_model(args.spec, args.batch, args.seq, "fp32", "cpu")
    model.train()
    cfg = cfg.get("model_config", cfg) if isinstance(cfg, dict) else cfg
    data = _batches(args.spec, cfg, inputs, args.batch, args.seq, args.steps * args.k)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    handle = apply_plan(model, args.plan, optimizer=opt) if args.mode == "plan" else None
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    torch.manual_seed(123)                 # the same dropout masks in both runs
    for step in range(args.steps):
        for k in range(args.k):
            (model(**data[step * args.k + k]).loss / args.k).backward()
        if handle is not None:
            handle.clip_grad_norm_(0.5)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
    result = {}
    if handle is None:
        torch.save(model.state_dict(), args.ref)
    else:
        sd = model.state_dict()
        ref = torch.load(args.ref)
        result["max_diff"] = max((sd[k].float() - v.float()).abs().max().item()
                                 for k, v in ref.items())
        rep = handle.report()
        steps = rep.steps[1:] or rep.steps
        result.update(
            peak_rise=statistics.median(s.peak_gpu_bytes for s in steps),
            predicted_rise=rep.predicted_gpu_rise_bytes,
            static=rep.predicted_static_bytes,
            predicted_peak=rep.predicted["peak_gpu_bytes"],
            step_s=statistics.median(s.step_s for s in steps),
            predicted_step_s=rep.predicted["step_s"],
            peak_nvme=statistics.median(s.peak_nvme_bytes for s in steps),
            predicted_nvme=rep.predicted["peak_nvme_bytes"],
            hwm_reset=rep.hwm_reset)
        nvme = handle.plan.nvme_dir
        handle.remove()
        result["files_left"] = sorted(str(p) for p in Path(nvme).rglob("*") if p.is_file()) \
            if nvme and os.path.exists(nvme) else []
    Path(args.out).write_text(json.dumps(result))


def bench_model(name, spec, B, S, args, tmp: Path) -> dict:
    py = sys.executable
    prof, plan = tmp / f"{name}-profile.json", tmp / f"{name}-plan.json"
    _run([py, "-m", "planner.cli", "profile", spec, "--batch", str(B), "--seq", str(S),
          "--dtype", "fp32", "--device", "cpu", "--hardware", "cpu-host", "-o", str(prof)])
    layers = json.loads(prof.read_text())["layers"]
    static = sum(u["param_bytes"] + u["grad_bytes"] + u["optimizer_bytes"] for u in layers)
    budget = int(static / args.ratio)
    nvme_dir = tmp / f"{name}-nvme"
    cmd = [py, "-m", "planner.cli", "solve", str(prof), "--gpu-mem", str(budget),
           "--nvme-mem", "50G", "--micro-batches", str(args.micro_batches),
           "--nvme-dir", str(nvme_dir), "-o", str(plan)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode == 3:           # no plan fits: a row that says what plan solve said
        return dict(name=name, static=static, budget=budget, no_fit=r.stderr.strip())
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stderr[-2000:]}")
    p = json.loads(plan.read_text())
    off = sum(1 for d in p["layers"]
              if any(d[k] != "gpu" for k in ("weights", "grads", "optimizer")))
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    ref, out = tmp / f"{name}-ref.pt", tmp / f"{name}-out.json"
    for mode in ("plain", "plan"):
        _run([py, __file__, "--worker", mode, "--spec", spec, "--batch", str(B), "--seq", str(S),
              "--steps", str(args.steps), "--k", str(args.micro_batches), "--plan", str(plan),
              "--ref", str(ref), "--out", str(out)], env=env)
    res = json.loads(out.read_text())
    res.update(name=name, static=static, budget=budget, units_off=off, units=len(p["layers"]),
               origin=p["solver"].get("origin"), solve=r.stdout.strip().splitlines()[-1])
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ratio", type=float, default=4.2, help="static state / device budget")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--keep", help="keep the profiles, plans and results in this directory")
    # the worker's own arguments
    ap.add_argument("--worker", choices=["plain", "plan"])
    for a in ("--spec", "--plan", "--ref", "--out"):
        ap.add_argument(a)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--k", type=int)
    args = ap.parse_args(argv)
    if args.worker:
        args.mode = args.worker
        worker(args)
        return 0
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="tierplan-streaming-"))
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for name in args.models.split(","):
            spec, B, S = MODELS[name]
            print(f"{name}: profiling, solving, training plain and under the plan ...",
                  file=sys.stderr, flush=True)
            rows.append(bench_model(name, spec, B, S, args, tmp))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"Layer streaming on cpu-host: {args.steps} optimizer steps x {args.micro_batches} "
          f"micro-batches, budget = static state / {args.ratio:g}")
    hdr = (f"{'model':8} {'static':>9} {'budget':>9} {'units off':>9} {'diff':>8} "
           f"{'peak rise meas/pred':>21} {'ratio':>6} {'total/budget':>13} {'NVMe meas/pred':>17}"
           f" {'step meas/pred':>15} {'files':>5}")
    print(hdr)
    print("-" * len(hdr))
    ok = True
    for r in rows:
        if "no_fit" in r:
            ok = False
            print(f"{r['name']:8} {r['static'] / MiB:7.1f}Mi {r['budget'] / MiB:7.1f}Mi   "
                  f"no plan (plan solve exit 3): {r['no_fit'].splitlines()[-1]}")
            continue
        # the device total: the static state the plan keeps resident plus the measured rise
        resident = r["predicted_peak"] - r["predicted_rise"]
        meas_total = resident + r["peak_rise"]
        ratio = r["peak_rise"] / r["predicted_rise"] if r["predicted_rise"] else float("nan")
        good = (r["max_diff"] <= 1e-6 and meas_total <= r["budget"] and not r["files_left"]
                and abs(meas_total / r["predicted_peak"] - 1) <= 0.10)   # within 10%, both ways
        ok &= good
        print(f"{r['name']:8} {r['static'] / MiB:7.1f}Mi {r['budget'] / MiB:7.1f}Mi "
              f"{r['units_off']:>4}/{r['units']:<4} {r['max_diff']:8.1e} "
              f"{r['peak_rise'] / MiB:9.2f}/{r['predicted_rise'] / MiB:6.2f} MiB "
              f"{ratio:6.3f} {meas_total / r['budget']:13.3f} "
              f"{r['peak_nvme'] / MiB:8.1f}/{r['predicted_nvme'] / MiB:6.1f}Mi "
              f"{r['step_s']:6.2f}/{r['predicted_step_s']:6.2f}s {len(r['files_left']):>5}")
    print("\nplans:", *(f"  {r['name']}: {r['origin']}: {r['solve']}" for r in rows
                        if "no_fit" not in r), sep="\n")
    print("\nall checks hold" if ok else "\nSOME CHECK FAILED (see the table)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
