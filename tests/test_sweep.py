"""``plan sweep``: the axis, the table, the knee, seeds, no-fit rows and exit codes."""
from __future__ import annotations

import json

import pytest

from planner.cli import main
from planner.formats import Budgets, write_json_atomic
from planner.hardware import load_hardware
from planner.plans.simulate import simulate
from planner.solve import _seed_candidates, solve_profile
from planner.cli.sweep import Point, knee
from synthetic import uniform_profile

H200 = load_hardware("h200")
GIB = 1024 ** 3


@pytest.fixture
def prof(tmp_path):
    p = uniform_profile(6, H200, jitter=0.02)
    path = tmp_path / "syn.json"
    write_json_atomic(path, p.to_dict())
    blocks = sum(u.activation_bytes for u in p.layers if u.kind == "block")
    fixed = (p.static_bytes + p.layers[0].activation_bytes + p.layers[-1].activation_bytes
             + max(u.workspace_bytes for u in p.layers))
    return path, p, fixed, blocks


def _sweep(path, lo, hi, step, *extra):
    return ["sweep", str(path), "--gpu-mem", f"{lo}:{hi}:{step}", "--cpu-mem", "0",
            "--stream", "off", "--time-limit", "20", *extra]


def test_sweep_json_is_monotone_and_each_plan_fits(prof, capsys):
    path, p, fixed, blocks = prof
    lo, hi = fixed + blocks // 4, fixed + blocks + 2 * GIB
    step = (hi - lo) // 5
    assert main(_sweep(path, lo, hi, step, "--json")) == 0
    d = json.loads(capsys.readouterr().out)
    rows = d["rows"]
    assert d["axis"] == "gpu" and len(rows) == 6
    assert [r["gpu_bytes"] for r in rows] == [lo + k * step for k in range(6)]
    fit = [r for r in rows if r["fits"]]
    assert len(fit) >= 3
    steps = [r["step_s"] for r in fit]
    assert all(b <= a for a, b in zip(steps, steps[1:])), steps
    # the largest budget holds everything: keep-all, compute only
    assert fit[-1]["step_s"] == pytest.approx(fit[-1]["compute_s"], rel=1e-6)
    tokens = p.model["batch"] * p.model["seq"]
    assert fit[0]["tokens_per_s"] == pytest.approx(tokens / fit[0]["step_s"])
    assert sum(r["knee"] for r in rows) <= 1
    assert all(r["peak_gpu_bytes"] <= r["gpu_bytes"] for r in fit)


def test_points_without_a_plan_are_rows_and_none_at_all_is_exit_3(prof, capsys):
    path, p, fixed, blocks = prof
    small = p.static_bytes // 2          # the static state alone exceeds it
    assert main(_sweep(path, small, fixed + blocks + GIB, fixed + blocks + GIB - small,
                       "--json")) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["fits"] for r in rows] == [False, True]
    assert "smallest --gpu-mem" in rows[0]["no_fit"]
    assert main(_sweep(path, small // 2, small, small // 2)) == 3
    err = capsys.readouterr().err
    assert "no plan fits at any point" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv, needle", [
    (["--gpu-mem", "80G"], "exactly one budget as A:B:STEP"),
    (["--gpu-mem", "1G:2G:1G", "--nvme-mem", "0:1G:1G"], "exactly one budget"),
    (["--gpu-mem", "1G:2G"], "A:B:STEP"),
    (["--gpu-mem", "1G:2G:0"], "step must be more than 0"),
    (["--gpu-mem", "1G:2G:1"], "points; give a larger step"),
    (["--gpu-mem", "1G:x:1G"], "--gpu-mem (end)"),
])
def test_bad_axis_is_one_line_exit_2(prof, capsys, argv, needle):
    path = prof[0]
    assert main(["sweep", str(path), *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


def test_table_marks_the_knee_and_the_changes(prof, capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path, p, fixed, blocks = prof
    lo, hi = fixed + blocks // 4, fixed + blocks + 2 * GIB
    png = tmp_path / "s.png"
    assert main(_sweep(path, lo, hi, (hi - lo) // 4, "--plot", str(png))) == 0
    out = capsys.readouterr().out
    assert "ms saved/GB" in out and "first plan" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_changes_count_each_choice_once():
    from planner.formats import Activation as A, Home, LayerDecision as LD, Tier as T
    from planner.cli.sweep import changes

    class P:
        def __init__(self, layers):
            self.layers = layers
    off = Home(T.CPU, T.CPU, T.CPU, T.CPU)
    a = P([LD("e", A.KEEP), LD("b0", A.RECOMPUTE, T.GPU), LD("b1", A.RECOMPUTE, T.NONE),
           LD("b2", A.CPU), LD("h", A.KEEP)])
    b = P([LD("e", A.KEEP), LD("b0", A.KEEP), LD("b1", A.CPU), LD("b2", A.CPU, home=off),
           LD("h", A.KEEP)])
    assert changes(a, b) == ["keep 2->3", "recompute@gpu 1->0", "recompute@none 1->0",
                             "cpu 1->2", "1 home(s) moved"]
    assert changes(None, b) == [] and changes(b, b) == []
    # two units trading choices: the counts stay, the swap is said
    c = P([LD("e", A.KEEP), LD("b0", A.CPU), LD("b1", A.KEEP), LD("b2", A.CPU, home=off),
           LD("h", A.KEEP)])
    assert changes(b, c) == ["2 unit(s) swapped choices"]


def test_knee_is_the_kneedle_point():
    def pts(ts):
        return [Point(budget=10 * k, plan=object(), step_s=t, compute_s=1.0)
                for k, t in enumerate(ts)]
    # normalised: x = 0, .25, .5, .75, 1; y = 1, .2, .1, 0, 0 -> (1-x)-y = 0, .55, .4, .25, 0
    p = pts([11.0, 3.0, 2.0, 1.0, 1.0])
    assert knee(p) is p[1]
    assert knee(pts([2.0, 2.0, 2.0])) is None          # flat: no knee
    assert knee(pts([3.0, 2.0])) is None                # too few points
    # a straight line has no point below its chord
    assert knee(pts([4.0, 3.0, 2.0, 1.0])) is None


def test_a_seed_plan_is_a_candidate_at_a_larger_budget(prof):
    path, p, fixed, blocks = prof
    small = Budgets(fixed + blocks // 3)
    out = solve_profile(p, str(path), H200, small, time_limit=20, stream="off")
    big = Budgets(fixed + blocks // 2)
    seeds = _seed_candidates([out.plan], big)
    assert len(seeds) == 1 and seeds[0].origin == "seed"
    assert seeds[0].plan.budgets == big
    assert seeds[0].sim.step_s == pytest.approx(out.plan.predicted.step_s)
    assert simulate(seeds[0].plan).fits
    # it does not fit a smaller budget: not a candidate there
    assert _seed_candidates([out.plan], Budgets(fixed)) == []
    # the solve at the larger budget is never slower than the seed
    got = solve_profile(p, str(path), H200, big, time_limit=20, stream="off",
                        seeds=(out.plan,))
    assert got.plan.predicted.step_s <= out.plan.predicted.step_s + 1e-12
    assert "seed" in got.tried
