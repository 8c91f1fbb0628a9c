"""``plan profile``: per-unit bytes, FLOPs and times of one training step of a model.

Units are ``embedding`` (everything before the first block), each block (by qualified name)
and ``head`` (everything after the last block, the loss included).

How one profile is taken (the same code on ``meta``, ``cpu`` and ``cuda``):

0. The blocks are found from one traced forward (``planner.blocks.detect_blocks``: runs of
   same-class modules each fed by the one before, at any depth, several stacks included), or
   named with ``--blocks``; the profile records their exact names in execution order.
1. One forward of the whole model runs under ``_Tracker``, a TorchDispatchMode that sees every
   aten call: it charges FLOPs (``torch.utils.flop_counter``'s formulas, plus ours in
   ``planner.profile.flops``), allocations (each output storage once, freed when its last tensor dies,
   through ``weakref.finalize``) and parameter use to the unit running. A
   ``saved_tensors_hooks`` pair records every storage autograd saves, per unit. Code that runs
   between two blocks (T5's encoder final norm and decoder embedding) is the later block's
   prologue: charged to it, its saved bytes shared (the runtime keeps them by reference).
2. Each block is replaced for that forward by a wrapper. The first block of each kind (same
   class, parameters and input shapes) runs alone: its inputs are detached into fresh leaves
   (its hidden state copied, so an in-place write cannot reach the model's tensor), its
   forward and then its backward run at once under the tracker, so its saved bytes,
   workspace and backward FLOPs are its own. Later blocks of the same kind run under no_grad
   without instrumentation and reuse the record: depth costs one meta forward per block.
   A small autograd function (``_Bridge``) joins each block's output to its inputs in the main
   graph, so the backward of ``head``, the prologues and ``embedding`` runs for real afterwards.
3. On ``meta``, ``scaled_dot_product_attention`` would fall to the math kernel (O(s^2) saved
   bytes) whatever the target; ``_TargetAttention`` calls the aten kernel the target runs
   instead (flash/efficient on CUDA, what ``_fused_sdp_choice`` picks on CPU).
4. Times: estimated (on ``meta``, or with ``--timing estimate``) as the sum over aten calls of
   max(FLOPs / rate, bytes / bandwidth) with the hardware spec's rates; otherwise measured: a
   warm-up, then repeats until the spread is small (``_Repeats``), the median kept, the spread,
   the load of other processes and a backward/forward check recorded in ``timing_quality``.
   State objects a block updates (key/value caches) are put back before every repeat.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import statistics
import sys
import time
import warnings
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from planner.blocks import (StateSnapshot, detect_blocks, hidden_location, hidden_of, identity_hash,
                     input_table, meta_scalar, param_table, run_op, same_tensor,
                     state_tensor_bytes, structure_hash)
from planner.errors import UserError
from planner.profile.flops import op_flops
from planner.formats import PROFILE_SCHEMA, HardwareSpec, Profile, UnitRecord, write_json_atomic
from planner.models import DTYPES

aten = torch.ops.aten
EMBEDDING, HEAD = "embedding", "head"
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
OPTIMIZERS = ("adamw", "adamw-pure", "sgd")


# ----------------------------------------------------------------------------- static state

def static_bytes_per_param(param_dtype: torch.dtype, optimizer: str) -> tuple[int, int, int]:
    """(weight, grad, optimizer-state) bytes per trainable parameter.

    ``adamw``: mixed precision for 16-bit weights keeps an fp32 master copy (4 bytes) and two
    fp32 moments (8 bytes): 2 + 2 + 12 = 16 bytes per parameter (Rajbhandari et al. 2020, ZeRO,
    Sec. 3.1: "16 bytes of memory per parameter"). fp32 AdamW: 4 + 4 + 8. ``adamw-pure``:
    ``torch.optim.AdamW`` over the parameters as they are, moments in their dtype and no
    master: 2 + 2 + 4 for 16-bit weights (what a bf16 model trained with a plain AdamW holds;
    seen on an H200: the ``adamw`` count over-predicted gpt2-xl's peak by 11.6 GiB), the same as
    ``adamw`` for fp32. SGD (no momentum): only the fp32 master for 16-bit weights.
    """
    w = torch.empty((), dtype=param_dtype).element_size()
    if optimizer == "adamw-pure":
        return w, w, 2 * w
    moments = 8 if optimizer == "adamw" else 0
    return w, w, master_bytes_per_param(param_dtype, optimizer) + moments


def master_bytes_per_param(param_dtype: torch.dtype, optimizer: str) -> int:
    """The fp32 master copy inside the optimizer state: 4 bytes for 16-bit floating weights
    under mixed precision, none for fp32 weights (their own master) or ``adamw-pure``."""
    w = torch.empty((), dtype=param_dtype).element_size()
    return 4 if w < 4 and param_dtype.is_floating_point and optimizer != "adamw-pure" else 0


# ----------------------------------------------------------------------------- attention

def _sdpa_args(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
               enable_gqa=False):
    return q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa


class _TargetAttention(TorchFunctionMode):
    """Routes ``F.scaled_dot_product_attention`` to the kernel the target hardware runs.

    With ``emulate`` (a meta profile) the target's aten kernel is called explicitly, since on
    meta PyTorch would decompose into the math kernel. Otherwise the call runs unchanged and only
    the kernel PyTorch picks is recorded. ``kernels`` collects what was assumed.
    """

    def __init__(self, target: str, emulate: bool):
        super().__init__()
        self.target, self.emulate = target, emulate
        self.kernels: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v, mask, p, causal, scale, gqa = _sdpa_args(*args, **kwargs)
        if self.target == "cuda":
            kind = self._cuda_choice(q, k, v, mask)
        else:
            kind = self._cpu_choice(q, k, v, mask, p, causal, scale, gqa)
        self.kernels.add(kind)
        if not self.emulate:
            return func(*args, **kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            return self._call(kind, q, k, v, mask, p, causal, scale, gqa)

    @staticmethod
    def _cuda_choice(q, k, v, mask) -> str:
        # FlashAttention-2 takes fp16/bf16, one head dim for query, key and value, up to 256
        # (multiples of 8), and no explicit mask; otherwise PyTorch uses the memory-efficient
        # kernel (xFormers), which takes fp32, additive masks and a value head dim of its own
        # (DeepSeek-V3: 192 for query and key, 128 for value; emulated as flash on meta it
        # gave a 192-wide output and the model's forward failed). Both save O(s) bytes (output
        # and log-sum-exp), never s^2.
        d = q.shape[-1]
        if (q.dtype in (torch.float16, torch.bfloat16) and d <= 256 and d % 8 == 0
                and mask is None and k.shape[-1] == d and v.shape[-1] == d):
            return "flash"
        return "efficient"

    @staticmethod
    def _cpu_choice(q, k, v, mask, p, causal, scale, gqa) -> str:
        # Ask PyTorch's CPU selector with tiny CPU tensors of the same dtypes, heads and head
        # dims: its rules depend on those, on dropout, the mask and grad mode, not on lengths.
        def small(t):
            return torch.empty((1,) * (t.dim() - 3) + (t.shape[-3], 1, t.shape[-1]),
                               dtype=t.dtype, requires_grad=t.requires_grad)
        m = None
        if mask is not None:
            m = torch.empty((1,) * mask.dim(), dtype=mask.dtype)
        choice = torch._fused_sdp_choice(small(q), small(k), small(v), m, p, causal,
                                         scale=scale, enable_gqa=gqa)
        return "cpu-flash" if choice == 1 else "math"

    @staticmethod
    def _call(kind, q, k, v, mask, p, causal, scale, gqa):
        if kind == "cpu-flash":
            return aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, p, causal, attn_mask=mask, scale=scale)[0]
        if kind == "math":
            return aten._scaled_dot_product_attention_math(
                q, k, v, mask, p, causal, None, scale=scale, enable_gqa=gqa)[0]
        if kind == "flash":
            return aten._scaled_dot_product_flash_attention(q, k, v, p, causal, False,
                                                            scale=scale)[0]
        if k.shape[-3] != q.shape[-3]:
            # NB: the efficient kernel takes no grouped KV heads; PyTorch expands them first.
            r = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(r, dim=-3), v.repeat_interleave(r, dim=-3)
        return aten._scaled_dot_product_efficient_attention(
            q, k, v, mask, q.requires_grad or k.requires_grad, p, causal, scale=scale)[0]


# ----------------------------------------------------------------------------- tracking

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
            # of these frees, the transient above the saved bytes still alive (gross, it was
            # 272 MiB against a measured ~70 MiB for a d=256 GPT block at b=8, s=1024).
            # NB: blocks only. The embedding's backward kernel differs by backend (on CPU it
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


# ----------------------------------------------------------------------------- timing

# A unit's timing is stable when its relative spread, the interquartile range over the median,
# is at most this; repeats continue (up to MAX_REPEAT_FACTOR x --repeats, and for at most
# TIMING_BUDGET_S per unit) until it is. Units still above WIDE_SPREAD are named in a warning.
STABLE_SPREAD = 0.10
WIDE_SPREAD = 0.25
# ... and only when that unit's interquartile range, in seconds, is at least this share of the
# step's compute: a 5 ms head whose backward varies by 40% does not move a 1.8 s step.
WIDE_SHARE = 0.05
MAX_REPEAT_FACTOR = 4
TIMING_BUDGET_S = 2.0
# Other processes using this many CPUs on average while we time (from /proc/stat), beyond the
# cores our own threads leave idle, make the timings unreliable. With one of this host's two
# cores busy, a 2-layer T5 block (0.3 ms of arithmetic) measured 37-49 ms with a spread under
# 1% (every OpenMP barrier waits for the thread that shares a core), against 0.06-0.46 s
# swings for gpt-tiny at b8 s256: a steady wrong time that no spread can reveal.
LOAD_CPUS = 0.25
# Backward over forward time against backward over forward FLOPs, for units whose forward is
# at least COMPUTE_BOUND arithmetic at the spec's achievable rate: outside this factor either
# way the times are suspect. Units further from the arithmetic are not checked: there the
# FLOP ratio says nothing (gpt-tiny at b8 s256 on this host, quiet: forward 29 ms, backward
# 10.5 ms, for 3 ms of arithmetic: the forward's fresh allocations and dropout masks dominate).
RATIO_FACTOR = 3.0
COMPUTE_BOUND = 0.5
# A profile warns when one unit holds more than this share of all saved activations, or the
# embedding and head together do: what a plan can act on comes in too coarse pieces.
DOMINANT_SHARE = 0.5


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(xs):
    return float(statistics.median(xs)) if xs else 0.0


def _spread(xs) -> float:
    """Interquartile range over the median (0 for fewer than 2 samples)."""
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    med = statistics.median(xs)
    return float((q3 - q1) / med) if med > 0 else 0.0


class _Repeats:
    """How many timed repeats to run: at least ``repeats``, then until every sample list is
    stable, at most ``MAX_REPEAT_FACTOR * repeats`` or ``TIMING_BUDGET_S`` seconds."""

    def __init__(self, repeats: int):
        self.min, self.max = repeats, MAX_REPEAT_FACTOR * repeats
        self.t0 = time.perf_counter()

    def done(self, n: int, lists) -> bool:
        if n < self.min:
            return False
        if n >= self.max or time.perf_counter() - self.t0 > TIMING_BUDGET_S:
            return True
        return all(_spread(xs) <= STABLE_SPREAD for xs in lists if xs)


PROC_STAT = "/proc/stat"


def usable_cpus() -> set[int]:
    """The CPUs this process's threads may run on (``os.cpu_count()`` counts the whole
    machine's). NB: every thread's, not only the calling one's: with ``OMP_PROC_BIND`` the
    main thread is pinned to one CPU while torch's workers run on the others, and counting its
    CPU alone missed a busy loop beside them."""
    cpus: set[int] = set()
    with contextlib.suppress(AttributeError, OSError):      # no /proc, no sched_getaffinity
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
                cpus |= os.sched_getaffinity(int(tid))
    if not cpus:
        with contextlib.suppress(AttributeError, OSError):
            cpus = set(os.sched_getaffinity(0))
    return cpus or set(range(os.cpu_count() or 1))


class _LoadMeter:
    """CPU time other processes used (and the hypervisor stole) while we measured, in CPUs:
    /proc/stat's busy time of the CPUs this process's threads may run on (at the start or
    the end: torch starts its workers lazily), less this process's own. ``None`` where
    /proc/stat cannot be read."""

    def __init__(self):
        self.cpus = usable_cpus()
        self.start = self._read()

    @staticmethod
    def _read():
        """(busy seconds per /proc/stat line, ``cpu`` being all CPUs, our own CPU seconds,
        wall seconds), or None."""
        busy = {}
        try:
            with open(PROC_STAT) as f:
                for line in f:
                    fields = line.split()
                    if fields and fields[0].startswith("cpu"):
                        # user nice system idle iowait irq softirq steal (guest is inside user)
                        busy[fields[0]] = sum(int(x) for i, x in enumerate(fields[1:9])
                                              if i not in (3, 4))
        except (OSError, ValueError):
            return None
        if not busy:
            return None
        tick = os.sysconf("SC_CLK_TCK")
        t = os.times()
        return {k: v / tick for k, v in busy.items()}, t.user + t.system, time.perf_counter()

    def other_cpus(self) -> float | None:
        end = self._read()
        if self.start is None or end is None:
            return None
        wall = end[2] - self.start[2]
        if wall < 0.2:      # /proc/stat counts in 10 ms ticks: too coarse below that
            return None
        # Only the CPUs our threads may run on (taskset, a container's cpuset): others' work
        # elsewhere does not touch our timings. Where /proc/stat has no line for each of
        # them, its first line (all CPUs).
        lines = [f"cpu{i}" for i in self.cpus | usable_cpus()]
        if not all(k in self.start[0] and k in end[0] for k in lines):
            lines = ["cpu"]
        if not all(k in self.start[0] and k in end[0] for k in lines):
            return None
        busy = sum(end[0][k] - self.start[0][k] for k in lines)
        other = busy - (end[1] - self.start[1])
        return max(0.0, other / wall)


# ----------------------------------------------------------------------------- the profile

def _sig(x):
    """Hashable signature of a block's inputs: tensor shapes/dtypes, other values by type."""
    leaves, spec = tree_flatten(x)
    out = []
    for a in leaves:
        if isinstance(a, torch.Tensor):
            out.append(("T", tuple(a.shape), str(a.dtype), a.requires_grad, a.device.type))
        elif isinstance(a, (int, float, bool, str, type(None))):
            out.append(a)
        else:
            out.append(type(a).__name__)
    return str(spec), tuple(out)


def _block_kind(block):
    return (type(block).__qualname__,
            tuple((n, tuple(p.shape), str(p.dtype), p.requires_grad)
                  for n, p in block.named_parameters()),
            tuple((n, tuple(b.shape), str(b.dtype)) for n, b in block.named_buffers()),
            block.training)


def _leaves(x) -> list:
    """Tensors in ``x``, looking inside dataclasses and Hugging Face ModelOutputs too."""
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        x = [getattr(x, f.name) for f in dataclasses.fields(x)]
    elif hasattr(x, "to_tuple"):
        x = x.to_tuple()
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _tensor_bytes(x) -> int:
    seen, total = set(), 0
    for t in _leaves(x):
        if isinstance(t, torch.Tensor):
            key = _storage_key(t)
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
    return total


def _first_tensor(x):
    leaves = _leaves(x)
    return leaves[0] if leaves else None


def _loss_of(out, name: str = "model"):
    loss = getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        t = _first_tensor(out)
        if t is None:
            raise UserError(f"model '{name}': its output has neither .loss nor a tensor; return "
                            "a loss or logits from its forward")
        loss = t.float().sum()
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise UserError(f"model '{name}': its output does not require grad, so there is no "
                        "backward to profile; the output must be differentiable (a .loss or a "
                        "float tensor that requires grad, from parameters that require grad)")
    return loss


def _user_code(name: str, what: str, fn, *args, meta: bool = False):
    """Run the user's model (``fn(*args)``), turning what it raises into one UserError line.

    Our own UserErrors pass through; anything else came from the model's code or from an op
    it calls that cannot run here (``.item()`` on meta, say), and only then is profiling on
    CPU worth suggesting.
    """
    try:
        return fn(*args)
    except UserError:
        raise
    except Exception as e:   # noqa: BLE001 -- the model is user code
        msg = (str(e).strip().splitlines() or [""])[0][:200]
        # another dtype too: some of torch's meta kernels take fewer dtypes than the real
        # ones (blocks.run_op makes grouped_mm's output itself; others may refuse too)
        hint = ("fix the model, or if it only fails on meta profile it with --device cpu or "
                "another --dtype" if meta else "fix the model or its inputs")
        raise UserError(f"model '{name}': its {what} raised {type(e).__name__}: {msg}; {hint}"
                        ) from None


def _call(model, inputs):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def _call_args(inputs):
    if isinstance(inputs, dict):
        return (), inputs
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


TIMINGS = ("auto", "measure", "estimate")
# profile_module's warnings (model.warnings) start so; ``plan profile`` prints them itself
WARNING_PREFIX = "tierplan: profile: "


def profile_module(model, inputs, *, name: str, hardware: HardwareSpec, dtype: str | None = None,
                   optimizer: str = "adamw", blocks_path=None, repeats: int = 5,
                   config: dict | None = None, batch: int = 0, seq: int = 0,
                   progress=None, timing: str = "auto") -> Profile:
    """Profile an already-built ``model`` on ``inputs`` (a dict of keyword arguments or a tuple).

    The device is the parameters' device (``meta``, ``cpu`` or ``cuda``); ``hardware`` is the
    target the estimate and the attention kernel are for. ``blocks_path`` is ``--blocks``
    (names or patterns; None: found from the forward). ``timing``: ``measure`` (cpu/cuda),
    ``estimate`` (from FLOPs and bytes on the hardware spec, any device), ``auto`` (measure
    where the device can).
    """
    if optimizer not in OPTIMIZERS:
        raise UserError(f"--optimizer {optimizer!r}: use {', '.join(OPTIMIZERS)}")
    if timing not in TIMINGS:
        raise UserError(f"--timing {timing!r}: use measure or estimate")
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    on_meta = device.type == "meta"
    if timing == "measure" and on_meta:
        raise UserError("--timing measure needs --device cpu or cuda (a meta profile has no "
                        "values to time); use --timing estimate or another --device")
    measure = not on_meta and timing != "estimate"
    if dtype is None:
        dtype = _DTYPE_NAMES.get(next((p.dtype for p in model.parameters()
                                       if p.is_floating_point()), torch.float32), "fp32")
    target = "cuda" if hardware.device == "cuda" else "cpu"
    if measure and device.type != target:
        raise UserError(f"--device {device.type} cannot measure times for --hardware "
                        f"{hardware.name} (a {hardware.device} spec); use --device meta, "
                        f"--timing estimate or a {device.type} spec such as cpu-host")
    who = (config or {}).get("factory", name)   # the MODEL argument where there is one
    was_training = model.training
    devices = [device] if device.type == "cuda" else []
    # Profiling runs the model many times; what it keeps in buffers (BatchNorm's running
    # statistics) is put back afterwards, so the model leaves as it came.
    buffers = [] if on_meta else [(b, b.detach().clone()) for b in model.buffers()]
    try:
        model.train()
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            blockset = _user_code(who, "forward", detect_blocks, model,
                                  lambda: _call(model, inputs), blocks_path, meta=on_meta)
        prof = _profile(model, inputs, blockset, name=name, who=who, hardware=hardware,
                        dtype=dtype, optimizer=optimizer, repeats=repeats, config=config,
                        batch=batch, seq=seq, progress=progress, device=device,
                        measure=measure, target=target)
        for w in prof.model["warnings"]:
            warnings.warn(f"{WARNING_PREFIX}{w}", stacklevel=2)
        return prof
    finally:
        model.train(was_training)
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)


def _profile(model, inputs, blockset, *, name, who, hardware, dtype, optimizer, repeats, config,
             batch, seq, progress, device, measure, target) -> Profile:
    on_meta = device.type == "meta"
    blocks = blockset.pairs()
    block_names = list(blockset.names)
    params = list(dict.fromkeys(model.parameters()))     # tied parameters once
    param_keys: dict = {}
    for p in params:
        param_keys.setdefault(_storage_key(p), []).append(p)
    static_keys = set(param_keys) | {_storage_key(b) for b in model.buffers()}
    tracker = _Tracker(param_keys, static_keys, hardware, dtype)
    attention = _TargetAttention(target, emulate=on_meta)
    tracker.cpu_on_meta = target == "cpu" and on_meta

    units = {EMBEDDING: _Unit(EMBEDDING, "embedding")}
    units.update({n: _Unit(n, "block") for n in block_names})
    units[HEAD] = _Unit(HEAD, "head")
    # The code between two blocks (a stack's final norm, the next stack's embedding) is the
    # later block's prologue: charged to it, kept by reference (docs/models.md).
    prologues = {n: _Unit(n, "prologue") for n in block_names[1:]}
    kinds: dict = {}          # block kind + input signature -> representative name
    rep_of: dict = {}         # block name -> representative block name
    needs_grad: dict = {}     # block kind + signature -> its output requires grad
    inplace_kinds: set = set()
    timing: dict = {}         # unit name -> (fwd samples, bwd samples, measured peak)
    marks: dict = {}          # main-graph timestamps for embedding/head/prologue timing
    jobs: list = []           # representative blocks to time once the instrumented pass is over
    chain_breaks: list = []   # blocks whose hidden state is not the previous block's output
    inplace: list = []        # blocks that write into their hidden state in place
    last_out: list = [None]   # the previous block's output hidden state, as the model got it
    runs: dict = {}           # block name -> times it ran in the instrumented forward
    last_call: list = [None]  # the last block's arguments (to weigh the cache they carry)
    last = len(blocks) - 1

    def note(i, what):
        if progress:
            progress(i, len(blocks) + 2, what)

    def wrapper_for(index, bname, block, orig):
        def wrapped(*args, **kwargs):
            u = units[bname]
            timing_pass = bool(marks.get("timing"))
            _sync(device)
            marks.setdefault("start", {})[index] = time.perf_counter()
            if index == 0:
                marks["emb_fwd_end"] = marks["start"][0]
            loc, main_in = hidden_location(args, kwargs)
            if not timing_pass:
                runs[bname] = runs.get(bname, 0) + 1
                last_call[0] = (args, kwargs)
                if index and not same_tensor(main_in, last_out[0]):
                    chain_breaks.append(bname)
            key = (_block_kind(block), _sig((args, kwargs)))
            grad_in = [t for t in tree_flatten((args, kwargs))[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            if key in kinds or timing_pass:
                if not timing_pass:
                    rep_of[bname] = kinds[key]
                with _Paused(tracker), torch.no_grad():
                    out = orig(*args, **kwargs)
            else:
                kinds[key] = bname
                rep_of[bname] = bname
                note(index + 1, bname)
                snap = StateSnapshot(args, kwargs, module=block)
                out, mutated, needs_grad[key] = _profile_isolated(
                    u, orig, args, kwargs, loc, tracker, device, timing)
                if mutated:
                    inplace_kinds.add(key)
                if measure:
                    jobs.append((u, orig, args, kwargs, loc, snap))
            if key in inplace_kinds and not timing_pass:
                inplace.append(bname)
            if not timing_pass:
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        tracker.adopt(t, u)
                u.input_key = tracker.ident(main_in)[0] if main_in is not None else None
                u.input_bytes = _tensor_bytes(main_in)
                u.output_bytes = _tensor_bytes(out)
                main_out = hidden_of(out)
                if index == last and main_out is not None:
                    units[HEAD].input_key = tracker.ident(main_out)[0]
            tracker.set(units[HEAD] if index == last else prologues[block_names[index + 1]])
            _sync(device)
            marks.setdefault("end", {})[index] = time.perf_counter()
            if index == last:
                marks["head_fwd_start"] = marks["end"][index]
            flat, spec = tree_flatten(out)
            pos = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)
                   and t.is_floating_point()]
            if pos and torch.is_grad_enabled() and (grad_in or needs_grad.get(key)):
                def hook(index=index):
                    _sync(device)
                    now = time.perf_counter()
                    marks.setdefault("bwd", {})[index] = now
                    if index == last:
                        marks["head_bwd_end"] = now
                    if index == 0:
                        marks["emb_bwd_start"] = now
                        tracker.set(units[EMBEDDING], "bwd")
                    else:
                        tracker.set(prologues[block_names[index]], "bwd")
                with _Paused(tracker):
                    ins = grad_in or [torch.zeros((), device=device, requires_grad=True)]
                    joined = _Bridge.apply(hook, tracker, len(ins), *ins,
                                           *[flat[i] for i in pos])
                for i, t in zip(pos, joined):
                    flat[i] = t
                out = spec.unflatten(flat)
            if not timing_pass:
                for t in tree_flatten(out)[0]:       # the bridged outputs, same storages
                    if isinstance(t, torch.Tensor):
                        tracker.adopt(t, u)
            last_out[0] = hidden_of(out)
            return out
        return wrapped

    originals = []
    grad_flags = [(p, p.requires_grad) for p in params]
    try:
        for i, (bname, block) in enumerate(blocks):
            orig = block.forward
            originals.append((block, "forward" in block.__dict__, block.__dict__.get("forward")))
            block.forward = wrapper_for(i, bname, block, orig)
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            # The instrumented step: embedding, prologues and head in the main graph, blocks
            # apart.
            note(0, EMBEDDING)
            with attention, tracker, torch.autograd.graph.saved_tensors_hooks(tracker.pack,
                                                                             tracker.unpack):
                tracker.set(units[EMBEDDING])
                out = _user_code(who, "forward", _call, model, inputs, meta=on_meta)
                loss = _loss_of(out, who)
                tracker.set(None)
            last_out[0] = None
            # A key/value cache the blocks filled (use_cache at its Hugging Face default) holds
            # a copy of every block's keys and values until the output is dropped: bytes no
            # unit saves, which the plan does not count.
            state_bytes = state_tensor_bytes(*last_call[0]) if last_call[0] else 0
            last_call[0] = None
            odd = [n for n in block_names if runs.get(n, 0) != 1]
            if odd:
                # A block found in one forward that does not run once in the next (a path that
                # depends on the data or on a counter) would be planned as 0 bytes and 0 s.
                raise UserError(f"model '{who}': block {odd[0]} ran {runs.get(odd[0], 0)} times "
                                "in the profiled forward where it ran once before (its path "
                                "depends on the data?); name blocks that run once per forward "
                                "with --blocks")
            units[HEAD].output_bytes = _tensor_bytes(out)
            units[EMBEDDING].input_bytes = _tensor_bytes(inputs)
            first = units[block_names[0]]
            units[HEAD].input_bytes = units[block_names[-1]].output_bytes
            units[EMBEDDING].output_bytes = first.input_bytes
            note(len(blocks) + 1, HEAD)
            with attention, tracker:
                tracker.set(units[HEAD], "bwd")
                _user_code(who, "backward", loss.backward, meta=on_meta)
                tracker.set(None)
            grad_idents = {tracker.ident(p.grad)[0] for p in params if p.grad is not None}
            del out, loss
            quality = {}
            if measure:
                meter = _LoadMeter()
                for u, fn, args, kwargs, loc, snap in jobs:
                    _time_block(u, fn, args, kwargs, loc, snap, device, repeats, timing)
                jobs.clear()
                _time_ends(model, inputs, device, repeats, marks, timing, tracker, prologues,
                           block_names)
                quality["other_load_cpus"] = meter.other_cpus()
    finally:
        for block, had, fwd in originals:
            if had:
                block.forward = fwd
            else:
                del block.forward
        for p, flag in grad_flags:
            p.grad = None
            p.requires_grad_(flag)

    quality["state_bytes"] = state_bytes
    return _assemble(model, inputs, units, prologues, rep_of, blockset, tracker, timing,
                     attention, params, grad_idents, hardware, dtype, optimizer, name, config,
                     batch, seq, device, measure, repeats, quality, chain_breaks, inplace)


def _leaf_copy(args, kwargs, loc=None):
    """The block's inputs as fresh leaves (same storages), so its graph stands alone; the
    hidden state at ``loc`` is a copy made from such a leaf, so that a block that writes into
    its input in place (``ReLU(inplace=True)``) neither hits autograd's rule against in-place
    writes to leaves nor changes the model's own tensor. Returns ``(args, kwargs, copy)``."""
    a, k = tree_map(lambda t: t.detach().requires_grad_(t.requires_grad)
                    if isinstance(t, torch.Tensor) else t, (args, kwargs))
    x = None
    if loc is not None:
        a, k = list(a), dict(k)
        where = a if loc[0] == "a" else k
        x = where[loc[1]] = where[loc[1]].clone()
        a = tuple(a)
    return a, k, x


def ctx_held(outs, known: set) -> tuple[int, tuple]:
    """Bytes of the distinct storages that custom autograd Functions in the graph of ``outs``
    hold as ctx attributes (``ctx.x = t``, also inside a list, tuple or dict attribute), other
    than the storages in ``known``; and the Functions' names.

    NB: the ctx of a custom Function is its backward node (a ``BackwardCFunction``), and its
    attributes live in the node's ``__dict__``; what it saved with ``save_for_backward`` is
    not there. Such tensors are freed only with the graph, after the block's backward: the
    runtime's saved-tensor hooks (recompute, offload) never see them.
    """
    from torch.autograd.function import BackwardCFunction
    seen_nodes, seen, total, names = set(), set(known), 0, []
    todo = [t.grad_fn for t in outs if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        todo.extend(n for n, _ in node.next_functions)
        if not isinstance(node, BackwardCFunction):
            continue
        held = 0
        for v in vars(node).values():
            items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) \
                else (v,)
            for t in items:
                if not isinstance(t, torch.Tensor):
                    continue
                key = _storage_key(t)
                if key is None or key in seen:
                    continue
                seen.add(key)
                held += _storage_nbytes(t)
        if held:
            total += held
            name = type(node).__name__.removesuffix("Backward")
            if name not in names:
                names.append(name)
    return total, tuple(names)


def _profile_isolated(u: _Unit, fn, args, kwargs, loc, tracker, device, timing):
    """Forward then backward of one block on fresh leaves, under the tracker. Returns its
    output (detached), whether it wrote into its hidden state in place, and whether its
    output requires grad."""
    with _Paused(tracker):
        a, k, x = _leaf_copy(args, kwargs, loc)
    u.side_keys = {_storage_key(t) for t in tree_flatten((a, k))[0]
                   if isinstance(t, torch.Tensor) and t is not x}
    version = x._version if x is not None else None
    tracker.set(u, "fwd")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start_mem = torch.cuda.memory_allocated(device)
    with torch.autograd.graph.saved_tensors_hooks(tracker.pack, tracker.unpack):
        out = fn(*a, **k)
    mutated = x is not None and x._version != version
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    # what its custom Functions hold as ctx attributes, beyond what autograd saved and the
    # block's own inputs (kept by reference under every plan anyway)
    known = set(tracker.static_keys) | u.side_keys | {v[2] for v in u.saved.values()}
    if x is not None:
        known.add(_storage_key(x))
    u.ctx_bytes, u.ctx_functions = ctx_held(outs, known)
    with _Paused(tracker):
        grads = [torch.ones_like(t) for t in outs]
    tracker.set(u, "bwd")
    if outs:
        torch.autograd.backward(outs, grads)
    tracker.set(None)
    peak = None
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) - start_mem
    result = tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)
    for t in tree_flatten(result)[0]:
        if isinstance(t, torch.Tensor):
            tracker.adopt(t, u)
    needs = bool(outs)
    del out, outs
    if peak is not None:
        timing[u.name] = ([], [], peak)
    return result, mutated, needs


def _time_block(u: _Unit, fn, args, kwargs, loc, snap, device, repeats, timing):
    """Forward and backward seconds of one block: a warm-up, then repeats until stable.

    Runs outside every profiling mode, so the instrumentation costs nothing here. Before each
    run the state objects among its arguments (a key/value cache) and its modules' tensor
    attributes (a recurrent state) are put back as the block first found them, so every
    repeat does the same work.
    """
    def once():
        snap.restore()
        a, k, _ = _leaf_copy(args, kwargs, loc)
        _sync(device)
        t0 = time.perf_counter()
        o = fn(*a, **k)
        _sync(device)
        t1 = time.perf_counter()
        outs = [t for t in tree_flatten(o)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        _sync(device)
        return t1 - t0, time.perf_counter() - t1

    fs, bs = [], []
    with _disable_current_modes():
        once()                                 # warm-up
        rep = _Repeats(repeats)
        while not rep.done(len(fs), (fs, bs)):
            f, b = once()
            fs.append(f)
            bs.append(b)
        snap.restore()
    timing[u.name] = (fs, bs, timing.get(u.name, (None, None, None))[2])


def _time_ends(model, inputs, device, repeats, marks, timing, tracker, prologues, block_names):
    """Time ``embedding``, ``head`` and the prologues between blocks in the full step; blocks
    run under no_grad meanwhile."""
    samples = {EMBEDDING: ([], []), HEAD: ([], [])}
    gaps = [i for i, n in enumerate(block_names) if n in prologues
            and (prologues[n].fwd.calls or prologues[n].bwd.calls)]
    for i in gaps:
        samples[("prologue", block_names[i])] = ([], [])

    def once():
        for k in ("start", "end", "bwd"):
            marks[k] = {}
        _sync(device)
        t0 = time.perf_counter()
        out = _call(model, inputs)
        loss = _loss_of(out)
        _sync(device)
        t1 = time.perf_counter()
        loss.backward()
        _sync(device)
        t2 = time.perf_counter()
        if not {"emb_fwd_end", "head_fwd_start"} <= set(marks):
            return False
        samples[EMBEDDING][0].append(marks["emb_fwd_end"] - t0)
        samples[HEAD][0].append(t1 - marks["head_fwd_start"])
        samples[HEAD][1].append(marks.get("head_bwd_end", t2) - t1)
        samples[EMBEDDING][1].append(t2 - marks.get("emb_bwd_start", t2))
        st, en, bw = marks["start"], marks["end"], marks["bwd"]
        for i in gaps:
            fs, bs = samples[("prologue", block_names[i])]
            if i in st and i - 1 in en:
                fs.append(max(0.0, st[i] - en[i - 1]))
            if i in bw and i - 1 in bw:
                bs.append(max(0.0, bw[i - 1] - bw[i]))
        return True

    marks["timing"] = True
    try:
        with _Paused(tracker):
            once()                             # warm-up
            for xs in (x for pair in samples.values() for x in pair):
                xs.clear()
            rep = _Repeats(repeats)
            n = 0
            while not rep.done(n, [xs for pair in samples.values() for xs in pair]):
                if not once():
                    break
                n += 1
    finally:
        marks["timing"] = False
    for key, (fs, bs) in samples.items():
        timing[key] = (fs, bs, None)


def _assemble(model, inputs, units, prologues, rep_of, blockset, tracker, timing, attention,
              params, grad_idents, hardware, dtype, optimizer, name, config, batch, seq, device,
              measure, repeats, quality, chain_breaks, inplace):
    blocks = blockset.pairs()
    block_names = list(blockset.names)
    # Parameters: charged to the first unit that used them (tied weights once); a parameter
    # of a reused block is charged to that block, as the representative's was.
    owner: dict = {}
    block_of_param = {}
    holders: dict = {}      # id(param) -> every block whose module holds it (shared by identity)
    for bname, block in blocks:
        for p in block.parameters():
            block_of_param.setdefault(id(p), bname)
            holders.setdefault(id(p), set()).add(bname)
    for p in params:
        owner[id(p)] = block_of_param.get(id(p)) or tracker.param_unit.get(id(p), EMBEDDING)
    order = [EMBEDDING] + block_names + [HEAD]
    index = {n: i for i, n in enumerate(order)}
    per_unit = {n: [0, 0, 0, 0, 0] for n in order}        # count, weight, grad, optimizer, master
    tied: dict = {n: set() for n in order}
    tied_grad = {n: 0 for n in order}    # grad bytes of parameters used but charged elsewhere
    outside = {n: 0 for n in order}      # a block's parameters that are not in its module
    for p in params:
        c = per_unit[owner[id(p)]]
        n = p.numel()
        if owner[id(p)] in block_names and block_of_param.get(id(p)) != owner[id(p)]:
            outside[owner[id(p)]] += n
        w, g, o = static_bytes_per_param(p.dtype, optimizer)
        c[0] += n
        c[1] += n * w
        if p.requires_grad:
            c[2] += n * g
            c[3] += n * o
            c[4] += n * master_bytes_per_param(p.dtype, optimizer)
        # every unit that uses it: seen using it in the forward (a representative block's
        # uses stand for its copies' only), or holding it in its module (a layer shared by
        # two blocks, found by identity whatever its names)
        users = set(tracker.param_users.get(id(p), ())) | holders.get(id(p), set()) | \
            {owner[id(p)]}
        for u in users:
            tied[u] |= users - {u}
            if u != owner[id(p)] and p.requires_grad:
                tied_grad[u] += n * g

    records, spreads, ratios = [], {}, {}
    for n in order:
        src = units[rep_of.get(n, n)]
        u = units[n]
        pro = prologues.get(n)
        if u.kind == "block":
            # Shared: what the block saves of its side arguments (masks, rotary tables,
            # encoder outputs, a position bias), which the runtime keeps by reference.
            shared_rows = [(b, prod) for b, prod, key in src.saved.values()
                           if key in src.side_keys]
        else:
            # embedding/head: saved storages another unit made, other than the input
            shared_rows = [(b, prod) for ident, (b, prod, _) in src.saved.items()
                           if prod is not None and prod != src.name and ident != src.input_key]
        saved = sum(b for b, _, _ in src.saved.values())
        saved_new = sum(b for b, prod, _ in src.saved.values() if prod == src.name)
        fwd_ws = max(0, _peak(src.fwd) - saved_new)
        bwd_ws = _peak(src.bwd, exclude=grad_idents)
        fwd_flops, bwd_flops = src.fwd.flops, src.bwd.flops
        fs, bs, peak = timing.get(src.name, ([], [], None))
        if measure:
            fwd_s, bwd_s, samples = _median(fs), _median(bs), len(fs)
        else:
            fwd_s, bwd_s, samples = src.fwd.seconds, src.bwd.seconds, 0
        spread = [_spread(fs), _spread(bs)] if measure else [0.0, 0.0]
        arithmetic_s = fwd_flops / hardware.flops_per_s(dtype)
        if measure and fwd_s > 0 and bwd_s > 0 and fwd_flops > 0 and bwd_flops > 0 \
                and arithmetic_s >= COMPUTE_BOUND * fwd_s:
            ratios[n] = [bwd_s / fwd_s, bwd_flops / fwd_flops]
        if pro is not None and (pro.fwd.calls or pro.bwd.calls):
            # Its prologue: everything it saves is kept by reference (the runtime does not
            # see that code), so it is shared; its producer is this block itself.
            pro_saved = [(b, prod) for b, prod, _ in pro.saved.values()]
            saved += sum(b for b, _ in pro_saved)
            shared_rows += pro_saved
            fwd_flops += pro.fwd.flops
            bwd_flops += pro.bwd.flops
            fwd_ws = max(fwd_ws, _peak(pro.fwd))
            bwd_ws = max(bwd_ws, _peak(pro.bwd, exclude=grad_idents))
            if measure:
                pfs, pbs, _ = timing.get(("prologue", n), ([], [], None))
                fwd_s += _median(pfs)
                bwd_s += _median(pbs)
                spread = [max(spread[0], _spread(pfs)), max(spread[1], _spread(pbs))]
            else:
                fwd_s += pro.fwd.seconds
                bwd_s += pro.bwd.seconds
        if u.kind == "block" and src.ctx_bytes:
            # Held by its custom Functions' ctx until its backward: under every decision, as
            # its prologue's tensors are, so shared (produced by the block itself).
            saved += src.ctx_bytes
            shared_rows.append((src.ctx_bytes, n))
        shared = sum(b for b, _ in shared_rows)
        producers = [prod for b, prod in shared_rows if b]
        # One name for all: the earliest producer (the tensors live at least from there); a
        # tensor no unit made (the user's own input) lives from the first unit, as null says.
        shared_from = None
        if producers and None not in producers:
            shared_from = min(producers, key=lambda p: index.get(p, 0))
        spreads[n] = spread
        count, w, g, o, master = per_unit[n]
        records.append(UnitRecord(
            name=n, kind=u.kind, param_bytes=w, grad_bytes=g, optimizer_bytes=o,
            input_bytes=int(src.input_bytes if u.kind == "block" else u.input_bytes),
            output_bytes=int(src.output_bytes if u.kind == "block" else u.output_bytes),
            saved_bytes=int(saved), workspace_bytes=int(max(fwd_ws, bwd_ws)),
            fwd_flops=int(fwd_flops), bwd_flops=int(bwd_flops),
            fwd_s=float(fwd_s), bwd_s=float(bwd_s), shared_saved_bytes=int(shared),
            shared_from=shared_from if shared else None, param_count=int(count),
            samples=samples, measured_peak_bytes=None if peak is None else int(peak),
            master_bytes=int(master), tied_to=tuple(sorted(tied[n])),
            tied_grad_bytes=int(tied_grad[n]), outside_params=int(outside[n])))

    n_params = sum(p.numel() for p in params)
    static = sum(r.static_bytes for r in records)
    trainable = [p for p in params if p.requires_grad]
    bpp = sum(static_bytes_per_param(p.dtype, optimizer)) if not params else \
        round(static / max(1, n_params))
    # NB: the optimizer reads and writes its whole state once per step (weights, grads, master,
    # moments): roughly 2 x static bytes over memory bandwidth, a memory-bound loop.
    optimizer_s = 2.0 * static / float(hardware.memory_bandwidth or 1.0)
    # NB: a fused/per-tensor AdamW keeps fp32 temporaries of one tensor at a time (two of them:
    # the update and the denominator); a foreach AdamW would hold them for a whole group.
    largest = max((p.numel() for p in trainable), default=0)
    opt_ws = 2 * 4 * largest if optimizer.startswith("adamw") else 4 * largest
    kernels = sorted(attention.kernels)
    args, kwargs = _call_args(inputs)
    model_section = {
        "name": name, "config": config or {}, "batch": int(batch), "seq": int(seq),
        "dtype": dtype, "param_count": int(n_params), "structure_hash": structure_hash(blocks),
        "blocks_path": blockset.paths, "blocks": block_names,
        "params": param_table(model, owner), "inputs": input_table(model.forward, args, kwargs),
        "chain_breaks": chain_breaks, "inplace_input": inplace,
        "state_bytes": int(quality.get("state_bytes", 0)),
        "attention": "+".join(kernels) if kernels else "none (no scaled_dot_product_attention call)",
        "optimizer": optimizer, "bytes_per_param": int(bpp),
        "unique_blocks": len({rep_of.get(n, n) for n in block_names}),
    }
    if measure:
        model_section["timing_quality"] = _timing_quality(records, spreads, ratios, repeats,
                                                          quality.get("other_load_cpus"))
    model_section["warnings"] = _unit_warnings(records, units, rep_of, block_names)
    model_section["identity"] = identity_hash(model_section)
    return Profile(schema=PROFILE_SCHEMA, model=model_section, device=device.type,
                   timing="measured" if measure else "estimated", hardware=hardware.to_dict(),
                   layers=records, optimizer_s=float(optimizer_s),
                   optimizer_workspace_bytes=int(opt_ws))


def _unit_warnings(records, units, rep_of, block_names) -> list[str]:
    """What a plan of this profile cannot act on, in words: one unit holding most of the saved
    activations (blocks too coarse), the embedding and head holding most of them (layers
    outside the blocks), tensors custom Functions keep as ctx attributes."""
    from planner.sizes import fmt_bytes
    out = []
    total = sum(r.saved_bytes for r in records)
    ends = [r for r in records if r.kind != "block"]
    ends_saved = sum(r.saved_bytes for r in ends)
    top = max(records, key=lambda r: r.saved_bytes)
    hint = ("name finer blocks with --blocks (qualified names or patterns, e.g. --blocks "
            "'**.layers.*'; docs/models.md)")
    if total and ends_saved > DOMINANT_SHARE * total:
        held = " and ".join(f"{r.name} {fmt_bytes(r.saved_bytes)}" for r in ends
                            if r.saved_bytes)
        out.append(f"{held} hold {ends_saved / total:.0%} of the {fmt_bytes(total)} of saved "
                   "activations, and no plan recomputes or offloads code outside the blocks; "
                   f"if repeated layers run there, {hint}")
    elif total and top.saved_bytes > DOMINANT_SHARE * total:
        out.append(f"block {top.name} holds {top.saved_bytes / total:.0%} of the "
                   f"{fmt_bytes(total)} of saved activations, so a plan can only recompute or "
                   f"offload them all at once; if it holds repeated layers, {hint}")
    held = [(n, units[rep_of.get(n, n)]) for n in block_names]
    held = [(n, u) for n, u in held if u.ctx_bytes]
    if held:
        n, u = held[0]
        more = f" (and {len(held) - 1} more blocks)" if len(held) > 1 else ""
        fns = ", ".join(u.ctx_functions)
        out.append(f"custom autograd Function {fns} in block {n}{more} keeps "
                   f"{fmt_bytes(u.ctx_bytes)} as ctx attributes rather than through "
                   "ctx.save_for_backward; no plan can recompute or offload those, so the "
                   "profile counts them as held from the block's forward to its backward "
                   "(shared_saved_bytes); save them with ctx.save_for_backward to let plans "
                   "act on them")
    return out


def _timing_quality(records, spreads, ratios, repeats, load, threads=None) -> dict:
    """How far the measured times can be trusted: the spread of every unit, the units whose
    spread is wide or whose backward/forward time ratio disagrees with their FLOP ratio, the
    load other processes put on the CPUs meanwhile, and the warnings that follow."""
    step = sum(r.fwd_s + r.bwd_s for r in records) or 1.0
    secs = {r.name: (r.fwd_s, r.bwd_s) for r in records}
    wide = [n for n, (f, b) in spreads.items() if max(f, b) > WIDE_SPREAD
            and f * secs[n][0] + b * secs[n][1] >= WIDE_SHARE * step]
    odd = {n: [round(m, 2), round(f, 2)] for n, (m, f) in ratios.items()
           if not f / RATIO_FACTOR <= m <= f * RATIO_FACTOR}
    cpus = len(usable_cpus())
    threads = threads or torch.get_num_threads()
    idle = max(0, cpus - threads)          # cores our threads leave to others
    warnings = []
    if load is not None and load >= LOAD_CPUS + idle:
        warnings.append(f"other processes used {load:.2f} CPUs on average while timing "
                        f"(this machine has {cpus}, {threads} used here), so the measured "
                        "times are not this model's; profile on a quiet machine or use "
                        "--timing estimate")
    if wide:
        warnings.append(f"timings of {_names(wide)} vary by more than "
                        f"{WIDE_SPREAD:.0%} between repeats (interquartile range over median), "
                        f"at least {WIDE_SHARE:.0%} of the step; profile on a quiet machine, "
                        "raise --repeats or use --timing estimate")
    if odd:
        warnings.append("backward/forward time ratio of " + ", ".join(
            f"{n} is {m} against a FLOP ratio of {f}" for n, (m, f) in odd.items())
            + f" (more than {RATIO_FACTOR:g}x off for compute-bound units); re-profile on a "
            "quiet machine or use --timing estimate")
    return {"statistic": "median", "repeats": int(repeats),
            "max_repeats": int(MAX_REPEAT_FACTOR * repeats),
            "samples": {r.name: r.samples for r in records},
            "spread": {n: [round(f, 4), round(b, 4)] for n, (f, b) in spreads.items()},
            "other_load_cpus": None if load is None else round(load, 3),
            "threads": int(threads), "ratio_checked": sorted(ratios),
            "wide_spread": wide, "ratio_mismatch": odd, "reliable": not warnings,
            "warnings": warnings}


def _names(names, limit=6) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


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


# ----------------------------------------------------------------------------- resolving MODEL

def _positive_int(value, what) -> int:
    try:
        v = int(str(value))
    except ValueError:
        raise UserError(f"--{what} '{value}' is not an integer; give a positive integer, "
                        f"e.g. --{what} 8") from None
    if v <= 0:
        raise UserError(f"--{what} {v}: must be a positive integer, e.g. --{what} 8")
    if v > MAX_DIM:
        # torch takes tensor sizes as int64: 1e30 ended in a TypeError traceback
        raise UserError(f"--{what} {v}: at most {MAX_DIM:,}")
    return v


MAX_DIM = 2**31 - 1           # one input dimension (batch or sequence length)
MAX_TOKENS = 2**40            # batch x seq: an activation of hidden 2^17 stays within int64


def _load_factory(spec: str):
    mod_name, _, fn_name = spec.partition(":")
    if not mod_name or not fn_name:
        raise UserError(f"model '{spec}': write package.module:function")
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)          # as 'python -m' would: modules of the current folder
    try:
        module = importlib.import_module(mod_name)
    except Exception as e:   # noqa: BLE001 -- any import failure is the user's module
        raise UserError(f"model '{spec}': cannot import module '{mod_name}' "
                        f"({type(e).__name__}: {e}); check the name and PYTHONPATH") from None
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise UserError(f"model '{spec}': module '{mod_name}' has no function '{fn_name}'")
    return fn


def _move(model, device, dtype) -> None:
    """``model.to(device, dtype)`` keeping tied parameters tied.

    Moving to meta builds a new Parameter per module (no shallow copy across device types), which
    would untie a language model's head from its embedding; re-tie them afterwards.
    """
    refs: dict = {}
    for mod in model.modules():
        for n, p in mod._parameters.items():
            if p is not None:
                refs.setdefault(id(p), []).append((mod, n))
    if dtype is not None:
        model.to(dtype)
    model.to(device)
    for group in refs.values():
        first = group[0][0]._parameters[group[0][1]]
        for mod, n in group[1:]:
            mod._parameters[n] = first


def _move_input(t, device, dtype):
    """One leaf of a factory's inputs onto ``device``; floating-point tensors (hidden states,
    float masks) also to ``dtype`` so they match the cast model. Token ids, integer and bool
    masks keep their dtype: casting them would change their meaning."""
    if not isinstance(t, torch.Tensor):
        return t
    if dtype is not None and t.is_floating_point():
        return t.to(device=device, dtype=dtype)
    return t.to(device)


def resolve_model(model_spec: str, batch: int, seq: int, dtype: str | None, device: str):
    """MODEL -> (module on ``device``, inputs on ``device``, name, config, dtype name)."""
    from planner.models import build_model, load_config, make_inputs

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available here; use --device meta "
                        "(estimated times) or --device cpu")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: use bf16, fp16 or fp32")
    is_file = Path(model_spec).suffix in (".yaml", ".yml")
    if ":" in model_spec and not is_file:
        fn = _load_factory(model_spec)
        result = None
        if device == "meta":
            # built under the meta device, a model made the usual way takes no memory: the
            # defaults of transformers' MixtralConfig() (46.7 B parameters, 187 GB in fp32)
            # had the OOM killer end the profile on a 24 GiB host. A factory that cannot run
            # there (it loads a checkpoint, say) runs again as it is.
            try:
                with torch.device("meta"):
                    result = fn(batch, seq)
            except Exception:    # noqa: BLE001 -- the factory is user code; retried below
                result = None
        if result is None:
            try:
                result = fn(batch, seq)
            except Exception as e:   # noqa: BLE001 -- the factory is user code
                raise UserError(f"model '{model_spec}': the factory raised "
                                f"{type(e).__name__}: {e}; fix it or check --batch/--seq") from None
        if not (isinstance(result, tuple) and len(result) == 2
                and isinstance(result[0], torch.nn.Module)):
            raise UserError(f"model '{model_spec}': the factory must return (module, inputs), "
                            f"got {type(result).__name__}")
        model, inputs = result
        cast = DTYPES[dtype] if dtype else None
        _move(model, device, cast)
        inputs = tree_map(lambda t: _move_input(t, device, cast), inputs)
        name = model_spec.split(":")[-1]
        config = {"factory": model_spec}
        if hasattr(model, "config") and hasattr(model.config, "to_dict"):
            config["model_config"] = {k: v for k, v in model.config.to_dict().items()
                                      if isinstance(v, (int, float, str, bool, type(None)))}
        dtype = dtype or _DTYPE_NAMES.get(next((p.dtype for p in model.parameters()
                                                if p.is_floating_point()), torch.float32), "fp32")
        return model, inputs, name, config, dtype
    cfg = load_config(model_spec)
    if seq > cfg["max_seq"]:
        raise UserError(f"--seq {seq} exceeds {cfg['name']}'s context of {cfg['max_seq']} "
                        "tokens; give --seq of at most that")
    dtype = dtype or cfg["dtype"]
    model = build_model(cfg, dtype=dtype, device=device)
    inputs = make_inputs(cfg, batch, seq, device=device)
    return model, inputs, cfg["name"], cfg, dtype


def profile_model(model_spec: str, batch: int, seq: int, *, dtype=None, device="meta",
                  hardware: HardwareSpec, optimizer="adamw", blocks_path=None, repeats=5,
                  progress=None, timing="auto") -> Profile:
    """Profile MODEL (built-in name, model YAML or ``package.module:function``) at one shape."""
    batch = _positive_int(batch, "batch")
    seq = _positive_int(seq, "seq")
    if int(repeats) < 1:
        raise UserError(f"--repeats {repeats}: give at least 1")
    if timing not in TIMINGS:
        raise UserError(f"--timing {timing!r}: use measure or estimate")
    if timing == "measure" and device == "meta":
        raise UserError("--timing measure needs --device cpu or cuda (a meta profile has no "
                        "values to time); use --timing estimate or another --device")
    model, inputs, name, config, dtype = resolve_model(model_spec, batch, seq, dtype, device)
    return profile_module(model, inputs, name=name, hardware=hardware, dtype=dtype,
                          optimizer=optimizer, blocks_path=blocks_path, repeats=int(repeats),
                          config=config, batch=batch, seq=seq, progress=progress,
                          timing=timing)


def default_output(profile: Profile) -> Path:
    """``profiles/<name>-b<B>-s<S>.json`` under the current directory, like any CLI output."""
    m = profile.model
    name = str(m["name"]).replace("/", "_").replace(":", "_")
    return Path("profiles") / f"{name}-b{m['batch']}-s{m['seq']}.json"


def cli_profile(args) -> int:
    from planner.hardware import load_hardware
    from planner.sizes import fmt_bytes

    batch = _positive_int(args.batch, "batch")
    seq = _positive_int(args.seq, "seq")
    if batch * seq > MAX_TOKENS:
        raise UserError(f"--batch {batch} x --seq {seq} = {batch * seq:,} tokens a pass: at most "
                        f"{MAX_TOKENS:,}")
    if args.output and Path(args.output).is_dir():   # say so before a long profile, not after
        raise UserError(f"output '{args.output}' is a directory; give a file name")
    hardware = load_hardware(args.hardware)
    progress = None
    if sys.stderr.isatty():
        def progress(i, n, what):
            print(f"\rprofiling {i + 1}/{n}: {what:<40}", end="", file=sys.stderr, flush=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=WARNING_PREFIX)
        prof = profile_model(args.model, batch, seq, dtype=args.dtype, device=args.device,
                             hardware=hardware, optimizer=args.optimizer,
                             blocks_path=args.blocks, repeats=getattr(args, "repeats", 5),
                             progress=progress, timing=getattr(args, "timing", None) or "auto")
    if progress:
        print(file=sys.stderr)
    m = prof.model
    blocks = [u for u in prof.layers if u.kind == "block"]
    where = m["blocks_path"] or "the top level"
    print(f"blocks: {len(blocks)} in '{where}' ({blocks[0].name} .. {blocks[-1].name}), "
          f"{m['unique_blocks']} profiled, the rest reused")
    print(f"attention kernel assumed: {m['attention']} (target {prof.hardware['name']})")
    print(f"parameters: {m['param_count']:,}; static state {fmt_bytes(prof.static_bytes)} "
          f"({m['bytes_per_param']} B/param, {m['optimizer']}); saved activations "
          f"{fmt_bytes(sum(u.saved_bytes for u in prof.layers))}")
    if m.get("state_bytes"):
        print(f"note: the blocks fill a key/value cache of {fmt_bytes(m['state_bytes'])} "
              "(use_cache is on), held until the model's output is dropped; plans count it "
              "for the whole step. Set model.config.use_cache = False to train without it",
              file=sys.stderr)
    for w in m.get("warnings") or ():
        print(f"plan: warning: {w}", file=sys.stderr)
    quality = m.get("timing_quality")
    if quality:
        load = quality["other_load_cpus"]
        print(f"timing: median of {min(quality['samples'].values())}-"
              f"{max(quality['samples'].values())} repeats per unit, widest spread "
              f"{max(max(v) for v in quality['spread'].values()):.0%}"
              + ("" if load is None else f", other processes {load:.2f} CPUs"))
        for w in quality["warnings"]:
            print(f"plan: warning: timings unreliable: {w}", file=sys.stderr)
    out = Path(args.output) if args.output else default_output(prof)
    write_json_atomic(out, prof.to_dict())
    print(out)
    return 0
