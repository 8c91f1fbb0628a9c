"""Trustworthy timings: repeats until stable, the spread recorded, the load of other
processes measured, a backward/forward check, warnings that name units, and times estimated
from FLOPs instead of measured. The tests assert the logic, never the host's speed."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import planner.profile.timing as P
from planner.cli import main
from planner.formats import UnitRecord
from planner.hardware import load_hardware
from planner.profile import profile_model

CPU = load_hardware("cpu-host")


def test_spread_is_the_interquartile_range_over_the_median():
    assert P._spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2 / 3)
    assert P._spread([2.0]) == 0.0 and P._spread([]) == 0.0


def test_repeats_stop_when_stable_and_at_the_limits(monkeypatch):
    rep = P._Repeats(5)
    steady, noisy = [1.0] * 5, [1.0, 2.0, 1.0, 3.0, 1.0]
    assert not rep.done(4, [steady[:4]])          # fewer than --repeats
    assert rep.done(5, [steady])                   # stable at the minimum
    assert not rep.done(5, [noisy])                # unstable: more repeats
    assert rep.done(20, [noisy * 4])               # up to MAX_REPEAT_FACTOR x --repeats
    monkeypatch.setattr(P, "TIMING_BUDGET_S", 0.0)
    assert P._Repeats(5).done(5, [noisy])          # or the time budget


def test_load_meter_counts_other_processes(monkeypatch):
    # /proc/stat busy seconds per line, our own CPU seconds, wall seconds: others used 3 - 1
    # CPU-s in 2 s on our two CPUs
    monkeypatch.setattr(P, "usable_cpus", lambda: {0, 1})
    reads = iter([({"cpu": 100.0, "cpu0": 60.0, "cpu1": 40.0}, 10.0, 50.0),
                  ({"cpu": 103.0, "cpu0": 61.5, "cpu1": 41.5}, 11.0, 52.0)])
    monkeypatch.setattr(P._LoadMeter, "_read", staticmethod(lambda: next(reads)))
    assert P._LoadMeter().other_cpus() == pytest.approx(1.0)
    reads = iter([({"cpu": 100.0}, 10.0, 50.0), ({"cpu": 100.0}, 10.0, 50.1)])  # too short
    assert P._LoadMeter().other_cpus() is None


def test_load_meter_reads_only_the_cpus_this_process_may_use(monkeypatch, tmp_path):
    """Under taskset or a container's cpuset, work on the machine's other CPUs does not touch
    our timings: only the lines of the CPUs our threads may run on count, at the start or the
    end (torch starts its workers lazily; with OMP_PROC_BIND the main thread's own CPU alone
    missed a busy loop beside them); the first line, all CPUs, where /proc/stat has no line
    per CPU."""
    stat = tmp_path / "stat"
    monkeypatch.setattr(P, "PROC_STAT", str(stat))
    tick = os.sysconf("SC_CLK_TCK")
    #               user nice system idle iowait irq softirq steal guest
    stat.write_text("cpu  700 0 0 9 9 0 0 0 0\n"
                    "cpu0 100 0 10 9 9 0 0 1 0\n"
                    "cpu1 500 0 0 9 9 0 0 0 0\n"
                    "cpu2 80 0 0 9 9 5 4 0 0\n"
                    "intr 123 4 5\n")
    assert P._LoadMeter._read()[0] == pytest.approx(
        {"cpu": 700 / tick, "cpu0": 111 / tick, "cpu1": 500 / tick, "cpu2": 89 / tick})
    cpus = iter([{0}, {0, 2}])
    monkeypatch.setattr(P, "usable_cpus", lambda: next(cpus))
    meter = P._LoadMeter()
    meter.start = ({"cpu": 7.0, "cpu0": 1.0, "cpu1": 5.0, "cpu2": 1.0}, 0.0, 0.0)
    stat.write_text(f"cpu  {9 * tick} 0 0 9 9 0 0 0 0\ncpu0 {1 * tick} 0 0 9 9 0 0 0 0\n"
                    f"cpu1 {6 * tick} 0 0 9 9 0 0 0 0\ncpu2 {2 * tick} 0 0 9 9 0 0 0 0\n")
    monkeypatch.setattr(P.time, "perf_counter", lambda: 1.0)
    monkeypatch.setattr(P.os, "times", lambda: os.times_result((0.0, 0.0, 0.0, 0.0, 0.0)))
    assert meter.other_cpus() == pytest.approx(1.0)     # cpu2's second, not cpu1's
    stat.write_text(f"cpu  {9 * tick} 0 0 9 9 0 0 0 0\n")
    meter.start = ({"cpu": 7.0}, 0.0, 0.0)
    monkeypatch.setattr(P, "usable_cpus", lambda: {0})
    assert meter.other_cpus() == pytest.approx(2.0)     # no line per CPU: all of them
    stat.write_text("intr 123 4 5\n")
    assert P._LoadMeter._read() is None


def _rec(name, fwd_s, bwd_s, fwd_flops=0, bwd_flops=0, samples=5):
    return UnitRecord(name=name, kind="block", param_bytes=0, grad_bytes=0, optimizer_bytes=0,
                      input_bytes=0, output_bytes=0, saved_bytes=0, workspace_bytes=0,
                      fwd_flops=fwd_flops, bwd_flops=bwd_flops, fwd_s=fwd_s, bwd_s=bwd_s,
                      samples=samples)


def test_quality_names_the_units_that_matter(monkeypatch):
    monkeypatch.setattr(P, "usable_cpus", lambda: {0, 1})
    recs = [_rec("a", 1.0, 2.0), _rec("b", 0.01, 0.02), _rec("c", 1.0, 2.0)]
    spreads = {"a": [0.40, 0.0], "b": [0.9, 0.9], "c": [0.05, 0.05]}
    q = P._timing_quality(recs, spreads, {}, 5, load=0.0, threads=2)
    # a varies by 40% of 1 s in a 6 s step: named; b varies more, but by 0.03 s: not
    assert q["wide_spread"] == ["a"] and not q["reliable"]
    assert "timings of a vary by more than 25%" in q["warnings"][0]
    q = P._timing_quality(recs, {n: [0.0, 0.0] for n in spreads}, {}, 5, load=0.2, threads=2)
    assert q["reliable"] and q["warnings"] == []
    q = P._timing_quality(recs, {n: [0.0, 0.0] for n in spreads}, {}, 5, load=1.0, threads=2)
    assert q["warnings"][0].startswith("other processes used 1.00 CPUs on average while timing")
    # the same load on cores our threads leave idle does not touch our timings
    q = P._timing_quality(recs, {n: [0.0, 0.0] for n in spreads}, {}, 5, load=1.0, threads=1)
    assert q["reliable"]


def test_backward_forward_check_flags_a_backward_faster_than_its_forward():
    recs = [_rec("a", 1.0, 0.3, 10, 20), _rec("b", 1.0, 2.1, 10, 20)]
    q = P._timing_quality(recs, {"a": [0, 0], "b": [0, 0]},
                          {"a": [0.3, 2.0], "b": [2.1, 2.0]}, 5, load=0.0, threads=1)
    assert q["ratio_mismatch"] == {"a": [0.3, 2.0]}
    assert q["warnings"] == ["backward/forward time ratio of a is 0.3 against a FLOP ratio of "
                             "2.0 (more than 3x off for compute-bound units); re-profile on a "
                             "quiet machine or use --timing estimate"]


def test_a_measured_profile_records_its_spread_and_repeats():
    prof = profile_model("gpt-tiny", 2, 16, dtype="fp32", device="cpu", hardware=CPU, repeats=3)
    q = prof.model["timing_quality"]
    assert q["statistic"] == "median" and q["repeats"] == 3 and q["max_repeats"] == 12
    assert set(q["spread"]) == {u.name for u in prof.layers}
    for u in prof.layers:
        assert 3 <= u.samples <= 12 and q["samples"][u.name] == u.samples
    assert q["reliable"] == (q["warnings"] == [])


def test_a_busy_core_makes_the_profile_say_its_timings_are_unreliable(capsys, tmp_path):
    """gpt-tiny at batch 8, sequence 128, profiled while other processes keep every core busy:
    the profile is marked unreliable and the CLI says why on stderr (exit 0). One busy loop per
    core, each running before the profile starts: a single loop that was still starting, or that
    the scheduler starved beside our threads, once left too little load to see (CI, stop 22).
    The profile times at every core (``--compute-threads all``): at its default, every core but
    one, the idle core lets a loop run unseen and the warning needs 1.25 CPUs of load, which
    two loops beside one thread (4/3 CPUs) missed once (CI, stop 38)."""
    threads = torch.get_num_threads()
    cpus = len(P.usable_cpus())
    torch.set_num_threads(cpus)                # no idle core for the busy loops to use
    hogs = [subprocess.Popen([sys.executable, "-c", "print('up', flush=True)\nwhile True: pass"],
                             stdout=subprocess.PIPE, text=True) for _ in range(cpus)]
    try:
        assert all(h.stdout.readline() == "up\n" for h in hogs)
        out = tmp_path / "p.json"
        assert main(["profile", "gpt-tiny", "--batch", "8", "--seq", "128", "--dtype", "fp32",
                     "--device", "cpu", "--repeats", "2", "--compute-threads", "all",
                     "-o", str(out)]) == 0
    finally:
        for h in hogs:
            h.kill()
            h.wait()
            h.stdout.close()
        torch.set_num_threads(threads)
    err = capsys.readouterr().err
    assert "plan: warning: timings unreliable: other processes used" in err, err
    from planner.formats import load_profile
    q = load_profile(out).model["timing_quality"]
    assert q["other_load_cpus"] >= P.LOAD_CPUS and not q["reliable"]


def test_timing_estimate_on_cpu_and_its_refusal_on_meta(capsys, tmp_path):
    est = profile_model("gpt-tiny", 2, 16, dtype="fp32", device="cpu", hardware=CPU,
                        timing="estimate")
    meta = profile_model("gpt-tiny", 2, 16, dtype="fp32", device="meta", hardware=CPU)
    assert est.timing == "estimated" and "timing_quality" not in est.model
    for a, b in zip(est.layers, meta.layers):
        assert (a.samples, a.fwd_s, a.bwd_s, a.saved_bytes) == (0, b.fwd_s, b.bwd_s,
                                                                b.saved_bytes)
    assert main(["profile", "gpt-tiny", "--batch", "2", "--seq", "8", "--device", "meta",
                 "--timing", "measure", "-o", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--timing measure needs --device cpu or cuda" in err
