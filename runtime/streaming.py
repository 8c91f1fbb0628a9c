"""Weights, gradients and optimizer state that live off the device between uses.

Each unit whose plan gives a tensor class a home other than the device gets a ``UnitStatic``.
Its parameters stay the user's own ``nn.Parameter`` objects on the device; between uses their
storage is resized to nothing (memory freed, every view autograd saved of them still valid, as
FSDP does) and refilled from the home before the unit's forward and again before its
backward, a share per stage as the plan says. Gradients of such a unit leave the device after
its backward, a share per stage, and are added into their home copy (``acc + new`` in the
parameter's dtype, the order PyTorch's own accumulation uses). Between passes a parameter
whose gradient lives on NVMe carries a placeholder ``.grad`` (``OffloadedGrad``) that behaves
as the gradient: ``torch.nn.utils.clip_grad_norm_`` takes its norm as it was written and its
scale as it is read at the step; ``zero_grad`` in any form, ``p.grad = None`` and a parameter
that got no gradient are followed exactly as ``p.grad`` would be (``sync_grads``).

The optimizer step goes through the handle (``OptimizerPhase``): units at home on the device
are stepped by the user's own optimizer; every other unit, one after the other, is brought to
where its step runs (weights, gradients and state read from the NVMe tier), stepped by an
optimizer of the user's class over that unit's parameters that shares the user's state dict
and hyper-parameters (so learning-rate schedulers and ``opt.state_dict()`` see every
parameter), and written back. On a CPU device every step runs on the CPU itself.
"""
from __future__ import annotations

import contextlib
import math
import threading
import warnings

import torch
from torch.utils._pytree import tree_flatten, tree_map

from planner.formats import ACC_CHUNK_BYTES, STEP_PIECE_ALIGN, STEP_PIECE_BYTES, Tier, UserError

from .files import NvmeStore, Sums, byte_view
from .offload import Counters, as_bytes
from .transfer import ByteStream, backend_for

ZERO, HOME = "zero", "home"      # a gradient at home: zeroed in place, or the accumulation


class OffloadedGrad(torch.Tensor):
    """A parameter's ``.grad`` while the gradient lives on the NVMe tier: same shape, dtype and
    device, no storage. It behaves as the gradient it stands for: zeroing it (``zero_``, what
    ``zero_grad(set_to_none=False)`` does) and scaling it by a scalar (``mul_``, what
    ``clip_grad_norm_`` does) are recorded and applied to the home copy; its 2-norm is the one
    taken as it was written; any other read brings the values from the home. Other writes into
    it are refused in one line."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, unit: "UnitStatic", k: int):
        t = torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype,
                                                device=like.device, requires_grad=False)
        t.owner = unit
        t.k = k
        t.unit = unit.name
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        first = args[0] if args else None
        if name in ("zero_", "_foreach_zero_"):
            return zero_each(first, OffloadedGrad, lambda t: t.owner.grad_zeroed(t.k))
        if name in ("mul_", "_foreach_mul_") and len(args) == 2 and not kwargs:
            many = isinstance(first, (list, tuple))
            ts = first if many else [first]
            fs = args[1] if many and isinstance(args[1], (list, tuple)) else [args[1]] * len(ts)
            if all(_scalar(f) for f in fs):
                for t, f in zip(ts, fs):
                    if isinstance(t, OffloadedGrad):
                        t.owner.grad_scaled(t.k, f)
                    else:
                        t.mul_(f)
                return None if many else first
        if isinstance(first, OffloadedGrad) and (
                name in ("detach", "alias") or (name in ("view", "_unsafe_view", "view_as")
                                                and tuple(_shape_of(args[1])) ==
                                                tuple(first.shape))):
            # an alias of the placeholder is a placeholder of the same gradient: what is done
            # to it (``p.grad.data.mul_``, ``.detach().zero_()``) reaches the home, as it
            # would reach the tensor it stands for
            return OffloadedGrad(first, first.owner, first.k)
        if name == "linalg_vector_norm" and isinstance(first, OffloadedGrad):
            n = first.owner.grad_norm(first.k, *args[1:], **kwargs)
            if n is not None:
                return n
        for t in tree_flatten(args)[0] + tree_flatten(kwargs)[0]:
            if isinstance(t, OffloadedGrad) and _writes(func, args, kwargs, t):
                where = "on the NVMe tier" if t.owner.home.grads is Tier.NVME \
                    else "in host memory"
                raise UserError(f"the gradients of {t.unit} live {where} under this plan, "
                                f"so {name} cannot write into them (zeroing, scaling "
                                "by a scalar and reading them work); change gradients "
                                "before the plan takes them, or read them with "
                                "handle.gradients()")
        real = tree_map(lambda t: t.owner.grad_value(t.k) if isinstance(t, OffloadedGrad)
                        else t, (args, kwargs))
        return func(*real[0], **real[1])

    def __repr__(self):
        return f"OffloadedGrad(unit={self.unit}, shape={tuple(self.shape)})"


def step_with_grads_hidden(params, step):
    """``step()`` with the gradients of ``params`` set aside, so that the user's optimizer
    skips them (the plan steps those parameters itself); they are back after it, also when it
    raises. Its result."""
    hidden = [(p, p.grad) for p in params if p.grad is not None]
    for p, _ in hidden:
        p.grad = None
    try:
        return step()
    finally:
        for p, g in hidden:
            p.grad = g


def _shape_of(x) -> tuple:
    """A view's target: a shape (list of ints) or, for ``view_as``, a tensor."""
    return tuple(x.shape) if isinstance(x, torch.Tensor) else tuple(x)


def zero_each(first, placeholder: type, zeroed):
    """``zero_`` or ``_foreach_zero_`` of ``first`` (a tensor or a list) inside a gradient
    placeholder's dispatch: ``zeroed(t)`` records it for each ``placeholder``, a plain tensor
    is zeroed; what the op returns (``None`` for the in-place foreach)."""
    many = isinstance(first, (list, tuple))
    for t in (first if many else [first]):
        if isinstance(t, placeholder):
            zeroed(t)
        else:
            t.zero_()
    return None if many else first


def is_one(f) -> bool:
    """A scale factor that is exactly 1 (a number or a one-element plain tensor)."""
    if isinstance(f, (int, float)):
        return f == 1
    return type(f) is torch.Tensor and f.numel() == 1 and bool(f.item() == 1)


def _scalar(f) -> bool:
    return isinstance(f, (int, float)) or (isinstance(f, torch.Tensor) and f.numel() == 1
                                           and not isinstance(f, OffloadedGrad))


def _writes(func, args, kwargs, t) -> bool:
    """Whether ``func`` writes into tensor ``t`` (an in-place or ``out=`` argument)."""
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        if v is t or (isinstance(v, (list, tuple)) and any(x is t for x in v)):
            return True
    return False


def _own_storage(p: torch.nn.Parameter) -> None:
    """Give ``p`` a storage of its own, so that resizing it frees exactly ``p``."""
    st = p.untyped_storage()
    if st.nbytes() == 0 and p.storage_offset() == 0 and p.is_contiguous():
        return          # a stand-in with no storage yet (filled from a checkpoint at setup)
    if p.storage_offset() != 0 or st.nbytes() != p.numel() * p.element_size() or not p.is_contiguous():
        p.data = p.data.clone(memory_format=torch.contiguous_format)


class _Flat(ByteStream):
    """A unit's tensors as one byte stream (``transfer.ByteStream``, one piece per tensor:
    ``items`` are (tensor, offset, nbytes) in a fixed order)."""

    def __init__(self, tensors):
        super().__init__(tensors, lambda t: t.numel() * t.element_size())

    def parts(self, a: int, b: int, by: str):
        """(index, tensor, 0, nbytes, offset) of the whole tensors the share [a, b) moves
        (``ByteStream.parts``)."""
        for k, t, off, n in super().parts(a, b, by):
            yield k, t, 0, n, off


def _covers(ranges, n: int) -> bool:
    """Whether the byte ranges ``[(lo, hi)]`` together cover ``[0, n)``."""
    at = 0
    for lo, hi in sorted(ranges):
        if lo > at:
            return False
        at = max(at, hi)
    return at >= n


class UnitStatic:
    """One unit's parameters, gradients and optimizer state under a home off the device."""

    def __init__(self, name: str, params: list, home, device: torch.device, store_of,
                 counters: Counters):
        self.name = name
        self.params = params                 # [(qualified name, Parameter)]
        self.home = home
        self.device = device
        self.store_of = store_of             # () -> NvmeStore
        self.be = backend_for(device)        # file ranges go through the transfer engine
        self.c = counters
        self.weights_out = home.weights is not Tier.GPU
        self.grads_out = home.grads is not Tier.GPU
        self.state_out = home.optimizer is not Tier.GPU
        self.lock = threading.Lock()
        self.futures: list = []
        self.w_path = self.g_path = self.s_path = None
        self.w_fd = self.g_fd = self.s_fd = None
        self.w_sums = self.g_sums = self.s_sums = None   # checksums of each file (files.Sums)
        self.w_got = set()                   # params whose weights are on the device
        self.in_use = False
        # Per parameter index, what its gradient is while it lives at home: absent (None,
        # as ``p.grad is None``), ZERO (zeroed in place) or HOME (the accumulation in the
        # file), with the scales recorded since it was written (clipping) and its 2-norm as
        # written. ``placeholders[k]`` is the ``.grad`` standing for it between passes: a
        # ``.grad`` that is no longer that object was dropped or replaced by the user.
        self.grad_state: dict = {}
        self.grad_scales: dict = {}          # k -> [scalar tensors or numbers], in order
        self.grad_norms: dict = {}           # k -> 2-norm of the accumulation as written
        self.placeholders: dict = {}
        self.lent: set = set()               # k whose placeholder a backward took (``.grad`` None)
        self.dev_grads = None                # the backward's gradients, until they have left
        self.scales_now: dict = {}           # the scales their accumulators take as they are added
        self.placeholders_due = False
        self.state_layout = None             # [(param index, key)] of state tensors on NVMe
        self.s_off: dict = {}                # (param index, key) -> (offset, bytes) in the state file
        self.s_end = 0
        # the overlapped executor (runtime/overlap.py): told on the training thread when the
        # unit's gradients have all arrived home; the state it read ahead (file offset ->
        # bytes, kept equal to the file by every state write until the step drops it); the
        # one line that refuses a scale of the gradients (a clip under a clip-none plan)
        self.on_grads_home = None
        self.ahead: dict = {}
        self.grads_ahead = None              # the pipelined phase: a read of the gradients
        self.scale_refusal: str | None = None
        for _, p in params:
            _own_storage(p)
        self.flat = _Flat([p for _, p in params])

    # -- weights ----------------------------------------------------------------------------
    def _pread(self, fd: int, mv, off: int, sums) -> None:
        self.be.read(fd, off, mv, sums)

    def _pwrite(self, fd: int, mv, off: int, sums) -> None:
        self.be.write(fd, off, mv, sums)

    # a unit's many tensors, each its own (offset, memoryview), in few requests (runtime/disk.py)
    def _pread_many(self, fd: int, items, sums) -> None:
        self.be.read_many(fd, items, sums)

    def _pwrite_many(self, fd: int, items, sums) -> None:
        self.be.write_many(fd, items, sums)

    def setup(self, source=None) -> None:
        """Write the current weights to their home and free them on the device. With
        ``source`` (index, parameter: fills the parameter, e.g. from a checkpoint) each
        parameter is filled, written and freed in turn: one tensor on the device at a time."""
        if not self.weights_out:
            return
        store = self.store_of()
        self.w_fd, self.w_path = store.open(f"w-{self.name}")
        self.w_sums = Sums(self.w_path, f"w-{self.name}")
        if source is None:
            store.submit(self._write_all_weights).result()
        else:
            for k, (_, p) in enumerate(self.params):
                t, off, n = self.flat.items[k]
                with torch.no_grad():
                    p.untyped_storage().resize_(n)
                    source(k, p)
                store.submit(self._pwrite, self.w_fd, byte_view(as_bytes(p.detach())), off,
                             self.w_sums).result()
                p.untyped_storage().resize_(0)
        self.c.add("nvme", self.flat.size)
        self._free_weights()

    def _write_all_weights(self):
        self._pwrite_many(self.w_fd, [(off, byte_view(as_bytes(t.detach())))
                                      for t, off, _ in self.flat.items], self.w_sums)
        self.c.moved_add("nvme_write", self.flat.size)

    def _free_weights(self):
        for _, p in self.params:
            p.untyped_storage().resize_(0)
        self.w_got.clear()

    def fetch_weights(self, fa: float, fb: float, own: bool = False):
        """Bring the planned share [fa, fb) of the weights back (an I/O job). Its future joins
        the unit's (``wait``: the training thread's), or, ``own``, is the caller's to wait
        for (the paced worker's read of a unit the training thread is done with)."""
        if not self.weights_out:
            return None
        a, b = self.flat.span(fa, fb)
        parts = list(self.flat.parts(a, b, by="end"))
        for k, t, lo, hi, off in parts:      # allocate here, fill on the I/O thread
            if t.untyped_storage().nbytes() == 0:
                t.untyped_storage().resize_(t.numel() * t.element_size())
        fut = self.store_of().submit(self._read_weights, parts)
        if not own:
            self.futures.append(fut)
        return fut

    def _read_weights(self, parts):
        items = [(off + lo, byte_view(as_bytes(t.detach())[lo:hi])) for _, t, lo, hi, off in parts]
        self._pread_many(self.w_fd, items, self.w_sums)
        for (at, mv), (k, _, lo, hi, _) in zip(items, parts):
            self.c.moved_add("nvme_read", hi - lo)
            # verified before it counts as present: a corrupted home is reported every time
            # it is read, never trusted by a later use, state dict or ``remove``
            self.w_sums.verify(at, mv, self.w_fd)
            with self.lock:
                self.w_got.add((k, lo, hi))

    def wait(self) -> None:
        """Block until this unit's I/O issued so far is done (raise its errors); then, on the
        training thread, put the placeholders on gradients that have gone home."""
        futs, self.futures = self.futures, []
        for f in futs:
            f.result()
        if self.placeholders_due:
            self.placeholders_due = False
            self._install_placeholders()
            if self.on_grads_home is not None:
                self.on_grads_home(self)

    def _install_placeholders(self) -> None:
        self.lent.clear()
        for k, (_, p) in enumerate(self.params):
            if self.grad_state.get(k) is not None:
                ph = self.placeholders.get(k)
                if ph is None:
                    ph = self.placeholders[k] = OffloadedGrad(p, self, k)
                p.grad = ph

    def use(self) -> None:
        """The unit computes now: its weights must all be here (what the plan did not
        fetch ahead is fetched now, waiting)."""
        if not self.weights_out:
            return
        self.wait()
        have = {}
        for k, lo, hi in self.w_got:
            have[k] = have.get(k, 0) + (hi - lo)
        missing = [(k, t, 0, n, off) for k, (t, off, n) in enumerate(self.flat.items)
                   if have.get(k, 0) < n]
        if missing:
            for k, t, lo, hi, off in missing:
                if t.untyped_storage().nbytes() == 0:
                    t.untyped_storage().resize_(t.numel() * t.element_size())
            self.store_of().submit(self._read_weights, missing).result()
        self.in_use = True

    def release(self) -> None:
        """The unit's compute is over: free its weights on the device."""
        if not self.weights_out:
            return
        self.wait()
        self._free_weights()
        self.in_use = False

    def prefetch(self) -> None:
        """Start reading what the unit's optimizer step reads first, its weights and its
        gradients at home (the pipelined phase: while the unit before steps); ``materialize``
        then finds them."""
        if self.grads_out:
            self.sync_grads()
        if self.weights_out and not self.in_use:
            self.fetch_weights(0.0, 1.0)
        if self.grads_out and self.acc_valid:
            self.grads_ahead = self.store_of().submit(self.read_grads)

    def drop_prefetch(self) -> None:
        """A pipelined phase failed: free what ``prefetch`` brought, once its reads are over."""
        got, self.grads_ahead = self.grads_ahead, None
        if got is not None:
            with contextlib.suppress(Exception):
                got.result()
        if self.weights_out and not self.in_use:
            self.release()

    # -- gradients --------------------------------------------------------------------------
    @property
    def acc_valid(self) -> bool:
        """Whether any parameter of the unit has a gradient at home."""
        return any(v is not None for v in self.grad_state.values())

    def sync_grads(self) -> None:
        """Take what the user did to the ``.grad`` of this unit's parameters since the plan
        last set them: a placeholder that is gone (``p.grad = None``, ``zero_grad()``) drops
        that gradient at home; a real tensor put there replaces it (autograd adds to it)."""
        if not self.grads_out:
            return
        self.wait()
        for k, (_, p) in enumerate(self.params):
            ph = self.placeholders.get(k)
            if ph is not None and p.grad is not ph and not (k in self.lent and p.grad is None):
                self.placeholders.pop(k)
                self._drop(k)

    def _drop(self, k: int) -> None:
        self.grad_state.pop(k, None)
        self.grad_scales.pop(k, None)
        self.grad_norms.pop(k, None)

    def grad_zeroed(self, k: int) -> None:
        """``p.grad.zero_()`` on the placeholder: the gradient is zeros, whatever is at home."""
        self.grad_state[k] = ZERO
        self.grad_scales.pop(k, None)
        self.grad_norms.pop(k, None)

    def grad_scaled(self, k: int, f) -> None:
        """``p.grad.mul_(f)`` on the placeholder: applied, in order, as the values are read. A
        scale by exactly 1 (torch's clip under its ``max_norm``) changes nothing, also where
        the plan refuses scales."""
        if is_one(f):
            return
        if self.scale_refusal:
            raise UserError(self.scale_refusal)
        if self.grad_state.get(k) is HOME:
            self.grad_scales.setdefault(k, []).append(f.clone() if isinstance(f, torch.Tensor)
                                                      else f)

    def grad_norm(self, k: int, ord=2, dim=None, keepdim=False, *, dtype=None):
        """The 2-norm of gradient k without reading it (None where it must be read)."""
        if ord != 2 or dim is not None or keepdim or dtype is not None or self.grad_scales.get(k):
            return None
        p = self.params[k][1]
        if self.grad_state.get(k) is ZERO:
            return torch.zeros((), dtype=p.dtype, device=self.device)
        n = self.grad_norms.get(k)
        return None if n is None else n.clone()

    def grad_value(self, k: int) -> torch.Tensor:
        """Gradient k as a tensor on the device (read from its home: zeros where zeroed)."""
        self.wait()
        return self.store_of().submit(self.read_grads, [k]).result()[k]

    def begin_backward(self) -> None:
        """Before the unit's backward: no placeholder may receive autograd's accumulation."""
        if self.grads_out:
            self.sync_grads()
            for k, (_, p) in enumerate(self.params):
                if p.grad is not None and p.grad is self.placeholders.get(k):
                    p.grad = None            # autograd makes a new one; the home keeps the sum
                    self.lent.add(k)

    def _collect(self):
        """The backward's gradients, in the byte layout of the home (``_Flat`` of the
        parameters): a parameter that got none in this pass has no entry (``None``)."""
        if self.dev_grads is None:
            grads = []
            for k, (_, p) in enumerate(self.params):
                g = p.grad
                if isinstance(g, OffloadedGrad):
                    g = None
                if g is not None:
                    g = g.detach().contiguous()
                grads.append(g)
                p.grad = None
            self.dev_grads = [(g, off, n) for g, (_, off, n) in zip(grads, self.flat.items)]
            self.scales_now = {k: list(v) for k, v in self.grad_scales.items()}

    def send_grads(self, fa: float, fb: float) -> None:
        """The planned share [fa, fb) of the unit's gradients leaves and is added to its home
        copy (an I/O job)."""
        if not self.grads_out:
            return
        self._collect()
        size = self.flat.size
        if self.g_fd is None:
            # the accumulator file lives until the handle closes: counted once, when made
            self.g_fd, self.g_path = self.store_of().open(f"g-{self.name}")
            self.g_sums = Sums(self.g_path, f"g-{self.name}")
            self.c.add("nvme", size)
        a, b = self.flat.span(fa, fb)
        last = fb >= 1 - 1e-12
        self.futures.append(self.store_of().submit(self._accumulate, a, b, last))

    def _accumulate(self, a: int, b: int, last: bool):
        flat = self.dev_grads
        writes, done = [], []
        for k, (g, off, n) in enumerate(flat):
            if g is None or not n or not a <= off < b:
                continue
            # by parts of ACC_CHUNK_BYTES (whole elements), each written with its own checksum:
            # the read-back below then holds one part at a time, as the plan counts it
            st = self.grad_state.get(k)
            if st is HOME:       # read, added into and written part by part, one held
                self._add_into_file(as_bytes(g), g.dtype, off, n, True,
                                    self.scales_now.get(k, ()))
            else:                # the first pass's: written with the share's others at once
                if st is ZERO:
                    g.add_(0.0)                 # 0.0 + x: x, except -0.0 -> +0.0
                writes += self._acc_parts(as_bytes(g), g.dtype, off, n)
            # the tensor's accumulated gradient is complete: its norm, as clipping takes it
            self.grad_norms[k] = torch.linalg.vector_norm(g, 2.0)
            self.grad_state[k] = HOME
            self.grad_scales.pop(k, None)
            done.append(k)
        if writes:
            self._pwrite_many(self.g_fd, writes, self.g_sums)
            self.c.moved_add("nvme_write", sum(len(mv) for _, mv in writes))
        for k in done:
            # and its memory goes now, not when the unit's last share has left: the plan
            # frees a split transfer share by share
            flat[k] = (None, flat[k][1], flat[k][2])
        if last:
            self.dev_grads = None
            self.placeholders_due = True      # installed by the training thread (``wait``)

    @staticmethod
    def _acc_parts(new: torch.Tensor, dtype, off: int, n: int) -> list:
        """(file offset, memoryview) of the gradient's bytes ``new`` in parts of
        ACC_CHUNK_BYTES (whole elements), each written with its own checksum."""
        es = torch.empty((), dtype=dtype).element_size()
        step = max(1, ACC_CHUNK_BYTES // es) * es
        return [(off + c0, byte_view(new[c0:min(n, c0 + step)])) for c0 in range(0, n, step)]

    def _add_into_file(self, new: torch.Tensor, dtype, off: int, n: int, add: bool,
                       scales) -> None:
        """The new gradient (``new``: its ``n`` bytes) into the accumulator file at ``off``, by
        parts of ACC_CHUNK_BYTES (whole elements), each written with its own checksum: the
        read-back then holds one part at a time, as the plan counts it. With ``add`` the
        accumulator is added into the new gradient in its dtype: new + acc, the same bits as
        PyTorch's acc + new (the accumulator scaled first, as a clip between passes scaled
        ``.grad`` in place). (A gradient zeroed in place, ``ZERO``, is added to zeros by the
        caller, as PyTorch's accumulation into a zeroed ``.grad`` is: 0.0 + -0.0 is +0.0, so a
        -0.0 does not survive; a copy would keep it.)"""
        for at, part in self._acc_parts(new, dtype, off, n):
            if add:
                old = torch.empty(len(part), dtype=torch.uint8)
                self._pread(self.g_fd, byte_view(old), at, self.g_sums)
                self.g_sums.verify(at, byte_view(old), self.g_fd)
                self.c.moved_add("nvme_read", len(part))
                acc = old.view(dtype)
                for f in scales:
                    acc.mul_(f)
                new[at - off:at - off + len(part)].view(dtype).add_(acc)
                del old, acc
            self._pwrite(self.g_fd, part, at, self.g_sums)
            self.c.moved_add("nvme_write", len(part))

    def read_grads(self, ks=None) -> dict:
        """Index -> the gradient at home of parameter k (all with one), read from the file
        (zeros where zeroed) with its recorded scales applied."""
        out, reads = {}, []
        for k, (t, off, n) in enumerate(self.flat.items):
            st = self.grad_state.get(k)
            if st is None or (ks is not None and k not in ks):
                continue
            p = self.params[k][1]
            if st is ZERO:
                out[k] = torch.zeros(p.shape, dtype=p.dtype, device=self.device)
                continue
            out[k] = torch.empty(p.shape, dtype=p.dtype, device=self.device)
            reads.append((k, off, byte_view(as_bytes(out[k]))))
        self._pread_many(self.g_fd, [(off, mv) for _, off, mv in reads], self.g_sums)
        for k, off, mv in reads:
            self.g_sums.verify(off, mv, self.g_fd)
            self.c.moved_add("nvme_read", len(mv))
            for f in self.grad_scales.get(k, ()):
                out[k].mul_(f)        # the same scale, in place, as torch's clipping
        return out

    # -- the optimizer step -----------------------------------------------------------------
    def state_tensors(self, opt_state) -> list:
        """(param index, key, tensor) of every per-element state tensor of the unit."""
        out = []
        for k, (_, p) in enumerate(self.params):
            st = opt_state.get(p, {})
            for key in sorted(st):
                v = st[key]
                if isinstance(v, torch.Tensor) and v.numel() == p.numel() and v.numel() > 1:
                    out.append((k, key, v))
        return out

    def materialize(self, opt_state, state: bool = True) -> None:
        """Bring what the step needs to the device: weights, gradients and (unless ``state``
        is False: a step in pieces reads its own) the optimizer state."""
        store = self.store_of()
        self.sync_grads()
        if self.weights_out and not self.in_use:
            self.use()
        got, self.grads_ahead = self.grads_ahead, None
        if self.grads_out and self.acc_valid:
            # scaled, as they come back, by what clipped them (read ahead by ``prefetch``)
            for k, g in (got or store.submit(self.read_grads)).result().items():
                self.params[k][1].grad = g
        if state and self.state_out and self.state_layout is not None:
            tens = self.state_tensors(opt_state)
            store.submit(self._read_state, tens).result()

    def _state_file(self):
        if self.s_fd is None:
            self.s_fd, self.s_path = self.store_of().open(f"s-{self.name}")
            self.s_sums = Sums(self.s_path, f"s-{self.name}")

    def _state_offset(self, k: int, key, n: int) -> int:
        """Where state tensor ``key`` of parameter k lives in the state file: given once, when
        first written, and kept (a step in pieces reads and writes slices of it in place)."""
        got = self.s_off.get((k, key))
        if got is None or got[1] != n:       # new, or loaded in another dtype: a new region
            got = self.s_off[(k, key)] = (self.s_end, n)
            self.s_end += n
            self.c.add("nvme", n)
        return got[0]

    def _read_state(self, tens):
        for _, _, v in tens:
            v.untyped_storage().resize_(v.numel() * v.element_size())
        self._read_state_ranges([(self.s_off[(k, key)][0], byte_view(as_bytes(v)))
                                 for k, key, v in tens])

    def write_back(self, opt_state, weights: bool = True, state: bool = True,
                   defer: bool = False):
        """After the step: weights (unless ``weights`` is False: a loaded optimizer state
        alone) and state (unless ``state`` is False: a step in pieces wrote its own) to their
        homes, freed on the device; gradients stay where they were (the accumulation lives
        until ``zero_grad``). With ``defer`` the writes are left in flight and the function
        that waits for them and frees is returned."""
        store = self.store_of()
        jobs = []
        state = state and self.state_out
        if state:
            tens = self.state_tensors(opt_state)
            self._state_file()
            for k, key, v in tens:
                self._state_offset(k, key, v.numel() * v.element_size())
            self.state_layout = [(k, key) for k, key, _ in tens]
            jobs.append(store.submit(self._write_state, tens))
        weights = weights and self.weights_out
        if weights:
            jobs.append(store.submit(self._write_all_weights))
        tens = self.state_tensors(opt_state) if state else []

        def finish():
            for j in jobs:
                j.result()
            for _, _, v in tens:
                v.untyped_storage().resize_(0)
            if weights:
                self._free_weights()
                self.in_use = False
            if self.grads_out:
                self._install_placeholders()
        if defer:
            return finish
        finish()
        return None

    def _write_state(self, tens):
        self._write_slices([(self.s_off[(k, key)][0], v) for k, key, v in tens])

    # -- the step in pieces -------------------------------------------------------------------
    def pieces(self, ps: list, opt_state) -> list:
        """``ps`` (parameters of this unit in one param group) cut into pieces of at most
        STEP_PIECE_BYTES of optimizer state each: runs of whole tensors, or slices of
        STEP_PIECE_ALIGN-element multiples of a larger one (at least one such slice): lists
        of (param index, first element, end element). A parameter's state per element is
        that of its state tensors where it has them, else taken as two of its own elements
        (Adam's moments) until its first step."""
        index = {id(p): k for k, (_, p) in enumerate(self.params)}
        out, cur, cur_b = [], [], 0
        for p in ps:
            k, n = index[id(p)], p.numel()
            per = sum(v.element_size() for v in opt_state.get(p, {}).values()
                      if isinstance(v, torch.Tensor) and v.numel() == n > 1) \
                or 2 * p.element_size()
            if n * per <= STEP_PIECE_BYTES:
                if cur and cur_b + n * per > STEP_PIECE_BYTES:
                    out.append(cur)
                    cur, cur_b = [], 0
                cur.append((k, 0, n))
                cur_b += n * per
                continue
            step = max(1, STEP_PIECE_BYTES // (per * STEP_PIECE_ALIGN)) * STEP_PIECE_ALIGN
            out += [[(k, lo, min(n, lo + step))] for lo in range(0, n, step)]
        if cur:
            out.append(cur)
        return out

    def step_in_pieces(self, make_optimizer, ps: list, opt_state, host=None,
                       pipelined: bool = False, timed=None) -> None:
        """Step the parameters ``ps`` piece by piece (``pieces``): each piece's state is read
        from the state file, stepped by ``make_optimizer(views)`` over flat views of the
        parameters' elements, and written back in place. For elementwise optimizers only
        (Adam, SGD, ...): there a slice steps exactly as the whole tensor would (slices start
        at multiples of 2^20 elements: the same vectorised kernels, the same bits). Weights
        and gradients are those of the parameters, or, with ``host`` (param index ->
        (weights, gradient or None): host tensors, the staged path's step on the CPU), those.
        One piece at a time; ``pipelined`` (the plan's optimizer depth 3): the next piece's
        state is read while one steps and its writes go behind (three pieces in flight, the
        pieces' file ranges disjoint), all written before this returns. ``timed(fn, n)``
        (``OptimizerPhase.timed``), where given, runs each piece's update of n elements."""
        self._state_file()
        store = self.store_of()
        # the state as the step found it: a tensor's later slices must read what its first
        # slice's step has not yet replaced (its stand-ins, its step count)
        before = {id(p): dict(opt_state.get(p, {})) for p in ps}
        pieces = iter(self.pieces(ps, opt_state))

        def prepared():                  # the next piece with something to step, or None
            for piece in pieces:
                x = self._piece_slots(piece, before, host)
                if x[0]:
                    return x, store.submit(self._read_slices, x[2])
            return None
        writing, cur, nxt = [], prepared(), None
        try:
            while cur is not None:
                (views, slots, _), got = cur
                got.result()
                if pipelined:
                    nxt = prepared()         # read while this one steps
                sub = make_optimizer(views)
                for c, (_, _, _, st) in zip(views, slots):
                    if st:
                        sub.state[c] = st
                if timed is None:
                    sub.step()
                else:
                    timed(sub.step, sum(v.numel() for v in views))
                writing.append(store.submit(self._write_slices,
                                            self._piece_writes(sub, views, slots, opt_state)))
                del sub, views, slots
                # one write behind at most (pipelined), none otherwise
                while len(writing) > (1 if pipelined else 0):
                    writing.pop(0).result()
                cur, nxt = (nxt if pipelined else prepared()), None
        finally:
            for x in (cur, nxt):
                if x is not None:
                    with contextlib.suppress(Exception):
                        x[1].result()
            for w in writing:
                w.result()
        self.state_layout = [(k, key) for k, key, _ in self.state_tensors(opt_state)]

    def _piece_slots(self, piece, before: dict, host) -> tuple:
        """(views, slots, reads) of one piece: a flat view of each parameter's elements with
        its gradient, its state (buffers to read into, per-tensor values copied) and the
        file reads that fill them. Parameters without a gradient are left out (the optimizer
        skips them)."""
        views, slots, reads = [], [], []
        for k, lo, hi in piece:
            p = self.params[k][1]
            w, g = host.get(k, (None, None)) if host is not None else (p.detach(), p.grad)
            if g is None or isinstance(g, OffloadedGrad):
                continue
            c = w.view(-1)[lo:hi]
            c.grad = g.detach().view(-1)[lo:hi]
            st = {}
            for key, v in before[id(p)].items():
                if isinstance(v, torch.Tensor) and v.numel() == p.numel() > 1:
                    off = self.s_off[(k, key)][0] + lo * v.element_size()
                    # state read ahead (paced: the plan's read part) is stepped where it was
                    # read, not copied into a second buffer: the plan holds it once
                    # (``paced_held``); a copy held the piece twice during the update
                    part = self._ahead_view(off, hi - lo, v)
                    if part is None:
                        part = torch.empty(hi - lo, dtype=v.dtype, device=v.device)
                        reads.append((off, part))
                    st[key] = part
                else:                        # a step count and the like: one per tensor
                    st[key] = v.clone() if isinstance(v, torch.Tensor) else v
            views.append(c)
            slots.append((k, lo, hi, st))
        return views, slots, reads

    def _piece_writes(self, sub, views, slots, opt_state) -> list:
        """The file writes of one stepped piece; its per-tensor values (and a stand-in of no
        storage for each new state tensor) go into the user's state."""
        writes = []
        for c, (k, lo, hi, _) in zip(views, slots):
            p = self.params[k][1]
            new = sub.state.get(c, {})
            old = opt_state.setdefault(p, {})
            for key in sorted(new, key=str):
                v = new[key]
                # per element: the view's own shape (a step count is 0-dim, even where a
                # slice has one element)
                if isinstance(v, torch.Tensor) and v.shape == c.shape and p.numel() > 1:
                    es = v.element_size()
                    off = self._state_offset(k, key, p.numel() * es)
                    writes.append((off + lo * es, v))
                    if key not in old:       # the whole tensor's stand-in: no storage
                        ph = torch.empty(p.shape, dtype=v.dtype, device=v.device)
                        ph.untyped_storage().resize_(0)
                        old[key] = ph
                else:
                    old[key] = v
        return writes

    def _read_slices(self, reads):
        self._read_state_ranges([(off, byte_view(as_bytes(t))) for off, t in reads])

    def _read_state_ranges(self, items) -> None:
        """State bytes at each ``(offset, mv)`` of the state file into ``mv``: from what was
        read ahead where that holds them (read, verified and counted then), else from the
        file (ranges that follow each other there in few requests)."""
        todo = [(off, mv) for off, mv in items if not self._from_ahead(off, mv)]
        self._pread_many(self.s_fd, todo, self.s_sums)
        for off, mv in todo:
            self.s_sums.verify(off, mv, self.s_fd)
            self.c.moved_add("nvme_read", len(mv))

    def _from_ahead(self, off: int, mv) -> bool:
        for a, buf in self.ahead.items():
            if a <= off and off + len(mv) <= a + buf.numel():
                mv[:] = byte_view(buf[off - a:off - a + len(mv)])
                return True
        return False

    def _ahead_view(self, off: int, n: int, like: torch.Tensor):
        """The n elements of ``like``'s dtype at ``off`` of the state file as a view of what
        was read ahead, where one read-ahead buffer holds them all (else None). A step on it
        updates the read-ahead bytes in place, which ``_ahead_written`` would make them anyway
        once the piece is written."""
        es = like.element_size()
        for a, buf in self.ahead.items():
            if (a <= off and off + n * es <= a + buf.numel() and (off - a) % es == 0
                    and buf.device == like.device):
                return buf[off - a:off - a + n * es].view(like.dtype)
        return None

    def _ahead_written(self, off: int, mv) -> None:
        """A state write at ``off``: what was read ahead of that range becomes the new bytes."""
        for a, buf in self.ahead.items():
            lo, hi = max(a, off), min(a + buf.numel(), off + len(mv))
            if lo < hi:
                byte_view(buf[lo - a:hi - a])[:] = mv[lo - off:hi - off]

    def state_regions(self) -> list:
        """(offset, bytes) of each state tensor of the unit in its state file (empty before
        its first step)."""
        if self.s_fd is None or self.state_layout is None:
            return []
        return [self.s_off[x] for x in self.state_layout if x in self.s_off]

    def read_ahead(self, regions) -> None:
        """Read the state regions [(offset, bytes)] now, verified, for the step to use (the
        overlapped executor under clip global: the reads move into the backward)."""
        got = {off: torch.empty(n, dtype=torch.uint8) for off, n in regions}
        items = [(off, byte_view(buf)) for off, buf in got.items()]
        self._pread_many(self.s_fd, items, self.s_sums)
        for off, mv in items:
            self.s_sums.verify(off, mv, self.s_fd)
            self.c.moved_add("nvme_read", len(mv))
        self.ahead.update(got)

    def drop_ahead(self) -> None:
        self.ahead = {}

    def _write_slices(self, writes):
        """Each tensor in STEP_PIECE_ALIGN-element parts, each checksummed on its own: a piece
        (whole tensors, or slices starting at multiples of that) then reads and verifies whole
        ranges only, never a larger range it would have to read from the file in full."""
        items = []
        for off, t in writes:
            mv = byte_view(as_bytes(t))
            step = STEP_PIECE_ALIGN * t.element_size()
            items += [(off + a, mv[a:a + step]) for a in range(0, len(mv), step)]
            self.c.moved_add("nvme_write", len(mv))
            if self.ahead:
                self._ahead_written(off, mv)
        self._pwrite_many(self.s_fd, items, self.s_sums)

    # -- reading and loading values ------------------------------------------------------------
    def _present(self, k: int) -> bool:
        n = self.flat.items[k][2]
        with self.lock:
            return _covers([(a, b) for kk, a, b in self.w_got if kk == k], n)

    def weight_value(self, k: int) -> torch.Tensor:
        """Parameter k's value as a tensor of its own (a state dict's): the device copy where
        it is present, else read from its home (verified); the device copy stays as it was."""
        t, off, n = self.flat.items[k]
        self.wait()
        if not self.weights_out or self._present(k):
            return t.detach().clone()
        out = torch.empty(t.shape, dtype=t.dtype, device=self.device)
        self.store_of().submit(self._read_weights_into, out, off).result()
        return out

    def _read_weights_into(self, out: torch.Tensor, off: int) -> None:
        mv = byte_view(as_bytes(out))
        self._pread(self.w_fd, mv, off, self.w_sums)
        self.w_sums.verify(off, mv, self.w_fd)
        self.c.moved_add("nvme_read", len(mv))

    def open_for_load(self, k: int) -> bool:
        """Give parameter k a storage for ``load_state_dict`` to copy into; True when it had
        none (``loaded`` frees it again)."""
        t, _, n = self.flat.items[k]
        self.wait()
        if not self.weights_out or t.untyped_storage().nbytes():
            return False
        t.untyped_storage().resize_(n)
        return True

    def loaded(self, k: int, opened: bool) -> None:
        """Parameter k was loaded in place: its home gets the new value (and the device copy
        goes again where ``open_for_load`` made it)."""
        if not self.weights_out:
            return
        t, off, _ = self.flat.items[k]
        self.store_of().submit(self._pwrite, self.w_fd, byte_view(as_bytes(t.detach())), off,
                               self.w_sums).result()
        self.c.moved_add("nvme_write", self.flat.items[k][2])
        if opened:
            t.untyped_storage().resize_(0)

    @contextlib.contextmanager
    def weights_present(self, write_back: bool = False):
        """The unit's weights on the device for the duration (state dicts, no-grad calls)."""
        was = self.in_use or not self.weights_out
        if not was:
            self.use()
        try:
            yield
        finally:
            if not was:
                if write_back:
                    self._write_weights_home()
                self.release()

    def _write_weights_home(self) -> None:
        """Every weight to its home, now (on the I/O thread, which owns the files)."""
        self.store_of().submit(self._write_all_weights).result()

    @contextlib.contextmanager
    def state_present(self, opt_state, write_back: bool = False):
        """The unit's optimizer state on the device for the duration (optimizer state dicts)."""
        if not (self.state_out and self.state_layout is not None):
            yield
            return
        tens = self.state_tensors(opt_state)
        self.store_of().submit(self._read_state, tens).result()
        try:
            yield
        finally:
            if write_back:
                tens = self.state_tensors(opt_state)
                self.state_layout = [(k, key) for k, key, _ in tens]
                self.store_of().submit(self._write_state, tens).result()
            for _, _, v in self.state_tensors(opt_state):
                v.untyped_storage().resize_(0)

    def bring_state_home(self, opt_state) -> None:
        """Leave the optimizer state on the device for good (``handle.remove()``)."""
        if self.state_out and self.state_layout is not None:
            tens = self.state_tensors(opt_state)
            self.store_of().submit(self._read_state, tens).result()
            self.state_layout = None

    def close(self) -> None:
        store = self.store_of() if (self.w_path or self.g_path or self.s_path) else None
        if store is not None:
            for path in (self.w_path, self.g_path, self.s_path):
                if path:
                    store.unlink(path)


# Optimizers whose step is elementwise (each element's update reads only that element's
# parameter, gradient and state, and per-tensor scalars such as the step count): a unit's state
# on NVMe is stepped piece by piece with them. Exact classes: a subclass may change the step.
ELEMENTWISE = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad,
               torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adamax,
               torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop)


class OptimizerPhase:
    """``opt.step()`` under a plan: the user's optimizer for units at home on the device, an
    optimizer of the same class per other unit (sharing the user's state and
    hyper-parameters), one unit after the other."""

    def __init__(self, opt: torch.optim.Optimizer, units: list[UnitStatic], model_params: set,
                 depth: int = 1):
        self.opt = opt
        self.units = units
        # the plan's optimizer_depth: with more than one unit in flight the phase is pipelined
        # (``_pipelined``), as the plan prices it; with one, one unit after the other
        self.depth = depth
        streamed = {id(p) for u in units for _, p in u.params}
        self.streamed = streamed
        # the runner's StageClock: what the updates on the device take (``timed``), so that
        # ``plan calibrate`` can tell the optimizer's compute from the phase's waiting
        self.clock = None
        group_of = {}
        for gi, g in enumerate(opt.param_groups):
            for p in g["params"]:
                group_of[id(p)] = gi
        missing = [n for u in units for n, p in u.params if id(p) not in group_of and p.requires_grad]
        if missing:
            raise UserError(f"the optimizer given to apply_plan does not hold parameter "
                            f"{missing[0]!r}; build it on model.parameters()")
        if type(opt) not in ELEMENTWISE and any(u.state_out or getattr(u, "state_up", False)
                                                for u in units):
            warnings.warn(f"tierplan: {type(opt).__name__} is not one of the elementwise "
                          "optimizers (Adam, AdamW, SGD, ...) whose state on NVMe, or on the "
                          "host stepped on the device, is stepped piece by piece: each unit's "
                          "whole state comes to the device for its step, more than the plan "
                          "counts", stacklevel=3)
        if any(getattr(u, "steps_on_host", False) and not getattr(u, "state_up", False)
               for u in units):
            # the staged path steps those units on the CPU with the user's hyper-parameters
            # (a state-up unit steps on the device, counters where the optimizer keeps them):
            # settings for device tensors only would fail half way through opt.step()
            for gi, g in enumerate(opt.param_groups):
                bad = [k for k, v in g.items() if k != "params" and (
                    (k == "capturable" and v) or
                    (isinstance(v, torch.Tensor) and v.device.type != "cpu"))]
                if bad:
                    raise UserError(f"param group {gi} of the optimizer sets {bad[0]!r} for "
                                    "device tensors, but this plan steps units off the device "
                                    "on the CPU; build the optimizer without it (capturable="
                                    "False, plain-number hyper-parameters)")
        self.subs = []      # (unit, [(sub optimizer, user group index)])
        for u in units:
            by_group = {}
            for _, p in u.params:
                if id(p) in group_of:
                    by_group.setdefault(group_of[id(p)], []).append(p)
            subs = []
            for gi, ps in by_group.items():
                hyper = {k: v for k, v in opt.param_groups[gi].items() if k != "params"}
                try:
                    sub = type(opt)([dict(hyper, params=ps)])
                except Exception as e:   # noqa: BLE001 -- the user's optimizer class
                    raise UserError(f"{type(opt).__name__} could not be built again from its "
                                    f"param groups ({type(e).__name__}: {e}); a streaming plan "
                                    "steps each unit with a copy of the optimizer: use a "
                                    "torch.optim optimizer") from None
                sub.state = opt.state        # one state dict: opt.state_dict() sees everything
                subs.append((sub, gi))
            self.subs.append((u, subs))

    def hyper(self, gi: int) -> dict:
        """The user's hyper-parameters of param group ``gi`` as they are now (a scheduler
        changes the groups between steps)."""
        return {k: v for k, v in self.opt.param_groups[gi].items() if k != "params"}

    def timed(self, fn, params: int):
        """``fn()``, an update of ``params`` elements on the device, timed on the clock."""
        clock = self.clock
        if clock is None or not params:
            return fn()
        t0 = clock.now()
        try:
            return fn()
        finally:
            clock.optimizer(t0, clock.now(), params)

    def step(self, original_step, closure=None, done=()):
        """The step: the user's optimizer over the units at home on the device, then every
        other unit but those in ``done`` (stepped already, beside the backward:
        runtime/overlap.py)."""
        if closure is not None:
            raise UserError("opt.step(closure) re-runs the forward, which a streaming plan does "
                            "not support; call loss.backward() and then opt.step()")
        own = sum(p.numel() for g in self.opt.param_groups for p in g["params"]
                  if id(p) not in self.streamed and p.grad is not None)
        loss = step_with_grads_hidden(
            [p for g in self.opt.param_groups for p in g["params"] if id(p) in self.streamed],
            lambda: self.timed(original_step, own))
        todo = [(u, subs) for u, subs in self.subs if u not in done]
        if self.depth > 1 and not any(getattr(u, "steps_on_host", False) for u, _ in todo):
            self._pipelined(todo)
        else:
            for u, subs in todo:
                self.step_unit(u, subs)
        return loss

    def _pipelined(self, todo: list) -> None:
        """The units' steps with three in flight (``optimizer_depth`` 3): while one steps, the
        next one's weights are read and the one before's written home (the store's one I/O
        thread runs them in the order given: this unit's reads, the next's weights, this
        unit's writes), and its state pieces are read one ahead and written behind
        (``step_in_pieces``). Each step computes what it would alone: only the I/O moves."""
        behind = None                    # finishes the write-back of the unit before
        try:
            for n, (u, subs) in enumerate(todo):
                nxt = todo[n + 1][0] if n + 1 < len(todo) else None
                # this unit's write-back is the one to end on an error from here on, also from
                # the unit before's (else this unit, stepped and written, kept its weights)
                before, behind = behind, self.step_unit(u, subs, ahead=nxt)
                if before is not None:
                    before()
        except BaseException:
            # the error is the one raised; the writes issued still end, and nothing fetched
            # ahead stays on the device
            with contextlib.suppress(Exception):
                if behind is not None:
                    behind()
            for u, _ in todo:
                with contextlib.suppress(Exception):
                    u.drop_prefetch()
            raise
        if behind is not None:
            behind()

    def step_unit(self, u: UnitStatic, subs: list, hypers: dict | None = None,
                  ahead: UnitStatic | None = None, updated=None):
        """One unit's step: brought to where it runs, stepped, written back. ``hypers``
        (group index -> hyper-parameters): those to step with, else the user's now. With
        ``ahead`` (the pipelined phase: the unit stepped next) that unit's weights are read
        while this one steps, this one's state pieces are read ahead and written behind, and
        its write-back is left in flight: the function that ends it is returned. ``updated()``,
        where given, runs once the update has, before the write-back (the paced executor frees
        the gradients there)."""
        try:
            if getattr(u, "steps_on_host", False):    # the staged path (runtime/staged.py)
                u.step_host(self.opt, subs, type(self.opt) in ELEMENTWISE, hypers)
                if updated is not None:
                    updated()
                return None
            by_pieces = type(self.opt) in ELEMENTWISE and u.state_out
            pipelined = self.depth > 1 and hypers is None    # the phase after the backward
            u.materialize(self.opt.state, state=not by_pieces)
            if ahead is not None:
                ahead.prefetch()
            for sub, gi in subs:
                # the user's state and hyper-parameters as they are now: a scheduler changes
                # the groups, and ``opt.load_state_dict`` replaces ``opt.state`` altogether
                hyper = hypers[gi] if hypers is not None else self.hyper(gi)
                if by_pieces:
                    u.step_in_pieces(lambda views, h=hyper: type(self.opt)([dict(h, params=views)]),
                                     sub.param_groups[0]["params"], self.opt.state,
                                     pipelined=pipelined, timed=self.timed)
                    continue
                sub.state = self.opt.state
                sub.param_groups[0].update(hyper)
                self.timed(sub.step, sum(p.numel() for p in sub.param_groups[0]["params"]
                                         if p.grad is not None))
            if updated is not None:
                updated()
            return u.write_back(self.opt.state, state=not by_pieces, defer=ahead is not None)
        finally:
            u.drop_ahead()       # state read ahead (clip global) is used, on either path
