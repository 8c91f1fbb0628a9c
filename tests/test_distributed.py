"""Per-rank plans under FSDP2 and DDP: the cost model's sharding and collectives, exact in
bytes and seconds; every rank's gradients and weights equal the engine's own under every plan
(2 ranks, gloo, CPU); wrong wrapping orders refused in one line; nothing left on disk after a
normal run, an exception or SIGINT on one rank."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_harness as H
from planner.costmodel.baselines import baseline_layers
from planner.errors import UserError
from planner.formats.events import Op, Stream
from planner.formats import Activation, Budgets, LayerDecision, Tier, load_plan
from planner.hardware import load_hardware
from planner.plans import cost_model, make_plan, plan_and_sim
from planner.costmodel.schedule import validate_layers
from planner.solve import solve_profile
from synthetic import uniform_profile

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3
H100 = load_hardware("h100-80g")


def _prof(n=4):
    return uniform_profile(n, H100, jitter=0.1, seed=2, param_bytes=400_000_000)


def _ceil(x, n):
    return -(-x // n)


# ----------------------------------------------------------------------------- cost model

def test_one_rank_without_engine_is_the_single_process_model():
    p = _prof()
    b = Budgets(80 * GIB, 512 * GIB, 0)
    a = make_plan(p, None, H100, b, "sqrt", baseline_layers("sqrt", p.layers, H100))
    cm = cost_model(p, H100, b, world_size=1, ranks_per_node=1, engine="none")
    c = make_plan(p, None, H100, b, "sqrt", baseline_layers("sqrt", p.layers, H100), cm=cm)
    assert a.to_dict() == c.to_dict()
    assert (a.world_size, a.engine) == (1, "none")
    assert Stream.NET.value not in a.schedule
    assert cm.P == [u.param_bytes for u in p.layers] and cm.engine_static == 0


@pytest.mark.parametrize("N,R", [(2, 2), (8, 8), (16, 8)])
def test_fsdp2_shards_static_state_and_counts_gathered_weights(N, R):
    p = _prof()
    b = Budgets(80 * GIB, 1024 * GIB, 0)
    one = cost_model(p, H100, b, world_size=1, ranks_per_node=1, engine="none")
    cm = cost_model(p, H100, b, world_size=N, ranks_per_node=R, engine="fsdp2")
    U, L = cm.U, cm.L
    for i, u in enumerate(p.layers):
        assert cm.P[i] == _ceil(u.param_bytes, N) and cm.G[i] == _ceil(u.grad_bytes, N)
        assert cm.O[i] == _ceil(u.optimizer_bytes, N)
    assert cm.budget["cpu"] == 1024 * GIB // R      # host budget per node, shared by its ranks
    # keep-all under FSDP2 against the same decisions in one process, stage by stage: the
    # difference is exactly the engine's bytes less the state the shards no longer hold
    layers = baseline_layers("keep-all", p.layers, H100)
    plan, r = plan_and_sim(p, None, H100, b, "keep-all", layers, cm=cm)
    _, r1 = plan_and_sim(p, None, H100, b, "keep-all", layers, cm=one)
    saved = sum(one.P[i] + one.O[i] - cm.P[i] - cm.O[i] for i in range(U))
    for s in L.pass_stages:
        # K = 1: a unit's (sharded) gradient exists from its backward on
        saved_g = sum(one.G[i] - cm.G[i] for i in range(U) if L.bwd(i) <= s)
        got = r.stages[s].memory["gpu"] - r1.stages[s].memory["gpu"]
        assert got == cm.engine_mem[s] - saved - saved_g, s
    P, G = [u.param_bytes for u in p.layers], [u.grad_bytes for u in p.layers]
    root = P[0] + P[-1]
    # the first backward of a block: the root's weights and the head's gradients, the block's
    # weights and the next one's (prefetched), its own unsharded gradients
    i = U - 2
    assert cm.engine_mem[L.bwd(i)] == root + G[0] + G[-1] + P[i] + P[i - 1] + G[i]
    # a forward: the root, this block and the next one's gathered weights
    assert cm.engine_mem[L.fwd(1)] == root + P[1] + P[2]
    assert (plan.world_size, plan.ranks_per_node, plan.engine) == (N, R, "fsdp2")
    assert r.static_bytes == sum(cm.P[i] + cm.O[i] for i in range(U))   # K = 1: no gradients


def test_fsdp2_counts_a_tied_gradient_once():
    """A tied embedding's gradient part: one process holds it as autograd's buffer from the
    head's backward to the embedding's; under FSDP2 the root's unsharded gradients (engine
    memory) hold it already, so with K = 1 it is not counted a second time."""
    from synthetic import random_profile
    p = random_profile(2, H100)
    assert any(u.tied_grad_bytes for u in p.layers)
    b = Budgets(80 * GIB, 512 * GIB, 0)
    one = cost_model(p, H100, b, world_size=1, ranks_per_node=1, engine="none")
    assert any(one._tied_grad_buffers())
    for K in (1, 2):
        cm = cost_model(p, H100, b, K, world_size=4, ranks_per_node=4, engine="fsdp2")
        assert any(cm._tied_grad_buffers()) == (K > 1)

@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_collectives_are_ring_transfers_on_the_net_stream(engine):
    p = _prof()
    N, R = 16, 8
    b = Budgets(80 * GIB, 1024 * GIB, 0)
    cm = cost_model(p, H100, b, world_size=N, ranks_per_node=R, engine=engine)
    # two nodes: the ring runs at the slower of NVLink and the NIC
    bw = min(H100.intra_node_bandwidth, H100.inter_node_bandwidth)
    assert cm.net_bandwidth() == bw
    plan, r = plan_and_sim(p, None, H100, b, "keep-all",
                           baseline_layers("keep-all", p.layers, H100), cm=cm)
    net = plan.events(Stream.NET)
    P = [u.param_bytes for u in p.layers]
    G = [u.grad_bytes for u in p.layers]
    U, L = cm.U, cm.L
    if engine == "fsdp2":
        ag = [e for e in net if e.op is Op.ALL_GATHER]
        rs = [e for e in net if e.op is Op.REDUCE_SCATTER]
        assert len(ag) == 2 + 2 * (U - 2) and len(rs) == U     # root once; blocks fwd + bwd
        assert sum(e.bytes for e in ag) == P[0] + P[-1] + 2 * sum(P[1:-1])
        e = next(e for e in ag if e.unit == p.layers[1].name and e.stage == L.fwd(1) - 1)
        assert math.isclose(e.seconds, (N - 1) / N * P[1] / bw, rel_tol=1e-12)
    else:
        ar = [e for e in net if e.op is Op.ALL_REDUCE]
        assert len(ar) == U and sum(e.bytes for e in ar) == sum(G)
        e = next(e for e in ar if e.unit == p.layers[1].name)
        assert e.stage == L.bwd(1) + 1
        assert math.isclose(e.seconds, 2 * (N - 1) / N * G[1] / bw, rel_tol=1e-12)
        assert cm.engine_static == sum(G)                       # DDP's buckets
    # a stage lasts as long as the longer of its compute and its collectives
    for s in L.pass_stages:
        rec = r.stages[s]
        assert rec.loads["net"] == pytest.approx(sum(x.seconds for x in net if x.stage == s))
        assert rec.seconds == pytest.approx(max(rec.loads.values()))
    assert r.busy_s["net"] == pytest.approx(sum(x.seconds for x in net))


def test_slow_interconnect_shows_in_the_step():
    p = _prof()
    b = Budgets(80 * GIB, 1024 * GIB, 0)
    slow = dataclasses.replace(H100, inter_node_bandwidth=1e9)     # 1 GB/s between nodes
    fast = cost_model(p, H100, b, world_size=8, ranks_per_node=8, engine="fsdp2")
    cm = cost_model(p, slow, b, world_size=16, ranks_per_node=8, engine="fsdp2")
    layers = baseline_layers("keep-all", p.layers, H100)
    _, rf = plan_and_sim(p, None, H100, b, "keep-all", layers, cm=fast)
    _, rs = plan_and_sim(p, None, slow, b, "keep-all", layers, cm=cm)
    # NVLink hides behind compute but for the prologue's gathers (no compute to hide behind)
    assert rf.step_s < 1.06 * rf.compute_s
    assert rs.step_s > 1.5 * rs.compute_s
    bound = {x.bound for x in rs.stages if x.phase != "optimizer"}
    assert "net" in bound


@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_milp_objective_is_the_simulated_step(engine, tmp_path):
    p = uniform_profile(6, H100, jitter=0.2, seed=5)
    cm = cost_model(p, H100, Budgets(80 * GIB, 0, 0), world_size=4, ranks_per_node=4,
                    engine=engine)
    keep = plan_and_sim(p, None, H100, Budgets(80 * GIB, 0, 0), "keep-all",
                        baseline_layers("keep-all", p.layers, H100), cm=cm)[1]
    act = sum(u.activation_bytes for u in p.layers if u.kind == "block")
    b = Budgets(int(keep.peak_gpu_bytes - 0.5 * act), 256 * GIB, 0)
    out = solve_profile(p, None, H100, b, time_limit=60, world_size=4, ranks_per_node=4,
                        engine=engine)
    assert out.sim.fits and out.plan.engine == engine and out.plan.world_size == 4
    assert {d.activation for d in out.plan.layers} - {Activation.KEEP}, "nothing was planned"
    if out.milp_objective is not None:
        assert out.milp_objective == pytest.approx(out.sim.step_s, rel=1e-6)
    # the written plan replays to its prediction from the file alone
    from planner.plans import save_plan
    from planner.plans.simulate import simulate
    save_plan(out.plan, tmp_path / "p.json")
    again = simulate(load_plan(tmp_path / "p.json"))
    assert again.step_s == out.plan.predicted.step_s
    assert again.peak_gpu_bytes == out.plan.predicted.peak_gpu_bytes


def test_edited_distributed_plans_are_refused(tmp_path):
    from planner.plans import save_plan
    from planner.plans.simulate import PlanInconsistent, simulate
    p = _prof()
    b = Budgets(80 * GIB, 0, 0)
    cm = cost_model(p, H100, b, world_size=4, ranks_per_node=4, engine="fsdp2")
    plan = make_plan(p, None, H100, b, "keep-all", baseline_layers("keep-all", p.layers, H100),
                     cm=cm)
    d = plan.to_dict()
    d["schedule"].pop("net")                   # the collectives dropped by hand
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanInconsistent, match="missing"):
        simulate(load_plan(path))
    d = plan.to_dict()
    d["engine"] = "none"                       # four ranks without an engine
    path.write_text(json.dumps(d))
    with pytest.raises(UserError, match="world_size 4 needs engine fsdp2 or ddp"):
        load_plan(path)


def test_fsdp2_refuses_segment_recompute_and_ddp_homes_off_the_device():
    p = _prof()
    b = Budgets(80 * GIB, 512 * GIB, 0)
    cm = cost_model(p, H100, b, world_size=2, ranks_per_node=2, engine="fsdp2")
    assert all("rz" not in c for c in cm.choices)
    with pytest.raises(UserError, match="FSDP2 must gather its weights a second time"):
        validate_layers(cm, baseline_layers("sqrt", p.layers, H100))
    from planner.formats import Home
    layers = baseline_layers("keep-all", p.layers, H100)
    # a shard homed on the host: fine under FSDP2 (not the first block: its gradient shard
    # would have no stage left after its reduce-scatter to go down in)
    layers[2] = dataclasses.replace(layers[2], home=Home(Tier.CPU, Tier.CPU, Tier.CPU, Tier.CPU))
    validate_layers(cm, layers)
    ddp = cost_model(p, H100, b, world_size=2, ranks_per_node=2, engine="ddp")
    validate_layers(ddp, baseline_layers("sqrt", p.layers, H100))   # DDP's weights stay put
    with pytest.raises(UserError, match="not planned under ddp"):
        validate_layers(ddp, layers)


def _cli(*args, cwd=None):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "planner.cli", *args], capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=300)


def test_cli_world_size_flags_and_errors(tmp_path):
    from planner.formats import write_json_atomic
    p = uniform_profile(4, H100, name="cli-dist")
    prof = tmp_path / "prof.json"
    write_json_atomic(prof, p.to_dict())
    out = tmp_path / "plan.json"
    r = _cli("solve", str(prof), "--gpu-mem", "80G", "--cpu-mem", "1T", "--world-size", "16",
             "--ranks-per-node", "8", "--engine", "fsdp2", "-o", str(out), "--time-limit", "60")
    assert r.returncode == 0, r.stderr
    plan = load_plan(out)
    assert (plan.world_size, plan.ranks_per_node, plan.engine) == (16, 8, "fsdp2")
    assert "per rank of 16 (fsdp2, 8 per node" in r.stdout
    sim = _cli("simulate", str(out), "--json")
    assert json.loads(sim.stdout)["busy_s"]["net"] > 0
    for bad, msg in [(("--world-size", "3", "--ranks-per-node", "2"), "divisor"),
                     (("--world-size", "2", "--engine", "none"), "need an engine"),
                     (("--world-size", "0"), "number of ranks"),
                     (("--world-size", "2", "--engine", "ddp", "--stream", "on"),
                      "not planned under --engine ddp")]:
        r = _cli("solve", str(prof), "--gpu-mem", "80G", *bad, "-o", str(tmp_path / "x.json"))
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    # a spec without the interconnect figure cannot time the collectives: one line, exit 2
    spec = tmp_path / "nolink.yaml"
    text = (REPO / "profiles/hardware/h100-80g.yaml").read_text()
    spec.write_text("\n".join(ln for ln in text.splitlines() if "node_bandwidth" not in ln))
    r = _cli("solve", str(prof), "--gpu-mem", "80G", "--world-size", "2", "--hardware", str(spec),
             "-o", str(tmp_path / "y.json"))
    assert r.returncode == 2 and "intra_node_bandwidth" in r.stderr and "Traceback" not in r.stderr


def test_no_fit_names_the_sharded_static_state(tmp_path):
    p = uniform_profile(4, H100, param_bytes=4 * 10**9)     # 4 x 4 GB of bf16 params
    static = sum(u.static_bytes for u in p.layers)
    assert static > 120 * GIB
    with pytest.raises(UserError) as e:
        solve_profile(p, None, H100, Budgets(60 * GIB, 0, 0), time_limit=30, world_size=2,
                      engine="fsdp2")
    assert e.value.exit_code == 3 and "the smallest --gpu-mem with a plan is" in str(e.value)
    need = e.value.needed_bytes
    assert static / 2 < need      # at least the half of the state each of two ranks holds
    out = solve_profile(p, None, H100, Budgets(80 * GIB, 0, 0), time_limit=30, world_size=16,
                        ranks_per_node=8, engine="fsdp2")
    assert out.sim.fits and out.sim.static_bytes <= static / 16 + 16


# ----------------------------------------------------------------------------- runtime, 2 ranks

@pytest.fixture(scope="module")
def plan_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("dist-plans")


@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_every_rank_equals_the_engine_alone_under_every_plan(engine, plan_dir):
    """Two AdamW steps, dropout on, 2 ranks with their own data: each rank's gradients (both
    steps) and weights equal the engine's without a plan, for keep-all, recompute-all,
    offload-all (NVMe) and the optimal plan at a tight per-rank budget."""
    cases = []
    for name in ("gpt-tiny", "hf-llama"):
        cases += H.plans(name, engine, plan_dir)
    opt = [load_plan(c[2]) for c in cases if c[1] == "optimal"]
    for plan in opt:
        assert {d.activation for d in plan.layers} != {Activation.KEEP}, "optimal kept all"
        assert plan.world_size == 2 and plan.engine == engine
    res = H.run(engine, cases, plan_dir / f"out-{engine}")
    for rank, per in enumerate(res):
        assert set(per) == {f"{c[0]}/{c[1]}" for c in cases}
        for key, x in per.items():
            assert x["grad_diff"] <= 1e-6 and x["weight_diff"] <= 1e-6, (rank, key, x)
            assert x["left"] == [], (rank, key)
            assert x["nonzero_grads"] > 0
            steps = x["report"]["steps"]
            assert len(steps) == 2 and x["report"]["rank"] == rank
            assert x["report"]["world_size"] == 2 and x["report"]["engine"] == engine
            if key.endswith("offload-all"):
                assert steps[-1]["moved"]["nvme_write"] == steps[-1]["moved"]["nvme_read"] > 0
            if engine == "fsdp2":
                # a recompute runs in its unit's backward, when FSDP2 has gathered the weights
                # anyway: no plan adds an all-gather
                assert x["gathers"] == x["gathers_plain"] > 0, (rank, key)
            if rank == 0:
                assert x["report"]["gathered_ranks"] == [0, 1]
    for c in cases:
        assert not Path(c[3]).exists(), c


# ----------------------------------------------------------------------------- one process

def _plan(name, engine, tmp_path, policy="recompute-all", world=1):
    from planner.plans import save_plan
    hw = load_hardware("cpu-host")
    prof = H.profile(name)
    b = Budgets(hw.memory_bytes, 0, 1 << 30)
    cm = cost_model(prof, hw, b, world_size=world, ranks_per_node=world, engine=engine)
    plan = make_plan(prof, None, hw, b, policy, baseline_layers(policy, prof.layers, hw),
                     nvme_dir=str(tmp_path / "nvme"), cm=cm)
    path = tmp_path / f"{engine}-{policy}.json"
    save_plan(plan, path)
    return path


def test_one_rank_fsdp2_plan_matches_plain_fsdp2(one_rank_group, tmp_path):
    for policy in ("recompute-all", "offload-all"):
        path = _plan("gpt-tiny", "fsdp2", tmp_path, policy)
        g0, w0, _, _ = H.train("gpt-tiny", "fsdp2", None, None, 0)
        g, w, rep, _ = H.train("gpt-tiny", "fsdp2", str(path), str(tmp_path / "nvme"), 0)
        for k in range(2):
            assert H._maxdiff(g[k], g0[k]) <= 1e-6
        assert H._maxdiff(w, w0) <= 1e-6
        assert rep["engine"] == "fsdp2" and not (tmp_path / "nvme").exists()


def _line(e):
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_wrong_wrapping_orders_are_refused_in_one_line(one_rank_group, tmp_path):
    from runtime import UnsupportedModelError, apply_plan
    from runtime.engines import EngineError
    from torch.distributed.fsdp import fully_shard
    fsdp = _plan("gpt-tiny", "fsdp2", tmp_path)
    none = _plan("gpt-tiny", "none", tmp_path)
    # a plan for FSDP2 on a model not sharded yet: shard first
    model, batches = H.build("gpt-tiny")
    with pytest.raises(EngineError) as e:
        apply_plan(model, fsdp)
    assert "wrap first" in _line(e) and "fully_shard" in _line(e)
    # a one-process plan applied, then the model sharded: refused at its first forward
    model, batches = H.build("gpt-tiny")
    h = apply_plan(model, none)
    H.wrap(model, "fsdp2")
    with pytest.raises(UnsupportedModelError) as e:
        model(**batches[0])
    assert "fully_shard was called after apply_plan" in _line(e)
    h.remove()
    # blocks sharded but not the root; the root but not the blocks
    model, _ = H.build("gpt-tiny")
    for b in H.blocks_of(model):
        fully_shard(b)
    with pytest.raises(EngineError) as e:
        apply_plan(model, fsdp)
    assert "the root is not" in _line(e)
    model, _ = H.build("gpt-tiny")
    fully_shard(model)
    with pytest.raises(EngineError) as e:
        apply_plan(model, fsdp)
    assert "block blocks.0 is not fully_shard-ed" in _line(e)
    # a sharded model under a one-process plan; a DDP plan on an FSDP2 model
    model, _ = H.build("gpt-tiny")
    with pytest.raises(EngineError) as e:
        apply_plan(H.wrap(model, "fsdp2"), none)
    assert "--world-size N --engine fsdp2" in _line(e)
    ddp = _plan("gpt-tiny", "ddp", tmp_path)
    model, _ = H.build("gpt-tiny")
    with pytest.raises(EngineError) as e:
        apply_plan(H.wrap(model, "fsdp2"), ddp)
    assert "is for ddp but the model is wrapped in fsdp2" in _line(e)
    # the plan's world size against the job's
    two = _plan("gpt-tiny", "fsdp2", tmp_path, world=2)
    model, _ = H.build("gpt-tiny")
    with pytest.raises(EngineError) as e:
        apply_plan(H.wrap(model, "fsdp2"), two)
    assert "this job has 1 rank(s)" in _line(e)
    # DDP after a one-process plan
    model, batches = H.build("gpt-tiny")
    h = apply_plan(model, none)
    wrapped = H.wrap(model, "ddp")
    with pytest.raises(UnsupportedModelError) as e:
        wrapped(**batches[0])
    assert "DistributedDataParallel after apply_plan" in _line(e)
    h.remove()


# ----------------------------------------------------------------------------- faults

@pytest.mark.parametrize("fault", ["exception", "sigint"])
def test_no_offload_file_left_when_one_rank_fails(fault, plan_dir, tmp_path):
    """Rank 0 fails inside the last block's forward of its second step, with offload files
    on disk on both ranks (an exception, or SIGINT to itself); rank 1 is left in a collective
    and is terminated (SIGTERM, as torchrun does). No file or directory is left."""
    cases = [c for c in H.plans("gpt-tiny", "fsdp2", plan_dir) if c[1] == "offload-all"]
    nvme = Path(cases[0][3])
    with pytest.raises(Exception):
        H.run_fault("fsdp2", cases[0][2], str(nvme), fault, tmp_path)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["files"] > 0, "no offload file existed when the fault came"
    assert not nvme.exists(), list(nvme.rglob("*"))


# ----------------------------------------------------------------------------- CUDA, NCCL

@pytest.mark.parametrize("world", [1, 2])
def test_cuda_nccl_ranks_equal_plain_fsdp2_and_ddp(world, tmp_path, monkeypatch):
    """On CUDA with NCCL: one rank (FSDP2 with one rank) or two, recompute and host offload
    (the CUDA-only tier, pinned memory and side streams) against the engine alone."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA device(s); this machine has "
                    f"{torch.cuda.device_count()}")
    from planner.plans import save_plan
    hw = load_hardware("h100-80g")
    for engine in ("fsdp2", "ddp"):
        prof = H.profile("gpt-tiny", "h100-80g")
        b = Budgets(hw.memory_bytes, 64 * GIB, 0)
        cm = cost_model(prof, hw, b, world_size=world, ranks_per_node=world, engine=engine)
        cases = []
        for pol in ("recompute-all", "offload-all"):
            plan = make_plan(prof, None, hw, b, pol, baseline_layers(pol, prof.layers, hw),
                             cm=cm, nvme_dir=str(tmp_path / "nvme"))
            path = tmp_path / f"{engine}-{pol}-{world}.json"
            save_plan(plan, path)
            cases.append(("gpt-tiny", pol, str(path), str(tmp_path / "nvme")))
        monkeypatch.setattr(H, "DEVICE", "cuda")
        res = H.run(engine, cases, tmp_path / f"out-{engine}", world=world)
        for rank, per in enumerate(res):
            for key, x in per.items():
                assert x["grad_diff"] <= 1e-6 and x["weight_diff"] <= 1e-6, (rank, key, x)
                if key.endswith("offload-all"):
                    moved = x["report"]["steps"][-1]["moved"]
                    assert moved["d2h"] == moved["h2d"] > 0
