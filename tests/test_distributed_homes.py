"""Homes per rank under FSDP2 (issue 29, the planner side): a rank's shards of weights,
gradients and optimizer state on GPU / host / NVMe; per-rank sizes, the node's NVMe, host
memory bandwidth and CPU step shared by its ranks, the upload before the all-gather and the
download after the reduce-scatter, the simulator agreeing with the MILP, DDP refused, and a
small model's plan at world size 2 on this CPU host with NVMe homes."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from planner.costmodel.baselines import baseline_layers
from planner.errors import UserError
from planner.formats import Budgets, Home, Tier, load_plan
from planner.hardware import load_hardware
from planner.plans import cost_model, plan_and_sim, save_plan
from planner.plans.simulate import simulate
from planner.solve import solve_profile
from synthetic import uniform_profile

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3
H100 = load_hardware("h100-80g")
CPU = Home(Tier.CPU, Tier.CPU, Tier.CPU, Tier.CPU)


def _prof(n=6):
    return uniform_profile(n, H100, jitter=0.1, seed=3, param_bytes=400_000_000)


def test_per_rank_sizes_and_homes_only_for_blocks():
    p = _prof()
    cm = cost_model(p, H100, Budgets(80 * GIB, 1024 * GIB, 4000 * GIB), world_size=16,
                    ranks_per_node=8, engine="fsdp2")
    for i, u in enumerate(p.layers):
        assert cm.N[i] == -(-u.param_count // 16) and cm.Nfull[i] == u.param_count
        assert cm.P[i] == -(-u.param_bytes // 16)
        if u.kind == "block":
            # the first block (i 1) has no stage for its gradient after its reduce-scatter
            assert (CPU in cm.homes[i]) == (i > 1) and len(cm.homes[i]) > 1
        else:
            assert cm.homes[i] == [Home()]        # FSDP2's root group stays gathered
    # a rank's CPU step steps its shard at 1/R of the node's cores
    i = 2
    dev, host = cm.step_seconds(i, CPU)
    assert dev == 0.0
    assert host == pytest.approx(cm.N[i] / (H100.cpu_adam_params_per_s / 8), rel=1e-12)


def test_shared_bandwidth_per_rank_and_the_plan_records_the_node_spec(tmp_path):
    p = _prof()
    b = Budgets(80 * GIB, 1024 * GIB, 4000 * GIB)
    cm = cost_model(p, H100, b, world_size=16, ranks_per_node=8, engine="fsdp2")
    assert cm.hw.nvme_read_bandwidth == H100.nvme_read_bandwidth / 8
    assert cm.hw.nvme_write_bandwidth == H100.nvme_write_bandwidth / 8
    assert cm.hw.host_memory_bandwidth == H100.host_memory_bandwidth / 8
    assert cm.hw.cpu_adam_params_per_s == H100.cpu_adam_params_per_s / 8
    # the PCIe links are one per GPU: not shared
    assert (cm.hw.h2d_bandwidth, cm.hw.d2h_bandwidth) == (H100.h2d_bandwidth, H100.d2h_bandwidth)
    # a variant rebuilt from the model shares from the node's figures again, not twice
    again = dataclasses.replace(cm, optimizer_depth=1)
    assert again.hw.nvme_read_bandwidth == H100.nvme_read_bandwidth / 8
    one_per_node = cost_model(p, H100, b, world_size=16, ranks_per_node=1, engine="fsdp2")
    assert one_per_node.hw.nvme_read_bandwidth == H100.nvme_read_bandwidth
    layers = baseline_layers("keep-all", p.layers, H100)
    layers[3] = dataclasses.replace(layers[3], home=Home(Tier.NVME, Tier.CPU, Tier.NVME, Tier.CPU))
    plan, r = plan_and_sim(p, None, cm.hw, b, "keep-all", layers, cm=cm)
    assert plan.hardware["nvme_read_bandwidth"] == H100.nvme_read_bandwidth
    path = tmp_path / "p.json"
    save_plan(plan, path)
    again = simulate(load_plan(path))
    assert again.step_s == pytest.approx(r.step_s, rel=1e-12)
    # the same plan with one rank per node moves the NVMe bytes 8x faster: a shorter step
    cm1 = cost_model(p, H100, b, world_size=16, ranks_per_node=1, engine="fsdp2")
    _, r1 = plan_and_sim(p, None, H100, b, "keep-all", layers, cm=cm1)
    assert r1.step_s < r.step_s


def test_shards_move_clear_of_their_collectives():
    p = _prof()
    cm = cost_model(p, H100, Budgets(80 * GIB, 1024 * GIB, 4000 * GIB), world_size=8,
                    ranks_per_node=8, engine="fsdp2")
    one = cost_model(p, H100, Budgets(80 * GIB, 1024 * GIB, 4000 * GIB))
    L = cm.L
    for i, u in enumerate(p.layers):
        if u.kind != "block":
            continue
        f, b = L.fwd(i), L.bwd(i)
        # the upload ends before the stage of the all-gather (f-1, b-1) ...
        assert cm.window("wfc", i) and max(cm.window("wfc", i)) == f - 2
        assert max(one.window("wfc", i)) == f - 1
        if cm.window("wbc", i):
            assert max(cm.window("wbc", i)) == b - 2
        # ... and the gradient shard goes down after the reduce-scatter (b+1)
        if cm.window("gdc", i):
            assert min(cm.window("gdc", i)) == b + 2
        assert not cm.valid_stage("gdc", i, b + 1) and one.valid_stage("gdc", i, b + 1)
        assert not cm.valid_stage("wfc", i, f - 1) and one.valid_stage("wfc", i, f - 1)
    # the first block's backward is the last but one stage: no stage left for its gradient
    assert not cm.window("gdc", 1)
    assert all(h.grads is Tier.GPU for h in cm.homes[1])


def test_ddp_keeps_every_home_on_the_device():
    p = _prof()
    b = Budgets(80 * GIB, 1024 * GIB, 4000 * GIB)
    ddp = cost_model(p, H100, b, world_size=2, ranks_per_node=2, engine="ddp")
    assert all(h == [Home()] for h in ddp.homes)
    with pytest.raises(UserError, match="not planned under --engine ddp"):
        solve_profile(p, None, H100, b, world_size=2, engine="ddp", stream="on", time_limit=10)


def test_solved_plan_streams_shards_when_they_do_not_fit_and_the_simulator_agrees(tmp_path):
    # 6 blocks of 4 GB of bf16 weights: 16 B/param of static state is 6 x 32 GB; on 2 ranks a
    # rank's shards alone are 96 GB, over an 80G GPU: only homes on the host make it fit
    p = uniform_profile(6, H100, param_bytes=4_000_000_000, seed=1)
    b = Budgets(80 * GIB, 2048 * GIB, 0)
    out = solve_profile(p, None, H100, b, world_size=2, ranks_per_node=2, engine="fsdp2",
                        time_limit=60, shard_homes="all")
    plan = out.plan
    assert out.sim.fits
    off = [d for d in plan.layers if not d.home.resident]
    assert off and all(d.home.weights is not Tier.NVME for d in off)   # no NVMe budget
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    r = simulate(load_plan(path))
    assert r.fits and r.step_s == pytest.approx(plan.predicted.step_s, rel=1e-9)
    assert r.peak_gpu_bytes <= 80 * GIB
    # the MILP's objective is the simulated step (within its gap)
    if out.milp_objective is not None:
        assert out.milp_objective == pytest.approx(out.sim.step_s, rel=1e-6)


def _cli(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_gpt_tiny_world_size_2_on_the_cpu_host_gets_nvme_homes(tmp_path):
    """The plan the runtime's two-rank test replays: gpt-tiny, 2 ranks, cpu-host, a budget
    under its shards plus activations, NVMe homes."""
    prof = tmp_path / "tiny.json"
    r = _cli("profile", "gpt-tiny", "--device", "meta", "--hardware", "cpu-host", "--batch", "2",
             "--seq", "64", "-o", str(prof))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "plan.json"
    nv = tmp_path / "nv"
    r = _cli("solve", str(prof), "--world-size", "2", "--engine", "fsdp2", "--hardware",
             "cpu-host", "--gpu-mem", "3.5M", "--nvme-mem", "1G", "--nvme-dir", str(nv),
             "--time-limit", "30", "--shard-homes", "all", "-o", str(out))
    assert r.returncode == 0, r.stderr
    plan = load_plan(out)
    assert (plan.world_size, plan.engine) == (2, "fsdp2")
    nvme = [d for d in plan.layers if Tier.NVME in (d.home.weights, d.home.grads, d.home.optimizer)]
    assert nvme, [d.home.label() for d in plan.layers]
    sim = _cli("simulate", str(out), "--json")
    assert sim.returncode == 0 and json.loads(sim.stdout)["fits"], sim.stdout
    # the same budget without NVMe does not fit: the homes are what makes it fit
    r = _cli("solve", str(prof), "--world-size", "2", "--engine", "fsdp2", "--hardware",
             "cpu-host", "--gpu-mem", "3.5M", "--time-limit", "30", "-o", str(tmp_path / "n.json"))
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr


def test_default_shard_homes_are_the_ones_the_runtime_executes():
    """``--shard-homes runnable`` (the default) offers a block the device or its whole shard on
    the host stepped on the CPU (FSDP2's CPUOffloadPolicy), and on a unified device with NVMe
    any of its shard's classes there (runtime/sharded.py NvmeShards); ``all`` offers every
    NVMe and split home."""
    p = uniform_profile(6, H100, param_bytes=4_000_000_000, seed=1)
    b = Budgets(80 * GIB, 2048 * GIB, 4096 * GIB)
    run = cost_model(p, H100, b, world_size=2, ranks_per_node=2, engine="fsdp2",
                     shard_homes="runnable")
    every = cost_model(p, H100, b, world_size=2, ranks_per_node=2, engine="fsdp2")
    host = Home(Tier.CPU, Tier.CPU, Tier.CPU, Tier.CPU)
    blocks = [i for i, u in enumerate(run.units) if u.kind == "block"]
    assert blocks and all(set(run.homes[i]) <= {Home(), host} for i in range(run.U))
    assert any(host in run.homes[i] for i in blocks)
    assert any(any(h.weights is Tier.NVME for h in every.homes[i]) for i in blocks)
    cpu = load_hardware("cpu-host")
    q = uniform_profile(6, cpu, param_bytes=4_000_000, seed=1)
    # on a unified device (gloo ranks on a CPU host): each tensor class's shard on NVMe or on
    # the device, the step on the device (NvmeShards)
    lean = cost_model(q, cpu, Budgets(64 * 1024**2, 0, GIB), world_size=2, ranks_per_node=2,
                      engine="fsdp2", shard_homes="runnable")
    q_blocks = [i for i, u in enumerate(lean.units) if u.kind == "block"]
    nvme = Home(Tier.NVME, Tier.GPU, Tier.NVME, Tier.GPU)
    nvme_all = Home(Tier.NVME, Tier.NVME, Tier.NVME, Tier.GPU)
    assert all(nvme in lean.homes[i] for i in q_blocks)
    # (not the first block: a gradient needs a stage after its backward to leave in)
    assert any(nvme_all in lean.homes[i] for i in q_blocks)
    assert all(h.step is Tier.GPU and Tier.CPU not in (h.weights, h.grads, h.optimizer)
               for hs in lean.homes for h in hs)
    bare = cost_model(q, cpu, Budgets(64 * 1024**2, 0, 0), world_size=2, ranks_per_node=2,
                      engine="fsdp2", shard_homes="runnable")
    assert all(h == [Home()] for h in bare.homes)       # no NVMe: nothing leaves the device
