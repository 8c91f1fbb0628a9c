"""Layer-major micro-batches: every micro-batch of a step through a unit before the next unit,
forward and backward (``micro_batch_order: layer-major``; ``Handle.run_micro_batches``).

An ordinary loop cannot run in this order (a micro-batch's loss exists only after its whole
forward), so the handle runs the K micro-batches itself:

- **Forward.** One thread per micro-batch runs the user's ``loss_fn(model, mb)``. Only one
  thread runs at a time: each waits for its turn at every unit it reaches, and turns go
  (unit 0, mb 1), (unit 0, mb 2), ..., (unit 1, mb 1), ... (``_Turns``). A thread keeps its turn
  from the start of its unit to the start of its next one, so the code between blocks runs in
  the turn of the block before it. The first turn of each unit starts the unit's stage in the
  stage driver (its weights come, the previous unit's go), so a streamed unit's weights are
  on the device once for all K micro-batches. Grad mode and autocast are carried into the
  threads; each micro-batch has its own pass (offload groups, segments).
- **Cuts.** Each block's hidden-state input is replaced by a detached leaf of the same values
  (and the last block's hidden output, when the plan has a head unit), so each micro-batch's
  graph is cut into pieces: the stem, one per block (with the code after it), the head.
- **Backward.** Piece by piece from the top, micro-batch 1..K within each unit's stage:
  ``torch.autograd.backward(root, leaf_above.grad)``. A piece's graph ends at its leaf, so it
  runs only that piece and accumulates its parameters' gradients in micro-batch order, which
  is the plain loop's order. A parameter that two pieces of one micro-batch read (tied
  embedding and head weights) gets its parts from each piece apart and, when the lowest piece
  has run, their sum added to ``.grad``: the plain loop's ``acc + (head part + stem part)``.
- **The optimizer beside the backward** (``overlapped``, ``paced``): the run tells the
  overlapped scheduler that its micro-batches are passes ``n+1 .. n+K`` of the step before any
  starts; the run that reaches the plan's K arms it, and the stage driver's hooks hand each
  unit over once its backward stage has run every micro-batch (runtime/overlap.py).
- **Refused.** A piece whose graph reaches another piece's other than through the cut (an
  encoder's output read by every decoder block, a skip connection around a block) is refused
  in one line after the forward, before any gradient is taken.

The micro-batch threads are the runner's own and live as long as the handle (``Workers``): a
library's per-thread state (MKL keeps each thread's GEMM packing buffers, about half a GEMM's
weight bytes: 1.1 MiB for a 2048-wide head of d = 256) is made in the first step and kept, as
the caller's own thread keeps it under a batch-major plan. Fresh threads each step made it
again inside every step's forward, beside the K micro-batches', where no plan counts it
(measured on the built-in LLaMA's layer-major forward: up to 1.3 MiB from blocks.0 on, 2.7 at
the head; docs/benchmarks.md).

Random draws (dropout) happen in the turn order, not the plain loop's: the run is
deterministic, but its masks are not the plain loop's (docs/runtime.md).
"""
from __future__ import annotations

import contextlib
import math
import queue
import threading
import weakref

import torch

from planner.formats import UserError

from .binding import PlanMismatchError
from .transfer import backend_for

API = "handle.run_micro_batches(batches, loss_fn)"


class Workers:
    """The runner's micro-batch threads (``tierplan-mb1`` ..), started on first use and kept
    until ``close``: ``run(fn, K, abort)`` calls ``fn(k)`` on thread k for k < K and waits
    for all."""

    def __init__(self):
        self.threads: list = []
        self.queues: list = []

    def _loop(self, q) -> None:
        while True:
            job = q.get()
            if job is None:
                return
            fn, k, done = job
            job = None
            try:
                fn(k)
            finally:
                fn = None                # hold nothing of the run until the next one
                done.release()
                done = None

    def run(self, fn, K: int, abort) -> None:
        """``fn(k)`` on threads 0..K-1, until every call has returned. An exception in the
        caller's wait (Ctrl-C) calls ``abort()``, still waits for every call, and is raised."""
        while len(self.threads) < K:
            q = queue.SimpleQueue()
            t = threading.Thread(target=self._loop, args=(q,), daemon=True,
                                 name=f"tierplan-mb{len(self.threads) + 1}")
            t.start()
            self.threads.append(t)
            self.queues.append(q)
        done = threading.Semaphore(0)
        for k in range(K):
            self.queues[k].put((fn, k, done))
        left = K
        try:
            while left:
                done.acquire()
                left -= 1
        except BaseException:
            abort()
            for _ in range(left):
                done.acquire()
            raise

    def stop(self) -> None:
        """Let the threads end (each once its queue reaches the stop), not waiting for them."""
        for q in self.queues:
            q.put(None)

    def close(self) -> None:
        self.stop()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join()
        self.threads, self.queues = [], []


class _Aborted(BaseException):
    """Another micro-batch's thread failed: this one stops at its next turn."""


class _Turns:
    """One thread runs at a time: the one whose (unit, micro-batch) position is the smallest."""

    def __init__(self, K: int, first: int):
        self.cv = threading.Condition()
        self.pos = [(first, k) for k in range(K)]
        self.aborted = False

    def advance(self, k: int, slot: int) -> None:
        with self.cv:
            self.pos[k] = (slot, k)
            self.cv.notify_all()
            while not self.aborted and min(self.pos) != self.pos[k]:
                self.cv.wait()
            if self.aborted:
                raise _Aborted()

    def done(self, k: int) -> None:
        with self.cv:
            self.pos[k] = (math.inf, k)
            self.cv.notify_all()

    def abort(self) -> None:
        with self.cv:
            self.aborted = True
            self.cv.notify_all()


def _tls_state(device):
    """Thread-local settings a micro-batch's thread takes from the caller's: autocast, and the
    caller's compute stream (``Backend.compute_context``). Not carried: the caller's own
    saved-tensor hooks and torch function/dispatch modes (docs/runtime.md)."""
    ac = []
    for dev in ("cpu", "cuda"):
        if torch.is_autocast_enabled(dev):
            ac.append((dev, torch.get_autocast_dtype(dev)))
    return ac, torch.is_autocast_cache_enabled(), backend_for(device).compute_context()


def _nodes(fn):
    """Every node of the autograd graph below ``fn``, once each; a leaf's ``AccumulateGrad``
    is yielded and not gone below."""
    stack, seen = [fn], set()
    while stack:
        f = stack.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        yield f
        if type(f).__name__ != "AccumulateGrad":
            stack.extend(nf for nf, _ in f.next_functions)


def _of_parameters(fn, param_ids: set) -> bool:
    """Whether the graph below ``fn`` reaches no leaf but the model's parameters."""
    return all(id(f.variable) in param_ids for f in _nodes(fn)
               if type(f).__name__ == "AccumulateGrad")


def _replace_hidden_out(out, leaf):
    if isinstance(out, torch.Tensor):
        return leaf
    if isinstance(out, (tuple, list)):
        items = list(out)
        for j, t in enumerate(items):
            if isinstance(t, torch.Tensor):
                items[j] = leaf
                return type(out)(items) if isinstance(out, list) else tuple(items)
    raise PlanMismatchError(f"the last block returned {type(out).__name__}; a layer-major plan "
                            "needs a tensor or a tuple whose first tensor is the hidden state; "
                            "solve with --micro-batch-order batch-major")


class Run:
    """One call of ``run_micro_batches`` under a layer-major plan."""

    def __init__(self, runner, batches, loss_fn):
        self.r = runner
        self.batches = batches
        self.loss_fn = loss_fn
        self.K = len(batches)
        U = runner.U
        units = runner.plan.units
        self.has_stem = units[0].kind != "block"
        self.has_head = units[-1].kind != "block"
        self.first = 0 if self.has_stem else -1
        self.turns = _Turns(self.K, self.first)
        self.slot = [self.first] * self.K
        self.entered = None              # the last forward slot whose stage was entered
        self.passes: list = [None] * self.K
        self.cut_in = [[] for _ in range(self.K)]   # per mb: (unit index, original, leaf)
        self.cut_out: list = [None] * self.K        # per mb: (original, leaf)
        self.losses: list = [None] * self.K
        self.errors: list = [None] * self.K
        self.U = U

    # -- forward, on the micro-batches' threads -----------------------------------------------
    def turn(self, k: int, slot: int, name: str) -> None:
        if slot <= self.slot[k]:
            raise PlanMismatchError(f"block {name} ran out of the plan's unit order under a "
                                    "layer-major plan (a block called twice, or blocks in "
                                    "another order); solve with --micro-batch-order batch-major")
        self.turns.advance(k, slot)
        self.slot[k] = slot
        self._enter(slot)

    def _enter(self, slot: int) -> None:
        if self.entered is None or slot > self.entered:
            self.entered = slot
            self.r.driver.enter(1 + max(slot, 0))

    def cut_input(self, k: int, ui: int, name: str, hidden: torch.Tensor):
        """The block's input as a leaf of the same values (the piece below ends there)."""
        leaf = hidden.detach().requires_grad_(hidden.requires_grad)
        self.cut_in[k].append((ui, hidden, leaf))
        if leaf.requires_grad and name in (self.r.plan.model.get("inplace_input") or ()):
            return leaf, leaf.clone()        # a leaf may not be written in place
        return leaf, leaf

    def after_last(self, k: int, out, hid: torch.Tensor):
        """The last block returned: cut its hidden output and start the head's turn."""
        if not self.has_head:
            return out
        if hid.requires_grad:
            leaf = hid.detach().requires_grad_(True)
            self.cut_out[k] = (hid, leaf)
            out = _replace_hidden_out(out, leaf)
        self.turn(k, self.U - 1, "head")
        return out

    def _worker(self, k: int, state) -> None:
        r = self.r
        ac, ac_cache, compute = state
        r._tls.run, r._tls.k, r._tls.pass_ = self, k, None
        try:
            with contextlib.ExitStack() as st:
                st.enter_context(compute())
                st.enter_context(torch.enable_grad())
                for dev, dtype in ac:
                    st.enter_context(torch.autocast(dev, dtype=dtype, cache_enabled=ac_cache))
                self.turns.advance(k, self.first)
                self._enter(self.first)
                loss = self.loss_fn(r.model, self.batches[k])
            if self.passes[k] is None:
                raise UserError(f"loss_fn did not call the model (micro-batch {k + 1}); "
                                f"{API} needs loss_fn(model, mb) -> the loss of one forward")
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or loss.grad_fn is None:
                raise UserError(f"loss_fn returned {type(loss).__name__} for micro-batch "
                                f"{k + 1}; it must return a scalar loss tensor that requires grad")
            self.losses[k] = loss
        except BaseException as e:     # noqa: BLE001 -- raised by the caller's thread
            self.errors[k] = e
            self.turns.abort()
        finally:
            r._tls.run = r._tls.pass_ = None
            self.turns.done(k)

    # -- the caller's thread -------------------------------------------------------------------
    def run(self) -> list:
        r = self.r
        if not r.step_open:
            r._begin_step()
        passes0 = r.step_passes
        if r.overlap is not None:
            # the optimizer beside the backward: the run's micro-batches are passes
            # passes0 + 1 .. passes0 + K of the step; the last one completes each unit's
            # gradient in its backward stage (summed over the run), as the plan prices it
            r.overlap.pass_starts(passes0 + self.K)
        r.clock.begin_pass(self.K)
        r.static_ptrs = set()            # each micro-batch's forward adds its own
        r.driver.begin(weakref.ref(self))
        state = _tls_state(self.r.device)
        try:
            r.lm_workers.run(lambda k: self._worker(k, state), self.K, self.turns.abort)
            errs = [e for e in self.errors if e is not None and not isinstance(e, _Aborted)]
            if errs:
                raise errs[0]
            r.clock.forward_done()
            pieces = self._pieces()
            plan = self._analyse(pieces)
            # from here the pieces alone hold the cuts: each goes once its backward has run
            self.cut_in = [[] for _ in range(self.K)]
            self.cut_out = [None] * self.K
            self.losses = [x.detach() for x in self.losses]
            r.clock.backward_seen()
            self._backward(pieces, plan)
            if r.overlap is not None:
                r.overlap.backward_ended()
        except BaseException:
            if r.overlap is not None:
                # the stages finish() runs next are not a backward: they hand nothing over
                r.overlap.armed = False
            self._discard()
            if r.overlap is None or not r.overlap.stepped():
                r.step_passes = passes0      # a failed run is none of the step's passes
            # (else units were stepped beside its backward: its passes stay counted, so that
            # another run before opt.step() is refused as a batch-major pass K + 1 is)
            raise
        finally:
            if r.driver.ctx is not None and r.driver.ctx() is self:
                r.driver.finish()
        r.steps_done()                   # clip none: no step beside the backward still runs
        out = list(self.losses)
        self._discard(keep_counts=True)
        return out

    def _discard(self, keep_counts: bool = False):
        for p in self.passes:
            if p is not None and not keep_counts:
                p.discard()
        self.passes = [None] * self.K
        self.cut_in = [[] for _ in range(self.K)]
        self.cut_out = [None] * self.K
        self.losses = [None] * self.K

    def _pieces(self) -> list:
        """Per micro-batch, top first: (slot, root, leaf above (its grad is the root's) or
        None for the loss, leaf below (the piece ends there) or None for the stem)."""
        out = []
        for k in range(self.K):
            cuts = self.cut_in[k]
            loss = self.losses[k]
            ps = []
            top = loss
            above = None
            if self.cut_out[k] is not None:
                y, leaf = self.cut_out[k]
                ps.append((self.U - 1, loss, None, leaf))
                top, above = y, leaf
            for j in range(len(cuts) - 1, -1, -1):
                ui, h, leaf = cuts[j]
                ps.append((ui, top, above, leaf))
                top, above = h, leaf
            ps.append((0 if self.has_stem else (cuts[0][0] if cuts else 0), top, above, None))
            out.append(ps)
        return out

    def _analyse(self, pieces) -> list:
        """Per micro-batch, per piece: the parameters it shares with another piece; refuses a
        graph that reaches across a cut other than through it."""
        plan = []
        mb_of: dict = {}                 # grad_fn -> the micro-batch whose graph holds it
        param_ids = {id(p) for p in self.r.model.parameters()}
        for k, ps in enumerate(pieces):
            leaves = {id(leaf) for _, _, leaf in self.cut_in[k]}
            if self.cut_out[k] is not None:
                leaves.add(id(self.cut_out[k][1]))
            owner: dict = {}
            reach: dict = {}             # id(leaf variable) -> [piece indices]
            names = [self._piece_name(s) for s, *_ in ps]
            for j, (slot, root, above, below) in enumerate(ps):
                fn = root.grad_fn if isinstance(root, torch.Tensor) else None
                for f in _nodes(fn):
                    if type(f).__name__ == "AccumulateGrad":
                        v = f.variable
                        if v is below:
                            continue
                        if id(v) in leaves:
                            self._refuse(names[j], "a block's input")
                        reach.setdefault(id(v), []).append(j)
                        continue
                    o = owner.get(f)
                    if o is not None and o != j:
                        self._refuse(names[j], names[o])
                    owner[f] = j
                    if mb_of.setdefault(f, k) != k and not _of_parameters(f, param_ids):
                        # (a node of parameters alone is shared rightly: autocast's cached
                        # cast of a weight, for the whole autocast region)
                        self._refuse_across(names[j], k, mb_of[f])
            shared = {v: js for v, js in reach.items() if len(set(js)) > 1}
            plan.append(shared)
        return plan

    def _piece_name(self, slot: int) -> str:
        return self.r.plan.units[max(slot, 0)].name

    @staticmethod
    def _refuse(here: str, there: str):
        raise UserError(f"under a layer-major plan a unit reads only the hidden state from the "
                        f"units before it, but the backward of {here} reaches {there} another "
                        "way (an encoder output read by later blocks, a skip connection); "
                        "solve with --micro-batch-order batch-major")

    @staticmethod
    def _refuse_across(here: str, k: int, other: int):
        # e.g. Hugging Face RecurrentGemma with use_cache on: each recurrent layer keeps its
        # last state on the module, and under the turn order micro-batch 2's layer starts from
        # micro-batch 1's (multiplied by 0, so the plain loop's values, but one graph)
        raise UserError(f"under a layer-major plan each micro-batch's graph is its own, but "
                        f"the backward of {here} in micro-batch {k + 1} reaches micro-batch "
                        f"{other + 1}'s (a module keeps a tensor of one call for the next, as a "
                        "recurrent state or cache does: call the model with use_cache=False), "
                        "or solve with --micro-batch-order batch-major")

    def _backward(self, pieces, shared) -> None:
        r = self.r
        params = {id(p): p for p in r.model.parameters()}
        # every leaf two pieces read: parts per micro-batch, added up at the lowest piece
        parts = [dict() for _ in range(self.K)]
        lowest = [{v: max(js) for v, js in s.items()} for s in shared]
        by_slot: dict = {}
        for k, ps in enumerate(pieces):
            for j, piece in enumerate(ps):
                by_slot.setdefault(piece[0], []).append((k, j, piece))
            ps.clear()
        for slot in sorted(by_slot, reverse=True):
            r.driver.enter(2 * self.U - max(slot, 0))
            # top piece first within a slot, micro-batches in order
            items = sorted(by_slot.pop(slot), key=lambda x: (x[1], x[0]))
            for n in range(len(items)):
                k, j, (s, root, above, below) = items[n]
                items[n] = None
                mine = [v for v, js in shared[k].items() if j in js]
                grad = None
                if above is not None:
                    grad = above.grad
                    above.grad = None
                run = (above is None or grad is not None) and isinstance(root, torch.Tensor) \
                    and root.grad_fn is not None
                if run:
                    held = []
                    for v in mine:
                        t = params.get(v)
                        if t is not None:
                            held.append((v, t, t.grad))
                            t.grad = None
                    torch.autograd.backward(root, grad)
                    for v, t, old in held:
                        got, t.grad = t.grad, old
                        if got is not None:
                            parts[k].setdefault(v, []).append(got)
                del root, grad
                for v in mine:
                    if lowest[k][v] == j and v in params:
                        self._accumulate(params[v], parts[k].pop(v, []))

    @staticmethod
    def _accumulate(t: torch.Tensor, got: list) -> None:
        """``.grad`` += the parts of one micro-batch, summed in the order they arrived (the
        plain backward sums a leaf's inputs before accumulating them)."""
        if not got:
            return
        s = got[0]
        for g in got[1:]:
            s = s + g
        with torch.no_grad():
            if t.grad is None:
                t.grad = s.detach()
            else:
                t.grad.add_(s)
