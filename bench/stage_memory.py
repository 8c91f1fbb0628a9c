"""Where a plan's predicted device peak and the measured one part, stage by stage (CPU host).

    python bench/stage_memory.py PLAN.json MODEL [--steps 3]

MODEL is what ``plan profile`` was given (``examples.hf_models:nanochat_default``, ``gpt-tiny``).
The plan trains STEPS optimizer steps of its K micro-batches (under ``handle.run_micro_batches``
for a layer-major plan, dropout off as bench/streaming.py does; else the plain loop), and at
the start of every stage the runtime's stage driver enters, the kernel's peak-RSS mark is
reset (``/proc/self/clear_refs``), so each stage's peak rise over the RSS before the step is
read on its own. The table puts the last step's figures beside the simulator's memory of the
same stage (less the static state resident before a step, as ``handle.report()`` counts the
rise). A transfer a stage issues and the next one waits for at its start lands in the next
stage's row (the mark is taken before the driver's wait). Run it with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors leave the RSS
(docs/runtime.md, "Measuring memory on a CPU host"). Linux only; a diagnostic, not a check.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# bench/runtime.py would shadow the runtime package: import from the repository root
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import torch  # noqa: E402

import runtime.stages as stages  # noqa: E402
from planner.formats import load_plan  # noqa: E402
from planner.plans.simulate import simulate  # noqa: E402
from planner.profile import resolve_model  # noqa: E402
from runtime import apply_plan  # noqa: E402
from runtime.report import read_status, reset_hwm  # noqa: E402

MiB = 2 ** 20


class StagePeaks:
    """Peak RSS rise per stage: the mark is reset as each stage begins and read as the next
    does (``mark``), over the RSS the step began with (``begin``)."""

    def __init__(self):
        self.base = 0
        self.current = None
        self.peaks: list = []

    def begin(self):
        self.peaks = []
        self.base = read_status()["VmRSS"]
        self.current = "start"
        reset_hwm()

    def mark(self, what):
        if self.current is not None:
            self.peaks.append((self.current, read_status()["VmHWM"] - self.base))
        reset_hwm()
        self.current = what


def _watch_stages(peaks: StagePeaks):
    """Wrap the stage driver's ``enter`` so that every stage it runs is marked."""
    enter = stages.StageDriver.enter

    def marked(self, stage):
        if self.ctx is None:
            return enter(self, stage)
        start = 0 if self.stage is None else self.stage + 1
        for s in range(start, min(stage, self.last) + 1):
            peaks.mark(s)
            enter(self, s)
        return None
    stages.StageDriver.enter = marked


def _dropout_off(model):
    """bench/streaming.py's: every dropout at 0, as its layer-major runs train."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_streaming", ROOT / "bench/streaming.py")
    streaming = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(streaming)
    streaming._dropout_off(model)


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
    if layer_major:
        _dropout_off(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = apply_plan(model, plan, optimizer=opt)
    peaks = StagePeaks()
    _watch_stages(peaks)

    def loss(m, mb):
        out = m(**mb) if isinstance(mb, dict) else m(*mb)
        return out.loss / K
    try:
        for _ in range(a.steps):
            mbs = [inputs] * K
            peaks.begin()
            if layer_major:
                handle.run_micro_batches(mbs, loss)
            else:
                for mb in mbs:
                    loss(model, mb).backward()
            peaks.mark("optimizer step")
            opt.step()
            opt.zero_grad()
            peaks.mark(None)
        rep = handle.report()
    finally:
        handle.remove()
    static = rep.predicted_static_bytes
    simulated = {st.stage: st for st in sim.stages}
    print(f"plan {a.plan}: {plan.micro_batch_order}, K={K}; measured rise per step "
          f"{', '.join(f'{s.peak_gpu_bytes / MiB:.1f}' for s in rep.steps)} MiB, predicted "
          f"{rep.predicted_gpu_rise_bytes / MiB:.1f} MiB (static {static / MiB:.1f} MiB)")
    print(f"{'stage':>6} {'phase':9} {'unit':22} {'measured':>10} {'predicted':>10} {'pred-meas':>10}")
    rows = []
    for what, rise in peaks.peaks:
        st = simulated.get(what) if isinstance(what, int) else None
        if st is None:
            print(f"{str(what):>6} {'':9} {'':22} {rise / MiB:10.2f}")
            continue
        pred = st.memory["gpu"] - static
        rows.append((what, rise, pred))
        print(f"{what:>6} {st.phase:9} {str(st.unit or ''):22} {rise / MiB:10.2f} "
              f"{pred / MiB:10.2f} {(pred - rise) / MiB:10.2f}")
    if rows:
        m, p = max(rows, key=lambda r: r[1]), max(rows, key=lambda r: r[2])
        print(f"measured peak in stage {m[0]} ({m[1] / MiB:.2f} MiB), predicted peak in stage "
              f"{p[0]} ({p[2] / MiB:.2f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
