"""Schedule builder: event layout, validation of decisions, segments, issue points."""
import pytest

from planner.baselines import baseline_layers
from planner.errors import UserError
from planner.formats import Activation as Act, HardwareSpec, LayerDecision as LD, Tier
from planner.schedule import build_schedule, compute_order, segments
from planner.synthetic import uniform_profile


def spec(unified=False, link=250.0, nvme_r=50.0, nvme_w=25.0):
    return HardwareSpec(name="unified" if unified else "toy", description="test", device="cpu" if unified else "cuda",
                        unified_memory=unified, memory_bytes=10**9, host_memory_bytes=0 if unified else 10**10,
                        peak_flops={"bf16": 1e9}, efficiency=1.0, memory_bandwidth=1e9,
                        h2d_bandwidth=0 if unified else link, d2h_bandwidth=0 if unified else link,
                        nvme_read_bandwidth=nvme_r, nvme_write_bandwidth=nvme_w, nvme_bytes=10**10)


def units(n, hw=None):
    return uniform_profile(n, hw or spec(), fwd_s=1.0, saved_bytes=1000, input_bytes=100,
                           param_bytes=10, workspace_bytes=50, head_saved_bytes=2000).layers


def ids(evs):
    return [e.id for e in evs]


def test_keep_all_has_only_compute_and_empty_links():
    us = units(2)
    s = build_schedule(us, baseline_layers("keep-all", us, spec()), spec(), optimizer_s=0.5)
    assert ids(s["compute"]) == ["F:embedding", "F:blocks.0", "F:blocks.1", "F:head", "B:head",
                                 "B:blocks.1", "B:blocks.0", "B:embedding", "OPT"]
    assert [e.stage for e in s["compute"]] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert s["compute"][-1].seconds == 0.5
    assert s["d2h"] == [] and s["h2d"] == [] and s["nvme"] == []


def test_cpu_offload_events_bytes_seconds_and_default_issue():
    hw, us = spec(link=250.0), units(2)
    s = build_schedule(us, baseline_layers("offload-all", us, hw), hw)
    assert ids(s["d2h"]) == ["out:blocks.0", "out:blocks.1"]
    # Prefetch order follows the backward: blocks.1 first, issued one unit ahead.
    assert ids(s["h2d"]) == ["in:blocks.1", "in:blocks.0"]
    in1, in0 = s["h2d"]
    assert (in1.issue, in0.issue) == ("B:head", "B:blocks.1")
    assert in0.after == ("out:blocks.0",) and in0.bytes == 1000 and in0.seconds == 4.0
    assert s["d2h"][0].after == ("F:blocks.0",) and s["d2h"][0].seconds == 4.0
    b0 = next(e for e in s["compute"] if e.id == "B:blocks.0")
    assert b0.after == ("in:blocks.0",)


def test_nvme_offload_goes_through_d2h_write_read_h2d():
    hw, us = spec(nvme_r=50.0, nvme_w=25.0), units(1)
    layers = [LD("embedding", Act.KEEP), LD("blocks.0", Act.NVME), LD("head", Act.KEEP)]
    s = build_schedule(us, layers, hw)
    assert ids(s["nvme"]) == ["w:blocks.0", "r:blocks.0"]
    w, r = s["nvme"]
    assert w.after == ("out:blocks.0",) and w.seconds == 1000 / 25.0
    assert r.after == ("w:blocks.0",) and r.issue == "B:head" and r.seconds == 1000 / 50.0
    (i,) = s["h2d"]
    assert i.after == ("r:blocks.0",) and i.issue is None


def test_unified_offload_all_uses_only_nvme_events():
    hw = spec(unified=True)
    us = units(3, hw)
    s = build_schedule(us, baseline_layers("offload-all", us, hw), hw)
    assert set(s) == {"compute", "nvme"}
    assert {e.op for e in s["nvme"]} == {"write", "read"}
    assert ids(s["nvme"]) == ["w:blocks.0", "w:blocks.1", "w:blocks.2",
                              "r:blocks.2", "r:blocks.1", "r:blocks.0"]
    assert s["nvme"][0].after == ("F:blocks.0",)
    b1 = next(e for e in s["compute"] if e.id == "B:blocks.1")
    assert b1.after == ("r:blocks.1",)


@pytest.mark.parametrize("L,expected", [
    (9, [[1, 2, 3], [4, 5, 6], [7, 8, 9]]),        # ceil(sqrt 9) = 3
    (10, [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]),   # ceil(sqrt 10) = 4
])
def test_sqrt_segments(L, expected):
    us = units(L)
    layers = baseline_layers("sqrt", us, spec())
    assert segments(layers) == expected
    order = compute_order(us, layers)
    # One recompute per segment, just before the backward of its last unit.
    recs = [x for x in order if x.startswith("R:")]
    assert recs == [f"R:blocks.{s[-1] - 1}" for s in reversed(expected)]
    for s in expected:
        r = order.index(f"R:blocks.{s[-1] - 1}")
        assert order[r + 1] == f"B:blocks.{s[-1] - 1}"


def test_recompute_checkpoint_on_cpu_is_fetched_before_the_segment():
    hw, us = spec(), units(3)
    layers = [LD("embedding", Act.KEEP), LD("blocks.0", Act.RECOMPUTE, Tier.CPU),
              LD("blocks.1", Act.RECOMPUTE, Tier.NONE), LD("blocks.2", Act.KEEP), LD("head", Act.KEEP)]
    s = build_schedule(us, layers, hw)
    assert ids(s["d2h"]) == ["ckout:blocks.0"] and s["d2h"][0].bytes == 100
    (ck,) = s["h2d"]
    assert ck.id == "ckin:blocks.0" and ck.issue == "B:blocks.2" and ck.after == ("ckout:blocks.0",)
    rec = next(e for e in s["compute"] if e.id == "R:blocks.1")
    assert rec.units == ("blocks.0", "blocks.1") and rec.seconds == 2.0 and rec.after == ("ckin:blocks.0",)


def test_prefetch_issue_override_and_its_checks():
    hw, us = spec(), units(2)
    layers = baseline_layers("offload-all", us, hw)
    s = build_schedule(us, layers, hw, prefetch_issue={"blocks.0": "F:head"})
    assert ids(s["h2d"]) == ["in:blocks.0", "in:blocks.1"]     # issued earlier, so queued first
    with pytest.raises(UserError, match="must run after F:blocks.0 and before B:blocks.0"):
        build_schedule(us, layers, hw, prefetch_issue={"blocks.0": "B:blocks.0"})
    with pytest.raises(UserError, match="not a compute event"):
        build_schedule(us, layers, hw, prefetch_issue={"blocks.0": "B:nowhere"})
    with pytest.raises(UserError, match="neither offloaded"):
        build_schedule(us, layers, hw, prefetch_issue={"head": "B:head"})


@pytest.mark.parametrize("layers,msg", [
    ([LD("embedding", Act.KEEP), LD("blocks.0", Act.KEEP), LD("blocks.1", Act.RECOMPUTE, Tier.NONE),
      LD("head", Act.KEEP)], "must follow a 'recompute'"),
    ([LD("embedding", Act.KEEP), LD("blocks.0", Act.RECOMPUTE, Tier.NONE), LD("blocks.1", Act.KEEP),
      LD("head", Act.KEEP)], "must follow a 'recompute'"),
    ([LD("embedding", Act.KEEP), LD("blocks.0", Act.KEEP), LD("blocks.1", Act.KEEP),
      LD("head", Act.RECOMPUTE, Tier.GPU)], "must be 'keep'"),
    ([LD("embedding", Act.CPU), LD("blocks.0", Act.KEEP), LD("blocks.1", Act.KEEP),
      LD("head", Act.KEEP)], "must be 'keep'"),
    ([LD("embedding", Act.KEEP), LD("blocks.0", Act.KEEP), LD("head", Act.KEEP)], "do not match"),
])
def test_malformed_decisions(layers, msg):
    with pytest.raises(UserError, match=msg):
        build_schedule(units(2), layers, spec())


def test_cpu_on_unified_memory_is_refused():
    hw = spec(unified=True)
    us = units(1, hw)
    for d in (LD("blocks.0", Act.CPU), LD("blocks.0", Act.RECOMPUTE, Tier.CPU)):
        with pytest.raises(UserError, match="not allowed on the unified-memory spec"):
            build_schedule(us, [LD("embedding", Act.KEEP), d, LD("head", Act.KEEP)], hw)


def test_baselines_shapes():
    hw, us = spec(), units(4)
    assert [d.activation for d in baseline_layers("keep-all", us, hw)] == [Act.KEEP] * 6
    ra = baseline_layers("recompute-all", us, hw)
    assert [(d.activation, d.checkpoint) for d in ra[1:5]] == [(Act.RECOMPUTE, Tier.GPU)] * 4
    assert ra[0].activation is Act.KEEP and ra[5].activation is Act.KEEP
    assert [d.activation for d in baseline_layers("offload-all", us, hw)[1:5]] == [Act.CPU] * 4
    assert [d.activation for d in baseline_layers("offload-all", us, spec(unified=True))[1:5]] == [Act.NVME] * 4
    with pytest.raises(UserError, match="not a baseline"):
        baseline_layers("optimal", us, hw)


def test_unified_nvme_checkpoint_is_written_and_read_back_before_the_recompute():
    hw = spec(unified=True)
    us = units(2, hw)
    layers = [LD("embedding", Act.KEEP), LD("blocks.0", Act.RECOMPUTE, Tier.NVME),
              LD("blocks.1", Act.RECOMPUTE, Tier.NONE), LD("head", Act.KEEP)]
    s = build_schedule(us, layers, hw)
    assert ids(s["nvme"]) == ["ckw:blocks.0", "ckr:blocks.0"]
    w, r = s["nvme"]
    assert w.after == ("F:blocks.0",) and w.bytes == 100 and r.issue == "B:head"
    rec = next(e for e in s["compute"] if e.id == "R:blocks.1")
    assert rec.after == ("ckr:blocks.0",)


def test_nvme_without_bandwidth_is_refused():
    hw = spec(nvme_r=0.0)
    us = units(1)
    with pytest.raises(UserError, match="needs positive NVMe"):
        build_schedule(us, [LD("embedding", Act.KEEP), LD("blocks.0", Act.NVME), LD("head", Act.KEEP)], hw)
