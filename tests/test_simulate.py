"""Simulator: hand-computed step times, stalls and peaks on tiny synthetic chains."""
import dataclasses
import json

import pytest

from planner.baselines import baseline_layers
from planner.cli import main as plan_main
from planner.errors import UserError
from planner.formats import Activation as Act, LayerDecision as LD, Plan, Tier
from planner.plans import make_plan, save_plan
from planner.simulate import DeadlockError, simulate
from planner.synthetic import uniform_profile

from test_schedule import spec

BIG = {"gpu_bytes": 10**9, "cpu_bytes": 10**9, "nvme_bytes": 10**9}
# uniform_profile(fwd_s=1): embedding 0.05 s fwd, blocks 1 s, head 1.5 s; backward 2x forward.
A, X, W, A_EMB, A_HEAD = 1000, 100, 50, 100, 2000
STATIC_PER_UNIT = 10 + 10 + 60   # params + grads + 6x params of optimizer state (synthetic.py)


def profile(n, hw, **kw):
    return uniform_profile(n, hw, fwd_s=1.0, saved_bytes=A, input_bytes=X, param_bytes=10,
                           workspace_bytes=W, head_saved_bytes=A_HEAD, **kw)


def plan_for(policy_or_layers, n=2, hw=None, budgets=BIG, prof=None, **kw):
    hw = hw or spec()
    prof = prof or profile(n, hw)
    layers = (baseline_layers(policy_or_layers, prof.layers, hw)
              if isinstance(policy_or_layers, str) else policy_or_layers)
    return make_plan(prof, None, hw, budgets, policy_or_layers if isinstance(policy_or_layers, str)
                     else "optimal", layers, **kw)


def stage(r, eid):
    return next(s for s in r.stages if s.id == eid)


@pytest.mark.parametrize("n", [1, 3, 8])
def test_keep_all_runs_at_compute_time_and_holds_everything(n):
    r = simulate(plan_for("keep-all", n))
    fwd = 0.05 + n * 1.0 + 1.5
    assert r.compute_s == pytest.approx(3 * fwd, rel=1e-12)
    assert r.step_s == pytest.approx(r.compute_s, rel=1e-12)
    assert r.compute_stall_s == 0.0 and r.recompute_s == 0.0
    static = (n + 2) * STATIC_PER_UNIT
    # Peak at F:head/B:head: static + every A_i + the (uniform) largest transient.
    assert r.peak_gpu_bytes == static + A_EMB + n * A + A_HEAD + W
    assert (r.peak_cpu_bytes, r.peak_nvme_bytes, r.fits) == (0, 0, True)


@pytest.mark.parametrize("n", [2, 5])
def test_recompute_all_adds_the_blocks_forward_time(n):
    r = simulate(plan_for("recompute-all", n))
    assert r.recompute_s == pytest.approx(n * 1.0, rel=1e-12)
    assert r.step_s == pytest.approx(r.compute_s + n * 1.0, rel=1e-12)
    static = (n + 2) * STATIC_PER_UNIT
    # Blocks keep only their input X between forward and backward.
    assert r.peak_gpu_bytes == static + A_EMB + n * X + A_HEAD + W
    # While R:blocks.k runs, blocks 0..k still hold X and blocks.k's activations are rebuilt.
    k = n - 1
    assert stage(r, f"R:blocks.{k}").peak_gpu_bytes == static + A_EMB + n * X + A + W


def test_sqrt_recomputes_each_segment_once_at_its_end():
    n = 4   # stride 2: segments (blocks.0, blocks.1), (blocks.2, blocks.3)
    r = simulate(plan_for("sqrt", n))
    assert r.step_s == pytest.approx(r.compute_s + n * 1.0, rel=1e-12)
    static = (n + 2) * STATIC_PER_UNIT
    # R:blocks.3 rebuilds A of blocks.2 and blocks.3 at once; checkpoints X of blocks.0, blocks.2.
    assert stage(r, "R:blocks.3").peak_gpu_bytes == static + A_EMB + 2 * X + 2 * A + W
    assert stage(r, "R:blocks.3").end - stage(r, "R:blocks.3").start == pytest.approx(2.0)
    assert r.peak_gpu_bytes == static + A_EMB + 2 * X + A_HEAD + W


def test_offload_all_on_slow_links_stalls_by_the_hand_computed_amount():
    # Links 250 B/s: each 1000-byte transfer takes 4 s, longer than any stage.
    # F: emb [0,.05] b0 [.05,1.05] b1 [1.05,2.05] head [2.05,3.55]; out:b0 [1.05,5.05],
    # out:b1 [5.05,9.05]; B:head [3.55,6.55]; in:b1 [9.05,13.05] -> B:b1 [13.05,15.05];
    # in:b0 [13.05,17.05] -> B:b0 [17.05,19.05]; B:emb [19.05,19.15].
    r = simulate(plan_for("offload-all", 2, spec(link=250.0)))
    assert r.compute_s == pytest.approx(10.65, rel=1e-12)
    assert r.step_s == pytest.approx(19.15, rel=1e-12)
    assert r.compute_stall_s == pytest.approx(6.5 + 2.0, rel=1e-12)
    assert stage(r, "B:blocks.1").stall_s == pytest.approx(6.5, rel=1e-12)
    assert r.transfers["blocks.1"]["out:blocks.1"] == pytest.approx((5.05, 9.05))
    assert r.transfers["blocks.0"]["in:blocks.0"] == pytest.approx((13.05, 17.05))
    assert r.busy_s["d2h"] == pytest.approx(8.0) and r.busy_s["h2d"] == pytest.approx(8.0)
    # Host holds both blocks from the start of out:b1 to the end of in:b1.
    assert r.peak_cpu_bytes == 2 * A


def test_earlier_prefetch_issue_removes_stall():
    # blocks.0 fetched from the start of F:head: in:b0 [5.05,9.05] ahead of in:b1 [9.05,13.05].
    r = simulate(plan_for("offload-all", 2, spec(link=250.0), prefetch_issue={"blocks.0": "F:head"}))
    assert r.compute_stall_s == pytest.approx(6.5, rel=1e-12)
    assert r.step_s == pytest.approx(10.65 + 6.5, rel=1e-12)


def test_slow_transfer_spreads_over_following_stages_and_frees_progressively():
    # Links 800 B/s: 1.25 s per transfer, longer than a 1 s block forward; prefetches hide
    # behind 2-3 s backwards, so the step runs at compute speed.
    r = simulate(plan_for("offload-all", 2, spec(link=800.0)))
    assert r.step_s == pytest.approx(r.compute_s, rel=1e-12) and r.compute_stall_s == 0.0
    s, e = r.transfers["blocks.0"]["out:blocks.0"]
    assert (s, e) == pytest.approx((1.05, 2.30))   # over F:blocks.1 [1.05,2.05] and into F:head
    static = 4 * STATIC_PER_UNIT
    # At the start of F:head (t=2.05) a fifth of blocks.0 is still on the GPU (0.25/1.25 s left);
    # blocks.1's offload has not started (d2h busy). That is F:head's peak: bytes only fall in it.
    assert stage(r, "F:head").peak_gpu_bytes == static + A_EMB + 200 + A + A_HEAD + W
    # At t=2.05 the timeline has the limit before (F:blocks.1's workspace) and the value after
    # (F:head's activations and workspace); the ramp of blocks.0 stands at 200 bytes in both.
    at = [g for t, g, c, nv in r.timeline if t == pytest.approx(2.05)]
    assert at == [static + A_EMB + 200 + A + W, static + A_EMB + 200 + A + A_HEAD + W]


@pytest.mark.parametrize("device,staging", [("cuda", 2 * A), ("cpu", 0)])
def test_unified_offload_all_uses_nvme_and_device_staging(device, staging):
    hw = dataclasses.replace(spec(unified=True, nvme_r=1000.0, nvme_w=1000.0), device=device)
    p = plan_for("offload-all", 3, hw, budgets={"gpu_bytes": 10**9, "cpu_bytes": 0, "nvme_bytes": 10**9})
    assert set(p.schedule) == {"compute", "nvme"}
    r = simulate(p)
    assert r.peak_cpu_bytes == 0 and r.fits
    # two buffers of the largest NVMe transfer on a unified-memory GPU; none on a CPU device,
    # whose runtime writes each tensor's own memory (docs/runtime.md)
    assert r.staging_bytes == staging
    no_staging = simulate(dataclasses.replace(p, hardware={**p.hardware, "device": "cpu"}))
    assert r.peak_gpu_bytes - no_staging.peak_gpu_bytes == staging
    assert r.peak_nvme_bytes == 3 * A        # all three blocks on disk before the first read
    assert set(r.busy_s) == {"compute", "nvme"}
    assert r.busy_s["nvme"] == pytest.approx(6 * 1.0)


def test_budget_violations_name_the_tier():
    p = plan_for("keep-all", 2)
    peak = simulate(p).peak_gpu_bytes
    tight = dataclasses.replace(p, budgets={"gpu_bytes": peak - 1, "cpu_bytes": 0, "nvme_bytes": 0})
    r = simulate(tight)
    assert not r.fits and len(r.budget_violations) == 1
    assert r.budget_violations[0].startswith("gpu: peak") and f"({peak} B)" in r.budget_violations[0]
    exact = dataclasses.replace(p, budgets={"gpu_bytes": peak, "cpu_bytes": 0, "nvme_bytes": 0})
    assert simulate(exact).fits
    off = plan_for("offload-all", 2, budgets={"gpu_bytes": 10**9, "cpu_bytes": 0, "nvme_bytes": 0})
    r = simulate(off)
    assert not r.fits and r.budget_violations[0].startswith("cpu: budget 0")


def test_shared_tensor_counted_once_until_its_last_readers_backward():
    hw = spec()
    prof = profile(3, hw)
    layers = list(prof.layers)
    # blocks.2 reads 300 bytes made by the embedding (on top of its own A).
    layers[3] = dataclasses.replace(layers[3], saved_bytes=A + 300, shared_saved_bytes=300,
                                    shared_from="embedding")
    prof = dataclasses.replace(prof, layers=layers)
    base = simulate(plan_for("recompute-all", prof=profile(3, hw)))
    r = simulate(plan_for("recompute-all", prof=prof))
    assert r.peak_gpu_bytes == base.peak_gpu_bytes + 300
    assert stage(r, "R:blocks.2").peak_gpu_bytes == stage(base, "R:blocks.2").peak_gpu_bytes + 300
    # Freed at the end of B:blocks.2: not alive while blocks.1 is recomputed.
    assert stage(r, "R:blocks.1").peak_gpu_bytes == stage(base, "R:blocks.1").peak_gpu_bytes
    # Two readers of the same producer: one tensor, counted once.
    layers[2] = dataclasses.replace(layers[2], saved_bytes=A + 300, shared_saved_bytes=300,
                                    shared_from="embedding")
    r2 = simulate(plan_for("recompute-all", prof=dataclasses.replace(prof, layers=layers)))
    assert r2.peak_gpu_bytes == base.peak_gpu_bytes + 300
    assert stage(r2, "R:blocks.1").peak_gpu_bytes == stage(base, "R:blocks.1").peak_gpu_bytes + 300


def test_optimizer_transient_counts_even_at_zero_seconds():
    hw = spec()
    prof = dataclasses.replace(profile(1, hw), optimizer_s=0.0, optimizer_workspace_bytes=10**6)
    r = simulate(plan_for("keep-all", prof=prof))
    assert r.peak_gpu_bytes == 3 * STATIC_PER_UNIT + 10**6
    assert stage(r, "OPT").peak_gpu_bytes == 3 * STATIC_PER_UNIT + 10**6


def test_roundtrip_through_json_simulates_identically(tmp_path):
    p = plan_for("offload-all", 3, spec(link=800.0), prefetch_issue={"blocks.0": "B:blocks.2"})
    again = Plan.from_dict(json.loads(json.dumps(p.to_dict(), sort_keys=True)))
    assert simulate(again) == simulate(p)
    assert p.predicted["step_s"] == simulate(again).step_s


def test_malformed_plans_are_user_errors():
    p = plan_for("recompute-all", 2)
    layers = list(p.layers)
    layers[1] = LD("blocks.0", Act.KEEP)
    layers[2] = LD("blocks.1", Act.RECOMPUTE, Tier.NONE)
    with pytest.raises(UserError, match="must follow a 'recompute'"):
        simulate(dataclasses.replace(p, layers=layers))
    hw = spec(unified=True)
    q = plan_for("keep-all", 1, hw, budgets={"gpu_bytes": 10**9})
    bad = [q.layers[0], LD("blocks.0", Act.CPU), q.layers[2]]
    with pytest.raises(UserError, match="unified-memory"):
        simulate(dataclasses.replace(q, layers=bad))
    # Decisions that no longer match the schedule's transfers.
    r = plan_for("offload-all", 2)
    with pytest.raises(UserError, match="transfers do not match"):
        simulate(dataclasses.replace(r, layers=plan_for("keep-all", 2).layers))


def test_deadlock_is_reported_by_name():
    p = plan_for("offload-all", 2)
    h2d = [dataclasses.replace(e, issue="B:blocks.0") if e.id == "in:blocks.0" else e
           for e in p.schedule["h2d"]]
    with pytest.raises(DeadlockError, match="in:blocks.0.*B:blocks.0|B:blocks.0.*in:blocks.0"):
        simulate(dataclasses.replace(p, schedule={**p.schedule, "h2d": h2d}))


def test_cli_simulate_json_and_text(tmp_path, capsys):
    p = plan_for("keep-all", 2)
    path = save_plan(p, tmp_path / "p.json")
    assert plan_main(["simulate", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["step_s"] == p.predicted["step_s"] and out["fits"] is True
    assert out["peak_gpu_bytes"] == p.predicted["peak_gpu_bytes"]
    assert {"compute_s", "peak_cpu_bytes", "peak_nvme_bytes"} <= set(out)
    tight = dataclasses.replace(p, budgets={"gpu_bytes": 1, "cpu_bytes": 0, "nvme_bytes": 0})
    path2 = save_plan(tight, tmp_path / "t.json")
    assert plan_main(["simulate", str(path2)]) == 0
    assert "DOES NOT FIT: gpu: peak" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text('{"schema": "tierplan.profile/1"}')
    assert plan_main(["simulate", str(tmp_path / "bad.json")]) == 2


def test_checkpoint_on_host_is_moved_out_and_back_for_the_segment():
    # ckout:b0 [1.05,1.45] (100 B at 250 B/s); ckin issued at B:blocks.2 (7.55) -> [7.55,7.95],
    # hidden behind B:blocks.2 [7.55,9.55]; then R:blocks.1 rebuilds blocks.0-1 [9.55,11.55].
    layers = [LD("embedding", Act.KEEP), LD("blocks.0", Act.RECOMPUTE, Tier.CPU),
              LD("blocks.1", Act.RECOMPUTE, Tier.NONE), LD("blocks.2", Act.KEEP), LD("head", Act.KEEP)]
    r = simulate(plan_for(layers, 3, spec(link=250.0)))
    assert r.step_s == pytest.approx(r.compute_s + 2.0, rel=1e-12) and r.compute_stall_s == 0.0
    assert r.transfers["blocks.0"]["ckin:blocks.0"] == pytest.approx((7.55, 7.95))
    assert r.peak_cpu_bytes == X
    static = 5 * STATIC_PER_UNIT
    # During R:blocks.1: the checkpoint is back, both blocks rebuilt, blocks.2 and head freed.
    assert stage(r, "R:blocks.1").peak_gpu_bytes == static + A_EMB + X + 2 * A + W
    # F:head: blocks.0's checkpoint has left (ckout ended at 1.45), blocks.1 holds nothing.
    assert stage(r, "F:head").peak_gpu_bytes == static + A_EMB + A + A_HEAD + W


def test_transfer_that_does_not_wait_for_its_source_is_refused():
    p = plan_for("offload-all", 2)
    h2d = [dataclasses.replace(e, after=()) if e.id == "in:blocks.0" else e for e in p.schedule["h2d"]]
    with pytest.raises(UserError, match="in:blocks.0 does not wait for out:blocks.0"):
        simulate(dataclasses.replace(p, schedule={**p.schedule, "h2d": h2d}))


# ----------------------------------------------------------------------------- random plans

def _gpu_at(plan, r, t):
    """Pointwise GPU bytes at time t, straight from the memory model's rules (test oracle)."""
    S = {k: v[0] for k, v in r.events.items()}
    E = {k: v[1] for k, v in r.events.items()}
    unified = plan.hardware["unified_memory"]
    on = lambda a, b: a <= t < b   # noqa: E731
    total = r.static_bytes + (r.staging_bytes if unified else 0)
    for u, d in zip(plan.units, plan.layers):
        n, A_, X_, W_ = u.name, u.activation_bytes, u.input_bytes, u.workspace_bytes
        f, b = f"F:{n}", f"B:{n}"
        total += W_ * on(S[f], E[f]) + W_ * on(S[b], E[b])

        def moved(nbytes, p, since):
            leave, fetch = (f"{p}w:{n}", f"{p}r:{n}") if unified else (f"{p}out:{n}", f"{p}in:{n}")
            v = nbytes * (on(since, S[leave]) + on(S[fetch], E[b]))
            if on(S[leave], E[leave]):
                v += nbytes * (E[leave] - t) / (E[leave] - S[leave])
            return v
        if d.activation is Act.KEEP:
            total += A_ * on(S[f], E[b])
        elif d.activation in (Act.CPU, Act.NVME):
            total += moved(A_, "", S[f])
        else:
            total += A_ * on(S[f], E[f])
            if d.checkpoint is Tier.GPU:
                total += X_ * on(E[f], E[b])
            elif d.checkpoint in (Tier.CPU, Tier.NVME):
                total += moved(X_, "ck", E[f])
    from planner.schedule import segments
    for s in segments(plan.layers):
        rid = f"R:{plan.units[s[-1]].name}"
        for j in s:
            total += plan.units[j].activation_bytes * on(S[rid], E[f"B:{plan.units[j].name}"])
        total += max(plan.units[j].workspace_bytes for j in s) * on(S[rid], E[rid])
    return total


def _random_layers(rng, units, unified):
    out = [LD(units[0].name, Act.KEEP)]
    for u in units[1:-1]:
        choices = ["keep", "rec-gpu", "rec-nvme", "nvme"] + ([] if unified else ["cpu", "rec-cpu"])
        if out[-1].activation is Act.RECOMPUTE:
            choices += ["rec-none"] * 2
        c = rng.choice(choices)
        if c.startswith("rec-"):
            out.append(LD(u.name, Act.RECOMPUTE, Tier(c[4:])))
        else:
            out.append(LD(u.name, Act(c)))
    out.append(LD(units[-1].name, Act.KEEP))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_random_plans_obey_dependencies_and_peaks_match_a_pointwise_oracle(seed):
    import random
    from planner.schedule import compute_order
    rng = random.Random(seed)
    unified = seed % 3 == 0
    hw = spec(unified=unified, link=rng.choice([200.0, 800.0, 5000.0]),
              nvme_r=rng.choice([100.0, 1000.0]), nvme_w=rng.choice([100.0, 500.0]))
    prof = uniform_profile(rng.randint(2, 7), hw, fwd_s=1.0, saved_bytes=A, input_bytes=X,
                           param_bytes=10, workspace_bytes=W, head_saved_bytes=A_HEAD,
                           jitter=0.3, seed=seed)
    layers = _random_layers(rng, prof.layers, unified)
    order = compute_order(prof.layers, layers)
    issue = {}
    from planner.schedule import segments
    seg_end = {i: s[-1] for s in segments(layers) for i in s}
    for i, d in enumerate(layers):
        moved = d.activation in (Act.CPU, Act.NVME) or (
            d.activation is Act.RECOMPUTE and d.checkpoint in (Tier.CPU, Tier.NVME))
        if moved and rng.random() < 0.5:
            n = prof.layers[i].name
            consumer = f"B:{n}" if d.activation is not Act.RECOMPUTE else f"R:{prof.layers[seg_end[i]].name}"
            lo, hi = order.index(f"F:{n}") + 1, order.index(consumer)
            issue[n] = order[rng.randrange(lo, hi)]
    budgets = {"gpu_bytes": 10**9, "cpu_bytes": 0 if unified else 10**9, "nvme_bytes": 10**9}
    plan = make_plan(prof, None, hw, budgets, "optimal", layers, prefetch_issue=issue)
    r = simulate(plan)
    assert r.step_s >= r.compute_s + r.recompute_s - 1e-9
    assert r.step_s == pytest.approx(r.compute_s + r.recompute_s + r.compute_stall_s, rel=1e-9)
    for e in (e for evs in plan.schedule.values() for e in evs):
        s, t = r.events[e.id]
        assert all(s >= r.events[a][1] - 1e-12 for a in e.after)
        assert e.issue is None or s >= r.events[e.issue][0] - 1e-12
        if e.op == "forward":
            assert s == pytest.approx(r.events[order[order.index(e.id) - 1]][1] if order.index(e.id) else 0.0)
    # Peak: the oracle sampled just after and just before every boundary and at midpoints.
    ts = sorted({x for se in r.events.values() for x in se})
    samples = [t for t in ts] + [t - 1e-9 for t in ts[1:]] + [(a + b) / 2 for a, b in zip(ts, ts[1:])]
    oracle = max(_gpu_at(plan, r, t) for t in samples)
    assert abs(oracle - r.peak_gpu_bytes) <= 1 + A * 1e-9 * 10
    for st in r.stages:
        if st.end > st.start:
            inner = [st.start, st.end - 1e-9, (st.start + st.end) / 2]
            assert max(_gpu_at(plan, r, t) for t in inner) <= st.peak_gpu_bytes + 1
