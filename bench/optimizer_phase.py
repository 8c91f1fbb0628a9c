"""The optimizer phase pipelined (a plan's ``optimizer_depth`` 3) against one unit after the
other (the same plan at depth 1), side by side on this host.

    python bench/optimizer_phase.py                          # built-in GPT, static / 4.2
    python bench/optimizer_phase.py --model examples.hf_models:nanochat_default --batch 1 \\
        --seq 128

One plan (``plan profile`` on this device, ``plan solve --gpu-mem static/RATIO
--micro-batches 2``) is run in fresh processes, alternately as written with depth 3 and with
depth 1 (only ``optimizer_depth`` differs: the same homes, the same schedule of the passes),
``--pairs`` times each. Each process trains ``--steps`` optimizer steps; its figure is the
median, over the steps after the first, of the seconds from the last backward's end to the
step's end (``StepRecord.after_backward_s``: the optimizer phase). The table gives the median
of each column, the median of the pair-by-pair ratios, and the simulator's optimizer phase of
the plan at each depth; the weights after the steps are compared between the two runs of each
pair (the pipelined phase moves only I/O: they must be equal).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]


def worker(args) -> None:
    import torch

    from planner.models import make_inputs
    from planner.profile import resolve_model
    from runtime import apply_plan
    torch.manual_seed(0)
    model, inputs, _, cfg, _ = resolve_model(args.model, args.batch, args.seq, "fp32", "cpu")
    model.train()
    cfg = cfg.get("model_config", cfg) if isinstance(cfg, dict) else cfg
    K = 2
    if args.model.count(":"):
        data = [inputs] * (args.steps * K)
    else:
        data = [make_inputs(cfg, args.batch, args.seq, seed=k) for k in range(args.steps * K)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    handle = apply_plan(model, args.plan, optimizer=opt)
    torch.manual_seed(123)
    for step in range(args.steps):
        for mb in data[step * K:(step + 1) * K]:
            out = model(**mb)
            (out.loss / K).backward()
        opt.step()
        opt.zero_grad()
    rep = handle.report()
    phase = statistics.median(s.after_backward_s for s in rep.steps[1:])
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    handle.remove()
    torch.save(sd, args.weights)
    Path(args.out).write_text(json.dumps({"phase_s": phase}))


def _run(cmd):
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stderr[-2000:]}")
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "bench/models/gpt-stream.yaml"))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--ratio", type=float, default=4.2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--worker", action="store_true")
    for a in ("--plan", "--out", "--weights"):
        ap.add_argument(a)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    import torch

    from planner.plans.load import load_plan
    from planner.plans import save_plan
    from planner.plans.simulate import simulate
    py = sys.executable
    tmp = Path(tempfile.mkdtemp(prefix="tierplan-optphase-"))
    try:
        prof = tmp / "profile.json"
        _run([py, "-m", "planner.cli", "profile", args.model, "--batch", str(args.batch),
              "--seq", str(args.seq), "--dtype", "fp32", "--device", "cpu", "--hardware",
              "cpu-host", "-o", str(prof)])
        layers = json.loads(prof.read_text())["layers"]
        static = sum(u["param_bytes"] + u["grad_bytes"] + u["optimizer_bytes"] for u in layers)
        plan3 = tmp / "plan-depth3.json"
        _run([py, "-m", "planner.cli", "solve", str(prof), "--gpu-mem",
              str(int(static / args.ratio)), "--nvme-mem", "50G", "--micro-batches", "2",
              "--optimizer-overlap", "off", "--nvme-dir", str(tmp / "nvme"), "-o", str(plan3)])
        base = load_plan(plan3)
        plans = {}
        for depth in (3, 1):
            p = dataclasses.replace(base, optimizer_depth=depth)
            plans[depth] = (tmp / f"plan-d{depth}.json", simulate(p).optimizer_s)
            save_plan(p, plans[depth][0])
        got = {3: [], 1: []}
        diffs = []
        for n in range(args.pairs):
            w = {}
            for depth in ((3, 1) if n % 2 == 0 else (1, 3)):
                out, wt = tmp / f"out-{n}-{depth}.json", tmp / f"w-{n}-{depth}.pt"
                _run([py, __file__, "--worker", "--model", args.model, "--batch",
                      str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
                      "--plan", str(plans[depth][0]), "--out", str(out), "--weights", str(wt)])
                got[depth].append(json.loads(out.read_text())["phase_s"])
                w[depth] = torch.load(wt)
            diffs.append(max((w[3][k].float() - w[1][k].float()).abs().max().item()
                             for k in w[3]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ratios = [a / b for a, b in zip(got[3], got[1])]
    print(f"optimizer phase of one plan ({Path(args.model).name} b{args.batch} s{args.seq}, "
          f"budget static/{args.ratio:g}, "
          f"{sum(not d.home.resident for d in base.layers)} units homed off the device), "
          f"{args.pairs} alternating pairs, {args.steps} steps each")
    print(f"{'depth':>5} {'measured (median)':>18} {'simulated':>10} {'runs':>30}")
    for depth in (3, 1):
        runs = " ".join(f"{x:.3f}" for x in got[depth])
        print(f"{depth:>5} {statistics.median(got[depth]):17.3f}s {plans[depth][1]:9.3f}s "
              f"{runs:>30}")
    print(f"pipelined / serial, pair by pair: median {statistics.median(ratios):.3f} "
          f"(lo {min(ratios):.3f}, hi {max(ratios):.3f}); largest weight difference between "
          f"the two runs of a pair {max(diffs):.1e}")
    return 0 if max(diffs) == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
