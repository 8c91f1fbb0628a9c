"""``plan solve`` through ``planner.cli.main``: exit codes, messages, written plans."""
from __future__ import annotations

import json

import pytest

from planner.cli import main
from planner.formats import Budgets, load_plan, write_json_atomic
from planner.hardware import load_hardware
from planner.plans import save_plan
from planner.plans.simulate import simulate
from planner.sizes import fmt_bytes
from synthetic import uniform_profile

H200 = load_hardware("h200")
A100 = load_hardware("a100-80g")
GiB = 1024**3


@pytest.fixture
def prof(tmp_path):
    p = uniform_profile(8, H200, jitter=0.02)
    path = tmp_path / "syn.json"
    write_json_atomic(path, p.to_dict())
    blocks = sum(u.activation_bytes for u in p.layers if u.kind == "block")
    fixed = (p.static_bytes + p.layers[0].activation_bytes + p.layers[-1].activation_bytes
             + max(u.workspace_bytes for u in p.layers))
    return path, p, int(fixed + blocks / 2)


def test_solve_writes_a_plan_that_fits(prof, tmp_path, capsys):
    path, p, gpu = prof
    out = tmp_path / "plan.json"
    rc = main(["solve", str(path), "--gpu-mem", str(gpu), "--cpu-mem", "512G", "-o", str(out)])
    assert rc == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == str(out) and "x compute-only" in lines[1]
    plan = load_plan(out)
    r = simulate(plan)
    assert r.fits and plan.predicted.step_s == r.step_s
    # the MILP and the simulator evaluate one cost model: its objective is the replay's step
    assert plan.solver.origin.startswith("milp")
    assert plan.solver.objective == pytest.approx(r.step_s, rel=1e-6)
    assert plan.budgets.to_dict() == {"gpu_bytes": gpu, "cpu_bytes": 512 * 1024**3,
                                      "nvme_bytes": 0}
    assert plan.nvme_dir.endswith("tierplan-nvme")
    for pol in ("keep-all", "recompute-all", "sqrt", "offload-all"):
        o = tmp_path / f"{pol}.json"
        rc = main(["solve", str(path), "--gpu-mem", "140G", "--cpu-mem", "512G", "--policy", pol,
                   "-o", str(o)])
        assert rc == 0
        b = load_plan(o)
        if simulate(b).peak_gpu_bytes <= gpu:
            assert plan.predicted.step_s <= b.predicted.step_s


def test_default_output_path(prof, tmp_path, monkeypatch):
    path, p, gpu = prof
    monkeypatch.chdir(tmp_path)   # outputs go under the current directory, like any CLI's
    assert main(["solve", str(path), "--gpu-mem", "140G", "--policy", "keep-all"]) == 0
    assert (tmp_path / "plans" / "syn-140G.json").is_file()


@pytest.mark.parametrize("argv", [
    ["--gpu-mem", "80X"], ["--gpu-mem=-1G"], ["--gpu-mem", "80G", "--cpu-mem", "lots"],
    ["--gpu-mem", "80G", "--hardware", "no-such-gpu"],
])
def test_bad_input_exits_2(prof, argv, capsys):
    path, _, _ = prof
    assert main(["solve", str(path), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_bad_profile_files_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["solve", str(bad), "--gpu-mem", "80G"]) == 2
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"schema": "tierplan.plan/2"}))
    assert main(["solve", str(wrong), "--gpu-mem", "80G"]) == 2
    assert main(["solve", str(tmp_path / "missing.json"), "--gpu-mem", "80G"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 3


def test_unified_memory_refuses_cpu_mem(tmp_path, capsys):
    cpu = load_hardware("cpu-host")
    p = uniform_profile(2, cpu, param_bytes=1_000_000, saved_bytes=10_000_000)
    path = tmp_path / "c.json"
    write_json_atomic(path, p.to_dict())
    assert main(["solve", str(path), "--gpu-mem", "20G", "--cpu-mem", "8G"]) == 2
    assert "--cpu-mem 0" in capsys.readouterr().err


def test_too_small_budget_names_smallest_that_fits(prof, tmp_path, capsys):
    path, p, gpu = prof
    small = 64 * 1024**2          # below anything: even streamed, a block's work needs more
    rc = main(["solve", str(path), "--gpu-mem", str(small), "--cpu-mem", "512G",
               "-o", str(tmp_path / "x.json")])
    assert rc == 3
    err = capsys.readouterr().err
    assert "the smallest --gpu-mem with a plan is" in err
    need = int(err.split("with a plan is ")[1].split("(")[1].split(" B)")[0])
    assert need > small
    # and that figure does fit
    rc = main(["solve", str(path), "--gpu-mem", str(need), "--cpu-mem", "512G",
               "-o", str(tmp_path / "y.json")])
    assert rc == 0 and simulate(load_plan(tmp_path / "y.json")).fits
    assert not (tmp_path / "x.json").exists()


def test_remat_only_names_a_budget_at_which_remat_only_fits(prof, tmp_path, capsys):
    """remat-only moves nothing off the device: the budget its exit 3 names is the smallest of
    its own (activation-only) model, not of the model that may stream (which named a budget
    below the one given, and then itself again)."""
    path, p, _ = prof
    small = p.static_bytes                # the state fits, but no activations beside it
    rc = main(["solve", str(path), "--gpu-mem", str(small), "--cpu-mem", "512G",
               "--policy", "remat-only", "-o", str(tmp_path / "x.json")])
    assert rc == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    need = int(err.split("with a plan is ")[1].split("(")[1].split(" B)")[0])
    assert need > small
    rc = main(["solve", str(path), "--gpu-mem", str(need), "--cpu-mem", "512G",
               "--policy", "remat-only", "-o", str(tmp_path / "y.json")])
    assert rc == 0
    plan = load_plan(tmp_path / "y.json")
    assert simulate(plan).fits and all(d.home.resident for d in plan.layers)
    # with the static state itself too big, the line says that the policy keeps it on the device
    rc = main(["solve", str(path), "--gpu-mem", str(small // 2), "--cpu-mem", "512G",
               "--policy", "remat-only", "-o", str(tmp_path / "z.json")])
    assert rc == 3
    err = capsys.readouterr().err.strip()
    assert "--policy remat-only keeps it on the device" in err and len(err.splitlines()) == 1


def test_static_state_too_big_without_other_tiers_says_so(tmp_path, capsys):
    # 175e9 parameters x 16 bytes (bf16 weights+grads, fp32 master and two moments) on 80G,
    # with neither host memory nor NVMe to put any of it in
    p = uniform_profile(4, A100, param_bytes=175_000_000_000 * 16 // 12 // 8)
    path = tmp_path / "gpt3.json"
    write_json_atomic(path, p.to_dict())
    assert main(["solve", str(path), "--gpu-mem", "80G", "--cpu-mem", "0"]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "the static state alone" in err and "exceeds it" in err
    assert "give --cpu-mem or --nvme-mem" in err


@pytest.mark.slow
def test_gpt3_175b_streams_through_one_80g_gpu(tmp_path, capsys):
    """A real gpt3-175b profile (meta, ~3 s): 2.8 TB of static state streams through one
    A100-80G from host memory and NVMe; without them it exits 3 saying why."""
    from planner.profile import profile_model
    p = profile_model("gpt3-175b", 1, 2048, device="meta", hardware=A100)
    path = tmp_path / "gpt3-175b.json"
    write_json_atomic(path, p.to_dict())
    # 16 bytes per parameter (bf16 weights + grads, fp32 master + two moments): ~2.8 TB
    assert p.static_bytes == 16 * p.model["param_count"]
    out = tmp_path / "plan.json"
    assert main(["solve", str(path), "--gpu-mem", "80G", "--cpu-mem", "0", "-o", str(out)]) == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "the static state alone" in err and not out.exists()
    assert main(["solve", str(path), "--gpu-mem", "80G", "--cpu-mem", "512G", "--nvme-mem", "4T",
                 "--time-limit", "120", "-o", str(out)]) == 0
    plan = load_plan(out)
    r = simulate(plan)
    assert r.fits and r.peak_gpu_bytes <= 80 * 1024**3
    # 2.5 TiB of static state, of which 80 GiB at most can stay: nearly every block is homed
    # off the device
    assert sum(1 for d in plan.layers if not d.home.resident) >= 0.9 * len(plan.layers)
    # a joint MILP (depth 3 or, since the interval segments, often depth 1) or the baseline
    assert plan.solver.origin in ("milp", "milp/depth1", "baseline:stream-all+recompute-all")
    assert r.peak_cpu_bytes <= 512 * 1024**3 and r.peak_nvme_bytes <= 4 * 1024**4


def test_highs_through_cli_is_silent_when_piped(prof, tmp_path, capsys):
    # stderr is not a TTY under capsys: no progress lines; and HiGHS's start-up banner (printed
    # by highspy.Highs() on stdout) must not come before the plan's path.
    path, p, gpu = prof
    out = tmp_path / "h.json"
    assert main(["solve", str(path), "--gpu-mem", str(gpu), "--cpu-mem", "512G",
                 "--solver", "highs", "-o", str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.err == ""
    assert cap.out.splitlines()[0] == str(out)
    assert load_plan(out).solver.name == "highs"


def test_highs_progress_line(capsys):
    from types import SimpleNamespace
    from planner.solve.progress import _HighsCallback
    cb = _HighsCallback(progress=True)
    ev = lambda t, inc, bound: SimpleNamespace(data_out=SimpleNamespace(   # noqa: E731
        running_time=t, mip_primal_bound=inc, mip_dual_bound=bound))
    cb(ev(0.5, float("inf"), 0.3))          # no incumbent yet: nothing
    cb(ev(1.5, 0.6, 0.594))                 # gap 0.006 / 0.6 = 1.00%
    cb(ev(2.0, 0.6, 0.597))                 # within a second of the last line: nothing
    cb(ev(2.6, 0.6, 0.597))
    assert capsys.readouterr().err.splitlines() == [
        "  solve:    1.5 s  incumbent 0.60000  gap 1.00%",
        "  solve:    2.6 s  incumbent 0.60000  gap 0.50%"]


def test_a_failing_solver_loses_its_strategy_not_the_solve(prof, tmp_path, capsys,
                                                          monkeypatch):
    """The solver program crashing in one MILP strategy (PuLP's PulpSolverError): plan solve
    still writes the best other candidate, with one warning line naming the failure."""
    import pulp

    def crash(self, solver=None, **kw):
        raise pulp.PulpSolverError("Pulp: Error while executing cbc")
    monkeypatch.setattr(pulp.LpProblem, "solve", crash)
    path, _, gpu = prof
    out = tmp_path / "plan.json"
    assert main(["solve", str(path), "--gpu-mem", str(gpu), "--cpu-mem", "512G",
                 "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "solver failed" in err and "strategy is left out" in err, err
    plan = load_plan(out)
    # the best survivor: a baseline, or a MILP strategy that did not go through the crashed call
    failed = err.split(" strategy is left out")[0].rsplit("the ", 1)[1]
    assert failed and plan.solver.origin.split("/")[0] != failed, (failed, plan.solver.origin)
    assert simulate(plan).fits


def test_exit_3_names_the_smallest_budget_when_a_mip_start_misleads_the_solver(tmp_path):
    """Bloom as ``BloomConfig()`` gives it (a tied 250,880-token embedding), profiled on the
    CPU host at batch 2, seq 32: HiGHS took the GPU-minimising model's first plan as optimal
    (0.450 GB) though its bound said 0.385, so exit 3 named 430 MiB while 368 MiB fits."""
    from pathlib import Path

    from planner.errors import NoFitError
    from planner.formats import Budgets, load_profile
    from planner.solve import solve_profile
    prof = load_profile(Path(__file__).parent / "data" / "profile-bloom-default-b2-s32.json")
    hw = prof.hardware_spec
    with pytest.raises(NoFitError) as e:
        solve_profile(prof, None, hw, Budgets(40 * 2**20, 0, 2 * 2**30), time_limit=30,
                      nvme_dir=str(tmp_path))
    need = e.value.needed_bytes
    assert need < 380 * 2**20, need
    out = solve_profile(prof, None, hw, Budgets(need, 0, 2 * 2**30), time_limit=30,
                        nvme_dir=str(tmp_path))
    assert out.plan.predicted.peak_gpu_bytes + hw.reserved_bytes <= need


def test_exit_3_never_names_a_budget_above_one_that_fits_under_fsdp2_homes(tmp_path):
    """gpt-tiny, 2 FSDP2 ranks on the CPU host with NVMe homes: a plan fit 9 MiB, but exit 3
    at 8 MiB named 10.79 MiB. The dive's polish reported an objective (0.0015 GB) below the
    relaxation's own bound (0.0084 GB), so its plan passed as proven. Such a plan now proves
    nothing, and the search goes on. The polish now reads the objective off the point HiGHS
    returns, not off HiGHS's report of it. (Since the disk's bounce buffer is priced, the
    smallest budget with NVMe homes is 9.15 MiB; all on the device needs 9.74.)"""
    from planner.errors import NoFitError
    from planner.formats import Budgets
    from planner.hardware import load_hardware
    from planner.profile import profile_model
    from planner.solve import solve_profile
    hw = load_hardware("cpu-host")
    prof = profile_model("gpt-tiny", 4, 128, dtype="fp32", device="meta", hardware=hw)

    def solve(mib):
        return solve_profile(prof, None, hw, Budgets(int(mib * 2**20), 0, 2**30),
                             time_limit=30, nvme_dir=str(tmp_path), world_size=2)
    with pytest.raises(NoFitError) as e:
        solve(8)
    need = e.value.needed_bytes
    assert need <= 9.5 * 2**20, need
    out = solve(need / 2**20)
    assert any(not d.home.resident for d in out.plan.layers)
    assert out.plan.predicted.peak_gpu_bytes + hw.reserved_bytes <= need


DEEP_NARROW = """\
name: deep-narrow
family: gpt
n_layers: 64
d_model: 1024
n_heads: 16
d_ff: 4096
vocab_size: 1024
max_seq: 2048
tie_embeddings: false
dtype: bf16
"""


@pytest.mark.parametrize("cpu_gib,tier", [(64, "cpu"), (4, "nvme")])
def test_stream_all_puts_the_checkpoints_off_the_device_when_they_do_not_fit_on_it(
        tmp_path, cpu_gib, tier):
    """64 blocks whose checkpoints (4 GiB) do not fit beside a streamed block in 4 GiB of GPU:
    the stream-all baselines with checkpoints on the device do not fit, so the checkpoints go to
    the host, or to NVMe where the host cannot hold them too. Before, no baseline fitted
    (gpt3-175b at b16 and b32 on one A100 ended in exit 3 this way)."""
    from planner.plans import cost_model
    from planner.profile import profile_model
    from planner.solve.strategies import baselines
    (tmp_path / "deep.yaml").write_text(DEEP_NARROW)
    hw = load_hardware("a100-80g")
    p = profile_model(str(tmp_path / "deep.yaml"), 16, 2048, device="meta", hardware=hw)
    b = Budgets(4 * GiB, cpu_gib * GiB, 64 * GiB)
    cands = {c.origin.split(":", 1)[1]: c for c in baselines(p, None, b, cost_model(p, hw, b),
                                                              str(tmp_path / "n"))}
    assert not cands["stream-all+recompute-all"].sim.fits
    assert not cands["stream-all+keep-all"].sim.fits
    off = cands[f"stream-all+recompute-all/checkpoints-{tier}"]
    assert off.sim.fits
    blocks = [d for d, u in zip(off.plan.layers, p.layers) if u.kind == "block"]
    assert blocks and all(d.checkpoint.value == tier for d in blocks)
    assert all(d.home.streams_weights for d in blocks)
    # the plan is simulator-checked like every other and survives a round trip through its file
    path = save_plan(off.plan, tmp_path / "p.json")
    assert simulate(load_plan(path)).fits


@pytest.mark.parametrize("spec", ["cpu-host", "h200"])
def test_frozen_units_keep_their_empty_grads_and_state_on_the_device(spec, tmp_path, capsys):
    """peft LoRA: the frozen embedding and head have weights but no gradients or optimizer
    state. The solve homed those empty classes on NVMe (or the host), the schedule moves no
    bytes for them, and ``check_homes`` refused the plan being made (exit 2 naming 'plan
    solve' itself as the fix). Their weights may stream; their gradients and state stay on the
    device, so a plan is written and replays."""
    import dataclasses

    from planner.formats import Tier
    from planner.plans import cost_model

    hw = load_hardware(spec)
    p = uniform_profile(6, hw, saved_bytes=2_000_000, input_bytes=100_000,
                        param_bytes=1_000_000, workspace_bytes=500_000,
                        head_saved_bytes=1_000_000)
    frozen = {"embedding", "head"}
    p = dataclasses.replace(p, layers=[
        dataclasses.replace(u, grad_bytes=0, optimizer_bytes=0, master_bytes=0)
        if u.name in frozen else u for u in p.layers])
    path = tmp_path / "frozen.json"
    write_json_atomic(path, p.to_dict())
    host = [] if hw.unified_memory else ["--cpu-mem", "1G"]
    budgets = Budgets(gpu_bytes=12 * 1024**2, cpu_bytes=0 if host == [] else GiB,
                      nvme_bytes=10 * GiB)
    cm = cost_model(p, hw, budgets)
    for i, u in enumerate(p.layers):
        if u.name in frozen:
            assert all(h.grads is Tier.GPU for h in cm.homes[i])
            assert all(h.optimizer is Tier.GPU or h.step is Tier.CPU for h in cm.homes[i])
    assert any(h.streams_weights for i in (0, len(p.layers) - 1) for h in cm.homes[i])
    out = tmp_path / "plan.json"
    rc = main(["solve", str(path), "--gpu-mem", "12M", *host, "--nvme-mem", "10G",
               "--nvme-dir", str(tmp_path / "nv"), "--time-limit", "20", "-o", str(out)])
    err = capsys.readouterr().err
    assert rc == 0, err
    plan = load_plan(out)
    assert simulate(plan).fits
    assert any(d.home.streams_weights for d in plan.layers)
    for u, d in zip(plan.units, plan.layers):
        if u.name in frozen:
            assert d.home.grads is Tier.GPU
    # a plan written before solves dropped such homes (the head's empty gradients "on NVMe",
    # no event for them) still replays: its own homes are offered when it is checked
    if hw.unified_memory:
        from planner.formats import Home
        old = dataclasses.replace(plan, layers=[
            dataclasses.replace(d, home=Home(d.home.weights, Tier.NVME, d.home.optimizer))
            if u.name == "head" else d for u, d in zip(plan.units, plan.layers)])
        save_plan(old, tmp_path / "old.json")
        assert simulate(load_plan(tmp_path / "old.json")).fits


def test_exit_3_says_when_the_budget_it_names_is_more_than_the_device(tmp_path, capsys):
    """A diffusers UNet's exit 3 named 144.74 GiB on an 80 GiB A100 without saying that no
    such device exists: the one line now says the budget is over the spec's memory and what
    makes the units smaller."""
    p = uniform_profile(4, A100, saved_bytes=2 * 1024**3, param_bytes=10**6,
                        head_saved_bytes=100 * GiB)
    path = tmp_path / "big.json"
    write_json_atomic(path, p.to_dict())
    rc = main(["solve", str(path), "--gpu-mem", "80G", "--cpu-mem", "512G", "--time-limit", "20",
               "-o", str(tmp_path / "x.json")])
    assert rc == 3
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    need = int(err.split("with a plan is ")[1].split("(")[1].split(" B)")[0])
    assert need > A100.memory_bytes
    assert f"that is more than the a100-80g's {fmt_bytes(A100.memory_bytes)}" in err
    assert "--blocks" in err and "smaller batch" in err
    # a budget within the device names nothing of it
    p = uniform_profile(4, A100, saved_bytes=2 * 1024**3, param_bytes=10**6)
    write_json_atomic(path, p.to_dict())
    assert main(["solve", str(path), "--gpu-mem", "1G", "--cpu-mem", "512G", "--time-limit",
                 "20", "-o", str(tmp_path / "x.json")]) == 3
    err = capsys.readouterr().err.strip()
    assert "with a plan is" in err and "more than the" not in err


def test_nvme_mem_on_a_spec_without_nvme_is_ignored_with_a_warning(prof, tmp_path, capsys):
    """--nvme-mem 1T on a spec with no NVMe tier (bandwidths 0) was accepted silently: the
    cost model drops the tier (``has_nvme``) and the plan recorded 1 TiB it cannot use."""
    import yaml
    path, p, gpu = prof
    d = H200.to_dict()
    d.update(name="h200-no-nvme", nvme_read_bandwidth=0.0, nvme_write_bandwidth=0.0,
             nvme_bytes=0)
    for k in ("nvme_drives", "nvme_drive_read_bandwidth", "nvme_drive_write_bandwidth",
              "nvme_striping_efficiency"):
        d.pop(k, None)
    spec = tmp_path / "h200-no-nvme.yaml"
    spec.write_text(yaml.safe_dump(d))
    out = tmp_path / "plan.json"
    rc = main(["solve", str(path), "--hardware", str(spec), "--gpu-mem", str(gpu),
               "--cpu-mem", "512G", "--nvme-mem", "1T", "--time-limit", "20", "-o", str(out)])
    assert rc == 0
    err = capsys.readouterr().err.strip().splitlines()
    warned = [x for x in err if "--nvme-mem" in x]
    assert len(warned) == 1 and "no NVMe tier" in warned[0] and "ignored" in warned[0]
    assert load_plan(out).budgets.nvme_bytes == 0
