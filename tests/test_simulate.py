"""The simulator: exact memory and time of small plans, the stage-duration rules, consistency
checks on edited plans, golden plans, and plans of the previous schema."""
import dataclasses
import json
import subprocess
import sys

import pytest

from planner.costmodel import STEP_PIECE_BYTES
from planner.costmodel.baselines import baseline_layers
from planner.errors import UserError
from planner.formats.events import Op, Stream
from planner.formats import (IO_BLOCK_BYTES, Activation as Act, Budgets, HardwareSpec, Home,
                             LayerDecision as LD,
                             Tier as T)
from planner.plans.load import load_plan
from golden import golden_plans
from planner.plans import make_plan, plan_and_sim, save_plan
from planner.plans.simulate import PlanInconsistent, simulate
from synthetic import uniform_profile


def spec(unified=False, link=100.0, duplex=0.0, nvme_r=50.0, nvme_w=25.0):
    return HardwareSpec(name="unified" if unified else "toy", description="test",
                        device="cpu" if unified else "cuda", unified_memory=unified,
                        memory_bytes=10**9, host_memory_bytes=0 if unified else 10**10,
                        peak_flops={"bf16": 1e9}, efficiency=1.0, memory_bandwidth=1e9,
                        h2d_bandwidth=0 if unified else link, d2h_bandwidth=0 if unified else link,
                        duplex_bandwidth=duplex, nvme_read_bandwidth=nvme_r,
                        nvme_write_bandwidth=nvme_w, nvme_bytes=10**10, host_memory_bandwidth=1e9,
                        cpu_adam_params_per_s=0 if unified else 1e9, staging_buffer_bytes=64)


def prof(n, hw, **kw):
    args = dict(fwd_s=1.0, saved_bytes=1000, input_bytes=100, param_bytes=10,
                workspace_bytes=50, head_saved_bytes=2000)
    args.update(kw)
    return uniform_profile(n, hw, **args)


BIG = Budgets(10**12, 10**12, 10**12)


def test_keep_all_memory_and_time_are_exact():
    hw = spec()
    p = prof(2, hw)
    plan, r = plan_and_sim(p, None, hw, BIG, "keep-all", baseline_layers("keep-all", p.layers, hw))
    us = p.layers
    static = sum(u.static_bytes - u.grad_bytes for u in us)
    # the head's backward holds every unit's activations, its own workspace and the gradient
    # it makes (K = 1: the other gradients come later, as activations go)
    assert r.peak_gpu_bytes == (static + sum(u.activation_bytes for u in us)
                                + us[-1].workspace_bytes + us[-1].grad_bytes)
    assert r.pass_s == pytest.approx(sum(u.fwd_s + u.bwd_s for u in us))
    assert r.step_s == pytest.approx(r.pass_s + p.optimizer_s)
    assert r.step_s == pytest.approx(r.compute_s)
    assert plan.predicted.step_s == r.step_s and r.fits
    assert r.peak_cpu_bytes == r.peak_nvme_bytes == 0


def test_a_stage_lasts_as_long_as_its_busiest_resource_and_links_share_duplex():
    # blocks.0 offloaded to the host: its 1000 bytes leave in stage 3 (blocks.1's forward) and
    # come back in stage 6 (blocks.1's backward), 10 s each at 100 B/s against 1 s of compute
    hw = spec(link=100.0, duplex=150.0)
    p = prof(2, hw)
    layers = [LD("embedding", Act.KEEP), LD("blocks.0", Act.CPU), LD("blocks.1", Act.CPU),
              LD("head", Act.KEEP)]
    shares = {("oc", 1, 3): 1.0, ("pc", 1, 6): 1.0, ("oc", 2, 4): 1.0, ("pc", 2, 5): 1.0}
    plan, r = plan_and_sim(p, None, hw, BIG, "x", layers, shares=shares)
    st = {s.stage: s for s in r.stages}
    assert st[3].seconds == pytest.approx(max(1.0, 1000 / 100.0)) and st[3].bound == "d2h"
    assert st[6].seconds == pytest.approx(1000 / 100.0) and st[6].bound == "h2d"
    # both directions in one stage (blocks.0 half out, blocks.1 back): the aggregate rate binds
    shares = {("oc", 1, 3): 0.5, ("oc", 1, 5): 0.5, ("pc", 1, 6): 1.0, ("oc", 2, 4): 1.0,
              ("pc", 2, 5): 1.0}
    plan, r = plan_and_sim(p, None, hw, BIG, "x", layers, shares=shares)
    st = {s.stage: s for s in r.stages}
    assert st[5].loads["d2h"] == pytest.approx(500 / 100.0)
    assert st[5].loads["h2d"] == pytest.approx(1000 / 100.0)
    assert st[5].loads["duplex"] == pytest.approx(1500 / 150.0)
    assert st[5].seconds == pytest.approx(10.0)
    r_full = plan_and_sim(p, None, dataclasses.replace(hw, duplex_bandwidth=0.0), BIG, "x",
                          layers, shares=shares)[1]
    assert r_full.stages[5].loads["duplex"] == pytest.approx(1500 / 200.0)   # full duplex


def test_reads_and_writes_share_one_drive():
    hw = spec(unified=True, nvme_r=50.0, nvme_w=25.0)
    p = prof(2, hw)
    layers = [LD("embedding", Act.KEEP), LD("blocks.0", Act.NVME), LD("blocks.1", Act.NVME),
              LD("head", Act.KEEP)]
    # blocks.1 writes in stage 4 while blocks.0 ... reads nothing yet; put a read there
    plan, r = plan_and_sim(p, None, hw, Budgets(10**12, 0, 10**12), "x", layers,
                           shares={("on", 1, 3): 1.0, ("pn", 1, 5): 1.0,
                                   ("on", 2, 4): 1.0, ("pn", 2, 5): 1.0})
    st = {s.stage: s for s in r.stages}
    assert st[5].loads["nvme"] == pytest.approx(2000 / 50.0)
    assert st[4].loads["nvme"] == pytest.approx(1000 / 25.0)
    assert r.peak_nvme_bytes == 2000


def test_later_passes_read_gradient_accumulators_back():
    hw = spec(unified=True)
    p = prof(2, hw, param_bytes=1000)
    home = Home(T.NVME, T.NVME, T.NVME, T.GPU)
    layers = [LD(u.name, Act.KEEP, home=home if u.kind == "block" else Home()) for u in p.layers]
    b = Budgets(10**12, 0, 10**12)
    _, r1 = plan_and_sim(p, None, hw, b, "x", layers, micro_batches=1)
    _, r3 = plan_and_sim(p, None, hw, b, "x", layers, micro_batches=3)
    assert r3.pass_s == pytest.approx(r1.pass_s)
    assert r3.rest_pass_s > r3.pass_s            # each later pass also reads 2 x 1000 B back
    assert r3.step_s == pytest.approx(r3.pass_s + 2 * r3.rest_pass_s + r3.optimizer_s)
    assert r3.optimizer_s == pytest.approx(r1.optimizer_s)


def test_streamed_weights_are_on_the_device_only_while_needed():
    hw = spec(unified=True)
    p = prof(3, hw, param_bytes=400, saved_bytes=0, workspace_bytes=0, head_saved_bytes=0,
             input_bytes=0)
    home = Home(T.NVME, T.GPU, T.GPU, T.GPU)
    layers = [LD(u.name, Act.KEEP, home=home if u.kind == "block" else Home()) for u in p.layers]
    # each block's weights come in the stage before its forward and before its backward
    shares = {}
    for i in (1, 2, 3):
        shares["wfn", i, i] = 1.0                       # stage fwd(i) - 1 = i
        shares["wbn", i, 2 * 5 - i - 1] = 1.0           # stage bwd(i) - 1, U = 5
    plan, r = plan_and_sim(p, None, hw, Budgets(10**12, 0, 10**12), "x", layers, shares=shares)
    # resident: weights and state (less the streamed blocks' weights), and with K = 1 the
    # gradients made so far (unit i's from its backward, stage 2U - i, on)
    resident = sum(u.static_bytes - u.grad_bytes for u in p.layers) - 3 * 400
    made = {s: sum(u.grad_bytes for i, u in enumerate(p.layers) if 2 * 5 - i <= s)
            for s in range(11)}
    # and on a CPU host the disk requests' bounce buffer, which the plan prices as its
    # staging pool: one request holds these weights and a partial block at each end
    assert r.staging_bytes == 400 + 2 * IO_BLOCK_BYTES
    held = {s.stage: s.memory["gpu"] - resident - made[s.stage] - r.staging_bytes
            for s in r.stages if s.phase != "optimizer"}
    assert held[2] == 800          # blocks.0 computes, blocks.1's weights arrive
    assert held[4] == 400          # blocks.2 computes; blocks.1's copy went with its forward
    assert held[5] == 0            # the head: no block needs weights
    assert held[7] == 800          # blocks.1's backward, blocks.0's arriving
    assert held[9] == 400          # blocks.0's backward
    assert held[10] == 0           # the embedding's backward
    assert r.peak_nvme_bytes == 3 * 400


def test_an_edited_schedule_is_refused():
    hw = spec()
    p = prof(2, hw)
    plan = make_plan(p, None, hw, BIG, "offload-all", baseline_layers("offload-all", p.layers, hw))
    d = plan.to_dict()
    d["schedule"]["d2h"][0]["bytes"] += 1
    edited = type(plan).from_dict(d, "edited")
    with pytest.raises(PlanInconsistent, match="should be"):
        simulate(edited)
    d = plan.to_dict()
    d["schedule"]["h2d"].pop()
    with pytest.raises(PlanInconsistent, match="regenerate it"):
        simulate(type(plan).from_dict(d, "edited"))
    d = plan.to_dict()
    d["layers"][1]["activation"] = "keep"
    with pytest.raises(PlanInconsistent, match="unexpected"):
        simulate(type(plan).from_dict(d, "edited"))


def test_over_budget_lines_name_the_tier():
    hw = spec()
    p = prof(2, hw)
    plan, r = plan_and_sim(p, None, hw, Budgets(1000, 10**12, 10**12), "keep-all",
                           baseline_layers("keep-all", p.layers, hw))
    assert not r.fits and r.budget_violations[0].startswith("gpu: peak")
    plan, r = plan_and_sim(p, None, hw, Budgets(10**12, 10**12, 1500), "offload-all",
                           [LD(d.name, Act.NVME if d.activation is Act.CPU else d.activation)
                            for d in baseline_layers("offload-all", p.layers, hw)])
    assert r.budget_violations[0].startswith("nvme: peak")
    # NVMe traffic on CUDA goes through pinned staging on the host, which --cpu-mem 0 forbids
    plan, r = plan_and_sim(p, None, hw, Budgets(10**12, 0, 10**12), "x",
                           [LD(d.name, Act.NVME if d.activation is Act.CPU else d.activation)
                            for d in baseline_layers("offload-all", p.layers, hw)])
    assert "cpu: budget 0 means the tier stays unused" in r.budget_violations[0]


@pytest.mark.parametrize("name", sorted(golden_plans()))
def test_golden_plans_simulate_to_their_prediction(name, tmp_path):
    from planner import PLANS_DIR
    plan = load_plan(PLANS_DIR / "golden" / f"{name}.json")
    r = simulate(plan)
    assert r.step_s == plan.predicted.step_s and r.fits
    assert r.peak_gpu_bytes == plan.predicted.peak_gpu_bytes
    fresh = golden_plans()[name]
    assert fresh.to_dict()["schedule"] == plan.to_dict()["schedule"], \
        "plans/golden is stale: python tests/golden.py"


def test_golden_plans_cover_every_kind_of_event():
    kinds = set()
    for plan in golden_plans().values():
        kinds |= {(e.stream, e.op, e.cls) for e in plan.all_events()}
    ops = {(s, o) for s, o, _ in kinds}
    for want in [(Stream.D2H, Op.OFFLOAD), (Stream.H2D, Op.PREFETCH), (Stream.H2D, Op.UPLOAD),
                 (Stream.NVME, Op.WRITE), (Stream.NVME, Op.READ), (Stream.HOST, Op.ACCUMULATE),
                 (Stream.HOST, Op.STEP), (Stream.COMPUTE, Op.RECOMPUTE), (Stream.COMPUTE, Op.STEP)]:
        assert want in ops, want


def test_a_plan_of_the_previous_schema_loads_with_its_decisions(tmp_path):
    from pathlib import Path
    old = Path(__file__).parent / "data" / "plan-v1-h200-mixed.json"
    plan = load_plan(old)
    d = json.loads(old.read_text())
    assert [x.activation.value for x in plan.layers] == [x["activation"] for x in d["layers"]]
    assert all(x.home.resident for x in plan.layers)
    assert "upgraded from tierplan.plan/1" in plan.solver.status
    r = simulate(plan)
    assert r.fits
    save_plan(plan, tmp_path / "v2.json")
    assert load_plan(tmp_path / "v2.json").schema == "tierplan.plan/3"


def test_simulate_cli_json(tmp_path):
    hw = spec()
    p = prof(2, hw)
    plan = make_plan(p, None, hw, BIG, "sqrt", baseline_layers("sqrt", p.layers, hw))
    path = save_plan(plan, tmp_path / "p.json")
    out = subprocess.run([sys.executable, "-m", "planner.cli", "simulate", str(path), "--json"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    for k in ("step_s", "compute_s", "peak_gpu_bytes", "peak_cpu_bytes", "peak_nvme_bytes", "fits"):
        assert k in d
    assert d["step_s"] == plan.predicted.step_s and d["fits"] is True


def test_shared_tensors_a_units_own_prologue_made_are_held_from_its_forward_to_its_backward(
        tmp_path):
    """Code between two blocks is the later block's prologue; what it saves is kept by
    reference, so the profile names the block itself as the producer (Jamba's attention
    layers between its Mamba blocks). Such a profile loads, and the cost model holds those
    bytes from the block's forward to its backward, nowhere else (it skipped them before)."""
    from planner.formats import load_profile, write_json_atomic
    from planner.hardware import load_hardware
    from planner.plans import cost_model
    hw = load_hardware("a100-80g")
    prof = uniform_profile(4, hw)
    j, S = 2, 300_000_000
    layers = list(prof.layers)
    layers[j] = dataclasses.replace(layers[j], saved_bytes=layers[j].saved_bytes + S,
                                    shared_saved_bytes=S, shared_from=layers[j].name)
    path = tmp_path / "p.json"
    write_json_atomic(path, dataclasses.replace(prof, layers=layers).to_dict())
    loaded = load_profile(str(path))
    assert loaded.layers[j].shared_from == layers[j].name
    budgets = Budgets(10**12, 10**12, 0)
    before, after = cost_model(prof, hw, budgets), cost_model(loaded, hw, budgets)
    L = after.L
    assert [a - b for a, b in zip(after.shared, before.shared)] == [
        S if L.fwd(j) <= s <= L.bwd(j) else 0 for s in range(len(after.shared))]
    # the simulator charges them too: keep-all's peak rises by S
    peaks = [plan_and_sim(p, None, hw, budgets, "keep-all",
                          baseline_layers("keep-all", p.layers, hw))[1].peak_gpu_bytes
             for p in (prof, loaded)]
    assert peaks[1] - peaks[0] == S


def test_the_optimizer_workspace_is_what_each_step_steps_at_once():
    """The profile's optimizer workspace (two fp32 temporaries of the largest tensor) is
    charged for a step of whole tensors; a unit stepped by pieces (its state on NVMe) holds at
    most 8 bytes per element of one piece, and a small unit 8 bytes per parameter. Found on a
    NanoChat plan whose optimizer phase was predicted 270 MiB above what it measured: the
    whole embedding's temporaries were charged though the runtime steps it 16 MiB at a time."""
    hw = spec(unified=True)
    M = 2 ** 20
    p = prof(2, hw, param_bytes=256 * M, saved_bytes=0, workspace_bytes=0, head_saved_bytes=0,
             input_bytes=0)
    big = 8 * p.layers[0].param_count          # two fp32 temporaries of a unit's tensor
    p = dataclasses.replace(p, optimizer_workspace_bytes=big)
    budgets = Budgets(10**13, 0, 10**13)

    def opt_phase_gpu(home_of):
        layers = [LD(u.name, Act.KEEP, home=home_of(u)) for u in p.layers]
        plan, r = plan_and_sim(p, None, hw, budgets, "x", layers)
        resident = sum(sum(v for v in (u.param_bytes if h.home.weights is T.GPU else 0,
                                       u.grad_bytes if h.home.grads is T.GPU else 0,
                                       u.optimizer_bytes if h.home.optimizer is T.GPU else 0))
                       for u, h in zip(p.layers, layers))
        phase = next(s for s in r.stages if s.phase == "optimizer")
        return phase.memory["gpu"] - resident - r.staging_bytes, plan

    # every unit resident: the user's optimizer steps whole tensors, the profile's figure
    ws, _ = opt_phase_gpu(lambda u: Home())
    assert ws == big
    # every unit's state on NVMe: a piece of 16 MiB of state is 16 MiB / 12 bytes per element
    # (master and two moments of bf16 weights); each of the opt_depth steps in flight holds
    # its piece, and the one stepping its temporaries
    nv = Home(T.GPU, T.GPU, T.NVME, T.GPU)
    ws, plan = opt_phase_gpu(lambda u: nv)
    per_element = p.layers[0].optimizer_bytes / p.layers[0].param_count
    piece_elems = -(-STEP_PIECE_BYTES // per_element)
    assert ws == pytest.approx(plan.optimizer_depth * STEP_PIECE_BYTES + 8 * piece_elems,
                               abs=8 * per_element)
    assert ws - plan.optimizer_depth * STEP_PIECE_BYTES < big / 20
