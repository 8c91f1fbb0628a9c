"""The dispatch tracker: ``_Tracker``, a TorchDispatchMode that charges every aten call's
FLOPs, allocations (each output storage once, freed when its last tensor dies) and parameter
use to the unit running, and records what autograd saves; the per-unit records it fills
(``_Unit``, ``_Phase``, ``_peak``); ``_Paused``; and ``_Bridge``, the autograd function that
joins a block computed apart to the main graph.
"""
from __future__ import annotations

import dataclasses
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from planner.blocks.flops import op_flops
from planner.blocks.metaops import meta_scalar, run_op
from planner.formats import HardwareSpec

aten = torch.ops.aten
EMBEDDING, HEAD = "embedding", "head"


def _storage_key(t) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, AttributeError):
        return None


def _storage_nbytes(t) -> int:
    return int(t.untyped_storage().nbytes())


@dataclasses.dataclass
class _Phase:
    """What one unit did in its forward or backward."""
    flops: int = 0
    seconds: float = 0.0      # roofline estimate
    cur: int = 0              # bytes allocated in this phase and still alive
    peak: int = 0
    calls: int = 0            # aten calls charged here
    events: list = dataclasses.field(default_factory=list)   # (key, +/-bytes) for the peak


@dataclasses.dataclass
class _Unit:
    name: str
    kind: str
    fwd: _Phase = dataclasses.field(default_factory=_Phase)
    bwd: _Phase = dataclasses.field(default_factory=_Phase)
    # storage ident -> (bytes, producing unit, storage key when saved)
    saved: dict = dataclasses.field(default_factory=dict)
    params: list = dataclasses.field(default_factory=list)
    side_keys: set = dataclasses.field(default_factory=set)   # storages of its side arguments
    input_key: int | None = None
    input_bytes: int = 0
    output_bytes: int = 0
    # bytes of tensors custom autograd Functions inside the block keep as ctx attributes (not
    # through save_for_backward): no saved-tensor hook sees them, so no plan frees them
    ctx_bytes: int = 0
    ctx_functions: tuple = ()


class _Tracker(TorchDispatchMode):
    """Charges every aten call's FLOPs, allocations and parameter use to the current unit."""

    def __init__(self, param_keys: dict, static_keys: set, hardware: HardwareSpec, dtype: str):
        super().__init__()
        self.param_keys = param_keys          # storage key -> [params]
        self.static_keys = static_keys        # storages of parameters and buffers
        self.rate = hardware.flops_per_s(dtype)
        self.bw = float(hardware.memory_bandwidth) or 1.0
        self.cpu_on_meta = False              # meta profile of a CPU target
        self.unit: _Unit | None = None
        self.phase: str = "fwd"
        self.paused = 0
        # Storage keys (StorageImpl addresses) are reused once freed, so each allocation also
        # gets a serial number that names it for good.
        self.live: dict = {}                  # storage key -> [bytes, refs, unit, phase, serial]
        self.producer: dict = {}              # serial -> unit name
        self.serial = 0
        self.param_unit: dict = {}            # id(param) -> unit name (first use)
        self.param_users: dict = {}           # id(param) -> names of every unit that used it

    # -- the bookkeeping
    def _ph(self) -> _Phase | None:
        if self.unit is None or self.paused:
            return None
        return self.unit.fwd if self.phase == "fwd" else self.unit.bwd

    def _release(self, key):
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del self.live[key]
        nbytes, _, unit, phase, serial = entry
        if unit is self.unit and phase == self.phase and not self.paused:
            ph = self._ph()
            ph.cur -= nbytes
            ph.events.append((serial, -nbytes))
        elif (unit is self.unit and phase == "fwd" and self.phase == "bwd" and not self.paused
              and serial in unit.saved and unit.kind == "block"):
            # A tensor the block's forward saved, freed by its own backward: the backward's
            # transients reuse that room, so its workspace is the peak of what it allocated net
            # of these frees, the transient above the saved bytes still alive (the gross
            # figure would count the saved bytes' room a second time). Blocks only. The embedding's backward kernel differs by backend (on CPU it
            # sorts the indices and frees its saved index tensor later than on meta), so there
            # the net figure would depend on the device; the embedding and head keep the gross
            # figure, which is never below the net one.
            unit.bwd.events.append((serial, -nbytes))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        value = meta_scalar(func, args)     # a meta tensor asked for a Python number
        if value is not None:
            return value
        out = run_op(func, args, kwargs)    # on meta, also in dtypes its meta kernel refuses
        if self.cpu_on_meta and func is aten.native_layer_norm.default \
                and args[0].dtype in (torch.float16, torch.bfloat16):
            # The meta kernel returns mean/rstd in fp32, as the CUDA kernel does; the CPU
            # kernel keeps them in the input's dtype (layer_norm_cpu: param_scalar_type).
            out = (out[0], out[1].to(args[0].dtype), out[2].to(args[0].dtype))
        ph = self._ph()
        if ph is None:
            return out
        unit = self.unit
        ph.calls += 1
        in_keys, moved = set(), 0
        for a in tree_flatten((args, kwargs))[0]:
            if isinstance(a, torch.Tensor):
                key = _storage_key(a)
                if key is None:
                    continue
                for p in self.param_keys.get(key, ()):
                    self.param_unit.setdefault(id(p), unit.name)
                    self.param_users.setdefault(id(p), set()).add(unit.name)
                if key not in in_keys:
                    in_keys.add(key)
                    moved += a.numel() * a.element_size()
        flops = op_flops(func, args, kwargs, out)
        ph.flops += flops
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            key = _storage_key(t)
            if key is None:
                continue
            if key not in in_keys:   # a view of an input moves no bytes
                moved += t.numel() * t.element_size()
            entry = self.live.get(key)
            if entry is None:
                if key in self.static_keys or key in in_keys:
                    continue
                nbytes = _storage_nbytes(t)
                self.serial += 1
                entry = self.live[key] = [nbytes, 0, unit, self.phase, self.serial]
                self.producer[self.serial] = unit.name
                ph.cur += nbytes
                ph.peak = max(ph.peak, ph.cur)
                ph.events.append((self.serial, nbytes))
            entry[1] += 1
            weakref.finalize(t, self._release, key)
        ph.seconds += max(flops / self.rate, moved / self.bw)
        return out

    def adopt(self, t, unit: _Unit) -> None:
        """Name ``unit`` as the producer of ``t``'s storage for as long as ``t`` lives, without
        charging its bytes anywhere: a block's output as the model receives it (detached from
        the block's isolated run, or made under no_grad by a reused block), so that the units
        that read it later know where it came from."""
        key = _storage_key(t)
        if key is None or key in self.static_keys:
            return
        entry = self.live.get(key)
        if entry is None:
            self.serial += 1
            entry = self.live[key] = [_storage_nbytes(t), 0, unit, "adopted", self.serial]
            self.producer[self.serial] = unit.name
        entry[1] += 1
        weakref.finalize(t, self._release, key)

    def ident(self, t):
        """A name for ``t``'s storage valid for the whole profile, and its producing unit."""
        key = _storage_key(t)
        entry = self.live.get(key)
        if entry is None:
            return ("untracked", key), None
        return entry[4], entry[2].name

    # -- saved tensors
    def pack(self, t):
        if self.unit is not None and not self.paused:
            key = _storage_key(t)
            if key is not None and key not in self.static_keys:
                ident, producer = self.ident(t)
                self.unit.saved.setdefault(ident, (_storage_nbytes(t), producer, key))
        return t

    @staticmethod
    def unpack(t):
        return t

    def set(self, unit: _Unit | None, phase: str = "fwd"):
        self.unit, self.phase = unit, phase


class _Paused:
    def __init__(self, tracker):
        self.tracker = tracker

    def __enter__(self):
        self.tracker.paused += 1

    def __exit__(self, *exc):
        self.tracker.paused -= 1


class _Bridge(torch.autograd.Function):
    """Joins a block's outputs (computed apart) to its inputs in the main graph.

    Backward returns zeros of each input's shape: the block's real backward already ran when it
    was profiled; the main graph only needs a gradient to reach the code before the block. The
    zeros stand in for the gradient the block's backward makes, so they are made with the
    tracker paused (they belong to no unit). When no input of the block requires grad (a first
    block on the user's raw input) a scalar stand-in leaf takes their place, so the output
    still requires grad wherever the block's own output does.
    """

    @staticmethod
    def forward(ctx, hook, tracker, n_in, *tensors):
        ctx.hook, ctx.tracker = hook, tracker
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tensors[:n_in]]
        # detach(), not view_as(): a view made inside a custom Function may not be written
        # in place, and the next block may do just that (ReLU(inplace=True) on its input).
        return tuple(t.detach() for t in tensors[n_in:])

    @staticmethod
    def backward(ctx, *grads):
        with _Paused(ctx.tracker):
            zeros = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.shapes]
        ctx.hook()
        return (None, None, None, *zeros, *(None for _ in grads))



def _peak(ph: _Phase, exclude: set = frozenset()) -> int:
    """Peak of the bytes allocated in a phase and alive, leaving out ``exclude`` storages
    (parameter gradients: they are the static ``grad_bytes``, not workspace)."""
    cur = peak = 0
    for key, delta in ph.events:
        if key in exclude:
            continue
        cur += delta
        peak = max(peak, cur)
    return peak

