"""``bench/bound.py``'s lower bound on one optimizer step holds below every plan the planner
writes: a plan under it would mean the bound assumes too much of the hardware, or the cost
model prices a schedule faster than any exact one can run."""
import importlib.util
import random
import sys
from pathlib import Path

import pytest

from planner.formats import Budgets
from planner.hardware import load_hardware
from planner.solve import solve_profile
from synthetic import random_profile, uniform_profile

ROOT = Path(__file__).resolve().parents[1]


def _bound_module():
    spec = importlib.util.spec_from_file_location("tierplan_bench_bound", ROOT / "bench" / "bound.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("seed", range(8))
def test_no_plan_is_faster_than_the_independent_bound(seed, tmp_path):
    pytest.importorskip("highspy")
    bound = _bound_module()
    rng = random.Random(seed)
    hw = load_hardware(("a100-80g", "rtx4090", "h200", "cpu-host")[seed % 4])
    prof = random_profile(seed, hw, n_blocks=rng.randint(3, 6))
    static = sum(u.static_bytes for u in prof.layers)
    acts = sum(u.saved_bytes for u in prof.layers)
    gpu = int((static + acts) * rng.uniform(0.35, 0.9))
    cpu = 0 if hw.unified_memory else int(static * rng.uniform(0.3, 2.0))
    nvme = 10**13
    K = rng.choice([1, 2])
    out = solve_profile(prof, None, hw, Budgets(gpu, cpu, nvme), time_limit=30,
                        micro_batches=K, nvme_dir=str(tmp_path), clip="none",
                        micro_batch_order="auto")
    lower = bound.bound_of(prof.layers, hw, gpu, min(cpu, hw.pinned_limit) if cpu else 0,
                           nvme, K)
    assert lower["status"] == "Optimal"
    assert lower["step_s"] <= out.sim.step_s * (1 + 1e-6), (lower, out.plan.solver.origin)
    # and it is a bound of substance: at least the passes' compute
    assert lower["step_s"] >= K * sum(u.fwd_s + u.bwd_s for u in prof.layers) * (1 - 1e-6)


def test_a_large_block_workspace_does_not_lift_the_bound_above_keep_all():
    """The turnaround holds the head's workspace only: a block whose workspace is five times
    its saved bytes leaves keep-all's step (which fits) at or above the bound."""
    import dataclasses

    from planner.costmodel.baselines import baseline_layers
    from planner.plans import plan_and_sim
    bound = _bound_module()
    hw = load_hardware("a100-80g")
    prof = uniform_profile(4, hw, saved_bytes=2_000_000_000)
    layers = list(prof.layers)
    layers[1] = dataclasses.replace(layers[1], workspace_bytes=10_000_000_000)
    prof = dataclasses.replace(prof, layers=layers)
    big = Budgets(10**15, 0, 0)
    keep = baseline_layers("keep-all", prof.layers, hw)
    peak = plan_and_sim(prof, None, hw, big, "keep-all", keep)[1].peak_gpu_bytes
    gpu = peak + hw.reserved_bytes + (1 << 30)
    _, sim = plan_and_sim(prof, None, hw, Budgets(gpu, 0, 0), "keep-all", keep)
    assert sim.fits
    lower = bound.bound_of(prof.layers, hw, gpu, 0, 0, 1)
    assert lower["step_s"] <= sim.step_s * (1 + 1e-6)
