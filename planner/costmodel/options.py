"""What each unit may do: its homes (where weights, gradients and optimizer state live and
where its step runs), its activation choices, the data-sized transfer windows and the stages
each transfer kind may move in (``OptionRules``, a part of ``CostModel``)."""
from __future__ import annotations

import math
from functools import cached_property

from planner.costmodel.layout import KINDS, Lin, View, Windows
from planner.formats import Home, Tier, UnitKind


# a host step this many times slower than the state-up step is no near-tie: state-up is offered
# at every budget (``_offers_state_up``)
STATE_UP_CLEAR = 2.0


class OptionRules:
    """Homes, choices and windows of a ``CostModel`` (which holds the data they read)."""

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

    @cached_property
    def static_bytes(self) -> int:
        """The weights, gradients and optimizer state of every unit (one rank's share)."""
        return sum(self.P[i] + self.G[i] + self.O[i] for i in range(self.U))

    @cached_property
    def static_over(self) -> bool:
        """Whether the weights, gradients and optimizer state alone exceed the device budget:
        some state must then leave the device whatever the activations do."""
        return self.static_bytes > self.budget["gpu"]

    def _homes(self, i: int, allow_streaming: bool) -> list[Home]:
        """``_all_homes``; paced, those whose gradient stays on the device: its step runs in the
        backward stages after its own and frees it there, so a gradient sent off to wait for its
        step (the homes that keep gradients on the host or NVMe all step) is not needed."""
        out = self._all_homes(i, allow_streaming)
        if self.moot_homes == "drop":
            out = [h for h in out if not home_is_moot(h, self.P[i], self.G[i], self.opt_copy(i, h))]
        if self.optimizer_overlap == "paced":
            out = [h for h in out if h.grads is Tier.GPU]
        return out

    def _all_homes(self, i: int, allow_streaming: bool) -> list[Home]:
        """The homes unit i may take on this spec under these budgets. A unit with tied
        parameters keeps its weights and gradients on the device (another unit uses them
        between its own uses), and so does a block charged parameters outside its module
        (code between blocks uses them before its forward, and their gradients finish after
        its backward); a unit without parameters has nothing to place."""
        R = Home()
        if not allow_streaming or self.P[i] + self.G[i] + self.O[i] == 0:
            return [R]
        tied = bool(self.units[i].tied_to) or self.units[i].outside_params > 0
        if self.engine == "fsdp2" and self.units[i].kind != UnitKind.BLOCK.value:
            return [R]      # FSDP2's root group (embedding, head) stays gathered all step
        grads_ok = len(self.window("gdc", i)) > 0     # a gradient needs a stage to leave in
        G_, C_, N_ = Tier.GPU, Tier.CPU, Tier.NVME
        if self.engine == "fsdp2" and self.shard_homes == "runnable":
            # what the runtime executes under FSDP2 today (runtime/sharded.py): on a unified
            # device (gloo ranks on a CPU host) each tensor class's shard on NVMe or on the
            # device with the step on the device (NvmeShards); on a discrete one the whole
            # shard in pinned host memory with the step on the CPU (FSDP2's CPUOffloadPolicy)
            if self.unified:
                if not self.has_nvme:
                    return [R]
                return [R] + [Home(w, g, o, G_) for w in (G_, N_) for g in (G_, N_)
                              for o in (G_, N_)
                              if N_ in (w, g, o) and not (tied and N_ in (w, g))
                              and not (g is N_ and not grads_ok)]
            if not self.has_cpu or self.hw.cpu_adam_params_per_s <= 0 or tied or not grads_ok:
                return [R]
            return [R, Home(C_, C_, C_, C_)]
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
        # The state on the host, stepped on the device (weights and gradients stay there): it
        # comes up over H2D for the step and goes back over D2H (``state_up``; the runtime's
        # ``StagedUnit.step_device``). Offered where the static state cannot all stay on the
        # device, or where the host's step is far slower (``_offers_state_up``). The same with
        # the state on NVMe is priced alike but not offered: it runs nowhere yet, and its
        # columns slowed the 175B solves
        if self.has_cpu and self._offers_state_up(i):
            out.append(Home(G_, G_, C_, G_))
        if not self.has_cpu or self.hw.cpu_adam_params_per_s <= 0:
            return out
        # Gradients on NVMe: with K > 1 every pass after the first reads the accumulators back,
        # which doubles the model's time rows whether or not a unit takes the home and makes
        # large solves markedly slower to converge; so with K > 1 only where the host cannot
        # hold every gradient accumulator
        grad_tiers = (G_, C_, N_) if self.has_nvme and (
            self.passes == 1 or sum(self.G) > self.budget["cpu"]) else (G_, C_)
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

    def _offers_state_up(self, i: int) -> bool:
        """Whether unit i is offered the state-up home: where the static state exceeds the
        device budget (some state must leave), for a given plan's check
        (``state_up_homes_for``), or where a host step of the unit takes more than
        ``STATE_UP_CLEAR`` times the state-up step's link and device time. Where the state fits,
        a plan moves a few units' state off to make room for activations, and a near-tie
        between the host's step and the state-up one only slowed the search (gpt2-xl at half
        its activations: 3.4 -> 45 s for no faster plan; docs/streaming.md, "Homes"). But
        offered below the static state and not above, a budget just above it was slower than
        one just below wherever the host steps slowly (57x on a spec with CPU Adam at 1e6
        params/s): the clear case is offered at every budget."""
        if self.static_over or self.state_up_homes == "all":
            return True
        hw = self.hw
        link = min(hw.h2d_bandwidth, hw.d2h_bandwidth)
        if link <= 0:
            return False
        up = 2 * self.O[i] / link + self.t_dev_opt[i]
        rate = hw.cpu_adam_params_per_s
        host = (self.N[i] / rate if rate > 0 else math.inf) + (self.G[i] + self.P[i]) / link
        return host > STATE_UP_CLEAR * up

    def _choices(self, i: int) -> list[str]:
        x = self.units[i]
        if x.kind != UnitKind.BLOCK.value:
            return ["keep"]
        replayable = x.name not in self.not_replayable
        out = ["keep", "rg"] if replayable else ["keep"]
        # FSDP2: no segment recompute (``_ranks``); every unit is recomputed in its own backward
        if replayable and i > 0 and self.units[i - 1].kind == UnitKind.BLOCK.value \
                and self.engine != "fsdp2" and x.name not in self.chain_breaks \
                and self.units[i - 1].name not in self.not_replayable:
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
            if replayable and L.bwd(i) - 1 > L.fwd(i) + 1:
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
        if kind[:2] in ("wf", "wb", "gd") and self.engine == "fsdp2":
            # a shard comes up one stage before the all-gather that reads it (fwd(i)-1 and
            # bwd(i)-1, ``collectives``) and goes down one after the reduce-scatter
            # (bwd(i)+1) that makes it
            r = self._plain_window(kind, i)
            if kind[:2] == "gd":
                return range(max(r.start, b + 2), r.stop)
            return range(r.start, r.stop - 1)
        return self._plain_window(kind, i)

    def _plain_window(self, kind: str, i: int) -> range:
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
        if self.engine == "fsdp2":      # the shard moves clear of its collective (``window``)
            if kind in ("wfc", "wfn"):
                return 0 <= s < f - 1
            if kind in ("wbc", "wbn"):
                return i != self.U - 1 and f < s < b - 1
            if kind in ("gdc", "gdn"):
                return b + 1 < s <= 2 * self.U
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

    def ck_pairs(self, e: int) -> list:
        """(k, choice) whose offloaded checkpoint may return for a segment ending at e (the
        MILP's candidates: k within w_seg of e)."""
        return [(k, ch) for k in range(max(0, e - self.windows.seg + 1), e + 1)
                for ch in ("rc", "rn") if ch in self.choices[k] and self.ck_allowed(k, e)]


def home_is_moot(h: Home, p: int, g: int, o: int) -> bool:
    """Whether home h places a tensor class of no bytes (``p`` weights, ``g`` gradients, ``o``
    the optimizer-state class, ``opt_copy``) off the device, where only a transfer would put it:
    the schedule makes no event for zero bytes and the runtime's ``check_homes`` wants one (a
    frozen unit: P > 0, G = O = 0, as peft's frozen embedding and head; or SGD without momentum,
    O = 0). Such a class stays on the device. The one exception: state of no bytes "on the
    host" with a host step where the weights stream (w:cpu or w:nvme, g:gpu, o:cpu, s:cpu): on
    a discrete device those are the only homes streaming the weights, and that step does
    nothing. A host step for a unit without gradients whose weights stay on the device is moot
    too: it only uploads weights nothing changed, which the resident home does without."""
    if h.resident:
        return False
    if (p == 0 and h.weights is not Tier.GPU) or (g == 0 and h.grads is not Tier.GPU):
        return True
    if g == 0 and h.step is Tier.CPU and h.weights is Tier.GPU:
        return True
    streamed = h.optimizer is Tier.CPU and h.step is Tier.CPU and h.weights is not Tier.GPU
    return o == 0 and h.optimizer is not Tier.GPU and not streamed


def state_class_bytes(o: int, p: int, m: int, h: Home) -> int:
    """Bytes of a unit's optimizer-state class under home h (``MemoryRules.opt_copy``): master
    and moments (``o``), plus, where the step runs on the host, has no fp32 master (``m`` 0) and
    the weights stay on the device, the host's own copy of the ``p`` bytes of weights it
    updates."""
    return o + (p if (h.step is Tier.CPU and m == 0 and h.weights is Tier.GPU) else 0)


def moot_homes_for(units, layers) -> str:
    """The cost model's ``moot_homes`` for given decisions: "keep" where one of them takes a
    moot home (``home_is_moot``; a plan written before solves dropped them still checks),
    else "drop". The state class's bytes are ``opt_copy``'s."""
    for u, d in zip(units, layers):
        o = state_class_bytes(u.optimizer_bytes, u.param_bytes, u.master_bytes, d.home)
        if home_is_moot(d.home, u.param_bytes, u.grad_bytes, o):
            return "keep"
    return "drop"


def state_up_homes_for(layers) -> str:
    """The cost model's ``state_up_homes`` for given decisions: "all" where one of them
    takes the state-up home (the runtime executes it wherever there is a host, though a solve
    offers it only where the static state is over the device budget), else "auto", the
    solve's own model (the homes offered shape some rows: a plan is priced as it was solved)."""
    return "all" if any(d.home.state_up for d in layers) else "auto"
