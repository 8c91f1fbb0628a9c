"""``apply_plan``: replay a plan inside an ordinary PyTorch training loop.

The runtime decides nothing. For every block it reads the plan's decision (``keep``,
``recompute`` with a checkpoint tier, ``cpu``, ``nvme``) and, for every prefetch, the compute
event at whose start the plan issues it. It acts through two things only: each block's
``forward`` is wrapped (an instance attribute, removed again by ``remove()``) so that the block
runs under ``torch.autograd.graph.saved_tensors_hooks``, and the model's ``forward`` is wrapped to
check the input size and to delimit a forward pass. With gradients off, both wrappers call
straight through.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import weakref
from collections.abc import Mapping
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.autograd.graph import saved_tensors_hooks

from planner.errors import UserError
from planner.formats import Activation, Plan, Stream, Tier, UnitKind, load_plan

from . import calls
from .binding import InputGuard, InputTooLargeError, PlanMismatchError, bind
from .calls import find_hidden as _find_hidden, hidden_of as _hidden_of
from .offload import Counters, Mover
from .recompute import Placeholder, RecomputeMismatch, Segment
from .report import LINKS, Report, StepRecord, malloc_trim, read_status, reset_hwm


__all__ = ["apply_plan", "Handle", "PlanMismatchError", "InputTooLargeError",
           "UnsupportedModelError"]


class UnsupportedModelError(UserError, ValueError):
    """A combination the runtime does not support yet (torch.compile, DDP/FSDP, own checkpointing)."""


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
        if cls & {"DistributedDataParallel", "DataParallel", "FullyShardedDataParallel",
                  "FSDPModule"}:
            raise UnsupportedModelError(
                f"the model{where} is wrapped in {type(m).__name__}; tierplan does not support "
                "DDP/FSDP yet: apply the plan to the unwrapped module")
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
    offloaded unit's packer, each segment), and the pass refers to nothing that holds the graph
    once its forward has returned (``prev_out`` and ``seg`` are cleared then; segments are held
    weakly; hooks on tensors hold the pass weakly). So when the graph is freed (its backward has
    run, or the output was dropped without one) the pass goes at once, by reference counting,
    and its finalizer discards the groups that are left: their files are deleted then."""

    def __init__(self, idx: int):
        self.idx = idx
        self.groups: dict = {}          # ("act"|"ck", unit name) -> offload Group
        self.segments: list = []        # weakref.ref(Segment)
        self.seg: Segment | None = None  # during the forward only
        self.prev_out = None             # during the forward only
        self.keeps: list[_KeepCount] = []
        self.head_started = False        # B:head has been triggered
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
    """A gradient hook that triggers compute events of one pass, held weakly (see ``_Pass``).
    ``B:head`` is triggered once per pass, by whichever of its hooks backward reaches first."""

    __slots__ = ("r", "wp", "ids")

    def __init__(self, r, p, ids):
        self.r, self.wp, self.ids = r, weakref.ref(p), ids

    def __call__(self, *_):
        p = self.wp()
        if p is None or self.r.closed:
            return
        for eid in self.ids:
            if eid == "B:head":
                if p.head_started:
                    continue
                p.head_started = True
            self.r.trigger(p, eid)


class _KeepCount:
    """The runtime's resident-bytes figure for a kept unit, without a hook on its tensors.

    A kept block needs nothing from the runtime, so it runs with no saved-tensor hook at all:
    packing each saved tensor through Python cost about 2 us per tensor (27 tensors per GPT
    block), which was most of keep-all's measured overhead on small blocks. Its bytes are the
    plan's own A_i (``activation_bytes``: saved bytes less shared side tensors, which every
    mode keeps by reference), counted from the block's forward until the
    gradient of its input is complete, i.e. its backward has run and autograd freed them."""

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
    inputs goes to its group; identical views are sent once."""

    __slots__ = ("r", "group", "keys", "pass_")

    def __init__(self, r, group, pass_):
        # The graph holds this packer through every tensor it packed, and through it the pass.
        self.r, self.group, self.keys, self.pass_ = r, group, {}, pass_

    def pack(self, t):
        if self.r.is_static(t):
            return ("ref", t)
        key = (_storage_ptr(t), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        hit = self.keys.get(key)
        if hit is None:
            # Hold the tensor until the block's forward ends: its address cannot be reused by
            # another tensor meanwhile, so equal keys mean the same bytes (the plan counts A_i
            # in full while F:i runs, so this costs nothing it did not plan for).
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
    def __init__(self, model, plan: Plan, plan_path: str | None, blocks, nvme_dir, trim: bool):
        self.guard = InputGuard(model, plan, plan_path or "the plan")
        self.model = model
        self.plan = plan
        self.plan_path = plan_path
        self.block_names = [n for n, _ in blocks]
        self.blocks = [m for _, m in blocks]
        dec = {d.name: d for d in plan.layers}
        self.decisions = [dec[n] for n in self.block_names]
        units = {u.name: u for u in plan.units}
        self.keep_bytes = [int(units[n].activation_bytes) for n in self.block_names]
        # Parameters' and buffers' storages matter only to units whose saved tensors are hooked.
        self.hooked = any(d.activation is not Activation.KEEP for d in self.decisions)
        p0 = next(model.parameters(), None)
        self.device = p0.device if p0 is not None else torch.device("cpu")
        self.counters = Counters()
        self.mover = Mover(self.device, nvme_dir, self.counters)
        self.static_ptrs: set = set()
        self.pass_: _Pass | None = None
        self.n_passes = 0
        self._recomputing = False
        self.closed = False
        # compute event id -> [(kind, unit)] whose prefetch the plan issues at its start
        self.issue_map: dict[str, list[tuple[str, str]]] = {}
        for stream in (Stream.NVME, Stream.H2D):
            for e in plan.events(stream):
                if e.issue and e.op in ("read", "prefetch"):
                    kind = "ck" if e.id.startswith("ck") else "act"
                    self.issue_map.setdefault(e.issue, []).append((kind, e.units[0]))
        self.predicted_moved = {link: 0 for link in LINKS}
        op_link = {"offload": "d2h", "prefetch": "h2d", "write": "nvme_write", "read": "nvme_read"}
        for evs in plan.schedule.values():
            for e in evs:
                if e.op in op_link:
                    self.predicted_moved[op_link[e.op]] += e.bytes
        # step measurement
        self.step_open = False
        self.step_t0 = 0.0
        self.step_passes = 0
        self.step_base = None
        self.step_static = 0
        self.optimizers: "weakref.WeakSet" = weakref.WeakSet()
        self.param_ids = {id(p) for p in model.parameters()}
        self.hwm_ok = True
        self.trim = trim
        self.report = Report(
            plan_path=plan_path, policy=str(plan.policy), device=self.device.type,
            hardware=str(plan.hardware.get("name")), batch=int(plan.model.get("batch", 0)),
            seq=int(plan.model.get("seq", 0)), predicted=dict(plan.predicted),
            predicted_moved=self.predicted_moved)
        self.wrapped: list[tuple] = []

    # -- helpers the segments use
    def is_static(self, t: torch.Tensor) -> bool:
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

    def trigger(self, p: _Pass, event_id: str):
        """The compute event ``event_id`` starts: issue the prefetches the plan put there."""
        if self.closed:
            return
        for kind, name in self.issue_map.get(event_id, ()):
            g = p.groups.get((kind, name))
            if g is not None:
                g.prefetch()

    # -- wrappers
    def wrap(self):
        for i, b in enumerate(self.blocks):
            self._wrap(b, functools.partial(self._block_forward, i))
        self._wrap(self.model, self._model_forward)

    def _wrap(self, mod, fn):
        had = "forward" in mod.__dict__
        orig = mod.forward
        self.wrapped.append((mod, had, mod.__dict__.get("forward")))

        @functools.wraps(orig)
        def forward(*args, **kwargs):
            return fn(orig, *args, **kwargs)
        mod.forward = forward

    def unwrap(self):
        for mod, had, prev in reversed(self.wrapped):
            if had:
                mod.forward = prev
            else:
                del mod.forward
        self.wrapped = []

    def _model_forward(self, orig, *args, **kwargs):
        if self._recomputing or not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        self._check_input(args, kwargs)
        if not self.step_open:
            self._begin_step()
        self.step_passes += 1
        p = _Pass(self.n_passes)
        self.n_passes += 1
        if self.hooked:
            ptrs = {_storage_ptr(t) for t in self.model.parameters()}
            ptrs.update(_storage_ptr(t) for t in self.model.buffers())
            self.static_ptrs = ptrs
        self.pass_ = p
        self.trigger(p, "F:embedding")
        try:
            out = orig(*args, **kwargs)
        except BaseException:
            p.discard()   # an exception (or Ctrl-C) inside the forward: nothing is left behind
            raise
        finally:
            self.pass_ = None
            p.end_forward()
        if "B:head" in self.issue_map:
            # The head's backward is where backward starts: at the loss's node, or, for a loss
            # computed outside the model, when the first output's gradient is complete; both
            # run before any block's backward. The last block's output hook is the fallback
            # (an output that does not require grad).
            t = _Trigger(self, p, ("B:head",))
            for root in _backward_roots(out):
                root.grad_fn.register_prehook(t)
        return out

    def _check_input(self, args, kwargs):
        self.guard(args, kwargs)      # runtime/binding.py: every dimension of every input

    def _block_forward(self, i, orig, *args, **kwargs):
        p = self.pass_
        if p is None or self._recomputing or not torch.is_grad_enabled():
            return orig(*args, **kwargs)
        name = self.block_names[i]
        d = self.decisions[i]
        loc, hidden = _find_hidden(args, kwargs)
        if hidden is None:
            raise PlanMismatchError(f"block {name} was called without a tensor argument; tierplan "
                                    "needs the hidden state as its first tensor argument")
        if self.mover.cuda:
            self.mover.poll()
        self.trigger(p, "F:" + name)
        if i == 0 and hidden.requires_grad and "B:embedding" in self.issue_map:
            hidden.register_hook(_Trigger(self, p, ("B:embedding",)))

        act = d.activation
        if act is Activation.KEEP:
            # Nothing to do for the block itself: no saved-tensor hook (see _KeepCount).
            p.seg = None
            k = _KeepCount(self, self.keep_bytes[i])
            p.keeps.append(k)
            out = orig(*args, **kwargs)
            hid = _hidden_of(out)
            # Its saved tensors are freed by its backward, which has run once the gradient of
            # its input is complete; without an input gradient, count until its backward starts.
            anchor = hidden if hidden.requires_grad else hid
            if anchor.requires_grad:
                anchor.register_hook(k.release)
            else:
                k.release()
            return self._block_done(p, i, name, out, hid)

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
            g = self.mover.group(act.value, name)
            p.groups[("act", name)] = g
            h = _Offload(self, g, p)
            p.seg = None
        version = hidden._version
        try:
            with saved_tensors_hooks(h.pack, h.unpack):
                out = orig(*args, **kwargs)
        finally:
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
        return self._block_done(p, i, name, out, _hidden_of(out))

    def _block_done(self, p, i, name, out, hid):
        p.prev_out = hid
        last = i == len(self.blocks) - 1
        ids = tuple(e for e in (("B:head",) if last else ()) + ("B:" + name,)
                    if e in self.issue_map)
        if hid.requires_grad and ids:
            # For the last block, B:head here is only the fallback (see _model_forward): its
            # gradient is complete at the end of the head's backward, not at its start.
            hid.register_hook(_Trigger(self, p, ids))
        if last:
            # The head runs in the model's own code and its forward starts when the last
            # block's ends. Its backward is triggered by _model_forward's hook, not here: a
            # prefetch issued now would be allocated while the head builds its logits.
            self.trigger(p, "F:head")
        return out

    # -- steps
    def _static_bytes(self) -> int:
        seen, n = set(), 0

        def add(t):
            nonlocal n
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                n += st.nbytes()
        for prm in self.model.parameters():
            add(prm)
            if prm.grad is not None:
                add(prm.grad)
        for opt in list(self.optimizers):
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.device == self.device:
                        add(v)
        return n

    def _begin_step(self):
        self.step_static = self._static_bytes()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.step_base = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            if self.trim:
                malloc_trim()
            self.hwm_ok = reset_hwm() and self.hwm_ok
            self.step_base = read_status().get("VmRSS")
        self.counters.reset_step()
        self.step_passes = 0
        self.step_open = True
        self.step_t0 = time.perf_counter()

    def on_optimizer_step(self, opt, args, kwargs):
        if not self.step_open:
            return
        if opt not in self.optimizers:
            if not any(id(q) in self.param_ids for g in opt.param_groups for q in g["params"]):
                return
            self.optimizers.add(opt)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t1 = time.perf_counter()
        c = self.counters
        stall = c.stall_s
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
            self.mover.poll()
            for a, b in self.mover.stall_events:
                stall += a.elapsed_time(b) / 1e3
            self.mover.stall_events = []
        else:
            hwm = read_status().get("VmHWM")
            peak = hwm - self.step_base if hwm is not None and self.step_base is not None else None
        with c.lock:
            rec = StepRecord(step_s=t1 - self.step_t0, passes=self.step_passes,
                             peak_gpu_bytes=peak, peak_cpu_bytes=c.peak_host,
                             peak_nvme_bytes=c.peak_nvme, peak_activation_bytes=c.peak_act,
                             static_bytes=self.step_static, base_bytes=self.step_base,
                             moved=dict(c.moved), stall_s=stall)
        self.report.steps.append(rec)
        self.report.hwm_reset = self.hwm_ok
        self.step_open = False

    def close(self):
        self.closed = True
        if self.pass_ is not None:
            self.pass_.discard()
            self.pass_ = None
        self.mover.close()


# ----------------------------------------------------------------------------- public API

class Handle:
    """What ``apply_plan`` returns: ``report()`` and ``remove()``."""

    def __init__(self, runner: _Runner, hook):
        self._r = runner
        self._hook = hook
        self._removed = False

    @property
    def plan(self) -> Plan:
        return self._r.plan

    def report(self) -> Report:
        """Measured steps so far beside the plan's prediction."""
        return self._r.report

    def remove(self) -> None:
        """Undo everything: the model's and blocks' ``forward`` as they were, no hooks left, the
        offload files and the directories the runtime created deleted."""
        if self._removed:
            return
        self._removed = True
        self._hook.remove()
        self._r.unwrap()
        self._r.close()
        _ACTIVE.pop(self._r.model, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def apply_plan(model: torch.nn.Module, plan: Plan | str | Path, *,
               nvme_dir: str | Path | None = None, trim_heap: bool = False) -> Handle:
    """Make ``model`` train under ``plan``; return a handle with ``report()`` and ``remove()``.

    Raises ``PlanMismatchError`` (a ``ValueError``) when the plan is not for this model: its
    blocks (exact names), any unit's parameter names or shapes, or its identity hash differ
    (``runtime/binding.py``); ``UnsupportedModelError`` for torch.compile'd,
    DDP/FSDP-wrapped or self-checkpointing models. On a CPU device, ``trim_heap=True`` gives
    freed heap pages back to the kernel before each step; it cost 25-30% of a small model's step
    time here, so it is off by default. For memory figures that follow the live tensors, start
    the process with ``MALLOC_MMAP_THRESHOLD_=65536`` instead (docs/runtime.md); the report
    says when that is missing.
    """
    if model in _ACTIVE:
        raise PlanMismatchError("a plan is already applied to this model; call handle.remove() "
                                "first")
    _refuse_unsupported(model)
    plan_path = None
    if not isinstance(plan, Plan):
        plan_path = str(plan)
        plan = load_plan(plan)
    src = plan_path or "the plan"
    blocks = bind(model, plan, src)      # runtime/binding.py: exact names, shapes, identity
    for u, d in zip(plan.units, plan.layers):
        if u.kind != UnitKind.BLOCK.value and d.activation is not Activation.KEEP:
            raise PlanMismatchError(f"{src}: unit {u.name} ({u.kind}) must be 'keep' in this "
                                    "version; regenerate the plan")
    p0 = next(model.parameters(), None)
    dev = p0.device.type if p0 is not None else "cpu"
    plan_dev = plan.hardware.get("device")
    if plan_dev and plan_dev != dev:
        raise PlanMismatchError(f"{src} is for {plan_dev} hardware ({plan.hardware.get('name')}) "
                                f"but the model is on {dev}; solve with a {dev} hardware spec")
    prev = None
    nvme_needed = False
    for u, d in zip(plan.units, plan.layers):
        if d.activation is Activation.RECOMPUTE and d.checkpoint is Tier.NONE and (
                prev is None or prev.activation is not Activation.RECOMPUTE):
            raise PlanMismatchError(f"{src}: {u.name} has checkpoint 'none' but does not follow "
                                    "a recompute unit; regenerate the plan")
        if d.activation is Activation.RECOMPUTE and d.checkpoint is Tier.NONE and \
                u.name in (plan.model.get("chain_breaks") or ()):
            raise PlanMismatchError(f"{src}: {u.name} has checkpoint 'none' but its input is not "
                                    "the previous block's output (another stack starts there), "
                                    "so it cannot be recomputed from it; re-plan with a "
                                    f"checkpoint tier for {u.name}")
        if d.activation is Activation.NVME or d.checkpoint is Tier.NVME:
            nvme_needed = True
        if (d.activation is Activation.CPU or d.checkpoint is Tier.CPU) and dev != "cuda":
            raise PlanMismatchError(f"{src}: {u.name} offloads to host memory, which needs a CUDA "
                                    "device; use a cpu-host plan (nvme) on a CPU")
        prev = d
    nvme = str(nvme_dir) if nvme_dir is not None else plan.nvme_dir
    if nvme_needed and not nvme:
        raise PlanMismatchError(f"{src} offloads to nvme but names no directory; pass "
                                "apply_plan(..., nvme_dir=DIR) or solve with --nvme-dir DIR")
    runner = _Runner(model, plan, plan_path, blocks, nvme, trim_heap)
    runner.wrap()
    hook = register_optimizer_step_post_hook(runner.on_optimizer_step)
    handle = Handle(runner, hook)
    _ACTIVE[model] = handle
    return handle
