"""Per-unit measured times in the report, and ``plan calibrate`` / ``plan inspect --report``."""
from __future__ import annotations

import dataclasses
import json
import statistics
import threading
import time

import pytest
import torch

from conftest import plan_for
from planner.profile.calibrate import calibrate
from planner.cli import main
from planner.formats import load_profile, write_json_atomic
from planner.models import build_model, load_config, make_inputs
from planner.formats.report import Report, StepRecord, load_report
from planner.sizes import fmt_seconds
from runtime import apply_plan
from runtime.timing import LinkClock, StageClock

B, S = 2, 16
MIXED = [("keep", None), ("recompute", "nvme"), ("recompute", "none"), ("nvme", None)]


# ----------------------------------------------------------------------------- the clocks

class _Fake(StageClock):
    """A StageClock whose timestamps are given by the test."""

    def __init__(self, names):
        super().__init__(names, torch.device("cpu"))
        self.t = 0.0

    def now(self):
        return self.t


def test_stage_marks_become_unit_times_exactly():
    # units e, b0, b1, h: stages F 1..4, B 5..8, end 9; b1's stage 6 holds b0..b1's recompute
    c = _Fake(["e", "b0", "b1", "h"])
    c.begin_step()
    c.begin_pass()
    wait = 0.0
    for stage, t, w in [(0, 0.0, 0.0), (1, 0.0, 0.0), (2, 1.0, 0.0), (3, 3.0, 0.5),
                        (4, 6.0, 0.5)]:
        c.t = t
        c.mark(stage, w)
    c.t = 7.0
    c.forward_done()                    # head forward: 6 -> 7
    c.t = 20.0                          # the loop's own time before backward: not the head's
    c.backward_seen()
    c.mark(5, 0.5)
    c.t = 22.0
    c.mark(6, 0.5)                      # head backward 2
    c.t = 23.0
    c.recompute("b0", 23.0, 24.0)
    c.recompute("b1", 24.0, 26.0)
    c.t = 30.0
    c.mark(7, 1.5)                      # b1 backward stage 8 s, of which 1 s stall, 3 recompute
    c.t = 33.0
    c.mark(8, 1.5)                      # b0 backward 3
    c.t = 34.0
    c.mark(9, 1.5)                      # e backward 1
    c.t = 36.0
    units, after, links = c.end_step()
    assert units["e"] == {"fwd_s": 1.0, "bwd_s": 1.0, "stall_s": 0.0}
    # b0: 1 -> 3 with the 0.5 s wait at stage 3's barrier left out
    assert units["b0"] == {"fwd_s": 1.5, "bwd_s": 3.0, "stall_s": 0.0, "recompute_s": 1.0}
    assert units["b1"] == {"fwd_s": 3.0, "bwd_s": 4.0, "stall_s": 1.0, "recompute_s": 2.0}
    assert units["h"] == {"fwd_s": 1.0, "bwd_s": 2.0, "stall_s": 0.0}
    assert after == 2.0 and links == {}


def test_a_pass_without_backward_adds_no_backward_times():
    c = _Fake(["e", "b0", "h"])
    c.begin_step()
    for p, (f, bw) in enumerate([(1.0, None), (2.0, 3.0)]):
        base = 100.0 * p
        c.begin_pass()
        for stage in (1, 2, 3):
            c.t = base + f * (stage - 1)
            c.mark(stage, 0.0)
        c.t = base + 3 * f
        c.forward_done()
        if bw is not None:
            c.backward_seen()
        for stage in (4, 5, 6, 7):      # dropped: the next forward runs these back to back
            c.t = base + 50 + (bw or 0.0) * (stage - 4)
            c.mark(stage, 0.0)
    units, _, _ = c.end_step()
    assert units["b0"]["fwd_s"] == 1.5            # both passes' forwards: (1 + 2) / 2
    assert units["b0"]["bwd_s"] == 3.0            # only the pass whose backward ran


def test_link_busy_time_is_the_union_of_overlapping_transfers():
    clk = LinkClock()
    before = clk.snapshot()
    started = threading.Event()

    def other():
        with clk.busy_with("nvme_read", 100):
            started.set()
            time.sleep(0.2)
    t0 = time.perf_counter()
    th = threading.Thread(target=other)
    th.start()
    started.wait()
    with clk.busy_with("nvme_read", 50):
        time.sleep(0.1)
    th.join()
    wall = time.perf_counter() - t0
    got = LinkClock.since(before, clk.snapshot())["nvme_read"]
    assert got["bytes"] == 150
    # one interval of ~0.2 s, not 0.3 s of summed calls
    assert 0.19 <= got["busy_s"] <= wall + 1e-6 < 0.29


# ----------------------------------------------------------------------------- the runtime

def _train(plan, model, cfg, steps=3, K=1, streams=False):
    opt = torch.optim.AdamW(model.parameters())
    h = apply_plan(model, plan, optimizer=opt if streams else None)
    for k in range(steps):
        for j in range(K):
            model(**make_inputs(cfg, B, S, seed=k * K + j)).loss.backward()
        opt.step()
        opt.zero_grad()
    rep = h.report()
    h.remove()
    return rep


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cal")
    cfg = dict(load_config("gpt-tiny"), dtype="fp32", n_layers=4)
    model = build_model(cfg, dtype="fp32")
    plan = plan_for(model, MIXED, B, S, nvme_dir=tmp / "n")
    rep = _train(plan, model, cfg)
    return tmp, cfg, plan, rep


def test_report_has_every_units_times(trained):
    tmp, cfg, plan, rep = trained
    names = [u.name for u in plan.units]
    assert rep.units == names and rep.structure_hash == plan.model["structure_hash"]
    for st in rep.steps:
        assert set(st.units) == set(names)
        for n in names:
            assert st.units[n]["fwd_s"] > 0 and st.units[n]["bwd_s"] >= 0
        # the segment blocks.1..blocks.2 (checkpoint on NVMe) is re-run in blocks.2's backward
        assert set(n for n in names if "recompute_s" in st.units[n]) == {"blocks.1", "blocks.2"}
        total = sum(sum(v for k, v in t.items() if k != "stall_s") for t in st.units.values())
        assert total <= st.step_s
        assert st.after_backward_s is not None and 0 < st.after_backward_s < st.step_s
        # the disk links: what the runtime moved over them, and some busy time
        assert st.links["nvme_write"]["bytes"] >= st.moved["nvme_write"] > 0
        assert st.links["nvme_read"]["busy_s"] > 0
    back = load_report(rep.save(tmp / "r.json"))
    assert back.unit_times() == rep.unit_times() and back.units == names


def test_gradient_accumulation_times_are_per_pass(tmp_path):
    cfg = dict(load_config("gpt-tiny"), dtype="fp32", n_layers=2)
    model = build_model(cfg, dtype="fp32")
    plan = plan_for(model, "keep-all", B, S, micro_batches=2)
    rep = _train(plan, model, cfg, steps=2, K=2)
    st = rep.steps[-1]
    assert st.passes == 2
    per_pass = sum(t["fwd_s"] + t["bwd_s"] for t in st.units.values())
    assert per_pass < st.step_s / 2 * 1.0001


# ----------------------------------------------------------------------------- plan calibrate

def _profile_and_report(tmp_path, trained):
    """The plan's profile as a file, and the run's report as a file."""
    _, _, plan, rep = trained
    from planner.formats import Profile
    prof = Profile(model=dict(plan.model), device="meta", timing="estimated",
                   hardware=dict(plan.hardware), layers=list(plan.units))
    pp = write_json_atomic(tmp_path / "prof.json", prof.to_dict())
    rp = rep.save(tmp_path / "rep.json")
    return pp, rp, rep


def test_calibrate_writes_the_measured_medians_and_bandwidths(tmp_path, trained, monkeypatch):
    import planner.profile.calibrate
    pp, rp, rep = _profile_and_report(tmp_path, trained)
    rates = rep.link_rates()
    # this small model moves less than a MiB a link: below the floor the spec's figure stays
    assert all(r["bytes"] < planner.profile.calibrate.MIN_LINK_BYTES for r in rates.values())
    cal0, _ = calibrate(load_profile(pp), rep, str(pp), str(rp))
    assert cal0.hardware["nvme_read_bandwidth"] == load_profile(pp).hardware["nvme_read_bandwidth"]
    monkeypatch.setattr(planner.profile.calibrate, "MIN_LINK_BYTES", 1)
    before = pp.read_bytes()
    out = tmp_path / "cal.json"
    assert main(["calibrate", str(pp), "--report", str(rp), "-o", str(out)]) == 0
    assert pp.read_bytes() == before                  # the input is untouched
    cal = load_profile(out)
    times = rep.unit_times()
    for u in cal.layers:
        assert u.fwd_s == times[u.name]["fwd_s"] and u.bwd_s == times[u.name]["bwd_s"]
        assert u.samples == 2                          # three steps, the first left out
    old = load_profile(pp)
    # bytes and FLOPs unchanged
    assert [dataclasses.replace(u, fwd_s=0, bwd_s=0, samples=0) for u in cal.layers] == \
        [dataclasses.replace(u, fwd_s=0, bwd_s=0, samples=0) for u in old.layers]
    assert cal.hardware["nvme_read_bandwidth"] == rates["nvme_read"]["bytes_per_s"]
    assert cal.hardware["nvme_write_bandwidth"] == rates["nvme_write"]["bytes_per_s"]
    assert "calibrated" in cal.hardware["sources"]["nvme_read_bandwidth"]
    assert cal.optimizer_s == rep.after_backward_s() and cal.timing == "measured"
    prov = cal.model["calibration"]
    assert prov["report"] == str(rp) and prov["steps"] == 2 and len(prov["report_sha256"]) == 64
    # the calibrated profile solves and its plan's prediction uses the measured times
    plan = tmp_path / "p.json"
    assert main(["solve", str(out), "--gpu-mem", "20G", "--policy", "keep-all",
                 "-o", str(plan)]) == 0
    from planner.formats import load_plan
    p = load_plan(plan)
    assert p.predicted.compute_s == pytest.approx(
        sum(u.fwd_s + u.bwd_s for u in cal.layers) + cal.optimizer_s, rel=1e-6)


def test_calibrate_json(tmp_path, trained, capsys):
    pp, rp, _ = _profile_and_report(tmp_path, trained)
    assert main(["calibrate", str(pp), "--report", str(rp), "-o", str(tmp_path / "c.json"),
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert len(d["units"]) == 6 and d["output"] == str(tmp_path / "c.json")
    assert d["provenance"]["steps"] == 2


def _mismatch(tmp_path, trained, change):
    pp, rp, rep = _profile_and_report(tmp_path, trained)
    d = json.loads(rp.read_text())
    change(d)
    rp.write_text(json.dumps(d))
    return pp, rp


@pytest.mark.parametrize("change, needle", [
    (lambda d: d.update(units=d["units"][:-1]), "units differ at position 5"),
    (lambda d: d.update(units=list(reversed(d["units"]))), "units differ at position 0"),
    (lambda d: d.update(structure_hash="deadbeef"), "structure hash deadbeef"),
    (lambda d: d.update(units=[]), "has no per-unit times"),
    (lambda d: d["plan"].update(batch=B + 1), "ran --batch 3"),
    # another machine or dtype: its times would be written into a profile claiming this one
    (lambda d: d.update(device="cuda"), "ran on device cuda but profile"),
    (lambda d: d.update(dtype="bf16"), "ran in bf16 but profile"),
    (lambda d: d["steps"][0]["units"]["head"].update(fwd_s=-1), "fwd_s must be"),
    (lambda d: d["steps"][0]["units"]["head"].update(zap=1.0), "'zap' is not one of"),
])
def test_a_report_of_another_profile_is_one_line_exit_2(tmp_path, trained, capsys, change,
                                                        needle):
    pp, rp = _mismatch(tmp_path, trained, change)
    out = tmp_path / "cal.json"
    assert main(["calibrate", str(pp), "--report", str(rp), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
    assert not out.exists()


def test_the_report_records_the_dtype_and_a_run_of_the_same_machine_calibrates(tmp_path,
                                                                              trained, capsys):
    pp, rp, rep = _profile_and_report(tmp_path, trained)
    assert rep.dtype == "fp32" and load_report(rp).dtype == "fp32"
    # a CPU profile (not only an estimated one) calibrated from a CPU run of it
    d = json.loads(pp.read_text())
    d["device"] = "cpu"
    pp.write_text(json.dumps(d))
    assert main(["calibrate", str(pp), "--report", str(rp), "-o", str(tmp_path / "c.json")]) == 0
    # a plan solved with --hardware naming another spec of this machine (a measured one)
    d = json.loads(rp.read_text())
    d["plan"]["hardware"] = "this-host"
    rp.write_text(json.dumps(d))
    assert main(["calibrate", str(pp), "--report", str(rp), "-o", str(tmp_path / "d.json")]) == 0


def test_calibrate_never_overwrites_its_input(tmp_path, trained, capsys):
    pp, rp, _ = _profile_and_report(tmp_path, trained)
    before = pp.read_bytes()
    assert main(["calibrate", str(pp), "--report", str(rp), "-o", str(pp)]) == 2
    assert "input" in capsys.readouterr().err and pp.read_bytes() == before
    # without -o: beside the input
    assert main(["calibrate", str(pp), "--report", str(rp)]) == 0
    assert (tmp_path / "prof-calibrated.json").is_file() and pp.read_bytes() == before
    # the default output is checked as -o is: a folder there is one line, exit 2
    (tmp_path / "prof-calibrated.json").unlink()
    (tmp_path / "prof-calibrated.json").mkdir()
    assert main(["calibrate", str(pp), "--report", str(rp)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_calibrate_needs_a_measured_step(tmp_path, trained):
    _, _, plan, rep = trained
    empty = dataclasses.replace(rep, steps=[])
    from planner.errors import UserError
    from planner.formats import Profile
    prof = Profile(model=dict(plan.model), device="meta", timing="estimated",
                   hardware=dict(plan.hardware), layers=list(plan.units))
    with pytest.raises(UserError, match="no measured step"):
        calibrate(prof, empty, "p", "r")


def test_inspect_report_shows_units_predicted_and_measured(tmp_path, trained, capsys):
    tmp, _, plan, rep = trained
    pp = write_json_atomic(tmp_path / "plan.json", plan.to_dict())
    rp = rep.save(tmp_path / "r.json")
    assert main(["inspect", str(pp), "--report", str(rp)]) == 0
    out = capsys.readouterr().out
    assert "fwd pred  fwd meas" in out
    row = next(line for line in out.splitlines() if line.strip().startswith("blocks.2 ")
               and "recompute" not in line.split()[1:2])
    assert f"{rep.unit_times()['blocks.2']['fwd_s'] * 1e3:.2f}" in row
    assert "nvme_read:" in out and "GB/s measured" in out
    assert main(["inspect", str(pp), "--report", str(rp), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [r["unit"] for r in d["units_measured"]] == [u.name for u in plan.units]


def test_an_old_report_without_unit_times_still_loads(tmp_path, trained):
    _, _, plan, rep = trained
    d = rep.to_dict()
    for k in ("units", "structure_hash", "measured_units", "measured_links"):
        d.pop(k)
    for s in d["steps"]:
        for k in ("units", "links", "after_backward_s"):
            s.pop(k)
    p = tmp_path / "old.json"
    p.write_text(json.dumps(d))
    back = load_report(p)
    assert back.units == [] and back.unit_times() == {}
    assert isinstance(back, Report) and all(isinstance(s, StepRecord) for s in back.steps)


def test_a_step_whose_rss_mark_lags_its_base_records_no_negative_rise(tmp_path, monkeypatch):
    # The kernel's RSS counters are cached per thread, so VmHWM read at a step's end can be a
    # few pages below the VmRSS read at its start (seen: -268 KiB on this host); the report's
    # loader rejects a negative byte count, so such a report could not be read back.
    import runtime.apply
    import runtime.report
    # both readers: the step's base (apply) and its peak (report.read_peak); with the peak's
    # read left real, the test failed once the process's own RSS passed the 1 GiB base (late
    # in a long pytest run)
    fake = lambda: {"VmRSS": 1 << 30, "VmHWM": (1 << 30) - 274432}  # noqa: E731
    monkeypatch.setattr(runtime.apply, "read_status", fake)
    monkeypatch.setattr(runtime.report, "read_status", fake)
    cfg = dict(load_config("gpt-tiny"), dtype="fp32", n_layers=2)
    model = build_model(cfg, dtype="fp32")
    rep = _train(plan_for(model, "keep-all", B, S), model, cfg, steps=2)
    assert all(s.peak_gpu_bytes == 0 for s in rep.steps)
    assert load_report(rep.save(tmp_path / "r.json")).steps[1].peak_gpu_bytes == 0


# ----------------------------------------------------------------------------- the optimizer's own time

@pytest.mark.parametrize("home", ["state on disk, stepped in pieces",
                                  "weights and gradients on disk, state on the device"])
def test_a_streaming_step_times_every_update_and_calibrate_takes_that_not_the_phase(tmp_path,
                                                                                    home):
    """A plan whose optimizer phase reads and writes state on the disk: the report times the
    device's updates (every trainable element once a step, the plan's per-unit steps and the
    user's optimizer over what stays on the device), apart from the phase's waiting; the
    calibrated optimizer_s is that rate times the model's parameters, not the phase's time,
    which also holds the transfers the cost model charges to the links."""
    from planner.formats import Home, Tier as T
    cfg = dict(load_config("gpt-tiny"), dtype="fp32", n_layers=3)
    torch.manual_seed(0)
    model = build_model(cfg, dtype="fp32")
    plan = plan_for(model, "keep-all", B, S, nvme_dir=tmp_path / "n",
                    homes={"blocks": Home(T.GPU, T.GPU, T.NVME, T.GPU) if "pieces" in home
                           else Home(T.NVME, T.NVME, T.GPU, T.GPU)})
    rep = _train(plan, model, cfg, steps=4, streams=True)
    n = sum(p.numel() for p in model.parameters())
    for st in rep.steps:
        assert st.optimizer_elements == n
        assert 0 < st.optimizer_compute_s < st.after_backward_s
    line = next(x for x in str(rep).splitlines() if "of which the device's updates" in x)
    assert fmt_seconds(statistics.median(s.optimizer_compute_s for s in rep.steps[1:])) in line
    back = load_report(rep.save(tmp_path / "r.json"))
    assert [s.optimizer_compute_s for s in back.steps] == [s.optimizer_compute_s
                                                           for s in rep.steps]
    use = rep.steps[1:]
    per = sum(s.optimizer_compute_s for s in use) / sum(s.optimizer_elements for s in use)
    assert rep.optimizer_seconds_per_element() == pytest.approx(per, rel=1e-12)
    pp, rp, _ = _profile_and_report(tmp_path, (None, None, plan, rep))
    prof = load_profile(pp)
    assert prof.model.get("param_count", sum(u.param_count for u in prof.layers)) == n
    cal, summary = calibrate(prof, rep, str(pp), str(rp))
    assert cal.optimizer_s == pytest.approx(per * n, rel=1e-12)
    assert cal.optimizer_s < rep.after_backward_s()
    assert summary["provenance"]["optimizer_from"] == "updates"


def _rec(**kw):
    base = dict(step_s=1.0, passes=1, peak_gpu_bytes=0, peak_cpu_bytes=0, peak_nvme_bytes=0,
                peak_activation_bytes=0, static_bytes=0, base_bytes=0, after_backward_s=0.5)
    return StepRecord(**{**base, **kw})


def test_calibrate_prices_the_timed_updates_per_element_and_falls_back_without_them(
        tmp_path, trained):
    pp, _, rep = _profile_and_report(tmp_path, trained)
    prof = load_profile(pp)
    n = sum(u.param_count for u in prof.layers)
    rp = tmp_path / "r.json"
    # the first step is left out; the others' seconds over their elements, times the model's
    steps = [_rec(optimizer_compute_s=9.0, optimizer_elements=10),
             _rec(optimizer_compute_s=0.2, optimizer_elements=100),
             _rec(optimizer_compute_s=0.4, optimizer_elements=300)]
    timed = dataclasses.replace(rep, steps=[dataclasses.replace(s, **{
        k: getattr(t, k) for k in ("optimizer_compute_s", "optimizer_elements")})
        for s, t in zip(rep.steps, steps)])
    timed.save(rp)
    cal, summary = calibrate(prof, load_report(rp), str(pp), str(rp))
    assert cal.optimizer_s == pytest.approx(0.6 / 400 * n, rel=1e-12)
    assert summary["provenance"]["optimizer_from"] == "updates"
    # no timed update (a plan without a streaming phase): the time after the backward
    cal, summary = calibrate(prof, rep, str(pp), str(rp))
    assert cal.optimizer_s == rep.after_backward_s()
    assert summary["provenance"]["optimizer_from"] == "after_backward"


@pytest.mark.parametrize("change, needle", [
    ({"optimizer_compute_s": -1.0}, "optimizer_compute_s must be"),
    ({"optimizer_compute_s": "fast"}, "optimizer_compute_s must be"),
    ({"optimizer_elements": -3}, "optimizer_elements must be"),
    ({"optimizer_elements": 2.5}, "optimizer_elements must be"),
])
def test_a_bad_timed_update_in_a_report_is_one_line(tmp_path, trained, capsys, change, needle):
    pp, rp, _ = _profile_and_report(tmp_path, trained)
    d = json.loads(rp.read_text())
    d["steps"][1].update(change)
    rp.write_text(json.dumps(d))
    assert main(["calibrate", str(pp), "--report", str(rp), "-o", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and len(err.splitlines()) == 1
