"""The instrumented step: what one profile is taken with (``Settings``) and the state of the
profiled forward and backward (``Step``): the units and their records, which block stands for
which, the blocks' wrappers (``Step.wrap``: the first block of each kind runs apart, the rest
reuse its record) and the main-graph marks by which ``_time_ends`` times the embedding, the
head and the prologues between blocks.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import time

import torch
from torch.utils._pytree import tree_flatten

from planner.formats.calls import StateSnapshot, hidden_location, hidden_of, same_tensor
from planner.formats import HardwareSpec
from planner.profile.calling import _block_kind, _call, _loss_of, _sig, _tensor_bytes
from planner.profile.isolated import _profile_isolated
from planner.profile.sdpa import _TargetAttention
from planner.profile.timing import _Repeats, _median, _sync
from planner.profile.tracker import EMBEDDING, HEAD, _Bridge, _Paused, _storage_key, _Tracker, _Unit


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one profile is taken with."""

    name: str                  # the model's name in the profile
    who: str                   # the MODEL argument, for error messages
    hardware: HardwareSpec     # the target: estimated times and the attention kernel
    dtype: str
    optimizer: str
    repeats: int               # least timed repeats per unit
    config: dict | None
    batch: int
    seq: int
    progress: object           # progress(i, n, what) or None
    device: torch.device       # where the model's parameters are
    measure: bool              # times are measured (else estimated from the spec)
    target: str                # "cuda" or "cpu": the target's device type
    compute_threads: int = 0   # torch's intra-op threads while timing on a CPU (0: not set)


@dataclasses.dataclass
class Step:
    """The state of the instrumented step, filled by the blocks' wrappers as the forward runs
    and read by ``planner.profile.assemble``."""

    settings: Settings
    model: object
    inputs: object
    blockset: object
    params: list               # the model's parameters, tied ones once
    tracker: _Tracker
    attention: _TargetAttention
    units: dict                # unit name -> _Unit: embedding, the blocks, head
    # The code between two blocks (a stack's final norm, the next stack's embedding) is the
    # later block's prologue: charged to it, kept by reference (docs/models.md).
    prologues: dict            # block name -> its prologue's _Unit (all blocks but the first)
    kinds: dict = dataclasses.field(default_factory=dict)       # kind + signature -> rep. name
    rep_of: dict = dataclasses.field(default_factory=dict)      # block -> representative block
    needs_grad: dict = dataclasses.field(default_factory=dict)  # kind + sig -> output needs grad
    inplace_kinds: set = dataclasses.field(default_factory=set)
    # unit name (or ("prologue", block)) -> (fwd samples, bwd samples, measured peak)
    timing: dict = dataclasses.field(default_factory=dict)
    marks: dict = dataclasses.field(default_factory=dict)   # main-graph timestamps
    jobs: list = dataclasses.field(default_factory=list)    # representative blocks to time
    chain_breaks: list = dataclasses.field(default_factory=list)  # hidden state not the last's
    inplace: list = dataclasses.field(default_factory=list)  # write their hidden state in place
    # (block, the state objects among its arguments as it found them): a tensor in them
    # written in place before the backward makes the block's forward unreplayable
    state_snaps: list = dataclasses.field(default_factory=list)
    not_replayable: list = dataclasses.field(default_factory=list)
    runs: dict = dataclasses.field(default_factory=dict)    # block -> runs in the forward
    last_out: object = None    # the previous block's output hidden state, as the model got it
    last_call: object = None   # the last block's arguments (to weigh the cache they carry)
    grad_idents: set = dataclasses.field(default_factory=set)   # storages of parameter grads
    quality: dict = dataclasses.field(default_factory=dict)     # state bytes, other load

    @classmethod
    def build(cls, model, inputs, blockset, settings: Settings) -> "Step":
        on_meta = settings.device.type == "meta"
        block_names = list(blockset.names)
        params = list(dict.fromkeys(model.parameters()))     # tied parameters once
        param_keys: dict = {}
        for p in params:
            param_keys.setdefault(_storage_key(p), []).append(p)
        static_keys = set(param_keys) | {_storage_key(b) for b in model.buffers()}
        tracker = _Tracker(param_keys, static_keys, settings.hardware, settings.dtype)
        attention = _TargetAttention(settings.target, emulate=on_meta)
        tracker.cpu_on_meta = settings.target == "cpu" and on_meta
        units = {EMBEDDING: _Unit(EMBEDDING, "embedding")}
        units.update({n: _Unit(n, "block") for n in block_names})
        units[HEAD] = _Unit(HEAD, "head")
        prologues = {n: _Unit(n, "prologue") for n in block_names[1:]}
        return cls(settings, model, inputs, blockset, params, tracker, attention, units,
                   prologues)

    @property
    def block_names(self) -> list:
        return list(self.blockset.names)

    @property
    def last(self) -> int:
        return len(self.blockset.names) - 1

    def note(self, i, what):
        if self.settings.progress:
            self.settings.progress(i, len(self.blockset.names) + 2, what)

    # -- the blocks' wrappers

    def wrap(self, index, bname, block, orig):
        """The forward that replaces block ``index``'s for the profiled step."""
        def wrapped(*args, **kwargs):
            return self.call_block(index, bname, block, orig, args, kwargs)
        return wrapped

    def call_block(self, index, bname, block, orig, args, kwargs):
        u = self.units[bname]
        timing_pass = bool(self.marks.get("timing"))
        main_out = snap = None
        _sync(self.settings.device)
        self.marks.setdefault("start", {})[index] = time.perf_counter()
        if index == 0:
            self.marks["emb_fwd_end"] = self.marks["start"][0]
        loc, main_in = hidden_location(args, kwargs)
        if not timing_pass:
            self.runs[bname] = self.runs.get(bname, 0) + 1
            self.last_call = (args, kwargs)
            self.state_snaps.append((bname, StateSnapshot(args, kwargs, module=block)))
            if index and not same_tensor(main_in, self.last_out):
                self.chain_breaks.append(bname)
        key = (_block_kind(block), _sig((args, kwargs)))
        grad_in = [t for t in tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if key in self.kinds or timing_pass:
            if not timing_pass:
                self.rep_of[bname] = self.kinds[key]
            with _Paused(self.tracker), torch.no_grad():
                out = orig(*args, **kwargs)
        else:
            # the snapshot lives as long as this call, as the arguments do
            out, snap = self._first_of_kind(index, bname, block, orig, args, kwargs, loc, key)
        if key in self.inplace_kinds and not timing_pass:
            self.inplace.append(bname)
        if not timing_pass:
            # The output's hidden state stays referenced until the bridged outputs are
            # adopted, so that its storage keeps its tracker entry (and the head's input its
            # name) while the unbridged outputs die.
            main_out = self._record_output(index, u, out, main_in)
        names = self.block_names
        self.tracker.set(self.units[HEAD] if index == self.last
                         else self.prologues[names[index + 1]])
        _sync(self.settings.device)
        self.marks.setdefault("end", {})[index] = time.perf_counter()
        if index == self.last:
            self.marks["head_fwd_start"] = self.marks["end"][index]
        out = self._bridged(index, out, grad_in, key)
        if not timing_pass:
            for t in tree_flatten(out)[0]:       # the bridged outputs, same storages
                if isinstance(t, torch.Tensor):
                    self.tracker.adopt(t, u)
        self.last_out = hidden_of(out)
        del main_out, snap
        return out

    def _first_of_kind(self, index, bname, block, orig, args, kwargs, loc, key):
        """The first block of its kind: run apart, forward and backward, under the tracker."""
        self.kinds[key] = bname
        self.rep_of[bname] = bname
        self.note(index + 1, bname)
        u = self.units[bname]
        snap = StateSnapshot(args, kwargs, module=block)
        out, mutated, self.needs_grad[key] = _profile_isolated(
            u, orig, args, kwargs, loc, self.tracker, self.settings.device, self.timing)
        if mutated:
            self.inplace_kinds.add(key)
        if self.settings.measure:
            self.jobs.append((u, orig, args, kwargs, loc, snap))
        return out, snap

    def _record_output(self, index, u: _Unit, out, main_in):
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.tracker.adopt(t, u)
        u.input_key = self.tracker.ident(main_in)[0] if main_in is not None else None
        u.input_bytes = _tensor_bytes(main_in)
        u.output_bytes = _tensor_bytes(out)
        main_out = hidden_of(out)
        if index == self.last and main_out is not None:
            self.units[HEAD].input_key = self.tracker.ident(main_out)[0]
        return main_out

    def _bridged(self, index, out, grad_in, key):
        """``out`` joined to the block's inputs in the main graph (``_Bridge``), so that the
        backward reaches the code before the block and marks when it does."""
        flat, spec = tree_flatten(out)
        pos = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor)
               and t.is_floating_point()]
        if not (pos and torch.is_grad_enabled() and (grad_in or self.needs_grad.get(key))):
            return out
        hook = functools.partial(self._backward_reached, index)
        with _Paused(self.tracker):
            ins = grad_in or [torch.zeros((), device=self.settings.device, requires_grad=True)]
            joined = _Bridge.apply(hook, self.tracker, len(ins), *ins, *[flat[i] for i in pos])
        for i, t in zip(pos, joined):
            flat[i] = t
        return spec.unflatten(flat)

    def _backward_reached(self, index):
        """The main graph's backward reached block ``index``'s inputs: from here on it runs
        that block's prologue (or the embedding, before the first block)."""
        _sync(self.settings.device)
        now = time.perf_counter()
        self.marks.setdefault("bwd", {})[index] = now
        if index == self.last:
            self.marks["head_bwd_end"] = now
        if index == 0:
            self.marks["emb_bwd_start"] = now
            self.tracker.set(self.units[EMBEDDING], "bwd")
        else:
            self.tracker.set(self.prologues[self.block_names[index]], "bwd")


def _time_ends(step: Step):
    """Time ``embedding``, ``head`` and the prologues between blocks in the full step; blocks
    run under no_grad meanwhile."""
    model, inputs, device = step.model, step.inputs, step.settings.device
    marks, prologues, block_names = step.marks, step.prologues, step.block_names
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
        with _Paused(step.tracker):
            once()                             # warm-up
            for xs in (x for pair in samples.values() for x in pair):
                xs.clear()
            rep = _Repeats(step.settings.repeats)
            n = 0
            while not rep.done(n, [xs for pair in samples.values() for xs in pair]):
                if not once():
                    break
                n += 1
    finally:
        marks["timing"] = False
    for key, (fs, bs) in samples.items():
        step.timing[key] = (fs, bs, None)


# A whole step is timed to scale the blocks' isolated times only where its activations take
# at most this share of the memory available: the instrumented step ran the blocks one kind
# at a time, a plain step holds every block's saved tensors at once.
IN_STEP_MEMORY_SHARE = 0.25
# Scale factors outside this range are not applied (a timing upset, not a cache effect).
IN_STEP_SCALE_RANGE = (0.5, 2.0)


def _available_bytes(device) -> int | None:
    """Memory a plain step could take on ``device`` (CPU: MemAvailable; CUDA: free)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _time_in_step(step: Step, model, inputs) -> None:
    """Scale the blocks' isolated times to a whole step. Each representative block is timed
    on its own, over and over, with its weights and activations warm in the caches; in a step
    every block's weights come cold from memory (the built-in GPT of bench/models/gpt-stream.yaml
    at 1 thread here: a block's forward 2.99 ms timed alone, 3.44 ms inside a step, the step
    1.07x the units' sum). The plain model's forward and backward are timed ``repeats`` times;
    per direction, what the step took beyond the embedding, head and prologues (timed in the
    step already) over the blocks' summed isolated times is the factor applied to every
    block's samples. Recorded in ``step.quality["in_step_scale"]`` ([forward, backward], null
    where not applied: no blocks, a step too large for the memory, or a factor out of range)."""
    settings = step.settings
    device = settings.device
    names = step.block_names
    step.quality["in_step_scale"] = None
    reps = [step.rep_of.get(n, n) for n in names]
    if not names or any(r not in step.timing for r in reps):
        return
    saved = sum(b for n in reps for b, *_ in step.units[n].saved.values()) + sum(
        b for n in (EMBEDDING, HEAD) for b, *_ in step.units[n].saved.values())
    avail = _available_bytes(device)
    if avail is None or saved > IN_STEP_MEMORY_SHARE * avail:
        return
    fwd, bwd = [], []
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            rep = _Repeats(settings.repeats)
            n = 0
            while not rep.done(n, [fwd, bwd]) or n < 2:
                _sync(device)
                t0 = time.perf_counter()
                loss = _loss_of(_call(model, inputs))
                _sync(device)
                t1 = time.perf_counter()
                loss.backward()
                _sync(device)
                t2 = time.perf_counter()
                del loss
                if n:                               # the first is a warm-up
                    fwd.append(t1 - t0)
                    bwd.append(t2 - t1)
                n += 1
    except torch.OutOfMemoryError:
        return
    finally:
        for p in model.parameters():
            p.grad = None
    ends = [k for k in step.timing if k in (EMBEDDING, HEAD) or
            (isinstance(k, tuple) and k[0] == "prologue")]
    scale = []
    for d, measured in ((0, _median(fwd)), (1, _median(bwd))):
        blocks = sum(_median(step.timing[r][d]) for r in reps)
        rest = sum(_median(step.timing[k][d]) for k in ends)
        f = (measured - rest) / blocks if blocks > 0 else 0.0
        if not IN_STEP_SCALE_RANGE[0] <= f <= IN_STEP_SCALE_RANGE[1]:
            return
        scale.append(f)
    for r in dict.fromkeys(reps):
        fs, bs, peak = step.timing[r]
        step.timing[r] = ([x * scale[0] for x in fs], [x * scale[1] for x in bs], peak)
    step.quality["in_step_scale"] = [round(scale[0], 4), round(scale[1], 4)]
