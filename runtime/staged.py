"""The staged path of layer streaming: weights, gradients and optimizer state of a unit homed
off a device that is not host memory (a CUDA device; the tests' recording backend).

Selected by ``streaming.unit_for`` where the transfer engine's backend is not ``unified``; the
same code for every such backend (docs/runtime.md, "Streaming on a device that is not host
memory"). Every byte between the device and the host moves through the backend: copies on its
``h2d``/``d2h`` streams, each waiting explicitly for the event of what produced its source, the
compute stream waiting for the event of the copy it reads; nothing here knows which device it
is, and the compute stream is never synchronised by the host.

Homes:
- ``cpu``: host memory, one tensor per parameter, a view of the pinned slab
  (``Backend.pinned``) where the slab can hold it, else an ordinary host tensor (copies from
  it are then synchronous for the host on CUDA; never wrong). The slab is sized by the
  runtime from the plan's host peak (``apply._pinned_bytes``).
- ``nvme``: the unit's file; every read and write goes through a pinned staging view of the
  slab (an ordinary host tensor only where the slab is full), on the runtime's I/O thread.

Weights: a fetch share allocates the parameters' device storage on the training thread (for
the compute stream, an event recorded after it that the ``h2d`` stream waits for) and copies
the home into it on ``h2d``; ``use`` makes the compute stream wait for those copies' events
(``Backend.wait``) and ``release`` frees the storage once the compute stream is ordered after
every copy into it. Gradients: as a share leaves, the compute stream's event is waited for on
``d2h``, each gradient is copied to a staging view, the device gradient is held until that
copy's event (``Backend.keep``) and a host job waits for the event and adds the staged
gradient into the home (``acc + new`` in the parameter's dtype: the bits PyTorch's own
accumulation gives; the scales recorded since, clipping's, applied to the accumulator first).

The optimizer step of such a unit runs on the CPU over host tensors of its weights (the home
itself on the host; read from the file, or copied from the device, otherwise), with the user's
optimizer class, hyper-parameters and state dict entries (``step_host``); the next fetch
brings the updated weights up. State at home on the host is the optimizer's own host tensors;
on NVMe it is stepped piece by piece as on a CPU device (``UnitStatic.step_in_pieces``).
"""
from __future__ import annotations

import contextlib
import math
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from planner.formats import Tier, UserError

from .files import Sums, byte_view
from .offload import as_bytes
from .streaming import HOME, ZERO, UnitStatic
from .transfer import TransferError, backend_for

_POOL: list = []


def unit_for(name: str, params: list, home, device: torch.device, store_of,
             counters) -> UnitStatic:
    """The unit's streaming object: ``UnitStatic`` where the transfer engine's backend for
    ``device`` is unified (device memory is host memory), else its staged path here (a CUDA
    device, the tests' recording backend)."""
    if backend_for(device).unified:
        return UnitStatic(name, params, home, device, store_of, counters)
    return StagedUnit(name, params, home, device, store_of, counters)


# the per-tensor counters torch's optimizers keep in a parameter's state (Adam's step, NAdam's
# mu_product, ASGD's eta and mu): they stay where the optimizer puts them, never moved as state
SCALAR_STATE = frozenset({"step", "mu_product", "eta", "mu"})


class _HostWorker:
    """Where a unit with no home on NVMe runs its host jobs (one thread, in order): the
    gradients' accumulation on the host. It stands for the NVMe store (``submit``)."""

    def submit(self, fn, *args):
        if not _POOL or _POOL[0][0] != os.getpid():   # none yet, or a forked child's copy
            _POOL[:] = [(os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="tierplan-host"))]
        return _POOL[0][1].submit(fn, *args)


def _on_host(f):
    return f.detach().to("cpu") if isinstance(f, torch.Tensor) else f


def _pb(t: torch.Tensor) -> torch.Tensor:
    """A parameter's (or gradient's) bytes: a flat uint8 tensor over its own storage, with
    a version counter of its own (a copy into it is not an in-place change autograd sees:
    a forward saved the parameter, and its backward finds the same values fetched again)."""
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),))


class StagedUnit(UnitStatic):
    """``UnitStatic`` on a device that is not host memory (module docstring)."""

    steps_on_host = True

    def __init__(self, name, params, home, device, store_of, counters):
        if home.optimizer is Tier.GPU and (home.weights is not Tier.GPU
                                           or home.grads is not Tier.GPU):
            raise UserError(f"{name}: home {home.label()} keeps the optimizer state on the device "
                            "but its weights or gradients off it, which this runtime does not "
                            "run on a device that is not host memory; re-solve the plan for "
                            "this hardware (its homes keep the state on the host or NVMe)")
        super().__init__(name, params, home, device, store_of, counters)
        self.nvme_store_of = store_of
        uses_nvme = Tier.NVME in (home.weights, home.grads, home.optimizer)
        self.worker = store_of if uses_nvme else (lambda w=_HostWorker(): w)
        self.store_of = self.worker              # what apply.py submits reads to
        self.h2d = self.be.stream("h2d")
        self.d2h = self.be.stream("d2h")
        self.w_home: dict = {}                   # k -> host tensor (cpu home)
        self.g_home: dict = {}
        self.pinned_views: list = []             # slab views the homes hold
        self.state_slots: dict = {}              # (param index, key) -> its state's home
        self.w_ev: dict = {}                     # k -> event of the h2d copy into it, unwaited
        self.reads_ev: list = []                 # h2d events that read a host home
        self.host_bytes = 0
        self.state_bytes = 0                     # of it, the optimizer state on the host
        # the state on the host stepped on the device (``step_device``); any other home is
        # stepped on the CPU here (a unified spec's plan, state on NVMe, included)
        self.state_up = home.state_up

    # -- host buffers ------------------------------------------------------------------------
    def _home_tensor(self, p) -> torch.Tensor:
        """A host tensor shaped as ``p``: a slab view where the slab holds it, else plain."""
        n = p.numel() * p.element_size()
        try:
            v = self.be.pinned(n)
        except TransferError:
            return torch.empty(p.shape, dtype=p.dtype)
        self.pinned_views.append(v)
        return v.view(p.dtype).view(p.shape) if n else torch.empty(p.shape, dtype=p.dtype)

    def _stage(self, n: int):
        """(uint8 host buffer of ``n`` bytes, whether it is a slab view); counted as host
        bytes the runtime holds until ``_unstage``."""
        self.c.add("host", n)
        try:
            return self.be.pinned(n), True
        except TransferError:
            return torch.empty(n, dtype=torch.uint8), False

    def _unstage(self, buf, pinned: bool, ev) -> None:
        self.c.add("host", -buf.numel())
        if pinned:
            self.be.unpin(buf, ev)
        elif ev is not None:
            self.be.keep(buf, ev)

    # -- weights -----------------------------------------------------------------------------
    def setup(self, source=None) -> None:
        if not self.weights_out:
            return
        if self.home.weights is Tier.NVME:
            store = self.nvme_store_of()
            self.w_fd, self.w_path = store.open(f"w-{self.name}")
            self.w_sums = Sums(self.w_path, f"w-{self.name}")
            self.c.add("nvme", self.flat.size)
        else:
            self.c.add("host", self.flat.size)
            self.host_bytes += self.flat.size
        for k, (_, p) in enumerate(self.params):
            t, off, n = self.flat.items[k]
            if source is not None:
                with torch.no_grad():
                    p.untyped_storage().resize_(n)
                    source(k, p)
            self._home_write(k, p)
            p.untyped_storage().resize_(0)
        self._free_weights()

    def _home_write(self, k: int, p) -> None:
        """Parameter k's device value to its home (setup, a load, a no-grad write back)."""
        _, off, n = self.flat.items[k]
        if self.home.weights is Tier.CPU:
            self._quiesce_reads()
            if k not in self.w_home:
                self.w_home[k] = self._home_tensor(p)
            with torch.no_grad():
                self.w_home[k].copy_(p.detach())
            self.c.moved_add("d2h", n)
            return
        host = p.detach().to("cpu").contiguous()   # written before this returns
        self.worker().submit(self._pwrite, self.w_fd, byte_view(as_bytes(host)), off,
                             self.w_sums).result()
        self.c.moved_add("d2h", n)
        self.c.moved_add("nvme_write", n)

    def _write_all_weights(self):
        for k, (_, p) in enumerate(self.params):
            if p.untyped_storage().nbytes():
                self._home_write(k, p)

    def _quiesce_reads(self) -> None:
        """The host waits until no queued copy reads a host home any more (before it is
        written: the step, a load)."""
        evs, self.reads_ev = self.reads_ev, []
        for ev in evs:
            self.be.host_wait(ev)

    def fetch_weights(self, fa: float, fb: float) -> None:
        if not self.weights_out:
            return
        a, b = self.flat.span(fa, fb)
        with self.lock:
            have = {k for k, _, _ in self.w_got}
        parts = [x for x in self.flat.parts(a, b, by="end") if x[0] not in have]
        self._fetch(parts)

    def _fetch(self, parts) -> None:
        if not parts:
            return
        be = self.be
        for k, t, lo, hi, off in parts:      # allocated on the training thread, for compute
            if t.untyped_storage().nbytes() == 0:
                t.untyped_storage().resize_(t.numel() * t.element_size())
        alloc = be.event()
        be.record(alloc, None)
        be.wait(self.h2d, alloc)             # the copy writes memory the compute stream freed
        if self.home.weights is Tier.NVME:
            self.futures.append(self.worker().submit(self._read_stage_weights, parts))
            return
        for k, t, lo, hi, off in parts:
            be.copy(_pb(t)[lo:hi], as_bytes(self.w_home[k])[lo:hi], self.h2d)
            self.c.moved_add("h2d", hi - lo)
        ev = be.event()
        be.record(ev, self.h2d)
        self.reads_ev = [e for e in self.reads_ev if not be.done(e)] + [ev]
        with self.lock:
            for k, t, lo, hi, off in parts:
                self.w_ev[k] = ev
                self.w_got.add((k, lo, hi))

    def _read_stage_weights(self, parts):
        """On the I/O thread: each part read from the file into a staging view, verified, and
        copied up on ``h2d``; the view goes back to the slab after that copy's event."""
        be = self.be
        for k, t, lo, hi, off in parts:
            buf, pinned = self._stage(hi - lo)
            ev = None
            try:        # the view goes back also when the read or its checksum fails
                mv = byte_view(buf)
                self._pread(self.w_fd, mv, off + lo, self.w_sums)
                self.w_sums.verify(off + lo, mv, self.w_fd)
                self.c.moved_add("nvme_read", hi - lo)
                be.copy(_pb(t)[lo:hi], buf, self.h2d)
                self.c.moved_add("h2d", hi - lo)
                ev = be.event()
                be.record(ev, self.h2d)
            finally:
                self._unstage(buf, pinned, ev)
            with self.lock:
                self.w_ev[k] = ev
                self.w_got.add((k, lo, hi))

    def use(self) -> None:
        if not self.weights_out:
            return
        self.wait()
        have = {}
        with self.lock:
            for k, lo, hi in self.w_got:
                have[k] = have.get(k, 0) + (hi - lo)
        missing = [(k, t, 0, n, off) for k, (t, off, n) in enumerate(self.flat.items)
                   if have.get(k, 0) < n]
        if missing:                          # what the plan did not fetch ahead: now
            self._fetch(missing)
            self.wait()
        with self.lock:
            evs, self.w_ev = self.w_ev, {}
        for ev in {id(e): e for e in evs.values()}.values():
            self.be.wait(None, ev)           # the compute stream, never the host
        for _, p in self.params:
            self.be.use(_pb(p))
        self.in_use = True

    def release(self) -> None:
        if not self.weights_out:
            return
        self.wait()
        with self.lock:
            evs, self.w_ev = self.w_ev, {}
        for ev in {id(e): e for e in evs.values()}.values():
            self.be.wait(None, ev)           # fetched, never used: ordered before the free
        self._free_weights()
        self.in_use = False

    def weight_value(self, k: int) -> torch.Tensor:
        t, off, n = self.flat.items[k]
        self.wait()
        if not self.weights_out or self._present(k):
            with self.lock:
                ev = self.w_ev.get(k)
            if ev is not None:
                self.be.wait(None, ev)
            return self.be.use(t.detach()).clone()
        return self._host_weight(k).to(self.device)

    def _host_weight(self, k: int) -> torch.Tensor:
        """Parameter k's value at home, as a host tensor of its own."""
        t, off, n = self.flat.items[k]
        if self.home.weights is Tier.CPU:
            return self.w_home[k].clone()
        out = torch.empty(t.shape, dtype=t.dtype)
        self.worker().submit(self._read_weights_into, out, off).result()
        return out

    def open_for_load(self, k: int) -> bool:
        """``UnitStatic.open_for_load``; where parameter k is fetched already, the compute
        stream first waits for its ``h2d`` copy, so that the copy cannot land over what
        ``load_state_dict`` writes into it (or be read half-done)."""
        opened = super().open_for_load(k)
        if not opened and self.weights_out:
            with self.lock:
                ev = self.w_ev.get(k)
            if ev is not None:
                self.be.wait(None, ev)
        return opened

    def loaded(self, k: int, opened: bool) -> None:
        if not self.weights_out:
            return
        t = self.flat.items[k][0]
        self._home_write(k, t)
        if opened:
            t.untyped_storage().resize_(0)
            with self.lock:
                self.w_got = {x for x in self.w_got if x[0] != k}

    # -- gradients ---------------------------------------------------------------------------
    def send_grads(self, fa: float, fb: float) -> None:
        if not self.grads_out:
            return
        self._collect()
        be = self.be
        if self.home.grads is Tier.NVME and self.g_fd is None:
            self.g_fd, self.g_path = self.nvme_store_of().open(f"g-{self.name}")
            self.g_sums = Sums(self.g_path, f"g-{self.name}")
            self.c.add("nvme", self.flat.size)
        a, b = self.flat.span(fa, fb)
        flat = self.dev_grads
        items = [(k, g, off, n) for k, (g, off, n) in enumerate(flat)
                 if g is not None and n and a <= off < b]
        staged, ev, scales, kept = [], None, {}, []
        if items:
            produced = be.event()            # the backward has written them
            be.record(produced, None)
            be.wait(self.d2h, produced)
            try:
                for k, g, off, n in items:
                    buf, pinned = self._stage(n)
                    staged.append((k, buf, pinned))
                    be.copy(buf, as_bytes(g), self.d2h)
                    self.c.moved_add("d2h", n)
                # the scales a clip recorded (device tensors the compute stream wrote): their
                # host copies on d2h too, behind the same event the host job waits for
                for k, g, off, n in items:
                    fs = self.scales_now.get(k, ())
                    host_fs = []
                    for f in fs:
                        if isinstance(f, torch.Tensor):
                            h, src = torch.empty(f.shape, dtype=f.dtype), f.detach().contiguous()
                            be.copy(as_bytes(h), as_bytes(src), self.d2h)
                            kept.append(src)
                            host_fs.append(h)
                        else:
                            host_fs.append(f)
                    scales[k] = host_fs
                ev = be.event()
                be.record(ev, self.d2h)
                for k, g, off, n in items:
                    be.keep(g, ev)           # freed once the copy has read it
                    flat[k] = (None, off, n)
                for src in kept:
                    be.keep(src, ev)
            except BaseException:            # Ctrl-C, a failed copy: the views go back
                done = be.event()
                be.record(done, self.d2h)
                for _, buf, pinned in staged:
                    self._unstage(buf, pinned, done)
                raise
        last = fb >= 1 - 1e-12
        if last:
            self.dev_grads = None
        try:
            fut = self.worker().submit(self._accumulate_staged, staged, ev, last, scales)
        except BaseException:
            for _, buf, pinned in staged:
                self._unstage(buf, pinned, ev)
            raise
        self.futures.append(fut)

    def _accumulate_staged(self, staged, ev, last: bool, scales: dict):
        """On the worker: wait for the copies, add each staged gradient into its home
        (``scales``: k -> the clip's scales as host tensors, copied behind ``ev``)."""
        left = list(staged)
        try:
            self._accumulate_each(left, ev, scales)
        finally:        # a failed read, checksum or write: the views not added yet go back
            for _, buf, pinned in left:
                self._unstage(buf, pinned, None)
        if last:
            self.placeholders_due = True

    def _accumulate_each(self, left: list, ev, host_scales: dict) -> None:
        """``_accumulate_staged``'s work; each view leaves ``left`` once given back."""
        if ev is not None:
            self.be.host_wait(ev)
        while left:
            k, buf, pinned = left[0]
            p = self.params[k][1]
            _, off, n = self.flat.items[k]
            new = buf.view(p.dtype)
            add = self.grad_state.get(k) is HOME
            scales = host_scales.get(k, ())
            if self.home.grads is Tier.CPU:
                if k not in self.g_home:
                    self.g_home[k] = self._home_tensor(p)
                    self.c.add("host", n)
                    self.host_bytes += n
                h = self.g_home[k].view(-1)
                if add:
                    for f in scales:
                        h.mul_(f)            # the accumulator scaled first, as clipping did
                    h.add_(new)              # acc + new: the bits of new + acc
                else:
                    h.copy_(new)
                    if self.grad_state.get(k) is ZERO:
                        h.add_(0.0)          # as PyTorch adds into a zeroed .grad: -0.0 -> +0.0
                norm = torch.linalg.vector_norm(h, 2.0)
            else:
                if not add and self.grad_state.get(k) is ZERO:
                    new.add_(0.0)            # as PyTorch adds into a zeroed .grad: -0.0 -> +0.0
                self._add_into_file(buf, p.dtype, off, n, add, scales)
                norm = torch.linalg.vector_norm(new, 2.0)
            self.grad_norms[k] = norm.to(self.device)
            self.grad_state[k] = HOME
            self.grad_scales.pop(k, None)
            left.pop(0)
            self._unstage(buf, pinned, None)

    def _host_grads(self, ks=None) -> dict:
        """Index -> the gradient at home of parameter k as a host tensor of its own, its
        recorded scales applied (zeros where zeroed); on the caller's thread."""
        out = {}
        for k, (t, off, n) in enumerate(self.flat.items):
            st = self.grad_state.get(k)
            if st is None or (ks is not None and k not in ks):
                continue
            p = self.params[k][1]
            if st is ZERO:
                out[k] = torch.zeros(p.shape, dtype=p.dtype)
                continue
            if self.home.grads is Tier.CPU:
                g = self.g_home[k].clone()
            else:
                g = torch.empty(p.shape, dtype=p.dtype)
                self._pread(self.g_fd, byte_view(as_bytes(g)), off, self.g_sums)
                self.g_sums.verify(off, byte_view(as_bytes(g)), self.g_fd)
                self.c.moved_add("nvme_read", n)
            for f in self.grad_scales.get(k, ()):
                g.mul_(_on_host(f))
            out[k] = g
        return out

    def read_grads(self, ks=None) -> dict:
        return {k: g.to(self.device) for k, g in self._host_grads(ks).items()}

    # -- device <-> host at the step -----------------------------------------------------------
    def _down(self, tensors: dict) -> dict:
        """Host copies of device tensors (k -> tensor), through ``d2h``; the host waits."""
        if not tensors:
            return {}
        be = self.be
        produced = be.event()
        be.record(produced, None)
        be.wait(self.d2h, produced)
        out, srcs = {}, []
        for k, t in tensors.items():
            out[k] = torch.empty(t.shape, dtype=t.dtype)
            srcs.append(t.detach().contiguous())
            be.copy(as_bytes(out[k]), as_bytes(srcs[-1]), self.d2h)
            self.c.moved_add("d2h", t.numel() * t.element_size())
        ev = be.event()
        be.record(ev, self.d2h)
        for t in srcs:
            be.keep(t, ev)                   # a contiguous copy made here lives until read
        be.host_wait(ev)
        return out

    def _up(self, host: dict) -> None:
        """Host tensors into the device parameters they stand for, through ``h2d``; the
        compute stream waits for the copies."""
        if not host:
            return
        be = self.be
        done = be.event()
        be.record(done, None)
        be.wait(self.h2d, done)
        for k, h in host.items():
            be.copy(_pb(self.params[k][1]), as_bytes(h), self.h2d)
            self.c.moved_add("h2d", h.numel() * h.element_size())
        ev = be.event()
        be.record(ev, self.h2d)
        be.wait(None, ev)
        for h in host.values():
            be.keep(h, ev)

    def _state_to_host(self, opt_state) -> None:
        """A loaded state on the host: stepped on the device (state up), each state tensor
        into its pinned home (a pageable one would make every copy synchronous)."""
        for k, (_, p) in enumerate(self.params):
            st = opt_state.get(p)
            for key, v in list((st or {}).items()):
                if not isinstance(v, torch.Tensor):
                    continue
                if self.state_up and key not in SCALAR_STATE:
                    home = self._host_state(v.shape, v.dtype, (k, key))
                    if home is not v:
                        home.copy_(v)
                    st[key] = home
                elif v.device.type != "cpu":
                    st[key] = v.to("cpu")

    def step_host(self, opt, subs, elementwise: bool, hypers: dict | None = None) -> None:
        """The unit's optimizer step on the CPU: over host tensors of its weights (the home
        itself on the host), its gradients read from their home (or copied from the device)
        and its state on the host (read by pieces from NVMe), with an optimizer of the user's
        class per param group sharing ``opt.state`` and the group's hyper-parameters as they
        are now (or ``hypers``, group index -> hyper-parameters). Weights go back to their
        home (file, device); on the host they were stepped in place, and the next fetch
        brings them up."""
        self.sync_grads()
        self.wait()
        if self.state_up:
            self.step_device(opt, subs, elementwise, hypers)
            return
        if self.weights_out:
            self._quiesce_reads()            # no queued copy still reads the host weights
            if self.in_use or self.w_got:
                self.release()               # the device copy is stale after the step
        index = {id(p): k for k, (_, p) in enumerate(self.params)}
        if self.home.weights is Tier.CPU:
            W = dict(self.w_home)
        elif self.home.weights is Tier.NVME:
            W = {k: self._host_weight(k) for k in range(len(self.params))}
        else:
            W = self._down({k: p.detach() for k, (_, p) in enumerate(self.params)})
        if self.grads_out:
            G = self.worker().submit(self._host_grads).result()
        else:
            G = self._down({k: p.grad for k, (_, p) in enumerate(self.params)
                            if p.grad is not None})
        nvme_state = self.home.optimizer is Tier.NVME
        if nvme_state and not elementwise and self.state_layout is not None:
            # not stepped by pieces: the unit's whole state comes to the host, and goes back
            self.worker().submit(self._read_state, self.state_tensors(opt.state)).result()
        for sub, gi in subs:
            hyper = hypers[gi] if hypers is not None else \
                {k: v for k, v in opt.param_groups[gi].items() if k != "params"}
            ps = sub.param_groups[0]["params"]

            def make(views, h=hyper):
                return type(opt)([dict(h, params=views)])
            if nvme_state and elementwise:
                self.step_in_pieces(make, ps, opt.state,
                                    host={k: (W[k], G.get(k)) for k in W})
                continue
            live = [(p, index[id(p)]) for p in ps if G.get(index[id(p)]) is not None]
            if not live:
                continue
            self._state_to_host(opt.state)
            views = []
            for p, k in live:
                h = W[k]
                h.grad = G[k]
                views.append(h)
            s2 = make(views)
            for (p, k), h in zip(live, views):
                if opt.state.get(p):
                    s2.state[h] = opt.state[p]
            s2.step()
            for (p, k), h in zip(live, views):
                opt.state[p] = s2.state[h]
                h.grad = None
        if nvme_state and not elementwise:
            UnitStatic.write_back(self, opt.state, weights=False)
        if self.home.optimizer is Tier.CPU:
            self._count_state(opt.state)
        if self.home.weights is Tier.NVME:
            self.worker().submit(self._write_host_weights, W).result()
        elif self.home.weights is Tier.GPU:
            self._up(W)
        if self.grads_out:
            self._install_placeholders()

    def step_device(self, opt, subs, elementwise: bool, hypers: dict | None = None) -> None:
        """The step of a unit whose weights and gradients live on the device and whose
        optimizer state lives on the host (``w:gpu g:gpu o:cpu s:gpu``): piece by piece
        (``pieces``), the piece's state comes up over ``h2d``, the compute stream waits for it
        and steps flat views of the parameters and gradients with an optimizer of the user's
        class, and the new state goes down over ``d2h`` into the host tensors the user's
        ``opt.state`` holds (the host waits, then the device copies are freed: one piece on
        the device at a time, as the plan counts it). One-element parameters, and every
        parameter of an optimizer not known elementwise (Adafactor factors a matrix's second
        moment), are stepped in their own shapes with their whole state, as one piece. A
        state the step finds on the device (a loaded ``opt.load_state_dict``) is read from
        there and lands on the host."""
        index = {id(p): k for k, (_, p) in enumerate(self.params)}
        for sub, gi in subs:
            hyper = hypers[gi] if hypers is not None else \
                {k: v for k, v in opt.param_groups[gi].items() if k != "params"}
            ps = [p for p in sub.param_groups[0]["params"] if p.grad is not None]
            if not ps:
                continue
            before = {id(p): dict(opt.state.get(p, {})) for p in ps}
            flat = [p for p in ps if elementwise and p.numel() > 1]
            whole = [(index[id(p)], 0, p.numel()) for p in ps
                     if not (elementwise and p.numel() > 1)]
            pieces = (self.pieces(flat, opt.state) if flat else []) + ([whole] if whole else [])
            for piece in pieces:
                self._step_piece(type(opt), hyper, piece, before, opt.state,
                                 flat=piece is not whole)
        self._count_state(opt.state)

    def _step_piece(self, cls, hyper: dict, piece, before: dict, opt_state, flat: bool) -> None:
        """One piece: ``flat``, slices of flat views of elementwise state; else whole tensors
        in their own shapes. A state tensor is the parameter's own (it goes up and comes back
        down) unless it is one of the counters torch's optimizers keep per tensor
        (``SCALAR_STATE``), which stay where the optimizer keeps them (the host, or the device
        for a fused or capturable step, as plain PyTorch has them)."""
        be = self.be
        views, slots, up, held = [], [], [], []   # held: sources until the host's last wait
        done = be.event()                    # the backward's gradients, the last step's views
        be.record(done, None)
        be.wait(self.h2d, done)
        on_device = bool(hyper.get("fused") or hyper.get("capturable"))
        for k, lo, hi in piece:
            p = self.params[k][1]
            c = p.detach().view(-1)[lo:hi] if flat else p.detach()
            c.grad = p.grad.detach().view(-1)[lo:hi] if flat else p.grad.detach()
            st = {}
            for key, v in before[id(p)].items():
                if isinstance(v, torch.Tensor) and key not in SCALAR_STATE and (
                        not flat or v.numel() == p.numel()):
                    src = v.detach().reshape(-1)[lo:hi] if flat else v.detach().contiguous()
                    part = torch.empty(src.shape, dtype=v.dtype, device=self.device)
                    be.copy(as_bytes(part), as_bytes(src), self.h2d)
                    held.append(src)
                    self.c.moved_add("h2d", part.numel() * part.element_size())
                    up.append(part)
                    st[key] = part
                elif isinstance(v, torch.Tensor):  # a counter: one per tensor
                    st[key] = v.detach().to(self.device if on_device else v.device, copy=True)
                else:
                    st[key] = v
            views.append(c)
            slots.append((k, lo, hi, st))
        ev = be.event()
        be.record(ev, self.h2d)
        be.wait(None, ev)
        for t in up:
            be.use(t)
        step = cls([dict(hyper, params=views)])
        for c, (_, _, _, st) in zip(views, slots):
            if st:
                step.state[c] = st
        step.step()
        produced = be.event()
        be.record(produced, None)
        be.wait(self.d2h, produced)
        down = []
        for c, (k, lo, hi, _) in zip(views, slots):
            p = self.params[k][1]
            new, old = step.state.get(c, {}), opt_state.setdefault(p, {})
            for key in sorted(new, key=str):
                v = new[key]
                if isinstance(v, torch.Tensor) and key not in SCALAR_STATE and (
                        not flat or v.shape == c.shape):
                    shape = p.shape if flat else v.shape
                    home = old.get(key)
                    if not (isinstance(home, torch.Tensor) and home.device.type == "cpu"
                            and home.dtype == v.dtype and home.shape == shape
                            and home.untyped_storage().nbytes() > 0):
                        home = self._host_state(shape, v.dtype, (k, key))
                    dst = home.view(-1)[lo:hi] if flat else home
                    v = v.contiguous()
                    be.copy(as_bytes(dst), as_bytes(v), self.d2h)
                    self.c.moved_add("d2h", v.numel() * v.element_size())
                    down.append(v)
                    old[key] = home
                else:
                    old[key] = v
        fin = be.event()
        be.record(fin, self.d2h)
        be.host_wait(fin)       # the pieces (``down``, ``up``) are free from here: not kept
        for c in views:
            c.grad = None

    def _host_state(self, shape, dtype, slot) -> torch.Tensor:
        """A host tensor for one state tensor of the unit (a slab view where the slab holds
        it), its home from now on; counted with the state by ``_count_state``. ``slot`` (the
        parameter's index and the state's key) keeps one per tensor: a loaded state comes
        back into the same views, not into new ones each load."""
        had = self.state_slots.get(slot)
        if had is not None and had.shape == tuple(shape) and had.dtype == dtype:
            return had
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        try:
            v = self.be.pinned(n)
        except TransferError:
            return torch.empty(shape, dtype=dtype)
        self.pinned_views.append(v)
        self.state_slots[slot] = v = v.view(dtype).view(shape)
        return v

    def _count_state(self, opt_state) -> None:
        """The optimizer state at home on the host, as host bytes the runtime holds."""
        n = sum(v.numel() * v.element_size() for _, p in self.params
                for v in (opt_state.get(p) or {}).values()
                if isinstance(v, torch.Tensor) and v.device.type == "cpu" and v.numel() > 1)
        self.c.add("host", n - self.state_bytes)
        self.host_bytes += n - self.state_bytes
        self.state_bytes = n

    def _write_host_weights(self, W: dict) -> None:
        for k, h in W.items():
            _, off, n = self.flat.items[k]
            self._pwrite(self.w_fd, byte_view(as_bytes(h)), off, self.w_sums)
            self.c.moved_add("nvme_write", n)

    def _write_weights_home(self) -> None:
        """``weights_present(write_back=True)``: what the call left in the weights goes to
        the home (``_write_all_weights`` brings them down and writes them itself)."""
        self._write_all_weights()

    # -- state: loading and leaving ------------------------------------------------------------
    def write_back(self, opt_state, weights: bool = True, state: bool = True) -> None:
        """A loaded optimizer state to its home (``opt.load_state_dict``): on the host, the
        optimizer's own host tensors; on NVMe, its file."""
        self._state_to_host(opt_state)
        if self.home.optimizer is Tier.CPU:
            self._count_state(opt_state)     # host bytes from now, not from the first step
        if self.home.optimizer is Tier.NVME and state:
            UnitStatic.write_back(self, opt_state, weights=False)
        if weights and self.weights_out:
            self._write_all_weights()
            self.release()

    def bring_state_home(self, opt_state) -> None:
        """``handle.remove()``: the state back on the device, where a plain model's optimizer
        steps it."""
        super().bring_state_home(opt_state)
        for _, p in self.params:
            st = opt_state.get(p)
            for key, v in list((st or {}).items()):
                # every state tensor (a 0-dim parameter's moments, Adafactor's row and column
                # factors), not the counters torch keeps on the host
                # (a copy: the slab views go back to the slab when the unit closes)
                if isinstance(v, torch.Tensor) and key not in SCALAR_STATE:
                    st[key] = v.to(self.device, copy=True)

    def close(self) -> None:
        self.free_host()
        super().close()

    def free_host(self) -> None:
        """Give the host homes back (their slab views too): the unit is done, or the runtime
        closed before it ran (a failed ``apply_plan``). Twice is once."""
        with contextlib.suppress(Exception):
            self.wait()
        if self.pinned_views:
            self.be.synchronize()
        for v in self.pinned_views:
            self.be.unpin(v)
        self.pinned_views, self.state_slots = [], {}
        self.w_home, self.g_home = {}, {}
        if self.host_bytes:
            self.c.add("host", -self.host_bytes)
            self.host_bytes = self.state_bytes = 0
