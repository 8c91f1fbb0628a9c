"""Baselines as plans and plan assembly (the golden plans: tests/test_simulate.py)."""
import json
from pathlib import Path

import pytest

from planner.costmodel.baselines import baseline_layers, sqrt_stride
from planner.formats import Activation as Act, Tier, load_plan
from planner.plans import baseline_plan, make_plan
from planner.costmodel.schedule import build_schedule, segments
from planner.plans.simulate import simulate
from synthetic import uniform_profile

from test_schedule import spec

@pytest.mark.parametrize("L,stride", [(1, 1), (4, 2), (9, 3), (10, 4), (48, 7), (192, 14)])
def test_sqrt_stride(L, stride):
    assert sqrt_stride(L) == stride


def test_sqrt_keeps_every_stride_th_input_on_gpu():
    hw = spec()
    us = uniform_profile(10, hw).layers
    layers = baseline_layers("sqrt", us, hw)
    ck = [d.checkpoint for d in layers[1:11]]
    assert ck == [Tier.GPU, Tier.NONE, Tier.NONE, Tier.NONE] * 2 + [Tier.GPU, Tier.NONE]
    assert all(d.activation is Act.RECOMPUTE for d in layers[1:11])


def test_baseline_plans_rank_as_expected():
    hw = spec(link=1e4)
    prof = uniform_profile(9, hw, fwd_s=1.0, saved_bytes=1000, input_bytes=100, param_bytes=10,
                           workspace_bytes=50, head_saved_bytes=200)
    budgets = {"gpu_bytes": 10**6, "cpu_bytes": 10**6, "nvme_bytes": 0}
    r = {p: baseline_plan(prof, None, hw, budgets, p) for p in
         ("keep-all", "recompute-all", "sqrt", "offload-all")}
    for name, plan in r.items():
        assert plan.policy == name and plan.solver.status == "baseline"
        assert plan.solver.name == name and plan.solver.objective is None
        assert plan.solver.origin == f"baseline:{name}"
        assert plan.predicted.step_s == simulate(plan).step_s
    peak = {k: v.predicted.peak_gpu_bytes for k, v in r.items()}
    step = {k: v.predicted.step_s for k, v in r.items()}
    static = 11 * 70                # weights and optimizer state; gradients (10 B a unit)
    g = 10                          # exist from their unit's backward on (K = 1)
    # keep-all peaks at the head's backward; recompute-all keeps 9 inputs and rebuilds one
    # block at a time (peak at R:blocks.8); sqrt keeps 3 checkpoints but rebuilds 3 at once.
    assert peak["keep-all"] == static + g + 100 + 9 * 1000 + 200 + 50
    assert peak["recompute-all"] == static + 2 * g + 100 + 9 * 100 + 1000 + 50
    assert peak["sqrt"] == static + 2 * g + 100 + 3 * 100 + 3 * 1000 + 50   # at R:blocks.8
    assert step["recompute-all"] == pytest.approx(step["sqrt"], rel=1e-12)
    assert step["keep-all"] == pytest.approx(prof_compute(prof), rel=1e-12)
    # Fast links (0.1 s per transfer): offloading hides completely and frees the blocks' bytes.
    assert step["offload-all"] == pytest.approx(step["keep-all"], rel=1e-12)
    assert peak["offload-all"] < peak["keep-all"]


def prof_compute(prof):
    return sum(u.fwd_s + u.bwd_s for u in prof.layers) + prof.optimizer_s


def test_make_plan_copies_profile_and_hashes_its_file(tmp_path):
    hw = spec()
    prof = uniform_profile(2, hw)
    path = tmp_path / "prof.json"
    path.write_text(json.dumps(prof.to_dict(), sort_keys=True))
    plan = make_plan(prof, str(path), hw, {"gpu_bytes": 1}, "keep-all",
                     baseline_layers("keep-all", prof.layers, hw))
    import hashlib
    assert plan.profile == {"path": str(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    assert plan.units == prof.layers and plan.model == prof.model
    assert plan.budgets.to_dict() == {"gpu_bytes": 1, "cpu_bytes": 0, "nvme_bytes": 0}
    assert {"step_s", "compute_s", "peak_gpu_bytes", "peak_cpu_bytes",
            "peak_nvme_bytes"} <= set(plan.predicted.to_dict())
    nohash = make_plan(prof, None, hw, {"gpu_bytes": 1}, "keep-all",
                       baseline_layers("keep-all", prof.layers, hw))
    assert nohash.profile == {"path": None, "sha256": None}
