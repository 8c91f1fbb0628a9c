"""The optimizer beside the backward: executing plans with ``optimizer_overlap: overlapped``.

A plan solved with ``--optimizer-overlap auto`` is labelled ``overlapped`` where the planner
found it faster for a unit's optimizer work to start once that unit's gradient of the step's
last micro-batch is complete, beside the backward of the units before it (docs/formulation.md,
"The optimizer beside the backward"). This module is the runtime's scheduler for it; the step
of one unit is ``streaming.OptimizerPhase.step_unit``, the same code the step after the
backward runs, so the bits are the same.

- The runtime counts the step's micro-batches (``plan.micro_batches``, K). In the K-th pass
  (layer-major: the ``run_micro_batches`` call that brings the step to K micro-batches, one
  pass of the stages whose backward stages run every micro-batch; ``pass_starts`` is told the
  last of them), a unit whose gradients live off the device (``UnitStatic.grads_out``) is
  complete when the last share its stage actions sent has been added into its home and the
  training thread has waited for it (``UnitStatic.wait`` calls ``on_grads_home`` then). Its
  work is then handed to one worker thread while the backward goes on.
- ``clip none``: the work is the unit's whole step, with the user's hyper-parameters as they
  are at that moment (a scheduler's change after the previous ``opt.step()`` is seen).
  ``opt.step()`` waits for those steps, steps what remains (units whose gradients stay on the
  device, by the plan's own path, and device-homed parameters by the user's optimizer) and
  returns. A hyper-parameter changed between that backward and ``opt.step()`` cannot reach
  steps that ran already: ``opt.step()`` refuses in one line (the step is then incomplete).
  A scale of a gradient off the device (``torch.nn.utils.clip_grad_norm_``,
  ``handle.clip_grad_norm_``) is refused in one line naming ``--clip global``.
- ``clip global``: no update may run before the user's clip, so the work is the state reads
  only (``UnitStatic.read_ahead``), up to ``plan.optimizer_prefetch_bytes`` a step in all;
  the step itself runs at ``opt.step()``, after the clip, reading its state from what was
  read ahead.
- The order of the units' steps does not change the bits: each unit's step reads and writes
  only that unit's parameters, gradients and state. The units stepped beside the backward are
  past their last stage action of the pass (their weights were released at the stage after
  their backward, and their gradients have left), so the training thread does not touch them
  until ``opt.step()``; anything else that reads a unit (a no-grad forward, a state dict,
  ``zero_grad``, ``handle.gradients()``, ``remove``) waits for the worker first.
- ``paced`` (``clip none``, one pass per step): the same jobs, started as each unit's backward
  ends, and three more rules (docs/formulation.md, "The optimizer paced into the backward";
  docs/runtime.md, "Paced plans"). The backward waits for them: the plan prices unit j's
  read, update and write in the three stages after its backward, so stage bwd(j) + 3 does not
  begin before j's update has run (and freed its gradient, as the plan's memory has it), nor
  bwd(j) + 4 before j's job has ended (``stage_begins``; the seconds join the driver's wait,
  the unit's ``stall_s``). The read is issued on the unit's I/O thread as the job is handed over,
  beside the update of the unit before. And the gradient is freed by its update: right after
  it, the job replaces each device ``.grad`` with a ``SteppedGrad`` (no storage, the 2-norm
  kept), which a clip that does not clip and the loop's ``zero_grad`` after ``opt.step()``
  accept and anything else refuses in one line; at the next step's first forward a zeroed one
  becomes ``None`` (and zeros again before its step where that backward gave no gradient), an
  unzeroed one is refused; ``remove`` leaves zeros for a zeroed one, ``None`` for the others.
- Faults: an exception in a job is kept and raised, as the original exception, by the next
  ``opt.step()`` (or by ``remove``, where no step came). The worker thread exists only while
  it has work: it ends when its queue is empty, so no thread outlives a step, an exception in
  the loop, or ``remove``.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures

import torch
from torch.utils._pytree import tree_flatten

from planner.formats import UserError

from .streaming import is_one, zero_each

WORKER_THREAD = "tierplan-optimizer"

CLIP_REFUSAL = ("this plan was solved with --clip none, so each unit's optimizer step runs "
                "during the backward, before a clip could scale its gradient; re-solve with "
                "--clip global to clip (torch.nn.utils.clip_grad_norm_ or "
                "handle.clip_grad_norm_)")


PACED_WAIT = 3          # unit j's job ends before stage bwd(j) + 1 + PACED_WAIT begins


class SteppedGrad(torch.Tensor):
    """A parameter's ``.grad`` after a paced plan's step consumed it during the backward: same
    shape, dtype and device, no storage, and the gradient's 2-norm as it was stepped. Zeroing
    it (``zero_``, ``_foreach_zero_``: what ``zero_grad(set_to_none=False)`` does) is recorded;
    its 2-norm is the recorded one and a scale by exactly 1 changes nothing, so a clip that
    does not clip (the Hugging Face Trainer's logged norm: ``clip_grad_norm_(..., inf)``; a
    total norm under ``max_norm``) runs as on the gradient; its aliases are the same
    placeholder. Anything else is refused in one line: a scale by another factor (the clip
    would have changed an update that already ran) names ``--clip global``."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, unit: str, norm: torch.Tensor,
                mark: dict | None = None):
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype,
                                                device=like.device, requires_grad=False)
        t.unit = unit
        t.norm2 = norm
        t.mark = mark if mark is not None else {"zeroed": False}
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        first = args[0] if args else None
        many = isinstance(first, (list, tuple))
        ts = list(first) if many else [first]
        if name in ("zero_", "_foreach_zero_"):
            return zero_each(first, SteppedGrad, _zeroed)
        if isinstance(first, SteppedGrad) and name in ("detach", "alias"):
            return SteppedGrad(first, first.unit, first.norm2, first.mark)
        if name in ("linalg_vector_norm", "_foreach_norm") and _l2(args[1:], kwargs):
            out = [(torch.zeros_like(t.norm2) if t.mark["zeroed"] else t.norm2.clone())
                   if isinstance(t, SteppedGrad) else torch.linalg.vector_norm(t) for t in ts]
            return out if many else out[0]
        if name in ("mul_", "_foreach_mul_") and len(args) == 2 and not kwargs:
            fs = args[1] if isinstance(args[1], (list, tuple)) else [args[1]] * len(ts)
            if all(is_one(f) or (isinstance(t, SteppedGrad) and t.mark["zeroed"])
                   for t, f in zip(ts, fs)):
                for t, f in zip(ts, fs):
                    if not isinstance(t, SteppedGrad):
                        t.mul_(f)
                return None if many else first
        unit = next(t.unit for t in tree_flatten((args, kwargs))[0]
                    if isinstance(t, SteppedGrad))
        if name in ("linalg_vector_norm", "_foreach_norm", "norm", "mul_", "_foreach_mul_",
                    "div_", "_foreach_div_", "clamp_", "_foreach_clamp_max_"):
            raise UserError(f"the gradients of {unit} were used by its optimizer step during "
                            f"the backward (optimizer_overlap 'paced'), so {name} cannot "
                            f"clip or scale them; {CLIP_REFUSAL}")
        raise SteppedGrad.refusal(unit, name)

    def __repr__(self):
        return (f"SteppedGrad(unit={self.unit!r}, shape={tuple(self.shape)}, "
                f"norm={0.0 if self.mark['zeroed'] else float(self.norm2):.6g}, "
                f"zeroed={self.mark['zeroed']})")

    @staticmethod
    def refusal(unit: str, what: str) -> UserError:
        return UserError(f"the gradients of {unit} were used by its optimizer step during the "
                         f"backward and freed (optimizer_overlap 'paced'), so {what} cannot "
                         "read or change them; read gradients before the step (a hook on the "
                         "parameter), or re-solve with --optimizer-overlap on to keep them "
                         "until opt.step()")


def _zeroed(t: "SteppedGrad") -> None:
    """A stand-in zeroed: after ``opt.step()`` (its step collected) that is the loop's usual
    ``zero_grad``; before it, plain PyTorch's step would have used zeros, but this one ran."""
    if not t.mark.get("collected"):
        raise UserError(f"the gradients of {t.unit} were used by its optimizer step during the "
                        "backward (optimizer_overlap 'paced'), so zeroing them before "
                        "opt.step() cannot change that step; zero gradients after opt.step(), "
                        "or re-solve with --optimizer-overlap on (or off)")
    t.mark["zeroed"] = True


def _l2(rest, kwargs) -> bool:
    """``linalg_vector_norm(t, *rest, **kwargs)`` / ``_foreach_norm`` asks for the plain 2-norm."""
    ord_ = rest[0] if rest else kwargs.get("ord", 2)
    extra = [a for a in rest[1:] if a not in (None, False)]
    return (ord_ in (2, 2.0) and not extra
            and all(v in (None, False) for k, v in kwargs.items() if k != "ord"))


class _Worker:
    """Jobs run one after the other on a thread that exists only while there are jobs."""

    def __init__(self):
        self.lock = threading.Lock()
        self.queue: deque = deque()
        self.thread: threading.Thread | None = None
        self.last: threading.Thread | None = None

    def submit(self, fn) -> Future:
        fut: Future = Future()
        with self.lock:
            self.queue.append((fn, fut))
            if self.thread is None:
                self.thread = self.last = threading.Thread(target=self._run, name=WORKER_THREAD,
                                                           daemon=True)
                self.thread.start()
        return fut

    def _run(self) -> None:
        while True:
            with self.lock:
                if not self.queue:
                    self.thread = None
                    return
                fn, fut = self.queue.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # noqa: BLE001 -- kept for opt.step() to raise
                fut.set_exception(e)

    def join(self) -> None:
        """Until every job submitted so far has run and the thread has ended."""
        while True:
            with self.lock:
                t = self.last
            if t is None:
                return
            t.join()
            with self.lock:
                if self.last is t and self.thread is None:
                    self.last = None
                    return


def _snapshot(hyper: dict) -> dict:
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in hyper.items()}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.shape == b.shape and bool(torch.equal(a, b)))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 -- a value that does not compare: taken as changed
        return a is b


class _Job:
    __slots__ = ("unit", "kind", "future", "hypers", "t_submit", "t_start", "t_end", "grads",
                 "due", "read", "freed", "t_freed", "gate", "t_update")

    def __init__(self, unit, kind, hypers, paced=False, due=None):
        self.unit, self.kind, self.hypers, self.due = unit, kind, hypers, due
        self.future = None
        self.read = None             # paced: the unit's state read, issued at the job's stage
        # gradients kept on the device: each with its version and 2-norm as the step took it
        # (set by the job: a clip or scale in the loop after that changes them, and is refused
        # at opt.step(); a scale by 1 moves the version only); paced: none kept (the step
        # frees them, and what is left refuses a clip itself)
        self.grads = [] if unit.grads_out or paced else [
            (n, p.grad) for n, p in unit.params if p.grad is not None]
        self.t_submit = time.perf_counter()
        self.t_start = self.t_end = self.t_freed = self.t_update = None
        # paced: set once the update has run and freed the gradients (or the job ended)
        self.freed = threading.Event()
        # paced: set once the update's stage (due - 2) has begun; the update waits for it
        self.gate = threading.Event()
        if not paced:
            self.gate.set()


class OverlapScheduler:
    """Hands units' optimizer work to the worker during the last micro-batch's backward and
    gathers it at ``opt.step()``. ``phase``: the handle's ``OptimizerPhase``."""

    def __init__(self, phase, plan):
        self.phase = phase
        self.clip = plan.clip
        self.family = plan.optimizer_overlap            # overlapped or paced
        self.paced = self.family == "paced"
        self.consumed: list = []                        # (param, SteppedGrad) of paced steps
        self.settled: list = []                         # ... of steps opt.step() gathered
        self.zeroed: set = set()                        # ids of params zeroed in place
        # unit name -> its backward stage, 2U - i (the plan's numbering, docs/runtime.md)
        U = len(plan.units)
        self.bwd = {u.name: 2 * U - i for i, u in enumerate(plan.units)}
        self.K = int(plan.micro_batches)
        self.budget = int(plan.optimizer_prefetch_bytes)
        self.subs = {id(u): subs for u, subs in phase.subs}
        self.worker = _Worker()
        self.jobs: list[_Job] = []
        self.pending_error: BaseException | None = None
        self.armed = False
        self.ahead_left = 0
        self.backward_end: float | None = None
        self.stage_t: dict = {}                         # paced: stage -> when its waits ended
        # per step gathered: (unit, kind, started before the last backward ended, seconds)
        self.last_log: list = []
        for u, _ in phase.subs:
            u.on_grads_home = self._grads_home
            if self.clip == "none":
                u.scale_refusal = CLIP_REFUSAL

    # -- the training thread's events ---------------------------------------------------------
    def pass_starts(self, n: int) -> None:
        """Forward pass ``n`` of the step (with gradients) begins."""
        if n > self.K and self.stepped() and self.backward_end is None:
            # the step's last backward stopped (an exception, Ctrl-C) after units were handed
            # over: their updates ran with its gradients, and a loop that skips the batch
            # would leave them in
            done = sum(j.kind == "step" for j in self.jobs)
            raise UserError(f"the last backward stopped after {done} unit(s) had been stepped "
                            f"beside it with its gradients (optimizer_overlap "
                            f"'{self.family}'), which cannot be undone, and a forward pass {n} "
                            "began before opt.step(); call opt.step() to finish that step, or "
                            "re-solve with --optimizer-overlap off to be able to skip a "
                            "failed batch")
        if n > self.K and self.stepped():
            # (state read ahead under clip global stays valid: nothing was updated)
            raise UserError(f"this plan (optimizer_overlap '{self.family}') steps each unit "
                            f"during the backward of micro-batch {self.K} of a step, but a "
                            f"forward pass {n} began before opt.step(); call opt.step() every "
                            f"{self.K} micro-batches, or re-solve with "
                            + (f"--micro-batches {n} and --optimizer-overlap on (paced runs "
                               "one pass a step)" if self.paced else f"--micro-batches {n} or "
                               "with --optimizer-overlap off"))
        self.armed = n == self.K
        self.stage_t = {}
        if self.armed:
            self.ahead_left = self.budget
            self.backward_end = None

    def backward_ended(self) -> None:
        self._open_gates()              # the updates due after the last stage: the phase's
        if self.armed and self.backward_end is None:
            self.backward_end = time.perf_counter()

    def _open_gates(self) -> None:
        for j in self.jobs:
            j.gate.set()

    def busy(self) -> bool:
        return bool(self.jobs)

    def stepped(self) -> bool:
        """Whether some unit was handed over for its step since the last ``opt.step()``."""
        return any(j.kind == "step" for j in self.jobs)

    def stage_begins(self, stage: int) -> float:
        """The backward reaches ``stage`` (training thread). Paced: wait for the jobs due by
        then, and for the updates of the jobs due at the next stage (the plan frees a unit's
        gradient with its update, in the stage before its write's); then let the updates the
        plan puts in this stage run (``_Job.gate``). The seconds waited."""
        if not self.paced:
            return 0.0
        due = [j for j in self.jobs if j.due <= stage]
        updating = [j for j in self.jobs if j.due == stage + 1]
        if due or updating:
            # what the worker runs first runs first: every job queued up to the last one
            # waited for may update (opened already, unless a stage was skipped)
            last = max(self.jobs.index(j) for j in due + updating)
            for j in self.jobs[:last + 1]:
                j.gate.set()
        t0 = time.perf_counter()
        for j in updating:
            j.freed.wait()
        wait_futures([j.future for j in due])   # an error stays in its future, for opt.step()
        waited = time.perf_counter() - t0 if (due or updating) else 0.0
        self.stage_t[stage] = time.perf_counter()
        for j in self.jobs:
            if j.due - 2 <= stage:
                j.gate.set()
        return waited

    def new_step(self) -> None:
        """A step's first forward (training thread): the gradients paced steps consumed are
        zeroed (then ``None``: the next backward makes them afresh, the same values as added
        into zeros) or refused."""
        consumed, self.settled = self.settled, []
        left = sorted({g.unit for p, g in consumed if p.grad is g and not g.mark["zeroed"]})
        if left:
            self.settled = consumed
            raise UserError(f"the gradients of {', '.join(left)} were used by their optimizer "
                            "step during the last backward and freed (optimizer_overlap "
                            "'paced'), but not zeroed before this forward, so they cannot be "
                            "accumulated into; call opt.zero_grad() or model.zero_grad() after "
                            "opt.step(), or re-solve with --optimizer-overlap on (or off)")
        # zeroed in place: plain PyTorch keeps zeros, which the step still applies (weight
        # decay, momentum) where the next backward gives the parameter no gradient
        self.zeroed = {id(p) for p, g in consumed if p.grad is g}
        for p, g in consumed:
            if p.grad is g:
                p.grad = None

    def _grads_home(self, u) -> None:
        """Unit ``u``'s gradients have all arrived home (training thread)."""
        if not self.armed or any(j.unit is u for j in self.jobs) or id(u) not in self.subs:
            return
        subs = self.subs[id(u)]
        # the training thread's compute stream, made the worker's own while the job runs: on
        # the staged path (a CUDA device) a step's waits and records for "the compute stream"
        # (``StagedUnit._up``, the norms' copies) are then on the stream the backward uses,
        # not on the worker thread's default one
        ctx = u.be.compute_context()
        if self.clip == "none":
            job = _Job(u, "step", {gi: _snapshot(self.phase.hyper(gi)) for _, gi in subs},
                       paced=self.paced,
                       due=self.bwd[u.name] + 1 + PACED_WAIT if self.paced else None)
            if self.paced and (job.due - 2 <= max(self.stage_t, default=-1)
                               or self.backward_end is not None):
                job.gate.set()          # (after the backward's end no stage opens it)
            if self.paced and u.state_out:
                # the plan's read part, in this stage: the state from its file on the I/O
                # thread now, beside the update the worker may still be running for the unit
                # before (the step takes it from there, ``read_ahead``)
                job.read = u.store_of().submit(u.read_ahead, u.state_regions())
            job.future = self.worker.submit(lambda j=job: self._run(j, self._step, ctx))
        else:
            if not u.state_out:
                return
            regions, n = [], 0
            for off, size in u.state_regions():
                if n + size <= self.ahead_left:
                    regions.append((off, size))
                    n += size
            if not regions:
                return
            self.ahead_left -= n
            job = _Job(u, "read", regions)
            job.future = self.worker.submit(lambda j=job: self._run(j, self._read, ctx))
        self.jobs.append(job)

    # -- the worker's jobs -------------------------------------------------------------------
    def _run(self, job: _Job, fn, ctx) -> None:
        job.t_start = time.perf_counter()
        try:
            with ctx():
                fn(job)
        finally:
            job.t_end = time.perf_counter()
            job.freed.set()             # (an update that failed frees nothing: no wait on it)

    def _step(self, job: _Job) -> None:
        u = job.unit
        kept = []
        if self.paced:
            for _, p in u.params:
                if p.grad is None and id(p) in self.zeroed:
                    p.grad = torch.zeros_like(p)         # what zero_grad left in plain PyTorch
            # each gradient kept on the device: its version and 2-norm as the step takes it
            kept = [(n, p, p.grad, p.grad._version, torch.linalg.vector_norm(p.grad))
                    for n, p in u.params if type(p.grad) is torch.Tensor]
        else:
            job.grads = [(n, g, g._version, torch.linalg.vector_norm(g)) for n, g in job.grads]
        if job.read is not None:
            job.read.result()
        if not job.gate.is_set():
            # paced: the update is the plan's in stage bwd + 2 (its workspace is allocated
            # there, ``MemoryRules._paced_memory``); run in the read's stage it held its
            # workspace beside what that stage holds. What it reads is read now, in the read's
            # stage: the state (``job.read``) and streamed weights
            fetch = None
            if not getattr(u, "steps_on_host", False) and u.weights_out and not u.in_use:
                fetch = u.fetch_weights(0.0, 1.0, own=True)
            job.gate.wait()
            if fetch is not None:
                fetch.result()          # (an error is the job's, for opt.step())
        job.t_update = time.perf_counter()
        if not kept:
            # (paced: a unit without a gradient on the device frees nothing, but its update's
            # end still lets stage bwd + 3 begin)
            more = {"updated": job.freed.set} if self.paced else {}
            self.phase.step_unit(u, self.subs[id(u)], job.hypers, **more)
            return
        changed: list = []

        def updated():
            changed.extend(self._free(u, kept))
            job.t_freed = time.perf_counter()
            job.freed.set()              # the stage before the write's may begin
        self.phase.step_unit(u, self.subs[id(u)], job.hypers, updated=updated)
        if changed:
            raise UserError(f"the gradient of {changed[0]!r} changed while its unit's optimizer "
                            "step ran during the backward (optimizer_overlap 'paced'), so the "
                            "step used it unchanged; to clip, re-solve with --clip global; "
                            "for other changes use a hook before the step, or re-solve with "
                            "--optimizer-overlap on (or off)")

    def _free(self, u, kept: list) -> list:
        """Paced: the update has run, and the plan frees the gradient with it. The training
        thread is past this unit's backward (its weights released, nothing tied to it), so
        nothing else holds or accumulates into these gradients until opt.step(). The names of
        those the loop replaced or changed in place while the update read them (an error)."""
        # (a scale by exactly 1, torch's clip under its max_norm, bumps the version and
        # changes nothing: the norm tells the two apart)
        changed = [n for n, p, g, ver, norm in kept if p.grad is not g or (
            g._version != ver and not torch.equal(torch.linalg.vector_norm(g), norm))]
        for _, p, g, _, norm in kept:
            if p.grad is g:
                stub = SteppedGrad(g, u.name, norm)
                p.grad = stub
                self.consumed.append((p, stub))
        return changed

    def _read(self, job: _Job) -> None:
        u = job.unit
        u.store_of().submit(u.read_ahead, job.hypers).result()

    # -- opt.step() --------------------------------------------------------------------------
    def quiesce(self) -> None:
        """Wait until the worker is idle (its errors are kept for ``opt.step()``)."""
        if self.jobs:
            self._open_gates()
            self.worker.join()

    def _drain(self) -> tuple[list, BaseException | None]:
        """Disarm, wait for the worker; the jobs it ran and the first error of them (or the one
        kept from before)."""
        self.armed = False
        self._open_gates()
        jobs, self.jobs = self.jobs, []
        self.worker.join()
        err, self.pending_error = self.pending_error, None
        for j in jobs:
            e = j.future.exception()
            if e is not None and err is None:
                err = e
        return jobs, err

    def collect(self) -> set:
        """At ``opt.step()``: wait for the jobs, raise the first one's error as it was, check
        the hyper-parameters the steps used; the units already stepped."""
        jobs, err = self._drain()
        stubs, self.consumed = self.consumed, []
        for _, g in stubs:
            g.mark["collected"] = True           # zeroing them is the loop's zero_grad now
        self.settled += stubs
        end = self.backward_end if self.backward_end is not None else float("inf")
        self.last_log = [(j.unit.name, j.kind, j.t_start is not None and j.t_start < end,
                          (j.t_end or 0.0) - (j.t_start or 0.0)) for j in jobs]
        if err is not None:
            for j in jobs:
                j.unit.drop_ahead()
            raise err
        dropped = sorted({g.unit for p, g in stubs if p.grad is not g})
        if dropped:
            raise UserError(f"the gradients of {', '.join(dropped)} were replaced or set to None "
                            "after their optimizer step ran during the backward "
                            "(optimizer_overlap 'paced'), which cannot change that step; "
                            "change gradients in a hook before the step, or re-solve with "
                            "--optimizer-overlap on (or off)")
        done = set()
        for j in jobs:
            if j.kind != "step":
                continue
            done.add(j.unit)
            for n, g, ver, norm in j.grads:
                if g._version != ver and not torch.equal(torch.linalg.vector_norm(g), norm):
                    raise UserError(f"the gradient of {n!r} changed after its unit's backward "
                                    f"(a clip or scale in the loop?); {CLIP_REFUSAL}")
            for gi, h in j.hypers.items():
                now = self.phase.hyper(gi)
                for key in sorted(set(h) | set(now), key=str):
                    if not _same(h.get(key), now.get(key)):
                        stepped = sum(x.kind == "step" for x in jobs)
                        raise UserError(
                            f"the optimizer's {key!r} of param group {gi} changed between the "
                            f"last backward and opt.step() ({h.get(key)!r} -> "
                            f"{now.get(key)!r}), but under this plan (optimizer_overlap "
                            f"'{self.family}', clip 'none') {stepped} unit(s) were stepped during "
                            "that backward with the old value, so this step is left "
                            "incomplete; change hyper-parameters after opt.step() "
                            "(scheduler.step() after it), or re-solve with "
                            "--optimizer-overlap off")
        return done

    def overlapped(self) -> int:
        """Units whose work of the last gathered step started before its backward ended."""
        return sum(1 for _, _, early, _ in self.last_log if early)

    def close(self) -> BaseException | None:
        """Wait for the worker, unhook the units; the error no ``opt.step()`` raised."""
        jobs, err = self._drain()
        for j in jobs:
            j.unit.drop_ahead()
        for p, g in self.settled + self.consumed:   # a plain model's: zeros where zeroed
            if p.grad is g:
                p.grad = torch.zeros_like(p) if g.mark["zeroed"] else None
        self.settled, self.consumed = [], []
        for u, _ in self.phase.subs:
            u.on_grads_home = None
            u.scale_refusal = None
        return err
