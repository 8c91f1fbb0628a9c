"""From per-unit decisions to the ordered events of every stream (``docs/file-formats.md``).

The schedule is what the runtime replays and what the simulator judges: one compute stream
(forwards, then recomputes and backwards in reverse order, then the optimizer step) and one
stream per link (``d2h``, ``h2d``; one ``nvme`` stream because reads and writes share one
device). Each transfer waits for what it needs (``after``) and, for a prefetch, for the
compute event at whose start the plan chose to issue it (``issue``).

This module decides nothing about *which* unit goes where; it only validates the decisions and
lays out the events they imply, so the MILP, the baselines and hand-written plans all share it.
"""
from __future__ import annotations

from .errors import UserError
from .formats import Activation, Event, HardwareSpec, LayerDecision, Stream, Tier, UnitKind, UnitRecord


# ----------------------------------------------------------------------------- event ids

def fwd_id(name: str) -> str:
    return f"F:{name}"


def bwd_id(name: str) -> str:
    return f"B:{name}"


def rec_id(name: str) -> str:
    return f"R:{name}"


OPT_ID = "OPT"


# ----------------------------------------------------------------------------- decisions

def _ckpt(d: LayerDecision) -> Tier:
    return d.checkpoint or Tier.GPU


def validate_layers(units: list[UnitRecord], layers: list[LayerDecision], hw: HardwareSpec) -> None:
    """Raise UserError when the decisions break the rules of ``docs/file-formats.md`` (Layers)."""
    if len(units) != len(layers) or any(u.name != d.name for u, d in zip(units, layers)):
        raise UserError("plan layers do not match the profile's units (names or order); "
                        "give one decision per unit, in execution order")
    prev = None
    for u, d in zip(units, layers):
        if not isinstance(d.activation, Activation):
            raise UserError(f"layer {d.name!r}: activation {d.activation!r} is not an Activation")
        if u.kind in (UnitKind.EMBEDDING.value, UnitKind.HEAD.value) and d.activation is not Activation.KEEP:
            raise UserError(f"layer {d.name!r} ({u.kind}) must be 'keep' in this version, "
                            f"got {d.activation.value!r}")
        if d.activation is Activation.RECOMPUTE and _ckpt(d) is Tier.NONE:
            if prev is None or prev.activation is not Activation.RECOMPUTE:
                raise UserError(f"layer {d.name!r}: checkpoint 'none' must follow a 'recompute' "
                                f"unit, but follows {prev.activation.value if prev else 'nothing'!r}; "
                                "give it a checkpoint tier (gpu, cpu, nvme)")
        uses_cpu = d.activation is Activation.CPU or (
            d.activation is Activation.RECOMPUTE and _ckpt(d) is Tier.CPU)
        if uses_cpu and hw.unified_memory:
            raise UserError(f"layer {d.name!r}: 'cpu' is not allowed on the unified-memory spec "
                            f"{hw.name!r} (no host tier); use 'nvme' or 'recompute'")
        uses_nvme = d.activation is Activation.NVME or (
            d.activation is Activation.RECOMPUTE and _ckpt(d) is Tier.NVME)
        if uses_nvme and (hw.nvme_read_bandwidth <= 0 or hw.nvme_write_bandwidth <= 0):
            raise UserError(f"layer {d.name!r}: 'nvme' needs positive NVMe read/write bandwidth "
                            f"in the hardware spec {hw.name!r}")
        prev = d


def segments(layers: list[LayerDecision]) -> list[list[int]]:
    """Indices of each recompute segment: a ``recompute`` unit whose checkpoint is not ``none``
    followed by every ``recompute``/``none`` unit right after it (Chen et al. 2016)."""
    segs: list[list[int]] = []
    for i, d in enumerate(layers):
        if d.activation is not Activation.RECOMPUTE:
            continue
        if _ckpt(d) is Tier.NONE:
            if not segs or segs[-1][-1] != i - 1:
                raise UserError(f"layer {d.name!r}: checkpoint 'none' must follow a 'recompute' unit")
            segs[-1].append(i)
        else:
            segs.append([i])
    return segs


# ----------------------------------------------------------------------------- schedule

def transfer_seconds(nbytes: int, bandwidth: float) -> float:
    """A transfer takes bytes / bandwidth of its link (the spec's sustained rate)."""
    if nbytes == 0:
        return 0.0
    assert bandwidth > 0, "validate_layers rejects offloads over a link of zero bandwidth"
    return nbytes / bandwidth


def compute_order(units: list[UnitRecord], layers: list[LayerDecision]) -> list[str]:
    """Ids of the compute stream in order: F:0..F:U-1, then per unit in reverse the segment's
    recompute (at the backward of its last unit) and the backward, then OPT."""
    seg_end = {s[-1] for s in segments(layers)}
    order = [fwd_id(u.name) for u in units]
    for i in range(len(units) - 1, -1, -1):
        if i in seg_end:
            order.append(rec_id(units[i].name))
        order.append(bwd_id(units[i].name))
    order.append(OPT_ID)
    return order


def build_schedule(units: list[UnitRecord], layers: list[LayerDecision], hw: HardwareSpec,
                   prefetch_issue: dict[str, str] | None = None,
                   optimizer_s: float = 0.0) -> dict[str, list[Event]]:
    """Lay out every event the decisions imply, per stream, in the order each stream runs them.

    ``prefetch_issue`` maps an offloaded unit (or a recompute unit whose checkpoint is on
    cpu/nvme) to the compute event at whose start its prefetch is issued. Default: the backward
    of the unit whose backward runs just before the consumer (reload one unit ahead, as
    Megatron-LM's fine-grained offloading does).
    """
    validate_layers(units, layers, hw)
    U = len(units)
    segs = segments(layers)
    seg_of = {i: s for s in segs for i in s}
    order = compute_order(units, layers)
    pos = {eid: p for p, eid in enumerate(order)}
    unified = hw.unified_memory

    # -- compute stream
    compute: dict[str, Event] = {}
    for i, u in enumerate(units):
        compute[fwd_id(u.name)] = Event(id=fwd_id(u.name), stream=Stream.COMPUTE, op="forward",
                                        units=(u.name,), seconds=u.fwd_s, stage=i)
    for s in segs:
        e = units[s[-1]].name
        compute[rec_id(e)] = Event(id=rec_id(e), stream=Stream.COMPUTE, op="recompute",
                                   units=tuple(units[j].name for j in s),
                                   seconds=sum(units[j].fwd_s for j in s), stage=2 * U - 1 - s[-1])
    for i, u in enumerate(units):
        compute[bwd_id(u.name)] = Event(id=bwd_id(u.name), stream=Stream.COMPUTE, op="backward",
                                        units=(u.name,), seconds=u.bwd_s, stage=2 * U - 1 - i)
    compute[OPT_ID] = Event(id=OPT_ID, stream=Stream.COMPUTE, op="optimizer", units=(),
                            seconds=float(optimizer_s), stage=2 * U)
    extra_after: dict[str, list[str]] = {eid: [] for eid in compute}

    # -- what must be moved: (unit index, kind "act"|"ck", tier, bytes, consumer compute id)
    moves = []
    for i, (u, d) in enumerate(zip(units, layers)):
        if d.activation in (Activation.CPU, Activation.NVME):
            moves.append((i, "act", Tier(d.activation.value), u.activation_bytes, bwd_id(u.name)))
        elif d.activation is Activation.RECOMPUTE and _ckpt(d) in (Tier.CPU, Tier.NVME):
            moves.append((i, "ck", _ckpt(d), u.input_bytes, rec_id(units[seg_of[i][-1]].name)))

    issue = dict(prefetch_issue or {})
    movable = {units[i].name for i, *_ in moves}
    for name in issue:
        if name not in movable:
            raise UserError(f"prefetch_issue names {name!r}, which is neither offloaded nor a "
                            "recompute unit with a cpu/nvme checkpoint")

    d2h, h2d, nvme = [], [], []   # (sort key, Event)
    for i, kind, tier, nbytes, consumer in moves:
        name = units[i].name
        # The consumer runs at the backward of unit `last`; the default issue point is the
        # backward of the unit after it, whose backward runs just before.
        last = i if kind == "act" else seg_of[i][-1]
        default = bwd_id(units[last + 1].name)
        at = issue.get(name, default)
        if at not in pos:
            raise UserError(f"prefetch_issue[{name!r}] = {at!r} is not a compute event of this plan "
                            "(ids look like 'B:blocks.7', 'F:head', 'R:blocks.3')")
        if not pos[fwd_id(name)] < pos[at] < pos[consumer]:
            raise UserError(f"prefetch_issue[{name!r}] = {at!r} must run after {fwd_id(name)} and "
                            f"before {consumer}, which needs the prefetched bytes")
        p = "" if kind == "act" else "ck"
        out_, w_, r_, in_ = f"{p}out:{name}", f"{p}w:{name}", f"{p}r:{name}", f"{p}in:{name}"
        fwd_stage, issue_stage = i + 1, compute[at].stage
        wkey = (pos[fwd_id(name)] + 1, 0, pos[consumer])   # ready once the next compute starts
        rkey = (pos[at], 1, pos[consumer])
        if unified:
            # No d2h/h2d: the write reads device memory and the read fills it (so r: is the prefetch).
            nvme.append((wkey, Event(id=w_, stream=Stream.NVME, op="write", units=(name,), bytes=nbytes,
                                     seconds=transfer_seconds(nbytes, hw.nvme_write_bandwidth),
                                     after=(fwd_id(name),), stage=fwd_stage)))
            nvme.append((rkey, Event(id=r_, stream=Stream.NVME, op="read", units=(name,), bytes=nbytes,
                                     seconds=transfer_seconds(nbytes, hw.nvme_read_bandwidth),
                                     after=(w_,), issue=at, stage=issue_stage)))
            extra_after[consumer].append(r_)
            continue
        d2h.append(((pos[fwd_id(name)], 0, 0), Event(
            id=out_, stream=Stream.D2H, op="offload", units=(name,), bytes=nbytes,
            seconds=transfer_seconds(nbytes, hw.d2h_bandwidth), after=(fwd_id(name),),
            stage=fwd_stage)))
        if tier is Tier.NVME:
            nvme.append((wkey, Event(id=w_, stream=Stream.NVME, op="write", units=(name,), bytes=nbytes,
                                     seconds=transfer_seconds(nbytes, hw.nvme_write_bandwidth),
                                     after=(out_,), stage=fwd_stage)))
            nvme.append((rkey, Event(id=r_, stream=Stream.NVME, op="read", units=(name,), bytes=nbytes,
                                     seconds=transfer_seconds(nbytes, hw.nvme_read_bandwidth),
                                     after=(w_,), issue=at, stage=issue_stage)))
            in_after, in_issue = (r_,), None
        else:
            # The host copy must be complete before it is read back (out: before in:).
            in_after, in_issue = (out_,), at
        h2d.append((rkey, Event(id=in_, stream=Stream.H2D, op="prefetch", units=(name,), bytes=nbytes,
                                seconds=transfer_seconds(nbytes, hw.h2d_bandwidth), after=in_after,
                                issue=in_issue, stage=issue_stage)))
        extra_after[consumer].append(in_)

    schedule = {Stream.COMPUTE.value: [
        Event(**{**_fields(compute[eid]), "after": tuple(extra_after[eid])}) for eid in order]}
    if not unified:
        schedule[Stream.D2H.value] = [e for _, e in sorted(d2h, key=lambda x: x[0])]
        schedule[Stream.H2D.value] = [e for _, e in sorted(h2d, key=lambda x: x[0])]
    schedule[Stream.NVME.value] = [e for _, e in sorted(nvme, key=lambda x: x[0])]
    assert all(e.id in pos or e.stream is not Stream.COMPUTE for evs in schedule.values() for e in evs)
    return schedule


def _fields(e: Event) -> dict:
    return {"id": e.id, "stream": e.stream, "op": e.op, "units": e.units, "bytes": e.bytes,
            "seconds": e.seconds, "after": e.after, "issue": e.issue, "stage": e.stage}
