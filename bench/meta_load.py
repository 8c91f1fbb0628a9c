"""Filling a model built on the meta device from a safetensors checkpoint, straight into its
homes (runtime/checkpoint.py), against building it whole and loading the same file.

    python bench/meta_load.py                   # a 12-block GPT of ~150M parameters
    python bench/meta_load.py --d-model 512     # a smaller one

Three fresh processes (MALLOC_MMAP_THRESHOLD_=65536, so freed tensors leave the RSS):
  save   builds the model (seed 0) and writes ``model.safetensors``
  plain  builds it whole, loads the file with ``load_state_dict``: peak RSS rise (VmHWM)
  meta   builds it under ``meta_parameters()``, ``apply_plan(..., checkpoint=)`` under a plan
         that homes every block on NVMe (``plan solve --gpu-mem static/4``): peak RSS rise,
         then one training step, and the largest weight difference against ``plain`` after
         the same step
The table shows both peaks beside the model's weight bytes, its largest parameter tensor and the
weights the plan keeps on the device (what the meta load must hold at least). ``plain`` loads
through safetensors' own mmap, whose touched file pages count in its RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
MiB = 2 ** 20


def child(args) -> None:
    import torch

    from planner.models import build_model, make_inputs
    cfg = json.loads(args.cfg)
    out = {}
    if args.role == "save":
        from safetensors.torch import save_model
        torch.manual_seed(0)
        m = build_model(cfg, dtype="fp32")
        save_model(m, args.ck)
        out["weights"] = sum(p.numel() * p.element_size() for p in m.parameters())
        out["largest"] = max(p.numel() * p.element_size() for p in m.parameters())
    else:
        data = make_inputs(cfg, 1, args.seq, seed=1)
        import runtime  # noqa: F401 -- its import is not the load's memory
        from runtime.report import read_status, reset_hwm
        from safetensors.torch import load_model  # noqa: F401
        reset_hwm()
        base = read_status()["VmRSS"]
        if args.role == "plain":
            from safetensors.torch import load_model
            m = build_model(cfg, dtype="fp32")
            load_model(m, args.ck)
            out["rise"] = read_status()["VmHWM"] - base
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            handle = None
        else:
            from runtime import apply_plan, meta_parameters
            with meta_parameters():
                m = build_model(cfg, dtype="fp32")
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            handle = apply_plan(m, args.plan, optimizer=opt, checkpoint=args.ck,
                                nvme_dir=args.nvme)
            out["rise"] = read_status()["VmHWM"] - base
        m.train()
        torch.manual_seed(5)
        m(**data).loss.backward()
        opt.step()
        opt.zero_grad()
        torch.save({k: v.clone() for k, v in m.state_dict().items()}, args.out + ".pt")
        if handle is not None:
            handle.remove()
            out["files_left"] = sum(len(fs) for _, _, fs in os.walk(args.nvme))
    Path(args.out).write_text(json.dumps(out))


def _cli(py, env, *argv) -> None:
    r = subprocess.run([py, "-m", "planner.cli", *argv], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"plan {argv[0]} exited {r.returncode}: {r.stderr.strip()[-1000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d-model", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    for k in ("cfg", "ck", "plan", "nvme", "out"):
        ap.add_argument(f"--{k}", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role:
        child(args)
        return
    import torch

    from planner.models import load_config
    cfg = dict(load_config(str(ROOT / "bench/models/gpt-stream.yaml")), d_model=args.d_model,
               n_layers=args.layers, n_heads=max(1, args.d_model // 64),
               n_kv_heads=max(1, args.d_model // 64), d_ff=4 * args.d_model, dropout=0.0,
               name="gpt-metaload")
    py = sys.executable
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory(prefix="tierplan-metaload-") as tmp:
        t = Path(tmp)
        yaml_path = t / "model.yaml"
        import yaml
        yaml_path.write_text(yaml.safe_dump(cfg))
        common = ["--cfg", json.dumps(cfg), "--ck", str(t / "model.safetensors"),
                  "--seq", str(args.seq), "--plan", str(t / "plan.json"), "--nvme", str(t / "nvme")]

        def run(role):
            r = subprocess.run([py, __file__, "--role", role, *common, "--out", str(t / role)],
                               env=env, capture_output=True, text=True)
            if r.returncode:
                raise SystemExit(f"{role} failed:\n{r.stderr[-2000:]}")
            return json.loads((t / role).read_text())
        saved = run("save")
        prof = t / "profile.json"
        _cli(py, env, "profile", str(yaml_path), "--batch", "1", "--seq", str(args.seq),
             "--dtype", "fp32", "--device", "meta", "--hardware", "cpu-host", "-o", str(prof))
        static = sum(u["param_bytes"] + u["grad_bytes"] + u["optimizer_bytes"]
                     for u in json.loads(prof.read_text())["layers"])
        _cli(py, env, "solve", str(prof), "--gpu-mem", str(static // 4), "--nvme-mem", "50G",
             "--nvme-dir", str(t / "nvme"), "-o", str(t / "plan.json"))
        plan = json.loads((t / "plan.json").read_text())
        off = sum(1 for d in plan["layers"] if d.get("weights", "gpu") != "gpu")
        home = {d["name"]: d.get("weights", "gpu") for d in plan["layers"]}
        resident = sum(u["param_bytes"] for u in plan["units"] if home[u["name"]] == "gpu")
        plain, meta = run("plain"), run("meta")
        a, b = torch.load(t / "plain.pt"), torch.load(t / "meta.pt")
        diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"GPT d_model {args.d_model}, {args.layers} blocks, fp32; plan at --gpu-mem "
          f"static/4 with {off} of {len(plan['layers'])} units' weights on NVMe")
    print(f"{'weights':>10} {'largest tensor':>15} {'resident in plan':>17} "
          f"{'plain load rise':>16} {'meta+checkpoint rise':>21} {'diff after a step':>18} "
          f"{'files left':>10}")
    print(f"{saved['weights'] / MiB:9.1f}Mi {saved['largest'] / MiB:14.1f}Mi "
          f"{resident / MiB:16.1f}Mi {plain['rise'] / MiB:15.1f}Mi {meta['rise'] / MiB:20.1f}Mi "
          f"{diff:18.1e} {meta['files_left']:10d}")


if __name__ == "__main__":
    main()
