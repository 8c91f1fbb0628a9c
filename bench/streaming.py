"""Layer streaming on this CPU host, end to end: models whose static state (weights, gradients,
AdamW state) is at least RATIO times the device budget are profiled, solved and trained for a
few optimizer steps under the plan, beside plain PyTorch, for each schedule family.

    python bench/streaming.py                       # built-in GPT and LLaMA; GPT-2 as
                                                    # GPT2Config() gives it (124M, tied
                                                    # embedding) and NanoChat as
                                                    # NanoChatConfig() does (257M), the
                                                    # latter also with attention dropout
    python bench/streaming.py --models gpt          # one of them
    python bench/streaming.py --families batch-major,overlap-none
    python bench/streaming.py --device cuda --hardware this-gpu.yaml   # on a GPU (bench/gpu.sh)

Families (``--families``, default all eight; each solved with the flags shown, the loop as
said):

  batch-major     --optimizer-overlap off: K whole passes, the optimizer after the backward;
                  the loop clips at 0.5 through handle.clip_grad_norm_
  layer-major     --micro-batch-order layer-major --optimizer-overlap off: every micro-batch
                  through a unit before the next; the loop runs them through
                  handle.run_micro_batches and clips; dropout is off in both runs (its
                  masks are drawn in the order the micro-batches take turns, not the plain
                  loop's: docs/runtime.md, "Layer-major plans"), so its plan is solved on
                  the profile of the model with dropout off (a copy of the model file with
                  its rates at 0, or NODROP's factory)
  overlap-none    --optimizer-overlap on --clip none: a unit's step may run beside the
                  backward of the units before it; the loop does not clip (neither does plain)
  overlap-global  --optimizer-overlap on --clip global: only state reads move into the
                  backward; the loop clips
  paced           --optimizer-overlap paced --clip none --micro-batches 1: each unit's step
                  in the three stages after its backward, the backward waiting for it (K = 1:
                  batch-major paced needs one pass per step); written after-backward where
                  paced is no faster at the budget
  lm-overlap-none, lm-overlap-global, lm-paced
                  overlap-none, overlap-global and paced with --micro-batch-order
                  layer-major (K micro-batches a step, the loop and dropout as layer-major's)

With ``on`` the plan runs the overlapped schedule even where it is not the fastest (``auto``
labels a plan overlapped only where that is faster: docs/streaming.md); where the overlapped
schedule of no plan found fits the budget, plan solve exits 3 and the row says so. The
"sched" column shows what the plan file says.

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
  buffered   (``--buffered-too``) the step time of a fourth run of the plan whose files go
             through the page cache (``TIERPLAN_NVME_IO=buffered``), beside its ratio to the
             prediction: what the runtime measured before its reads and writes went to the
             drive with O_DIRECT (docs/runtime.md, "Files")

The plain run computes with the intra-op threads the plan does (the plan's
``executor.compute_threads``, its profile's: every core but one by default, which the runtime
sets on a CPU device; docs/runtime.md, "Compute threads on a CPU host"): torch's float sums
split by thread count, so plain PyTorch at 1 and 2 threads differ (2e-7 in one backward).
The plain and plan runs whose weights are compared run with MKL_CBWR=AUTO,STRICT: without
it MKL's matrix products may round differently where a buffer's alignment differs, and a plain
run then differs from another plain run (3e-6 after 3 steps, seen once in five).

On a CPU device the memory runs (plain and plan) use MALLOC_MMAP_THRESHOLD_=65536, so that
glibc maps every tensor of 64 KiB or more on its own and returns it when freed: the RSS then
follows the bytes that are alive, not what the heap kept from earlier steps (runtime.md,
"Measuring memory on a CPU host"). That setting makes every such allocation a fresh mapping
whose pages fault in on first touch: on this host it doubles a plain step (156 ms -> 333 ms for
the built-in GPT), so the step time is measured in a third run of the plan without it
("step meas/pred", with the time the runtime waited on transfers; ``--timing-steps`` steps,
default 6, the median of those after the first). On CUDA one run gives both (the allocator's
peak is the device figure).

``--calibrate`` (CPU): ``plan calibrate`` of the profile from that timing run's report, the
plan solved again on the calibrated profile with the same flags, and a timing run of it: the
"calibrated meas/pred" column (docs/planning-loop.md).
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
FAMILIES = {
    # name: (plan solve flags, the loop clips, the loop runs micro-batches through the handle,
    #        micro-batches per step: None for --micro-batches)
    "batch-major": (["--optimizer-overlap", "off"], True, False, None),
    "layer-major": (["--micro-batch-order", "layer-major", "--optimizer-overlap", "off"],
                    True, True, None),
    "overlap-none": (["--optimizer-overlap", "on", "--clip", "none"], False, False, None),
    "overlap-global": (["--optimizer-overlap", "on", "--clip", "global"], True, False, None),
    "paced": (["--optimizer-overlap", "paced", "--clip", "none"], False, False, 1),
    "lm-overlap-none": (["--micro-batch-order", "layer-major", "--optimizer-overlap", "on",
                         "--clip", "none"], False, True, None),
    "lm-overlap-global": (["--micro-batch-order", "layer-major", "--optimizer-overlap", "on",
                           "--clip", "global"], True, True, None),
    "lm-paced": (["--micro-batch-order", "layer-major", "--optimizer-overlap", "paced",
                  "--clip", "none"], False, True, None),
}


OVERLAP_TAG = {"overlapped": "ovl", "paced": "pac"}    # the "sched" column's middle part


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


def _dropout_off(model) -> None:
    """Every dropout of the model at p = 0: modules and the float rates attention layers keep
    (the built-in models' ``dropout``, Hugging Face's ``attention_dropout``)."""
    import torch
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for attr in ("dropout", "attention_dropout", "dropout_p"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)


def worker(args) -> None:
    """One training run in this process: plainly (saving the weights) or under the plan
    (comparing with them); writes a JSON result."""
    import torch

    from planner.profile import resolve_model
    from runtime import apply_plan

    if args.mode == "plain":
        # plain PyTorch at the intra-op threads the plan computes with (its profile's; the
        # runtime sets them): a float sum splits by thread count, so a plain run at another
        # count differs from itself at this one (2e-7 in one backward of the built-in GPT)
        n = (json.loads(Path(args.plan).read_text()).get("executor") or {}).get("compute_threads")
        if n and args.device == "cpu":
            torch.set_num_threads(int(n))
    torch.manual_seed(0)
    model, inputs, _, cfg, _ = resolve_model(args.spec, args.batch, args.seq, "fp32", "cpu")
    model.to(args.device)
    if args.through_handle:
        _dropout_off(model)
    model.train()
    cfg = cfg.get("model_config", cfg) if isinstance(cfg, dict) else cfg
    data = [{k: v.to(args.device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}
            for d in _batches(args.spec, cfg, inputs, args.batch, args.seq,
                              args.steps * args.k)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    # the memory run also measures the peak of every stage (it resets the peak as each stage
    # begins: not in the timing run)
    handle = apply_plan(model, args.plan, optimizer=opt, stage_peaks=args.mode == "plan") \
        if args.mode != "plain" else None
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    torch.manual_seed(123)                 # the same dropout masks in both runs
    for step in range(args.steps):
        mbs = data[step * args.k:(step + 1) * args.k]
        if handle is not None and args.through_handle:
            handle.run_micro_batches(mbs, lambda m, mb: m(**mb).loss / args.k)
        else:
            for mb in mbs:
                (model(**mb).loss / args.k).backward()
        if args.clip and handle is not None:
            handle.clip_grad_norm_(0.5)
        elif args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        opt.zero_grad()
    result = {}
    if handle is None:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.ref)
    elif args.mode == "time":
        rep = handle.report()
        if args.report_out:
            rep.save(args.report_out)
        steps = rep.steps[1:] or rep.steps
        result.update(step_s=statistics.median(s.step_s for s in steps),
                      stall_s=statistics.median(s.stall_s for s in steps),
                      predicted_step_s=rep.predicted["step_s"])
        handle.remove()
    else:
        sd = {k: v.cpu() for k, v in model.state_dict().items()}
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
            stall_s=statistics.median(s.stall_s for s in steps),
            predicted_step_s=rep.predicted["step_s"],
            peak_nvme=statistics.median(s.peak_nvme_bytes for s in steps),
            predicted_nvme=rep.predicted["peak_nvme_bytes"],
            hwm_reset=rep.hwm_reset, stages=[x.strip() for x in rep.stage_summary()])
        nvme = handle.plan.nvme_dir
        handle.remove()
        result["files_left"] = sorted(str(p) for p in Path(nvme).rglob("*") if p.is_file()) \
            if nvme and os.path.exists(nvme) else []
    Path(args.out).write_text(json.dumps(result))


# a factory whose model with its dropout off is another factory's (the layer-major loop
# trains with dropout off, so its plan is solved on that model's profile)
NODROP = {"examples.hf_models:nanochat_default_dropout": "examples.hf_models:nanochat_default"}


def nodrop_spec(name: str, spec: str, tmp: Path) -> str:
    """The spec of the model as the layer-major loop trains it, every dropout at 0: a copy of
    a model file with its dropout rates at 0, a factory's named in NODROP, else the spec
    itself (the worker sets its rates to 0 after building it; the profile keeps them)."""
    if spec in NODROP:
        return NODROP[spec]
    if not spec.endswith((".yaml", ".yml")):
        return spec
    import yaml
    cfg = yaml.safe_load(Path(spec).read_text())
    rates = [k for k, v in cfg.items() if ("dropout" in k or "pdrop" in k) and v]
    if not rates:
        return spec
    out = tmp / f"{name}-nodrop.yaml"
    out.write_text(yaml.safe_dump({**cfg, **{k: 0.0 for k in rates}}, sort_keys=False))
    return str(out)


def profile_model(name, spec, B, S, args, tmp: Path) -> tuple[Path, int]:
    """``plan profile`` on this device; (profile path, static state bytes)."""
    prof = tmp / f"{name}-profile.json"
    _run([sys.executable, "-m", "planner.cli", "profile", spec, "--batch", str(B), "--seq",
          str(S), "--dtype", "fp32", "--device", args.device, "--hardware", args.hardware,
          "-o", str(prof)])
    layers = json.loads(prof.read_text())["layers"]
    return prof, sum(u["param_bytes"] + u["grad_bytes"] + u["optimizer_bytes"] for u in layers)


def bench_family(name, spec, B, S, family, prof: Path, static: int, args, tmp: Path) -> dict:
    py = sys.executable
    flags, clip, through, k = FAMILIES[family]
    k = k or args.micro_batches
    tag = f"{name}-{family}"
    plan = tmp / f"{tag}-plan.json"
    budget = int(static / args.ratio)
    nvme_dir = tmp / f"{tag}-nvme"
    cmd = [py, "-m", "planner.cli", "solve", str(prof), "--gpu-mem", str(budget),
           "--nvme-mem", "50G", "--micro-batches", str(k),
           "--nvme-dir", str(nvme_dir), *flags, "-o", str(plan)]
    if args.cpu_mem:
        cmd += ["--cpu-mem", args.cpu_mem]
    row = dict(name=name, family=family, static=static, budget=budget)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if r.returncode == 3:           # no plan fits: a row that says what plan solve said
        return dict(row, no_fit=r.stderr.strip())
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} exited {r.returncode}:\n{r.stderr[-2000:]}")
    p = json.loads(plan.read_text())
    off = sum(1 for d in p["layers"]
              if any(d[k] != "gpu" for k in ("weights", "grads", "optimizer")))
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    timing_env = dict(os.environ, PYTHONPATH=path)
    timing_env.pop("MALLOC_MMAP_THRESHOLD_", None)
    memory_env = dict(timing_env, MALLOC_MMAP_THRESHOLD_="65536") if args.device == "cpu" \
        else timing_env
    # the runs whose weights are compared: MKL's matrix products in strict conditional
    # numerical reproducibility, whose bits do not depend on where a tensor lies in memory (a
    # plain run once differed from four others by 3e-6: its buffers' alignment)
    memory_env = dict(memory_env, MKL_CBWR="AUTO,STRICT")
    ref, out, tout = tmp / f"{tag}-ref.pt", tmp / f"{tag}-out.json", tmp / f"{tag}-time.json"
    common = ["--spec", spec, "--batch", str(B), "--seq", str(S), "--steps", str(args.steps),
              "--k", str(k), "--plan", str(plan), "--ref", str(ref),
              "--device", args.device] + (["--clip"] if clip else []) + \
        (["--through-handle"] if through else [])
    runs = [("plain", memory_env, out), ("plan", memory_env, out)]
    timing = ["--steps", str(args.timing_steps)]
    rout = tmp / f"{tag}-report.json"
    if args.device == "cpu":
        runs.append(("time", timing_env, tout, timing + ["--report-out", str(rout)]))
    bout = tmp / f"{tag}-buffered.json"
    if args.buffered_too:             # the same timing run, its files through the page cache
        runs.append(("time", dict(timing_env, TIERPLAN_NVME_IO="buffered"), bout, timing))
    for mode, env, dest, *more in runs:
        _run([py, __file__, "--worker", mode, *common, "--out", str(dest), *(more[0] if more
                                                                            else [])], env=env)
    res = json.loads(out.read_text())
    if args.device == "cpu":          # the step time from the run without the mmap threshold
        res.update(json.loads(tout.read_text()))
    if args.calibrate and args.device == "cpu":
        res.update(_calibrated(prof, rout, cmd, plan, tag, common, timing, timing_env, tmp))
    if args.buffered_too:
        res["buffered_step_s"] = json.loads(bout.read_text())["step_s"]
    sched = f"{p.get('micro_batch_order', 'batch-major')[:5]}/" \
            f"{OVERLAP_TAG.get(p.get('optimizer_overlap'), 'aft')}/" \
            f"{p.get('clip', 'global')[:4]}"
    ahead = int(p.get("optimizer_prefetch_bytes") or 0)
    res.update(row, units_off=off, units=len(p["layers"]), sched=sched,
               origin=p["solver"].get("origin"), solve=r.stdout.strip().splitlines()[-1]
               + (f"; state read ahead {ahead / MiB:.3f} MiB" if ahead else ""))
    return res


def _calibrated(prof, report, cmd, plan, tag, common, timing, env, tmp: Path) -> dict:
    """``--calibrate``: the profile calibrated from the timing run's report (plan calibrate),
    the plan solved again on it with the same flags, and a timing run of that plan: its
    measured and predicted step (``cal_step_s``, ``cal_predicted_s``), or why there is none."""
    py = sys.executable
    cal, plan2 = tmp / f"{tag}-calibrated.json", tmp / f"{tag}-calibrated-plan.json"
    _run([py, "-m", "planner.cli", "calibrate", str(prof), "--report", str(report), "-o",
          str(cal)])
    solve = [str(cal) if str(x) == str(prof) else (str(plan2) if str(x) == str(plan) else x)
             for x in cmd]
    r = subprocess.run(solve, cwd=ROOT, capture_output=True, text=True)
    if r.returncode != 0:
        return {"cal_error": f"plan solve exit {r.returncode}: {r.stderr.strip()[-200:]}"}
    out = tmp / f"{tag}-calibrated-time.json"
    args2 = [str(plan2) if str(x) == str(plan) else x for x in common]
    _run([py, __file__, "--worker", "time", *args2, "--out", str(out), *timing], env=env)
    t = json.loads(out.read_text())
    return {"cal_step_s": t["step_s"], "cal_predicted_s": t["predicted_step_s"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--ratio", type=float, default=4.2, help="static state / device budget")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--hardware", default="cpu-host",
                    help="hardware spec for profile and solve (cpu-host on a CPU; on a GPU the "
                         "file 'plan hardware' wrote)")
    ap.add_argument("--cpu-mem", help="host memory budget for plan solve (a GPU's host)")
    ap.add_argument("--buffered-too", action="store_true",
                    help="time each plan a second time with its files through the page cache "
                         "(TIERPLAN_NVME_IO=buffered), as the runtime wrote them before it "
                         "used O_DIRECT: the 'buffered' column")
    ap.add_argument("--timing-steps", type=int, default=6,
                    help="optimizer steps of each timing run (its step time is the median of "
                         "those after the first)")
    ap.add_argument("--calibrate", action="store_true",
                    help="also calibrate the profile from the timing run's report (plan "
                         "calibrate), solve again on it and time that plan: the 'calibrated' "
                         "column")
    ap.add_argument("--keep", help="keep the profiles, plans and results in this directory")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    # the worker's own arguments
    ap.add_argument("--worker", choices=["plain", "plan", "time"])
    for a in ("--spec", "--plan", "--ref", "--out"):
        ap.add_argument(a)
    ap.add_argument("--batch", type=int)
    ap.add_argument("--seq", type=int)
    ap.add_argument("--k", type=int)
    ap.add_argument("--clip", action="store_true")
    ap.add_argument("--through-handle", action="store_true")
    ap.add_argument("--report-out")
    args = ap.parse_args(argv)
    if args.worker:
        args.mode = args.worker
        worker(args)
        return 0
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        raise SystemExit(f"--families {unknown[0]!r}: use some of {', '.join(FAMILIES)}")
    tmp = Path(args.keep or tempfile.mkdtemp(prefix="tierplan-streaming-"))
    tmp.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        for name in args.models.split(","):
            spec, B, S = MODELS[name]
            profiles = {}
            for fam in args.families.split(","):
                # a loop through the handle trains with dropout off: its plan is solved on the
                # profile of that model (a profile with dropout counts its masks' bytes)
                sp = nodrop_spec(name, spec, tmp) if FAMILIES[fam][2] else spec
                if sp not in profiles:
                    profiles[sp] = profile_model(name if sp == spec else f"{name}-nodrop", sp,
                                                 B, S, args, tmp)
                print(f"{name} {fam}: solving, training plain and under the plan ...",
                      file=sys.stderr, flush=True)
                rows.append(bench_family(name, sp, B, S, fam, *profiles[sp], args, tmp))
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"Layer streaming on {args.hardware} ({args.device}): {args.steps} optimizer steps x "
          f"{args.micro_batches} micro-batches (paced: 1), budget = static state / "
          f"{args.ratio:g}")
    hdr = (f"{'model':11} {'family':14} {'sched':14} {'static':>9} {'budget':>9} {'off':>5} "
           f"{'diff':>8} {'peak rise meas/pred':>21} {'ratio':>6} {'total/budget':>13} "
           f"{'NVMe meas/pred':>17} {'step meas/pred':>15} {'ratio':>6} {'waited':>7} "
           f"{'files':>5}" + (f" {'buffered':>8} {'ratio':>6}" if args.buffered_too else "")
           + (f" {'calibrated meas/pred':>20} {'ratio':>6}" if args.calibrate else ""))
    print(hdr)
    print("-" * len(hdr))
    ok = True
    for r in rows:
        if "no_fit" in r:
            ok = False
            print(f"{r['name']:11} {r['family']:14} {'-':14} {r['static'] / MiB:7.1f}Mi "
                  f"{r['budget'] / MiB:7.1f}Mi no plan (plan solve exit 3): "
                  f"{r['no_fit'].splitlines()[-1]}")
            continue
        # the device total: the static state the plan keeps resident plus the measured rise
        resident = r["predicted_peak"] - r["predicted_rise"]
        meas_total = resident + r["peak_rise"]
        ratio = r["peak_rise"] / r["predicted_rise"] if r["predicted_rise"] else float("nan")
        good = (r["max_diff"] <= 1e-6 and meas_total <= r["budget"] and not r["files_left"]
                and abs(meas_total / r["predicted_peak"] - 1) <= 0.10)   # within 10%, both ways
        ok &= good
        print(f"{r['name']:11} {r['family']:14} {r['sched']:14} {r['static'] / MiB:7.1f}Mi "
              f"{r['budget'] / MiB:7.1f}Mi {r['units_off']:>2}/{r['units']:<2} "
              f"{r['max_diff']:8.1e} "
              f"{r['peak_rise'] / MiB:9.2f}/{r['predicted_rise'] / MiB:6.2f} MiB "
              f"{ratio:6.3f} {meas_total / r['budget']:13.3f} "
              f"{r['peak_nvme'] / MiB:8.1f}/{r['predicted_nvme'] / MiB:6.1f}Mi "
              f"{r['step_s']:6.2f}/{r['predicted_step_s']:6.2f}s "
              f"{r['step_s'] / r['predicted_step_s']:6.2f} {r['stall_s'] * 1e3:5.0f}ms "
              f"{len(r['files_left']):>5}" + (
                  f" {r['buffered_step_s']:7.2f}s {r['buffered_step_s'] / r['predicted_step_s']:6.2f}"
                  if args.buffered_too else "") + (_cal_cells(r) if args.calibrate else ""))
    for r in rows:
        if r.get("cal_error"):
            print(f"  {r['name']} {r['family']} calibrated: {r['cal_error']}")
    print("\nplans:", *(f"  {r['name']} {r['family']}: {r['origin']}: {r['solve']}" for r in rows
                        if "no_fit" not in r), sep="\n")
    print("\nwhere the device peak was (the memory run; docs/runtime.md, \"Peaks per stage\"):",
          *(f"  {r['name']} {r['family']}: " + "; ".join(r.get("stages") or ["not measured"])
            for r in rows if "no_fit" not in r), sep="\n")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print("\nall checks hold" if ok else "\nSOME CHECK FAILED (see the table)")
    return 0 if ok else 1


def _cal_cells(r: dict) -> str:
    if "cal_step_s" not in r:
        return f" {'-':>20} {'-':>6}"
    return (f" {r['cal_step_s']:12.2f}/{r['cal_predicted_s']:6.2f}s "
            f"{r['cal_step_s'] / r['cal_predicted_s']:6.2f}")


if __name__ == "__main__":
    sys.exit(main())
