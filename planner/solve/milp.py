"""The MILP: per unit, the activation decision and the home of every tensor class, and how
many bytes every transfer moves in every stage.

Every row is built from ``planner.costmodel``: the model adds only variables and the rules
that tie them (one choice per unit, segments, shares that sum to their decision), then bounds
the cost model's memory per tier and stage and takes the cost model's stage durations as its
objective. Symbols follow ``docs/formulation.md``; each constraint family is one method whose
docstring holds its equation, and every row is named ``<family>_<index>`` (``mem_gpu_7``).

Bytes enter the model in GB (1e9) and times in seconds, or in units of ``ts`` seconds where
the compute floor is under 0.1 s (``time_unit``), so coefficients stay near 1; values leave it
in seconds (``objective_value``, ``solution``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pulp

from planner.costmodel import (CHOICE_DECISION, EPS_S_PER_BYTE, REC, TIERS, CostModel, View,
                               decision_choice)
from planner.formats import LayerDecision
from planner.solve.lin import GB, lin, time_unit
from planner.solve.opt_floor import home_groups, opt_floor_int
from planner.solve.overlap_rows import overlap_rows

# Shares below this are solver noise, not a decision to move bytes.
SHARE_EPS = 1e-7


class _Problem(pulp.LpProblem):
    """``pulp.LpProblem`` whose ``variables()`` is collected once until a row or the objective
    changes: PuLP gathers and sorts them from every row on each call, and the solvers and
    PuLP's own solve ask about ten times per model, a noticeable share of a short solve."""

    _vars = None

    def variables(self):
        if self._vars is None:
            self._vars = super().variables()
        return self._vars

    def addConstraint(self, *a, **k):
        self._vars = None
        return super().addConstraint(*a, **k)

    def setObjective(self, obj):
        self._vars = None
        return super().setObjective(obj)

    def __iadd__(self, other):
        self._vars = None
        return super().__iadd__(other)


@dataclass(frozen=True)
class Options:
    """Switches of the formulation (each in docs/formulation.md)."""

    minimise: str = "time"          # time | gpu | cpu: what the objective minimises




class _Vars(View):
    """The MILP's answer to the cost model's questions: variables, or 0 where a decision is
    not available."""

    def __init__(self, m: "Model"):
        self.m = m

    def x(self, i, c):
        return self.m.xv[i].get(c, 0)

    def h(self, i, k):
        return self.m.hv[i][k]

    def share(self, kind, i, s):
        return self.m.sv.get((kind, i, s), 0)

    def e(self, i):
        return self.m.ev.get(i, 0)

    def q(self, k, i):
        return self.m.qv.get((k, i), 0)

    def y(self, c, k, e):
        return self.m.yv.get((c, k, e), 0)

    def at(self, s):
        return self.m.at_stage.get(s, ())

    def recomputed_at(self, i):
        return self.m.rec_at.get(i, ())

    def ck_returns(self, s):
        return self.m.ck_at.get(s, ())


@dataclass
class Solution:
    """What the model chose, read back as plain values."""

    layers: list                   # list[LayerDecision]
    shares: dict                   # (kind, unit index, stage) -> share in (0, 1]
    objective: float               # the step (or the budget minimised), solver's incumbent
    stage_s: list = field(default_factory=list)
    prefetch_bytes: int = 0        # overlapped, clip global: optimizer state read ahead


class Model:
    """The MILP over one ``CostModel``."""

    def __init__(self, cm: CostModel, options: Options = Options()):
        self.cm = cm
        self.opt = options
        self.prob = _Problem("tierplan", pulp.LpMinimize)
        self.violated: list[str] = []
        # what the solver runs learn about this model (planner.solve.runner, .relaxation):
        # seconds a run took beyond its time limit (handing the model over), and whether the
        # last LP was optimal
        self.overrun_s = 0.0
        self.lp_optimal = False
        self.rival = None           # a search the dive leaves to run beside the MIP's
        self.ts = time_unit(cm)
        self.v = _Vars(self)
        self._variables()
        self.c_choice()
        self.c_segments()
        self.c_streamed_segments()
        self.c_shares()
        self.c_out_before_in()
        self.c_memory()
        self.c_time()
        self.c_link_totals()
        self.c_peak_knapsack()
        self.prob += self.objective()

    # -- variables ---------------------------------------------------------------------------

    def _var(self, name, low=0, up=None, cat="Continuous"):
        return self.prob.add_variable(name, low, up, cat=cat)

    def _variables(self):
        cm, U = self.cm, self.cm.U
        # x_{c,i}: activation choice; h_{k,i}: home; a unit with one option gets the constant 1
        self.xv = []
        for i in range(U):
            ch = cm.choices[i]
            self.xv.append({c: (1 if len(ch) == 1 else self._var(f"x_{c}_{i}", 0, 1, "Binary"))
                            for c in ch})
        self.hv = []
        for i in range(U):
            hs = cm.homes[i]
            self.hv.append([1 if len(hs) == 1 else self._var(f"h_{k}_{i}", 0, 1, "Binary")
                            for k in range(len(hs))])
        # shares: s^{kind}_{i,t} in [0, 1]
        self.sv = {}
        for i in range(U):
            for kind in cm.kinds_of(i):
                for t in cm.window(kind, i):
                    self.sv[kind, i, t] = self._var(f"{kind}_{i}_{t}", 0, 1)
        # segments as intervals: z^c_{k,e} = 1 when k..e is one recompute segment, k taking
        # c in {rg, rc, rn} (its input checkpoint kept, on the host or on NVMe) and k+1..e
        # taking rz; e_i (i ends one) and q_{k,i} (k is recomputed at bwd(i)) are sums of them
        self.zv = {}
        for k in range(U):
            for c in ("rg", "rc", "rn"):
                if c not in cm.choices[k]:
                    continue
                for e in range(k, min(U, k + cm.windows.seg)):
                    if e > k and "rz" not in cm.choices[e]:
                        break
                    if c != "rg" and not cm.ck_allowed(k, e):
                        continue
                    self.zv[c, k, e] = self._var(f"z{c[1]}_{k}_{e}", 0, 1)
        self.ev, self.qv = {}, {}
        for (c, k, e) in self.zv:
            if e not in self.ev:
                self.ev[e] = self._var(f"e_{e}", 0, 1)
            for j in range(k, e):
                if (j, e) not in self.qv:
                    self.qv[j, e] = self._var(f"q_{j}_{e}", 0, 1)
        # y^c_{k,e}: k's offloaded checkpoint returns for a segment ending at e: z^c_{k,e}
        self.yv = {key: v for key, v in self.zv.items() if key[0] != "rg"}
        # what the cost model asks per stage: the shares, segment members, checkpoint returns
        self.at_stage, self.rec_at, self.ck_at = {}, {}, {}
        for kind, i, t in self.sv:
            self.at_stage.setdefault(t, []).append((kind, i))
        for k, i in sorted(self.qv):
            self.rec_at.setdefault(i, []).append(k)
        for c, k, e in self.yv:
            self.ck_at.setdefault(cm.ck_return_stage(k, e), []).append((k, e, c))
        L = cm.L
        self.rest = cm.needs_rest_pass()
        self.T = {s: self._var(f"T_{s}") for s in L.pass_stages}
        self.T2 = {s: self._var(f"Tr_{s}") for s in L.pass_stages} if self.rest else {}
        self.To = self._var("To")
        # overlapped, clip global: the state read ahead during the backward (GB), held until
        # the optimizer phase (``OverlapRules``)
        self.Vpre = self._var("Vpre") if cm.overlapped and cm.clip == "global" else None
        self.pool = self._var("pi") if cm.staging_needs(self.v) else None
        self.C = {(t, s): self._var(f"C{t[0]}_{s}") for t in self._tiers() for s in L.pass_stages}
        if self.opt.minimise == "gpu":
            self.Gvar = self._var("G")
        if self.opt.minimise == "cpu":
            self.Hvar = self._var("Hc")

    def _tiers(self):
        """The tiers with memory rows: the device; the host wherever anything can use it (its
        own choices, or the pinned staging of NVMe traffic, which a host budget of 0 then
        forbids); NVMe where it is a tier."""
        cm = self.cm
        host = cm.has_cpu or (not cm.unified and self.pool is not None)
        return [t for t in TIERS if t == "gpu" or (t == "cpu" and host)
                or (t == "nvme" and cm.has_nvme)]

    def budget(self, tier: str):
        """The budget of ``tier`` in GB, or the variable being minimised."""
        if tier == "gpu" and self.opt.minimise == "gpu":
            return self.Gvar
        if tier == "cpu" and self.opt.minimise == "cpu":
            return self.Hvar
        return self.cm.budget[tier] / GB

    def _c(self, expr, name):
        if isinstance(expr, bool):          # a row with no variable left
            if not expr:
                self.violated.append(name)
            return
        self.prob += expr, name

    def rec(self, i):
        return [(self.v.x(i, c), 1.0) for c in REC if c in self.cm.choices[i]]

    # -- constraint families -----------------------------------------------------------------

    def c_choice(self):
        """choice_i:  Σ_c x_{c,i} = 1        home_i:  Σ_k h_{k,i} = 1"""
        for i in range(self.cm.U):
            if len(self.xv[i]) > 1:
                self._c(pulp.lpSum(self.xv[i].values()) == 1, f"choice_{i}")
            if len(self.hv[i]) > 1:
                self._c(pulp.lpSum(self.hv[i]) == 1, f"home_{i}")

    def c_segments(self):
        """Segment recompute (Chen et al. 2016) as intervals: a ``none`` unit (rz) is rebuilt
        with the segment it continues, at the backward of the segment's last unit. A segment
        k..e (z^c_{k,e}) starts at a unit whose input is checkpointed (c = rg, rc, rn) and
        continues through rz units; at most w_seg units long; an offloaded checkpoint only
        where it can be back in time (σ_{k,e} > fwd(k)+1).

        seg_start_c_k:  x_{c,k} = Σ_e z^c_{k,e}                      (c = rg, rc, rn)
        seg_cont_i:     x_{rz,i} = Σ_{c, k<i<=e} z^c_{k,e}
        seg_end_i:      e_i = Σ_{c, k<=i} z^c_{k,i}
        seg_rec_k_i:    q_{k,i} = Σ_{c, j<=k} z^c_{j,i}               (k < i)
        y^c_{k,e} = z^c_{k,e}

        With choice_i these partition the chain: every recomputed unit lies in exactly one
        segment. Given whole x the z are whole (the segments are the maximal runs), so z, e,
        q stay continuous; and the relaxation is a mix of whole segmentations, so it cannot
        rebuild a fraction of a segment more cheaply than the segment (the chain rows this
        replaces, m_{k,i} >= m_{k,i-1} + rz_i - 1, let 60% of rz fade to nothing in three
        units).
        """
        U = self.cm.U
        starts, cont, ends, recs = {}, {}, {}, {}
        for (c, k, e), z in self.zv.items():
            starts.setdefault((c, k), []).append(z)
            ends.setdefault(e, []).append(z)
            for i in range(k + 1, e + 1):
                cont.setdefault(i, []).append(z)
            for j in range(k, e):
                recs.setdefault((j, e), []).append(z)
        for k in range(U):
            for c in ("rg", "rc", "rn"):
                if c in self.xv[k]:
                    self._c(self.xv[k][c] - pulp.lpSum(starts.get((c, k), [])) == 0,
                            f"seg_start_{c}_{k}")
            if "rz" in self.xv[k]:
                self._c(self.xv[k]["rz"] - pulp.lpSum(cont.get(k, [])) == 0, f"seg_cont_{k}")
        for i, e in self.ev.items():
            self._c(e - pulp.lpSum(ends[i]) == 0, f"seg_end_{i}")
        for (j, i), q in self.qv.items():
            self._c(q - pulp.lpSum(recs[j, i]) == 0, f"seg_rec_{j}_{i}")

    def c_streamed_segments(self):
        """A unit whose weights stream is recomputed only on its own (its weights are fetched
        once for its backward stage, which holds its recompute):

        stream_rz_i:   rz_i + Σ_{k streams} h_{k,i} <= 1        (i continues no segment)
        stream_next_i: rz_{i+1} + Σ_{k streams} h_{k,i} <= 1    (no segment continues after i)
        """
        cm = self.cm
        for i in range(cm.U):
            st = [self.hv[i][k] for k, h in enumerate(cm.homes[i]) if h.streams_weights]
            if not st:
                continue
            if "rz" in self.xv[i]:
                self._c(self.xv[i]["rz"] + pulp.lpSum(st) <= 1, f"stream_rz_{i}")
            if i + 1 < cm.U and "rz" in self.xv[i + 1]:
                self._c(self.xv[i + 1]["rz"] + pulp.lpSum(st) <= 1, f"stream_next_{i}")

    def c_shares(self):
        """Every byte a decision moves moves exactly once:

        share_kind_i:  Σ_{t in window(kind, i)} s^{kind}_{i,t} = gate_kind(i)
        (gate: x_{cpu,i} / x_{nvme,i} for activations, Σ of the homes that stream the class)
        """
        cm = self.cm
        for i in range(cm.U):
            for kind in cm.kinds_of(i):
                terms = [(self.sv[kind, i, t], 1.0) for t in cm.window(kind, i)]
                terms += [(v, -c) for v, c in cm.gate(kind, i, self.v)]
                self._c(lin(terms) == 0, f"share_{kind}_{i}")

    def c_out_before_in(self):
        """Offloaded activations come back only after they left (when the windows overlap):

        order_c_i_t:  Σ_{τ<=t} p^c_{i,τ} <= Σ_{τ<t} o^c_{i,τ}        (and the same for nvme)
        """
        cm = self.cm
        for i in range(cm.U):
            for o, p in (("oc", "pc"), ("on", "pn")):
                if p not in cm.kinds_of(i):
                    continue
                out_w, in_w = cm.window(o, i), cm.window(p, i)
                for t in in_w:
                    if t > max(out_w):
                        break
                    terms = [(self.sv[p, i, tt], 1.0) for tt in in_w if tt <= t]
                    terms += [(self.sv[o, i, tt], -1.0) for tt in out_w if tt < t]
                    self._c(lin(terms) <= 0, f"order_{p[1]}_{i}_{t}")

    def c_memory(self):
        """Memory per tier and stage, as the cost model counts it (bytes carried from stage to
        stage as a running sum, so each row has O(w) terms):

        carried_t_s:  C_{t,s} = C_{t,s-1} - free_t(s-1) + alloc_t(s),   C_{t,-1} = 0
        base_t:       base_t = what every home holds on t all step (one variable per tier)
        mem_t_s:      base_t + shared_t(s) + C_{t,s} + ws_s [gpu] + pi [cpu; gpu on unified] <= B_t
        opt_held_t_j: tmax_t >= what unit j's step holds on tier t (read to write)
        mem_t_opt:    base'_t + depth tmax_t + wsopt_t + pi [host] <= B_t
                      (base' = base with every gradient on the device, also with K = 1)
        ws_s >= each workspace candidate of stage s (the largest of a recomputed segment's)
        opt_ws_t_j:   wsopt_t >= unit j's step workspace on tier t (``step_workspace``)
        staging_n:    pi >= each staging need (two buffers of the largest NVMe transfer)
        """
        cm, L, v = self.cm, self.cm.L, self.v
        base, base_opt = cm.base(v), cm.base(v, optimizer_phase=True)
        if self.pool is not None:
            for n, need in enumerate(cm.staging_needs(v)):
                self._c(self.pool - lin(need, 1 / GB) >= 0, f"staging_{n}")
        pool_tier = None if self.pool is None else ("gpu" if cm.unified else "cpu")
        tmax = {}
        for t, per_unit in cm.opt_transients(v).items():
            if t not in self._tiers():
                continue
            tmax[t] = self._var(f"tmax_{t}") if per_unit else 0
            for j, terms in enumerate(per_unit):
                self._c(tmax[t] - lin(terms, 1 / GB) >= 0, f"opt_held_{t}_{j}")
        self.wsopt = {}
        for t, per_unit in cm.opt_workspaces(v).items():
            if t not in self._tiers() or not per_unit:
                continue
            self.wsopt[t] = self._var(f"wsopt_{t}")
            for j, terms in enumerate(per_unit):
                self._c(self.wsopt[t] - lin(terms, 1 / GB) >= 0, f"opt_ws_{t}_{j}")
        for t in self._tiers():
            held = self._held_all_step(t, base[t])
            prev_free = None
            for s in L.pass_stages:
                a = cm.alloc(s, v, self.rest)[t]
                terms = [(self.C[t, s], -1.0)] + [(x, c / GB) for x, c in a]
                if s > 0:
                    terms += [(self.C[t, s - 1], 1.0)] + [(x, -c / GB) for x, c in prev_free]
                self._c(lin(terms) == 0, f"carried_{t}_{s}")
                prev_free = cm.free(s, v, self.rest)[t]
                row = held + self.C[t, s]
                if t == "gpu":
                    row += cm.shared[s] / GB
                if t == "gpu":
                    cands = [c for c in cm.transient(s, v) if c]
                    if len(cands) == 1:
                        row += lin(cands[0], 1 / GB)
                    elif cands:
                        ws = self._var(f"ws_{s}")
                        for n, c in enumerate(cands):
                            self._c(ws - lin(c, 1 / GB) >= 0, f"ws_{s}_{n}")
                        row += ws
                if t == pool_tier:
                    row += self.pool
                if cm.overlapped and s > cm.U:
                    row += self._overlap_held(t, tmax)
                self._c(row - self.budget(t) <= 0, f"mem_{t}_{s}")
        for t in tmax:
            row = lin(base_opt[t], 1 / GB) + cm.opt_depth * tmax[t] + self.wsopt.get(t, 0)
            if t == pool_tier:
                row += self.pool
            if self.Vpre is not None and t == cm.prefetch_tier():
                row += self.Vpre
            self._c(row - self.budget(t) <= 0, f"mem_{t}_opt")

    def _held_all_step(self, t: str, terms) -> pulp.LpAffineExpression:
        """What every home holds on tier t all step, in GB, as each stage's memory row takes
        it: one variable ``base_t`` (its row ``base_t``) where homes are chosen, so that the
        2U rows hold one term each instead of every unit's home choices; those O(U^2)
        nonzeros made the relaxation's interior-point iterations dense (gpt3-175b, 98
        units: 53 iterations in 10.4 s)."""
        expr = lin(terms, 1 / GB)
        if len(expr) < 2:
            return expr
        b = self._var(f"base_{t}")
        self._c(b - expr == 0, f"base_{t}")
        return pulp.LpAffineExpression([(b, 1.0)])

    def _overlap_held(self, t: str, tmax: dict):
        """GB the optimizer work beside a backward stage holds on tier t: ``opt_depth``
        units' steps in flight (clip none), or the state read ahead (clip global)."""
        if self.Vpre is not None:
            return self.Vpre if t == self.cm.prefetch_tier() else 0
        # a step's own workspace where it runs
        return self.cm.opt_depth * tmax.get(t, 0) + self.wsopt.get(t, 0)

    def c_time(self):
        """A stage lasts as long as its longest resource (transfers overlap compute):

        time_r_s:   T_s >= load_r(s)            r in compute, d2h, h2d, duplex, nvme, host
        (and Tr_s for the passes after the first, which also read gradient accumulators back)
        timeo_r:       To >= Σ_j load_r(j)       the optimizer phase (depth 3): its busiest
        timeo_chain_j: To >= read_j + step_j + write_j     resource, or one unit's chain
        timeo_sum:     To >= Σ_j (read_j + step_j + write_j)    (depth 1: one after another)
        (overlapped, either depth: ``overlap_rows``)
        timeo_int:     To >= F_int   (depth 3; valid: the phase over whole units, opt_floor_int)
        """
        cm, L, v = self.cm, self.cm.L, self.v
        for s in L.pass_stages:
            for T, rest, tag in ((self.T, False, ""), (self.T2, True, "r")):
                if not T:
                    continue
                for r, terms in cm.loads(s, v, rest).items():
                    if terms:
                        self._c(T[s] - lin(terms, 1 / self.ts) >= 0, f"time{tag}_{r}_{s}")
        chains = cm.opt_chains(v)
        if cm.overlapped:
            # (at depth 1 the worker's rows bound the phase by the chains not yet run)
            overlap_rows(self)
        elif cm.opt_depth == 1:
            # one unit after the other: the phase is the sum of their chains
            self._c(self.To - lin([t for c in chains for t in c], 1 / self.ts) >= 0, "timeo_sum")
        else:
            for r, terms in cm.opt_loads(v).items():
                if terms:
                    self._c(self.To - lin(terms, 1 / self.ts) >= 0, f"timeo_{r}")
            for j, terms in enumerate(chains):
                self._c(self.To - lin(terms, 1 / self.ts) >= 0, f"timeo_chain_{j}")
            floor = opt_floor_int(cm)
            if floor is not None:
                self._c(self.To >= floor / self.ts, "timeo_int")

    def c_link_totals(self):
        """Valid inequalities (implied in integer solutions; they tighten the LP relaxation):

        time_total:   Σ_s T_s >= Σ_i (f_i + b_i) + Σ_i f_i rec_i   (each recomputed unit runs
                      its forward once more: without it the relaxation spreads ``none`` so
                      thinly that no segment seems to end and recompute looks free)
        (The per-link totals, Σ_s T_s >= Σ_s load_r(s), were once here too: they are the
        sums of the time rows, so they tightened nothing, and their U x homes terms each made
        the relaxation's interior-point iterations slower.)
        """
        cm = self.cm
        terms = [(self.T[s], 1.0) for s in cm.L.pass_stages]
        for i in range(cm.U):
            terms += [(x, -cm.f[i] / self.ts) for x, _ in self.rec(i)]
        self._c(lin(terms) >= (sum(cm.f) + sum(cm.b)) / self.ts, "time_total")

    def c_peak_knapsack(self):
        """Valid inequality over binaries alone (implied by mem_gpu at the first backward
        stage, where every kept activation and checkpoint is held at once); the solvers' cover
        cuts need it stated without the continuous shares:

        peak_knapsack: Σ_i [A_i x_keep_i + X_i x_rg_i] + Σ_{i,k} R^gpu_{i,k} h_{k,i}
                       + A_{U-1} + W_{U-1} + shared(U+1) <= G
        """
        cm, v = self.cm, self.v
        i_head = cm.U - 1
        terms = list(cm.base(v)["gpu"])
        for i in range(cm.U - 1):
            if "keep" in cm.choices[i]:
                terms.append((v.x(i, "keep"), float(cm.A[i])))
            if "rg" in cm.choices[i]:
                terms.append((v.x(i, "rg"), float(cm.X[i])))
        const = cm.A[i_head] + cm.W[i_head] + cm.shared[cm.L.bwd(i_head)]
        self._c(lin(terms, 1 / GB, const / GB) - self.budget("gpu") <= 0, "peak_knapsack")

    def home_counts(self) -> list:
        """For each group g of alike units (``home_groups``) with a choice, and each home k:
        the variables whose sum n_{g,k} = Σ_{j in g} h_{k,j} is a whole number in any plan
        (``planner.solve.bound`` branches the relaxation on a fractional one)."""
        cm, out = self.cm, []
        for units in home_groups(cm):
            if len(units) < 2 or len(cm.homes[units[0]]) < 2:
                continue
            for k in range(len(cm.homes[units[0]])):
                hv = [self.v.h(j, k) for j in units]
                if not any(isinstance(x, (int, float)) for x in hv):
                    out.append(hv)
        return out

    def counts(self) -> list:
        """Sums of binaries that are whole numbers in any plan, for ``planner.solve.bound`` to
        branch the relaxation on: the home counts (``home_counts``), for each activation
        choice the number of units taking it, and the number of recompute segments."""
        out = list(self.home_counts())
        by_choice: dict = {}
        for xs in self.xv:
            for c, var in xs.items():
                if not isinstance(var, (int, float)):
                    by_choice.setdefault(c, []).append(var)
        out += [vs for _, vs in sorted(by_choice.items()) if len(vs) > 1]
        if len(self.ev) > 1:
            out.append([self.ev[e] for e in sorted(self.ev)])
        return out

    # -- objective -----------------------------------------------------------------------------

    def step_expr(self) -> pulp.LpAffineExpression:
        """step = Σ_s T_s (first pass) + (K-1) Σ_s T'_s (later passes) + To, in the model's
        time unit (``ts`` seconds)"""
        K = self.cm.passes
        first = pulp.lpSum(self.T.values())
        later = pulp.lpSum(self.T2.values()) if self.T2 else first
        return first + (K - 1) * later + self.To

    def objective(self):
        """min step + eps · bytes moved per pass (10 us per GB: moving bytes that gain nothing
        loses the tie to not moving them); or the budget of a tier (+1e-4 · step) when finding
        the smallest that fits."""
        step = self.step_expr()
        if self.opt.minimise == "gpu":
            return self.Gvar + 1e-4 * step
        if self.opt.minimise == "cpu":
            return self.Hvar + 1e-4 * step
        out = step + lin(self.cm.moved_bytes(self.v), EPS_S_PER_BYTE * self.cm.passes / self.ts)
        if self.Vpre is not None:        # reading ahead what gains nothing loses the tie
            out += self.Vpre * (EPS_S_PER_BYTE * GB / self.ts)
        return out

    def objective_value(self, x: float) -> float:
        """A value of the objective in its own unit: seconds when the step is minimised (the
        model counts time in units of ``ts``), GB when a budget is."""
        return x * self.ts if self.opt.minimise == "time" else x

    # -- warm start and read-back -----------------------------------------------------------

    def warm_start(self, layers: list[LayerDecision]) -> bool:
        """Set the choice binaries to ``layers``; False if one is not available here."""
        picks = []
        for i, d in enumerate(layers):
            c = decision_choice(d)
            if c not in self.xv[i] or d.home not in self.cm.homes[i]:
                return False
            picks.append((c, self.cm.homes[i].index(d.home)))
        for i, (c, k) in enumerate(picks):
            for cc, var in self.xv[i].items():
                if not isinstance(var, int):
                    var.setInitialValue(1 if cc == c else 0)
            for kk, var in enumerate(self.hv[i]):
                if not isinstance(var, int):
                    var.setInitialValue(1 if kk == k else 0)
        return True

    def solution(self) -> Solution:
        cm = self.cm

        def val(x):
            return float(x) if isinstance(x, (int, float)) else float(x.value() or 0.0)
        layers = []
        for i, u in enumerate(cm.units):
            c = max(self.xv[i], key=lambda cc: val(self.xv[i][cc]))
            k = max(range(len(self.hv[i])), key=lambda kk: val(self.hv[i][kk]))
            act, ck = CHOICE_DECISION[c]
            layers.append(LayerDecision(u.name, act, ck, cm.homes[i][k]))
        shares = {key: val(x) for key, x in self.sv.items() if val(x) > SHARE_EPS}
        stage_s = [val(self.T[s]) * self.ts for s in cm.L.pass_stages] + [val(self.To) * self.ts]
        pre = 0 if self.Vpre is None else max(0, int(val(self.Vpre) * GB))
        return Solution(layers=layers, shares=shares, objective=self.step_s(), stage_s=stage_s,
                        prefetch_bytes=pre)

    def step_s(self) -> float:
        """The step of the solution held in the variables, in seconds."""
        return float(pulp.value(self.step_expr())) * self.ts

