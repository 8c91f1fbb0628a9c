"""Assembling a profile from the instrumented step (``planner.profile.step.Step``): each
parameter charged to one unit (tied weights once) with its static bytes, each unit's record
(saved, shared and workspace bytes, FLOPs, times, their spread), the model section (blocks,
parameter and input tables, identity hash, timing quality) and the warnings about what a plan
of this profile cannot act on.
"""
from __future__ import annotations

import dataclasses

from planner.formats.identity import identity_hash, input_table, param_table, structure_hash
from planner.formats import PROFILE_SCHEMA, Profile, UnitRecord
from planner.profile.calling import _call_args
from planner.profile.optimizer_bytes import master_bytes_per_param, static_bytes_per_param
from planner.profile.timing import COMPUTE_BOUND, _median, _spread, _timing_quality
from planner.profile.tracker import EMBEDDING, HEAD, _peak
from planner.sizes import fmt_bytes

# A profile warns when one unit holds more than this share of all saved activations, or the
# embedding and head together do: what a plan can act on comes in too coarse pieces.
DOMINANT_SHARE = 0.5


@dataclasses.dataclass
class _Charges:
    """Where each parameter is charged, and each unit's static bytes."""

    owner: dict            # id(param) -> the unit charged with it
    per_unit: dict         # unit -> [count, weight, grad, optimizer, master] (counts, bytes)
    tied: dict             # unit -> the other units that use one of its parameters
    tied_grad: dict        # unit -> grad bytes of parameters it uses but charged elsewhere
    outside: dict          # block -> its parameters that are not in its module


def _charge_params(step) -> _Charges:
    """Parameters: charged to the first unit that used them (tied weights once); a parameter
    of a reused block is charged to that block, as the representative's was."""
    blocks, block_names = step.blockset.pairs(), step.block_names
    tracker, optimizer = step.tracker, step.settings.optimizer
    owner: dict = {}
    block_of_param = {}
    holders: dict = {}      # id(param) -> every block whose module holds it (shared by identity)
    for bname, block in blocks:
        for p in block.parameters():
            block_of_param.setdefault(id(p), bname)
            holders.setdefault(id(p), set()).add(bname)
    for p in step.params:
        owner[id(p)] = block_of_param.get(id(p)) or tracker.param_unit.get(id(p), EMBEDDING)
    order = [EMBEDDING] + block_names + [HEAD]
    per_unit = {n: [0, 0, 0, 0, 0] for n in order}        # count, weight, grad, optimizer, master
    tied: dict = {n: set() for n in order}
    tied_grad = {n: 0 for n in order}    # grad bytes of parameters used but charged elsewhere
    outside = {n: 0 for n in order}      # a block's parameters that are not in its module
    for p in step.params:
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
    return _Charges(owner, per_unit, tied, tied_grad, outside)


def _unit_record(step, n: str, index: dict, charges: _Charges):
    """Unit ``n``'s record (from its representative's, with its prologue's added), the spread
    of its times, and its backward/forward time and FLOP ratios where those are checked
    (else None)."""
    units, timing, grad_idents = step.units, step.timing, step.grad_idents
    measure, hardware = step.settings.measure, step.settings.hardware
    src = units[step.rep_of.get(n, n)]
    u = units[n]
    pro = step.prologues.get(n)
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
    arithmetic_s = fwd_flops / hardware.flops_per_s(step.settings.dtype)
    ratio = None
    if measure and fwd_s > 0 and bwd_s > 0 and fwd_flops > 0 and bwd_flops > 0 \
            and arithmetic_s >= COMPUTE_BOUND * fwd_s:
        ratio = [bwd_s / fwd_s, bwd_flops / fwd_flops]
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
    count, w, g, o, master = charges.per_unit[n]
    return UnitRecord(
        name=n, kind=u.kind, param_bytes=w, grad_bytes=g, optimizer_bytes=o,
        input_bytes=int(src.input_bytes if u.kind == "block" else u.input_bytes),
        output_bytes=int(src.output_bytes if u.kind == "block" else u.output_bytes),
        saved_bytes=int(saved), workspace_bytes=int(max(fwd_ws, bwd_ws)),
        fwd_flops=int(fwd_flops), bwd_flops=int(bwd_flops),
        fwd_s=float(fwd_s), bwd_s=float(bwd_s), shared_saved_bytes=int(shared),
        shared_from=shared_from if shared else None, param_count=int(count),
        samples=samples, measured_peak_bytes=None if peak is None else int(peak),
        master_bytes=int(master), tied_to=tuple(sorted(charges.tied[n])),
        tied_grad_bytes=int(charges.tied_grad[n]),
        outside_params=int(charges.outside[n])), spread, ratio


def _assemble(step) -> Profile:
    """The profile of the instrumented ``step``."""
    settings, params, optimizer = step.settings, step.params, step.settings.optimizer
    block_names = step.block_names
    charges = _charge_params(step)
    order = [EMBEDDING] + block_names + [HEAD]
    index = {n: i for i, n in enumerate(order)}
    records, spreads, ratios = [], {}, {}
    for n in order:
        record, spread, ratio = _unit_record(step, n, index, charges)
        if ratio is not None:
            ratios[n] = ratio
        spreads[n] = spread
        records.append(record)

    n_params = sum(p.numel() for p in params)
    static = sum(r.static_bytes for r in records)
    trainable = [p for p in params if p.requires_grad]
    bpp = sum(static_bytes_per_param(p.dtype, optimizer)) if not params else \
        round(static / max(1, n_params))
    # The optimizer reads and writes its whole state once per step (weights, grads, master,
    # moments): roughly 2 x static bytes over memory bandwidth, a memory-bound loop.
    optimizer_s = 2.0 * static / float(settings.hardware.memory_bandwidth or 1.0)
    # A fused/per-tensor AdamW keeps fp32 temporaries of one tensor at a time (two of them:
    # the update and the denominator); a foreach AdamW would hold them for a whole group.
    largest = max((p.numel() for p in trainable), default=0)
    opt_ws = 2 * 4 * largest if optimizer.startswith("adamw") else 4 * largest
    model_section = _model_section(step, charges.owner, n_params, bpp)
    if settings.measure:
        model_section["timing_quality"] = _timing_quality(
            records, spreads, ratios, settings.repeats, step.quality.get("other_load_cpus"))
        model_section["timing_quality"]["in_step_scale"] = step.quality.get("in_step_scale")
    if settings.compute_threads:
        model_section["compute_threads"] = int(settings.compute_threads)
    model_section["warnings"] = _unit_warnings(records, step.units, step.rep_of, block_names)
    model_section["identity"] = identity_hash(model_section)
    return Profile(schema=PROFILE_SCHEMA, model=model_section, device=settings.device.type,
                   timing="measured" if settings.measure else "estimated",
                   hardware=settings.hardware.to_dict(), layers=records,
                   optimizer_s=float(optimizer_s), optimizer_workspace_bytes=int(opt_ws))


def _model_section(step, owner: dict, n_params: int, bpp: int) -> dict:
    """The profile's ``model`` section, timing quality, warnings and identity aside."""
    s, blockset, block_names = step.settings, step.blockset, step.block_names
    kernels = sorted(step.attention.kernels)
    args, kwargs = _call_args(step.inputs)
    return {
        "name": s.name, "config": s.config or {}, "batch": int(s.batch), "seq": int(s.seq),
        "dtype": s.dtype, "param_count": int(n_params),
        "structure_hash": structure_hash(blockset.pairs()),
        "blocks_path": blockset.paths, "blocks": block_names,
        "params": param_table(step.model, owner),
        "inputs": input_table(step.model.forward, args, kwargs),
        "chain_breaks": step.chain_breaks, "inplace_input": step.inplace,
        "not_replayable": step.not_replayable,
        "state_bytes": int(step.quality.get("state_bytes", 0)),
        "attention": "+".join(kernels) if kernels else "none (no scaled_dot_product_attention call)",
        "optimizer": s.optimizer, "bytes_per_param": int(bpp),
        "unique_blocks": len({step.rep_of.get(n, n) for n in block_names}),
    }


def _unit_warnings(records, units, rep_of, block_names) -> list[str]:
    """What a plan of this profile cannot act on, in words: one unit holding most of the saved
    activations (blocks too coarse), the embedding and head holding most of them (layers
    outside the blocks), tensors custom Functions keep as ctx attributes."""
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
