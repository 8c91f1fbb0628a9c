"""The judge of every plan: an event-driven replay of its schedule (``plan simulate``).

Written independently of the MILP. It trusts only the plan's decisions, its units (times and
bytes from the profile) and its hardware spec: each event's duration is re-derived here (a
forward takes ``fwd_s``, a transfer ``bytes / bandwidth`` of its link), each stream runs its
events in list order, one at a time, and an event starts when its stream is free, everything in
``after`` has finished and its ``issue`` event has started. Since the streams are FIFOs with no
other shared resource, the start times are the longest paths of that dependency graph, computed
exactly in topological order; a cycle is a deadlock and is reported by name.

Memory follows ``docs/file-formats.md`` (Memory model). Every term is constant or, for bytes
leaving during an offload, linear between two consecutive event boundaries, so each tier's peak
is at a boundary: we evaluate the value just after every boundary and the limit just before it
(an allocation and a free at the same instant are not counted together).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import networkx as nx
import numpy as np

from .errors import UserError
from .formats import Activation, Plan, Stream, Tier
from .schedule import OPT_ID, bwd_id, compute_order, fwd_id, rec_id, segments, validate_layers
from .sizes import fmt_bytes, fmt_seconds

# Pinned staging pool for NVMe traffic: two buffers (double buffering) of the largest NVMe
# transfer, each capped at 256 MiB (docs/file-formats.md, Memory model). The one definition:
# the MILP (formulation.py) imports these. A CPU device has no staging at all: its runtime
# writes each saved tensor's own memory to disk (docs/runtime.md, CPU row; counting 2 x 256 MiB
# made cpu-host's predicted offload-all peak 39% too high, docs/benchmarks.md).
STAGING_BUFFERS = 2
STAGING_CAP_BYTES = 256 * 1024**2


def staging_buffers(hw) -> int:
    """How many pinned staging buffers the runtime allocates on ``hw``: 0 on a CPU device."""
    return 0 if hw.device == "cpu" else STAGING_BUFFERS

TIERS = ("gpu", "cpu", "nvme")


class DeadlockError(UserError):
    """The schedule's dependencies form a cycle: no event order can satisfy them."""


@dataclass(frozen=True)
class StageRecord:
    """One compute event as replayed."""

    id: str
    op: str
    units: tuple
    stage: int
    start: float
    end: float
    stall_s: float          # time the compute stream waited for transfers before it
    peak_gpu_bytes: int     # GPU bytes at the highest point while it runs


@dataclass(frozen=True)
class SimResult:
    step_s: float
    compute_s: float                 # sum of fwd + bwd + optimizer: no recompute, no stalls
    recompute_s: float
    peak_gpu_bytes: int
    peak_cpu_bytes: int
    peak_nvme_bytes: int
    budgets: dict                    # gpu_bytes, cpu_bytes, nvme_bytes
    fits: bool
    budget_violations: tuple         # one line per tier over budget
    busy_s: dict                     # stream -> seconds it runs events
    stall_s: dict                    # stream -> seconds events waited for their `after`
    compute_stall_s: float
    static_bytes: int
    staging_bytes: int               # pinned NVMe staging pool (host, or GPU when unified)
    peak_gpu_time: float
    stages: tuple                    # StageRecord per compute event, in order
    events: dict                     # event id -> (start, end)
    transfers: dict                  # unit name -> {event id: (start, end)}
    timeline: tuple                  # (time, gpu, cpu, nvme) at every event boundary

    @property
    def overhead(self) -> float | None:
        """Step time over compute-only time (None for an empty step)."""
        return self.step_s / self.compute_s if self.compute_s > 0 else None

    def summary(self) -> dict:
        """The scalar figures (what ``plan simulate --json`` prints)."""
        return {"step_s": self.step_s, "compute_s": self.compute_s,
                "recompute_s": self.recompute_s, "overhead": self.overhead,
                "peak_gpu_bytes": self.peak_gpu_bytes, "peak_cpu_bytes": self.peak_cpu_bytes,
                "peak_nvme_bytes": self.peak_nvme_bytes, "budgets": dict(self.budgets),
                "fits": self.fits, "budget_violations": list(self.budget_violations),
                "busy_s": dict(self.busy_s), "stall_s": dict(self.stall_s),
                "compute_stall_s": self.compute_stall_s, "static_bytes": self.static_bytes,
                "staging_bytes": self.staging_bytes}

    def to_dict(self) -> dict:
        d = self.summary()
        d["peak_gpu_time"] = self.peak_gpu_time
        d["stages"] = [dataclasses.asdict(s) | {"units": list(s.units)} for s in self.stages]
        d["events"] = {k: list(v) for k, v in self.events.items()}
        d["transfers"] = {u: {k: list(v) for k, v in ev.items()} for u, ev in self.transfers.items()}
        d["timeline"] = [list(x) for x in self.timeline]
        return d


# ----------------------------------------------------------------------------- checks

def _expected_transfers(plan: Plan, unified: bool) -> dict[str, tuple[str, str, str, int]]:
    """Event id -> (stream, op, unit, bytes, source) of every transfer the decisions imply."""
    exp = {}
    for u, d in zip(plan.units, plan.layers):
        if d.activation in (Activation.CPU, Activation.NVME):
            tier, p, nbytes = Tier(d.activation.value), "", u.activation_bytes
        elif d.activation is Activation.RECOMPUTE and d.checkpoint in (Tier.CPU, Tier.NVME):
            tier, p, nbytes = d.checkpoint, "ck", u.input_bytes
        else:
            continue
        n = u.name
        # The last field is what the event must wait for: the bytes it moves exist only then.
        if not unified:
            exp[f"{p}out:{n}"] = ("d2h", "offload", n, nbytes, fwd_id(n))
            exp[f"{p}in:{n}"] = ("h2d", "prefetch", n, nbytes,
                                 f"{p}r:{n}" if tier is Tier.NVME else f"{p}out:{n}")
        if tier is Tier.NVME:
            exp[f"{p}w:{n}"] = ("nvme", "write", n, nbytes, fwd_id(n) if unified else f"{p}out:{n}")
            exp[f"{p}r:{n}"] = ("nvme", "read", n, nbytes, f"{p}w:{n}")
    return exp


def _check_events(plan: Plan, events: dict, unified: bool) -> None:
    src = "plan"
    want_compute = compute_order(plan.units, plan.layers)
    got_compute = [e.id for e in plan.schedule.get(Stream.COMPUTE.value, [])]
    if got_compute != want_compute:
        raise UserError(f"{src}: the compute stream is not forwards, then recomputes and backwards "
                        "in reverse, then OPT, as the layers imply; regenerate it with 'plan solve'")
    if unified and (plan.schedule.get("d2h") or plan.schedule.get("h2d")):
        raise UserError(f"{src}: d2h/h2d events on the unified-memory spec "
                        f"{plan.hardware.get('name')!r}; regenerate it with 'plan solve'")
    exp = _expected_transfers(plan, unified)
    got = {eid: e for eid, e in events.items() if e.stream is not Stream.COMPUTE}
    if set(got) != set(exp):
        missing, extra = sorted(set(exp) - set(got)), sorted(set(got) - set(exp))
        raise UserError(f"{src}: transfers do not match the layers (missing {missing[:4]}, "
                        f"unexpected {extra[:4]}); regenerate it with 'plan solve'")
    for eid, (stream, op, unit, nbytes, source) in exp.items():
        e = got[eid]
        if e.stream.value != stream or e.op != op or e.bytes != nbytes or tuple(e.units) != (unit,):
            raise UserError(f"{src}: event {eid} should be a {op} of {nbytes} bytes of {unit} on "
                            f"{stream}; regenerate it with 'plan solve'")
        if source not in e.after:
            raise UserError(f"{src}: event {eid} does not wait for {source}, which makes the bytes "
                            "it moves; regenerate it with 'plan solve'")
    for e in events.values():
        for dep in (*e.after, *([e.issue] if e.issue else [])):
            if dep not in events:
                raise UserError(f"{src}: event {e.id} waits for {dep!r}, which is not in the schedule")
    # The consumer of each prefetch must wait for it, or the replay would read missing bytes.
    segs = segments(plan.layers)
    seg_end = {i: s[-1] for s in segs for i in s}
    for i, (u, d) in enumerate(zip(plan.units, plan.layers)):
        fetched = None
        if d.activation in (Activation.CPU, Activation.NVME):
            fetched, consumer = (f"r:{u.name}" if unified else f"in:{u.name}"), bwd_id(u.name)
        elif d.activation is Activation.RECOMPUTE and d.checkpoint in (Tier.CPU, Tier.NVME):
            fetched = f"ckr:{u.name}" if unified else f"ckin:{u.name}"
            consumer = rec_id(plan.units[seg_end[i]].name)
        if fetched and fetched not in events[consumer].after:
            raise UserError(f"{src}: {consumer} does not wait for {fetched}; regenerate the plan")


def _duration(e, plan: Plan, hw, by_name) -> float:
    if e.stream is Stream.COMPUTE:
        if e.op == "forward":
            return by_name[e.units[0]].fwd_s
        if e.op == "backward":
            return by_name[e.units[0]].bwd_s
        if e.op == "recompute":
            return sum(by_name[n].fwd_s for n in e.units)
        if e.op == "optimizer":
            return float(plan.optimizer_s)
    elif e.stream is Stream.D2H:
        return e.bytes / hw.d2h_bandwidth if e.bytes else 0.0
    elif e.stream is Stream.H2D:
        return e.bytes / hw.h2d_bandwidth if e.bytes else 0.0
    elif e.stream is Stream.NVME:
        bw = hw.nvme_write_bandwidth if e.op == "write" else hw.nvme_read_bandwidth
        return e.bytes / bw if e.bytes else 0.0
    raise UserError(f"plan: event {e.id} has op {e.op!r} on stream {e.stream.value}; regenerate it")


# ----------------------------------------------------------------------------- timing

def _times(plan: Plan, events: dict, dur: dict) -> tuple[dict, dict]:
    """Start and end of every event: the longest path through stream order, after and issue."""
    g = nx.DiGraph()
    g.add_nodes_from(events)
    for evs in plan.schedule.values():
        for a, b in zip(evs, evs[1:]):
            g.add_edge(a.id, b.id, why="stream")
    for e in events.values():
        for a in e.after:
            g.add_edge(a, e.id, why="after")
        if e.issue:
            g.add_edge(e.issue, e.id, why="issue")
    try:
        topo = list(nx.topological_sort(g))
    except nx.NetworkXUnfeasible:
        cycle = nx.find_cycle(g)
        how = {"stream": "runs after {a} on its stream", "after": "waits for {a} to finish",
               "issue": "waits for {a} to start"}
        chain = "; ".join(f"{b} " + how[g.edges[a, b]["why"]].format(a=a) for a, b in cycle)
        raise DeadlockError(f"plan schedule deadlocks: {chain}; move the prefetch issue points "
                            "earlier or regenerate the plan") from None
    prev = {}
    for evs in plan.schedule.values():
        for a, b in zip(evs, evs[1:]):
            prev[b.id] = a.id
    start, end = {}, {}
    for eid in topo:
        e = events[eid]
        t = 0.0
        if eid in prev:
            t = max(t, end[prev[eid]])
        for a in e.after:
            t = max(t, end[a])
        if e.issue:
            t = max(t, start[e.issue])
        start[eid], end[eid] = t, t + dur[eid]
    return start, end


# ----------------------------------------------------------------------------- memory

class _Memory:
    """Per-tier bytes as constant steps on [a, b) and linear ramps down to 0 over [a, b)."""

    def __init__(self, times):
        self.T = np.array(sorted(set(times)), dtype=np.float64)
        self.k = {t: i for i, t in enumerate(self.T.tolist())}
        M = len(self.T)
        self.right = {t: np.zeros(M) for t in TIERS}   # value just after each boundary
        self.left = {t: np.zeros(M) for t in TIERS}    # limit just before each boundary
        self.owned = {}                                 # compute event id -> transient gpu bytes
        self.impulses = []                              # (index, owner) of zero-length events

    def step(self, tier, a, b, nbytes, owner=None):
        if nbytes == 0:
            return
        ia, ib = self.k[a], self.k[b]
        if owner is not None:
            self.owned[owner] = self.owned.get(owner, 0) + nbytes
            if ia == ib:
                self.impulses.append((ia, owner))
        if ia >= ib:
            return
        self.right[tier][ia:ib] += nbytes
        self.left[tier][ia + 1:ib + 1] += nbytes

    def ramp(self, tier, a, b, nbytes):
        """``nbytes`` leaving progressively (tensors go one by one) over [a, b)."""
        if nbytes == 0:
            return
        ia, ib = self.k[a], self.k[b]
        if ia >= ib:
            return
        T = self.T
        self.right[tier][ia:ib] += nbytes * (b - T[ia:ib]) / (b - a)
        self.left[tier][ia + 1:ib + 1] += nbytes * (b - T[ia + 1:ib + 1]) / (b - a)

    def constant(self, tier, nbytes):
        self.right[tier] += nbytes
        self.left[tier][1:] += nbytes



def _moved_away(mem, S, E, n, prefix, nbytes, held_from, held_to, to_host, unified):
    """GPU, host and NVMe bytes of something offloaded after ``held_from`` and needed by
    ``held_to``: held in full until its transfer out starts, freed progressively while it
    leaves, held again from the start of its prefetch. ``prefix`` is "" for a unit's
    activations and "ck" for its checkpoint (event ids ``out:``/``ckout:`` and so on)."""
    if unified:
        leave, fetch = f"{prefix}w:{n}", f"{prefix}r:{n}"
    else:
        leave, fetch = f"{prefix}out:{n}", f"{prefix}in:{n}"
    mem.step("gpu", held_from, S[leave], nbytes)
    mem.ramp("gpu", S[leave], E[leave], nbytes)
    mem.step("gpu", S[fetch], held_to, nbytes)
    if to_host:
        mem.step("cpu", S[f"{prefix}out:{n}"], E[f"{prefix}in:{n}"], nbytes)
    else:
        mem.step("nvme", S[f"{prefix}w:{n}"], E[f"{prefix}r:{n}"], nbytes)


def _memory(plan: Plan, hw, start, end, staging: int) -> _Memory:
    mem = _Memory([0.0, *start.values(), *end.values()])
    S, E = start, end
    units = plan.units
    by_name = {u.name: u for u in units}
    static = sum(u.static_bytes for u in units)
    mem.constant("gpu", static)
    mem.constant("gpu" if hw.unified_memory else "cpu", staging)

    # Shared tensors: one per producer, alive from its forward to the end of the last backward
    # among its readers. Readers come from the unit graph (edge producer -> reader), so a
    # tensor read far downstream stays counted whatever the list order says.
    g = nx.DiGraph()
    g.add_nodes_from(u.name for u in units)
    for a, b in zip(units, units[1:]):
        g.add_edge(a.name, b.name, shared=0)
    for u in units:
        if u.shared_saved_bytes > 0:
            producer = u.shared_from if u.shared_from is not None else units[0].name
            if producer not in by_name:
                raise UserError(f"plan: unit {u.name!r} reads shared tensors from {producer!r}, "
                                "which is not a unit of the plan; regenerate the profile")
            old = g.edges[producer, u.name]["shared"] if g.has_edge(producer, u.name) else 0
            g.add_edge(producer, u.name, shared=max(old, u.shared_saved_bytes))
    for p in g.nodes:
        readers = [(r, d["shared"]) for _, r, d in g.out_edges(p, data=True) if d["shared"] > 0]
        if readers:
            nbytes = max(b for _, b in readers)   # one tensor for all readers, counted once
            mem.step("gpu", S[fwd_id(p)], max(E[bwd_id(r)] for r, _ in readers), nbytes)

    unified = hw.unified_memory
    segs = segments(plan.layers)
    for u, d in zip(units, plan.layers):
        n, A, X = u.name, u.activation_bytes, u.input_bytes
        f, b = fwd_id(n), bwd_id(n)
        mem.step("gpu", S[f], E[f], u.workspace_bytes, owner=f)
        mem.step("gpu", S[b], E[b], u.workspace_bytes, owner=b)
        act = d.activation
        if act is Activation.KEEP:
            mem.step("gpu", S[f], E[b], A)
        elif act in (Activation.CPU, Activation.NVME):
            _moved_away(mem, S, E, n, "", A, S[f], E[b], act is Activation.CPU, unified)
        else:  # recompute: A_i lives only while F:i runs, then the checkpoint X_i (if any)
            mem.step("gpu", S[f], E[f], A, owner=f)
            ck = d.checkpoint or Tier.GPU
            if ck is Tier.GPU:
                mem.step("gpu", E[f], E[b], X)
            elif ck in (Tier.CPU, Tier.NVME):
                _moved_away(mem, S, E, n, "ck", X, E[f], E[b], ck is Tier.CPU, unified)
    for s in segs:
        r = rec_id(units[s[-1]].name)
        for j in s:   # the whole segment is rebuilt at once; B:j frees its part
            mem.step("gpu", S[r], E[bwd_id(units[j].name)], units[j].activation_bytes)
        # NB: the recompute runs the segment's forwards one after another, so its transient is
        # the largest of their workspaces (the file-format doc names only F and B transients).
        mem.step("gpu", S[r], E[r], max(units[j].workspace_bytes for j in s), owner=r)
    mem.step("gpu", S[OPT_ID], E[OPT_ID], int(plan.optimizer_workspace_bytes), owner=OPT_ID)
    return mem


# ----------------------------------------------------------------------------- simulate

def staging_pool_bytes(plan: Plan) -> int:
    """Bytes of the pinned NVMe staging pool: staging_buffers x min(largest NVMe transfer, cap)."""
    largest = max((e.bytes for e in plan.schedule.get(Stream.NVME.value, [])), default=0)
    return staging_buffers(plan.hardware_spec) * min(largest, STAGING_CAP_BYTES) if largest else 0


def simulate(plan: Plan) -> SimResult:
    """Replay ``plan`` event by event; see the module docstring."""
    hw = plan.hardware_spec
    validate_layers(plan.units, plan.layers, hw)
    events = {}
    for stream, evs in plan.schedule.items():
        for e in evs:
            if e.id in events:
                raise UserError(f"plan: event id {e.id!r} appears twice; regenerate the plan")
            if e.stream.value != stream:
                raise UserError(f"plan: event {e.id} is listed under {stream} but says {e.stream.value}")
            events[e.id] = e
    unified = hw.unified_memory
    _check_events(plan, events, unified)
    by_name = {u.name: u for u in plan.units}
    dur = {eid: _duration(e, plan, hw, by_name) for eid, e in events.items()}
    start, end = _times(plan, events, dur)

    staging = staging_pool_bytes(plan)
    mem = _memory(plan, hw, start, end, staging)

    # Zero-length compute events (an optimizer step profiled at 0 s, say) still hold their
    # transient for an instant: on top of what is live then, less the next compute event's.
    compute = plan.schedule[Stream.COMPUTE.value]
    starting = {}
    for e in compute:
        if end[e.id] > start[e.id]:
            starting[mem.k[start[e.id]]] = e.id
    impulse_at = {}
    for k, owner in mem.impulses:
        base = mem.right["gpu"][k] - mem.owned.get(starting.get(k), 0)
        impulse_at[k] = max(impulse_at.get(k, 0.0), base + mem.owned[owner])

    peaks = {}
    for t in TIERS:
        peaks[t] = max(float(mem.right[t].max()), float(mem.left[t].max()))
    if impulse_at:
        peaks["gpu"] = max(peaks["gpu"], max(impulse_at.values()))
    peaks = {t: int(round(v)) for t, v in peaks.items()}
    gk = int(np.argmax(np.maximum(mem.right["gpu"], mem.left["gpu"])))
    peak_gpu_time = float(mem.T[gk])

    # Stages: compute events with their stall and their own GPU peak.
    stages, prev_end = [], 0.0
    for e in compute:
        s, t = start[e.id], end[e.id]
        ks, kt = mem.k[s], mem.k[t]
        if kt > ks:
            pk = max(mem.right["gpu"][ks:kt].max(), mem.left["gpu"][ks + 1:kt + 1].max())
        else:
            pk = impulse_at.get(ks, mem.right["gpu"][ks])
        stages.append(StageRecord(id=e.id, op=e.op, units=tuple(e.units), stage=e.stage, start=s,
                                  end=t, stall_s=s - prev_end, peak_gpu_bytes=int(round(pk))))
        prev_end = t

    busy, stall = {}, {}
    for stream, evs in plan.schedule.items():
        busy[stream] = sum(dur[e.id] for e in evs)
        waited, free = 0.0, 0.0
        for e in evs:
            ready = max(free, start[e.issue] if e.issue else 0.0)
            waited += start[e.id] - ready
            free = end[e.id]
        stall[stream] = waited

    transfers: dict = {}
    for eid, e in events.items():
        if e.stream is not Stream.COMPUTE:
            transfers.setdefault(e.units[0], {})[eid] = (start[eid], end[eid])

    timeline = []
    for k, t in enumerate(mem.T.tolist()):
        lv = tuple(int(round(mem.left[x][k])) for x in TIERS)
        rv = tuple(int(round(mem.right[x][k])) for x in TIERS)
        if k > 0 and lv != rv:
            timeline.append((t, *lv))
        timeline.append((t, *rv))

    budgets = {k: int(plan.budgets.get(k, 0) or 0) for k in ("gpu_bytes", "cpu_bytes", "nvme_bytes")}
    violations = []
    for tier in TIERS:
        peak, budget = peaks[tier], budgets[f"{tier}_bytes"]
        if peak > budget:
            if budget == 0:
                violations.append(f"{tier}: budget 0 means the tier stays unused, but the plan "
                                  f"peaks at {fmt_bytes(peak)} ({peak} B)")
            else:
                violations.append(f"{tier}: peak {fmt_bytes(peak)} ({peak} B) exceeds the budget "
                                  f"{fmt_bytes(budget)} ({budget} B) by {fmt_bytes(peak - budget)}")

    compute_s = sum(u.fwd_s + u.bwd_s for u in plan.units) + float(plan.optimizer_s)
    recompute_s = sum(dur[e.id] for e in compute if e.op == "recompute")
    return SimResult(
        step_s=max(end.values()), compute_s=compute_s, recompute_s=recompute_s,
        peak_gpu_bytes=peaks["gpu"], peak_cpu_bytes=peaks["cpu"], peak_nvme_bytes=peaks["nvme"],
        budgets=budgets, fits=not violations, budget_violations=tuple(violations),
        busy_s=busy, stall_s=stall, compute_stall_s=stall[Stream.COMPUTE.value],
        static_bytes=sum(u.static_bytes for u in plan.units), staging_bytes=staging,
        peak_gpu_time=peak_gpu_time, stages=tuple(stages),
        events={eid: (start[eid], end[eid]) for eid in events}, transfers=transfers,
        timeline=tuple(timeline))


# ----------------------------------------------------------------------------- CLI

def format_summary(plan: Plan, r: SimResult, source: str = "plan") -> str:
    lines = [f"{source}: policy {plan.policy}, {len(plan.units)} units, hardware "
             f"{plan.hardware.get('name')}"]
    lines.append(f"step {fmt_seconds(r.step_s)}   compute-only {fmt_seconds(r.compute_s)}   "
                 f"({r.overhead or 0:.3f}x; recompute {fmt_seconds(r.recompute_s)}, compute waits for "
                 f"transfers {fmt_seconds(r.compute_stall_s)})")
    for tier in TIERS:
        peak, budget = getattr(r, f"peak_{tier}_bytes"), r.budgets[f"{tier}_bytes"]
        ok = "ok" if peak <= budget else "OVER"
        lines.append(f"  {tier:<5} peak {fmt_bytes(peak):>11} / budget {fmt_bytes(budget):>11}  {ok}")
    lines.append(f"  {'stream':<8} {'busy':>10} {'stall':>10}")
    for s in ("compute", "d2h", "h2d", "nvme"):
        if s in r.busy_s:
            lines.append(f"  {s:<8} {fmt_seconds(r.busy_s[s]):>10} {fmt_seconds(r.stall_s[s]):>10}")
    pred = plan.predicted.get("step_s") if isinstance(plan.predicted, dict) else None
    if pred:
        lines.append(f"plan predicted step {fmt_seconds(pred)} "
                     f"({(r.step_s / pred - 1) * 100:+.2f}% in this replay)")
    if r.fits:
        lines.append("FITS: every peak is within its budget")
    else:
        lines.append("DOES NOT FIT: " + "; ".join(r.budget_violations))
    return "\n".join(lines)


def cli_simulate(args) -> int:
    """``plan simulate PLAN [--json]``. Exits 0 whether or not the plan fits (the replay itself
    succeeded); ``fits`` and the DOES NOT FIT line say which."""
    from .formats import load_plan
    plan = load_plan(args.plan)
    r = simulate(plan)
    if getattr(args, "json", False):
        print(json.dumps(r.summary(), sort_keys=True))
    else:
        print(format_summary(plan, r, args.plan))
    return 0
