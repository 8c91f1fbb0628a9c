"""The overlapped executor against the step after the backward, on this CPU host: one plan
(the solver's, at the smallest budget that fits; the models and plans of
tests/test_overlap_runtime.py) trained STEPS optimizer steps of K micro-batches in each mode,
twice in alternation, in this process.

    python bench/overlap.py [gpt|llama|hf-llama]

Per run: the median over the steps after the first of the step time and of ``after_backward_s``
(the last backward's end to the step's end), the units whose optimizer work began before the
backward's compute ended per step (``overlapped_units``), and the plan's predicted step.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the repository, not bench/ (whose runtime.py would shadow the runtime package), and tests/
sys.path[:] = [str(ROOT), str(ROOT / "tests")] + [
    p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

import test_overlap_runtime as t  # noqa: E402

STEPS = 8


def main(name: str) -> None:
    for clip in ("none", "global"):
        with tempfile.TemporaryDirectory() as d:
            model0, data, plan = t._setup(name, clip, Path(d) / "nvme")
            data = (data * 4)[:STEPS * t.K]
            for mode in ("after-backward", "overlapped") * 2:
                model = copy.deepcopy(model0)
                opt, sched = t._optimizer(model)
                h = t.apply_plan(model, dataclasses.replace(plan, optimizer_overlap=mode),
                                 optimizer=opt)
                try:
                    t._train(model, data, opt, sched, clip, h, steps=STEPS)
                    steps = h.report().steps
                    step = statistics.median(s.step_s for s in steps[1:])
                    after = statistics.median(s.after_backward_s for s in steps[1:])
                    print(f"{name} clip {clip:6s} {mode:14s} step {step * 1e3:6.1f} ms, after "
                          f"the backward {after * 1e3:6.1f} ms, begun early "
                          f"{[s.overlapped_units for s in steps]}, predicted "
                          f"{plan.predicted.step_s * 1e3:.1f} ms", flush=True)
                finally:
                    h.remove()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "gpt")
