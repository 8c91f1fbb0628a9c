"""Taking one profile: ``profile_module`` (an already-built model on its inputs) and
``profile_model`` (MODEL resolved first), and ``_profile``, the instrumented step's stages:
wrap the blocks, run the forward and backward under the tracker, time the units, put the model
back as it came, assemble the profile.
"""
from __future__ import annotations

import contextlib
import os
import warnings

import torch

from planner.formats.calls import state_tensor_bytes
from planner.blocks.detect import detect_blocks
from planner.errors import UserError
from planner.formats import HardwareSpec, Profile
from planner.profile.assemble import _assemble
from planner.profile.calling import _call, _loss_of, _tensor_bytes, _user_code
from planner.profile.isolated import _time_block
from planner.profile.load import _DTYPE_NAMES, _positive_int, resolve_model
from planner.profile.optimizer_bytes import OPTIMIZERS
from planner.profile.step import Settings, Step, _time_ends, _time_in_step
from planner.profile.timing import _LoadMeter
from planner.profile.tracker import EMBEDDING, HEAD

TIMINGS = ("auto", "measure", "estimate")
# profile_module's warnings (model.warnings) start so; ``plan profile`` prints them itself
WARNING_PREFIX = "tierplan: profile: "


def profile_module(model, inputs, *, name: str, hardware: HardwareSpec, dtype: str | None = None,
                   optimizer: str = "adamw", blocks_path=None, repeats: int = 5,
                   config: dict | None = None, batch: int = 0, seq: int = 0,
                   progress=None, timing: str = "auto",
                   compute_threads: int | None = None) -> Profile:
    """Profile an already-built ``model`` on ``inputs`` (a dict of keyword arguments or a tuple).

    The device is the parameters' device (``meta``, ``cpu`` or ``cuda``); ``hardware`` is the
    target the estimate and the attention kernel are for. ``blocks_path`` is ``--blocks``
    (names or patterns; None: found from the forward). ``timing``: ``measure`` (cpu/cuda),
    ``estimate`` (from FLOPs and bytes on the hardware spec, any device), ``auto`` (measure
    where the device can). ``compute_threads``: torch's intra-op threads while times are
    measured on a CPU device (None: ``default_compute_threads()``); the profile records it and
    a plan's runtime computes with as many (docs/runtime.md, "Compute threads on a CPU host").
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
        threads = 0
        if measure and device.type == "cpu":
            threads = check_compute_threads(compute_threads)
        settings = Settings(name=name, who=who, hardware=hardware, dtype=dtype,
                            optimizer=optimizer, repeats=repeats, config=config, batch=batch,
                            seq=seq, progress=progress, device=device, measure=measure,
                            target=target, compute_threads=threads)
        with torch_threads(threads):
            prof = _profile(model, inputs, blockset, settings)
        for w in prof.model["warnings"]:
            warnings.warn(f"{WARNING_PREFIX}{w}", stacklevel=2)
        return prof
    finally:
        model.train(was_training)
        with torch.no_grad():
            for b, v in buffers:
                b.copy_(v)


def _profile(model, inputs, blockset, settings: Settings) -> Profile:
    """The instrumented step of ``model``: its blocks wrapped (``Step.wrap``), one forward and
    backward under the tracker, the units timed where times are measured; then the model put
    back as it came (its blocks' forwards, its parameters' grads and flags) and the profile
    assembled."""
    step = Step.build(model, inputs, blockset, settings)
    originals = []
    grad_flags = [(p, p.requires_grad) for p in step.params]
    try:
        for i, (bname, block) in enumerate(blockset.pairs()):
            orig = block.forward
            originals.append((block, "forward" in block.__dict__, block.__dict__.get("forward")))
            block.forward = step.wrap(i, bname, block, orig)
        devices = [settings.device] if settings.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            _forward_backward(step)
            if settings.measure:
                _time_units(step)
    finally:
        # the last block's output (timing runs the step again) would keep the step alive
        # through its bridge's backward hook, holding the device tensor: the old closures did not
        step.last_out = None
        for block, had, fwd in originals:
            if had:
                block.forward = fwd
            else:
                del block.forward
        for p, flag in grad_flags:
            p.grad = None
            p.requires_grad_(flag)
    if settings.measure:
        # the blocks as the model runs them, cold caches and all (their forwards are the
        # model's own again)
        _time_in_step(step, model, step.inputs)
    return _assemble(step)


def _forward_backward(step: Step) -> None:
    """The instrumented step: embedding, prologues and head in the main graph, blocks apart
    (under their wrappers); then the units' boundary bytes, the key/value cache the blocks
    filled and the storages of the parameters' gradients."""
    settings, units, tracker, attention = step.settings, step.units, step.tracker, step.attention
    who, on_meta, block_names = settings.who, settings.device.type == "meta", step.block_names
    step.note(0, EMBEDDING)
    with attention, tracker, torch.autograd.graph.saved_tensors_hooks(tracker.pack,
                                                                     tracker.unpack):
        tracker.set(units[EMBEDDING])
        out = _user_code(who, "forward", _call, step.model, step.inputs, meta=on_meta)
        loss = _loss_of(out, who)
        tracker.set(None)
    step.last_out = None
    # A block whose state arguments (a cache: Jamba's per-layer counters and convolution
    # states in transformers 5.25) hold a tensor written in place since it ran, by itself or
    # a later block, cannot be run again as it first ran: the runtime refuses to recompute it
    # (``runtime.calls.CallState.replay``, the same test), so the plan must keep or offload it.
    step.not_replayable = [n for n, snap in step.state_snaps if snap.changed_in_place()]
    step.state_snaps = []
    # A key/value cache the blocks filled (use_cache at its Hugging Face default) holds a copy
    # of every block's keys and values until the output is dropped: bytes no unit saves, which
    # the plan does not count.
    step.quality["state_bytes"] = state_tensor_bytes(*step.last_call) if step.last_call else 0
    step.last_call = None
    odd = [n for n in block_names if step.runs.get(n, 0) != 1]
    if odd:
        # A block found in one forward that does not run once in the next (a path that
        # depends on the data or on a counter) would be planned as 0 bytes and 0 s.
        raise UserError(f"model '{who}': block {odd[0]} ran {step.runs.get(odd[0], 0)} times "
                        "in the profiled forward where it ran once before (its path "
                        "depends on the data?); name blocks that run once per forward "
                        "with --blocks")
    units[HEAD].output_bytes = _tensor_bytes(out)
    units[EMBEDDING].input_bytes = _tensor_bytes(step.inputs)
    first = units[block_names[0]]
    units[HEAD].input_bytes = units[block_names[-1]].output_bytes
    units[EMBEDDING].output_bytes = first.input_bytes
    step.note(len(block_names) + 1, HEAD)
    with attention, tracker:
        tracker.set(units[HEAD], "bwd")
        _user_code(who, "backward", loss.backward, meta=on_meta)
        tracker.set(None)
    step.grad_idents = {tracker.ident(p.grad)[0] for p in step.params if p.grad is not None}


def _time_units(step: Step) -> None:
    """Measured times: each representative block on its own, then the embedding, head and
    prologues in the full step; the load of other processes meanwhile."""
    meter = _LoadMeter()
    settings = step.settings
    for u, fn, args, kwargs, loc, snap in step.jobs:
        _time_block(u, fn, args, kwargs, loc, snap, settings.device, settings.repeats,
                    step.timing)
    step.jobs.clear()
    _time_ends(step)
    step.quality["other_load_cpus"] = meter.other_cpus()


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_compute_threads() -> int:
    """Intra-op threads a CPU profile is timed with by default: every core this process may
    use but one, left to the runtime's transfer thread, and never more than torch uses now (a
    lower ``OMP_NUM_THREADS`` or ``torch.set_num_threads`` of the user's is kept). On a 2-core
    host a pass at 2 threads ran 1.5x slower beside one reader thread at a quarter of its
    time, 2x at half and 27x when the reader never paused; at 1 thread it did not slow at all
    (docs/runtime.md, "Compute threads on a CPU host")."""
    return max(1, min(torch.get_num_threads(), usable_cores() - 1))


def check_compute_threads(n) -> int:
    """``--compute-threads``: a positive count, at most the usable cores; None: the default."""
    if n is None:
        return default_compute_threads()
    cores = usable_cores()
    if isinstance(n, str) and n == "all":
        return cores
    try:
        k = int(n)
    except (TypeError, ValueError):
        k = 0
    if k < 1 or k > cores or str(n).strip() != str(k):
        raise UserError(f"--compute-threads {n!r}: give a count from 1 to {cores} (this "
                        "process's cores) or 'all'")
    return k


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads at ``n`` inside (0: unchanged), as they were after."""
    was = torch.get_num_threads()
    if n and n != was:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n and torch.get_num_threads() != was:
            torch.set_num_threads(was)


def profile_model(model_spec: str, batch: int, seq: int, *, dtype=None, device="meta",
                  hardware: HardwareSpec, optimizer="adamw", blocks_path=None, repeats=5,
                  progress=None, timing="auto", compute_threads=None) -> Profile:
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
    if device == "cpu" and compute_threads is not None:   # before the model is built
        check_compute_threads(compute_threads)
    model, inputs, name, config, dtype = resolve_model(model_spec, batch, seq, dtype, device)
    return profile_module(model, inputs, name=name, hardware=hardware, dtype=dtype,
                          optimizer=optimizer, blocks_path=blocks_path, repeats=int(repeats),
                          config=config, batch=batch, seq=seq, progress=progress,
                          timing=timing, compute_threads=compute_threads)

