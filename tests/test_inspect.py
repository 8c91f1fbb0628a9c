"""``plan inspect``: per-unit table, where the time above compute-only goes, binding
constraints, --json, --plot, --report, a profile, and bad input."""
import dataclasses
import json

import pytest

from planner.cli import main
from planner.formats import (REPORT_SCHEMA, Activation, Budgets, Home, LayerDecision, Tier,
                             write_json_atomic)
from planner.hardware import load_hardware
from planner.cli.inspect import binding, time_breakdown
from planner.plans import make_plan, plan_and_sim
from planner.plans.simulate import simulate
from planner.sizes import fmt_bytes
from synthetic import uniform_profile
from planner.cli.table import unit_table

N_BLOCKS = 14
GIB = 1024 ** 3


def _plan(decisions: dict, *, gpu=None, cpu=512 * GIB, nvme=0, n=N_BLOCKS, hw="a100-80g",
          homes=None):
    """A plan of a uniform chain (7 ms forward, 1.27 GB saved per block; the brief's
    calibration) with block ``i``'s decision from ``decisions``; the GPU budget binds at the
    plan's own peak when not given."""
    spec = load_hardware(hw)
    prof = uniform_profile(n, spec)
    layers = []
    for u in prof.layers:
        i = int(u.name.split(".")[1]) if u.kind == "block" else None
        act, ck = decisions.get(i, (Activation.KEEP, None))
        layers.append(LayerDecision(u.name, act, ck, (homes or {}).get(i, Home())))
    b = Budgets(gpu or 80 * GIB, cpu, nvme)
    plan = make_plan(prof, None, spec, b, "optimal", layers,
                     nvme_dir="/tmp/tierplan-test" if nvme else None)
    if gpu is None:   # make the GPU budget bind exactly at the plan's own peak
        plan = make_plan(prof, None, spec, Budgets(plan.predicted.peak_gpu_bytes, cpu, nvme),
                         "optimal", layers, nvme_dir="/tmp/tierplan-test" if nvme else None)
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


def test_inspect_names_every_unit_and_its_decision(plan_file, capsys):
    plan, path = plan_file
    assert main(["inspect", path]) == 0
    out = capsys.readouterr().out
    assert f"budgets   GPU {fmt_bytes(plan.budgets.gpu_bytes)}" in out
    lines = out.splitlines()
    start = next(k for k, line in enumerate(lines) if line.split() == ["unit"])
    rows = [line.split() for line in lines[start + 1:start + 1 + len(plan.units)]]
    assert [r[0] for r in rows] == [u.name for u in plan.units]
    assert [r[2] for r in rows] == ["keep", "recompute/gpu", "recompute/none", "recompute/none",
                                    "keep", "cpu", "cpu", "cpu", "keep", "keep", "recompute/gpu",
                                    "recompute/none", "keep", "keep", "keep", "keep"]


def test_json_matches_the_simulator(plan_file, capsys):
    plan, path = plan_file
    assert main(["inspect", path, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    sim = simulate(plan)
    assert got["summary"]["step_s"] == sim.step_s
    assert got["summary"]["peak_gpu_bytes"] == sim.peak_gpu_bytes
    assert [u["unit"] for u in got["units"]] == [u.name for u in plan.units]
    assert len(got["stages"]) == len(sim.stages)
    total = sum(got["time_above_compute"].values())
    assert total == pytest.approx(sim.step_s - sim.compute_s, rel=1e-9, abs=1e-12)


def test_time_above_compute_is_charged_to_what_held_each_stage():
    # Eight blocks offloaded to the host: 8 x 1.27 GB at 24 GB/s is 423 ms against 7 ms
    # forwards, more than the links can hide, so stages carrying it last as long as a link.
    plan = _plan({i: CPU for i in range(2, 10)}, gpu=80 * GIB)
    sim = simulate(plan)
    br = time_breakdown(plan, sim)
    waits = {k: v for k, v in br.items() if k.startswith("waiting on")}
    assert waits and set(waits) <= {"waiting on D2H", "waiting on H2D", "waiting on PCIe both ways"}
    link_excess = sum(r.seconds - r.loads["compute"] for r in sim.stages if r.phase != "optimizer")
    assert sum(waits.values()) == pytest.approx(link_excess)
    # a recompute-only plan waits on nothing but pays each recomputed forward once more
    plan = _plan({i: RC for i in range(N_BLOCKS)}, gpu=80 * GIB)
    sim = simulate(plan)
    br = time_breakdown(plan, sim)
    assert br["recompute"] == pytest.approx(sum(u.fwd_s for u in plan.units if u.kind == "block"))
    assert not any(k.startswith("waiting") for k in br)


def test_binding_constraints():
    plan = _plan({2: CPU, 3: CPU, 4: CPU, 5: CPU})      # budget = its own peak
    sim = simulate(plan)
    lines = binding(plan, sim)
    assert lines[0].startswith("GPU memory binds")
    assert any("D2H" in x or "PCIe" in x for x in lines)
    roomy = _plan({}, gpu=80 * GIB)
    sim = simulate(roomy)
    assert binding(roomy, sim)[0] == (f"GPU memory does not bind: peak {fmt_bytes(sim.peak_gpu_bytes)}"
                                      f" is {sim.peak_gpu_bytes / (80 * GIB):.0%} of 80.00 GiB")


def test_binding_counts_the_specs_reserve():
    """Every GPU budget keeps the spec's reserve free: a plan whose peak fills the rest binds,
    though its peak is under 99% of the budget itself (on cpu-host, whose reserve is 1 MiB,
    inspect said 'does not bind: 46%' at --gpu-mem 1.9M). Here a spec with a 20 GiB
    reserve."""
    spec = dataclasses.replace(load_hardware("a100-80g"), reserved_bytes=20 * GIB)
    prof = uniform_profile(N_BLOCKS, spec)
    layers = _plan({}).layers
    peak = make_plan(prof, None, spec, Budgets(80 * GIB, 0, 0), "optimal",
                     layers).predicted.peak_gpu_bytes
    tight = make_plan(prof, None, spec, Budgets(peak + 20 * GIB, 0, 0), "optimal", layers)
    assert peak < 0.99 * (peak + 20 * GIB)
    line = binding(tight, simulate(tight))[0]
    assert line.startswith("GPU memory binds") and "less the spec's reserve 20.00 GiB" in line
    roomy = make_plan(prof, None, spec, Budgets(80 * GIB, 0, 0), "optimal", layers)
    assert binding(roomy, simulate(roomy))[0] == (
        f"GPU memory does not bind: peak {fmt_bytes(peak)} is {peak / (60 * GIB):.0%} of "
        "80.00 GiB less the spec's reserve 20.00 GiB")


def test_memory_binds_when_no_saving_can_be_undone_within_the_budget():
    """Each decision moves the peak by a whole block's activations, so a plan that recomputes
    blocks because one more kept block would not fit is bound by memory though its peak is
    well under the budget (the demo's plan recomputes 2 of 3 blocks at 75% of its budget and
    inspect said "GPU memory does not bind"). With room for one more kept block, it does not
    bind, and the line names the saving that could be undone."""
    rc = {0: RC, 1: RC}                    # 2 of 3 blocks recomputed, as in the demo
    peak = _plan(rc, gpu=80 * GIB, n=3).predicted.peak_gpu_bytes
    one_more = _plan({1: RC}, gpu=80 * GIB, n=3).predicted.peak_gpu_bytes
    assert one_more > 1.05 * peak          # one block's step leaves the budget room below 99%
    reserve = load_hardware("a100-80g").reserved_bytes
    tight = _plan(rc, gpu=int((peak + one_more) / 2) + reserve, n=3)
    sim = simulate(tight)
    line = binding(tight, sim)[0]
    assert sim.peak_gpu_bytes < 0.99 * (tight.budgets.gpu_bytes - reserve)
    assert line.startswith(f"GPU memory binds: peak {fmt_bytes(sim.peak_gpu_bytes)} is "), line
    assert "undoing any of its 2 saving(s) alone does not fit" in line, line
    assert "keeping blocks.0's activations instead of recompute/gpu" in line, line
    roomy = _plan(rc, gpu=80 * GIB, n=3)
    line = binding(roomy, simulate(roomy))[0]
    assert line.startswith("GPU memory does not bind") and "would still fit" in line, line


def test_parameter_counts_carry_their_unit(plan_file, tmp_path, capsys):
    """A 199,232-parameter model printed "0 M params"."""
    from planner.cli.inspect import fmt_count
    assert [fmt_count(n) for n in (0, 999, 1000, 199_232, 1_500_000, 124_439_808,
                                   7_241_732_096, 999_999)] == \
        ["0", "999", "1K", "199K", "1.5M", "124M", "7.24B", "1M"]
    plan, _ = plan_file
    small = dataclasses.replace(plan, model={**plan.model, "param_count": 199_232})
    p = tmp_path / "small.json"
    write_json_atomic(p, small.to_dict())
    assert main(["inspect", str(p)]) == 0
    assert "  199K params  1 micro-batch(es)" in capsys.readouterr().out


def test_streamed_units_show_their_homes_and_traffic():
    home = Home(Tier.CPU, Tier.CPU, Tier.CPU, Tier.CPU)
    plan = _plan({}, gpu=80 * GIB, homes={3: home})
    t = unit_table(plan, simulate(plan))
    assert t.loc["blocks.3", "home"] == "w:cpu g:cpu o:cpu s:cpu"
    p = plan.units[4].param_bytes
    assert t.loc["blocks.3", "weight_in_bytes"] == 2 * p       # before its forward and backward
    assert t.loc["blocks.3", "grad_out_bytes"] == plan.units[4].grad_bytes
    assert t.loc["blocks.3", "on_gpu_bytes"] == 0
    assert t.loc["blocks.2", "on_gpu_bytes"] == plan.units[3].static_bytes


def test_plot_is_a_png(plan_file, tmp_path, capsys):
    plan, path = plan_file
    png = tmp_path / "p.png"
    assert main(["inspect", path, "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["inspect", path, "--plot", str(tmp_path / "p.jpg")]) == 2


def test_plot_without_matplotlib_says_how_to_install(plan_file, tmp_path, capsys, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_mpl)
    plan, path = plan_file
    assert main(["inspect", path, "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_inspect_profile(tmp_path, capsys):
    prof = uniform_profile(3, load_hardware("h200"))
    p = tmp_path / "prof.json"
    write_json_atomic(p, prof.to_dict())
    assert main(["inspect", str(p)]) == 0
    out = capsys.readouterr().out
    assert "blocks.2" in out and "static" in out
    assert main(["inspect", str(p), "--plot", str(tmp_path / "x.png")]) == 2


def test_report_beside_prediction(plan_file, tmp_path, capsys):
    plan, path = plan_file
    rep = {"schema": REPORT_SCHEMA, "plan": {"path": path, "policy": "optimal",
                                            "hardware": "a100-80g", "batch": 1, "seq": 1,
                                            "micro_batches": 1},
           "device": "cuda", "predicted": plan.predicted.to_dict(), "predicted_moved": {},
           "predicted_static_bytes": 0,
           "steps": [{"step_s": 0.5, "passes": 1, "peak_gpu_bytes": 10 * GIB,
                      "peak_cpu_bytes": 0, "peak_nvme_bytes": 0, "peak_activation_bytes": 0,
                      "static_bytes": 0, "base_bytes": 0, "moved": {}, "stall_s": 0.0}]}
    rp = tmp_path / "r.json"
    rp.write_text(json.dumps(rep))
    assert main(["inspect", path, "--report", str(rp)]) == 0
    assert "measured  step 500.00 ms vs predicted" in capsys.readouterr().out
    rep["steps"][0]["step_s"] = "fast"
    rp.write_text(json.dumps(rep))
    assert main(["inspect", path, "--report", str(rp)]) == 2
    assert "step_s must be" in capsys.readouterr().err
    # the prediction a report carries needs what a plan's does (found by bench/fuzz.py: a
    # report without predicted.peak_cpu_bytes was shown with exit 0)
    rep["steps"][0]["step_s"] = 0.5
    del rep["predicted"]["peak_cpu_bytes"]
    rp.write_text(json.dumps(rep))
    assert main(["inspect", path, "--report", str(rp)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "peak_cpu_bytes" in err and "r.json" in err


def test_bad_input_exits_2_with_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["inspect", str(bad)]) == 2
    assert main(["inspect", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("plan: error:") for e in err)


def test_unified_memory_plan():
    spec = load_hardware("cpu-host")
    prof = uniform_profile(3, spec, saved_bytes=10**7, param_bytes=10**6)
    layers = [LayerDecision(u.name, Activation.NVME if u.kind == "block" else Activation.KEEP)
              for u in prof.layers]
    plan, sim = plan_and_sim(prof, None, spec, Budgets(10**10, 0, 10**10), "x", layers,
                             nvme_dir="/tmp/tierplan-test")
    t = unit_table(plan, sim)
    assert (t.loc[[u.name for u in prof.layers if u.kind == "block"], "act_out_bytes"]
            == 10**7).all()
