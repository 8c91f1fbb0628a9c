"""``plan inspect``: every unit named, --json round-trips, stalls and binding constraints are
the simulator's, the plot is a real two-panel PNG, bad input exits 2 with one line."""
import json
import os
import sys

import pytest

from planner.cli import main
from planner.formats import (REPORT_SCHEMA, Activation, LayerDecision, Tier, write_json_atomic)
from planner.hardware import load_hardware
from planner.inspect import analyse, stage_names, timeline
from planner.plans import make_plan
from planner.simulate import simulate
from planner.sizes import fmt_bytes
from planner.synthetic import uniform_profile

N_BLOCKS = 14
GIB = 1024 ** 3


def _plan(decisions: dict, *, gpu=None, cpu=512 * GIB, nvme=0, n=N_BLOCKS, hw="a100-80g",
          prefetch_issue=None):
    """A plan of a uniform chain (7 ms forward, 1.27 GB saved per block; brief's calibration)
    with block ``i``'s decision from ``decisions``; GPU budget = its own peak when not given."""
    spec = load_hardware(hw)
    prof = uniform_profile(n, spec)
    layers = []
    for u in prof.layers:
        i = int(u.name.split(".")[1]) if u.kind == "block" else None
        act, ck = decisions.get(i, (Activation.KEEP, None))
        layers.append(LayerDecision(u.name, act, ck))
    budgets = {"gpu_bytes": gpu or 80 * GIB, "cpu_bytes": cpu, "nvme_bytes": nvme}
    plan = make_plan(prof, None, spec, budgets, "optimal", layers, prefetch_issue=prefetch_issue,
                     nvme_dir="/tmp/tierplan-test" if nvme else None)
    if gpu is None:   # make the GPU budget bind exactly at the plan's own peak
        plan = make_plan(prof, None, spec, dict(budgets, gpu_bytes=plan.predicted["peak_gpu_bytes"]),
                         "optimal", layers, prefetch_issue=prefetch_issue)
    return plan


RC = (Activation.RECOMPUTE, Tier.GPU)
NONE = (Activation.RECOMPUTE, Tier.NONE)
CPU = (Activation.CPU, None)
MIXED = {0: RC, 1: NONE, 2: NONE, 4: CPU, 5: CPU, 6: CPU, 9: RC, 10: NONE}


@pytest.fixture
def plan_file(tmp_path):
    plan = _plan(MIXED)
    p = tmp_path / "plan.json"
    write_json_atomic(p, plan.to_dict())
    return plan, str(p)


def test_inspect_names_every_unit(plan_file, capsys):
    plan, path = plan_file
    assert len(plan.units) == N_BLOCKS + 2
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    table = out[out.index("fwd ms"):].splitlines()[1:]
    assert [line.split()[0] for line in table] == [u.name for u in plan.units]
    by = {line.split()[0]: line.split()[1] for line in table}
    assert by["blocks.4"] == "cpu" and by["blocks.1"] == "recompute" and by["blocks.3"] == "keep"
    assert "GPU memory is full" in out and "a100-80g" in out
    assert f"budgets   GPU {fmt_bytes(plan.budgets['gpu_bytes'])}" in out


def test_json_round_trips_and_matches_the_simulator(plan_file, capsys):
    plan, path = plan_file
    assert main(["inspect", path, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == json.loads(json.dumps(analyse(plan, path)))
    assert [u["unit"] for u in got["units"]] == [u.name for u in plan.units]
    sim = simulate(plan)
    t = got["time"]
    assert t["step_s"] == sim.step_s and t["compute_s"] == sim.compute_s
    assert t["recompute_s"] == pytest.approx(sim.recompute_s)
    # The stalls charged to links add up to the compute stream's own idle time...
    assert t["stall_s"] == pytest.approx(sim.compute_stall_s, abs=1e-12)
    # ...and the difference from compute-only is recompute + stalls (+ nothing else here).
    assert t["step_s"] - t["compute_s"] == pytest.approx(t["recompute_s"] + t["stall_s"])
    assert t["other_s"] == pytest.approx(0.0, abs=1e-12)
    assert got["peaks"] == {"gpu": sim.peak_gpu_bytes, "cpu": sim.peak_cpu_bytes,
                            "nvme": sim.peak_nvme_bytes}
    # Bytes per tier: a cpu unit sends A_i to the host, a gpu checkpoint keeps X_i.
    rows = {u["unit"]: u for u in got["units"]}
    u4 = plan.units[5]
    assert u4.name == "blocks.4"
    assert rows["blocks.4"]["cpu_bytes"] == u4.activation_bytes and rows["blocks.4"]["gpu_bytes"] == 0
    assert rows["blocks.0"]["gpu_bytes"] == plan.units[1].input_bytes
    assert rows["blocks.1"]["gpu_bytes"] == 0
    s, e = sim.events["out:blocks.4"]
    assert (rows["blocks.4"]["offload_start_s"], rows["blocks.4"]["offload_end_s"]) == (s, e)
    assert rows["blocks.4"]["prefetch_start_s"] == sim.events["in:blocks.4"][0]
    assert got["decision_counts"] == {"cpu": 3, "keep": 8, "recompute": 5}


def test_stall_is_charged_to_the_link_that_held_compute():
    # One block offloaded to the host, fetched back from the start of the next block's
    # backward (the default): 1.27 GB at 24 GB/s is 52.9 ms against 14 ms of backward, so
    # B:blocks.6 waits for in:blocks.6 and that wait is all H2D.
    plan = _plan({6: CPU}, gpu=80 * GIB)
    sim = simulate(plan)
    r = analyse(plan)
    wait = sim.events["in:blocks.6"][1] - sim.events["B:blocks.7"][1]
    assert wait > 0.03
    assert r["time"]["stall_by_link_s"] == {"h2d": pytest.approx(wait, abs=1e-12)}
    assert r["time"]["worst_stalls"][0]["event"] == "B:blocks.6"

    # Through NVMe: the read then the copy; each link is charged its own part of the wait.
    plan = _plan({6: (Activation.NVME, None)}, gpu=80 * GIB, nvme=64 * GIB)
    sim = simulate(plan)
    r = analyse(plan)
    b_prev = sim.events["B:blocks.7"][1]
    rs, re_ = sim.events["r:blocks.6"]
    ins, ine = sim.events["in:blocks.6"]
    assert re_ == pytest.approx(ins) and rs >= sim.events["B:blocks.7"][0]
    assert r["time"]["stall_by_link_s"]["h2d"] == pytest.approx(ine - ins)
    assert r["time"]["stall_by_link_s"]["nvme"] == pytest.approx(re_ - b_prev)


def test_binding_constraints():
    plan = _plan({2: CPU, 3: CPU, 4: CPU, 5: CPU})
    r = analyse(plan)
    texts = [b["text"] for b in r["binding"]]
    # The budget is the plan's own peak, so the stage holding the peak is reported full.
    sim = simulate(plan)
    peak_stage = next(s for s in sim.stages if s.start <= sim.peak_gpu_time < s.end
                      or s.end == sim.peak_gpu_time)
    gpu = [b for b in r["binding"] if b["constraint"] == "gpu_memory"]
    names = stage_names(plan)
    covered = set()
    for b in gpu:
        lo, hi = names.index(b["stages"][0]), names.index(b["stages"][1])
        covered |= set(names[lo:hi + 1])
    assert names[peak_stage.stage] in covered
    # D2H: four 52.9 ms offloads back to back from the end of F:blocks.2 outlast every later
    # forward (7 ms each; the forward ends ~80 ms later), so every forward stage from
    # F:blocks.3 to F:head is link-bound, and F:blocks.2 itself is not.
    d2h = [t for t in texts if t.startswith("D2H is the bottleneck in forward")]
    assert d2h == ["D2H is the bottleneck in forward stages F:blocks.3–F:head"]

    # A keep-all plan under a roomy budget binds nothing.
    r = analyse(_plan({}, gpu=80 * GIB))
    assert [b["text"] for b in r["binding"]] == [
        f"GPU memory does not bind: peak {fmt_bytes(r['peaks']['gpu'])}"
        f" is {r['peaks']['gpu'] / (80 * GIB):.0%} of 80.00 GiB"]


def test_plot_is_a_two_panel_png(plan_file, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from planner.plot import plan_figure
    plan, path = plan_file
    fig = plan_figure(plan, timeline(plan))
    axes = fig.get_axes()
    assert len(axes) == 2
    assert axes[0].get_ylabel() == "memory (GiB)" and axes[1].get_xlabel() == "time in the step (ms)"
    assert [t.get_text() for t in axes[1].get_yticklabels()] == ["compute", "D2H", "H2D"]
    # GPU curve + budget, host curve + budget: 4 legend entries in the memory panel.
    assert len(axes[0].get_legend().get_texts()) == 4
    out = tmp_path / "sub" / "plan.png"
    assert main(["inspect", path, "--plot", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert os.listdir(out.parent) == ["plan.png"]   # no temporary file left behind


def test_plot_without_matplotlib_says_how_to_install(plan_file, tmp_path, capsys, monkeypatch):
    plan, path = plan_file
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib -> ImportError
    assert main(["inspect", path, "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip()
    assert "pip install matplotlib" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x.png").exists()


def test_inspect_profile(tmp_path, capsys):
    prof = uniform_profile(12, load_hardware("a100-80g"))
    p = tmp_path / "prof.json"
    write_json_atomic(p, prof.to_dict())
    assert main(["inspect", str(p), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert [u["unit"] for u in got["units"]] == [u.name for u in prof.layers]
    assert got["totals"]["fwd_flops"] == sum(u.fwd_flops for u in prof.layers)
    assert got["totals"]["saved_bytes"] == sum(u.saved_bytes for u in prof.layers)
    assert got["totals"]["compute_s"] == pytest.approx(sum(u.fwd_s + u.bwd_s for u in prof.layers))
    assert main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    table = out[out.index("bwd ms"):].splitlines()[1:]
    assert [line.split()[0] for line in table] == [u.name for u in prof.layers]
    assert "1.18 GiB" in out   # 1.27 GB saved per block, in human units
    assert main(["inspect", str(p), "--plot", str(tmp_path / "x.png")]) == 2
    assert "is a profile" in capsys.readouterr().err


def test_report_beside_prediction(plan_file, tmp_path, capsys):
    plan, path = plan_file
    sim = simulate(plan)
    rep = {"schema": REPORT_SCHEMA, "device": "cuda",
           "predicted": dict(plan.predicted),
           "measured": {"step_s": sim.step_s * 1.1, "peak_gpu_bytes": sim.peak_gpu_bytes // 2,
                        "peak_cpu_bytes": sim.peak_cpu_bytes, "peak_nvme_bytes": 0,
                        "stall_s": 0.0, "moved": {"d2h": 3 * 1_270_000_000}, "steps": 3}}
    rp = tmp_path / "report.json"
    rp.write_text(json.dumps(rep))
    assert main(["inspect", path, "--report", str(rp), "--json"]) == 0
    rows = {r["quantity"]: r for r in json.loads(capsys.readouterr().out)["report"]["rows"]}
    assert rows["step_s"]["ratio"] == pytest.approx(1.1)
    assert rows["peak_gpu_bytes"]["predicted"] == sim.peak_gpu_bytes
    assert rows["peak_gpu_bytes"]["measured"] == sim.peak_gpu_bytes // 2
    assert rows["moved_d2h_bytes"]["predicted"] == 3 * plan.units[5].activation_bytes
    assert rows["moved_h2d_bytes"]["measured"] is None
    assert main(["inspect", path, "--report", str(rp)]) == 0
    out = capsys.readouterr().out
    assert "measured vs predicted:" in out and "1.100x" in out

    # On a CPU host the runtime measures the RSS rise, compared with the predicted rise.
    rep.update(device="cpu", predicted_gpu_rise_bytes=12345)
    rp.write_text(json.dumps(rep))
    assert main(["inspect", path, "--report", str(rp), "--json"]) == 0
    rows = {r["quantity"]: r for r in json.loads(capsys.readouterr().out)["report"]["rows"]}
    assert rows["peak_gpu_bytes"]["predicted"] == 12345
    assert rows["peak_gpu_bytes"]["label"] == "peak RSS rise over step"

    rp.write_text(json.dumps({"schema": REPORT_SCHEMA, "measured": {}}))
    assert main(["inspect", path, "--report", str(rp)]) == 2
    assert "no measured step" in capsys.readouterr().err


def _one_line(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["inspect", str(bad)]) == 2
    assert "is not valid JSON" in _one_line(capsys)
    assert main(["inspect", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in _one_line(capsys)
    other = tmp_path / "other.json"
    other.write_text('{"schema": "tierplan.hardware/1"}')
    assert main(["inspect", str(other)]) == 2
    assert "give a plan" in _one_line(capsys)
    trunc = tmp_path / "trunc.json"
    trunc.write_text('{"schema": "tierplan.plan/1", "units": []}')
    assert main(["inspect", str(trunc)]) == 2
    assert "lacks the field" in _one_line(capsys)
    plan = _plan({}, gpu=80 * GIB)
    p = tmp_path / "plan.json"
    write_json_atomic(p, plan.to_dict())
    assert main(["inspect", str(p), "--plot", str(tmp_path / "x.jpg")]) == 2
    assert ".png" in _one_line(capsys)
    assert main(["inspect", str(p), "--report", str(tmp_path / "nope.json")]) == 2
    assert "no such file" in _one_line(capsys)


def test_unified_memory_plan(tmp_path):
    # cpu-host: no host tier; offloads go straight to disk, so every stall is the disk's.
    from planner.plans import golden_plans
    plan = golden_plans()["cpu-host-offload-all"]
    sim = simulate(plan)
    r = analyse(plan)
    assert [u["unit"] for u in r["units"]] == [u.name for u in plan.units]
    assert set(r["time"]["stall_by_link_s"]) == {"nvme"}
    assert r["time"]["stall_s"] == pytest.approx(sim.compute_stall_s, abs=1e-12)
    assert r["bytes_moved"] == {"nvme": 2 * sum(u.activation_bytes for u in plan.units
                                                if u.kind == "block")}
    assert r["binding"][0]["text"].startswith("device memory does not bind")
    pytest.importorskip("matplotlib")
    from planner.plot import plan_figure
    axes = plan_figure(plan, timeline(plan)).get_axes()
    assert [t.get_text() for t in axes[1].get_yticklabels()] == ["compute", "NVMe"]
