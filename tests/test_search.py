"""``plan search``: candidates and K, the table's rows, the written plan (its tokens, the
fastest row, the simulator's check), the time shared out, bad inputs and exit codes."""
from __future__ import annotations

import json
import time

import pytest

from planner.cli import main
from planner.errors import NoFitError, UserError
from planner.formats import Budgets
from planner.hardware import load_hardware
from planner.plans.load import load_plan
from planner.plans.simulate import simulate
from planner.solve import SolveConfig, throughput
from planner.solve.throughput import candidates, orders_to_try, recompute_flops, with_order



def _search(tmp_path, capsys, *extra, seq=128, tokens=1024, code=0):
    out = tmp_path / "plan.json"
    argv = ["search", "gpt-tiny", "--seq", str(seq), "--tokens-per-step", str(tokens),
            "--time-limit", "20", "-o", str(out), "--json", *extra]
    assert main(argv) == code
    cap = capsys.readouterr()
    return (json.loads(cap.out) if code == 0 else None), out, cap.err


def _check_rows(d, out, seq, tokens):
    rows = d["rows"]
    assert [r["micro_batch"] for r in rows] == [b for b in (1, 2, 4, 8, 16, 32)
                                                if (tokens // seq) % b == 0]
    for r in rows:
        assert r["micro_batch"] * r["micro_batches"] * seq == tokens
        assert r["order"] == "batch-major"
    fit = [r for r in rows if r["fits"]]
    assert fit
    best = min(fit, key=lambda r: r["step_s"])
    assert d["best"] == rows.index(best) and d["plan"] == str(out)
    plan = load_plan(out)
    assert plan.model["batch"] * plan.model["seq"] * plan.micro_batches == tokens
    assert (plan.model["batch"], plan.micro_batches) == (best["micro_batch"],
                                                         best["micro_batches"])
    sim = simulate(plan)
    assert sim.fits and sim.step_s == pytest.approx(best["step_s"], rel=1e-12)
    for r in fit:
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_s"])
        assert r["tflops_6nt"] == pytest.approx(
            6 * d["param_count"] * tokens / r["step_s"] / 1e12)
        assert r["tflops_counted"] > 0 and 0 < r["bound_share"] <= 1
        assert r["peak_gpu_bytes"] <= d["budgets"]["gpu_bytes"]
    return rows, plan, sim


def test_cpu_host_rows_k_and_the_fastest_plan(tmp_path, capsys):
    d, out, err = _search(tmp_path, capsys, "--hardware", "cpu-host", "--gpu-mem", "4G")
    rows, plan, sim = _check_rows(d, out, 128, 1024)
    assert [r["micro_batches"] for r in rows] == [8, 4, 2, 1]
    assert d["hardware"] == "cpu-host" and d["schema"] == "tierplan.search/1"
    # keep-all fits everywhere: counted FLOPs are the passes' own (no recompute)
    assert sim.flops / sim.step_s / 1e12 == pytest.approx(rows[d["best"]]["tflops_counted"])


def test_gpu_spec_tight_budget_rows_that_do_not_fit_and_recompute_counted(tmp_path, capsys):
    d, out, err = _search(tmp_path, capsys, "--hardware", "h200", "--gpu-mem", "10M",
                          "--cpu-mem", "0", "--stream", "off", tokens=4096)
    rows, plan, sim = _check_rows(d, out, 128, 4096)
    assert [r["fits"] for r in rows] == [True, True, True, True, False, False]
    assert all(r["status"].startswith("no plan fits") for r in rows if not r["fits"])
    # the largest fitting micro-batch recomputes: its counted FLOPs exceed the passes' own
    r4, r8 = rows[2], rows[3]
    assert r8["origin"].startswith("milp")
    assert r8["tflops_counted"] / r8["tflops_6nt"] > r4["tflops_counted"] / r4["tflops_6nt"]
    # one progress line per cell on stderr, --json or not
    assert err.count("plan search: micro-batch") == 6
    assert err.count("no plan fits (needs --gpu-mem >= ") == 2


def test_recompute_flops_follow_the_plan(tmp_path):
    from planner.profile import profile_model
    from planner.solve import solve_profile
    hw = load_hardware("h200")
    p = profile_model("gpt-tiny", 8, 128, device="meta", hardware=hw, timing="estimate")
    keep = solve_profile(p, None, hw, Budgets(1 << 30, 0, 0), "keep-all").plan
    rec = solve_profile(p, None, hw, Budgets(1 << 30, 0, 0), "recompute-all").plan
    assert recompute_flops(keep) == 0
    blocks = [u for u in p.layers if u.kind == "block"]
    assert recompute_flops(rec) == pytest.approx(sum(u.fwd_flops for u in blocks))


def test_text_table_progress_lines_and_the_mark(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["search", "gpt-tiny", "--seq", "64", "--tokens-per-step", "256",
                 "--hardware", "h200", "--gpu-mem", "2G", "--time-limit", "20",
                 "-o", str(out)]) == 0
    cap = capsys.readouterr()
    assert cap.err.count("plan search: micro-batch") == 3       # b = 1, 2, 4
    lines = cap.out.splitlines()
    head = next(ln for ln in lines if "micro-batch" in ln and "order" in ln)
    for col in ("K", "step", "tokens/s", "TFLOPS 6NT", "TFLOPS counted", "peak GPU",
                "peak host", "peak NVMe", "bound", "status"):
        assert col in head
    marked = [ln for ln in lines if ln.startswith("*")]
    assert len(marked) == 1 and "batch-major" in marked[0]
    assert lines[-1] == str(out) and out.is_file()


def test_no_candidate_fits_is_exit_3_one_line(tmp_path, capsys):
    _, out, err = _search(tmp_path, capsys, "--hardware", "h200", "--gpu-mem", "1M",
                          "--cpu-mem", "0", "--stream", "off", code=3)
    last = err.strip().splitlines()[-1]
    assert last.startswith("plan: error: plan search: no candidate fits")
    assert not out.exists()


@pytest.mark.parametrize("extra, what", [
    (["--tokens-per-step", "1000"], "not a multiple of --seq"),
    (["--tokens-per-step", "1024", "--micro-batch-sizes", "3"], "does not divide"),
    (["--tokens-per-step", "1024", "--micro-batch-sizes", "a,b"], "positive integers"),
    (["--tokens-per-step", "0"], "positive integer"),
    (["--tokens-per-step", "1024", "--gap", "2"], "--gap"),
    (["--tokens-per-step", "1024", "--time-limit", "-1"], "--time-limit"),
])
def test_bad_inputs_one_line_exit_2(tmp_path, capsys, extra, what):
    argv = ["search", "gpt-tiny", "--seq", "128", "--hardware", "h200", "--gpu-mem", "2G",
            "-o", str(tmp_path / "p.json"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("plan: error:") and what in err[0]
    assert not (tmp_path / "p.json").exists()


def test_unknown_model_is_exit_2(tmp_path, capsys):
    assert main(["search", "no-such-model", "--seq", "128", "--tokens-per-step", "256",
                 "--hardware", "h200", "--gpu-mem", "2G", "-o", str(tmp_path / "p.json")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_candidates_and_k():
    assert candidates(2048 * 8, 2048) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    assert candidates(128 * 12, 128) == [(1, 12), (2, 6), (4, 3)]
    assert candidates(128 * 12, 128, [3, 6, 12]) == [(3, 4), (6, 2), (12, 1)]
    assert candidates(100 * 8192, 100)[0] == (2, 4096)      # K at most 4096: b = 1 left out
    with pytest.raises(UserError, match="not a multiple"):
        candidates(1000, 128)


def test_orders_follow_the_option_and_with_order():
    hw = load_hardware("h200")
    cfg = SolveConfig.build(hw, Budgets(1 << 30, 0, 0), micro_batches=4)
    assert orders_to_try(cfg) == ("batch-major",)
    assert with_order(cfg, "batch-major") == cfg
    auto = SolveConfig.build(hw, Budgets(1 << 30, 0, 0), micro_batches=4, micro_batch_order="auto")
    assert orders_to_try(auto) == ("batch-major", "layer-major")
    one = SolveConfig.build(hw, Budgets(1 << 30, 0, 0), micro_batches=1, micro_batch_order="auto")
    assert orders_to_try(one) == ("batch-major",)
    assert with_order(auto, "layer-major").micro_batch_order == "layer-major"


def test_time_is_shared_evenly_and_carried_over(monkeypatch):
    """Each cell gets the time left over the cells left; a quick cell leaves its time on."""
    seen = []

    def fake_solve(profile, path, cfg, seeds=()):
        seen.append(cfg.time_limit)
        raise NoFitError("no plan fits (fake)")

    monkeypatch.setattr(throughput, "solve", fake_solve)
    hw = load_hardware("h200")
    t0 = time.perf_counter()
    cells = throughput.search(lambda b: object(), hw, Budgets(1 << 30, 0, 0), {},
                              [(1, 4), (2, 2), (4, 1)], 4096, t0 + 12.0, profile_s=1.0)
    assert [c.status for c in cells] == ["no plan fits (fake)"] * 3
    # 12 s, two profiles still to take (1 s each), three cells: 10/3; then 11/2, then 12/1
    assert seen[0] == pytest.approx(10 / 3, abs=0.05)
    assert seen[1] == pytest.approx(11 / 2, abs=0.05)
    assert seen[2] == pytest.approx(12.0, abs=0.05)
    assert throughput.fastest(cells) is None


def test_each_cell_is_seeded_with_the_fastest_plan_so_far(tmp_path, monkeypatch):
    """Warm starts across candidates: a cell after the first gets the fastest plan found so far
    as a seed, and ``solve`` plans its decisions anew on the cell's own profile (another
    micro-batch size): a candidate that fits there, and the MILP's warm start when it is the
    best. A seed whose units differ is left out."""
    from planner.profile import profile_model
    from planner.solve import search as solve_search, strategies
    hw = load_hardware("a100-80g")
    prof = {b: profile_model("gpt-tiny", b, 128, device="meta", hardware=hw) for b in (1, 2)}
    budgets = Budgets(1 << 30, 0, 0)
    seen = []
    real = throughput.solve

    def watching(profile, path, cfg, seeds=()):
        seen.append([s.model["batch"] for s in seeds])
        return real(profile, path, cfg, seeds)
    monkeypatch.setattr(throughput, "solve", watching)
    cells = throughput.search(lambda b: prof[b], hw, budgets, {"gap": 0.005},
                              [(1, 2), (2, 1)], 256, time.perf_counter() + 30)
    assert [c.fits for c in cells] == [True, True]
    assert seen == [[], [1]]
    # the seed as solve takes it: planned on the b=2 profile, its decisions those of b=1
    first = cells[0].plan
    cfg = SolveConfig.build(hw, budgets, "optimal", micro_batches=1, time_limit=10)
    got = strategies._seed_candidates((first,), budgets, prof[2], None,
                                      cfg.cost_model(prof[2]), None)
    assert len(got) == 1 and got[0].origin == "seed" and got[0].sim.fits
    assert got[0].plan.model["batch"] == 2 and got[0].plan.micro_batches == 1
    assert [d.activation for d in got[0].plan.layers] == [d.activation for d in first.layers]
    out = solve_search.solve(prof[2], None, cfg, (first,))
    assert "seed" in out.tried and out.sim.step_s <= out.tried["seed"][0] * (1 + 1e-9)
    # a seed of this very profile but another order and K is planned anew, not replayed
    cfg_lm = SolveConfig.build(hw, budgets, "optimal", micro_batches=2,
                               micro_batch_order="layer-major", time_limit=10)
    got = strategies._seed_candidates((first,), budgets, prof[1], None,
                                      cfg_lm.cost_model(prof[1]), None)
    assert len(got) == 1 and got[0].sim.fits
    assert (got[0].plan.micro_batch_order, got[0].plan.micro_batches) == ("layer-major", 2)
    # a seed of other units (its last one renamed) gives no candidate
    import dataclasses
    odd = dataclasses.replace(first, layers=first.layers[:-1] + [
        dataclasses.replace(first.layers[-1], name="elsewhere")])
    assert strategies._seed_candidates((odd,), budgets, prof[2], None,
                                       cfg.cost_model(prof[2]), None) == []


def test_6nt_above_the_counted_flops_is_marked_with_a_footnote():
    """A mixture of experts runs only some experts per token: 6 x N_params x tokens counts
    every parameter and showed more TFLOPS than the hardware's peak. Where 6NT exceeds the
    FLOPs the profile counted by more than 1.5x, its cell is marked and one line under the
    table says why; otherwise the table is as before."""
    from planner.cli.search import table
    from planner.solve.throughput import Cell

    def cell(b, six, counted):
        return Cell(b, 1, "batch-major", plan=object(), step_s=1.0, tokens_per_s=1000.0,
                    tflops_6nt=six, tflops_counted=counted,
                    peaks={"gpu": 1, "cpu": 0, "nvme": 0}, bound="compute", bound_share=1.0,
                    origin="milp", status="ok")

    dense = [cell(1, 100.0, 120.0), cell(2, 100.0, 70.0)]   # recompute, attention: within 1.5x
    text = table(dense, dense[0])
    assert len(text.splitlines()) == 3 and "100*" not in text and "6NT*" not in text
    moe = [cell(1, 900.0, 300.0), cell(2, 140.0, 100.0), Cell(4, 1, "batch-major",
                                                           status="no plan fits (x)")]
    lines = table(moe, moe[0]).splitlines()
    assert len(lines) == 5 and lines[-1].startswith("6NT*: ")
    assert "900*" in lines[1] and "140*" not in lines[2] and "140" in lines[2]
    assert "mixture of experts" in lines[-1] and "overstates" in lines[-1]
