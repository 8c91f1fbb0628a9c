"""The small plans in ``plans/golden/``: built here from synthetic profiles (no torch, no solver),
compared with the files by ``tests/test_simulate.py``. Rewrite them when the plan format or the
cost model changes: ``python tests/golden.py``."""
from __future__ import annotations

import sys
from pathlib import Path

from planner.formats import Budgets, Plan, SolverRecord
from planner.plans import make_plan, save_plan

def golden_plans() -> dict[str, Plan]:
    """The small plans in ``plans/golden/``, from synthetic profiles (no torch, no solver).

    Together they exercise every event kind: a segment recompute, checkpoints on the host and
    on NVMe, activations offloaded to the host and to NVMe, streamed weights, gradients and
    optimizer state on every tier, and NVMe on unified memory with two micro-batches.
    """
    from planner.costmodel.baselines import baseline_layers
    from planner.formats import Activation as Act, Home, LayerDecision as LD, Tier as T
    from planner.hardware import load_hardware
    from synthetic import uniform_profile

    h200, cpu = load_hardware("h200"), load_hardware("cpu-host")
    gib = 1024**3
    out = {}
    p = uniform_profile(4, h200, name="golden-sqrt")
    out["h200-sqrt"] = make_plan(p, None, h200, Budgets(64 * gib), "sqrt",
                                 baseline_layers("sqrt", p.layers, h200))
    p = uniform_profile(6, h200, jitter=0.1, seed=3, name="golden-mixed")
    stream = Home(T.CPU, T.CPU, T.NVME, T.CPU)
    layers = [LD("embedding", Act.KEEP, home=Home(T.GPU, T.GPU, T.CPU, T.CPU)),
              LD("blocks.0", Act.RECOMPUTE, T.CPU), LD("blocks.1", Act.RECOMPUTE, T.NONE),
              LD("blocks.2", Act.CPU, home=stream), LD("blocks.3", Act.NVME),
              LD("blocks.4", Act.RECOMPUTE, T.NVME, home=Home(T.NVME, T.CPU, T.NVME, T.CPU)),
              LD("blocks.5", Act.KEEP, home=Home(T.GPU, T.CPU, T.CPU, T.CPU)),
              LD("head", Act.KEEP)]
    out["h200-mixed"] = make_plan(p, None, h200, Budgets(64 * gib, 64 * gib, 64 * gib), "optimal",
                                  layers, solver=SolverRecord(name="hand", status="golden",
                                                              origin="hand"),
                                  nvme_dir="/tmp/tierplan-golden")
    p = uniform_profile(3, cpu, name="golden-cpu-host")
    disk = Home(T.NVME, T.NVME, T.NVME, T.GPU)
    layers = [LD(u.name, d.activation, d.checkpoint, disk if u.kind == "block" else d.home)
              for u, d in zip(p.layers, baseline_layers("offload-all", p.layers, cpu))]
    out["cpu-host-streaming"] = make_plan(
        p, None, cpu, Budgets(20 * gib, 0, 16 * gib), "offload-all", layers,
        nvme_dir="/tmp/tierplan-golden", micro_batches=2)
    return out


def write_golden_plans(folder=None) -> list[Path]:
    """(Re)write ``plans/golden/*.json`` (or ``folder``)."""
    from planner import PLANS_DIR
    folder = Path(folder) if folder else PLANS_DIR / "golden"
    return [save_plan(plan, folder / f"{name}.json") for name, plan in golden_plans().items()]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    for path in write_golden_plans(sys.argv[1] if len(sys.argv) > 1 else None):
        print(path)
