"""Layer-major micro-batches: every micro-batch of a step through a unit before the next, so
streamed weights cross once per step and direction while the K micro-batches' saved bytes are
held (planner.costmodel.model, ``micro_batch_order``)."""
from __future__ import annotations

import dataclasses

import pytest

from planner.costmodel import evaluate
from planner.costmodel.baselines import baseline_layers
from planner.errors import UserError
from planner.formats import Activation, Budgets, Policy, Tier
from planner.hardware import load_hardware
from planner.plans import cost_model, plan_and_sim
from planner.solve.config import SolveConfig
from planner.solve.search import solve
from planner.solve.strategies import stream_all_layers
from synthetic import uniform_profile

GiB = 2**30
K = 4


def _case(order, policy=Policy.RECOMPUTE_ALL, param_bytes=1_000_000_000):
    hw = load_hardware("a100-80g")
    prof = uniform_profile(6, hw, param_bytes=param_bytes, saved_bytes=300_000_000)
    budgets = Budgets(40 * GiB, 256 * GiB, 1024 * GiB)
    cm = cost_model(prof, hw, budgets, K, micro_batch_order=order)
    layers = stream_all_layers(cm, baseline_layers(policy, prof.layers, hw))
    return prof, hw, budgets, cm, layers


def _weight_in(r):
    return sum(r.busy_s.get(x, 0.0) for x in ("h2d",))


def test_streamed_weights_cross_once_per_step_and_saved_bytes_are_held_k_times():
    prof, hw, budgets, bm, layers = _case("batch-major")
    lm = dataclasses.replace(bm, micro_batch_order="layer-major")
    pb, rb = plan_and_sim(prof, None, hw, budgets, "stream-all", layers, cm=bm)
    pl, rl = plan_and_sim(prof, None, hw, budgets, "stream-all", layers, cm=lm)
    assert pl.micro_batch_order == "layer-major" and pl.micro_batches == K
    # the same model FLOPs and compute per step, one sequence of stages instead of K
    assert rl.flops == rb.flops and rl.compute_s == pytest.approx(rb.compute_s)
    # every h2d byte here is a streamed weight: K times fewer of them per step
    assert _weight_in(rb) == pytest.approx(K * _weight_in(rl), rel=1e-9)
    # the checkpoints of K micro-batches are held at once: the device peak grows by them
    ck = sum(u.input_bytes for u in prof.layers[1:-1])
    assert rl.peak_gpu_bytes - rb.peak_gpu_bytes >= (K - 1) * ck * 0.99
    assert rl.step_s < rb.step_s


def test_one_micro_batch_is_the_same_in_either_order_but_for_the_held_inputs():
    hw = load_hardware("a100-80g")
    prof = uniform_profile(4, hw)
    budgets = Budgets(80 * GiB)
    got = []
    for order in ("batch-major", "layer-major"):
        cm = cost_model(prof, hw, budgets, 1, micro_batch_order=order)
        layers = baseline_layers(Policy.SQRT, prof.layers, hw)
        got.append(plan_and_sim(prof, None, hw, budgets, "sqrt", layers, cm=cm)[1])
    assert got[0].step_s == pytest.approx(got[1].step_s, rel=1e-12)
    # layer-major cuts the graph at every unit's input (runtime/layer_major.py): the inputs
    # of units rebuilt from an earlier checkpoint stay on the device until the backward
    # below them, one at least at the peak, never more than all of them
    rebuilt = [u.input_bytes for u, d in zip(prof.layers, layers)
               if d.activation.value == "recompute" and d.checkpoint.value == "none"]
    assert rebuilt
    extra = got[1].peak_gpu_bytes - got[0].peak_gpu_bytes
    assert min(rebuilt) <= extra <= sum(rebuilt)


def test_layer_major_holds_the_inputs_of_units_whose_bytes_left_the_device():
    # the K micro-batches' inputs of a unit whose saved tensors go to NVMe (or whose
    # checkpoint does) stay on the device from its forward to the backward below it: the
    # runtime's cut keeps their storage as a leaf (measured: docs/benchmarks.md)
    from planner.plans.simulate import PlanView, check_plan
    seen = set()
    for policy in (Policy.OFFLOAD_ALL, Policy.SQRT):
        prof, hw, budgets, cm, layers = _case("layer-major", policy)
        plan, r = plan_and_sim(prof, None, hw, budgets, "stream-all", layers, cm=cm)
        cm2, shares = check_plan(plan)
        v = PlanView(cm2, plan.layers, shares)
        bm = dataclasses.replace(cm, micro_batch_order="batch-major")
        for i in range(1, cm2.U):
            held = sum(evaluate([t]) for t in cm2._input_held(i, v))
            d = plan.layers[i]
            ck = d.checkpoint.value if d.checkpoint is not None else None
            if d.activation.value in ("cpu", "nvme") or ck in ("cpu", "nvme", "none"):
                assert held == cm2.X[i] > 0, (policy, i, d)
                seen.add(d.activation.value)
            else:                                 # kept, or its checkpoint is that input
                assert held == 0, (policy, i, d)
        # allocated in the unit's forward, freed at the end of the backward below it (the
        # one stage after its own); batch-major holds none of them
        U = cm2.U
        for i in range(1, U):
            for t in cm2._input_held(i, v):
                assert t in cm2.alloc(cm2.L.fwd(i), v, False)["gpu"]
                assert t in cm2.free(cm2.L.bwd(i) + 1, v, False)["gpu"]
        assert bm._input_held(1, v) == []
    assert seen & {"cpu", "nvme"}               # the offloaded units were checked


def test_auto_solves_both_orders_and_keeps_the_faster():
    prof, hw, budgets, _, _ = _case("batch-major")
    cfg = SolveConfig.build(hw, budgets, micro_batches=K, time_limit=20)
    outs = {o: solve(prof, None, dataclasses.replace(cfg, micro_batch_order=o)).plan
            for o in ("batch-major", "layer-major")}
    auto = solve(prof, None, dataclasses.replace(cfg, micro_batch_order="auto")).plan
    best = min(p.predicted.step_s for p in outs.values())
    # each order gets half the time under auto: allow what a shorter solve may lose
    assert auto.predicted.step_s <= best * 1.02
    assert auto.micro_batch_order in outs


def test_bad_orders_are_refused_in_one_line():
    hw = load_hardware("a100-80g")
    with pytest.raises(UserError, match="--micro-batch-order"):
        SolveConfig.build(hw, Budgets(GiB), micro_batches=2, micro_batch_order="zigzag")
    with pytest.raises(UserError, match="only batch-major"):
        SolveConfig.build(hw, Budgets(GiB), micro_batches=2, micro_batch_order="layer-major",
                          world_size=2)
    # one micro-batch: the orders are one, written as batch-major
    assert SolveConfig.build(hw, Budgets(GiB), micro_batch_order="layer-major"
                             ).micro_batch_order == "batch-major"


def test_each_micro_batch_holds_its_part_of_a_tied_gradient():
    """A tied head/embedding gradient is summed per micro-batch in micro-batch order, so in
    layer-major each of the K micro-batches' head parts is held until the embedding's backward."""
    hw = load_hardware("a100-80g")
    prof = uniform_profile(4, hw)
    n = 50_000_000
    units = list(prof.layers)
    units[-1] = dataclasses.replace(units[-1], tied_to=("embedding",), tied_grad_bytes=n)
    prof = dataclasses.replace(prof, layers=units)
    b = Budgets(80 * GiB)
    bm = cost_model(prof, hw, b, K)
    lm = cost_model(prof, hw, b, K, micro_batch_order="layer-major")
    s = bm.L.bwd(bm.U - 1)               # the head's backward: the tied part exists from here
    assert bm.shared[s] - bm._shared_memory()[s] == n
    assert lm.shared[s] - K * lm._shared_memory()[s] == K * n


def test_a_units_later_micro_batches_add_their_gradient_once_the_first_ones_bytes_are_gone():
    """Layer-major, B:i: the runtime runs the K micro-batches' pieces of unit i one after the
    other, so micro-batch 2 adds its gradient into micro-batch 1's (``transient``'s acc) after
    micro-batch 1's saved bytes of the unit have gone with its graph, however late a transfer
    finishes. The model holds W plus the largest of micro-batch 1's moment (the K output
    gradients B:i+1 handed down, its input gradient), micro-batch 2's (G added, one output
    gradient fewer, two input gradients; a kept or offloaded unit's micro-batch 1 saved bytes
    but its input gone) and micro-batch K's; a recomputed unit's saved bytes are one
    micro-batch's already. Beside each, the unit's outputs of micro-batches k..K, which its
    pieces hold, where the unit above kept them as saved bytes or as its checkpoint and so
    stopped counting them at its own backward's end (measured: docs/benchmarks.md,
    "Layer-major backward stages", "... of recomputed units")."""
    from planner.plans.simulate import PlanView, check_plan
    seen, roots_seen, largest = set(), set(), set()
    # a large gradient (micro-batch 2's moment the largest) and a small one (micro-batch 1's)
    for policy, g in ((p, g) for p in (Policy.KEEP_ALL, Policy.OFFLOAD_ALL, Policy.RECOMPUTE_ALL)
                      for g in (1_000_000_000, 1_000_000)):
        prof, hw, budgets, cm, layers = _case("layer-major", policy, param_bytes=g)
        plan, _ = plan_and_sim(prof, None, hw, budgets, "stream-all", layers, cm=cm)
        cm2, shares = check_plan(plan)
        v = PlanView(cm2, plan.layers, shares)
        for i in range(cm2.U):
            s = cm2.L.bwd(i)
            got = max(sum(evaluate([t]) for t in lin) for lin in cm2.transient(s, v))
            u, d = prof.layers[i], plan.layers[i].activation.value
            assert cm2.G[i] > 0 and cm2.W[i] > 0
            gone = max(u.activation_bytes - u.input_bytes, 0)
            if d == "recompute":
                gone = 0
            # the last unit's pieces end in the loss: no output gradient is handed down to it;
            # the first unit's input (token ids) gets no gradient
            x = u.input_bytes if i > 0 else 0
            y = u.output_bytes if i < cm2.U - 1 else 0
            up = plan.layers[i + 1] if i + 1 < cm2.U else None
            holds = up is not None and (up.activation is Activation.KEEP or (
                up.activation is Activation.RECOMPUTE and (up.checkpoint or Tier.GPU) is Tier.GPU))

            def roots(k):       # unit i's outputs of micro-batches k..K, held by its pieces
                return (K - k + 1) * y if holds else 0
            # micro-batch 1: K output gradients handed down, its input gradient made;
            # micro-batch 2: one output gradient fewer, two input gradients, its gradient added
            # ... micro-batch K: one output gradient, K input gradients, K - 1 units' bytes gone
            first = K * y + x + roots(1)
            second = cm2.G[i] + (K - 1) * y + 2 * x - gone + roots(2)
            last = cm2.G[i] + y + K * x - (K - 1) * gone + roots(K)
            assert got == cm2.W[i] + max(first, second, last), (policy, i, d)
            if d == "recompute":        # more than its workspace and added gradient alone
                assert got > cm2.W[i] + cm2.G[i], (policy, i)
            seen.add(d)
            roots_seen.add(holds and y > 0)
            largest.add((d, "first" if first > max(second, last) else
                         "second" if second > max(first, last) else "tie"))
    assert {"keep", "nvme", "recompute"} <= seen or {"keep", "cpu", "recompute"} <= seen
    assert roots_seen == {True, False}
    # each unit's choice has a case where micro-batch 1's moment decides, and one where 2's does
    for d in ("keep", "recompute"):
        assert {(d, "first"), (d, "second")} <= largest, largest


def test_a_layer_major_forward_holds_the_outputs_its_earlier_micro_batches_made():
    """Layer-major, F:i: micro-batch K's forward runs beside the outputs micro-batches 1..K-1
    made, which the cut holds as the unit above's inputs and which count only from F:i+1 on;
    the last unit's pieces end in the loss. Batch-major runs one micro-batch per pass: W_i
    alone (measured: docs/benchmarks.md, "Layer-major backward stages of recomputed units",
    the embedding's forward 0.8-1.8 MiB above its prediction before)."""
    for order in ("batch-major", "layer-major"):
        prof, hw, budgets, cm, layers = _case(order)
        for i in range(cm.U):
            got = max(sum(evaluate([t]) for t in lin) for lin in cm.transient(cm.L.fwd(i), None))
            made = (K - 1) * prof.layers[i].output_bytes
            if order == "batch-major" or i == cm.U - 1:
                made = 0
            assert prof.layers[i].output_bytes > 0
            assert got == cm.W[i] + made, (order, i)
