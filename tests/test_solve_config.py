"""The solve configuration and the frozen cost model: built once, variants by replace, and the
plan's K is the K of the cost model that made it."""
from __future__ import annotations

import dataclasses

import pytest

from planner.costmodel import CostModel, device_budget
from planner.costmodel.baselines import baseline_layers
from planner.errors import UserError
from planner.formats import Budgets
from planner.hardware import load_hardware
from planner.plans import cost_model, plan_and_sim
from planner.solve import MARGIN_BYTES, SolveConfig
from synthetic import uniform_profile

GIB = 2**30


@pytest.fixture(scope="module")
def setup():
    hw = dataclasses.replace(load_hardware("a100-80g"), reserved_bytes=3 * 2**20)
    prof = uniform_profile(6, hw, saved_bytes=200_000_000, param_bytes=50_000_000)
    return hw, prof


def test_plan_micro_batches_come_from_its_cost_model(setup):
    hw, prof = setup
    b = Budgets(80 * GIB, 512 * GIB, 0)
    cm = cost_model(prof, hw, b, 3)
    layers = baseline_layers("keep-all", prof.layers, hw, ())
    plan, r = plan_and_sim(prof, None, hw, b, "keep-all", layers, cm=cm)
    assert plan.micro_batches == 3 == cm.K == r.micro_batches


def test_cost_model_is_frozen_and_replace_is_a_fresh_build(setup):
    hw, prof = setup
    b = Budgets(20 * GIB, 64 * GIB, 0)
    cm = cost_model(prof, hw, b, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cm.K = 5
    lean = dataclasses.replace(cm, optimizer_depth=1)
    fresh = cost_model(prof, hw, b, 2, optimizer_depth=1)
    assert lean.opt_depth == 1 and cm.opt_depth == 3
    assert (lean.budget, lean.homes, lean.choices, lean.shared, lean.windows) == \
        (fresh.budget, fresh.homes, fresh.choices, fresh.shared, fresh.windows)
    tight = dataclasses.replace(cm, margin_bytes=MARGIN_BYTES)
    assert tight.budget["gpu"] == 20 * GIB - MARGIN_BYTES - 3 * 2**20
    assert cm.budget["gpu"] == 20 * GIB - 3 * 2**20
    assert tight.homes == cm.homes and dict(tight.budget, gpu=0) == dict(cm.budget, gpu=0)


def test_device_budget_takes_the_margin_then_the_reserve_never_below_zero(setup):
    hw, _ = setup
    assert device_budget(10 * 2**20, hw) == 7 * 2**20
    assert device_budget(10 * 2**20, hw, 4096) == 7 * 2**20 - 4096
    assert device_budget(2 * 2**20, hw) == 0
    assert device_budget(100, hw, 4096) == 0


def test_config_is_checked_once_and_frozen(setup):
    hw, prof = setup
    b = Budgets(20 * GIB, 64 * GIB, 0)
    cfg = SolveConfig.build(hw, b, micro_batches=4, world_size=4)
    assert (cfg.engine, cfg.ranks_per_node, cfg.micro_batches) == ("fsdp2", 4, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.gap = 0.1
    cm = cfg.cost_model(prof)
    assert (cm.K, cm.world, cm.rpn, cm.engine) == (4, 4, 4, "fsdp2")
    assert cm.budget["cpu"] == 64 * GIB // 4
    assert cfg.gpu_budget_for(1000) == 1000 + 2 * MARGIN_BYTES + 3 * 2**20
    with pytest.raises(UserError, match="--stream"):
        SolveConfig.build(hw, b, stream="sometimes")
    with pytest.raises(UserError, match="--stream on"):
        SolveConfig.build(hw, b, stream="on", world_size=2, engine="ddp")
    assert isinstance(cm, CostModel)
