"""The one cost model: the stages of an optimizer step, what every decision holds on each tier
in each stage, what each stage moves on each link, and what each stage's duration is made of.

Nothing else in tierplan knows these rules. The MILP (``planner.solve.milp``) builds its rows from
them with PuLP variables; the simulator (``planner.plans.simulate``) evaluates the very same
functions with a plan's numbers; the schedule builder and ``inspect`` ask them too. So the
MILP's objective and a plan's simulated step are the same function of the decisions, and
``docs/formulation.md`` documents this module symbol for symbol.

How the functions speak: every quantity is a ``Lin``, a list of ``(value, coefficient)``
pairs, where ``value`` is whatever the caller's ``View`` returns for a decision: a PuLP
variable in the MILP, a number in the simulator. ``evaluate`` sums a Lin of numbers.

Stages (``Layout``). One optimizer step is ``K`` forward/backward passes, then the optimizer
phase. A pass has 2U+1 stages: the prologue (stage 0, no compute: weights the first forward
needs come in), the forward of unit i (stage 1+i) and its backward (stage 2U-i; a segment's
recompute runs at the start of its last unit's backward stage). The optimizer phase has U+2
stages: unit j's optimizer state is read in stage o(j), stepped in o(j+1), written back in
o(j+2), so reads, steps and writes of neighbours overlap. Every stage ends at a barrier: it
lasts as long as its longest resource (compute, each link, the NVMe drive, the host CPU), a
transfer assigned to it starts with it, and bytes it moves out are freed at its end while
bytes it brings in are held from its start.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx

from planner.errors import UserError
from planner.formats import Activation, HardwareSpec, Home, LayerDecision, Tier, UnitKind, UnitRecord

TIERS = ("gpu", "cpu", "nvme")
RESOURCES = ("compute", "d2h", "h2d", "duplex", "nvme", "host")
# Activation choices: keep, offload to cpu / nvme, recompute with the input checkpoint on
# gpu / cpu / nvme (rg, rc, rn), recompute from the previous checkpoint (rz, checkpoint none).
CHOICES = ("keep", "cpu", "nvme", "rg", "rc", "rn", "rz")
CHOICE_DECISION = {
    "keep": (Activation.KEEP, None), "cpu": (Activation.CPU, None),
    "nvme": (Activation.NVME, None), "rg": (Activation.RECOMPUTE, Tier.GPU),
    "rc": (Activation.RECOMPUTE, Tier.CPU), "rn": (Activation.RECOMPUTE, Tier.NVME),
    "rz": (Activation.RECOMPUTE, Tier.NONE),
}
REC = ("rg", "rc", "rn", "rz")
# Host-side gradient accumulation reads the accumulator and the arriving bytes and writes the
# sum: three bytes of memory traffic per gradient byte.
ACCUMULATE_TRAFFIC = 3.0
# A tie-break on the objective: 10 us per GB moved, so that moving bytes that hide fully
# behind compute loses to not moving them (it gains nothing and costs link time).
EPS_S_PER_BYTE = 1e-5 / 1e9
# A unit whose optimizer state lives on NVMe is stepped piece by piece
# (runtime/streaming.py, ``UnitStatic.step_in_pieces``): a piece is whole tensors whose state
# comes to at most STEP_PIECE_BYTES, or a slice of STEP_PIECE_ALIGN-element multiples of one
# larger tensor (at least one such slice). Only a piece's state is read at a time, so a tied
# embedding whose own moments exceed the budget can still be stepped. Slices start at
# multiples of 2^20 elements so that the elementwise kernels see the same vector/scalar split
# as on the whole tensor (bit-identical steps; tests/test_streaming.py).
STEP_PIECE_BYTES = 16 * 2**20
STEP_PIECE_ALIGN = 2**20
# In the passes after the first, a gradient accumulator on NVMe is read back, added into and
# written again in parts of at most this many bytes, one part at a time (the runtime's single
# I/O thread): the read-back holds one such part, not the unit's whole gradient.
ACC_CHUNK_BYTES = 2**20


def decision_choice(d: LayerDecision) -> str:
    for c, (act, ck) in CHOICE_DECISION.items():
        if d.activation is act and (act is not Activation.RECOMPUTE or
                                    (d.checkpoint or Tier.GPU) is ck):
            return c
    raise AssertionError(d)


Lin = list   # [(value, coefficient)]


def evaluate(terms: Lin) -> float:
    return float(sum(v * c for v, c in terms))


# ----------------------------------------------------------------------------- stages

@dataclass(frozen=True)
class Layout:
    """Stage indices of one optimizer step with U units."""

    U: int

    @property
    def pass_stages(self) -> range:
        return range(0, 2 * self.U + 1)

    @property
    def opt_stage(self) -> int:
        """The optimizer phase: one stage after the last pass."""
        return 2 * self.U + 1

    @property
    def n_stages(self) -> int:
        return 2 * self.U + 2

    def fwd(self, i: int) -> int:
        return 1 + i

    def bwd(self, i: int) -> int:
        return 2 * self.U - i

    def unit_of(self, s: int) -> int | None:
        """The unit whose compute opens pass stage s (None for the prologue and the optimizer
        phase)."""
        U = self.U
        if s == 0 or s > 2 * U:
            return None
        return s - 1 if s <= U else 2 * U - s

    def phase(self, s: int) -> str:
        U = self.U
        if s == 0:
            return "prologue"
        if s <= U:
            return "forward"
        if s <= 2 * U:
            return "backward"
        return "optimizer"


# ----------------------------------------------------------------------------- transfers

@dataclass(frozen=True)
class Kind:
    """One kind of spread transfer: a class of bytes of a unit moved over a window of stages
    as continuous shares (Σ shares = the decision that asks for it)."""

    name: str            # also the MILP's variable prefix
    cls: str             # act | weight | grad
    src: str             # tier the bytes come from
    dst: str             # tier they go to


KINDS = {k.name: k for k in (
    Kind("oc", "act", "gpu", "cpu"), Kind("on", "act", "gpu", "nvme"),
    Kind("pc", "act", "cpu", "gpu"), Kind("pn", "act", "nvme", "gpu"),
    Kind("wfc", "weight", "cpu", "gpu"), Kind("wfn", "weight", "nvme", "gpu"),
    Kind("wbc", "weight", "cpu", "gpu"), Kind("wbn", "weight", "nvme", "gpu"),
    Kind("gdc", "grad", "gpu", "cpu"), Kind("gdn", "grad", "gpu", "nvme"),
)}


class View:
    """What the cost model asks about the decisions. The MILP answers with variables, the
    simulator with numbers; a decision that cannot be taken answers 0."""

    def x(self, i: int, c: str):                  # activation choice c of unit i
        raise NotImplementedError

    def h(self, i: int, k: int):                  # home k (index into CostModel.homes[i])
        raise NotImplementedError

    def share(self, kind: str, i: int, s: int):   # share of unit i's bytes moved in stage s
        raise NotImplementedError

    def e(self, i: int):                          # i ends a recompute segment
        raise NotImplementedError

    def q(self, k: int, i: int):                  # k is recomputed at the backward of i (k < i)
        raise NotImplementedError

    def y(self, c: str, k: int, e: int):          # k's offloaded checkpoint returns for segment end e
        raise NotImplementedError

    def at(self, s: int) -> list:                 # (kind, i) that may move a share in stage s
        raise NotImplementedError

    def recomputed_at(self, i: int) -> list:      # k < i that the recompute at bwd(i) may rebuild
        raise NotImplementedError

    def ck_returns(self, s: int) -> list:         # (k, e, choice) whose checkpoint may return in s
        raise NotImplementedError


# ----------------------------------------------------------------------------- the model

@dataclass
class Windows:
    act: int        # w_a: stages an activation transfer may spread over
    weight: int     # w_w: stages a weight fetch may spread over
    grad: int       # w_g: stages a gradient offload may spread over
    seg: int = 8    # w_seg: longest recompute segment


class CostModel:
    """Everything about one profile on one spec under one set of budgets that the MILP and the
    simulator must agree on."""

    def __init__(self, units: list[UnitRecord], hw: HardwareSpec, *, gpu_bytes: int,
                 cpu_bytes: int, nvme_bytes: int, micro_batches: int = 1,
                 optimizer_s: float = 0.0, optimizer_workspace_bytes: int = 0,
                 allow_offload: bool = True, allow_streaming: bool = True,
                 windows: Windows | None = None, optimizer_depth: int = 3,
                 cache_bytes: int = 0, world_size: int = 1, ranks_per_node: int = 1,
                 engine: str = "none", chain_breaks=()):
        self.units = list(units)
        # blocks whose input is not the previous block's output (the profile's
        # model.chain_breaks: another stack starts, a U-Net's skip is concatenated): no
        # segment can continue into them, so they take no checkpoint 'none'
        self.chain_breaks = frozenset(chain_breaks or ())
        self.hw = hw
        self.U = len(self.units)
        self.L = Layout(self.U)
        self.K = max(1, int(micro_batches))
        self.unified = bool(hw.unified_memory)
        # Every host byte the runtime holds is pinned (CUDA): the pinned limit caps the budget.
        cpu_cap = cpu_bytes if self.unified or not hw.pinned_limit else min(cpu_bytes, hw.pinned_limit)
        # the spec's reserve stays free on the device (what no profile counts)
        self.budget = {"gpu": max(0, gpu_bytes - int(hw.reserved_bytes)), "cpu": cpu_cap,
                       "nvme": nvme_bytes}
        u = self.units
        self.A = [x.activation_bytes for x in u]
        self.X = [x.input_bytes for x in u]
        self.W = [x.workspace_bytes for x in u]
        self.P = [x.param_bytes for x in u]
        self.G = [x.grad_bytes for x in u]
        self.O = [x.optimizer_bytes for x in u]
        self.M = [x.master_bytes for x in u]
        self.N = [x.param_count for x in u]
        self.f = [float(x.fwd_s) for x in u]
        self.b = [float(x.bwd_s) for x in u]
        self.opt_ws = int(optimizer_workspace_bytes)
        # a sharded engine (FSDP2, DDP): per-rank static state, budgets and optimizer step
        optimizer_s = self._ranks(world_size, ranks_per_node, engine, optimizer_s)
        if self.distributed:
            allow_streaming = False     # homes off the device are single-process only (for now)
        # units in flight in the optimizer phase: 1 steps them one after the other (read, step,
        # write back), 3 reads the next and writes the previous back while one steps
        if optimizer_depth not in (1, 3):
            raise ValueError(f"optimizer_depth {optimizer_depth}: use 1 or 3")
        self.opt_depth = optimizer_depth
        # a key/value cache the blocks fill (Hugging Face use_cache): the model's output holds
        # it, and a loop may keep that output until the next forward replaces it, so it is
        # counted for the whole step
        self.cache = int(cache_bytes)
        static = [self.P[i] + self.G[i] + self.O[i] for i in range(self.U)]
        total = sum(static)
        # The device optimizer step of each unit: the profile's figure, shared by static bytes.
        self.t_dev_opt = [float(optimizer_s) * s / total if total else 0.0 for s in static]
        self.has_cpu = (not self.unified) and cpu_bytes > 0
        self.has_nvme = nvme_bytes > 0 and hw.nvme_read_bandwidth > 0 and hw.nvme_write_bandwidth > 0
        self.allow_offload = allow_offload
        self.windows = windows or self._default_windows()
        self.staging_cap = 0 if self.unified or hw.device == "cpu" else int(hw.staging_buffer_bytes)
        self.n_staging = 0 if self.staging_cap == 0 else int(hw.staging_buffers)
        self.homes = [self._homes(i, allow_streaming) for i in range(self.U)]
        self.choices = [self._choices(i) for i in range(self.U)]
        self.shared = self._shared_memory()
        for s, n in enumerate(self._tied_grad_buffers()):
            self.shared[s] += n
        if self.distributed:
            # what the engine holds per stage whatever the decisions (gathered weights, unsharded
            # gradients) joins the shared tensors: both are constants of the stage
            self.engine_mem = self._engine_memory()
            self.shared = [a + b for a, b in zip(self.shared, self.engine_mem)]
            self.net_s = self._net_seconds()

    # -- data-sized windows -----------------------------------------------------------------

    def _default_windows(self) -> Windows:
        """w = 3x the stages one block's largest transfer takes at link speed, clamped to
        4..12: a transfer shares its link with its neighbours', so it needs more stages than
        the bare ratio; 12 keeps the model O(U*12) (design brief: windows keep it small)."""
        blocks = [i for i, x in enumerate(self.units) if x.kind == UnitKind.BLOCK.value]
        fs = sorted(self.f[i] for i in blocks) or [1e-3]
        f_med = max(fs[len(fs) // 2], 1e-9)
        hw = self.hw
        bw = hw.nvme_write_bandwidth if self.unified else min(hw.d2h_bandwidth, hw.h2d_bandwidth)
        bw = bw or 1e9

        def w(nbytes):
            return int(min(12, max(4, math.ceil(3 * nbytes / bw / f_med))))
        a = max((self.A[i] for i in blocks), default=0)
        p = max((self.P[i] for i in blocks), default=0)
        g = max((self.G[i] for i in blocks), default=0)
        return Windows(act=w(a), weight=w(p), grad=w(g))

    # -- what each unit may do --------------------------------------------------------------

    def _homes(self, i: int, allow_streaming: bool) -> list[Home]:
        """The homes unit i may take on this spec under these budgets. A unit with tied
        parameters keeps its weights and gradients on the device (another unit uses them
        between its own uses), and so does a block charged parameters outside its module
        (code between blocks uses them before its forward, and their gradients finish after
        its backward); a unit without parameters has nothing to place."""
        R = Home()
        if not allow_streaming or self.P[i] + self.G[i] + self.O[i] == 0:
            return [R]
        tied = bool(self.units[i].tied_to) or self.units[i].outside_params > 0
        grads_ok = len(self.window("gdc", i)) > 0     # a gradient needs a stage to leave in
        G_, C_, N_ = Tier.GPU, Tier.CPU, Tier.NVME
        out = [R]
        if self.unified:
            # The device is the host: every step runs on it; nvme is the only other tier.
            if not self.has_nvme:
                return out
            for w in (G_, N_):
                for g in (G_, N_):
                    for o in (G_, N_):
                        h = Home(w, g, o, G_)
                        if h.resident or (tied and (w, g) != (G_, G_)) or (g is N_ and not grads_ok):
                            continue
                        out.append(h)
            return out
        if not self.has_cpu or self.hw.cpu_adam_params_per_s <= 0:
            return out
        # Gradients on NVMe: with K > 1 every pass after the first reads the accumulators back,
        # which doubles the model's time rows whether or not a unit takes the home (a K=8
        # GPT-3 175B solve fell from 1,768 s to 2,653 s within its 100 s limit); so with K > 1
        # only where the host cannot hold every gradient accumulator
        grad_tiers = (G_, C_, N_) if self.has_nvme and (
            self.K == 1 or sum(self.G) > self.budget["cpu"]) else (G_, C_)
        for w in (G_, C_, N_):
            for g in grad_tiers:
                for o in (C_, N_):
                    if N_ in (w, g, o) and not self.has_nvme:
                        continue
                    if tied and (w, g) != (G_, G_):
                        continue
                    if g is not G_ and not grads_ok:
                        continue
                    out.append(Home(w, g, o, C_))
        return out

    def _choices(self, i: int) -> list[str]:
        x = self.units[i]
        if x.kind != UnitKind.BLOCK.value:
            return ["keep"]
        out = ["keep", "rg"]
        # FSDP2: no segment recompute (``_ranks``); every unit is recomputed in its own backward
        if i > 0 and self.units[i - 1].kind == UnitKind.BLOCK.value and self.engine != "fsdp2" \
                and x.name not in self.chain_breaks:
            out.append("rz")
        if not self.allow_offload:
            return out
        L = self.L
        for tier, c, rc in (("cpu", "cpu", "rc"), ("nvme", "nvme", "rn")):
            if not (self.has_cpu if tier == "cpu" else self.has_nvme):
                continue
            if self.window("o" + c[0], i) and self.window("p" + c[0], i):
                out.append(c)
            # an offloaded checkpoint leaves in stage fwd(i)+1 and is back by bwd(i)-1
            if L.bwd(i) - 1 > L.fwd(i) + 1:
                out.append(rc)
        return out

    def window(self, kind: str, i: int) -> range:
        """The stages where unit i's share of ``kind`` may move.

        oc/on: fwd(i)+1 .. min(fwd(i)+w_a, bwd(i)-1)      (after the forward that made them)
        pc/pn: max(fwd(i)+1, bwd(i)-w_a) .. bwd(i)-1       (before the backward that reads them)
        wfc/wfn: max(0, fwd(i)-w_w) .. fwd(i)-1            (before the forward; 0 = prologue)
        wbc/wbn: max(fwd(i)+1, bwd(i)-w_w) .. bwd(i)-1     (before the backward; none for the
                 last unit, whose forward copy stays for its backward in the next stage)
        gdc/gdn: bwd(i)+1 .. min(bwd(i)+w_g, 2U)           (after the backward that made them)
        """
        L, w = self.L, self.windows
        f, b = L.fwd(i), L.bwd(i)
        if kind in ("oc", "on"):
            return range(f + 1, min(f + w.act, b - 1) + 1)
        if kind in ("pc", "pn"):
            return range(max(f + 1, b - w.act), b)
        if kind in ("wfc", "wfn"):
            return range(max(0, f - w.weight), f)
        if kind in ("wbc", "wbn"):
            return range(0) if i == self.U - 1 else range(max(f + 1, b - w.weight), b)
        if kind in ("gdc", "gdn"):
            return range(b + 1, min(b + w.grad, 2 * self.U) + 1)
        raise KeyError(kind)

    def valid_stage(self, kind: str, i: int, s: int) -> bool:
        """Where a share may move at all (the simulator's check of a plan; the MILP's windows
        are inside these): after the bytes exist and before they are needed."""
        L = self.L
        f, b = L.fwd(i), L.bwd(i)
        if kind in ("oc", "on", "pc", "pn"):
            return f < s < b
        if kind in ("wfc", "wfn"):
            return 0 <= s < f
        if kind in ("wbc", "wbn"):
            return i != self.U - 1 and f < s < b
        if kind in ("gdc", "gdn"):
            return b < s <= 2 * self.U
        raise KeyError(kind)

    def gate(self, kind: str, i: int, v: View) -> Lin:
        """What Σ_s share(kind, i, s) must equal: the decision that asks for the transfer."""
        if kind in ("oc", "pc"):
            return [(v.x(i, "cpu"), 1.0)]
        if kind in ("on", "pn"):
            return [(v.x(i, "nvme"), 1.0)]
        attr = "grads" if kind.startswith("gd") else "weights"
        tier = Tier.CPU if kind.endswith("c") else Tier.NVME
        return [(v.h(i, k), 1.0) for k, h in enumerate(self.homes[i]) if getattr(h, attr) is tier]

    def kinds_of(self, i: int) -> list[str]:
        """The transfer kinds unit i can need, given its choices and homes."""
        out = []
        for c, kinds in (("cpu", ("oc", "pc")), ("nvme", ("on", "pn"))):
            if c in self.choices[i]:
                out += kinds
        for h in self.homes[i]:
            for t, kinds in ((h.weights, ("wf", "wb")), (h.grads, ("gd",))):
                if t is not Tier.GPU:
                    for k in kinds:
                        name = k + ("c" if t is Tier.CPU else "n")
                        if name not in out and self.window(name, i):
                            out.append(name)
        return out

    def size(self, kind: str, i: int) -> int:
        return {"act": self.A, "weight": self.P, "grad": self.G}[KINDS[kind].cls][i]

    def ck_return_stage(self, k: int, e: int) -> int:
        """sigma_{k,e}: the stage an offloaded checkpoint X_k comes back in when k's segment
        ends at unit e: the one before the segment's recompute."""
        return self.L.bwd(e) - 1

    def ck_allowed(self, k: int, e: int) -> bool:
        """X_k leaves in stage fwd(k)+1; it can come back only after that."""
        return self.ck_return_stage(k, e) > self.L.fwd(k) + 1

    # -- per home: bytes and optimizer work -------------------------------------------------

    def opt_copy(self, i: int, h: Home) -> int:
        """Bytes of unit i's optimizer-state class: master and moments, plus, where the step
        runs on the host, has no fp32 master and the weights stay on the device, the host's
        own copy of the weights the step updates."""
        extra = self.P[i] if (h.step is Tier.CPU and self.M[i] == 0
                              and h.weights is Tier.GPU) else 0
        return self.O[i] + extra

    def resident(self, i: int, h: Home) -> dict:
        """Bytes unit i holds on each tier for the whole step under home h (on a spec without
        a host tier, 'gpu' is the device's memory and there is no 'cpu')."""
        out = {"gpu": 0, "cpu": 0, "nvme": 0}
        out[h.weights.value] += self.P[i]
        out[h.grads.value] += self.G[i]
        out[h.optimizer.value] += self.opt_copy(i, h)
        return out

    def step_reads(self, i: int, h: Home) -> dict:
        """What unit i's optimizer step needs brought to where it runs, per source tier:
        nvme -> the step's memory; gpu -> host (gradients kept on the device, stepped on the
        host)."""
        nv = 0
        if h.optimizer is Tier.NVME:
            nv += self.opt_copy(i, h)
        if h.weights is Tier.NVME and self.M[i] == 0:
            nv += self.P[i]          # no master: the weights are what the step updates
        if h.grads is Tier.NVME:
            nv += self.G[i]
        d2h = self.G[i] if (h.step is Tier.CPU and h.grads is Tier.GPU) else 0
        return {"nvme": nv, "d2h": d2h}

    def step_writes(self, i: int, h: Home) -> dict:
        nv = (self.opt_copy(i, h) if h.optimizer is Tier.NVME else 0) + \
             (self.P[i] if h.weights is Tier.NVME else 0)
        h2d = self.P[i] if (h.step is Tier.CPU and h.weights is Tier.GPU) else 0
        return {"nvme": nv, "h2d": h2d}

    def state_held(self, i: int, h: Home) -> int:
        """Bytes of unit i's optimizer state its step holds at once when that state lives on
        NVMe: one piece (see STEP_PIECE_BYTES), taking the state as even over its elements."""
        full = self.opt_copy(i, h)
        per_element = full / max(1, self.N[i])
        return min(full, math.ceil(max(STEP_PIECE_BYTES, STEP_PIECE_ALIGN * per_element)))

    def step_transient(self, i: int, h: Home) -> int:
        """Bytes held where the step runs, from its read stage to its write stage: what it
        reads (of a state on NVMe, one piece at a time) and the weights it writes."""
        r = self.step_reads(i, h)
        held = r["nvme"] + r["d2h"]
        if h.optimizer is Tier.NVME:
            held -= self.opt_copy(i, h) - self.state_held(i, h)
        written_only = self.P[i] if (h.weights is Tier.NVME and self.M[i] > 0) else 0
        return held + written_only

    def step_seconds(self, i: int, h: Home) -> tuple[float, float]:
        """(device seconds, host seconds) of unit i's optimizer step under home h."""
        if h.step is Tier.CPU:
            return 0.0, self.N[i] / self.hw.cpu_adam_params_per_s
        return self.t_dev_opt[i], 0.0

    def accumulate_s_per_byte(self) -> float:
        """Host seconds to add one gradient byte into its accumulator."""
        bw = self.hw.host_memory_bandwidth or (self.hw.memory_bandwidth if self.unified else 0)
        return ACCUMULATE_TRAFFIC / bw if bw else 0.0

    def needs_rest_pass(self) -> bool:
        """Passes after the first read back an NVMe gradient accumulator: they differ."""
        return self.K > 1 and any(h.grads is Tier.NVME for hs in self.homes for h in hs)

    # -- constant memory: shared tensors -----------------------------------------------------

    def _shared_memory(self) -> list[int]:
        """Bytes of shared tensors alive in each pass stage, from the unit graph: a tensor one
        unit makes and later units read (rotary tables, masks, an encoder's output) lives from
        its producer's forward to the backward of its last reader, wherever that reader sits in
        the list; its size is the largest any reader reports. A shared tensor without a named
        producer is taken to come from the first unit; one a unit's own prologue made lives
        from that unit's forward to the backward of its last reader."""
        L = self.L
        idx = {x.name: i for i, x in enumerate(self.units)}
        g = nx.DiGraph()
        g.add_nodes_from(idx)
        for x in self.units:
            if x.shared_saved_bytes > 0:
                # p may be x itself (its prologue made them): alive from its own forward to
                # its backward, a self-loop; skipped before, which left them uncounted
                p = x.shared_from if x.shared_from is not None else self.units[0].name
                old = g.edges[p, x.name]["bytes"] if g.has_edge(p, x.name) else 0
                g.add_edge(p, x.name, bytes=max(old, x.shared_saved_bytes))
        out = [0] * (2 * self.U + 1)
        for p in g.nodes:
            readers = list(g.successors(p))
            if not readers:
                continue
            size = max(g.edges[p, r]["bytes"] for r in readers)
            last = max(idx[r] for r in readers)
            for s in range(L.fwd(idx[p]), L.bwd(last) + 1):
                out[s] += size
        return out

    def _tied_grad_buffers(self) -> list[int]:
        """Bytes autograd holds for tied parameters' gradients in each pass stage: a parameter
        two units use gets its gradient in parts, and the engine keeps the first part (from the
        later unit's backward) until the earlier unit's backward adds the second and hands the
        sum to ``.grad``. The part is counted from that later backward to the earlier one,
        both included (there it is summed with the earlier unit's part, which ``alloc``
        counts with K = 1; with K > 1 the resident gradient exists beside both). Under FSDP2
        with K = 1 the root's unsharded gradients (``_engine_memory``) already hold it from
        the head's backward on."""
        out = [0] * (2 * self.U + 1)
        if self.K == 1 and self.engine == "fsdp2":
            return out
        idx = {x.name: i for i, x in enumerate(self.units)}
        for j, x in enumerate(self.units):
            if not x.tied_grad_bytes:
                continue
            span = [idx[t] for t in x.tied_to if t in idx] + [j]
            for s in range(self.L.bwd(max(span)), self.L.bwd(min(span)) + 1):
                out[s] += int(x.tied_grad_bytes)
        return out

    # -- ranks: FSDP2 and DDP ----------------------------------------------------------------
    # Only a sharded engine (``engine`` fsdp2 or ddp) reaches this section; world_size 1 with
    # engine none builds exactly the single-process model above. docs/distributed.md documents
    # each rule and its source.

    def _ranks(self, world_size: int, ranks_per_node: int, engine: str, optimizer_s: float) -> float:
        """Per-rank figures of a sharded engine; returns the per-rank optimizer step time.

        The profile is one rank's (its batch is the per-rank batch). FSDP2 shards every unit's
        weights, gradients and optimizer state 1/N (P_i, G_i, O_i, M_i become ceil(x/N); the
        full P_i, G_i are kept as ``Pfull``, ``Gfull`` for what is gathered), so the optimizer
        steps 1/N of the state. DDP replicates them. --cpu-mem and --nvme-mem are per node: each
        rank gets 1/R of them (R ranks per node).
        NB: FSDP2 pads each parameter's first dimension to a multiple of N; ceil(P_i/N) leaves
        out that padding (at most N-1 rows per parameter).
        NB: segment recompute (checkpoint ``none``) is not offered under FSDP2: a unit rebuilt
        at a later unit's backward would need its weights gathered a second time, so every
        recompute runs in the unit's own backward, when FSDP2 has gathered them anyway.
        """
        self.world, self.rpn, self.engine = int(world_size), int(ranks_per_node), str(engine)
        if self.engine not in ("none", "fsdp2", "ddp"):
            raise ValueError(f"engine {engine!r}: use none, fsdp2 or ddp")
        if self.world < 1 or not 1 <= self.rpn <= self.world:
            raise ValueError(f"world_size {world_size}, ranks_per_node {ranks_per_node}: need "
                             "1 <= ranks_per_node <= world_size")
        if self.engine == "none" and self.world > 1:
            raise ValueError(f"world_size {world_size} needs an engine (fsdp2 or ddp)")
        self.distributed = self.engine != "none"
        self.nodes = -(-self.world // self.rpn)
        self.Pfull, self.Gfull = list(self.P), list(self.G)
        self.engine_static = 0
        if not self.distributed:
            return optimizer_s
        N = self.world
        for k in ("cpu", "nvme"):
            self.budget[k] //= self.rpn
        if self.engine == "fsdp2":
            self.P, self.G, self.O, self.M = ([-(-x // N) for x in xs]
                                              for xs in (self.P, self.G, self.O, self.M))
            return optimizer_s / N
        # DDP copies gradients into its buckets (gradient_as_bucket_view=False, its default):
        # one more copy of every gradient, allocated once and held for good
        self.engine_static = sum(self.G)
        return optimizer_s

    def net_bandwidth(self) -> float:
        """Bus bandwidth of one rank's ring: the intra-node link on one node; across nodes the
        slower of it and the inter-node link (a ring crosses every node boundary)."""
        hw = self.hw
        bw = float(hw.intra_node_bandwidth)
        if self.nodes > 1:
            bw = min(bw, float(hw.inter_node_bandwidth))
        return bw

    def ring_seconds(self, op: str, nbytes: int) -> float:
        """Ring cost of a collective on a tensor of ``nbytes`` (the unsharded size) across N
        ranks: all-gather and reduce-scatter move (N-1)/N of it through each rank, all-reduce
        twice that (NVIDIA nccl-tests doc/PERFORMANCE.md, bus bandwidth; Thakur, Rabenseifner
        and Gropp 2005). NB: the per-step latency (N-1) alpha is left out: these are megabytes."""
        N = self.world
        if N <= 1 or not nbytes:
            return 0.0
        bw = self.net_bandwidth()
        if bw <= 0:
            field = "intra_node_bandwidth" if self.nodes == 1 else "inter_node_bandwidth"
            raise UserError(f"hardware spec {self.hw.name!r} gives no {field}, which {N} ranks "
                            f"on {self.nodes} node(s) need; add it (bytes/s of one rank's ring, "
                            "see profiles/hardware/h100-80g.yaml)")
        factor = 2.0 if op == "all-reduce" else 1.0
        return factor * (N - 1) / N * nbytes / bw

    def collectives(self) -> list[tuple]:
        """(op, cls, unit, stage, bytes) of every collective of a pass, on the ``net`` stream;
        they depend on no decision (the engine issues them), each overlapping the compute of
        its stage.

        FSDP2 (``fully_shard`` on each block, then on the root, which holds the embedding and
        the head): the root's weights are gathered in the prologue and kept to the end of the
        backward (FSDP2 does not reshard the root after forward); block i's weights are
        gathered one stage before its forward and one before its backward (FSDP2's prefetch),
        and its gradients reduce-scattered in the stage after its backward; the root's at the
        last backward stage. DDP: each unit's gradients all-reduced in the stage after its
        backward (the last stage for the embedding).
        """
        if not self.distributed or self.world <= 1:
            return []
        L, U = self.L, self.U
        last = 2 * U
        out = []
        blocks = [i for i, x in enumerate(self.units) if x.kind == UnitKind.BLOCK.value]
        root = [i for i in range(U) if i not in blocks]
        if self.engine == "ddp":
            for i in range(U):
                out.append(("all-reduce", "grad", i, min(L.bwd(i) + 1, last), self.Gfull[i]))
            return out
        for i in root:
            out.append(("all-gather", "weight", i, 0, self.Pfull[i]))
            out.append(("reduce-scatter", "grad", i, last, self.Gfull[i]))
        for i in blocks:
            out.append(("all-gather", "weight", i, L.fwd(i) - 1, self.Pfull[i]))
            out.append(("all-gather", "weight", i, L.bwd(i) - 1, self.Pfull[i]))
            out.append(("reduce-scatter", "grad", i, min(L.bwd(i) + 1, last), self.Gfull[i]))
        return [c for c in out if c[4] > 0]

    def _net_seconds(self) -> list[float]:
        """Seconds of the net stream per pass stage (the ring cost of its collectives)."""
        out = [0.0] * (2 * self.U + 1)
        for op, _, _, s, n in self.collectives():
            out[s] += self.ring_seconds(op, n)
        return out

    def _engine_memory(self) -> list[int]:
        """Device bytes per pass stage that the engine holds whatever the decisions.

        FSDP2: the root's gathered weights from the prologue to the last backward stage, and
        its unsharded gradients from the head's backward on; block i's gathered weights in its
        forward and backward stages and, prefetched, in the stage before each; its unsharded
        gradients in its backward stage and the next (reduce-scattered then). Two blocks'
        weights at most at once: the one computing and the one prefetched.
        NB: on a CPU device gloo runs the collectives synchronously, so the forward holds one
        block's gathered weights, not two, and a reduce-scatter ends inside its backward: the
        model over-counts there by one block's weights or gradients.
        DDP: nothing per stage (its buckets are in ``base``).
        """
        L, U = self.L, self.U
        out = [0] * (2 * U + 1)
        if self.engine != "fsdp2":
            return out
        blocks = [i for i, x in enumerate(self.units) if x.kind == UnitKind.BLOCK.value]
        root = [i for i in range(U) if i not in blocks]
        rw = sum(self.Pfull[i] for i in root)
        rg = sum(self.Gfull[i] for i in root)
        for s in range(0, 2 * U + 1):
            out[s] += rw
        for s in range(L.bwd(U - 1), 2 * U + 1):
            out[s] += rg
        for i in blocks:
            for s in (L.fwd(i) - 1, L.fwd(i), L.bwd(i) - 1, L.bwd(i)):
                out[s] += self.Pfull[i]
            for s in (L.bwd(i), min(L.bwd(i) + 1, 2 * U)):
                out[s] += self.Gfull[i]
        return out

    # -- memory ----------------------------------------------------------------------------

    def grads_from_backward(self) -> bool:
        """With one pass per step (K = 1) a gradient kept on the device exists from its
        unit's backward to the end of the optimizer step: ``opt.zero_grad()`` sets every
        ``.grad`` to None (PyTorch's default since 2.0), so the next forward runs without them
        (the runtime warns when a step starts with gradients present). With K > 1 they carry
        from pass to pass and count for the whole step."""
        return self.K == 1

    def base(self, v: View, optimizer_phase: bool = False) -> dict:
        """Lin per tier: what every home holds for the whole step (a key/value cache, and a
        sharded engine's own resident bytes: DDP's gradient buckets). Gradients on the device
        with K = 1 count from their backward (``alloc``): here only in the optimizer phase."""
        out = {t: [] for t in TIERS}
        if self.engine_static:
            out["gpu"].append((1, float(self.engine_static)))
        late = self.grads_from_backward() and not optimizer_phase
        for i in range(self.U):
            for k, h in enumerate(self.homes[i]):
                for t, n in self.resident(i, h).items():
                    if late and t == "gpu" and h.grads is Tier.GPU:
                        n -= self.G[i]
                    if n:
                        out[t].append((v.h(i, k), float(n)))
        if self.cache:
            out["gpu"].append((1, float(self.cache)))
        return out

    def staging_needs(self, v: View) -> list:
        """Lin terms each of which the pinned staging pool must cover (pool >= each): two
        buffers of the largest NVMe transfer, capped (CUDA only; none on a CPU device)."""
        if not self.n_staging:
            return []
        cap, nb = self.staging_cap, self.n_staging
        out = []
        for i in range(self.U):
            for c, n in (("nvme", self.A[i]), ("rn", self.X[i])):
                if c in self.choices[i]:
                    out.append([(v.x(i, c), float(nb * min(n, cap)))])
            for k, h in enumerate(self.homes[i]):
                n = max([self.P[i] if h.weights is Tier.NVME else 0,
                         self.G[i] if h.grads is Tier.NVME else 0,
                         self.opt_copy(i, h) if h.optimizer is Tier.NVME else 0])
                if n:
                    out.append([(v.h(i, k), float(nb * min(n, cap)))])
        return out

    def alloc(self, s: int, v: View, rest: bool) -> dict:
        """Lin per tier: bytes allocated at the start of pass stage s."""
        L, U = self.L, self.U
        g, c, n = [], [], []
        out = {"gpu": g, "cpu": c, "nvme": n}
        # a gradient accumulator read back from NVMe (passes after the first) is summed where
        # the host's role is played: the device on unified memory, host memory on CUDA
        dev = g if self.unified else c
        if 1 <= s <= U:                      # F:i
            i = s - 1
            g.append((1, float(self.A[i])))
        if 2 <= s <= U + 1:                  # the checkpoint of unit s-2, kept after its forward
            i = s - 2
            for ch in ("rg", "rc", "rn"):
                if ch in self.choices[i]:
                    g.append((v.x(i, ch), float(self.X[i])))
            for ch, tier in (("rc", c), ("rn", n)):
                if ch in self.choices[i]:
                    tier.append((v.x(i, ch), float(self.X[i])))
        if U + 1 <= s <= 2 * U:              # B:i: its recompute materialises the segment
            i = 2 * U - s
            if any(ch in self.choices[i] for ch in REC):
                g.append((v.e(i), float(self.A[i])))
            for k in v.recomputed_at(i):
                g.append((v.q(k, i), float(self.A[k])))
            if self.G[i]:
                # the new gradient exists from B:i: one homed elsewhere leaves from here (its
                # shares free it); with K = 1 one kept on the device is made here and stays
                late = self.grads_from_backward()
                g += [(v.h(i, k), float(self.G[i])) for k, h in enumerate(self.homes[i])
                      if late or h.grads is not Tier.GPU]
        for kind, i in v.at(s):              # transfers arriving in stage s
            K = KINDS[kind]
            nb = float(self.size(kind, i))
            sh = v.share(kind, i, s)
            # only activations take room where they go: a gradient is added into its home
            # copy, which is resident (``base``)
            if K.dst == "gpu":
                g.append((sh, nb))
            elif K.cls == "act":
                (c if K.dst == "cpu" else n).append((sh, nb))
            if rest and kind == "gdn":       # reading a gradient accumulator back, by parts
                dev += self._readback(v, i, nb)
        for k, e, ch in v.ck_returns(s):
            g.append((v.y(ch, k, e), float(self.X[k])))
        return out

    def _readback(self, v: View, i: int, nb: float) -> list:
        """Lin of what reading unit i's gradient accumulator back holds during a stage its
        share moves in: one part (ACC_CHUNK_BYTES) under a home whose gradients are on NVMe.
        Counted in every stage the share may move in (the MILP's window; the simulator's
        stages with a share), freed at the stage's end."""
        part = float(min(nb, ACC_CHUNK_BYTES))
        return [(v.h(i, k), part) for k, h in enumerate(self.homes[i]) if h.grads is Tier.NVME]

    def ck_pairs(self, e: int) -> list:
        """(k, choice) whose offloaded checkpoint may return for a segment ending at e (the
        MILP's candidates: k within w_seg of e)."""
        return [(k, ch) for k in range(max(0, e - self.windows.seg + 1), e + 1)
                for ch in ("rc", "rn") if ch in self.choices[k] and self.ck_allowed(k, e)]

    def free(self, s: int, v: View, rest: bool) -> dict:
        """Lin per tier: bytes freed at the end of pass stage s."""
        L, U = self.L, self.U
        g, c, n = [], [], []
        out = {"gpu": g, "cpu": c, "nvme": n}
        if 1 <= s <= U:                      # end of F:i: a recomputed unit drops its bytes
            i = s - 1
            for ch in REC:
                if ch in self.choices[i]:
                    g.append((v.x(i, ch), float(self.A[i])))
        if 2 <= s <= U + 1:                  # an offloaded checkpoint has left the device
            i = s - 2
            for ch in ("rc", "rn"):
                if ch in self.choices[i]:
                    g.append((v.x(i, ch), float(self.X[i])))
        if U + 1 <= s <= 2 * U:              # end of B:i: everything of unit i goes
            i = 2 * U - s
            g.append((1, float(self.A[i])))
            for ch in ("rg", "rc", "rn"):
                if ch in self.choices[i]:
                    g.append((v.x(i, ch), float(self.X[i])))
        for kind, i in v.at(s):              # transfers leaving in stage s
            K = KINDS[kind]
            nb = float(self.size(kind, i))
            sh = v.share(kind, i, s)
            # a weight fetched from its home is copied, not moved: the home copy stays
            if K.src == "gpu":
                g.append((sh, nb))
            elif K.cls == "act":
                (c if K.src == "cpu" else n).append((sh, nb))
            if rest and kind == "gdn":
                (g if self.unified else c).extend(self._readback(v, i, nb))
        for k, e, ch in v.ck_returns(s):     # a checkpoint's copy was read back
            (c if ch == "rc" else n).append((v.y(ch, k, e), float(self.X[k])))
        # streamed weights: the forward copy goes when the forward ends (the last unit's stays
        # for its backward in the next stage), the backward copy when the backward ends
        for i in self._weight_frees().get(s, ()):
            g += [(v.h(i, k), float(self.P[i])) for k, h in enumerate(self.homes[i])
                  if h.streams_weights]
        return out

    def _weight_frees(self) -> dict:
        """Stage -> units whose streamed weights are freed at its end (see ``free``). Built
        once: scanning every unit at every stage made ``free`` O(U^2), 37 of the 42 s that
        ``plan solve`` spent simulating the baselines of a 500-unit profile."""
        got = self.__dict__.get("_wf")
        if got is None:
            L, U = self.L, self.U
            got = {}
            for i in range(U):
                if not any(h.streams_weights for h in self.homes[i]):
                    continue
                got.setdefault(L.bwd(i) if i == U - 1 else L.fwd(i), []).append(i)
                if i != U - 1:
                    got.setdefault(L.bwd(i), []).append(i)
            self._wf = got
        return got

    def transient(self, s: int, v: View) -> list:
        """GPU Lins of which the largest is held on top of the carried bytes during pass stage
        s: the running unit's workspace; during a segment's recompute, the largest workspace
        of the segment's forwards. In the passes after the first (K > 1), a backward also
        holds its unit's new gradient beside the resident one it is added into."""
        U = self.U
        if s == 0:
            return [[]]
        if s <= U:
            return [[(1, float(self.W[s - 1]))]]
        i = 2 * U - s
        acc = []
        if self.K > 1 and self.G[i]:
            acc = [(v.h(i, k), float(self.G[i])) for k, h in enumerate(self.homes[i])
                   if h.grads is Tier.GPU]
        out = [[(1, float(self.W[i])), *acc]]
        for k in v.recomputed_at(i):
            if self.W[k] > self.W[i]:
                out.append([(v.q(k, i), float(self.W[k])), *acc])
        return out

    def opt_transients(self, v: View) -> dict:
        """Per tier, one Lin per unit: what the unit's step holds where it runs, from its read
        to its write. The optimizer phase holds at most ``opt_depth`` units' at once (with 3:
        one read ahead, one stepping, one written behind): that many times the largest."""
        out = {t: [] for t in TIERS}
        for j in range(self.U):
            per = {t: [] for t in TIERS}
            for k, h in enumerate(self.homes[j]):
                n = self.step_transient(j, h)
                if n:
                    where = "gpu" if (self.unified or h.step is Tier.GPU) else "cpu"
                    per[where].append((v.h(j, k), float(n)))
            for t in TIERS:
                if per[t]:
                    out[t].append(per[t])
        return out

    # -- time ------------------------------------------------------------------------------

    def loads(self, s: int, v: View, rest: bool) -> dict:
        """Lin per resource of pass stage s, each in seconds: the stage lasts the longest.

        compute: f_i at F:i; b_i + f_i e_i + Σ_k f_k q_{k,i} at B:i (its segment's recompute)
        d2h, h2d: bytes over the link's rate; duplex: both over the aggregate rate
        nvme: reads over the read rate plus writes over the write rate (one drive)
        host: gradient accumulation on the host
        """
        U, hw, L = self.U, self.hw, self.L
        comp, d2h, h2d, rd, wr, host = [], [], [], [], [], []
        if 1 <= s <= U:
            comp.append((1, self.f[s - 1]))
        elif s > U:
            i = 2 * U - s
            comp.append((1, self.b[i]))
            if any(ch in self.choices[i] for ch in REC):
                comp.append((v.e(i), self.f[i]))
            for k in v.recomputed_at(i):
                comp.append((v.q(k, i), self.f[k]))
        acc = self.accumulate_s_per_byte()
        for kind, i in v.at(s):
            K = KINDS[kind]
            nb = float(self.size(kind, i))
            sh = v.share(kind, i, s)
            if K.src == "gpu" and not self.unified:
                d2h.append((sh, nb))
            if K.dst == "gpu" and not self.unified:
                h2d.append((sh, nb))
            if K.dst == "nvme":
                wr.append((sh, nb))
                if kind == "gdn" and rest:
                    rd.append((sh, nb))
                    host.append((sh, nb * acc))
            if K.src == "nvme":
                rd.append((sh, nb))
            if kind == "gdc":
                host.append((sh, nb * acc))
        if 2 <= s <= U + 1:                  # an offloaded checkpoint leaves
            i = s - 2
            for ch in ("rc", "rn"):
                if ch in self.choices[i]:
                    if not self.unified:
                        d2h.append((v.x(i, ch), float(self.X[i])))
                    if ch == "rn":
                        wr.append((v.x(i, ch), float(self.X[i])))
        for k, e, ch in v.ck_returns(s):
            yv, nb = v.y(ch, k, e), float(self.X[k])
            if not self.unified:
                h2d.append((yv, nb))
            if ch == "rn":
                rd.append((yv, nb))
        out = self._resource_terms(comp, d2h, h2d, rd, wr, host)
        if self.distributed:
            # net: the engine's collectives (``collectives``), beside compute on their own stream
            out["net"] = [(1, self.net_s[s])] if self.net_s[s] else []
        return out

    def _resource_terms(self, comp, d2h, h2d, rd, wr, host) -> dict:
        hw = self.hw
        out = {"compute": comp, "host": host}
        if not self.unified:
            out["d2h"] = [(v, c / hw.d2h_bandwidth) for v, c in d2h]
            out["h2d"] = [(v, c / hw.h2d_bandwidth) for v, c in h2d]
            out["duplex"] = [(v, c / hw.duplex) for v, c in d2h + h2d]
        else:
            out["d2h"] = out["h2d"] = out["duplex"] = []
        rb = hw.nvme_read_bandwidth or math.inf
        wb = hw.nvme_write_bandwidth or math.inf
        out["nvme"] = [(v, c / rb) for v, c in rd] + [(v, c / wb) for v, c in wr]
        return out

    def opt_loads(self, v: View) -> dict:
        """Lin per resource of the optimizer phase, each the total over units in seconds. With
        depth 3 the phase is a pipeline (read unit j+1, step unit j, write unit j-1 at once),
        so it lasts as long as its busiest resource, or as one unit's own read-step-write chain
        if that is longer (``opt_chains``); with depth 1 it is the sum of the chains."""
        comp, d2h, h2d, rd, wr, host = [], [], [], [], [], []
        for j in range(self.U):
            for k, h in enumerate(self.homes[j]):
                hv = v.h(j, k)
                r, w = self.step_reads(j, h), self.step_writes(j, h)
                dev, cpu = self.step_seconds(j, h)
                for lst, n in ((rd, r["nvme"]), (d2h, r["d2h"]), (wr, w["nvme"]), (h2d, w["h2d"]),
                               (comp, dev), (host, cpu)):
                    if n:
                        lst.append((hv, float(n)))
        return self._resource_terms(comp, d2h, h2d, rd, wr, host)

    def opt_chains(self, v: View) -> list:
        """One Lin per unit: its read, step and write back to back (seconds)."""
        hw = self.hw
        out = []
        for j in range(self.U):
            terms = []
            for k, h in enumerate(self.homes[j]):
                r, w = self.step_reads(j, h), self.step_writes(j, h)
                dev, cpu = self.step_seconds(j, h)
                t = (r["nvme"] / hw.nvme_read_bandwidth if r["nvme"] else 0.0) + \
                    (r["d2h"] / hw.d2h_bandwidth if r["d2h"] else 0.0) + dev + cpu + \
                    (w["nvme"] / hw.nvme_write_bandwidth if w["nvme"] else 0.0) + \
                    (w["h2d"] / hw.h2d_bandwidth if w["h2d"] else 0.0)
                if t:
                    terms.append((v.h(j, k), t))
            if terms:
                out.append(terms)
        return out

    # -- totals ----------------------------------------------------------------------------

    def compute_only(self) -> float:
        """Every plan's floor: K passes of forward and backward, and the optimizer phase at its
        shortest, which is the device's own step unless the host's CPU can take a share of it
        in parallel (the split that balances the two, fractional)."""
        return self.K * (sum(self.f) + sum(self.b)) + self.optimizer_floor()

    def optimizer_floor(self) -> float:
        """min over fractional splits x of max(Σ dev_j (1 - x_j), Σ cpu_j x_j), over the units
        whose step may run on the host: move the units that free the most device time per host
        second first, until the host's share would exceed the device's."""
        dev = sum(self.t_dev_opt)
        movable = []
        for j in range(self.U):
            cpu = min((self.step_seconds(j, h)[1] for h in self.homes[j] if h.step is Tier.CPU),
                      default=None)
            if cpu and self.t_dev_opt[j] > 0:
                movable.append((self.t_dev_opt[j] / cpu, self.t_dev_opt[j], cpu))
        host = 0.0
        for _, d, c in sorted(movable, reverse=True):
            # moving a fraction x of this unit: dev - d x = host + c x
            x = min(1.0, max(0.0, (dev - host) / (d + c)))
            dev -= d * x
            host += c * x
            if x < 1.0:
                break
        return max(dev, host)

    def held_longer(self, v: View) -> Lin:
        """Device bytes held for longer than their transfer window requires, times the stages
        (as a fraction of the pass): a send that leaves after its window's first stage, or a
        fetch that arrives before its window's last. What the second phase of a solve minimises
        (``solvers._settle``): among schedules of equal step, the least device memory held, which
        is also how a runtime behaves (it frees a tensor as soon as its bytes have left, and
        has no reason to fetch early what is hidden anyway)."""
        out = []
        n = float(len(self.L.pass_stages))
        for s in self.L.pass_stages:
            for kind, i in v.at(s):
                K, w = KINDS[kind], self.window(kind, i)
                late = s - w.start if K.src == "gpu" else (w.stop - 1 - s if K.dst == "gpu" else 0)
                if late > 0:
                    out.append((v.share(kind, i, s), float(self.size(kind, i)) * late / n))
        return out

    def moved_bytes(self, v: View) -> Lin:
        """Bytes moved per pass (the tie-break's measure)."""
        out = []
        for s in self.L.pass_stages:
            for kind, i in v.at(s):
                if KINDS[kind].src == "gpu" or KINDS[kind].cls == "weight":
                    out.append((v.share(kind, i, s), float(self.size(kind, i))))
        for i in range(self.U):
            for ch in ("rc", "rn"):
                if ch in self.choices[i]:
                    out.append((v.x(i, ch), float(self.X[i])))
        return out
