"""Peaks per stage: the runtime reads and resets the device peak as each stage begins, so a
report says in which stage the measured peak fell, beside the simulator's figure for that
stage (which a plan now carries, ``predicted.stage_gpu_bytes``).
"""
from __future__ import annotations

import copy
import dataclasses
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


def test_stage_peaks_keep_each_stages_largest_over_the_passes():
    be = _Counters()
    sp = StagePeaks(be, 6)                   # two units: stages 0..4, optimizer 5
    sp.begin(None)
    for rise in (10, 30):                    # two passes, the second holding more
        sp.cut(0)
        be.alloc(5)                          # prologue: held until the last backward
        sp.cut(1)
        be.alloc(rise)                       # a forward allocates, then frees
        be.alloc(-rise)
        sp.cut(3)                            # (stage 2 never begins)
        be.alloc(rise + 1)
        be.alloc(-(rise + 1))
        sp.cut(4)
        be.alloc(-5)
    sp.cut(5)
    be.alloc(7)
    be.alloc(-7)
    peaks, top = sp.end()
    assert peaks == [5, 35, None, 36, 5, 7]
    assert top == 36
    assert sp.end() == (None, None)          # nothing open after the step ended


def test_stage_peaks_without_stages_give_the_step_peak_only():
    be = _Counters()
    sp = StagePeaks(be, 4)
    sp.begin(None)
    be.alloc(9)
    assert sp.end() == (None, 9)


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
    assert Plan.from_dict(old, "p.json").predicted.stage_gpu_bytes == []


def test_a_streaming_run_reports_the_peak_of_every_stage(tmp_path):
    cfg = dict(load_config("gpt-tiny"), dtype="fp32")
    torch.manual_seed(0)
    model = build_model(cfg, dtype="fp32")
    model.train()
    plan = plan_for(model, "recompute-all", B, S, nvme_dir=tmp_path / "nvme",
                    homes={"blocks": Home(T.NVME, T.NVME, T.NVME, T.GPU)}, micro_batches=K)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = apply_plan(model, plan, optimizer=opt)
    for step in range(3):
        for k in range(K):
            (model(**make_inputs(cfg, B, S, seed=step * K + k)).loss / K).backward()
        opt.step()
        opt.zero_grad()
    rep = handle.report()
    n = 2 * len(plan.units) + 2
    for s in rep.steps:
        if not rep.hwm_reset:
            pytest.skip("/proc/self/clear_refs is not writable here: no peak can be reset")
        assert s.stage_peaks is not None and len(s.stage_peaks) == n
        # every stage began and was measured, and the step's peak is the largest of them
        assert all(x is not None for x in s.stage_peaks), s.stage_peaks
        assert max(s.stage_peaks) == s.peak_gpu_bytes
    med = rep.stage_peaks()
    assert len(med) == n
    lines = rep.stage_summary()
    assert lines and lines[0].startswith("  measured peak in stage ")
    assert "(predicted there " in lines[0]
    assert lines[0] in str(rep)
    # the report round-trips with its stage peaks; a malformed list is one line
    d = json.loads(json.dumps(rep.to_dict()))
    back = load_report_dict(d, "r.json")
    assert [s.stage_peaks for s in back.steps] == [s.stage_peaks for s in rep.steps]
    d["steps"][0]["stage_peaks"] = [1, "x"]
    with pytest.raises(UserError, match="stage_peaks must be null or a list of byte counts"):
        load_report_dict(d, "r.json")
    handle.remove()


def test_stage_names_follow_the_simulators_stages():
    rep = Report(plan_path=None, policy="p", device="cpu", hardware="h", batch=1, seq=1,
                 micro_batches=1, predicted={}, predicted_moved={}, units=["a", "b"])
    assert [rep.stage_name(s) for s in range(6)] == [
        "stage 0 (prologue)", "stage 1 (forward a)", "stage 2 (forward b)",
        "stage 3 (backward b)", "stage 4 (backward a)", "stage 5 (to the optimizer step's end)"]
    assert dataclasses.fields(rep)          # a plain dataclass: nothing measured, no lines
    assert rep.stage_summary() == []
