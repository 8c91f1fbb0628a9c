"""The transfer engine (runtime/transfer): the byte stream, the pinned slab, and activation
offload and layer streaming run through the recording backend, which executes every copy in
an adversarial order its waits allow and counts the consumers that read before their
producer's event: gradients equal plain PyTorch's, 0 missing waits, and a removed wait is
caught."""
from __future__ import annotations

import pytest
import torch

import zoo_models as zm
from conftest import plan_for
from planner.formats import Home, Tier as T
from runtime import apply_plan
from runtime.transfer import ByteStream, Slab, TransferError, using
from runtime.transfer.recording import RecordingBackend

B, S = 2, 8
MODELS = ("raw_mlp", "nested", "tied", "inplace")


def _loss(out):
    return out.loss if hasattr(out, "loss") else out["loss"]


def _grads(name, layers=None, tmp=None, homes=None, backend=None, steps=2):
    """Two AdamW steps of zoo model ``name``; gradients of each step and the final weights."""
    model, inputs = getattr(zm, name)(B, S)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    handle = None
    if layers is not None:
        n = len(plan_for(model, "keep-all", B, S, inputs=inputs).units) - 2
        acts = [layers] * n if isinstance(layers, tuple) else (layers * n)[:n]
        # a discrete device's plan (it has a host tier), run on the CPU: the recording backend
        # is the device that is not host memory
        # with no homes: a discrete device's plan (it has a host tier), run on the CPU, the
        # recording backend being the device that is not host memory
        plan = plan_for(model, acts, B, S, inputs=inputs, nvme_dir=tmp, homes=homes,
                        hardware="cpu-host" if homes else "h200")
        plan.hardware["device"] = "cpu"
        with using(backend):
            handle = apply_plan(model, plan, optimizer=opt if homes else None)
    torch.manual_seed(7)
    grads = []
    for _ in range(steps):
        _loss(model(**inputs)).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    weights = [v.clone() for v in model.state_dict().values()]   # streamed ones read back
    if handle is not None:
        handle.remove()
    return grads, weights


def _same(a, b, tol=1e-6):
    for ga, gb in zip(a, b):
        for x, y in zip(ga, gb):
            assert (x is None) == (y is None)
            if x is not None:
                assert (x - y).abs().max().item() <= tol


def test_byte_stream_shares_tile_the_stream():
    s = ByteStream()
    for n in (10, 0, 30, 20):
        s.append(object(), n)
    assert s.size == 60
    a, b = s.span(0.0, 0.5)
    assert (a, b) == (0, 30)
    starts = [k for k, *_ in s.parts(0, 30, "start")] + [k for k, *_ in s.parts(30, 60, "start")]
    ends = [k for k, *_ in s.parts(0, 30, "end")] + [k for k, *_ in s.parts(30, 60, "end")]
    assert starts == [0, 2, 3] and ends == [0, 2, 3]   # each non-empty piece exactly once
    assert [k for k, *_ in s.parts(0, 30, "end")] == [0]   # piece 2 ends at 40


def test_slab_carves_one_buffer_and_refuses_what_it_cannot_hold():
    made = []
    slab = Slab(256, lambda n: made.append(n) or torch.zeros(n, dtype=torch.uint8))
    a, b = slab.take(100), slab.take(64)
    assert made == [256] and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert b.storage_offset() == 128          # 100 rounded up to the 64-byte alignment
    with pytest.raises(TransferError, match="cannot hold 100 more bytes"):
        slab.take(100)
    slab.give(a)
    c = slab.take(120)                        # a's range is free again
    assert c.storage_offset() == 0 and made == [256]
    slab.give(b), slab.give(c)
    assert slab.free == [(0, 256)] and slab.peak == 192


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
@pytest.mark.parametrize("name", MODELS)
def test_activation_offload_in_adversarial_order(name, tier, tmp_path):
    """Offload every block's activations to ``tier`` through the staged path (the one a CUDA
    device takes), copies deferred and reordered: gradients and weights equal plain
    PyTorch's, every copy ran, and no consumer read before its producer's event."""
    ref = _grads(name)
    be = RecordingBackend()
    got = _grads(name, (tier, None), tmp_path, backend=be)
    _same(ref[0], got[0])
    _same([ref[1]], [got[1]])
    assert be.missing == 0, be.problems[:3]
    copies = sum(1 for _, op, _ in be.log if op == "copy")
    assert copies > 0 and be.ran_ops == copies
    assert {s for s, op, _ in be.log if op == "copy"} == {"d2h", "h2d"}
    assert be.slab.in_use == 0 and be.slab.peak > 0     # every slab view given back


MIXED = [("cpu", None), ("recompute", "cpu"), ("recompute", "none"), ("nvme", None),
         ("recompute", "nvme")]


@pytest.mark.parametrize("name", ["nested", "mixed_sequential"])
def test_mixed_plan_in_adversarial_order(name, tmp_path):
    """Host and NVMe offload and recompute segments checkpointed on the host and on NVMe in
    one plan (the checkpoints move through the same groups): gradients and weights equal,
    0 missing waits."""
    ref = _grads(name)
    be = RecordingBackend()
    got = _grads(name, MIXED, tmp_path, backend=be)
    _same(ref[0], got[0])
    _same([ref[1]], [got[1]])
    assert be.missing == 0, be.problems[:3]
    assert be.ran_ops > 0


@pytest.mark.parametrize("name", ["raw_mlp", "nested"])
def test_streaming_plan_through_the_recording_backend(name, tmp_path):
    """A streaming plan (weights, gradients and optimizer state on NVMe) with activations on
    NVMe, the activations staged through the recording backend: gradients and weights equal
    plain PyTorch's under the adversarial order, 0 missing waits."""
    ref = _grads(name)
    be = RecordingBackend()
    got = _grads(name, ("nvme", None), tmp_path, backend=be,
                 homes={"blocks": Home(T.NVME, T.NVME, T.NVME, T.GPU)})
    _same(ref[0], got[0])
    _same([ref[1]], [got[1]])
    assert be.missing == 0, be.problems[:3]
    assert be.ran_ops > 0


def _round_trip(tier, tmp_path, drop=()):
    """Three tensors through one group, send then fetch then get, with no stage barrier in
    between (the copies of both directions queued at once): what came back, the backend."""
    from runtime.offload import Counters, Group, Mover
    be = RecordingBackend()
    be.drop_waits.update(drop)
    with using(be):
        m = Mover(torch.device("cpu"), str(tmp_path), Counters())
    g = Group(m, tier, "u")
    saved = [torch.randn(64, 3), torch.randn(100), torch.arange(40.0)]
    views = [g.put(t) for t in saved]
    g.send(*g.span(0.0, 1.0))
    g.fetch(*g.span(0.0, 1.0))
    back = []
    for v in views:
        back.append(g.get(v).clone())
        g.release(v)
    m.close()
    return saved, back, be


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_round_trip_without_barriers_waits_for_every_producer(tier, tmp_path):
    saved, back, be = _round_trip(tier, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(saved, back))
    assert be.missing == 0, be.problems[:3]
    assert be.slab.in_use == 0


@pytest.mark.parametrize("dropped", ["h2d", "compute"])
def test_a_removed_wait_is_caught_in_a_round_trip(dropped, tmp_path):
    """The ``h2d`` copy no longer waits for the ``d2h`` copy it reads, or the compute stream
    no longer waits for the ``h2d`` copy: missing waits are counted and the bytes read back
    are not the ones saved."""
    saved, back, be = _round_trip("cpu", tmp_path, drop=(dropped,))
    assert be.missing > 0
    assert not all(torch.equal(a, b) for a, b in zip(saved, back))


def test_a_removed_wait_is_caught_in_training(tmp_path):
    """The compute stream no longer waits for the activations' ``h2d`` copies: the check
    counts missing waits (whatever the gradients read)."""
    be = RecordingBackend()
    be.drop_waits.add("compute")
    try:
        _grads("raw_mlp", ("cpu", None), tmp_path, backend=be)
    except Exception:   # noqa: BLE001 -- garbage may reach autograd; the count is the check
        pass
    assert be.missing > 0


def test_a_slab_view_is_given_back_only_after_its_last_copy():
    """``unpin(view, event)`` while the copy out of the view is still queued keeps the range
    taken (the host does not wait); once the stream has run, the next request reaps it. Given
    back at once instead, the next copy into the reused range is a missing wait."""
    be = RecordingBackend(pinned_bytes=128)
    h2d = be.stream("h2d")
    view = be.pinned(128)
    view.fill_(7)
    out = torch.zeros(128, dtype=torch.uint8)
    be.copy(out, view, h2d)
    ev = be.event()
    be.record(ev, h2d)
    be.unpin(view, ev)
    assert be.slab.in_use == 128 and be.ran_ops == 0     # deferred: nothing forced
    be.wait(None, ev)                                    # the consumer waits: the copy runs
    again = be.pinned(128)                               # reaped now
    assert torch.equal(out, torch.full((128,), 7, dtype=torch.uint8)) and be.missing == 0
    be.copy(out, again, h2d)
    be.slab.give(again)                                  # wrong: the copy has not run
    be.copy(be.pinned(128), torch.zeros(128, dtype=torch.uint8), be.stream("d2h"))
    assert be.missing == 1 and "overwrites unread bytes" in be.problems[0]


def test_cpu_backend_streams_run_in_order_and_events_gate_the_waiter():
    """The CPU backend: one backend per device, unified; a copy on a stream runs on its
    thread, another stream's wait for its event orders the next copy after it."""
    from runtime.transfer import backend_for
    from runtime.transfer.cpu import CpuBackend
    be = backend_for(torch.device("cpu"))
    assert isinstance(be, CpuBackend) and be.unified and be is backend_for(torch.device("cpu"))
    a, b = be.stream("t-a"), be.stream("t-b")
    src = torch.arange(1 << 16, dtype=torch.float32)
    mid, out = torch.zeros_like(src), torch.zeros_like(src)
    be.copy(mid, src, a)
    ev = be.event()
    be.record(ev, a)
    be.wait(b, ev)
    be.copy(out, mid, b)
    done = be.event()
    be.record(done, b)
    be.wait(None, done)
    assert be.done(done) and torch.equal(out, src)
