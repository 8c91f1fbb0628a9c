"""From decisions and transfer shares to the events of every stream (``docs/file-formats.md``).

The schedule is what the runtime replays and the simulator judges. Stages come from
``planner.costmodel.Layout``; the rule between them is the stage barrier (``planner.formats.events``).
This module decides nothing about *which* unit goes where: it checks decisions against the
rules and lays out the events they imply. Where no MILP chose the shares (a baseline, a
hand-written plan), ``greedy_shares`` places them: each transfer as early (offloads) or as late
(fetches) as its window allows, filling the stages' compute time first.
"""
from __future__ import annotations

import math

from planner.costmodel.layout import KINDS, REC, decision_choice
from planner.costmodel.model import CostModel
from planner.errors import UserError
from planner.formats.events import Event, Op, Passes, Stream, TensorClass, compute, event_id, transfer
from planner.formats import Activation, LayerDecision, Tier, UnitKind

_CLS = {"act": TensorClass.ACT, "weight": TensorClass.WEIGHT, "grad": TensorClass.GRAD}


def _ckpt(d: LayerDecision) -> Tier:
    return d.checkpoint or Tier.GPU


def validate_layers(cm: CostModel, layers: list[LayerDecision]) -> None:
    """Raise UserError when decisions break the rules (docs/file-formats.md, Layers) or ask
    for what this spec and these budgets do not have."""
    units, hw = cm.units, cm.hw
    if len(units) != len(layers) or any(u.name != d.name for u, d in zip(units, layers)):
        raise UserError("plan layers do not match the profile's units (names or order); "
                        "give one decision per unit, in execution order")
    prev = None
    for i, (u, d) in enumerate(zip(units, layers)):
        if cm.engine == "ddp" and not d.home.resident:
            raise UserError(f"layer {d.name!r}: homes off the device ({d.home.label()}) are not "
                            "planned under ddp (it replicates every tensor on every rank); "
                            "keep every tensor class on the device or use --engine fsdp2")
        if cm.engine == "fsdp2" and d.activation is Activation.RECOMPUTE and \
                _ckpt(d) is Tier.NONE:
            raise UserError(f"layer {d.name!r}: checkpoint 'none' would recompute it away from "
                            "its own backward, where FSDP2 must gather its weights a second "
                            "time; give it a checkpoint tier (gpu, cpu, nvme)")
        if u.kind != UnitKind.BLOCK.value and d.activation is not Activation.KEEP:
            raise UserError(f"layer {d.name!r} ({u.kind}) must be 'keep' in this version, "
                            f"got {d.activation.value!r}")
        if d.activation is Activation.RECOMPUTE and u.name in cm.not_replayable:
            raise UserError(f"layer {d.name!r}: it cannot be recomputed: a tensor in its cache "
                            "argument is written in place after it runs (model.not_replayable), "
                            "so its forward cannot be run again as it first ran; keep or "
                            "offload it (or profile the model with use_cache=False)")
        if d.activation is Activation.RECOMPUTE and _ckpt(d) is Tier.NONE:
            if u.name in cm.chain_breaks:
                raise UserError(f"layer {d.name!r}: checkpoint 'none' but its input is not the "
                                "previous block's output (model.chain_breaks), so no segment "
                                "continues into it; give it a checkpoint tier (gpu, cpu, nvme)")
            if prev is None or prev.activation is not Activation.RECOMPUTE:
                raise UserError(f"layer {d.name!r}: checkpoint 'none' must follow a 'recompute' "
                                f"unit, but follows {prev.activation.value if prev else 'nothing'!r}"
                                "; give it a checkpoint tier (gpu, cpu, nvme)")
        c = decision_choice(d)
        uses = {t for t in (d.home.weights, d.home.grads, d.home.optimizer)} | (
            {Tier.CPU} if c in ("cpu", "rc") else {Tier.NVME} if c in ("nvme", "rn") else set())
        if Tier.CPU in uses and cm.unified:
            raise UserError(f"layer {d.name!r}: 'cpu' is not a tier on the unified-memory spec "
                            f"{hw.name!r} (no host tier); use 'nvme' or the device")
        if Tier.CPU in uses and not cm.has_cpu:
            raise UserError(f"layer {d.name!r} uses host memory but --cpu-mem is 0; give a host "
                            "budget or keep it off the host")
        if Tier.NVME in uses and not cm.has_nvme:
            raise UserError(f"layer {d.name!r} uses NVMe but --nvme-mem is 0 (or the spec "
                            f"{hw.name!r} has no NVMe bandwidth); give an NVMe budget")
        if c not in cm.choices[i]:
            raise UserError(f"layer {d.name!r}: activation {c!r} is not possible for this unit "
                            "here (its transfer window is empty or its checkpoint could not "
                            "come back in time)")
        if d.home not in cm.homes[i]:
            raise UserError(f"layer {d.name!r}: home {d.home.label()!r} is not possible here "
                            "(tied weights, and a block's weights used between blocks, stay "
                            "on the device; a CPU step needs a host tier and "
                            "the spec's cpu_adam_params_per_s; a gradient that leaves needs a "
                            "stage after its backward"
                            + ("; under optimizer_overlap paced a gradient stays on the device)"
                               if cm.paced else ")"))
        if d.home.streams_weights:
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            if (c == "rz") or (nxt is not None and decision_choice(nxt) == "rz"):
                raise UserError(f"layer {d.name!r} streams its weights, so it is recomputed "
                                "only on its own: no 'none' checkpoint in it or right after it")
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


# ----------------------------------------------------------------------------- shares

def kinds_needed(cm: CostModel, i: int, d: LayerDecision) -> list[str]:
    """The transfer kinds unit i's decisions ask for (each must sum to one)."""
    out = []
    c = decision_choice(d)
    if c == "cpu":
        out += ["oc", "pc"]
    if c == "nvme":
        out += ["on", "pn"]
    for tier, tag in ((Tier.CPU, "c"), (Tier.NVME, "n")):
        if d.home.weights is tier:
            out += ["wf" + tag] + (["wb" + tag] if i != cm.U - 1 else [])
        if d.home.grads is tier:
            out.append("gd" + tag)
    return out


def _link_rate(cm: CostModel, kind: str) -> float:
    K, hw = KINDS[kind], cm.hw
    if cm.unified:
        return hw.nvme_write_bandwidth if K.dst == "nvme" else hw.nvme_read_bandwidth
    return hw.d2h_bandwidth if K.src == "gpu" else hw.h2d_bandwidth


def greedy_shares(cm: CostModel, layers: list[LayerDecision]) -> dict:
    """(kind, i, stage) -> share for decisions no MILP timed: offloads leave as early as their
    window allows and fetches arrive as late as it allows, each stage taking what its compute
    time hides on the link; whatever does not fit goes to the stage nearest the bytes' use
    (the first after an offload's forward, the last before a fetch's use), which then waits
    for its link but holds the bytes no longer than it must."""
    L = cm.L
    hide = {}
    for s in L.pass_stages:
        i = L.unit_of(s)
        hide[s] = 0.0 if i is None else (cm.f[i] if s <= cm.U else cm.b[i])
    used: dict = {}
    out = {}
    for i, d in enumerate(layers):
        for kind in kinds_needed(cm, i, d):
            size = cm.size(kind, i)
            win = list(cm.window(kind, i))
            if KINDS[kind].cls == "act":
                # offloads within the forward, fetches within the backward: every byte is back
                # only after it left, whatever the other transfers do
                win = [s for s in win if (s <= cm.U) == (KINDS[kind].src == "gpu")] or win
            if not win:
                raise UserError(f"layer {d.name!r}: no stage can carry its {kind} transfer")
            leaving = KINDS[kind].src == "gpu"
            order = win if leaving else win[::-1]
            rate = _link_rate(cm, kind)
            link = ("out" if leaving else "in")
            left = 1.0
            for s in order:
                if left <= 0:
                    break
                room = max(0.0, hide[s] * rate - used.get((link, s), 0.0))
                take = min(left, room / size) if size else left
                if take > 0:
                    out[kind, i, s] = out.get((kind, i, s), 0.0) + take
                    used[link, s] = used.get((link, s), 0.0) + take * size
                    left -= take
            if left > 1e-12:
                s = order[0]
                out[kind, i, s] = out.get((kind, i, s), 0.0) + left
                used[link, s] = used.get((link, s), 0.0) + left * size
    return out


ORDER_PAIRS = (("oc", "pc"), ("on", "pn"))   # (leaves, comes back) of an offloaded activation
# A solver meets the order rows only to its feasibility tolerance (HiGHS: 1e-6 and 1e-7,
# scaled): up to this much of a unit's share may come back 'before it left' in its answer
SOLVER_ORDER_SLACK = 1e-4


def order_values(values: dict, allowed) -> dict:
    """``values`` ((kind, unit, stage) -> share or bytes) with each offloaded activation's
    arrivals made to follow its departures exactly: an arrival beyond what has left before its
    stage moves to the unit's next arrival stage; what is still over at the last one comes off
    the departures at or after it and onto the latest departure before it. A unit whose moves
    would exceed ``allowed(total arrived, arrival stages)`` is left as it was, for
    ``_check_order`` to refuse."""
    out = dict(values)
    by = {}
    for (k, i, st) in values:
        by.setdefault((k, i), []).append(st)
    for o, p in ORDER_PAIRS:
        for (k, i), arr in list(by.items()):
            if k != p or (o, i) not in by:
                continue
            arr, dep = sorted(arr), sorted(by[o, i])
            trial = {**{(o, i, d): out[o, i, d] for d in dep},
                     **{(p, i, t): out[p, i, t] for t in arr}}
            moved, got = 0, 0
            for n, t in enumerate(arr):
                left = sum(trial[o, i, d] for d in dep if d < t)
                over = got + trial[p, i, t] - left
                if over > 0 and n + 1 < len(arr):
                    trial[p, i, t] -= over
                    trial[p, i, arr[n + 1]] += over
                    moved += over
                elif over > 0:                   # the last arrival: departures come earlier
                    early = [d for d in dep if d < t]
                    for d in (d for d in dep if d >= t):
                        if not early or over <= 0:
                            break
                        take = min(over, trial[o, i, d])
                        trial[o, i, d] -= take
                        trial[o, i, early[-1]] += take
                        over -= take
                        moved += take
                    if over > 0:
                        moved = math.inf
                got += trial[p, i, t]
            if 0 < moved <= allowed(sum(values[p, i, t] for t in arr), len(arr)):
                out.update(trial)
    return {key: v for key, v in out.items() if v > 0}


def _check_order(cm: CostModel, layers, shares: dict, tol: float = 1e-6,
                 in_bytes: bool = False) -> None:
    """Offloaded activations come back only after they left: by every stage t, the share
    arrived (up to and in t) is at most the share that left before t. ``in_bytes``: the
    values are whole bytes (summed exactly), shown as shares."""
    # Group the shares once: scanning all of them per unit would be O(U^2), minutes at
    # 10,000 units, where --time-limit must still hold.
    by = {}
    for (k, ii, s), v in shares.items():
        by.setdefault((k, ii), []).append((s, v))
    for i, d in enumerate(layers):
        for o, p in ORDER_PAIRS:
            ins = sorted(by.get((p, i), ()))
            if not ins:
                continue
            outs = by.get((o, i), [])
            for t, _ in ins:
                arrived = sum(v for s, v in ins if s <= t)
                left = sum(v for s, v in outs if s < t)
                if arrived > left + tol:
                    n = cm.size(p, i) if in_bytes else 1
                    raise UserError(f"layer {d.name!r}: {arrived / n:.3f} of its activations "
                                    f"come back by stage {t} but only {left / n:.3f} left "
                                    "before it; regenerate the plan")


def _split_bytes(shares: dict, cm: CostModel) -> dict:
    """(kind, i, stage) -> whole bytes, each (kind, i) summing exactly to its size (largest
    remainder), so that a plan's bytes add up."""
    by = {}
    for (kind, i, s), sh in shares.items():
        by.setdefault((kind, i), []).append((s, sh))
    out = {}
    for (kind, i), parts in by.items():
        size = cm.size(kind, i)
        total = sum(sh for _, sh in parts)
        raw = [(s, size * sh / total) for s, sh in parts]
        whole = {s: int(x) for s, x in raw}
        rest = size - sum(whole.values())
        for s, x in sorted(raw, key=lambda p: p[1] - int(p[1]), reverse=True)[:rest]:
            whole[s] += 1
        for s, n in whole.items():
            if n:
                out[kind, i, s] = n
    return out


# ----------------------------------------------------------------------------- events

def compute_order(cm: CostModel, layers: list[LayerDecision]) -> list[tuple]:
    """(op, units, stage) of the compute events in order: forwards, then per unit in reverse
    its segment's recompute (at the backward of the segment's last unit) and its backward,
    then each unit's optimizer step."""
    L = cm.L
    seg_end = {s[-1]: s for s in segments(layers)}
    names = [u.name for u in cm.units]
    out = [(Op.FORWARD, (names[i],), L.fwd(i)) for i in range(cm.U)]
    for i in range(cm.U - 1, -1, -1):
        if i in seg_end:
            out.append((Op.RECOMPUTE, tuple(names[k] for k in seg_end[i]), L.bwd(i)))
        out.append((Op.BACKWARD, (names[i],), L.bwd(i)))
    for j in range(cm.U):
        if cm.P[j] + cm.G[j] + cm.O[j]:
            out.append((Op.STEP, (names[j],), L.opt_stage))
    return out


def build_schedule(cm: CostModel, layers: list[LayerDecision], shares: dict | None = None
                   ) -> dict[str, list[Event]]:
    """Every event the decisions imply, per stream, in the order each stream runs them.

    ``shares`` maps (kind, unit index, stage) to the share of the unit's bytes that moves in
    that stage (the MILP's read-back); missing: ``greedy_shares``.
    """
    validate_layers(cm, layers)
    nbytes = _transfer_bytes(cm, layers, greedy_shares(cm, layers) if shares is None else shares)
    evs = _compute_events(cm, layers)
    xfer = _Transfers(cm, evs)
    _share_transfers(cm, nbytes, xfer)
    _checkpoint_transfers(cm, layers, xfer)
    _optimizer_transfers(cm, layers, xfer)
    # a sharded engine's collectives: fixed by the engine, whatever the decisions
    for op, cls, i, s, n in cm.collectives():
        evs.append(transfer(Stream.NET, Op(op), _CLS[cls], xfer.names[i], s, n,
                            cm.ring_seconds(op, n)))
    schedule: dict[str, list[Event]] = {}
    order = {s: k for k, s in enumerate(Stream)}
    for e in sorted(evs, key=lambda e: e.stage):   # stable: compute order kept within a stage
        schedule.setdefault(e.stream.value, []).append(e)
    return {k: schedule[k] for k in sorted(schedule, key=lambda k: order[Stream(k)])}


def _transfer_bytes(cm: CostModel, layers: list[LayerDecision], shares: dict) -> dict:
    """(kind, i, stage) -> whole bytes of each transfer the decisions need, from ``shares``:
    every needed transfer has a share, each in a stage its window allows, and no byte comes
    back before it left."""
    need = {(k, i) for i, d in enumerate(layers) for k in kinds_needed(cm, i, d)
            if cm.size(k, i) > 0}
    shares = {key: v for key, v in shares.items() if (key[0], key[1]) in need and v > 0}
    missing = need - {(k, i) for k, i, _ in shares}
    if missing:
        k, i = sorted(missing)[0]
        raise UserError(f"layer {layers[i].name!r}: its {k} transfer has no share in any stage")
    for (kind, i, s) in shares:
        if not cm.valid_stage(kind, i, s):
            raise UserError(f"layer {layers[i].name!r}: its {kind} transfer cannot move in stage "
                            f"{s} (before its bytes exist or after they are needed)")
    # A solver meets the order rows only to its tolerance (its shares may come back a hair
    # ahead of what has left): that much is accepted, and the whole bytes are then made to
    # follow exactly (also what rounding to bytes moved), so that the runtime never fetches a
    # byte before it was written and a plan rebuilt from its own events gives the same events.
    _check_order(cm, layers, shares, tol=SOLVER_ORDER_SLACK)
    nbytes = order_values(_split_bytes(shares, cm),
                          lambda total, n: SOLVER_ORDER_SLACK * total + 2 * n)
    _check_order(cm, layers, nbytes, tol=0, in_bytes=True)
    return nbytes


def _compute_events(cm: CostModel, layers: list[LayerDecision]) -> list[Event]:
    """The compute stream's events (and the host's CPU steps), in ``compute_order``."""
    names = [u.name for u in cm.units]
    index = {n: k for k, n in enumerate(names)}   # not names.index: O(U^2) at 10,000 units
    evs: list[Event] = []
    seconds = {Op.FORWARD: cm.f, Op.BACKWARD: cm.b}
    for op, units, stage in compute_order(cm, layers):
        if op is Op.RECOMPUTE:
            sec = sum(cm.f[index[n]] for n in units)
            evs.append(compute(op, units, stage, sec))
        elif op is Op.STEP:
            j = index[units[0]]
            dev, cpu = cm.step_seconds(j, layers[j].home)
            evs.append(compute(op, units, stage, dev or cpu,
                               Stream.HOST if layers[j].home.step is Tier.CPU else Stream.COMPUTE))
        else:
            evs.append(compute(op, units, stage, seconds[op][index[units[0]]]))
    return evs


class _Transfers:
    """Appends transfer events to ``evs``, each timed at its stream's rate on the spec."""

    def __init__(self, cm: CostModel, evs: list[Event]):
        self.cm, self.evs = cm, evs
        self.names = [u.name for u in cm.units]

    def __call__(self, stream, op, cls, i, s, n, passes=Passes.ALL):
        cm, hw = self.cm, self.cm.hw
        rate = {Stream.D2H: hw.d2h_bandwidth, Stream.H2D: hw.h2d_bandwidth,
                Stream.NVME: hw.nvme_write_bandwidth if op is Op.WRITE else hw.nvme_read_bandwidth,
                Stream.HOST: 1.0}[stream]
        sec = n * cm.accumulate_s_per_byte() if stream is Stream.HOST else (n / rate if rate else 0.0)
        self.evs.append(transfer(stream, op, cls, self.names[i], s, n, sec, passes))


def _share_transfers(cm: CostModel, nbytes: dict, xfer: _Transfers) -> None:
    """The events of every share-placed transfer, by stage, then unit, then kind."""
    uni = cm.unified
    for (kind, i, s), n in sorted(nbytes.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0])):
        K = KINDS[kind]
        cls = _CLS[K.cls]
        if kind == "gdn":
            if not uni:      # through host memory: the link first
                xfer(Stream.D2H, Op.OFFLOAD, cls, i, s, n)
            xfer(Stream.NVME, Op.READ, cls, i, s, n, Passes.REST)
            xfer(Stream.HOST, Op.ACCUMULATE, cls, i, s, n, Passes.REST)
            xfer(Stream.NVME, Op.WRITE, cls, i, s, n)
            continue
        if K.src == "gpu" and not uni:
            xfer(Stream.D2H, Op.OFFLOAD, cls, i, s, n)
        if K.src == "nvme":
            xfer(Stream.NVME, Op.READ, cls, i, s, n)
        if K.dst == "nvme":
            xfer(Stream.NVME, Op.WRITE, cls, i, s, n)
        if K.dst == "gpu" and not uni:
            xfer(Stream.H2D, Op.PREFETCH, cls, i, s, n)
        if kind == "gdc":
            xfer(Stream.HOST, Op.ACCUMULATE, cls, i, s, n)


def _checkpoint_transfers(cm: CostModel, layers: list[LayerDecision], xfer: _Transfers) -> None:
    """The checkpoints of segments whose head keeps its input on cpu/nvme: out after its
    forward, back before the recompute."""
    L, uni, names = cm.L, cm.unified, xfer.names
    for seg in segments(layers):
        k, e = seg[0], seg[-1]
        ck = _ckpt(layers[k])
        if ck not in (Tier.CPU, Tier.NVME):
            continue
        if not cm.ck_allowed(k, e):
            raise UserError(f"layer {layers[k].name!r}: its {ck.value} checkpoint cannot come back "
                            f"before the recompute at {names[e]!r}'s backward; keep it on the gpu")
        out_s, back = L.fwd(k) + 1, cm.ck_return_stage(k, e)
        n = cm.X[k]
        if not uni:
            xfer(Stream.D2H, Op.OFFLOAD, TensorClass.CKPT, k, out_s, n)
        if ck is Tier.NVME:
            xfer(Stream.NVME, Op.WRITE, TensorClass.CKPT, k, out_s, n)
            xfer(Stream.NVME, Op.READ, TensorClass.CKPT, k, back, n)
        if not uni:
            xfer(Stream.H2D, Op.PREFETCH, TensorClass.CKPT, k, back, n)


def _optimizer_transfers(cm: CostModel, layers: list[LayerDecision], xfer: _Transfers) -> None:
    """The optimizer phase: each unit off the device read, stepped, written back (a
    pipeline, in unit order)."""
    L = cm.L
    for j, d in enumerate(layers):
        h = d.home
        if h.resident:
            continue
        r, w = cm.step_reads(j, h), cm.step_writes(j, h)
        reads = [(TensorClass.STATE, cm.opt_copy(j, h) if h.optimizer is Tier.NVME else 0),
                 (TensorClass.WEIGHT, cm.P[j] if h.weights is Tier.NVME and cm.M[j] == 0 else 0),
                 (TensorClass.GRAD, cm.G[j] if h.grads is Tier.NVME else 0)]
        assert sum(n for _, n in reads) == r["nvme"]
        for cls, n in reads:
            if n:
                xfer(Stream.NVME, Op.READ, cls, j, L.opt_stage, n)
        if r["d2h"]:
            xfer(Stream.D2H, Op.OFFLOAD, TensorClass.GRAD, j, L.opt_stage, r["d2h"])
        if r["h2d"]:     # state off the device, stepped on it: up for the step, down after
            xfer(Stream.H2D, Op.PREFETCH, TensorClass.STATE, j, L.opt_stage, r["h2d"])
            xfer(Stream.D2H, Op.OFFLOAD, TensorClass.STATE, j, L.opt_stage, w["d2h"])
        writes = [(TensorClass.STATE, cm.opt_copy(j, h) if h.optimizer is Tier.NVME else 0),
                  (TensorClass.WEIGHT, cm.P[j] if h.weights is Tier.NVME else 0)]
        assert sum(n for _, n in writes) == w["nvme"]
        for cls, n in writes:
            if n:
                xfer(Stream.NVME, Op.WRITE, cls, j, L.opt_stage, n)
        if w["h2d"]:
            xfer(Stream.H2D, Op.UPLOAD, TensorClass.WEIGHT, j, L.opt_stage, w["h2d"])


# ----------------------------------------------------------------------------- reading back

def shares_of(cm: CostModel, layers: list[LayerDecision], events) -> dict:
    """(kind, i, stage) -> share, read from a schedule's transfer events: the inverse of
    ``build_schedule`` (the simulator rebuilds the schedule from these and compares)."""
    idx = {u.name: i for i, u in enumerate(cm.units)}
    out = {}
    for e in events:
        if not e.is_transfer or e.stage not in cm.L.pass_stages:
            continue
        i = idx[e.unit]
        d = layers[i]
        c = decision_choice(d)
        kind = None
        if e.cls is TensorClass.ACT:
            tier = "c" if c == "cpu" else "n"
            if (e.stream is Stream.D2H) or (cm.unified and e.op is Op.WRITE):
                kind = "o" + tier
            elif (e.stream is Stream.H2D) or (cm.unified and e.op is Op.READ):
                kind = "p" + tier
        elif e.cls is TensorClass.WEIGHT and ((e.stream is Stream.H2D) or
                                              (cm.unified and e.op is Op.READ)):
            tag = "c" if d.home.weights is Tier.CPU else "n"
            kind = ("wf" if e.stage < cm.L.fwd(i) else "wb") + tag
        elif e.cls is TensorClass.GRAD and (e.stream is Stream.D2H or
                                            (cm.unified and e.op is Op.WRITE and
                                             d.home.grads is Tier.NVME)):
            kind = "gdc" if d.home.grads is Tier.CPU else "gdn"
        if kind is None:
            continue
        size = cm.size(kind, i)
        out[kind, i, e.stage] = out.get((kind, i, e.stage), 0.0) + (e.bytes / size if size else 1.0)
    return out


def event_ids(schedule: dict) -> dict:
    """id -> (stream, bytes, passes) of every event: what two schedules are compared on."""
    return {e.id: (e.stream, e.bytes, e.passes) for evs in schedule.values() for e in evs}


__all__ = ["build_schedule", "compute_order", "event_id", "greedy_shares", "segments",
           "shares_of", "validate_layers", "REC"]
