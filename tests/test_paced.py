"""The paced optimizer (``optimizer_overlap: paced``, planner.costmodel.overlap): each unit's
step pipelined through the backward stages after its own (read, update, write), its gradient
freed by its update; the work conserved, the memory it saves, the MILP and the simulator
agreeing, the options that need it, and the runtime refusing it in one line."""
from __future__ import annotations

import dataclasses

import pytest

from planner.costmodel.layout import evaluate
from planner.costmodel.overlap import PACED_PARTS
from planner.errors import UserError
from planner.formats import Activation, Budgets, Home, LayerDecision, Tier
from planner.hardware import load_hardware
from planner.plans import cost_model, plan_and_sim
from planner.plans.simulate import simulate
from planner.solve.config import SolveConfig
from planner.solve.search import solve
from synthetic import uniform_profile

GiB = 2**30
BUDGETS = Budgets(20 * GiB, 64 * GiB, 2048 * GiB)


def _profile(n=8):
    hw = load_hardware("a100-80g")
    return hw, uniform_profile(n, hw, fwd_s=2.0, param_bytes=2_000_000_000,
                               saved_bytes=200_000_000)


def _views(hw, prof):
    """The paced cost model and its after-backward twin over one set of decisions (every
    block's state on NVMe, stepped on the host; activations kept), with a view of each."""
    from planner.plans.simulate import PlanView, check_plan
    paced = cost_model(prof, hw, BUDGETS, optimizer_overlap="paced", clip="none")
    after = dataclasses.replace(paced, optimizer_overlap="after-backward")
    layers = []
    for d, hs in zip(prof.layers, paced.homes):
        h = next((h for h in hs if h.step is Tier.CPU and h.optimizer is Tier.NVME), hs[0])
        layers.append(LayerDecision(d.name, Activation.KEEP, home=h))
    plan, _ = plan_and_sim(prof, None, hw, BUDGETS, "optimal", layers, cm=paced,
                           keep_overlap=True)
    assert plan.optimizer_overlap == "paced"
    _, shares = check_plan(plan)
    return paced, after, PlanView(paced, plan.layers, shares), PlanView(after, plan.layers, shares)


def _part_seconds(cm, v, j, k, part):
    """Seconds per resource that ``part`` of unit j's step under its home k puts on a stage."""
    lists = [[] for _ in range(6)]
    cm._step_terms(j, k, cm.homes[j][k], v, (part,), *lists)
    return {r: evaluate(t) for r, t in cm._resource_terms(*lists).items()}


def test_each_part_of_a_step_is_in_its_stage_and_no_work_is_lost():
    """Unit j's read is in the stage after its backward, its update in the next, its write in
    the one after (the first units' late parts in the optimizer phase): each stage carries
    its own loads plus exactly those parts; summed over the stages and the phase, every
    resource carries the optimizer work the same homes carry in the phase after the
    backward."""
    hw, prof = _profile()
    paced, after, vp, va = _views(hw, prof)
    U, L = paced.U, paced.L
    placed = 0
    for s in L.pass_stages:
        extra = {r: evaluate(t) - evaluate(after.loads(s, va, False)[r])
                 for r, t in paced.loads(s, vp, False).items()}
        want = {r: 0.0 for r in extra}
        for j, k, part in paced.paced_at.get(s, ()):
            if vp.h(j, k):
                assert paced.paced_part_stage(j, paced.homes[j][k], part) == s
                assert s == L.bwd(j) + 1 + PACED_PARTS.index(part)
                placed += 1
                for r, x in _part_seconds(paced, vp, j, k, part).items():
                    want[r] += x
        for r in extra:
            assert extra[r] == pytest.approx(want[r], rel=1e-9, abs=1e-12), (s, r)
    assert placed >= 3 * (U - 4)          # every block's three parts but the first ones'
    for r in ("nvme", "host", "d2h", "h2d", "compute"):
        stages = sum(evaluate(paced.loads(s, vp, False)[r]) -
                     evaluate(after.loads(s, va, False)[r]) for s in L.pass_stages)
        phase = evaluate(paced.opt_loads(vp)[r])
        assert stages + phase == pytest.approx(evaluate(after.opt_loads(va)[r]),
                                               rel=1e-9), r
    # the phase's chains hold only what is left of each unit there
    left = [evaluate(t) for t in paced.opt_chains(vp)]
    whole = [evaluate(t) for t in after.opt_chains(va)]
    assert len(left) < len(whole) and max(left) <= max(whole)


def test_a_paced_gradient_is_freed_by_its_update_not_held_to_the_phase():
    """The same decisions, paced and after the backward: after the backward every unit's
    gradient is on the device in the optimizer phase; paced, only the units whose update
    spills into the phase hold theirs there, and each other unit's gradient is freed at the
    end of the stage of its update."""
    hw, prof = _profile()
    paced, after, vp, va = _views(hw, prof)
    g_after = evaluate(after.base(va, optimizer_phase=True)["gpu"])
    g_paced = evaluate(paced.base(vp, optimizer_phase=True)["gpu"])
    home = {j: next(k for k in range(len(paced.homes[j])) if vp.h(j, k))
            for j in range(paced.U)}
    spilled = [j for j in range(paced.U)
               if paced.in_phase(j, paced.homes[j][home[j]], "step")]
    stepped = [j for j in range(paced.U) if j not in spilled]
    assert spilled and len(stepped) >= paced.U - 3
    assert g_after - g_paced == pytest.approx(sum(paced.G[j] for j in stepped))
    for j in stepped:
        s = paced.paced_part_stage(j, paced.homes[j][home[j]], "step")
        others = sum(paced.G[i] for i, k, p in paced.paced_at[s]
                     if p == "step" and i != j and vp.h(i, k))
        assert evaluate(paced.free(s, vp, False)["gpu"]) - \
            evaluate(after.free(s, va, False)["gpu"]) == pytest.approx(paced.G[j] + others)


def test_paced_solve_is_priced_as_the_simulator_replays_it_and_beats_after_backward():
    """A model whose state lives off the device and whose host memory is tight: paced, no
    gradient waits for the phase, so the solve finds a faster plan than after the backward;
    the written plan says paced, fits, and its MILP objective is what the simulator replays."""
    hw, prof = _profile()
    cfg = SolveConfig.build(hw, BUDGETS, time_limit=10, clip="none",
                            optimizer_overlap="paced")
    off = solve(prof, None, dataclasses.replace(cfg, optimizer_overlap="off"))
    on = solve(prof, None, cfg)
    assert on.plan.optimizer_overlap == "paced"
    assert on.plan.predicted.step_s < off.plan.predicted.step_s
    r = simulate(on.plan)
    assert r.fits and r.step_s == pytest.approx(on.plan.predicted.step_s, rel=1e-9)
    if on.plan.solver.origin.startswith("milp") and on.plan.solver.objective:
        assert on.plan.solver.objective == pytest.approx(r.step_s, rel=2e-3)
    assert all(d.home.grads is Tier.GPU for d in on.plan.layers)


def test_paced_decisions_no_faster_than_after_the_backward_are_written_after_it():
    """Where the same decisions after the backward fit and are no slower (nothing off the
    device), the plan is written as after-backward: what the runtime executes."""
    hw, prof = _profile(4)
    cm = cost_model(prof, hw, Budgets(200 * GiB, 64 * GiB, 0), optimizer_overlap="paced",
                    clip="none")
    layers = [LayerDecision(d.name, Activation.KEEP, home=Home()) for d in prof.layers]
    plan, r = plan_and_sim(prof, None, hw, Budgets(200 * GiB, 64 * GiB, 0), "optimal",
                           layers, cm=cm)
    assert plan.optimizer_overlap == "after-backward" and r.fits


def test_paced_options_are_one_line():
    hw = load_hardware("a100-80g")
    with pytest.raises(UserError, match="--clip none"):
        SolveConfig.build(hw, BUDGETS, optimizer_overlap="paced")
    with pytest.raises(UserError, match="layer-major"):
        SolveConfig.build(hw, BUDGETS, optimizer_overlap="paced", clip="none", micro_batches=2)
    cfg = SolveConfig.build(hw, BUDGETS, optimizer_overlap="paced", clip="none",
                            micro_batches=2, micro_batch_order="auto")
    assert cfg.micro_batch_order == "layer-major"
    with pytest.raises(UserError, match="--engine"):
        SolveConfig.build(hw, BUDGETS, optimizer_overlap="paced", clip="none", world_size=2)


def test_plan_solve_paced_without_clip_none_exits_2_in_one_line(tmp_path, capsys):
    from planner.cli import main
    from planner.formats import write_json_atomic
    hw, prof = _profile(2)
    p = write_json_atomic(tmp_path / "prof.json", prof.to_dict())
    rc = main(["solve", str(p), "--hardware", "a100-80g", "--gpu-mem", "20G",
               "--optimizer-overlap", "paced", "-o", str(tmp_path / "plan.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--clip none" in err[0]
    assert not (tmp_path / "plan.json").exists()


def test_the_runtime_refuses_a_paced_plan_in_one_line(tmp_path):
    import torch
    from planner.models import build_model, load_config
    from runtime import apply_plan
    from conftest import plan_for

    model = build_model(dict(load_config("gpt-tiny"), dtype="fp32"), dtype="fp32")
    plan = plan_for(model, "keep-all", 2, 16, nvme_dir=tmp_path / "nvme")
    with pytest.raises(UserError, match="paced.*--optimizer-overlap auto") as e:
        apply_plan(model, dataclasses.replace(plan, optimizer_overlap="paced", clip="none"),
                   optimizer=torch.optim.AdamW(model.parameters()))
    assert len(str(e.value).splitlines()) == 1
    assert PACED_PARTS == ("read", "step", "write")
