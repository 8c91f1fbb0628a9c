"""The paced optimizer (``optimizer_overlap: paced``, planner.costmodel.overlap): each unit's
step in three parts (read, update, write) in the backward stages after its own, its gradient
freed by its update and what it reads held from its read to its write; the work conserved,
the memory per stage, the MILP and the simulator agreeing, the options and plan files that
need it (the runtime: tests/test_paced_runtime.py, tests/test_layer_major_overlap_runtime.py)."""
from __future__ import annotations

import dataclasses
import json

import pytest

from planner.costmodel.layout import evaluate
from planner.costmodel.overlap import PACED_PARTS
from planner.errors import UserError
from planner.formats import Activation, Budgets, Home, LayerDecision, Plan, Tier
from planner.hardware import load_hardware
from planner.plans import cost_model, plan_and_sim
from planner.plans.simulate import PlanView, check_plan, simulate
from planner.solve.config import SolveConfig
from planner.solve.search import solve
from synthetic import uniform_profile

GiB = 2**30
BUDGETS = Budgets(20 * GiB, 64 * GiB, 2048 * GiB)


def _profile(n=8, jitter=0.0, hw="a100-80g"):
    """A chain of n blocks; with ``jitter``, each unit's parameters (so its gradient, state
    and step) a different size too, so that the wrong unit's bytes would show."""
    hw = load_hardware(hw)
    prof = uniform_profile(n, hw, fwd_s=2.0, param_bytes=2_000_000_000,
                           saved_bytes=200_000_000, jitter=jitter, seed=5)
    if jitter:
        keys = ("param_bytes", "grad_bytes", "optimizer_bytes", "master_bytes", "param_count")
        units = [dataclasses.replace(u, **{k: int(getattr(u, k) * (1 + jitter * i / n))
                                           for k in keys if getattr(u, k, None)})
                 for i, u in enumerate(prof.layers)]
        prof = dataclasses.replace(prof, layers=units)
    return hw, prof


def _views(hw, prof, want=lambda h: h.step is Tier.CPU and h.optimizer is Tier.NVME):
    """The paced cost model and its after-backward twin over one set of decisions (each
    unit's first home that ``want`` takes, activations kept), a view of each over the paced
    plan's shares, and the two plans."""
    paced = cost_model(prof, hw, BUDGETS, optimizer_overlap="paced", clip="none")
    after = dataclasses.replace(paced, optimizer_overlap="after-backward")
    layers = [LayerDecision(d.name, Activation.KEEP, home=next((h for h in hs if want(h)), hs[0]))
              for d, hs in zip(prof.layers, paced.homes)]
    plan, _ = plan_and_sim(prof, None, hw, BUDGETS, "optimal", layers, cm=paced,
                           keep_overlap=True)
    assert plan.optimizer_overlap == "paced"
    _, shares = check_plan(plan)
    twin, _ = plan_and_sim(prof, None, hw, BUDGETS, "optimal", layers, shares=shares, cm=after)
    return (paced, after, PlanView(paced, plan.layers, shares),
            PlanView(after, plan.layers, shares), plan, twin)


def _home(cm, v, j):
    return next(k for k in range(len(cm.homes[j])) if v.h(j, k))


def test_paced_keeps_every_gradient_on_the_device_and_needs_its_options():
    hw, prof = _profile()
    paced = cost_model(prof, hw, BUDGETS, optimizer_overlap="paced", clip="none")
    after = cost_model(prof, hw, BUDGETS, clip="none")
    assert all(h.grads is Tier.GPU for hs in paced.homes for h in hs)
    assert any(h.grads is not Tier.GPU for hs in after.homes for h in hs)
    # every home after the backward that keeps its gradient on the device is offered paced
    for hs, ps in zip(after.homes, paced.homes):
        assert [h for h in hs if h.grads is Tier.GPU] == ps
    with pytest.raises(ValueError, match="paced"):
        cost_model(prof, hw, BUDGETS, optimizer_overlap="paced", clip="global")
    with pytest.raises(ValueError, match="paced"):
        cost_model(prof, hw, BUDGETS, 2, optimizer_overlap="paced", clip="none")
    # layer-major: one pass per step, so K micro-batches may be paced
    lm = cost_model(prof, hw, BUDGETS, 4, optimizer_overlap="paced", clip="none",
                    micro_batch_order="layer-major")
    assert lm.paced and lm.passes == 1
    # the update may run beside the backward: the step's floor is the passes alone
    slow = dataclasses.replace(prof, optimizer_s=1.0)
    p1 = cost_model(slow, hw, BUDGETS, optimizer_overlap="paced", clip="none")
    a1 = cost_model(slow, hw, BUDGETS, clip="none", optimizer_overlap="after-backward")
    assert p1.compute_only() == pytest.approx(sum(p1.f) + sum(p1.b))
    assert a1.compute_only() > p1.compute_only()


def test_each_part_is_in_its_stage_with_the_bytes_it_moves():
    """A block's state on NVMe, stepped on the host: the stage after its backward reads the
    state from NVMe and its gradient over D2H, the next updates it on the host, the one after
    writes the state back; the seconds are the bytes over the spec's rates, counted here from
    the unit's own sizes."""
    hw, prof = _profile(jitter=0.3)
    paced, after, vp, va, _, _ = _views(hw, prof)
    L, U = paced.L, paced.U
    seen = 0
    for j in range(1, U - 1):
        k = _home(paced, vp, j)
        h = paced.homes[j][k]
        assert (h.step, h.optimizer, h.grads) == (Tier.CPU, Tier.NVME, Tier.GPU)
        want = {"read": {"nvme": paced.O[j] / hw.nvme_read_bandwidth,
                         "d2h": paced.G[j] / hw.d2h_bandwidth},
                "step": {"host": paced.N[j] / hw.cpu_adam_params_per_s},
                "write": {"nvme": paced.O[j] / hw.nvme_write_bandwidth}}
        for part, s in zip(PACED_PARTS, (L.bwd(j) + 1, L.bwd(j) + 2, L.bwd(j) + 3)):
            assert paced.paced_part_stage(j, h, part) == s
            if s > 2 * U:
                assert paced.in_phase(j, h, part)
                continue
            assert not paced.in_phase(j, h, part) and (j, k, part) in paced.paced_at[s]
            # this stage's load beyond the same stage after the backward: this part and the
            # other units' parts placed here
            others = [(i, kk, p) for i, kk, p in paced.paced_at[s] if i != j and vp.h(i, kk)]
            for r, x in want[part].items():
                extra = evaluate(paced.loads(s, vp, False)[r]) - \
                    evaluate(after.loads(s, va, False)[r])
                rest = 0.0
                for i, kk, p in others:
                    lists = [[] for _ in range(6)]
                    paced._step_terms(i, kk, paced.homes[i][kk], vp, (p,), *lists)
                    rest += evaluate(paced._resource_terms(*lists)[r])
                assert extra == pytest.approx(x + rest, rel=1e-9), (j, part, r)
            seen += 1
    assert seen >= 3 * (U - 5)


def test_no_work_is_lost_between_the_stages_and_the_phase():
    """Summed over the stages and the phase, every resource carries the optimizer work the same
    homes carry in the phase after the backward; the phase's chains only what is left there."""
    hw, prof = _profile(jitter=0.3)
    paced, after, vp, va, _, _ = _views(hw, prof)
    for r in ("nvme", "host", "d2h", "h2d", "compute"):
        stages = sum(evaluate(paced.loads(s, vp, False)[r]) -
                     evaluate(after.loads(s, va, False)[r]) for s in paced.L.pass_stages)
        phase = evaluate(paced.opt_loads(vp)[r])
        assert stages + phase == pytest.approx(evaluate(after.opt_loads(va)[r]),
                                               rel=1e-9), r
    left = [evaluate(t) for t in paced.opt_chains(vp)]
    whole = [evaluate(t) for t in after.opt_chains(va)]
    assert 0 < len(left) < len(whole) and max(left) <= max(whole)


def test_memory_per_stage_gradient_freed_by_its_update_reads_held_to_the_write():
    """Stage by stage (sizes differ per unit, so the wrong unit's bytes would show): paced
    allocates, beyond the same stage after the backward, what the unit read in that stage
    holds and the workspace of the unit updated there; it frees that unit's gradient and
    workspace and what the unit written there held. The simulated memory of every stage is
    the after-backward plan's less the gradients already updated, plus what the steps in
    flight hold; the phase holds only the gradients (and reads) of the units it updates."""
    hw, prof = _profile(jitter=0.3)
    paced, after, vp, va, plan, twin = _views(hw, prof)
    U = paced.U
    home = {j: paced.homes[j][_home(paced, vp, j)] for j in range(U)}
    stage = {(j, p): paced.paced_part_stage(j, home[j], p) for j in range(U) for p in PACED_PARTS}
    stepped = [j for j in range(U) if paced.G[j] and not home[j].resident]
    assert len({paced.G[j] for j in stepped}) == len(stepped)      # distinct sizes
    rp, ra = simulate(plan), simulate(twin)
    for s in paced.L.pass_stages:
        d_alloc = {t: evaluate(x) - evaluate(after.alloc(s, va, False)[t])
                   for t, x in paced.alloc(s, vp, False).items()}
        d_free = {t: evaluate(x) - evaluate(after.free(s, va, False)[t])
                  for t, x in paced.free(s, vp, False).items()}
        want_a, want_f = {"gpu": 0.0, "cpu": 0.0, "nvme": 0.0}, {"gpu": 0.0, "cpu": 0.0,
                                                                  "nvme": 0.0}
        mem = {"gpu": 0.0, "cpu": 0.0, "nvme": 0.0}
        for j in stepped:
            t, held = paced.paced_held(j, home[j])
            wt, ws = paced.step_workspace(j, home[j])
            if stage[j, "read"] == s:
                want_a[t] += held
            if stage[j, "step"] == s:
                want_a[wt] += ws
                want_f[wt] += ws
                want_f["gpu"] += paced.G[j]
            if stage[j, "write"] == s:
                want_f[t] += held
            if stage[j, "step"] < s:
                mem["gpu"] -= paced.G[j]
            if stage[j, "read"] <= s <= stage[j, "write"]:
                mem[t] += held
            if stage[j, "step"] == s:
                mem[wt] += ws
        for t in d_alloc:
            assert d_alloc[t] == pytest.approx(want_a[t]), (s, t)
            assert d_free[t] == pytest.approx(want_f[t]), (s, t)
            assert rp.stages[s].memory[t] - ra.stages[s].memory[t] == \
                pytest.approx(mem[t], abs=2), (s, t)
    phase = 2 * U + 1
    spilled = [j for j in stepped if stage[j, "step"] > 2 * U]
    reads_in = [j for j in stepped if stage[j, "read"] <= 2 * U < stage[j, "write"]]
    assert spilled and reads_in
    for t in ("gpu", "cpu"):
        grads = sum(paced.G[j] for j in stepped if j not in spilled) if t == "gpu" else 0
        held = sum(paced.paced_held(j, home[j])[1] for j in reads_in
                   if paced.paced_held(j, home[j])[0] == t)
        assert ra.stages[phase].memory[t] - rp.stages[phase].memory[t] == \
            pytest.approx(grads - held, abs=2), t
    assert any(paced.paced_held(j, home[j])[1] for j in reads_in)


def test_a_state_up_step_holds_its_state_on_the_device_from_read_to_write():
    """State on the host stepped on the device (state up): what it holds between its read and
    its write is its state, on the device."""
    hw, prof = _profile(jitter=0.3)
    paced, _, vp, _, _, _ = _views(hw, prof, want=lambda h: h.state_up)
    j = 3
    h = paced.homes[j][_home(paced, vp, j)]
    assert h.state_up
    assert paced.paced_held(j, h) == ("gpu", paced.opt_copy(j, h))


def test_paced_solve_is_priced_as_the_simulator_replays_it_and_beats_after_backward():
    """A model whose state lives off the device and whose host memory is tight: paced, no
    gradient waits for the phase, so the solve finds a faster plan than after the backward;
    the written plan says paced, fits, and its MILP objective is what the simulator replays;
    the device's updates in the backward are not reported as recompute."""
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
    from planner.cli.inspect import time_breakdown
    parts = time_breakdown(on.plan, r)
    assert sum(parts.values()) == pytest.approx(r.step_s - r.compute_s, rel=1e-9)


def test_paced_is_never_slower_than_after_the_backward_with_every_home():
    """Paced homes keep gradients on the device; where parking one on the host is faster (an
    h200 model whose device needs the room for state), the paced solve also solves the
    after-backward model with every home and writes that plan (the runtime executes it)."""
    hw = load_hardware("h200")
    prof = dataclasses.replace(uniform_profile(12, hw, fwd_s=0.02, param_bytes=1_000_000_000,
                                               saved_bytes=300_000_000), optimizer_s=0.5)
    static = sum(u.param_bytes + u.grad_bytes + u.optimizer_bytes for u in prof.layers)
    b = Budgets(int(static * 0.5), int(static * 0.6), 2048 * GiB)
    cfg = SolveConfig.build(hw, b, time_limit=10, clip="none", optimizer_overlap="paced")
    on = solve(prof, None, cfg)
    off = solve(prof, None, dataclasses.replace(cfg, optimizer_overlap="off"))
    assert on.plan.predicted.step_s <= off.plan.predicted.step_s * 1.005
    assert simulate(on.plan).fits


def test_on_a_cpu_host_the_device_updates_are_no_recompute():
    """cpu-host: every step runs on the device, so a paced update is compute in its stage;
    it is reported as the optimizer's, not as recompute, and the breakdown adds up."""
    from planner.cli.inspect import time_breakdown
    hw = load_hardware("cpu-host")
    prof = dataclasses.replace(uniform_profile(6, hw, fwd_s=0.1, param_bytes=50_000_000,
                                               saved_bytes=10_000_000), optimizer_s=2.0)
    b = Budgets(400 * 2**20, 0, 8 * GiB)
    cm = cost_model(prof, hw, b, optimizer_overlap="paced", clip="none")
    layers = [LayerDecision(d.name, Activation.KEEP,
                            home=next((h for h in hs if h.optimizer is Tier.NVME), hs[0]))
              for d, hs in zip(prof.layers, cm.homes)]
    plan, r = plan_and_sim(prof, None, hw, b, "optimal", layers, cm=cm, keep_overlap=True)
    assert plan.optimizer_overlap == "paced"
    assert r.recompute_s == pytest.approx(0.0, abs=1e-12)
    assert r.paced_compute_s > 0
    parts = time_breakdown(plan, r)
    assert sum(parts.values()) == pytest.approx(r.step_s - r.compute_s, rel=1e-9)


def test_paced_decisions_no_faster_than_after_the_backward_are_written_after_it():
    """Where the same decisions after the backward fit and are no slower (nothing off the
    device), the plan is written as after-backward: what the runtime executes."""
    hw, prof = _profile(4)
    b = Budgets(200 * GiB, 64 * GiB, 0)
    cm = cost_model(prof, hw, b, optimizer_overlap="paced", clip="none")
    layers = [LayerDecision(d.name, Activation.KEEP, home=Home()) for d in prof.layers]
    plan, r = plan_and_sim(prof, None, hw, b, "optimal", layers, cm=cm)
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


def test_a_paced_plan_file_that_clips_is_refused_in_one_line(tmp_path, capsys):
    """A paced plan edited to clip global (or batch-major K > 1, or an engine) is refused when
    read, in one line, by every verb (exit 2), never a traceback."""
    from planner.cli import main
    hw, prof = _profile(4)
    plan = _views(hw, prof)[4]
    d = plan.to_dict()
    for bad in ({"clip": "global"}, {"micro_batches": 2}, {"engine": "fsdp2", "world_size": 2}):
        with pytest.raises(UserError, match="paced") as e:
            Plan.from_dict({**d, **bad})
        assert len(str(e.value).splitlines()) == 1
    p = tmp_path / "paced-global.json"
    p.write_text(json.dumps({**d, "clip": "global"}))
    for verb in ("simulate", "inspect"):
        rc = main([verb, str(p)])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and "paced" in err[0], (verb, err)


def test_auto_searches_paced_where_it_can_run_and_keeps_the_fastest(monkeypatch):
    """``--optimizer-overlap auto`` with clip none and one pass a step also solves the paced
    family (a ``milp/paced`` joint MILP on the paced model) and writes the fastest plan of all,
    no slower than ``on`` or ``paced`` alone; under clip global, or K = 2 batch-major, it does
    not try it. (Where paced wins, on 175B on the A100: docs/streaming.md.)"""
    from planner.solve import search
    hw, prof = _profile()
    tried = []
    real = search.milp

    def spy(profile, path, cfg, cm, **kw):
        tried.append((kw["origin"], cm.optimizer_overlap))
        return real(profile, path, cfg, cm, **kw)
    monkeypatch.setattr(search, "milp", spy)
    cfg = SolveConfig.build(hw, BUDGETS, time_limit=10, clip="none")
    auto = solve(prof, None, cfg)
    assert ("milp/paced", "paced") in tried, tried
    others = [solve(prof, None, dataclasses.replace(cfg, optimizer_overlap=ov))
              for ov in ("on", "paced")]
    assert auto.plan.predicted.step_s <= min(o.plan.predicted.step_s for o in others) * 1.005
    r = simulate(auto.plan)
    assert r.fits and r.step_s == pytest.approx(auto.plan.predicted.step_s, rel=1e-9)
    for kw in ({"clip": "global"}, {"micro_batches": 2}):
        tried.clear()
        other = solve(prof, None, SolveConfig.build(hw, BUDGETS, time_limit=5,
                                                    **{"clip": "none", **kw}))
        assert tried and all(ov != "paced" for _, ov in tried), tried
        assert other.plan.optimizer_overlap != "paced"
