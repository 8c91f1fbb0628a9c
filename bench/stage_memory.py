"""Where a plan's predicted device peak and the measured one part, stage by stage (CPU host).

    python bench/stage_memory.py PLAN.json MODEL [--steps 3]

MODEL is what ``plan profile`` was given (``examples.hf_models:nanochat_default``, ``gpt-tiny``).
The plan trains STEPS optimizer steps of its K micro-batches (under ``handle.run_micro_batches``
for a layer-major plan, else the plain loop), dropout as the model has it, as it was profiled, with
``apply_plan(..., stage_peaks=True)``: the runtime resets the peak as each stage begins, after
the previous unit's weights are released, as the plan frees them (docs/runtime.md, "Peaks per
stage"). The table puts each stage's median over the steps after the first beside the
simulator's memory of the same stage, as the report compares them (on a CPU host less the
static state resident before a step). Run it with ``MALLOC_MMAP_THRESHOLD_=65536`` so that
freed tensors leave the RSS (docs/runtime.md, "Measuring memory on a CPU host"). Linux only;
a diagnostic, not a check.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/runtime.py would shadow the runtime package: import from the repository root
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import torch  # noqa: E402

from planner.formats import load_plan  # noqa: E402
from planner.plans.simulate import simulate  # noqa: E402
from planner.profile import resolve_model  # noqa: E402
from runtime import apply_plan  # noqa: E402

MiB = 2 ** 20


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("plan")
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=3)
    a = ap.parse_args(argv)
    plan = load_plan(a.plan)
    sim = simulate(plan)
    K, B, S = plan.micro_batches, plan.model["batch"], plan.model["seq"]
    layer_major = plan.micro_batch_order == "layer-major"
    torch.manual_seed(0)
    model, inputs, _, _, _ = resolve_model(a.model, B, S, "fp32", "cpu")
    # dropout stays as profiled: its masks are saved tensors, and without it an attention
    # layer may save far less (PyTorch's fused CPU attention keeps no probabilities)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = apply_plan(model, plan, optimizer=opt, stage_peaks=True)

    def loss(m, mb):
        out = m(**mb) if isinstance(mb, dict) else m(*mb)
        return out.loss / K
    try:
        for _ in range(a.steps):
            mbs = [inputs] * K
            if layer_major:
                handle.run_micro_batches(mbs, loss)
            else:
                for mb in mbs:
                    loss(model, mb).backward()
            opt.step()
            opt.zero_grad()
        rep = handle.report()
    finally:
        handle.remove()
    got = rep.stage_peaks()
    if got is None:
        print("no stage was measured (/proc/self/clear_refs not writable, or not Linux)")
        return 1
    print(f"plan {a.plan}: {plan.micro_batch_order}, K={K}; measured rise per step "
          f"{', '.join(f'{s.peak_gpu_bytes / MiB:.1f}' for s in rep.steps)} MiB, predicted "
          f"{rep.predicted_gpu_rise_bytes / MiB:.1f} MiB "
          f"(static {rep.predicted_static_bytes / MiB:.1f} MiB)")
    print(f"{'stage':>6} {'phase':9} {'unit':22} {'measured':>10} {'predicted':>10} {'pred-meas':>10}")
    for st in sim.stages:
        meas = got[st.stage]
        pred = rep.as_measured(st.memory["gpu"])
        m = f"{meas / MiB:10.2f}" if meas is not None else f"{'-':>10}"
        d = f"{(pred - meas) / MiB:10.2f}" if meas is not None else ""
        print(f"{st.stage:>6} {st.phase:9} {str(st.unit or ''):22} {m} {pred / MiB:10.2f} {d}")
    print(*rep.stage_summary(), sep="\n")
    # the lines above are the runtime's, from the figures in the plan file; a plan written by
    # an older planner is simulated here with today's model (the table's predicted column)
    top = max(sim.stages, key=lambda st: st.memory["gpu"])
    print(f"  simulated here: peak {rep.as_measured(top.memory['gpu']) / MiB:.2f} MiB in stage "
          f"{top.stage} ({top.phase} {top.unit or ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
