"""FSDP2 shards homed off the device: ``fully_shard`` each block with the offload policy its
plan's homes need (docs/distributed.md, "Shards on host or NVMe").

A per-rank FSDP2 plan says, per unit, where this rank's shard of the weights, gradients and
optimizer state lives between uses (``layers[i].home``, the single-process format). The host
case is FSDP2's own: ``CPUOffloadPolicy`` keeps a group's sharded parameters and gradients in
(pinned) host memory, copies them up before the all-gather and down after the reduce-scatter,
and the user's optimizer steps them on the CPU. It moves a group's three tensor classes
together, so a block's host home is all three on the host with the step on the CPU; any other
mix is refused in one line. On a CPU device host memory is the device: no policy.

NVMe homes for a block's weight and optimizer-state shards (each or both, with the gradient
shard and the step on the device, on a CPU device) are this runtime's: ``NvmeShards`` keeps
their bytes in files between uses around FSDP2's own machinery. Other NVMe homes are refused
by ``policy_for`` in one line, naming the fix.

    plan = load_plan("plans/rank.json")
    shard_for_plan(model, plan)                 # the blocks, then the root
    handle = apply_plan(model, plan, optimizer=opt)

A user who wraps by hand gets each block's policy checked by ``apply_plan``
(``check_policies``).
"""
from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from planner.formats import RESIDENT, Plan, Tier, UnitKind, load_plan

from .binding import bind
from .engines import EngineError

HOST = "host"        # CPUOffloadPolicy
DEVICE = "device"    # no offload policy
NVME = "nvme"        # no offload policy: the shard's files are this runtime's (NvmeShards)


def _unified(device_type: str) -> bool:
    return device_type in ("cpu", "meta")


def policy_for(name: str, home, device_type: str, src: str) -> str:
    """``"host"`` (``CPUOffloadPolicy``), ``"device"`` (none) or ``"nvme"`` (none: this
    runtime keeps the shard's weights and optimizer state in files, ``NvmeShards``) for a
    unit's home under FSDP2, or one ``EngineError`` line for a home it does not execute."""
    tiers = (home.weights, home.grads, home.optimizer)
    if Tier.NVME in tiers:
        why = _nvme_refusal(home, device_type)
        if why:
            raise EngineError(f"{src}: {name} has home {home.label()}: {why}")
        return NVME
    if home.resident:
        return DEVICE
    if all(t is Tier.CPU for t in tiers) and home.step is Tier.CPU:
        if _unified(device_type):
            raise EngineError(f"{src}: {name} has home {home.label()}, host memory, which on a "
                              f"{device_type} device is the device itself; use a cpu-host plan")
        return HOST
    raise EngineError(f"{src}: {name} has home {home.label()}, but FSDP2 moves a group's "
                      "weights, gradients and optimizer state together (CPUOffloadPolicy): "
                      "re-solve so each block's shard is all on the device or all on the host "
                      "with the step on the CPU")


def _nvme_refusal(home, device_type: str) -> str | None:
    """Why this runtime does not execute an NVMe shard home (None: it does). It executes the
    shard's weights, gradients and optimizer state each on NVMe or on the device, with the
    step on the device, on a CPU device (gloo ranks)."""
    if home.step is not Tier.GPU or Tier.CPU in (home.weights, home.grads, home.optimizer):
        return ("under fsdp2 this runtime executes shards homed on NVMe or on the device, "
                "with the step on the device, not mixed with host memory; re-solve with such "
                "homes or with the whole shard on the host")
    if not _unified(device_type):
        return (f"shards homed on NVMe are executed on a CPU device only so far, not on "
                f"{device_type}; re-solve with the shards on the device or the host")
    return None


def _root_policy(plan: Plan, device_type: str, src: str) -> str:
    """The root group holds every unit that is not a block: one policy for all of them."""
    got = {policy_for(u.name, d.home, device_type, src)
           for u, d in zip(plan.units, plan.layers) if u.kind != UnitKind.BLOCK.value}
    if NVME in got:
        raise EngineError(f"{src}: a unit outside the blocks has a home on NVMe, which this "
                          "runtime does not execute under fsdp2 (FSDP2's root group holds them "
                          "all); re-solve with those units on the device or the host")
    if len(got) > 1:
        raise EngineError(f"{src}: the units outside the blocks have different homes, but "
                          "FSDP2's root group holds them all under one offload policy; re-solve "
                          "with one home for them")
    return got.pop() if got else DEVICE


def _policy_obj(kind: str, pin_memory: bool):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    return CPUOffloadPolicy(pin_memory=pin_memory) if kind == HOST else OffloadPolicy()


def _device_type(model: torch.nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def shard_for_plan(model: torch.nn.Module, plan: Plan | str | Path, *, mesh=None,
                   pin_memory: bool = True, **fully_shard_kwargs) -> torch.nn.Module:
    """``fully_shard`` each of the plan's blocks with the offload policy its homes need, then
    the root (the order of docs/distributed.md); returns ``model`` (now an ``FSDPModule``).
    ``mesh`` and further keyword arguments (``mp_policy``, ...) go to every ``fully_shard``
    call; ``reshard_after_forward`` and ``offload_policy`` are the plan's."""
    from torch.distributed.fsdp import fully_shard
    for k in ("offload_policy", "reshard_after_forward"):
        if k in fully_shard_kwargs:
            raise EngineError(f"shard_for_plan sets {k} from the plan; leave it out (or wrap by "
                              "hand and let apply_plan check it)")
    src = str(plan) if not isinstance(plan, Plan) else "the plan"
    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    if plan.engine != "fsdp2":
        raise EngineError(f"{src} is for engine {plan.engine!r}, not fsdp2; solve it with "
                          "'plan solve --world-size N --engine fsdp2'")
    dev = _device_type(model)
    blocks = bind(model, plan, src)
    homes = {u.name: d.home for u, d in zip(plan.units, plan.layers)}
    kinds = [(b, policy_for(name, homes[name], dev, src)) for name, b in blocks]
    root = _root_policy(plan, dev, src)      # every refusal before any module is wrapped
    if mesh is not None:
        fully_shard_kwargs["mesh"] = mesh
    for b, kind in kinds:
        fully_shard(b, offload_policy=_policy_obj(kind, pin_memory), **fully_shard_kwargs)
    fully_shard(model, offload_policy=_policy_obj(root, pin_memory), **fully_shard_kwargs)
    return model


def _actual(m) -> str | None:
    """The FSDP2 group's offload policy as HOST/DEVICE (None: a layout this does not know)."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    try:
        group = m._get_fsdp_state()._fsdp_param_group
    except AttributeError:
        return None
    if group is None:
        return None
    pol = getattr(group, "offload_policy", None)
    if pol is None:
        return None
    return HOST if isinstance(pol, CPUOffloadPolicy) else DEVICE


def check_policies(plan: Plan, root: torch.nn.Module, blocks, src: str) -> None:
    """Each block's FSDP2 offload policy against its plan's homes (a model wrapped by hand)."""
    dev = _device_type(root)
    homes = {u.name: d.home for u, d in zip(plan.units, plan.layers)}
    what = {HOST: "CPUOffloadPolicy", DEVICE: "no offload policy"}
    for name, b in [("the root", root)] + list(blocks):
        want = _root_policy(plan, dev, src) if b is root else policy_for(name, homes[name], dev,
                                                                         src)
        want = DEVICE if want == NVME else want
        got = _actual(b)
        if got is not None and got != want:
            where = "the root" if b is root else f"block {name}"
            raise EngineError(f"{src}: {where} is fully_shard-ed with {what[got]} but the plan "
                              f"homes its shard on the {'host' if want == HOST else 'device'}; "
                              f"wrap it with {what[want]} (runtime.shard_for_plan does)")


def engine_view(plan: Plan) -> Plan:
    """The plan as this runtime executes it under FSDP2: host homes are the engine's
    (CPUOffloadPolicy), so the runtime streams nothing itself."""
    layers = [d if d.home.resident else dataclasses.replace(d, home=RESIDENT)
              for d in plan.layers]
    return dataclasses.replace(plan, layers=layers)


# ----------------------------------------------------------------------------- NVMe shard homes

class _Shard:
    """One block's FSDP2 shard whose weights, optimizer state or both live in files between
    uses. The weights are each ``FSDPParam``'s padded local shard (``_sharded_param_data``,
    the tensor FSDP2's all-gather copies in; the parameter's local tensor is a view of it);
    the state is each tensor of the optimizer's state whose local shape is the parameter's (a
    0-dim step count stays). A released tensor keeps its object, shape and dtype; its storage
    is resized to nothing, and back to its size when the bytes are read home."""

    def __init__(self, name: str, group, home, store, counters):
        from .files import Sums
        self.name, self.group, self.store, self.c = name, group, store, counters
        self.fsdp_params = list(group.fsdp_params)
        self.params = [fp.sharded_param for fp in self.fsdp_params]
        self.w_out = home.weights is Tier.NVME
        self.o_out = home.optimizer is Tier.NVME
        self.w_out_now = False            # the weight shards released (their bytes in the file)
        self.s_out: list = []             # (local tensor, offset, bytes) released to the file
        self.w_fd = self.s_fd = None
        self.w_size = self.s_size = 0     # bytes in each file
        if self.w_out:
            self.w_fd, path = store.open(f"shard-{name}-weights")
            self.w_sums = Sums(path, f"{name}'s weight shard")
        if self.o_out:
            self.s_fd, path = store.open(f"shard-{name}-state")
            self.s_sums = Sums(path, f"{name}'s optimizer state shard")
        # gradient shards on NVMe: each parameter's accumulated local gradient at an offset
        # of the file; between uses its ``.grad`` is a placeholder (``OffloadedGrad`` as the
        # DTensor's local tensor) on which zeroing and scaling are recorded and any other
        # read brings the values home
        self.home = home
        self.sd_depth = 0                 # state_dict() calls of this block's modules open
        self.g_out = home.grads is Tier.NVME
        self.g_fd = None
        self.g_size = 0
        self.g_has: dict = {}             # k -> the file holds parameter k's gradient
        self.g_zero: dict = {}            # k -> zeroed since it was written (zero_)
        self.g_scales: dict = {}          # k -> scales recorded since (mul_), in order
        self.placeholders: dict = {}      # k -> the DTensor .grad standing for it
        self.g_norms: dict = {}           # k -> its 2-norm as written
        if self.g_out:
            self.g_fd, path = store.open(f"shard-{name}-grads")
            self.g_sums = Sums(path, f"{name}'s gradient shard")
            off = 0
            self.g_off = []
            for fp in self.fsdp_params:
                n = fp.sharded_param._local_tensor.numel() * fp.sharded_param.element_size()
                self.g_off.append((off, n))
                off += n

    # -- the bytes ---------------------------------------------------------------------------
    def _datas(self) -> list:
        return [fp._sharded_param_data for fp in self.fsdp_params]

    def _write(self, fd, sums, items, free: bool = True) -> None:
        """Write each (tensor, offset) home and (``free``) release its storage (I/O thread)."""
        from .files import byte_view, pwrite_many
        from .offload import as_bytes
        views = [(off, byte_view(as_bytes(t))) for t, off in items]
        pwrite_many(fd, views, sums)
        self.c.moved_add("nvme_write", sum(len(mv) for _, mv in views))
        if free:
            for t, _ in items:
                t.untyped_storage().resize_(0)

    def _read(self, fd, sums, items) -> None:
        """Give each (tensor, offset, bytes) its storage back and read its bytes (verified)."""
        from .files import byte_view, pread_many
        from .offload import as_bytes
        for t, _, n in items:
            t.untyped_storage().resize_(n)
        views = [(off, byte_view(as_bytes(t))) for t, off, _ in items]
        pread_many(fd, views, sums)
        for off, mv in views:
            sums.verify(off, mv, fd)
            self.c.moved_add("nvme_read", len(mv))

    def _io(self, fn, *args) -> None:
        """``fn`` on the store's I/O thread, waited for. Interrupted (Ctrl-C) while it runs,
        it is still waited for before the interrupt goes on, so what the caller records of
        the storages afterwards is what they are."""
        import concurrent.futures
        fut = self.store.submit(fn, *args)
        try:
            fut.result()
        except BaseException:
            concurrent.futures.wait([fut])
            raise

    def _weight_items(self, check: bool = True) -> list:
        """(shard, offset in the file, bytes) of each non-empty weight shard; ``check``: each
        is its whole contiguous storage (not once released: the storage is empty then)."""
        out, off = [], 0
        for d in self._datas():
            n = d.numel() * d.element_size()
            if n:
                if check and (not d.is_contiguous() or d.untyped_storage().nbytes() != n):
                    raise EngineError(f"{self.name}: an FSDP2 shard that is not a whole "
                                      "contiguous storage cannot be homed on NVMe")
                out.append((d, off, n))
                off += n
        return out

    def release_weights(self) -> None:
        """The current weight shards to the file, their storage freed."""
        if self.w_out and not self.w_out_now:
            items = self._weight_items()
            try:
                self._io(self._write, self.w_fd, self.w_sums, [(d, off) for d, off, _ in items])
                self._grown("w_size", sum(n for _, _, n in items))
            finally:
                self.w_out_now = self._freed(items)

    def _grown(self, attr: str, size: int) -> None:
        """The runtime's count of bytes in its files (``peak nvme`` of the report)."""
        if size > getattr(self, attr):
            self.c.add("nvme", size - getattr(self, attr))
            setattr(self, attr, size)

    def drop_weights(self) -> None:
        """The weight shards freed, unchanged since they were read (the file holds them)."""
        if self.w_out and not self.w_out_now:
            for d, _, _ in self._weight_items():
                d.untyped_storage().resize_(0)
            self.w_out_now = True

    def load_weights(self) -> None:
        if self.w_out_now:
            items = self._weight_items(check=False)
            try:
                self._io(self._read, self.w_fd, self.w_sums, items)
            finally:
                # a read that failed part way is read again whole next time
                self.w_out_now = self._freed(items, any_of=True)

    @staticmethod
    def _freed(items, any_of: bool = False) -> bool:
        empty = [t.untyped_storage().nbytes() == 0 for t, *_ in items]
        return bool(empty) and (any(empty) if any_of else all(empty))

    def _state_items(self, state) -> list:
        from torch.distributed.tensor import DTensor
        out = []
        for p in self.params:
            local = p._local_tensor if isinstance(p, DTensor) else p
            for key in sorted(state.get(p, {}), key=str):
                v = state[p][key]
                loc = v._local_tensor if isinstance(v, DTensor) else v
                # a moment of the parameter's shape that is its whole storage (a 0-dim step
                # count, or a view into something larger, stays resident)
                if (isinstance(loc, torch.Tensor) and loc.dim() > 0 and loc.numel() > 0
                        and loc.numel() == local.numel() and loc.is_contiguous()
                        and loc.untyped_storage().nbytes() == loc.numel() * loc.element_size()):
                    out.append(loc)
        return out

    def release_state(self, state) -> None:
        """The optimizer state that is resident to the file, its storage freed."""
        if not self.o_out or self.s_out:
            return
        items, off = [], 0
        for loc in self._state_items(state):
            n = loc.numel() * loc.element_size()
            items.append((loc, off, n))
            off += n
        try:
            self._io(self._write, self.s_fd, self.s_sums, [(t, o) for t, o, _ in items])
            self._grown("s_size", off)
        finally:
            self.s_out = [it for it in items if it[0].untyped_storage().nbytes() == 0]

    def load_state(self) -> None:
        if self.s_out:
            items = self.s_out
            try:
                self._io(self._read, self.s_fd, self.s_sums, items)
            finally:
                self.s_out = [it for it in items if it[0].untyped_storage().nbytes() == 0] \
                    if any(it[0].untyped_storage().nbytes() == 0 for it in items) else []

    def forget_state(self) -> None:
        """``opt.load_state_dict`` replaced the state: what was released is no one's now."""
        self.s_out = []

    # -- gradient shards on NVMe -------------------------------------------------------------
    def _local_like(self, k: int) -> torch.Tensor:
        t = self.params[k]._local_tensor
        return torch.empty(t.shape, dtype=t.dtype, device=t.device)

    def grad_value(self, k: int) -> torch.Tensor:
        """Parameter k's gradient shard as a tensor of its own: read from the file (verified),
        then the zeroing and scales recorded on its placeholder, in order."""
        out = self._local_like(k)
        if self.g_zero.get(k):
            out.zero_()
        else:
            off, n = self.g_off[k]
            if n:
                self._io(self._read_into, self.g_fd, self.g_sums, out, off)
        for f in self.g_scales.get(k, ()):      # after a zero too (-0.0, NaN as plain gives)
            out.mul_(f)
        return out

    def _read_into(self, fd, sums, t, off) -> None:
        from .files import byte_view, pread_all
        from .offload import as_bytes
        mv = byte_view(as_bytes(t))
        pread_all(fd, mv, off, sums)
        sums.verify(off, mv, fd)
        self.c.moved_add("nvme_read", len(mv))

    def grad_zeroed(self, k: int) -> None:
        self.g_zero[k] = True
        self.g_scales[k] = []

    def grad_scaled(self, k: int, f) -> None:
        self.g_scales.setdefault(k, []).append(f.clone() if isinstance(f, torch.Tensor) else f)

    def grad_norm(self, k: int, *args, **kwargs):
        """The 2-norm taken as the gradient was written (what ``clip_grad_norm_`` asks first),
        without reading it back; None (the values are read) for any other norm, or once
        zeroed or scaled."""
        n = self.g_norms.get(k)
        default = (not args or args[0] == 2) and not kwargs.get("dim") and \
            not kwargs.get("keepdim") and kwargs.get("dtype") is None and len(args) <= 1
        if n is None or not default or self.g_zero.get(k) or self.g_scales.get(k):
            return None
        return n.clone()

    def has_placeholder(self, k: int) -> bool:
        ph = self.placeholders.get(k)
        return ph is not None and self.params[k].grad is ph

    def grads_home(self, carried: dict) -> None:
        """After FSDP2's reduce-scatter of this group: each gradient shard it left goes to the
        file (added to what the file carried, in FSDP2's order: ``old += new``) and its
        ``.grad`` becomes the placeholder; ``carried``: k -> the placeholder taken off before."""
        from .streaming import OffloadedGrad
        for k, (fp, p) in enumerate(zip(self.fsdp_params, self.params)):
            g = p.grad
            if g is None:
                if carried.get(k):                # FSDP2 reduced nothing (no sync): as it was
                    p.grad = self.placeholders[k]
                continue
            new = g._local_tensor
            if carried.get(k) and self.g_has.get(k):
                value = self.grad_value(k)
                value += new
            else:
                value = new
            off, n = self.g_off[k]
            if n:
                self._io(self._write, self.g_fd, self.g_sums, [(value.contiguous(), off)],
                         False)
            self._grown("g_size", off + n)
            self.g_has[k] = True
            self.g_zero[k] = False
            self.g_scales[k] = []
            self.g_norms[k] = torch.linalg.vector_norm(value)
            ph = fp.to_sharded_dtensor(OffloadedGrad(new, self, k))
            self.placeholders[k] = ph
            p.grad = ph

    def real_grads(self) -> list:
        """For the step: each placeholder ``.grad`` replaced by the values; (k, placeholder)
        to put back."""
        back = []
        for k, (fp, p) in enumerate(zip(self.fsdp_params, self.params)):
            if self.has_placeholder(k):
                back.append((k, p.grad))
                p.grad = fp.to_sharded_dtensor(self.grad_value(k))
        return back


class NvmeShards:
    """FSDP2 shards whose weights or optimizer state live on NVMe (``layers[i].home`` of a
    per-rank plan: ``w:nvme`` and/or ``o:nvme`` with ``g:gpu s:gpu``), executed around FSDP2's
    own machinery on a CPU device (gloo ranks); docs/distributed.md, "Shards on host or NVMe
    (runtime)".

    - A weight shard is read home just before its group's all-gather (``unshard``, which
      copies it into the all-gather buffer) and freed right after: the file already holds
      those bytes. Between uses the rank holds only the gathered weights FSDP2 keeps.
    - ``opt.step()``: the user's optimizer steps everything else (the homed shards' gradients
      hidden from it), then each homed block in turn is read home (weights, state), stepped
      by an optimizer of the user's class with each group's hyper-parameters as they are now
      over the same state dict, and written home. An elementwise optimizer's step of one
      parameter does not depend on the others, so the bits are the user's optimizer's.
    - ``model.state_dict()`` / ``opt.state_dict()``: the homed tensors are read, cloned into
      the returned dict and freed again; ``load_state_dict`` (either) writes what it loaded
      home. ``remove()`` leaves every tensor resident.
    - Gradients stay where FSDP2 puts them (the device), so clipping, ``zero_grad`` and
      ``model.zero_grad()`` are the user's as ever."""

    def __init__(self, root, plan, blocks, store, counters, optimizer, src: str):
        from .streaming import ELEMENTWISE
        homes = {u.name: d.home for u, d in zip(plan.units, plan.layers)}
        wanted = [(n, b) for n, b in blocks
                  if Tier.NVME in (homes[n].weights, homes[n].grads, homes[n].optimizer)]
        if optimizer is None:
            raise EngineError(f"{src} homes shards on NVMe, so the optimizer step goes through "
                              "the plan: pass apply_plan(model, plan, optimizer=opt)")
        if type(optimizer) not in ELEMENTWISE:
            raise EngineError(f"{src} homes shards on NVMe, which this runtime steps one block "
                              f"at a time; {type(optimizer).__name__} is not one of the "
                              "elementwise optimizers it steps that way (Adam, AdamW, SGD, ...)")
        state = root._get_fsdp_state()
        # FSDP2's lazy initialisation re-pads a sharded parameter whose storage it finds
        # empty: it runs now, before any storage is released
        state._lazy_init()
        self.opt = optimizer
        self.units = []
        groups = {id(p): gi for gi, g in enumerate(optimizer.param_groups) for p in g["params"]}
        try:
            for name, b in wanted:
                group = b._get_fsdp_state()._fsdp_param_group
                if group is None:
                    raise EngineError(f"{src}: block {name} is not fully_shard-ed; wrap it "
                                      "(runtime.shard_for_plan) before apply_plan")
                from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo
                if isinstance(group.mesh_info, HSDPMeshInfo):
                    raise EngineError(f"{src}: block {name} is sharded on a 2-D mesh (HSDP), "
                                      "whose gradients FSDP2 holds until the backward ends; "
                                      "shards on NVMe run on a 1-D mesh only: fully_shard "
                                      "over one dimension")
                pg = group._all_gather_process_group
                if pg.size() < 2:
                    raise EngineError(f"{src}: block {name} is sharded over 1 rank, where FSDP2 "
                                      "gathers nothing (its weights are the shard itself), so "
                                      "its shard cannot leave between uses; run the "
                                      "single-process plan (plan solve without --world-size, "
                                      "engine none) on one rank")
                u = _Shard(name, group, homes[name], store, counters)
                missing = [p for p in u.params if id(p) not in groups]
                if missing:
                    raise EngineError(f"{src}: a parameter of block {name} is not in the "
                                      "optimizer passed to apply_plan; pass the optimizer that "
                                      "steps the whole model")
                u.groups = [groups[id(p)] for p in u.params]
                self.units.append(u)
        except BaseException:
            self.units = []
            raise
        self.homed = {id(p) for u in self.units for p in u.params}
        self.undo: list = []
        self.in_step = False
        self.end_step = lambda: None

    # -- install ------------------------------------------------------------------------------
    def install(self, end_step) -> None:
        """Hook the groups, the blocks' state dicts and the optimizer; ``end_step``: the
        runtime's end of a training step (after the homed blocks' steps)."""
        import itertools
        import types

        import torch.optim.optimizer as optim_mod
        self.end_step = end_step
        for u in self.units:
            self._wrap_unshard(u)
            if u.g_out:
                self._wrap_post_backward(u)
            u.release_weights()
            homed = {id(p) for p in u.params}
            for blk in u.group.modules:
                self._wrap_apply(u, blk)
                for m in blk.modules():
                    # every module holding a homed parameter: a submodule's own state_dict()
                    # reads them too
                    if any(id(q) in homed for q in m.parameters()):
                        self._hook_module(u, m)
        opt = self.opt
        orig_step, orig_sd, orig_load = opt.step, opt.state_dict, opt.load_state_dict
        shards = self

        def step(_opt, closure=None):
            if closure is not None:
                raise EngineError("opt.step(closure) re-runs the forward, which a plan with "
                                  "shards on NVMe does not support; call loss.backward() and "
                                  "then opt.step()")
            if raw_step is None:                 # (a torch without the hook wrapper)
                out = shards.step(orig_step)
            else:
                # the step hooks (the optimizer's and the global ones, in torch's order) run
                # once, around the whole step with the homed blocks in it, not inside the
                # user's step of the rest
                for hook in itertools.chain(optim_mod._global_optimizer_pre_hooks.values(),
                                            _opt._optimizer_step_pre_hooks.values()):
                    hook(_opt, (), {})
                out = shards.step(lambda: raw_step(_opt))
                for hook in itertools.chain(_opt._optimizer_step_post_hooks.values(),
                                            optim_mod._global_optimizer_post_hooks.values()):
                    hook(_opt, (), {})
                if sched_wrapped:
                    _opt._opt_called = True      # what the scheduler's own wrapper records
            shards.end_step()
            return out
        # torch's step hook wrapper around the optimizer class's own step
        raw_step = getattr(type(opt).step, "__wrapped__", None)
        sched_wrapped = hasattr(orig_step, "_wrapped_by_lr_sched")
        if sched_wrapped:
            step._wrapped_by_lr_sched = True

        def state_dict(_opt, *args, **kwargs):
            return shards.opt_state_dict(lambda: orig_sd(*args, **kwargs))

        def load_state_dict(_opt, *args, **kwargs):
            shards.load_all_state()
            try:
                return orig_load(*args, **kwargs)
            finally:
                for u in shards.units:
                    u.forget_state()
                    # torch's load keeps the caller's tensors where no cast is needed: the
                    # homed ones are copied before their storage goes, so the caller's dict
                    # stays as it was
                    for p in u.params:
                        st = opt.state.get(p)
                        for key, v in list((st or {}).items()):
                            if isinstance(v, torch.Tensor) and v.dim() > 0:
                                st[key] = v.clone()
                    u.release_state(opt.state)

        for name, fn in (("step", step), ("state_dict", state_dict),
                         ("load_state_dict", load_state_dict)):
            had = name in opt.__dict__
            prev = opt.__dict__.get(name)
            setattr(opt, name, types.MethodType(fn, opt))
            self.undo.append(lambda n=name, h=had, pv=prev:
                             setattr(opt, n, pv) if h else delattr(opt, n))

    def _wrap_post_backward(self, u: _Shard) -> None:
        group = u.group
        orig = group.post_backward

        def post_backward(*args, **kwargs):
            carried = {}
            for k, p in enumerate(u.params):
                if u.has_placeholder(k):
                    carried[k] = True
                    p.grad = None            # FSDP2 assigns the new shard; grads_home adds
                elif p.grad is None:
                    u.g_has[k] = False       # set to None by the user: nothing carried
            try:
                return orig(*args, **kwargs)
            finally:
                u.grads_home(carried)
        group.post_backward = post_backward
        self.undo.append(lambda: group.__dict__.pop("post_backward", None))

    def _wrap_unshard(self, u: _Shard) -> None:
        group = u.group
        orig = group.unshard

        def unshard(async_op: bool = False):
            u.sd_depth = 0               # no state_dict() of this block is open in a pass
            need = (u.w_out_now and group.is_sharded and group._all_gather_result is None)
            if need:
                u.load_weights()
            try:
                return orig(async_op)
            finally:
                if need:
                    # FSDP2 copied the shard into its all-gather buffer (on a CPU device,
                    # before unshard returns): the file holds these bytes
                    u.drop_weights()
        group.unshard = unshard
        self.undo.append(lambda: group.__dict__.pop("unshard", None))

    def _wrap_apply(self, u: _Shard, blk) -> None:
        """``model.to()``, ``.float()``: FSDP2's ``_apply`` re-pads a shard it finds empty, so
        the weights are home around it (and written back: a cast changes them)."""
        orig = blk._apply

        def _apply(*args, **kwargs):
            u.load_weights()
            try:
                return orig(*args, **kwargs)
            finally:
                u.release_weights()
        blk._apply = _apply
        self.undo.append(lambda: blk.__dict__.pop("_apply", None))

    def _hook_module(self, u: _Shard, m) -> None:
        def sd_pre(module, prefix, keep_vars):
            u.sd_depth += 1
            u.load_weights()

        names = {n for n, _ in m.named_parameters()}

        def sd_post(module, sd, prefix, local_metadata):
            u.sd_depth = max(0, u.sd_depth - 1)
            if u.sd_depth:
                return                   # inside an outer state_dict() of the same block
            # the entries share the shards' storage (detached views): cloned before it is freed
            for n in names:
                v = sd.get(prefix + n)
                if isinstance(v, torch.Tensor):
                    sd[prefix + n] = v.clone()
            if not self.in_step:         # (a hook inside the step: the step writes them home)
                u.drop_weights()

        def load_pre(*args, **kwargs):
            u.load_weights()

        def load_post(module, incompatible):
            u.release_weights()          # what was loaded, home

        hs = [m.register_state_dict_pre_hook(sd_pre),
              m.register_state_dict_post_hook(sd_post),
              m._register_load_state_dict_pre_hook(load_pre),
              m.register_load_state_dict_post_hook(load_post)]
        self.undo.append(lambda: [h.remove() for h in hs])

    # -- the optimizer ------------------------------------------------------------------------
    def step(self, orig_step):
        self.in_step = True
        try:
            return self._step(orig_step)
        finally:
            self.in_step = False

    def _step(self, orig_step):
        from .streaming import step_with_grads_hidden
        loss = step_with_grads_hidden([p for u in self.units for p in u.params], orig_step)
        opt = self.opt
        for u in self.units:
            back = []
            try:
                u.sd_depth = 0
                u.load_weights()
                u.load_state()
                if u.g_out:
                    back = u.real_grads()
                for gi in sorted(set(u.groups)):
                    ps = [p for p, g in zip(u.params, u.groups) if g == gi and p.grad is not None]
                    if not ps:
                        continue
                    hyper = {k: v for k, v in opt.param_groups[gi].items() if k != "params"}
                    sub = type(opt)([dict(hyper, params=ps)])
                    sub.state = opt.state
                    sub.defaults = opt.defaults
                    # what torch's GradScaler puts on the optimizer it steps (a fused step
                    # unscales with it and skips on inf)
                    for a in ("grad_scale", "found_inf"):
                        if hasattr(opt, a):
                            setattr(sub, a, getattr(opt, a))
                    # the step itself, without torch's hook wrapper: the optimizer hooks
                    # (global ones too) run once a step, not once per homed block
                    raw = getattr(type(sub).step, "__wrapped__", None)
                    if raw is not None:
                        raw(sub)
                    else:
                        sub.step()
            finally:
                for k, ph in back:
                    u.params[k].grad = ph        # the file still holds the gradient
                u.release_weights()
                u.release_state(opt.state)
        return loss

    def load_all_state(self) -> None:
        for u in self.units:
            u.load_state()

    def opt_state_dict(self, orig_sd):
        self.load_all_state()
        try:
            sd = orig_sd()
            # the returned dict's tensors are the state's own: the homed ones cloned before
            # their storage is freed
            order = [p for g in self.opt.param_groups for p in g["params"]]
            for i, st in sd["state"].items():
                if isinstance(i, int) and i < len(order) and id(order[i]) in self.homed:
                    sd["state"][i] = {k: (v.detach().clone() if isinstance(v, torch.Tensor)
                                          else v) for k, v in st.items()}
            return sd
        finally:
            for u in self.units:
                u.release_state(self.opt.state)

    # -- remove -------------------------------------------------------------------------------
    def remove(self) -> BaseException | None:
        """Every homed tensor resident again, every hook undone; the first error (after all of
        it has run)."""
        first = None
        for u in self.units:
            for fn in (u.load_weights, u.load_state, u.real_grads):
                try:
                    fn()
                except BaseException as e:   # noqa: BLE001 -- raised after the clean-up
                    first = first or e
        for undo in reversed(self.undo):
            with contextlib.suppress(Exception):
                undo()
        self.undo = []
        return first
