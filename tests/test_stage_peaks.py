"""Peaks per stage: the runtime reads and resets the device peak as each stage begins, so a
report says in which stage the measured peak fell, beside the simulator's figure for that
stage (which a plan now carries, ``predicted.stage_gpu_bytes``).
"""
from __future__ import annotations

import copy
import json

import pytest
import torch

from planner.errors import UserError
from planner.formats import Home, Tier as T
from planner.formats.plan import Plan
from planner.formats.report import Report, load_report_dict
from planner.models import build_model, load_config, make_inputs
from runtime import apply_plan
from runtime.report import StagePeaks
from runtime.stages import StageDriver

from conftest import plan_for

B, S, K = 2, 16, 2


class _Counters:
    """A backend with device memory counters, driven by hand (as CUDA's allocator)."""

    def __init__(self):
        self.now = self.top = 0

    def alloc(self, n):
        self.now += n
        self.top = max(self.top, self.now)

    def peak(self):
        return self.top

    def reset_peak(self):
        self.top = self.now


def _run_passes(sp, be, allocs, between=0, optimizer=7):
    """Passes through a real StageDriver (two units: stages 0..4, the optimizer 5) feeding
    ``sp``; ``allocs[k][s]``: what pass k allocates and frees again in stage s; ``between``:
    what the loop allocates and frees between the passes."""
    drv = StageDriver({}, 4, lambda c, a: None, lambda c: None, lambda c, s: sp.cut(s))
    sp.begin(None)
    for k, per_stage in enumerate(allocs):
        drv.begin(object())
        for s in range(5):
            drv.enter(s)
            be.alloc(per_stage[s])
            be.alloc(-per_stage[s])
        drv.finish()
        if k + 1 < len(allocs):
            be.alloc(between)
            be.alloc(-between)
    be.alloc(optimizer)                      # the optimizer step
    be.alloc(-optimizer)
    return sp.end()


def test_stage_peaks_keep_each_stages_largest_over_the_passes():
    be = _Counters()
    sp = StagePeaks(be, 6)
    # the first pass larger in stage 1, the second in stage 3: each stage keeps its largest
    got = _run_passes(sp, be, [[1, 40, 2, 10, 3], [1, 20, 2, 30, 3]])
    assert got == [1, 40, 2, 30, 3, 7]
    assert sp.end() is None                  # nothing open after the step ended


def test_between_passes_counts_as_the_last_backward_not_the_optimizer_phase():
    be = _Counters()
    sp = StagePeaks(be, 6)
    got = _run_passes(sp, be, [[0] * 5, [0] * 5], between=100, optimizer=7)
    assert got == [0, 0, 0, 0, 100, 7]


def test_stage_peaks_none_when_no_peak_can_be_read(monkeypatch):
    import runtime.report as rr

    class NoCounters:
        def peak(self):
            return None

    monkeypatch.setattr(rr, "reset_hwm", lambda: False)
    sp = StagePeaks(NoCounters(), 6)
    got = _run_passes(sp, _Counters(), [[0] * 5])
    assert got is None and sp.failed


def test_a_plan_carries_the_simulated_memory_of_every_stage(tmp_path):
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    model = build_model(cfg, dtype="fp32")
    plan = plan_for(model, "recompute-all", B, S, nvme_dir=tmp_path / "nvme",
                    homes={"blocks": Home(T.NVME, T.NVME, T.NVME, T.GPU)}, micro_batches=K)
    got = plan.predicted.stage_gpu_bytes
    assert len(got) == 2 * len(plan.units) + 2
    assert max(got) == plan.predicted.peak_gpu_bytes
    d = plan.to_dict()
    assert Plan.from_dict(json.loads(json.dumps(d)), "p.json").predicted == plan.predicted
    # a list that does not match the units is one line naming the field
    bad = copy.deepcopy(d)
    bad["predicted"]["stage_gpu_bytes"] = got[:-1]
    with pytest.raises(UserError, match="stage_gpu_bytes has .* entries, but .* units"):
        Plan.from_dict(bad, "p.json")
    bad["predicted"]["stage_gpu_bytes"] = [1, -2]
    with pytest.raises(UserError, match="stage_gpu_bytes must be a list of non-negative"):
        Plan.from_dict(bad, "p.json")
    # plans written before the field load, without it
    old = copy.deepcopy(d)
    del old["predicted"]["stage_gpu_bytes"]
    assert Plan.from_dict(old, "p.json").predicted.stage_gpu_bytes == ()


def _streaming_run(tmp_path, **kw):
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    torch.manual_seed(0)
    model = build_model(cfg, dtype="fp32")
    model.train()
    plan = plan_for(model, "recompute-all", B, S, nvme_dir=tmp_path / "nvme",
                    homes={"blocks": Home(T.NVME, T.NVME, T.NVME, T.GPU)}, micro_batches=K)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = apply_plan(model, plan, optimizer=opt, **kw)
    for step in range(3):
        for k in range(K):
            (model(**make_inputs(cfg, B, S, seed=step * K + k)).loss / K).backward()
        opt.step()
        opt.zero_grad()
    return plan, handle


def test_a_streaming_run_reports_the_peak_of_every_stage(tmp_path, monkeypatch):
    import runtime.streaming as rs
    from runtime.report import StagePeaks as SP

    # the order at a stage's start: the previous unit's weights released, then the cut (the
    # plan frees them at the end of their stage), then the current unit's taken into use
    log = []
    for name in ("release", "use"):
        orig = getattr(rs.UnitStatic, name)

        def spy(self, *a, _o=orig, _n=name, **k):
            log.append(_n)
            return _o(self, *a, **k)
        monkeypatch.setattr(rs.UnitStatic, name, spy)
    orig_cut = SP.cut

    def cut(self, stage):
        log.append("cut")
        return orig_cut(self, stage)
    monkeypatch.setattr(SP, "cut", cut)
    plan, handle = _streaming_run(tmp_path, stage_peaks=True)
    rep = handle.report()
    if not rep.hwm_reset:
        pytest.skip("/proc/self/clear_refs is not writable here: no peak can be reset")
    releases = [i for i, x in enumerate(log) if x == "release"]
    assert releases and all(log[i + 1] == "cut" for i in releases), log[:40]
    n = 2 * len(plan.units) + 2
    for s in rep.steps:
        assert s.stage_peaks is not None and len(s.stage_peaks) == n
        assert all(x is not None for x in s.stage_peaks), s.stage_peaks
        assert max(s.stage_peaks) == s.peak_gpu_bytes
    med = rep.stage_peaks()
    m = max(range(n), key=lambda k: med[k])
    lines = rep.stage_summary()
    assert lines[0].startswith(f"  measured peak in {rep.stage_name(m)}: ")
    assert lines[0] in str(rep)
    # the report round-trips with its stage peaks; a malformed list is one line
    d = json.loads(json.dumps(rep.to_dict()))
    back = load_report_dict(d, "r.json")
    assert [s.stage_peaks for s in back.steps] == [s.stage_peaks for s in rep.steps]
    assert back.stage_summary() == lines
    bad = copy.deepcopy(d)
    bad["steps"][0]["stage_peaks"] = [1, "x"]
    with pytest.raises(UserError, match="stage_peaks must be null or a list of byte counts"):
        load_report_dict(bad, "r.json")
    # lists that do not match the units (a report edited by hand) give no stage lines
    bad["steps"] = [dict(s, stage_peaks=[1, 2]) for s in bad["steps"]]
    assert load_report_dict(bad, "r.json").stage_summary() == []
    handle.remove()


def test_stage_peaks_are_off_by_default(tmp_path):
    # off, nothing resets the peak inside a step: a peak read after it is the step's
    _, handle = _streaming_run(tmp_path)
    rep = handle.report()
    assert all(s.stage_peaks is None for s in rep.steps)
    assert rep.stage_summary() == [] and "measured peak in" not in str(rep)
    handle.remove()


def _synthetic(device, static, pred, steps):
    from planner.formats.report import StepRecord
    recs = [StepRecord(step_s=1.0, passes=1, peak_gpu_bytes=max(x or 0 for x in p),
                       peak_cpu_bytes=0, peak_nvme_bytes=0, peak_activation_bytes=0,
                       static_bytes=static, base_bytes=None, stage_peaks=p) for p in steps]
    return Report(plan_path=None, policy="p", device=device, hardware="h", batch=1, seq=1,
                  micro_batches=1, predicted={"step_s": 1.0, "peak_gpu_bytes": max(pred),
                                              "stage_gpu_bytes": pred},
                  predicted_moved={}, predicted_static_bytes=static, units=["a", "b"],
                  steps=recs)


def test_stage_summary_names_the_largest_stages_as_the_measurement_counts_them():
    MiB = 2 ** 20
    pred = [10 * MiB, 20 * MiB, 30 * MiB, 60 * MiB, 40 * MiB, 50 * MiB]
    # the first step is left out of the medians; stage 2 measured largest, 3 predicted
    steps = [[99 * MiB] * 6, [1 * MiB, 5 * MiB, 45 * MiB, 15 * MiB, 9 * MiB, None],
             [1 * MiB, 5 * MiB, 43 * MiB, 17 * MiB, 9 * MiB, None]]
    cpu = _synthetic("cpu", 10 * MiB, pred, steps)
    assert cpu.stage_summary() == [
        "  measured peak in stage 2 (forward b): 44.00 MiB (predicted there 20.00 MiB)",
        "  predicted peak in stage 3 (backward b): 50.00 MiB (measured there 16.00 MiB)"]
    # on CUDA the allocator counts the static state: nothing is taken off
    cuda = _synthetic("cuda", 10 * MiB, pred, steps)
    assert cuda.stage_summary()[0].endswith("(predicted there 30.00 MiB)")
    # a static figure above a stage's prediction is no negative prediction
    assert "-" not in "".join(_synthetic("cpu", 100 * MiB, pred, steps).stage_summary())
    # no stage measured: no lines (and no error printing the report)
    none = _synthetic("cpu", 0, pred, [[None] * 6, [None] * 6])
    assert none.stage_summary() == [] and "tierplan report" in str(none)


def test_stage_names_follow_the_simulators_stages():
    rep = Report(plan_path=None, policy="p", device="cpu", hardware="h", batch=1, seq=1,
                 micro_batches=1, predicted={}, predicted_moved={}, units=["a", "b"])
    assert [rep.stage_name(s) for s in range(6)] == [
        "stage 0 (prologue)", "stage 1 (forward a)", "stage 2 (forward b)",
        "stage 3 (backward b)", "stage 4 (backward a)", "stage 5 (to the optimizer step's end)"]
    assert rep.stage_summary() == []         # nothing measured: no lines
