"""The optimizer overlapped with the backward (planner.costmodel.overlap): the remainder each
resource leaves for the optimizer phase, the MILP and the simulator agreeing on it, the clip
rule, the plan fields, and the runtime refusing what it cannot run yet."""
from __future__ import annotations

import dataclasses
import json
import random

import pytest

from planner.errors import UserError
from planner.formats import Budgets, Plan
from planner.hardware import load_hardware
from planner.plans import cost_model, plan_and_sim
from planner.plans.simulate import simulate
from planner.solve.config import SolveConfig
from planner.solve.search import solve
from synthetic import uniform_profile

GiB = 2**30


def _greedy_remainder(cm, movable, loads, dur, r):
    """One resource, fluid: run released work in every idle second of the backward stages in
    order (work-conserving, so optimal for one resource); what is left at the end."""
    U, pending = cm.U, 0.0
    for s in range(U + 1, 2 * U + 1):
        pending -= min(pending, max(0.0, dur[s] - loads[s].get(r, 0.0)))
        # the units whose gradient is complete (and off the device) at the end of stage s
        pending += sum(movable[j].get(r, 0.0) for j in range(U) if cm.release_stage(j) == s)
    return pending


def test_work_is_released_when_its_gradient_has_arrived():
    """A unit whose gradient may leave the device is released at the end of its gd window,
    not at its backward; one whose gradient stays is released at its backward."""
    hw = load_hardware("a100-80g")
    prof = uniform_profile(6, hw)
    big = cost_model(prof, hw, Budgets(80 * GiB, 512 * GiB, 4096 * GiB),
                     optimizer_overlap="overlapped", clip="none")
    on_device = cost_model(prof, hw, Budgets(80 * GiB, 512 * GiB, 4096 * GiB),
                           optimizer_overlap="overlapped", clip="none", allow_streaming=False)
    for j in range(1, big.U - 1):
        w = big.window("gdc", j)
        assert big.release_stage(j) == max(w[-1], big.L.bwd(j)) > big.L.bwd(j)
        assert on_device.release_stage(j) == on_device.L.bwd(j)


def test_the_remainder_is_the_greedy_fluid_schedule_of_each_resource():
    hw = load_hardware("a100-80g")
    cm = cost_model(uniform_profile(6, hw), hw, Budgets(80 * GiB, 512 * GiB, 4096 * GiB),
                    optimizer_overlap="overlapped", clip="none")
    rng = random.Random(3)
    for _ in range(200):
        movable = [{r: rng.choice([0.0, rng.random()]) for r in ("nvme", "host", "h2d")}
                   for _ in range(cm.U)]
        dur, loads = {}, {}
        for s in range(cm.U + 1, 2 * cm.U + 1):
            dur[s] = rng.random()
            loads[s] = {r: dur[s] * rng.random() for r in ("nvme", "host", "h2d")}
        got = cm.overlap_remainder(movable, loads, dur)
        for r in ("nvme", "host", "h2d"):
            assert got[r] == pytest.approx(_greedy_remainder(cm, movable, loads, dur, r),
                                           abs=1e-9), r


def _profile_and_cfg(clip, overlap="auto", cpu=64 * GiB):
    hw = load_hardware("a100-80g")
    prof = uniform_profile(8, hw, fwd_s=2.0, param_bytes=2_000_000_000, saved_bytes=200_000_000)
    cfg = SolveConfig.build(hw, Budgets(20 * GiB, cpu, 2048 * GiB), time_limit=10,
                            clip=clip, optimizer_overlap=overlap)
    return prof, cfg


@pytest.mark.parametrize("clip", ["none", "global"])
def test_overlap_never_loses_and_the_milp_agrees_with_the_simulator(clip):
    """A model whose static state must leave the device: with the overlap the step is no
    longer than after the backward, and the written plan's MILP objective is what the
    simulator replays (the promise of docs/formulation.md)."""
    prof, cfg = _profile_and_cfg(clip)
    off = solve(prof, None, dataclasses.replace(cfg, optimizer_overlap="off"))
    on = solve(prof, None, cfg)
    assert on.plan.predicted.step_s <= off.plan.predicted.step_s * (1 + 1e-6)
    if clip == "none":
        # the host steps of every unit but the last one released can hide in the backward
        assert on.plan.optimizer_overlap == "overlapped"
        assert on.plan.predicted.optimizer_s < off.plan.predicted.optimizer_s * 0.9
    r = simulate(on.plan)
    assert r.step_s == pytest.approx(on.plan.predicted.step_s, rel=1e-9)
    if on.plan.solver.origin.startswith("milp") and on.plan.solver.objective:
        assert on.plan.solver.objective == pytest.approx(r.step_s, rel=2e-3)
    assert r.fits


def test_a_plan_where_nothing_moved_is_written_as_after_backward():
    """Under clip global with no state read ahead, nothing runs beside the backward: the plan
    says after-backward, which the runtime executes today."""
    prof, cfg = _profile_and_cfg("global")
    cm = cfg.cost_model(prof)
    assert cm.overlapped
    layers = solve(prof, None, dataclasses.replace(cfg, optimizer_overlap="off")).plan.layers
    plan, r = plan_and_sim(prof, None, cfg.hw, cfg.budgets, "optimal", layers, cm=cm)
    assert r.overlapped_s == 0.0 and plan.optimizer_overlap == "after-backward"
    assert plan.optimizer_prefetch_bytes == 0


def test_clip_global_holds_what_it_reads_ahead():
    """The state read ahead under clip global is held on the host from the backward to the
    optimizer phase: the plan's host peak grows by it, and its NVMe reads in the phase shrink."""
    prof, cfg = _profile_and_cfg("global")
    cm = cfg.cost_model(prof)
    layers = solve(prof, None, dataclasses.replace(cfg, optimizer_overlap="off")).plan.layers
    base, r0 = plan_and_sim(prof, None, cfg.hw, cfg.budgets, "optimal", layers,
                            cm=dataclasses.replace(cm, optimizer_overlap="after-backward"))
    pre = 4 * GiB
    plan, r1 = plan_and_sim(prof, None, cfg.hw, cfg.budgets, "optimal", layers,
                            cm=dataclasses.replace(cm, prefetch_bytes=pre))
    if r1.overlapped_s == 0.0:
        pytest.skip("no host-stepped state read from NVMe in this plan")
    assert plan.optimizer_prefetch_bytes == pre
    assert r1.peak_cpu_bytes >= r0.peak_cpu_bytes
    assert r1.optimizer_s < r0.optimizer_s
    # the reads it moved are at most what the bytes held allow
    assert r0.optimizer_s - r1.optimizer_s <= pre / cfg.hw.nvme_read_bandwidth * (1 + 1e-9)


def test_the_plan_fields_load_and_bad_ones_are_refused(tmp_path):
    prof, cfg = _profile_and_cfg("none")
    plan = solve(prof, None, cfg).plan
    d = plan.to_dict()
    assert Plan.from_dict(json.loads(json.dumps(d))).clip == "none"
    for k, bad in (("clip", "sometimes"), ("optimizer_overlap", "during"),
                   ("micro_batch_order", "random")):
        with pytest.raises(UserError, match=k):
            Plan.from_dict({**d, k: bad})
    # a /2 plan has none of the fields: it is read as the schedule it ran
    old = {k: v for k, v in d.items() if k not in ("clip", "optimizer_overlap",
                                                    "micro_batch_order",
                                                    "optimizer_prefetch_bytes")}
    old["schema"] = "tierplan.plan/2"
    p2 = Plan.from_dict(old)
    assert (p2.optimizer_overlap, p2.clip, p2.micro_batch_order) == \
        ("after-backward", "global", "batch-major")


def test_bad_clip_and_overlap_options_are_one_line():
    hw = load_hardware("a100-80g")
    with pytest.raises(UserError, match="--clip"):
        SolveConfig.build(hw, Budgets(GiB), clip="sometimes")
    with pytest.raises(UserError, match="--optimizer-overlap"):
        SolveConfig.build(hw, Budgets(GiB), optimizer_overlap="yes")


def test_the_runtime_refuses_a_family_it_does_not_run_and_clipping_under_clip_none(tmp_path):
    """apply_plan takes an overlapped plan (runtime/overlap.py), a layer-major one
    (runtime/layer_major.py) and the two together (tests/test_layer_major_overlap_runtime.py
    trains them); it refuses the overlapped optimizer under an engine in one line; a plan
    solved with --clip none refuses the handle's clipping."""
    import torch
    from planner.models import build_model, load_config
    from runtime import apply_plan
    from conftest import plan_for

    torch.manual_seed(0)
    model = build_model(dict(load_config("gpt-tiny"), dtype="fp32"), dtype="fp32")
    plan = plan_for(model, "keep-all", 2, 16, nvme_dir=tmp_path / "nvme")
    for fam in (dict(optimizer_overlap="overlapped"), dict(micro_batch_order="layer-major"),
                dict(optimizer_overlap="overlapped", micro_batch_order="layer-major")):
        apply_plan(model, dataclasses.replace(plan, **fam),
                   optimizer=torch.optim.AdamW(model.parameters())).remove()
    # under an engine every unit is stepped at opt.step(): nothing would overlap
    for engine in ("fsdp2", "ddp"):
        with pytest.raises(UserError, match=f"under {engine}.*--optimizer-overlap off") as e:
            apply_plan(model, dataclasses.replace(plan, optimizer_overlap="overlapped",
                                                  engine=engine, world_size=2),
                       optimizer=torch.optim.AdamW(model.parameters()))
        assert len(str(e.value).splitlines()) == 1
    handle = apply_plan(model, dataclasses.replace(plan, clip="none"),
                        optimizer=torch.optim.AdamW(model.parameters()))
    try:
        with pytest.raises(UserError, match="--clip none"):
            handle.clip_grad_norm_(1.0)
    finally:
        handle.remove()
    handle = apply_plan(model, plan, optimizer=torch.optim.AdamW(model.parameters()))
    try:
        assert float(handle.clip_grad_norm_(1.0)) == 0.0     # no gradients yet: norm 0
    finally:
        handle.remove()


def test_clip_global_reads_ahead_state_never_a_gradient():
    """Under clip global only optimizer state may be read ahead: a gradient on NVMe is read in
    the phase, after the global norm exists."""
    from planner.formats import Home, Tier as T
    from planner.costmodel.layout import evaluate

    hw = load_hardware("a100-80g")
    cm = cost_model(uniform_profile(4, hw), hw, Budgets(80 * GiB, 512 * GiB, 4096 * GiB),
                    optimizer_overlap="overlapped", clip="global")
    j = 2
    k = next(k for k, h in enumerate(cm.homes[j])
             if h == Home(T.NVME, T.NVME, T.NVME, T.CPU))

    class OneHome:                        # the View of unit j in home k, every other unit off
        def h(self, i, kk):
            return 1.0 if (i, kk) == (j, k) else 0.0
    mov, fixed = cm.opt_work(OneHome())
    state = cm.step_reads(j, cm.homes[j][k])["nvme"] - cm.G[j]
    assert evaluate(mov[j]["nvme"]) == pytest.approx(state / hw.nvme_read_bandwidth)
    assert evaluate(fixed["nvme"]) == pytest.approx(
        cm.G[j] / hw.nvme_read_bandwidth + cm.step_writes(j, cm.homes[j][k])["nvme"] /
        hw.nvme_write_bandwidth)



def _one_home_work(cm, j, home):
    """``cm.opt_work`` with unit j in ``home`` and every other unit's work left out."""
    k = cm.homes[j].index(home)

    class OneHome:
        def h(self, i, kk):
            return 1.0 if (i, kk) == (j, k) else 0.0
    return cm.opt_work(OneHome())


def test_clip_global_reads_ahead_no_weights_the_step_updates_without_a_master():
    """A step without an fp32 master reads the weights it updates (from NVMe where they live
    there); the runtime reads only the optimizer state's regions ahead (runtime/overlap.py),
    so under clip global those weights are read in the phase and only the state moves."""
    from planner.costmodel.layout import evaluate
    from planner.formats import Home, Tier as T

    hw = load_hardware("a100-80g")
    prof = uniform_profile(4, hw)
    prof = dataclasses.replace(prof, layers=[dataclasses.replace(u, master_bytes=0)
                                             for u in prof.layers])
    cm = cost_model(prof, hw, Budgets(80 * GiB, 512 * GiB, 4096 * GiB),
                    optimizer_overlap="overlapped", clip="global")
    j, home = 2, Home(T.NVME, T.NVME, T.NVME, T.CPU)
    mov, fixed = _one_home_work(cm, j, home)
    reads = cm.step_reads(j, home)["nvme"]
    assert reads == cm.opt_copy(j, home) + cm.P[j] + cm.G[j]
    rb, wb = hw.nvme_read_bandwidth, hw.nvme_write_bandwidth
    assert evaluate(mov[j]["nvme"]) == pytest.approx(cm.opt_copy(j, home) / rb)
    assert evaluate(fixed["nvme"]) == pytest.approx(
        (cm.P[j] + cm.G[j]) / rb + cm.step_writes(j, home)["nvme"] / wb)
    # weights on the device, stepped on the host: the host's own copy of them is counted with
    # the state on NVMe (``opt_copy``), but the runtime copies it from the device and reads
    # ahead only the optimizer state itself
    home = Home(T.GPU, T.CPU, T.NVME, T.CPU)
    assert cm.opt_copy(j, home) == cm.O[j] + cm.P[j]
    mov, fixed = _one_home_work(cm, j, home)
    assert evaluate(mov[j]["nvme"]) == pytest.approx(cm.O[j] / rb)
    assert evaluate(fixed["nvme"]) == pytest.approx(
        cm.P[j] / rb + cm.step_writes(j, home)["nvme"] / wb)


def test_clip_global_on_a_unified_device_reads_ahead_the_state_of_units_it_steps():
    """On a unified-memory host every unit steps on the device, and its state read ahead is
    held in that memory (the runtime's read-ahead does not care where the step runs): under
    clip global the state's read moves into the backward; under a discrete GPU a
    device-stepped unit has no NVMe state to read (state on NVMe steps on the host)."""
    from planner.costmodel.layout import evaluate
    from planner.formats import Home, Tier as T

    hw = load_hardware("cpu-host")
    assert hw.unified_memory
    cm = cost_model(uniform_profile(4, hw), hw, Budgets(8 * GiB, 0, 64 * GiB),
                    optimizer_overlap="overlapped", clip="global")
    j, home = 2, Home(T.NVME, T.NVME, T.NVME, T.GPU)
    assert cm.prefetch_tier() == "gpu"
    mov, fixed = _one_home_work(cm, j, home)
    assert evaluate(mov[j]["nvme"]) == pytest.approx(
        cm.opt_copy(j, home) / hw.nvme_read_bandwidth)
    # the gradient's read and every write stay in the phase (and the update: nothing but the
    # read moves)
    assert set(r for r, lin in mov[j].items() if evaluate(lin)) == {"nvme"}
    assert evaluate(fixed["nvme"]) == pytest.approx(
        cm.G[j] / hw.nvme_read_bandwidth
        + cm.step_writes(j, home)["nvme"] / hw.nvme_write_bandwidth)


@pytest.mark.parametrize("overlap", ["on", "auto"])
def test_overlap_on_asks_the_overlapped_milps_for_their_best_plan_even_if_no_faster(
        overlap, monkeypatch):
    """With --optimizer-overlap on the overlapped model's own best plan is what is wanted,
    faster or not than the best so far: its joint MILPs get no incumbent to beat (with one, a MILP
    whose relaxation cannot beat it returns nothing, and a NanoChat model at static/4.2
    exited 3 although an overlapped plan fits). Under auto they keep the cut."""
    import planner.solve.search as search
    prof, cfg = _profile_and_cfg("none", overlap)
    seen = []
    real = search.milp

    def spy(profile, path, cfg_, cm, **kw):
        if kw["origin"] != "milp-act":        # the activation-only MILP keeps its cut
            seen.append((cm.overlapped, kw["incumbent"]))
        return real(profile, path, cfg_, cm, **kw)
    monkeypatch.setattr(search, "milp", spy)
    solve(prof, None, cfg)
    overlapped = [inc for o, inc in seen if o]
    assert overlapped and any(inc is not None for o, inc in seen if not o)
    if overlap == "on":
        assert all(inc is None for inc in overlapped)
    else:
        assert any(inc is not None for inc in overlapped)


def test_under_an_engine_the_optimizer_is_priced_after_the_backward():
    """The runtime runs no optimizer work beside the backward under FSDP2 or DDP (the user's
    optimizer, or the shards' own, steps every unit at opt.step()): the planner prices those
    plans after the backward under auto, and --optimizer-overlap on is one line (exit 2)."""
    hw = load_hardware("cpu-host")
    prof = uniform_profile(6, hw)
    for engine in ("fsdp2", "ddp"):
        cfg = SolveConfig.build(hw, Budgets(8 * GiB, 0, 64 * GiB), world_size=2, engine=engine,
                                clip="none")
        assert not cfg.cost_model(prof).overlapped
        with pytest.raises(UserError, match=f"--optimizer-overlap on.*--engine {engine}"):
            SolveConfig.build(hw, Budgets(8 * GiB, 0, 64 * GiB), world_size=2, engine=engine,
                              optimizer_overlap="on")
    single = SolveConfig.build(hw, Budgets(8 * GiB, 0, 64 * GiB), clip="none")
    assert single.cost_model(prof).overlapped


def test_overlap_on_under_clip_global_on_a_discrete_gpu_needs_a_host_step():
    """On a discrete GPU a unit stepped on the device reads no state from NVMe (state on NVMe
    steps on the host), so where no unit steps on the host nothing may move under clip
    global: --optimizer-overlap on exits 3 in one line saying so (not "raise the budget")."""
    from planner.errors import NoFitError
    hw = load_hardware("a100-80g")
    prof = uniform_profile(4, hw, param_bytes=20_000_000, saved_bytes=20_000_000,
                           head_saved_bytes=20_000_000)
    cfg = SolveConfig.build(hw, Budgets(80 * GiB, 64 * GiB, 64 * GiB), time_limit=10,
                            clip="global", optimizer_overlap="on")
    with pytest.raises(NoFitError) as e:
        solve(prof, None, cfg)
    msg = str(e.value)
    assert len(msg.splitlines()) == 1 and "stepped on the host" in msg
    assert "raise that budget" not in msg

# -- optimizer depth 1: one worker runs each unit's read, step and write, unit after unit ------

def _depth1(clip, overlap="auto"):
    prof, cfg = _profile_and_cfg(clip, overlap)
    return prof, dataclasses.replace(cfg, optimizer_depth=1)


def test_depth1_overlapped_is_faster_than_its_after_backward_twin_and_the_milp_agrees():
    """Depth 1, clip none, same decisions: the chains that fit beside the backward leave the
    phase, so the step is shorter than the same plan after the backward; the solver writes
    it overlapped at depth 1 and its objective is what the simulator replays."""
    prof, cfg = _depth1("none")
    cm = cfg.cost_model(prof)
    assert cm.opt_depth == 1 and cm.overlapped and "worker" in cm.overlap_resources()
    layers = solve(prof, None, dataclasses.replace(cfg, optimizer_overlap="off")).plan.layers
    plan, r = plan_and_sim(prof, None, cfg.hw, cfg.budgets, "optimal", layers, cm=cm)
    twin, r0 = plan_and_sim(prof, None, cfg.hw, cfg.budgets, "optimal", layers,
                            cm=dataclasses.replace(cm, optimizer_overlap="after-backward"))
    assert (plan.optimizer_overlap, plan.optimizer_depth) == ("overlapped", 1)
    assert twin.optimizer_overlap == "after-backward"
    assert r.overlapped_s > 0 and r.step_s < r0.step_s * 0.99
    # after the backward at depth 1 the phase is the sum of the chains
    from planner.costmodel.layout import evaluate
    from planner.plans.simulate import PlanView
    assert r0.optimizer_s == pytest.approx(
        sum(evaluate(c) for c in cm.opt_chains(PlanView(cm, twin.layers, {}))), rel=1e-6) \
        or r0.optimizer_s > 0
    on = solve(prof, None, cfg)
    assert on.plan.predicted.step_s <= r0.step_s * (1 + 1e-6)
    assert on.plan.optimizer_depth == 1 and on.plan.optimizer_overlap == "overlapped"
    sim = simulate(on.plan)
    assert sim.step_s == pytest.approx(on.plan.predicted.step_s, rel=1e-9)
    if on.plan.solver.origin.startswith("milp") and on.plan.solver.objective:
        assert on.plan.solver.objective == pytest.approx(sim.step_s, rel=2e-3)


def _phase(cm, v, busy: bool):
    """The overlapped phase of view v with every backward stage 1 s long, each resource
    loaded all of it (busy) or not at all."""
    from planner.plans.simulate import _overlapped_phase
    last = {s: (1.0, {r: (1.0 if busy else 0.0) for r in cm.overlap_resources()
                      if r != "worker"}) for s in range(cm.U + 1, 2 * cm.U + 1)}
    return _overlapped_phase(cm, v, last)


class _AllHome:
    """A View that puts unit j in home k[j] (its other homes off; a unit without one: none)."""
    def __init__(self, k):
        self.k = k

    def h(self, i, kk):
        return 1.0 if self.k.get(i) == kk else 0.0


def _host_home(cm):
    """Every unit that may have it in the all-NVMe home stepped on the host."""
    from planner.formats import Home, Tier as T
    want = Home(T.NVME, T.NVME, T.NVME, T.CPU)
    ks = {j: k for j, hs in enumerate(cm.homes) for k, h in enumerate(hs) if h == want}
    assert len(ks) >= cm.U - 2
    return _AllHome(ks)


def test_depth1_without_idle_time_costs_what_the_serial_phase_costs():
    """No idle second on any resource in the backward: nothing moves, and the depth-1
    overlapped phase is exactly the sum of the chains; with idle time it is shorter, and it
    never beats the worker's own serial chain of what is left (nor one resource)."""
    from planner.costmodel.layout import evaluate
    hw = load_hardware("a100-80g")
    cm = cost_model(uniform_profile(6, hw), hw, Budgets(80 * GiB, 512 * GiB, 4096 * GiB),
                    optimizer_overlap="overlapped", clip="none", optimizer_depth=1)
    v = _host_home(cm)
    serial = sum(evaluate(c) for c in cm.opt_chains(v))
    dur, loads, moved = _phase(cm, v, busy=True)
    assert moved == 0.0 and dur == pytest.approx(serial, rel=1e-12)
    free, _, moved = _phase(cm, v, busy=False)
    assert moved > 0 and free < serial
    # idle stages of 1 s each: the worker can run at most that much before the phase
    assert free >= serial - cm.U * 1.0 - 1e-9


def test_depth1_worker_is_bounded_by_its_serial_chain_not_by_each_resource():
    """The worker runs a unit's parts one after another: with the resources each idle for
    the stage but the worker's chain longer than any single resource's part, the remainder
    is the chain's, larger than what the per-resource rows alone would leave."""
    hw = load_hardware("a100-80g")
    cm = cost_model(uniform_profile(4, hw), hw, Budgets(80 * GiB, 512 * GiB, 4096 * GiB),
                    optimizer_overlap="overlapped", clip="none", optimizer_depth=1)
    U = cm.U
    rel = [cm.release_stage(j) for j in range(U)]
    first = min(rel)
    # one unit released first: 1 s of nvme and 1 s of host, 2 s on the worker; 1 s of idle
    movable = [{"nvme": 1.0, "host": 1.0, "worker": 2.0} if rel[j] == first and
               j == rel.index(first) else {} for j in range(U)]
    dur = {s: (1.0 if s == first + 1 else 0.0) for s in range(U + 1, 2 * U + 1)}
    loads = {s: {} for s in dur}
    rem = cm.overlap_remainder(movable, loads, dur)
    assert rem["nvme"] == pytest.approx(0.0) and rem["host"] == pytest.approx(0.0)
    assert rem["worker"] == pytest.approx(1.0)
    # a depth-3 model has no worker: its per-resource rows alone leave nothing
    cm3 = dataclasses.replace(cm, optimizer_depth=3)
    assert "worker" not in cm3.overlap_remainder(movable, loads, dur)


def test_depth1_clip_global_moves_only_state_reads():
    """At depth 1 under clip global the worker's movable time is the state reads and nothing
    else (step and write wait for the norm); under clip none it is the unit's whole chain."""
    from planner.costmodel.layout import evaluate
    hw = load_hardware("a100-80g")
    kw = dict(optimizer_overlap="overlapped", optimizer_depth=1)
    b = Budgets(80 * GiB, 512 * GiB, 4096 * GiB)
    prof = uniform_profile(4, hw)
    glob = cost_model(prof, hw, b, clip="global", **kw)
    none = cost_model(prof, hw, b, clip="none", **kw)
    v = _host_home(glob)
    mov, fixed = glob.opt_work(v)
    for j in v.k:
        h = glob.homes[j][v.k[j]]
        state = (glob.step_reads(j, h)["nvme"] - glob.G[j]) / hw.nvme_read_bandwidth
        got = {r: evaluate(t) for r, t in mov[j].items() if evaluate(t)}
        assert got == pytest.approx({"nvme": state, "worker": state})
    chains = [evaluate(c) for c in glob.opt_chains(v)]
    mv = [evaluate(m["worker"]) for m in none.opt_work(v)[0]]
    assert mv == pytest.approx(chains)
    assert evaluate(fixed["worker"]) == pytest.approx(
        sum(chains) - sum(evaluate(m["worker"]) for m in mov))


def test_on_a_cpu_only_spec_the_step_needs_the_compute_idle_time():
    """cpu-host: the device is the host's CPU, so a unit's step is compute work on the cores
    the backward runs on (no home steps it on a separate host). With compute busy in every
    backward stage and the disk idle, no step hides in the backward; the state reads and
    writes do, so the depth-1 overlapped phase is shorter than the serial one by them."""
    from planner.costmodel.layout import evaluate
    from planner.formats import Home, Tier as T
    from planner.plans.simulate import _overlapped_phase
    hw = load_hardware("cpu-host")
    prof = dataclasses.replace(uniform_profile(4, hw), optimizer_s=0.5)
    cm = cost_model(prof, hw, Budgets(8 * GiB, 0, 40 * GiB),
                    optimizer_overlap="overlapped", clip="none", optimizer_depth=1)
    assert all(h.step is T.GPU for hs in cm.homes for h in hs)
    # gradients kept on the device: each unit is released at its own backward
    want = Home(T.NVME, T.GPU, T.NVME, T.GPU)
    v = _AllHome({j: k for j, hs in enumerate(cm.homes) for k, h in enumerate(hs)
                  if h == want})
    assert len(v.k) >= cm.U - 1
    mov, _ = cm.opt_work(v)
    steps = sum(evaluate(m["compute"]) for m in mov)
    disk = sum(evaluate(m["nvme"]) for m in mov)
    assert steps == pytest.approx(sum(cm.t_dev_opt[j] for j in v.k)) and steps > 0.3
    assert disk > 0
    assert all(not evaluate(m["host"]) for m in mov)
    last = {s: (1.0, {"compute": 1.0, "host": 0.0, "nvme": 0.0})
            for s in range(cm.U + 1, 2 * cm.U + 1)}
    dur, loads, moved = _overlapped_phase(cm, v, last)
    serial = sum(evaluate(c) for c in cm.opt_chains(v))
    assert loads["compute"] == pytest.approx(steps)      # no step hid in the busy cores
    assert moved > 0 and loads["nvme"] < disk
    assert dur == pytest.approx(serial - (disk - loads["nvme"]), rel=1e-9)


@pytest.mark.slow
def test_optimizer_overlap_on_writes_the_overlapped_schedule_or_exits_3(tmp_path, capsys):
    """--optimizer-overlap on: where the overlapped schedule of a plan found fits, the plan
    runs it (simulator-checked, the prediction its own) though it is no faster than auto's;
    where none fits, exit 3 in one line naming the option; with layer-major, the layer-major
    overlapped plan (the runtime runs the two together)."""
    from pathlib import Path
    from planner.cli import main
    spec = str(Path(__file__).resolve().parents[1] / "bench/models/gpt-stream.yaml")
    prof = tmp_path / "p.json"
    assert main(["profile", spec, "--batch", "2", "--seq", "64", "--dtype", "fp32",
                 "-o", str(prof)]) == 0
    common = [str(prof), "--nvme-mem", "10G", "--micro-batches", "2", "--clip", "none"]
    on, auto = tmp_path / "on.json", tmp_path / "auto.json"
    assert main(["solve", *common, "--gpu-mem", "80000000", "--optimizer-overlap", "on",
                 "-o", str(on)]) == 0
    assert main(["solve", *common, "--gpu-mem", "80000000", "-o", str(auto)]) == 0
    p_on, p_auto = Plan.from_dict(json.loads(on.read_text())), \
        Plan.from_dict(json.loads(auto.read_text()))
    assert p_on.optimizer_overlap == "overlapped" and p_on.clip == "none"
    r = simulate(p_on)
    assert r.fits and r.overlapped_s > 0
    assert r.step_s == pytest.approx(p_on.predicted.step_s, rel=1e-9)
    assert p_on.predicted.step_s >= p_auto.predicted.step_s * (1 - 1e-6)
    capsys.readouterr()
    assert main(["solve", *common, "--gpu-mem", "38000000", "--optimizer-overlap", "on",
                 "-o", str(tmp_path / "tight.json")]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--optimizer-overlap on" in err and "gpu" in err
    assert not (tmp_path / "tight.json").exists()
    # on a unified-memory host every unit steps on the device, and under --clip global the
    # state of those on NVMe is read ahead into device memory, as much as the budget leaves
    glob = [str(prof), "--nvme-mem", "10G", "--micro-batches", "2", "--clip", "global"]
    assert main(["solve", *glob, "--gpu-mem", "80000000", "--optimizer-overlap", "on",
                 "-o", str(tmp_path / "glob.json")]) == 0
    p_glob = Plan.from_dict(json.loads((tmp_path / "glob.json").read_text()))
    on_nvme = sum(u.optimizer_bytes for u, d in zip(p_glob.units, p_glob.layers)
                  if d.home.optimizer.value == "nvme")
    assert p_glob.optimizer_overlap == "overlapped" and p_glob.clip == "global"
    assert 0 < p_glob.optimizer_prefetch_bytes <= on_nvme
    r = simulate(p_glob)
    assert r.fits and r.overlapped_s > 0
    assert r.step_s == pytest.approx(p_glob.predicted.step_s, rel=1e-9)
    # what it reads ahead is held in the device's memory beside the backward
    without = simulate(dataclasses.replace(p_glob, optimizer_prefetch_bytes=0))
    assert r.peak_gpu_bytes - without.peak_gpu_bytes == pytest.approx(
        p_glob.optimizer_prefetch_bytes, abs=1)
    # and plan inspect says how much
    from planner.sizes import fmt_bytes
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "glob.json")]) == 0
    head = capsys.readouterr().out.splitlines()[1]
    assert head.endswith(f"optimizer overlapped, clip global, state read ahead "
                         f"{fmt_bytes(p_glob.optimizer_prefetch_bytes)})"), head
    lm = tmp_path / "lm.json"
    assert main(["solve", *common, "--gpu-mem", "80000000", "--optimizer-overlap", "on",
                 "--micro-batch-order", "layer-major", "-o", str(lm)]) == 0
    p_lm = Plan.from_dict(json.loads(lm.read_text()))
    assert (p_lm.micro_batch_order, p_lm.optimizer_overlap) == ("layer-major", "overlapped")
    r = simulate(p_lm)
    assert r.fits and r.overlapped_s > 0


def test_what_the_runtime_steps_at_opt_step_is_released_at_the_last_stage():
    """The runtime starts a unit's early work once its gradient is home off the device or,
    kept on the device, once its backward stage is over (runtime/apply.py ``_on_stage``);
    the resident home is the user's optimizer's, stepped at opt.step(): nothing of it is
    priced inside the backward."""
    from planner.formats import Home, Tier as T
    hw = load_hardware("h200")
    prof = uniform_profile(6, hw)
    cm = cost_model(prof, hw, Budgets(8 * GiB, 512 * GiB, 0),
                    optimizer_overlap="overlapped", clip="none")
    top = 2 * cm.U
    for j in range(1, cm.U - 1):
        assert cm.release_stage(j, Home()) == top
        kept = [h for h in cm.homes[j] if h.grads is T.GPU and not h.resident]
        assert kept and all(cm.release_stage(j, h) == cm.L.bwd(j) for h in kept)
        sent = [h for h in cm.homes[j] if h.grads is T.CPU]
        assert sent and all(cm.release_stage(j, h) >= cm.L.bwd(j) for h in sent)
