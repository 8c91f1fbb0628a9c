"""``apply_plan``: replay a plan inside an ordinary PyTorch training loop.

The runtime decides nothing. It knows when each compute event of the plan starts — a block's
forward (its ``forward`` is wrapped), the start of a forward pass (the model's ``forward`` is
wrapped), each unit's backward (gradient hooks on the blocks' outputs and inputs, and on the
loss) — and at each such moment the stage driver (``runtime.stages``) waits for the previous
stage's transfers and starts this stage's, as the plan lists them. Saved activations go
through ``saved_tensors_hooks`` (offloaded a byte range per stage, or recomputed from a
checkpoint); weights, gradients and optimizer state homed off the device go through
``runtime.streaming``; the optimizer step goes through the handle. ``remove()`` undoes all of
it. With gradients off, blocks run as they are (streamed weights fetched around the call).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import time
import types
import warnings
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from planner.formats.events import Op, Stream, TensorClass
from planner.formats import Activation, Executor, Plan, Tier, UnitKind, UserError, io_requests, load_plan
from planner.formats.plan import check_homes
from planner.formats.report import LINKS, Report, StepRecord

from . import calls, engines, layer_major, sharded
from .binding import InputGuard, InputTooLargeError, PlanMismatchError, bind
from .calls import find_hidden as _find_hidden, hidden_of as _hidden_of
from .files import OffloadError, planned_files
from .offload import Counters, Group, Mover
from .transfer import backend_for
from .recompute import Placeholder, RecomputeMismatch, Segment
from .report import StagePeaks, malloc_trim, read_peak, read_status, reset_hwm
from .timing import StageClock
from .stages import StageDriver, plan_actions
from .staged import unit_for
from .streaming import OffloadedGrad, OptimizerPhase, UnitStatic
from .overlap import OverlapScheduler, SteppedGrad


__all__ = ["apply_plan", "Handle", "PlanMismatchError", "InputTooLargeError",
           "UnsupportedModelError"]


from .engines import UnsupportedModelError  # noqa: E402 (defined beside the engines' checks)


_ACTIVE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()   # model -> Handle


# ----------------------------------------------------------------------------- argument helpers

def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape
                      and a.stride() == b.stride() and a.dtype == b.dtype)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _backward_roots(out) -> list[torch.Tensor]:
    """Tensors of the model's output from which a backward can start, the loss first: ``.loss``,
    then the first other tensor that requires grad (the logits, for a loss computed outside)."""
    loss = getattr(out, "loss", None)
    roots = [loss] if isinstance(loss, torch.Tensor) and loss.grad_fn is not None else []
    if isinstance(out, torch.Tensor):
        items = [out]
    elif isinstance(out, (tuple, list)):
        items = out
    elif isinstance(out, Mapping):          # Hugging Face ModelOutput is an OrderedDict
        items = list(out.values())
    elif dataclasses.is_dataclass(out):
        items = [getattr(out, f.name) for f in dataclasses.fields(out)]
    else:
        items = []
    first = next((t for t in items if isinstance(t, torch.Tensor) and t.grad_fn is not None
                  and t is not loss), None)
    return roots + ([first] if first is not None else [])


# ----------------------------------------------------------------------------- refusals

def _refuse_unsupported(model) -> None:
    if hasattr(model, "_orig_mod") or type(model).__name__ == "OptimizedModule":
        raise UnsupportedModelError(
            "the model is torch.compile'd; tierplan does not support torch.compile yet: apply the "
            "plan to the uncompiled model")
    for name, m in model.named_modules():
        cls = {c.__name__ for c in type(m).__mro__}
        where = f" ({name})" if name else ""
        # FSDP2 and DDP are checked by runtime.engines (what the plan says, the order)
        if "CheckpointWrapper" in cls:
            raise UnsupportedModelError(
                f"module{where} is wrapped for activation checkpointing; remove the wrapper: the "
                "plan decides what is recomputed")
        if getattr(m, "_compiled_call_impl", None) is not None:
            raise UnsupportedModelError(
                f"module{where} was compiled with .compile(); tierplan does not support "
                "torch.compile yet")
        if getattr(m, "gradient_checkpointing", False) is True:
            raise UnsupportedModelError(
                f"module{where} has its own gradient checkpointing switched on; turn it off "
                "(model.gradient_checkpointing_disable()): the plan decides what is recomputed")
    # transformers >= 5 renamed the flag and warns on the old name: read the new one first.
    flag = next((a for a in ("is_activation_checkpointing", "is_gradient_checkpointing")
                 if hasattr(type(model), a)), None)
    if flag and getattr(model, flag, False) is True:
        raise UnsupportedModelError(
            "the model has gradient checkpointing switched on; turn it off "
            "(model.gradient_checkpointing_disable()): the plan decides what is recomputed")


# ----------------------------------------------------------------------------- one forward pass

class _Pass:
    """What one forward pass (with gradients) left for its backward.

    Its lifetime is the autograd graph's: only what the graph holds refers to it strongly (each
    offloaded unit's packer, each segment, the gradient hooks); the stage driver holds it weakly.
    So when the graph is freed (its backward has run, or the output was dropped without one)
    the pass goes at once, and its finalizer discards the groups that are left (their files
    are deleted then)."""

    def __init__(self, idx: int):
        self.idx = idx
        self.groups: dict = {}          # ("act"|"ck", unit name) -> offload Group
        self.segments: list = []        # weakref.ref(Segment)
        self.seg: Segment | None = None  # during the forward only
        self.prev_out = None             # during the forward only
        self.keeps: list[_KeepCount] = []
        self.backward_started = False
        fin = weakref.finalize(self, _abandon_groups, self.groups)
        fin.atexit = False               # at exit the store's own close deletes every file

    def end_forward(self):
        """The forward returned: drop what would tie the pass to its own graph (a cycle through
        autograd's C++ nodes, which Python's collector cannot see)."""
        self.prev_out = None
        self.seg = None

    def discard(self):
        for k in self.keeps:
            k.release()
        self.keeps = []
        _abandon_groups(self.groups)
        for ref in self.segments:
            s = ref()
            if s is not None:
                s.discard()
        self.segments = []
        self.end_forward()


def _abandon_groups(groups: dict):
    for g in list(groups.values()):
        g.abandon()
    groups.clear()


class _Trigger:
    """A gradient hook that starts a backward stage of one pass. The graph owns the hook, so
    the hook may own the pass: the pass then lives exactly as long as its graph."""

    __slots__ = ("r", "p", "stage")

    def __init__(self, r, p, stage):
        self.r, self.p, self.stage = r, p, stage

    def __call__(self, *_):
        p = self.p
        if self.r.closed:
            return
        if not p.backward_started:
            p.backward_started = True
            # the end of this backward ends the pass: whatever stage never got a trigger runs
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self.r.end_backward, weakref.ref(p)))
        self.r.enter(p, self.stage)


class _KeepCount:
    """The runtime's resident-bytes figure for a kept unit, without a hook on its tensors
    (packing each saved tensor through Python cost about 2 us per tensor, most of keep-all's
    measured overhead on small blocks). Its bytes are the plan's A_i, counted from the block's
    forward until its backward has run."""

    __slots__ = ("r", "n")

    def __init__(self, r, n):
        self.r, self.n = r, n
        r.counters.add("act", n)

    def release(self, *_):
        if self.n:
            self.r.counters.add("act", -self.n)
            self.n = 0

    # A forward dropped without a backward: the hook holding this goes with its graph.
    __del__ = release


class _Offload:
    """A ``cpu``/``nvme`` unit: every saved tensor except parameters, buffers and shared side
    inputs joins its group; identical views join once."""

    __slots__ = ("r", "group", "keys", "pass_")

    def __init__(self, r, group, pass_):
        # The graph holds this packer through every tensor it packed, and through it the pass.
        self.r, self.group, self.keys, self.pass_ = r, group, {}, pass_

    def pack(self, t):
        if self.r.is_static(t) or t.device != self.r.device:
            # a tensor saved off the device (a CPU scalar a CUDA model's forward made; seen
            # with FSDP2 and Hugging Face GPT-2 on an H200) holds no device memory: left as is
            return ("ref", t)
        key = (_storage_ptr(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype,
               t.is_conj(), t.is_neg())
        hit = self.keys.get(key)
        if hit is None:
            # The group holds the storage until its bytes leave: its address cannot be reused
            # meanwhile, so equal keys mean the same bytes.
            hit = self.keys[key] = (self.group.put(t), t)
        s = hit[0]
        s.refs += 1
        return (self, s)

    def unpack(self, x):
        if x[0] == "ref":
            return x[1]
        s = x[1]
        t = self.group.get(s)
        s.refs -= 1
        if s.refs == 0:
            self.group.release(s)
        return t


class _SegUnit:
    __slots__ = ("seg", "u")

    def __init__(self, seg, u):
        self.seg, self.u = seg, u

    def pack(self, t):
        return self.seg.pack(self.u, t)

    def unpack(self, x):
        if type(x) is tuple:
            return x[1]
        assert isinstance(x, Placeholder)
        return x.seg.unpack(x)


# ----------------------------------------------------------------------------- the runner

class _Runner:
    def __init__(self, model, plan: Plan, plan_path: str | None, blocks, nvme_dir, trim: bool,
                 optimizer, executor: Executor, stage_peaks: bool = False):
        self.guard = InputGuard(model, plan, plan_path or "the plan")
        self.model = model
        self.plan = plan
        self.plan_path = plan_path
        self.block_names = [n for n, _ in blocks]
        self.blocks = [m for _, m in blocks]
        self.U = len(plan.units)
        dec = {d.name: d for d in plan.layers}
        self.decisions = [dec[n] for n in self.block_names]
        units = {u.name: u for u in plan.units}
        self.keep_bytes = [int(units[n].activation_bytes) for n in self.block_names]
        self.unit_index = {u.name: i for i, u in enumerate(plan.units)}
        p0 = next(model.parameters(), None)
        self.device = p0.device if p0 is not None else torch.device("cpu")
        self.counters = Counters()
        self._mods = list(model.modules())   # _live_params reads their parameters as they are
        self.shards = None               # runtime/sharded.py NvmeShards, under fsdp2
        self.mover = Mover(self.device, nvme_dir, self.counters, _pinned_bytes(plan),
                           _io_requests(plan, executor))
        self.param_ids = {id(p) for p in model.parameters()}
        self.static_ptrs: set = set()
        self.pass_: _Pass | None = None
        # layer-major: each micro-batch's thread has its own run, micro-batch and pass
        self.layer_major = plan.micro_batch_order == "layer-major"
        self.lm_workers = layer_major.Workers()   # the micro-batch threads, kept
        # a handle dropped without remove() lets its threads go
        weakref.finalize(self, self.lm_workers.stop)
        self._tls = threading.local()
        self.n_passes = 0
        self.passes_warned = False
        self.grads_warned = False
        self._recomputing = False
        self.closed = False
        self.hooked = any(d.activation is not Activation.KEEP for d in self.decisions)
        # a sharded engine (FSDP2, DDP) around the model; the model's class at apply time, to
        # catch one wrapped after the plan (the wrong order)
        self.engine = plan.engine
        self.model_cls = type(model)
        # the modules that can switch their own gradient checkpointing on (Hugging Face's
        # stacks carry the flag): switched on after apply_plan (the Trainer's
        # ``gradient_checkpointing=True`` does, inside ``train()``) the next forward refuses
        self.gc_modules = [(n, m) for n, m in model.named_modules()
                           if isinstance(getattr(m, "gradient_checkpointing", None), bool)]
        # units whose tensors live off the device between uses
        self.statics: dict[str, UnitStatic] = {}
        self.unit_params = _unit_params(model, plan, dict(blocks))
        for i, (u, d) in enumerate(zip(plan.units, plan.layers)):
            if not d.home.resident:
                self.statics[u.name] = unit_for(u.name, self.unit_params[u.name], d.home,
                                                  self.device, self.mover.nvme_store,
                                                  self.counters)
        self.by_stage_unit = {}              # pass stage -> unit index computing in it
        for i in range(self.U):
            self.by_stage_unit[1 + i] = i
            self.by_stage_unit[2 * self.U - i] = i
        actions = plan_actions(plan, bool(plan.hardware.get("unified_memory")))
        # the weights and gradients of a unit whose home the runtime does not hold are moved
        # by others (FSDP2's CPUOffloadPolicy, sharded.NvmeShards): the plan's stages for them
        # carry nothing to move here
        actions = {st: [a for a in acts if a.cls not in (TensorClass.WEIGHT, TensorClass.GRAD)
                        or a.unit in self.statics] for st, acts in actions.items()}
        self.driver = StageDriver(actions, 2 * self.U, self._run_action, self._barrier,
                                  self._on_stage)
        self.phase = None
        if optimizer is not None and self.statics:
            self.phase = OptimizerPhase(optimizer, list(self.statics.values()), self.param_ids,
                                        depth=int(plan.optimizer_depth))
        # optimizer_overlap 'overlapped' or 'paced': units' optimizer work beside the backward
        self.overlap = (OverlapScheduler(self.phase, plan) if self.phase is not None
                        and plan.optimizer_overlap != "after-backward" else None)
        self.predicted_moved = _predicted_moved(plan)
        # step measurement
        self.step_open = False
        self.step_t0 = 0.0
        self.step_passes = 0
        self.step_base = None
        self.step_static = 0
        self.optimizers: "weakref.WeakSet" = weakref.WeakSet()
        self.sub_optimizers = {id(s) for _, subs in (self.phase.subs if self.phase else [])
                               for s, _ in subs}
        self.hwm_ok = True
        self.trim = trim
        # the plan's figures (its executor section): whether it counts gradients from their
        # unit's backward, and what it holds on the device before a step (weights and
        # optimizer state at home there; not the gradients, which zero_grad frees and the
        # backward makes again: they belong to the step's rise, as the plan counts them)
        self.grads_late = executor.grads_from_backward
        static_pred = executor.static_device_bytes
        self.report = Report(
            plan_path=plan_path, policy=str(plan.policy), device=self.device.type,
            hardware=str(plan.hardware.get("name")), batch=int(plan.model.get("batch", 0)),
            seq=int(plan.model.get("seq", 0)), micro_batches=plan.micro_batches,
            predicted=plan.predicted.to_dict(), predicted_moved=self.predicted_moved,
            predicted_static_bytes=int(static_pred), rank=engines.rank(),
            world_size=plan.world_size, engine=plan.engine,
            units=[u.name for u in plan.units], structure_hash=plan.model.get("structure_hash"),
            dtype=str(plan.model.get("dtype") or ""))
        self.clock = StageClock([u.name for u in plan.units], self.device)
        if self.phase is not None:
            self.phase.clock = self.clock     # times the updates (plan calibrate's optimizer_s)
        # apply_plan(..., stage_peaks=True): the peak of every stage (a diagnostic: it resets
        # the peak each stage, so a peak read during a step is only its stage's)
        self.stage_peaks = StagePeaks(self.mover.be, 2 * len(plan.units) + 2) \
            if stage_peaks else None
        self.wrapped: list[tuple] = []

    # -- helpers the segments use
    def is_static(self, t: torch.Tensor) -> bool:
        if id(t) in self.param_ids or (t._base is not None and id(t._base) in self.param_ids):
            return True
        return _storage_ptr(t) in self.static_ptrs

    strip_hidden = staticmethod(calls.strip_hidden)
    put_hidden = staticmethod(calls.put_hidden)
    hidden_of = staticmethod(_hidden_of)

    @contextlib.contextmanager
    def recomputing(self):
        prev, self._recomputing = self._recomputing, True
        try:
            yield
        finally:
            self._recomputing = prev

    def trigger(self, p: _Pass, event: str):
        """The segment's recompute starts: it runs inside its backward stage, nothing to do."""

    # -- the stage driver's hooks
    def enter(self, p: _Pass, stage: int) -> None:
        if self.closed or self.driver.ctx is None or self.driver.ctx() is not p:
            return
        self.clock.backward_seen()
        self.driver.enter(stage)

    def end_backward(self, pref) -> None:
        p = pref()
        if self.closed or p is None or self.driver.ctx is None or self.driver.ctx() is not p:
            return
        if self.overlap is not None:
            self.overlap.backward_ended()     # its compute is over (what waits is transfers)
        self.driver.finish()
        self.steps_done()

    def steps_done(self) -> None:
        """At a backward's end (batch-major, or a layer-major run): under clip none the steps
        beside it read the gradients they were handed, so they end before the loop gets the
        gradients back (a clip scaled a unit's gradient while its paced step ran, and
        remove() then raised that in place of the clip's refusal)."""
        if self.overlap is not None and self.overlap.clip == "none":
            self.overlap.quiesce()

    def quiesce(self) -> None:
        """Nothing of the overlapped executor runs (before a unit is read outside a pass)."""
        if self.overlap is not None:
            self.overlap.quiesce()

    def _ctx_passes(self, ctx) -> list:
        """The passes a stage acts on: the pass, or under a layer-major plan every micro-batch's
        (each has its own offload groups, one action moving the same share of each)."""
        c = ctx() if ctx is not None else None
        if c is None:
            return []
        if isinstance(c, layer_major.Run):
            return [p for p in c.passes if p is not None]
        return [c]

    def _lm_run(self):
        return getattr(self._tls, "run", None) if self.layer_major else None

    def _run_action(self, ctx, a) -> None:
        if a.cls is TensorClass.WEIGHT:
            self.statics[a.unit].fetch_weights(a.fa, a.fb)
            return
        if a.cls is TensorClass.GRAD:
            self.statics[a.unit].send_grads(a.fa, a.fb)
            return
        kind = "act" if a.cls is TensorClass.ACT else "ck"
        for p in self._ctx_passes(ctx):
            g = p.groups.get((kind, a.unit))
            if g is None:
                continue
            lo, hi = g.span(a.fa, a.fb)
            if a.out:
                g.send(lo, hi)
            else:
                g.fetch(lo, hi)

    def _barrier(self, ctx) -> None:
        for p in self._ctx_passes(ctx):
            for g in list(p.groups.values()):
                g.wait()
        for s in self.statics.values():
            s.wait()
        self.mover.barrier()

    def _on_stage(self, ctx, stage: int) -> None:
        """Stage ``stage`` begins (its transfers not yet issued): the unit that computed in the
        previous stage is done with its weights, the one that computes now needs them."""
        if self.overlap is not None:     # paced: the steps due by this stage have ended
            self.driver.wait_s += self.overlap.stage_begins(stage)
        self.clock.mark(stage, self.driver.wait_s)
        prev = self.by_stage_unit.get(stage - 1)
        cur = self.by_stage_unit.get(stage)
        if prev is not None and not (prev == self.U - 1 and stage == self.U + 1):
            s = self.statics.get(self.plan.units[prev].name)
            if s is not None and s.in_use:
                # its storages are freed now: an activation allocated at the same address
                # later must not pass for a parameter (kept by reference, never offloaded)
                self.static_ptrs.difference_update(_storage_ptr(q) for _, q in s.params)
                s.release()
            u = self.plan.units[prev]
            if s is not None and stage - 1 > self.U and not s.grads_out and \
                    s.on_grads_home is not None and not u.tied_to and not u.outside_params:
                # its backward is done and its gradients stay on the device: complete
                s.on_grads_home(s)
        # after the release: the plan frees the unit's weights at the end of its stage
        if self.stage_peaks is not None:
            self.stage_peaks.cut(stage)
        if cur is not None and stage <= 2 * self.U:
            s = self.statics.get(self.plan.units[cur].name)
            if s is not None:
                if stage > self.U:
                    s.begin_backward()
                s.use()
                self.static_ptrs.update(_storage_ptr(q) for _, q in s.params)

    # -- wrappers
    def wrap(self):
        for i, b in enumerate(self.blocks):
            self._wrap(b, functools.partial(self._block_forward, i))
        self._wrap(self.model, self._model_forward)
        if self.overlap is not None:
            # model.zero_grad() between the backward and opt.step() waits for the worker, as
            # opt.zero_grad() does, instead of setting .grad under a step that reads it
            self._wrap(self.model, self._model_zero_grad, "zero_grad")

    def _finish_unarmed(self) -> None:
        """End the open pass's remaining stages handing nothing to the optimizer's worker: a
        pass whose forward or backward failed, or never ran, is not the step's backward."""
        if self.overlap is not None:
            self.overlap.armed = False
        self.driver.finish()

    def _model_zero_grad(self, orig, *args, **kwargs):
        self.quiesce()
        return orig(*args, **kwargs)

    def _wrap(self, mod, fn, attr="forward"):
        had = attr in mod.__dict__
        orig = getattr(mod, attr)
        self.wrapped.append((mod, attr, had, mod.__dict__.get(attr)))

        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            return fn(orig, *args, **kwargs)
        setattr(mod, attr, wrapper)

    def unwrap(self):
        for mod, attr, had, prev in reversed(self.wrapped):
            if had:
                setattr(mod, attr, prev)
            else:
                delattr(mod, attr)
        self.wrapped = []

    def _nongrad_units(self):
        """Streamed units that are not blocks (embedding, head): present around a no-grad call."""
        return [s for n, s in self.statics.items() if n not in set(self.block_names)]

    def _model_forward(self, orig, *args, **kwargs):
        if self._recomputing:
            return orig(*args, **kwargs)
        if not torch.is_grad_enabled():
            self.quiesce()
            with contextlib.ExitStack() as st:
                for s in self._nongrad_units():
                    st.enter_context(s.weights_present())
                return orig(*args, **kwargs)
        if self.engine == "none":
            why = engines.wrapped_after(self.model, self.model_cls)
            if why:
                raise UnsupportedModelError(f"{why}; {engines.ORDER}")
        for name, m in self.gc_modules:
            if m.gradient_checkpointing is True:
                raise UnsupportedModelError(
                    f"module {name or 'the model'} switched its own gradient checkpointing on "
                    "after apply_plan (the Hugging Face Trainer does for gradient_checkpointing="
                    "True); turn it off (model.gradient_checkpointing_disable(), or "
                    "gradient_checkpointing=False): the plan decides what is recomputed")
        if self.layer_major:
            return self._lm_model_forward(orig, args, kwargs)
        self._check_input(args, kwargs)
        if not self.step_open:
            self._begin_step()
        if self.driver.ctx is not None and self.driver.ctx() is not None:
            # the previous pass never ran (or never ended) its backward: its stages end
            # before this pass is counted (after, they would hand that pass's units to this
            # step's scheduler, where their own gradients of this step would then find them
            # handed over already)
            self._finish_unarmed()
        if self.overlap is not None:
            self.overlap.pass_starts(self.step_passes + 1)
        self.step_passes += 1
        p = _Pass(self.n_passes)
        self.n_passes += 1
        # FSDP2: the root's gathered weights are the parameters now; blocks' are shards
        ptrs = {_storage_ptr(engines.local(t)) for t in self._live_params()}
        ptrs.update(_storage_ptr(t) for m in self._mods for t in m._buffers.values()
                    if t is not None)
        ptrs.discard(0)
        self.static_ptrs = ptrs
        self.pass_ = p
        self.driver.begin(weakref.ref(p))
        self.clock.begin_pass()
        try:
            self.driver.enter(1)          # the prologue, then the first unit's forward
            out = orig(*args, **kwargs)
            self.clock.forward_done()
        except BaseException:
            p.discard()   # an exception (or Ctrl-C) inside the forward: nothing is left behind
            self._finish_unarmed()
            raise
        finally:
            self.pass_ = None
            p.end_forward()
        roots = _backward_roots(out)
        t = _Trigger(self, p, self.U + 1)
        for root in roots:
            root.grad_fn.register_prehook(t)
        if not roots:
            # nothing to go backward from: the pass is over
            self.driver.finish()
        return out

    def _lm_model_forward(self, orig, args, kwargs):
        """One micro-batch's forward inside ``run_micro_batches`` (its own thread and pass; the
        run drives the stages and the backward)."""
        run = self._lm_run()
        if run is None:
            raise UserError("this plan is layer-major (every micro-batch through a unit before "
                            "the next), which an ordinary loop cannot run: train with "
                            f"{layer_major.API} (docs/runtime.md), or solve with "
                            "--micro-batch-order batch-major")
        k = self._tls.k
        if run.passes[k] is not None:
            raise UserError(f"loss_fn called the model twice for micro-batch {k + 1}; under a "
                            "layer-major plan it runs one forward per micro-batch")
        self._check_input(args, kwargs)
        self.step_passes += 1
        p = _Pass(self.n_passes)
        self.n_passes += 1
        ptrs = {_storage_ptr(engines.local(t)) for t in self.model.parameters()}
        ptrs.update(_storage_ptr(t) for t in self.model.buffers())
        ptrs.discard(0)
        self.static_ptrs |= ptrs
        run.passes[k] = p
        self._tls.pass_ = p
        try:
            return orig(*args, **kwargs)
        except BaseException:
            p.discard()
            raise
        finally:
            self._tls.pass_ = None
            p.end_forward()

    def _check_input(self, args, kwargs):
        self.guard(args, kwargs)      # runtime/binding.py: every dimension of every input

    def _block_forward(self, i, orig, *args, **kwargs):
        lm = self._lm_run()
        p = self._tls.pass_ if lm is not None else self.pass_
        name = self.block_names[i]
        if p is None or self._recomputing or not torch.is_grad_enabled():
            s = self.statics.get(name)
            if s is not None and not self._recomputing and not s.in_use:
                with s.weights_present():
                    return orig(*args, **kwargs)
            if self._recomputing:
                t0 = self.clock.now()
                out = orig(*args, **kwargs)
                self.clock.recompute(name, t0, self.clock.now())
                return out
            return orig(*args, **kwargs)
        ui = self.unit_index[name]
        d = self.decisions[i]
        loc, hidden = _find_hidden(args, kwargs)
        if hidden is None:
            raise PlanMismatchError(f"block {name} was called without a tensor argument; tierplan "
                                    "needs the hidden state as its first tensor argument")
        if lm is not None:
            # this micro-batch's turn at this unit; its input becomes the piece's leaf
            lm.turn(self._tls.k, ui, name)
            leaf, hidden = lm.cut_input(self._tls.k, ui, name, hidden)
            args, kwargs = calls.put_hidden(args, kwargs, loc, hidden)
        else:
            self.driver.enter(1 + ui)
        if i == 0 and hidden.requires_grad and lm is None:
            hidden.register_hook(_Trigger(self, p, 2 * self.U))

        act = d.activation
        if act is Activation.KEEP:
            # Nothing to do for the block itself: no saved-tensor hook (see _KeepCount).
            p.seg = None
            k = _KeepCount(self, self.keep_bytes[i])
            p.keeps.append(k)
            out = orig(*args, **kwargs)
            hid = _hidden_of(out)
            anchor = hidden if hidden.requires_grad else hid
            if anchor.requires_grad:
                anchor.register_hook(k.release)
            else:
                k.release()
            return self._block_done(p, i, ui, out, hid)

        # Shared side inputs (masks, rotary tables, encoder outputs) are kept by reference.
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor) and a is not hidden:
                self.static_ptrs.add(_storage_ptr(a))
        if act is Activation.RECOMPUTE:
            if d.checkpoint is Tier.NONE:
                if p.seg is None or p.prev_out is None or not _same(hidden, p.prev_out):
                    raise PlanMismatchError(
                        f"block {name} has checkpoint 'none', but its input is not the output of "
                        f"the block before it; this model is not a chain there: re-plan with a "
                        f"checkpoint tier for {name}")
            else:
                p.seg = Segment(self, p, i, [], d.checkpoint.value)
                p.segments.append(weakref.ref(p.seg))
            p.seg.names.append(name)
            u = p.seg.begin_unit(args, kwargs, loc, hidden)
            h = _SegUnit(p.seg, u)
        else:
            g = Group(self.mover, act.value, name)
            p.groups[("act", name)] = g
            h = _Offload(self, g, p)
            p.seg = None
        version = hidden._version
        gathered = set()
        if self.engine == "fsdp2":
            # FSDP2 gathered this block's weights before its forward (they are its parameters
            # until it reshards): the engine's, never activations to offload or recompute
            gathered = {_storage_ptr(q) for q in self.blocks[i].parameters()} - self.static_ptrs
            self.static_ptrs |= gathered
        try:
            with saved_tensors_hooks(h.pack, h.unpack):
                out = orig(*args, **kwargs)
        finally:
            self.static_ptrs -= gathered
            if type(h) is _Offload:
                h.keys = None    # drop the forward's references (see _Offload.pack)
        if (act is Activation.RECOMPUTE and d.checkpoint is not Tier.NONE
                and hidden._version != version and not p.seg.ck_copied):
            # The block wrote into its input, which the segment keeps as its checkpoint by
            # reference: the recomputation would start from the written values.
            raise RecomputeMismatch(
                f"tierplan: block {name} writes into its input in place (ReLU(inplace=True)?), "
                "so its input cannot be its recompute checkpoint; re-profile the model (the "
                "profile records such blocks and the runtime then copies the checkpoint)")
        return self._block_done(p, i, ui, out, _hidden_of(out))

    def _block_done(self, p, i, ui, out, hid):
        p.prev_out = hid
        last = i == len(self.blocks) - 1
        lm = self._lm_run()
        if lm is not None:
            # the run drives the stages: no gradient hooks; the head's turn comes next
            return lm.after_last(self._tls.k, out, hid) if last else out
        if hid.requires_grad:
            hid.register_hook(_Trigger(self, p, 2 * self.U - ui))
            if last:
                # the fallback for B:head (an output that is not the loss): its gradient is
                # complete at the end of the head's backward
                hid.register_hook(_Trigger(self, p, self.U + 1))
        if last:
            # the head runs in the model's own code, right after the last block
            self.driver.enter(self.U)
        return out

    # -- steps
    def _live_params(self) -> list:
        """The model's parameters as registered now (FSDP2 swaps its gathered and sharded ones
        in and out), each once, read from the module list taken at apply time. Not
        ``model.parameters()``: its recursive walk cost 0.3 ms a call on a 4-block GPT, and
        three such walks a step were most of keep-all's replay overhead (1.35 ms a step)."""
        seen, out = set(), []
        for m in self._mods:
            for t in m._parameters.values():
                if t is not None and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
        return out

    def _static_bytes(self, params: list) -> int:
        """Device bytes of the parameters, their gradients and the optimizers' state, each
        storage once (a gradient whose home is NVMe is a placeholder: nothing)."""
        tensors = []
        for prm in params:
            tensors.append(prm)
            if prm.grad is not None:
                tensors.append(prm.grad)
        # the handle's optimizer under a streaming plan ends the step itself, so it is never
        # among the optimizers seen stepping: its state on the device counts all the same
        opts = list(self.optimizers) + ([self.phase.opt] if self.phase is not None else []) \
            + ([self.shards.opt] if self.shards is not None else [])
        for opt in opts:
            for state in opt.state.values():
                tensors.extend(v for v in state.values()
                               if isinstance(v, torch.Tensor) and v.device == self.device)
        seen, n = set(), 0
        for t in tensors:
            # a DTensor's local tensor as it is (to_local() would read a placeholder's values)
            t = getattr(t, "_local_tensor", t)
            if isinstance(t, OffloadedGrad):     # a gradient whose home is NVMe: no storage
                continue
            st = t.untyped_storage()
            ptr = st.data_ptr()
            if ptr and ptr not in seen:
                seen.add(ptr)
                n += st.nbytes()
        return n

    def _begin_step(self):
        if self.overlap is not None:
            self.overlap.new_step()      # paced: the gradients its steps used, zeroed
        params = self._live_params()
        if self.grads_late and not self.grads_warned and any(
                p.grad is not None for p in params):
            # the plan counts a gradient from its unit's backward to the optimizer step:
            # gradients alive through the forward are not in it
            self.grads_warned = True
            warnings.warn("tierplan: gradients exist as a step's forward starts, but the plan "
                          "(--micro-batches 1) counts each from its unit's backward on; free "
                          "them after the optimizer step with opt.zero_grad() (set_to_none, "
                          "the default), or for gradient accumulation solve with "
                          "--micro-batches K", stacklevel=3)
        self.step_static = self._static_bytes(params)
        be = self.mover.be
        if be.allocated() is not None:
            be.synchronize()
            self.step_base = be.allocated()
            be.reset_peak()
        else:
            if self.trim:
                malloc_trim()
            self.hwm_ok = reset_hwm() and self.hwm_ok
            self.step_base = read_status().get("VmRSS")
        if self.stage_peaks is not None:
            self.stage_peaks.begin(None if be.allocated() is not None else self.step_base)
        self.counters.reset_step()
        self.driver.wait_s = 0.0
        self.step_passes = 0
        self.step_open = True
        self.clock.begin_step()
        self.step_t0 = time.perf_counter()

    def before_optimizer_step(self, opt, args, kwargs):
        """Another optimizer stepping parameters the plan keeps off the device would step
        placeholders (a Trainer given no ``optimizers=`` makes its own): refused first."""
        if self.shards is not None and opt is not self.shards.opt and not self.shards.in_step \
                and any(id(q) in self.shards.homed for g in opt.param_groups
                        for q in g["params"]):
            raise PlanMismatchError(
                f"{type(opt).__name__} is not the optimizer given to apply_plan, but it steps "
                "shards the plan homes on NVMe; step the one given to "
                "apply_plan(model, plan, optimizer=opt)")
        if self.phase is None or opt is self.phase.opt or id(opt) in self.sub_optimizers:
            return
        if any(id(q) in self.phase.streamed for g in opt.param_groups for q in g["params"]):
            raise PlanMismatchError(
                f"{type(opt).__name__} is not the optimizer given to apply_plan, but it steps "
                "parameters the plan keeps off the device; step the one given to "
                "apply_plan(model, plan, optimizer=opt) (with the Hugging Face Trainer: "
                "Trainer(..., optimizers=(opt, None)))")

    def on_optimizer_step(self, opt, args, kwargs):
        if not self.step_open or id(opt) in self.sub_optimizers:
            return
        if self.phase is not None and opt is self.phase.opt:
            return      # the handle's own step ends the step (after the streamed units)
        if self.shards is not None and (opt is self.shards.opt or self.shards.in_step):
            return      # sharded.NvmeShards ends the step after the homed blocks' steps
        if opt not in self.optimizers:
            if not any(id(q) in self.param_ids for g in opt.param_groups for q in g["params"]):
                return
            self.optimizers.add(opt)
        self.end_step()

    def end_step(self):
        if not self.step_open:
            return
        be = self.mover.be
        if be.allocated() is not None:
            be.synchronize()
        t1 = time.perf_counter()
        c = self.counters
        stall = c.stall_s + self.driver.wait_s
        sp = self.stage_peaks
        stage_peaks = sp.end() if sp is not None else None
        if stage_peaks is not None and not sp.failed:
            # the intervals cover the step: the largest is its peak (the mark was reset)
            peak = max(x for x in stage_peaks if x is not None)
        else:
            # the kernel's per-thread RSS counters can leave VmHWM a few pages below the VmRSS
            # read at the start: read_peak takes the rise as 0 then
            peak = read_peak(be, self.step_base)
            self.hwm_ok = self.hwm_ok and not (sp is not None and sp.failed)
        units, after_backward, links = self.clock.end_step()
        opt_s, opt_n = self.clock.optimizer_compute()
        with c.lock:
            rec = StepRecord(step_s=t1 - self.step_t0, passes=self.step_passes,
                             peak_gpu_bytes=peak, peak_cpu_bytes=c.peak_host,
                             peak_nvme_bytes=c.peak_nvme, peak_activation_bytes=c.peak_act,
                             static_bytes=self.step_static, base_bytes=self.step_base,
                             moved=dict(c.moved), stall_s=stall, units=units,
                             after_backward_s=after_backward, links=links,
                             optimizer_compute_s=opt_s, optimizer_elements=opt_n,
                             overlapped_units=(self.overlap.overlapped() if self.overlap
                                               is not None else 0),
                             stage_peaks=stage_peaks)
        self.report.steps.append(rec)
        self.report.hwm_reset = self.hwm_ok
        if not self.report.nvme_io and self.mover.store is not None:
            self.report.nvme_io = self.mover.store.io_mode()
        self.step_open = False
        K = self.plan.micro_batches
        if self.step_passes not in (0, K) and not self.passes_warned:
            # the prediction is for K passes a step: with more, memory and time are not it
            # (found running a --micro-batches 1 plan with two passes: 6.6% above its peak)
            self.passes_warned = True
            warnings.warn(f"tierplan: this optimizer step ran {self.step_passes} forward "
                          f"pass(es) with gradients but the plan was solved for --micro-batches "
                          f"{K}; its memory and time predictions assume {K}: solve with "
                          f"--micro-batches {self.step_passes} (a forward that needs no backward, "
                          "an evaluation, belongs under torch.no_grad())", stacklevel=2)

    def close(self):
        self.closed = True
        self.lm_workers.close()
        self.quiesce()
        if self.pass_ is not None:
            self.pass_.discard()
            self.pass_ = None
        for s in self.statics.values():
            with contextlib.suppress(Exception):
                s.wait()
            if hasattr(s, "free_host"):      # host homes and their slab views (staged path)
                s.free_host()
        self.mover.close()


def _unit_params(model, plan: Plan, blocks: dict) -> dict:
    """Unit name -> [(qualified name, parameter)] it owns, as the profile charged them
    (``model.params``, checked against the model by ``binding.bind``). Plans of profiles that
    predate that table: each block its own parameters, the embedding those registered before
    the first block's (tied weights included), the head those after the last."""
    by_name = dict(model.named_parameters())
    table = plan.model.get("params")
    if isinstance(table, dict) and table:
        return {u.name: [(row[0], by_name[row[0]]) for row in table.get(u.name, ())]
                for u in plan.units}
    in_block = {}
    for bname, b in blocks.items():
        for p in b.parameters():
            in_block.setdefault(id(p), bname)
    out = {u.name: [] for u in plan.units}
    emb, head = plan.units[0].name, plan.units[-1].name
    seen_block = False
    for n, p in model.named_parameters():
        if id(p) in in_block:
            out[in_block[id(p)]].append((n, p))
            seen_block = True
        else:
            out[head if seen_block else emb].append((n, p))
    return out


def _io_requests(plan: Plan, executor) -> tuple[int, int]:
    """The disk requests the plan priced (its executor section), or for a plan that does not
    record them, those of its hardware."""
    if executor is not None and executor.io_request_bytes and executor.io_in_flight:
        return executor.io_request_bytes, executor.io_in_flight
    hw = plan.hardware
    return io_requests(bool(hw.get("unified_memory")) or hw.get("device") == "cpu",
                       int(hw.get("nvme_drives") or 0))


def _pinned_bytes(plan: Plan) -> int:
    """The pinned slab's size: the plan's predicted peak of pinned host bytes, and at least
    twice the largest unit's offloaded activations (an NVMe tier stages through it). Used only
    where the device is not host memory; allocated once, at the first request."""
    dec = {d.name: d for d in plan.layers}
    staged = [int(u.activation_bytes) for u in plan.units
              if dec[u.name].activation is not Activation.KEEP]
    return max(int(plan.predicted.peak_cpu_bytes), 2 * max(staged, default=0))


def _predicted_moved(plan: Plan) -> dict:
    """Bytes per optimizer step the schedule moves per link (as the report keys them)."""
    U = len(plan.units)
    out = {k: 0 for k in LINKS}
    # layer-major: one stage sequence a step, each gradient complete within its stage (summed
    # on the device over the micro-batches), so nothing is read back to accumulate
    passes = 1 if plan.micro_batch_order == "layer-major" else plan.micro_batches
    for e in plan.all_events():
        if not e.is_transfer:
            continue
        times = 1 if e.stage > 2 * U else (
            passes - 1 if e.passes.value == "rest" else passes)
        key = {Stream.D2H: "d2h", Stream.H2D: "h2d"}.get(e.stream)
        if e.stream is Stream.NVME:
            key = "nvme_write" if e.op is Op.WRITE else "nvme_read"
        if key:
            out[key] += e.bytes * times
    return out


# ----------------------------------------------------------------------------- public API

class Handle:
    """What ``apply_plan`` returns: ``report()``, ``clip_grad_norm_()``, ``remove()``."""

    def __init__(self, runner: _Runner, hook, undo: list):
        self._r = runner
        self._hook = hook
        self._undo = undo
        self._removed = False

    @property
    def plan(self) -> Plan:
        return self._r.plan

    def report(self) -> Report:
        """Measured steps so far beside the plan's prediction."""
        return self._r.report

    def gather_reports(self) -> list | None:
        """Every rank's report, on rank 0 (a list in rank order; None on the other ranks); a
        collective: every rank must call it. Without a process group, ``[report()]``."""
        return engines.gather_objects(self._r.report)

    def run_micro_batches(self, batches, loss_fn) -> list:
        """Forward and backward of the micro-batches ``batches`` of one optimizer step in the
        plan's order; ``loss_fn(model, mb)`` runs one forward and returns its scalar loss (divide
        by K there to average). Returns the losses (detached). Under a batch-major plan this is
        the plain loop (``loss_fn(model, mb).backward()`` for each); under a layer-major one
        every micro-batch goes through a unit before the next unit (``runtime.layer_major``),
        the gradients those of the plain loop. Then ``opt.step()`` and ``zero_grad()`` as usual."""
        batches = list(batches)
        if not batches:
            raise UserError("run_micro_batches needs at least one micro-batch")
        if not torch.is_grad_enabled():
            raise UserError("run_micro_batches trains (forward and backward): call it with "
                            "gradients enabled, not under torch.no_grad()")
        r = self._r
        if not r.layer_major:
            losses = []
            for mb in batches:
                loss = loss_fn(r.model, mb)
                loss.backward()
                losses.append(loss.detach())
            return losses
        if r.closed or self._removed:
            raise UserError("this handle was removed; apply the plan again")
        if len(batches) > r.plan.micro_batches:
            # layer-major holds every micro-batch's activations of a unit at once: more than
            # the plan's K is more memory than it counted
            raise UserError(f"run_micro_batches got {len(batches)} micro-batches, but this "
                            f"layer-major plan holds {r.plan.micro_batches} at a time; pass at "
                            f"most {r.plan.micro_batches} per call, or re-solve with "
                            f"--micro-batches {len(batches)}")
        return layer_major.Run(r, batches, loss_fn).run()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, foreach=None,
                        parameters=None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, ...)`` for a plan whose
        gradients may live off the device: the same total norm and the same scale, the scale
        reaching the gradients on NVMe as they are read at ``opt.step()``."""
        if self._r.plan.clip == "none":
            raise UserError("this plan was solved with --clip none (the loop does not clip by "
                            "the global gradient norm); re-solve with --clip global to clip")
        params = list(self._r.model.parameters() if parameters is None else parameters)
        for s in self._r.statics.values():
            s.wait()
        # torch's own: a gradient on NVMe gives the norm taken as it was written and takes
        # the scale as it is read at the step (runtime.streaming.OffloadedGrad)
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite,
                                              foreach)

    def gradients(self) -> dict:
        """Parameter name -> its accumulated gradient, wherever it lives (read from NVMe where
        it is there), or None."""
        out = {}
        self._r.quiesce()
        for n, p in self._r.model.named_parameters():
            g = p.grad
            if isinstance(g, SteppedGrad):
                raise SteppedGrad.refusal(g.unit, "handle.gradients()")
            out[n] = None if g is None else (None if isinstance(g, OffloadedGrad) else g.detach())
        for s in self._r.statics.values():
            if s.grads_out:
                s.sync_grads()
                for k, g in s.store_of().submit(s.read_grads).result().items():
                    out[s.params[k][0]] = g
        return out

    def remove(self) -> None:
        """Undo everything: the model's and blocks' ``forward`` and the optimizer as they were,
        every weight back on the device, no hooks left, the runtime's files and the directories
        it created deleted."""
        if self._removed:
            return
        self._removed = True
        self._hook.remove()
        r = self._r
        # the overlapped executor's worker done first; its error, where no opt.step() raised it
        first = r.overlap.close() if r.overlap is not None else None
        r.unwrap()
        for undo in reversed(self._undo):
            undo()
        if r.shards is not None:               # FSDP2 shards homed on NVMe, resident again
            err = r.shards.remove()
            first = first or err
        # Every unit is brought home and every file deleted even when one unit fails (a
        # corrupted weight, a read-only directory); then the first error is raised.
        for s in r.statics.values():
            try:
                with contextlib.suppress(Exception):
                    s.wait()
                if s.weights_out and not s.in_use:
                    s.use()
                if s.grads_out:
                    s.sync_grads()
                    for k, g in s.store_of().submit(s.read_grads).result().items():
                        s.params[k][1].grad = g
                if r.phase is not None:
                    s.bring_state_home(r.phase.opt.state)
            except BaseException as e:       # noqa: BLE001 -- raised after the clean-up
                first = first or e
            finally:
                s.close()
        try:
            r.close()
        except OffloadError as e:           # files it could not delete: one line
            if first is None:
                first = e
            else:
                warnings.warn(str(e), stacklevel=2)
        finally:
            _ACTIVE.pop(r.model, None)
        if first is not None:
            raise first

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def _install_optimizer(runner: _Runner, opt) -> list:
    """Route ``opt.step``, ``zero_grad``, ``state_dict`` and ``load_state_dict`` through the
    plan; returns the undo callbacks."""
    undo = []
    phase = runner.phase

    def patch(name, fn):
        # a bound method, as torch's LR schedulers expect of ``opt.step`` (they wrap its
        # ``__func__``), whether they are made before apply_plan or after
        had = name in opt.__dict__
        prev = opt.__dict__.get(name)
        setattr(opt, name, types.MethodType(fn, opt))
        undo.append(lambda: setattr(opt, name, prev) if had else delattr(opt, name))

    orig_step = opt.step
    orig_zero = opt.zero_grad
    orig_sd = opt.state_dict
    orig_load = opt.load_state_dict

    def step(_opt, closure=None):
        # overlapped: the units stepped beside the backward (their errors raised here)
        done = runner.overlap.collect() if runner.overlap is not None else ()
        for s in runner.statics.values():
            s.wait()
        out = phase.step(orig_step, closure, done)
        if sched_wrapped:
            _opt._opt_called = True          # what the scheduler's own wrapper records
        runner.end_step()
        return out

    # An LR scheduler made before apply_plan wrapped ``opt.step`` and checks for its mark at
    # every ``sched.step()``; the step that replaces it carries the mark on.
    sched_wrapped = hasattr(orig_step, "_wrapped_by_lr_sched")
    if sched_wrapped:
        step._wrapped_by_lr_sched = True

    def zero_grad(_opt, set_to_none: bool = True):
        # the placeholders of gradients on NVMe are in place before the user's zero_grad
        # clears or zeroes them (what it does to them reaches their homes)
        runner.quiesce()
        for s in runner.statics.values():
            s.wait()
        return orig_zero(set_to_none)

    def state_dict(_opt):
        runner.quiesce()
        with contextlib.ExitStack() as st:
            for s in runner.statics.values():
                st.enter_context(s.state_present(opt.state))
            sd = orig_sd()
            # copies: the live tensors of NVMe-homed state are freed again on leaving
            sd["state"] = {k: {kk: (v.clone() if isinstance(v, torch.Tensor) else v)
                               for kk, v in st_.items()} for k, st_ in sd["state"].items()}
            return sd

    def load_state_dict(_opt, sd):
        runner.quiesce()
        orig_load(sd)
        _state_home(runner, opt)
    # state the optimizer holds already (loaded from a checkpoint, or steps taken before
    # apply_plan) goes to its homes now, as a load would send it
    _state_home(runner, opt)
    patch("step", step)
    patch("zero_grad", zero_grad)
    patch("state_dict", state_dict)
    patch("load_state_dict", load_state_dict)
    return undo


def _state_home(runner: _Runner, opt) -> None:
    """The per-element optimizer state ``opt`` holds for units whose state is homed off the
    device, written to those homes and freed on the device (the step reads it from there)."""
    for s in runner.statics.values():
        tens = s.state_tensors(opt.state) if s.state_out else []
        if tens:
            # the optimizer may hold the caller's own tensors (``load_state_dict`` keeps those
            # already of the right dtype and device): the home gets copies, and freeing them
            # on the device leaves the caller's dict as it was
            for k, key, v in tens:
                opt.state[s.params[k][1]][key] = v.clone()
            s.state_layout = None                # rewritten from the values held
            s.write_back(opt.state, weights=False)


def _install_state_dict_hooks(runner: _Runner) -> list:
    """``state_dict()`` of the model, of any module inside it or of any wrapper around it gives
    the real weights of parameters homed off the device, and ``load_state_dict()`` puts loaded
    values in their home: hooks on every module that holds such a parameter itself, so they
    see the key under whatever prefix the call gives it. One parameter at a time is read or
    written, never a unit's weights at once."""
    owned = {}
    for s in runner.statics.values():
        if s.weights_out:
            for k, (_, p) in enumerate(s.params):
                owned[id(p)] = (s, k)
    holders = {}
    for mod in runner.model.modules():
        local = [(n, owned[id(p)]) for n, p in mod._parameters.items()
                 if p is not None and id(p) in owned]
        if local:
            holders[mod] = local
    undo = []
    for mod, local in holders.items():
        opened = []

        def post(module, sd, prefix, local_metadata, local=local):
            runner.quiesce()
            for n, (s, k) in local:
                if prefix + n in sd:
                    sd[prefix + n] = s.weight_value(k)

        def pre(module, sd, prefix, local_metadata, strict, missing, unexpected, errors,
                local=local, opened=opened):
            if local_metadata.get("assign_to_params_buffers"):
                raise PlanMismatchError("load_state_dict(assign=True) would replace parameters "
                                        "that the plan keeps off the device; load without "
                                        "assign (the values go to their homes)")
            runner.quiesce()
            for n, (s, k) in local:
                if prefix + n in sd:
                    opened.append((s, k, s.open_for_load(k)))

        def after(module, incompatible, opened=opened):
            while opened:
                s, k, made = opened.pop()
                s.loaded(k, made)

        undo += [mod.register_state_dict_post_hook(post).remove,
                 mod.register_load_state_dict_pre_hook(pre).remove,
                 mod.register_load_state_dict_post_hook(after).remove]
    return undo


def _executor(plan: Plan, src: str) -> Executor:
    """The plan's ``executor`` section: what the runtime acts on that the planner's cost model
    computed (it reads nothing else of the planner). A plan written before the section is
    refused in one line: ``plan upgrade`` writes it (from the plan's own cost model, after the
    simulator's check). The plan's consistency (its events are those its decisions imply) was
    checked by the simulator when it was written; here the format's own checks ran and
    ``check_homes`` checks what can be checked without the cost model (homes against the
    schedule's transfers, tied units on the device)."""
    if plan.executor is None:
        raise PlanMismatchError(f"{src} has no executor section (written before this version); "
                                "write it with 'plan upgrade PLAN -o NEW', or solve again")
    try:
        check_homes(plan, src)
        plan.executor.check_pieces(src)
    except UserError as e:
        raise PlanMismatchError(str(e)) from None
    return plan.executor


def _compute_threads(runner: _Runner, executor: Executor) -> list:
    """On a CPU device, torch's intra-op threads at the count the plan's profile was timed
    with (``executor.compute_threads``), as they were again at ``remove()``; the undo list.

    The plan's times hold at that count only: on a 2-core host a pass at 2 threads beside the
    runtime's transfer thread ran 2.1x the profile's time, at 1 thread (the profile's default
    there) its own (docs/runtime.md, "Compute threads on a CPU host")."""
    n = executor.compute_threads
    if runner.device.type != "cpu" or not n:
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores and n > cores:
        # a profile from a larger host, or an edited plan (100000 threads crashed the process
        # in torch's pool, leaving its offload folder): the cores there are
        warnings.warn(f"tierplan: the plan's profile computed with {n} threads, but this "
                      f"process may use {cores} cores: computing with {cores}, where the plan's "
                      "times do not hold (profile the model on this machine with plan profile "
                      "--device cpu, and solve again)", stacklevel=3)
        n = cores
    was = torch.get_num_threads()
    runner.report.compute_threads = n
    if n == was:
        return []
    torch.set_num_threads(n)

    def restore():
        if torch.get_num_threads() == n:       # not changed again by the user since
            torch.set_num_threads(was)
    return [restore]


def apply_plan(model: torch.nn.Module, plan: Plan | str | Path, *,
               optimizer: torch.optim.Optimizer | None = None,
               nvme_dir: str | Path | None = None, trim_heap: bool = False,
               checkpoint: str | Path | None = None, stage_peaks: bool = False) -> Handle:
    """Make ``model`` train under ``plan``; return a handle with ``report()``, ``remove()``
    and, for plans whose gradients may live off the device, ``clip_grad_norm_()``.

    ``optimizer`` (built by the user on ``model.parameters()``) is needed when the plan homes
    weights, gradients or optimizer state off the device: its ``step``, ``zero_grad`` and state
    dicts then go through the plan. Raises ``PlanMismatchError`` (a ``ValueError``) when the
    plan's blocks differ from the model's, ``UnsupportedModelError`` for torch.compile'd,
    FSDP1- or DataParallel-wrapped or self-checkpointing models. On a CPU device,
    ``trim_heap=True`` gives freed heap pages back to the kernel before each step (costly; see
    docs/runtime.md). ``stage_peaks=True`` also measures the device peak of every stage
    (``report().stage_peaks()``, and two lines of the printed report naming the stage where
    the measured and the predicted peak fell): a diagnostic, off by default, since it resets
    the peak as each stage begins (a peak read inside a step is then its stage's).

    ``checkpoint`` (a safetensors file, its index, or a directory with either) fills the
    model's parameters from it, each straight into its home: a model built under
    ``runtime.meta_parameters()`` never exists whole in memory (runtime/checkpoint.py).

    Under FSDP2 or DDP (a plan from ``plan solve --world-size N``) every rank applies the same
    plan to its model after wrapping it: ``fully_shard`` on each block and then the root, or
    ``DistributedDataParallel(model)`` (give this the wrapper); ``runtime.engines`` checks the
    wrapping and the order, and ``handle.gather_reports()`` brings every rank's report to
    rank 0 (docs/distributed.md).
    """
    engine, model = engines.detect(model)     # DDP: the plan binds to the module inside it
    if model in _ACTIVE:
        raise PlanMismatchError("a plan is already applied to this model; call handle.remove() "
                                "first")
    _refuse_unsupported(model)
    plan_path = None
    if not isinstance(plan, Plan):
        plan_path = str(plan)
        plan = load_plan(plan)     # the format's checks; a /1 plan refused, naming 'plan upgrade'
    src = plan_path or "the plan"
    if plan.micro_batch_order == "layer-major" and plan.engine != "none":
        raise UserError(f"{src} is layer-major under {plan.engine}, which this runtime does not "
                        "run; solve with --micro-batch-order batch-major")
    if plan.optimizer_overlap == "overlapped" and plan.engine != "none":
        # under an engine the user's optimizer (or sharded.NvmeShards) steps every unit at
        # opt.step(): nothing would run beside the backward, and the prediction would not hold
        raise UserError(f"{src} overlaps the optimizer with the backward under {plan.engine}, "
                        "which this runtime does not run; re-solve with --optimizer-overlap "
                        "off")
    executor = _executor(plan, src)
    blocks = bind(model, plan, src)      # runtime/binding.py: exact names, shapes, identity
    engines.check(plan, engine, model, blocks, src)
    if engine == "fsdp2":
        sharded.check_policies(plan, model, blocks, src)    # each block's policy against its home
    table = plan.model.get("params") or {}
    for u, d in zip(plan.units, plan.layers):
        if u.kind != UnitKind.BLOCK.value and d.activation is not Activation.KEEP:
            raise PlanMismatchError(f"{src}: unit {u.name} ({u.kind}) must be 'keep' in this "
                                    "version; regenerate the plan")
        if u.kind == UnitKind.BLOCK.value and (d.home.weights is not Tier.GPU
                                               or d.home.grads is not Tier.GPU):
            # code between blocks uses such a parameter before the block's forward and its
            # gradient finishes after the block's backward (the planner keeps them on the GPU)
            outside = [row[0] for row in table.get(u.name, ())
                       if not str(row[0]).startswith(u.name + ".")]
            if outside:
                raise PlanMismatchError(
                    f"{src}: unit {u.name} streams its weights or gradients, but it holds "
                    f"{outside[0]!r}, which code between blocks uses; such a unit keeps its "
                    "weights and gradients on the device: regenerate the plan")
    p0 = next(model.parameters(), None)
    dev = p0.device.type if p0 is not None else "cpu"
    plan_dev = plan.hardware.get("device")
    on_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if on_meta and checkpoint is None:
        raise PlanMismatchError(f"parameter {on_meta[0]!r} is on the meta device: pass "
                                "apply_plan(..., checkpoint=FILE) to fill it")
    if on_meta:
        dev = plan_dev or "cpu"
    if plan_dev and plan_dev != dev:
        raise PlanMismatchError(f"{src} is for {plan_dev} hardware ({plan.hardware.get('name')}) "
                                f"but the model is on {dev}; solve with a {dev} hardware spec")
    nvme_needed = False
    streams = False
    for u, d in zip(plan.units, plan.layers):
        if d.activation is Activation.RECOMPUTE and d.checkpoint is Tier.NONE and \
                u.name in (plan.model.get("chain_breaks") or ()):
            raise PlanMismatchError(f"{src}: {u.name} has checkpoint 'none' but its input is not "
                                    "the previous block's output (another stack starts there), "
                                    "so it cannot be recomputed from it; re-plan with a "
                                    f"checkpoint tier for {u.name}")
        if Tier.NVME in (d.checkpoint, d.home.weights, d.home.grads, d.home.optimizer) or \
                d.activation is Activation.NVME:
            nvme_needed = True
        if (d.activation is Activation.CPU or d.checkpoint is Tier.CPU) and \
                backend_for(torch.device(dev)).unified:
            raise PlanMismatchError(f"{src}: {u.name} offloads to host memory, which needs a CUDA "
                                    "device; use a cpu-host plan (nvme) on a CPU")
        if Tier.CPU in (d.home.weights, d.home.grads, d.home.optimizer) and \
                backend_for(torch.device(dev)).unified:
            raise PlanMismatchError(f"{src}: {u.name} has home {d.home.label()}, host memory, "
                                    "which needs a device that is not host memory (CUDA); use a "
                                    "cpu-host plan (homes on nvme) on a CPU")
        streams = streams or not d.home.resident
    nvme = str(nvme_dir) if nvme_dir is not None else plan.nvme_dir
    if nvme_needed and not nvme:
        raise PlanMismatchError(f"{src} uses nvme but names no directory; pass "
                                "apply_plan(..., nvme_dir=DIR) or solve with --nvme-dir DIR")
    if streams and plan.engine == "ddp":
        raise PlanMismatchError(f"{src} keeps tensors off the device under ddp, which is not "
                                "supported; solve it with --engine fsdp2 (or homes on the device)")
    homed = plan
    if streams and plan.engine == "fsdp2":
        # engines.check has matched each block's CPUOffloadPolicy to its host home: FSDP2
        # moves those shards and the user's optimizer steps them on the CPU. NVMe homes are
        # sharded.NvmeShards' own, around FSDP2's machinery; the single-process streaming
        # path runs nothing (runtime/sharded.py)
        plan, streams = sharded.engine_view(plan), False
    if streams and optimizer is None:
        raise PlanMismatchError(f"{src} keeps weights, gradients or optimizer state off the "
                                "device, so the optimizer step goes through the plan: pass "
                                "apply_plan(model, plan, optimizer=opt)")
    ck = None
    if checkpoint is not None:
        from . import checkpoint as ckpt
        ck = ckpt.Checkpoint(checkpoint)
        owned = _unit_params(model, plan, dict(blocks))
        streamed = {id(p) for u, d in zip(plan.units, plan.layers) if d.home.weights is not Tier.GPU
                    for _, p in owned[u.name]}
        try:
            ckpt.load_resident(model, ck, torch.device(dev) if on_meta else p0.device, streamed)
        except BaseException:
            ck.close()
            raise
    runner = _Runner(model, plan, plan_path, blocks, nvme, trim_heap, optimizer, executor,
                     stage_peaks)
    if nvme_needed:
        # Up front (docs/reliability.md): the directory is made, writable and has room for the
        # plan's NVMe peak, or one line says why; not a raw OSError at the first forward, nor
        # a full disk found at the backward after the whole forward.
        try:
            runner.mover.nvme_store().prepare(int(plan.predicted.peak_nvme_bytes), src,
                                              files=planned_files(plan))
        except BaseException:
            runner.close()
            raise
    try:
        if ck is not None:
            names = ckpt.names_of(model)
        for s in runner.statics.values():
            s.setup(None if ck is None else
                    (lambda k, p: ckpt.fill(ck, names[id(p)], p)))
    except BaseException:
        runner.close()
        raise
    finally:
        if ck is not None:
            ck.close()
    shards = None
    if engine == "fsdp2" and any(Tier.NVME in (d.home.weights, d.home.grads, d.home.optimizer)
                                 for d in homed.layers):
        try:
            shards = sharded.NvmeShards(model, homed, blocks, runner.mover.nvme_store(),
                                        runner.counters, optimizer, src)
            shards.install(runner.end_step)
        except BaseException:
            if shards is not None:
                shards.remove()
            runner.close()
            raise
    runner.shards = shards
    undo = []
    hook = None
    try:
        runner.wrap()
        if runner.phase is not None:
            undo += _install_optimizer(runner, optimizer)
        undo += _install_state_dict_hooks(runner)
        hook = register_optimizer_step_post_hook(runner.on_optimizer_step)
        pre_hook = register_optimizer_step_pre_hook(runner.before_optimizer_step)
        undo.append(pre_hook.remove)
        undo += _compute_threads(runner, executor)
        handle = Handle(runner, hook, undo)
    except BaseException:
        # (Ctrl-C included) the model as it came: its shards resident, nothing hooked
        if hook is not None:
            hook.remove()
        for u in reversed(undo):
            with contextlib.suppress(Exception):
                u()
        with contextlib.suppress(Exception):
            runner.unwrap()
        if shards is not None:
            err = shards.remove()
            if err is not None:          # a shard that could not come home: said, not lost
                warnings.warn(f"tierplan: bringing the shards home after the error failed: "
                              f"{err}", stacklevel=2)
        runner.close()
        raise
    _ACTIVE[model] = handle
    return handle
