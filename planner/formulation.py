"""The MILP: per block keep / recompute (checkpoint tier) / offload, and when every byte moves.

Symbols follow ``docs/formulation.md``; each constraint family is one function whose docstring
holds its equation, and every constraint is named ``<family>_<index>`` (``gpu_mem_fwd_3``).

Stages: with U units, stage ``s = i`` is the forward of unit i and ``s = 2U-1-i`` its backward
(``docs/file-formats.md``). Offloads run in forward stages after their unit's forward, prefetches
in backward stages up to their unit's backward; both spread over a window of stages as
continuous shares, because a block's activations take several stages to cross PCIe (design
brief: 1.27 GB at 55 GB/s is 23 ms against a 7 ms forward).

Bytes enter the model in GB (1e9) and times in seconds, so coefficients stay near 1.
"""
from __future__ import annotations

import contextlib
import math
import os
import re
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field

import networkx as nx
import pulp

from .errors import NoFitError, UserError
from .formats import Activation, HardwareSpec, LayerDecision, Tier, UnitKind, UnitRecord
from .simulate import STAGING_CAP_BYTES, staging_buffers
from .sizes import fmt_bytes

GB = 1e9
# Shares below this are solver noise, not a decision to move bytes.
SHARE_EPS = 1e-6

CHOICES = ("keep", "cpu", "nvme", "rg", "rc", "rn", "rz")
# rg/rc/rn: recompute with the input checkpoint on gpu/cpu/nvme; rz: checkpoint none.
CHOICE_DECISION = {
    "keep": (Activation.KEEP, None),
    "cpu": (Activation.CPU, None),
    "nvme": (Activation.NVME, None),
    "rg": (Activation.RECOMPUTE, Tier.GPU),
    "rc": (Activation.RECOMPUTE, Tier.CPU),
    "rn": (Activation.RECOMPUTE, Tier.NVME),
    "rz": (Activation.RECOMPUTE, Tier.NONE),
}


def decision_choice(d: LayerDecision) -> str:
    for c, (act, ck) in CHOICE_DECISION.items():
        if d.activation is act and (act is not Activation.RECOMPUTE or (d.checkpoint or Tier.GPU) is ck):
            return c
    raise AssertionError(d)


@dataclass(frozen=True)
class Budgets:
    gpu_bytes: int
    cpu_bytes: int
    nvme_bytes: int


@dataclass(frozen=True)
class Options:
    """Switches of the formulation (each documented in docs/formulation.md)."""

    window: int | None = None      # w: stages a transfer may spread over (None: sized from data)
    seg_window: int = 8            # w_seg: longest recompute segment
    allow_offload: bool = True     # False: remat-only (no cpu/nvme activations or checkpoints)
    minimise: str = "time"         # time | gpu | cpu: what the objective minimises
    # True: a binary "prefetch started by stage s" per offloaded unit and backward stage, and
    # GPU memory counts the whole buffer from that start, as the simulator does (exact, but
    # 14 s vs 3.3 s with CBC at 96 blocks); solve.py escalates to it only when the fast
    # model's plan simulates more than 2% off its objective or needs budget tightening.
    exact_prefetch: bool = False


@dataclass
class MilpResult:
    """What one solve returns: decisions, prefetch issue points and the solver's account."""

    layers: list                   # list[LayerDecision]
    prefetch_issue: dict           # unit name -> compute event id where its prefetch starts
    objective: float               # predicted step seconds (or bytes when minimising memory)
    status: str                    # optimal | feasible (time limit)
    gap: float | None
    solve_s: float
    variables: int
    constraints: int
    solver: str
    stage_s: list = field(default_factory=list)   # predicted duration of every stage
    window: int = 0
    # Other prefetch issue points for the same decisions (Formulation.prefetch_candidates),
    # first-share (= prefetch_issue) first; solve.py simulates each and keeps the best.
    prefetch_alternatives: list = field(default_factory=list)

    def solver_info(self) -> dict:
        return {"name": self.solver, "status": self.status, "objective": self.objective,
                "gap": self.gap, "solve_s": round(self.solve_s, 4), "variables": self.variables,
                "constraints": self.constraints}


def lin(terms, constant: float = 0.0) -> pulp.LpAffineExpression:
    """A linear expression from (variable, coefficient) pairs, summing repeated variables
    (pulp's own constructor keeps only the last coefficient of a repeated variable)."""
    e = pulp.LpAffineExpression(constant=constant)
    for v, a in terms:
        e.addterm(v, a)
    return e


class Infeasible(Exception):
    """The model has no solution under the budgets it was given (internal; solve.py reports)."""


# ----------------------------------------------------------------------------- solver choice

class _QuietHiGHS(pulp.HiGHS):
    """PuLP's HiGHS, without the banner ``highspy.Highs()`` prints on stdout before any option
    can silence it (``plan solve`` prints the plan's path as its first stdout line), and with
    an optional progress callback (elapsed, incumbent, gap) on HiGHS's MIP interrupt event."""

    def __init__(self, *a, progress=None, **k):
        super().__init__(*a, **k)
        self.progress = progress

    def createAndConfigureSolver(self, lp):
        import highspy
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                h = highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        h.setOptionValue("output_flag", bool(self.msg))
        for key, val in (("mip_rel_gap", self.gapRel), ("mip_abs_gap", self.gapAbs),
                         ("threads", self.threads),
                         ("time_limit", None if self.timeLimit is None else float(self.timeLimit))):
            if val is not None:
                h.setOptionValue(key, val)
        for key, value in self.optionsDict.items():
            h.setOptionValue(key, value)
        if self.progress is not None:
            h.cbMipInterrupt.subscribe(self.progress)
        lp.solverModel = h


def make_solver(name: str, time_limit: float | None, gap: float | None, warm: bool,
                log_path: str | None, msg: bool = False, gap_abs: float | None = None,
                progress=None):
    """The only place a solver is chosen: ``cbc`` (default) or ``highs``.

    ``gap`` is relative to the solver's own objective, ``gap_abs`` absolute in its units; the
    solver stops at whichever is met first (``run_solver`` passes only the one it means).
    ``progress`` (HiGHS only) is called on HiGHS's MIP interrupt event.
    """
    if name == "cbc":
        # NB: PuLP 3.x warns that its bundled CBC goes away in PuLP 4; we pin pulp<4 for it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            return pulp.PULP_CBC_CMD(msg=msg, timeLimit=time_limit, gapRel=gap, gapAbs=gap_abs,
                                     warmStart=warm, logPath=log_path, threads=1)
    if name == "highs":
        return _QuietHiGHS(msg=msg, timeLimit=time_limit, gapRel=gap, gapAbs=gap_abs, threads=1,
                           progress=progress)
    raise UserError(f"--solver '{name}': unknown solver; use cbc or highs")


# ----------------------------------------------------------------------------- model

class Formulation:
    """Builds the MILP for one profile, hardware spec and budget set.

    Public after ``build()``: ``prob`` (the pulp problem), ``x`` (choice binaries), the share
    variables, and ``stage_event(s, layers)`` to name the compute event that opens stage s.
    """

    def __init__(self, units: list[UnitRecord], hw: HardwareSpec, budgets: Budgets,
                 optimizer_s: float = 0.0, optimizer_workspace_bytes: int = 0,
                 options: Options = Options()):
        self.units = list(units)
        self.hw = hw
        self.budgets = budgets
        self.opt = options
        self.optimizer_s = optimizer_s
        self.optimizer_ws = optimizer_workspace_bytes
        U = self.U = len(units)
        self.S = 2 * U
        self.unified = bool(hw.unified_memory)
        self.A = [u.activation_bytes / GB for u in units]
        self.X = [u.input_bytes / GB for u in units]
        self.W = [u.workspace_bytes / GB for u in units]
        self.f = [float(u.fwd_s) for u in units]
        self.b = [float(u.bwd_s) for u in units]
        self.has_cpu = (not self.unified) and budgets.cpu_bytes > 0 and options.allow_offload
        self.has_nvme = (budgets.nvme_bytes > 0 and options.allow_offload
                         and hw.nvme_read_bandwidth > 0 and hw.nvme_write_bandwidth > 0)
        self.d2h = hw.d2h_bandwidth / GB if not self.unified else 0.0
        self.h2d = hw.h2d_bandwidth / GB if not self.unified else 0.0
        self.rbw = hw.nvme_read_bandwidth / GB
        self.wbw = hw.nvme_write_bandwidth / GB
        self.w = options.window or self._default_window()
        self.wseg = max(1, options.seg_window)
        # Pinned NVMe staging (simulate.py holds the one definition): none on a CPU device.
        self.nbuf = staging_buffers(hw)
        self.C = self._constant_memory()

    # -- helpers ----------------------------------------------------------------------------

    def _default_window(self) -> int:
        """w = 3x the stages one block's transfer takes at full link speed, clamped to 4..12.

        A transfer shares its link with its neighbours', so it needs more stages than the
        bare ratio; 12 keeps the model O(U*12) (design brief: windows keep the model small).
        """
        blocks = [i for i, u in enumerate(self.units) if u.kind == UnitKind.BLOCK.value]
        if not blocks:
            return 4
        bw = self.d2h if not self.unified else self.wbw
        if bw <= 0:
            return 4
        fs = sorted(self.f[i] for i in blocks)
        f_med = max(fs[len(fs) // 2], 1e-9)
        a_max = max(self.A[i] for i in blocks)
        return int(min(12, max(4, math.ceil(3 * a_max / bw / f_med))))

    def bwd(self, i: int) -> int:
        return 2 * self.U - 1 - i

    def unit_of(self, s: int) -> int:
        return s if s < self.U else 2 * self.U - 1 - s

    def ck_back_stage(self, k: int, e: int) -> int:
        """sigma_{k,e} = bwd(e) - 1: the stage where an offloaded checkpoint X_k comes back when
        k's segment ends at unit e, the one before the segment's R event (the schedule's
        default one-ahead point). Exact where the fixed bwd(k) - w_seg was not: that one held
        X_k up to w_seg stages too long and barred the last w_seg units from cpu/nvme
        checkpoints (review: no model of <= 8 blocks could get one)."""
        return self.bwd(e) - 1

    def _constant_memory(self) -> list[float]:
        """C_s: static state + the optimizer-free constants + shared tensors alive at stage s.

        Shared tensors (``shared_from``) come from the unit graph: a tensor lives from its
        producer's forward to the backward of its last reader, wherever that reader sits.
        """
        static = sum(u.static_bytes for u in self.units) / GB
        idx = {u.name: i for i, u in enumerate(self.units)}
        g = nx.DiGraph()
        g.add_nodes_from(idx)
        for u in self.units:
            if u.shared_from and u.shared_saved_bytes > 0:
                if u.shared_from not in idx:
                    raise UserError(f"profile: unit {u.name!r} reads a shared tensor from "
                                    f"{u.shared_from!r}, which is not a unit; regenerate the profile")
                g.add_edge(u.shared_from, u.name, bytes=u.shared_saved_bytes)
        C = [static] * self.S
        for p in g.nodes:
            readers = list(g.successors(p))
            if not readers:
                continue
            size = max(g.edges[p, r]["bytes"] for r in readers) / GB
            last = max(idx[r] for r in readers)
            for s in range(idx[p], self.bwd(last) + 1):
                C[s] += size
        return C

    def choices(self, i: int) -> list[str]:
        u = self.units[i]
        if u.kind != UnitKind.BLOCK.value:
            return ["keep"]
        out = ["keep", "rg"]
        if i > 0 and self.units[i - 1].kind == UnitKind.BLOCK.value:
            out.append("rz")
        if self.has_cpu:
            if self._out_window(i) and self._in_window(i):
                out.append("cpu")
            if self.ck_back_stage(i, i) >= self.U:
                out.append("rc")
        if self.has_nvme:
            if self._out_window(i) and self._in_window(i):
                out.append("nvme")
            if self.ck_back_stage(i, i) >= self.U:
                out.append("rn")
        return out

    def _out_window(self, i: int) -> range:
        """Forward stages where unit i's activations may leave: i+1 .. min(i+w, U-1)."""
        return range(i + 1, min(i + self.w, self.U - 1) + 1)

    def _in_window(self, i: int) -> range:
        """Backward stages where they may come back: max(U, bwd(i)-w) .. bwd(i)-1.

        A prefetch is issued at the start of a compute event strictly before its consumer
        (the schedule's contract), so the last stage it can use is the one before bwd(i).
        """
        return range(max(self.U, self.bwd(i) - self.w), self.bwd(i))

    # -- variables ---------------------------------------------------------------------------

    def _var(self, name: str, low=None, up=None, cat: str = "Continuous"):
        """A variable attached to the model (PuLP 3.3's non-deprecated way to make one)."""
        return self.prob.add_variable(name, low, up, cat=cat)

    def _variables(self):
        U = self.U
        self.x = []
        for i in range(U):
            row = {c: self._var(f"x_{c}_{i}", cat="Binary") for c in self.choices(i)}
            self.x.append(row)
        # o^c_{i,s}, o^n_{i,s}: share of A_i leaving in stage s; p^c, p^n: arriving.
        self.oc, self.on, self.pc, self.pn = {}, {}, {}, {}
        for i in range(U):
            if "cpu" in self.x[i]:
                for s in self._out_window(i):
                    self.oc[i, s] = self._var(f"oc_{i}_{s}", 0, 1)
                for s in self._in_window(i):
                    self.pc[i, s] = self._var(f"pc_{i}_{s}", 0, 1)
            if "nvme" in self.x[i]:
                for s in self._out_window(i):
                    self.on[i, s] = self._var(f"on_{i}_{s}", 0, 1)
                for s in self._in_window(i):
                    self.pn[i, s] = self._var(f"pn_{i}_{s}", 0, 1)
        # m_{k,i}: A_k materialised at bwd(i) by a segment recompute; q_{k,i}: k recomputed in
        # the R event at bwd(i); e_i: i ends a segment.
        self.m, self.q, self.e = {}, {}, {}
        for i in range(U):
            if "rz" in self.x[i] or any(c in self.x[i] for c in ("rg", "rc", "rn")):
                self.e[i] = self._var(f"e_{i}", 0, 1)
        for i in range(U):
            for k in range(max(0, i - self.wseg + 1), i):
                if all("rz" in self.x[t] for t in range(k + 1, i + 1)):
                    self.m[k, i] = self._var(f"m_{k}_{i}", 0, 1)
                    self.q[k, i] = self._var(f"q_{k}_{i}", 0, 1)
        # y^c_{k,e}: X_k (checkpoint on tier c) comes back for a segment ending at e; and
        # stage -> [(k, c, y)] of the checkpoints that come back in that stage.
        self.y, self.ck_back = {}, {}
        for k in range(U):
            for c in ("rc", "rn"):
                if c not in self.x[k]:
                    continue
                for e in [k] + [i for (kk, i) in self.m if kk == k]:
                    s = self.ck_back_stage(k, e)
                    if s >= U:
                        v = self.y[c, k, e] = self._var(f"y{c[1]}_{k}_{e}", 0, 1)
                        self.ck_back.setdefault(s, []).append((k, c, v))
        # phi^c_{i,s} (exact_prefetch only): unit i's prefetch (tier c) has started by backward
        # stage s (binary, non-decreasing in s; it starts where it turns 1). The runtime and the
        # simulator hold the whole buffer A_i from that start (docs/file-formats.md, memory
        # model), so GPU memory counts A_i from it, and the shares p may move only from it on.
        # Cumulative rather than one binary per start stage: O(w) nonzeros per unit, and a
        # branch on phi splits "started by s" from "not yet".
        self.phi, self.phi_at = {}, {}
        if self.opt.exact_prefetch:
            for i in range(U):
                for c, tag in (("cpu", "c"), ("nvme", "n")):
                    if c not in self.x[i]:
                        continue
                    for s in self._in_window(i):
                        self.phi[c, i, s] = self._var(f"s{tag}_{i}_{s}", cat="Binary")
                        self.phi_at.setdefault(s, []).append((c, i))
        self.T = {s: self._var(f"T_{s}", 0) for s in range(U, self.S)}
        self.M = {s: self._var(f"M_{s}", 0) for s in range(1, U)}
        self.H = {s: self._var(f"H_{s}", 0) for s in range(U, self.S)}
        self.pool = self._var("pi", 0) if self.has_nvme and self.nbuf else None
        if self.opt.minimise == "gpu":
            self.G = self._var("G", 0)
        else:
            self.G = self.budgets.gpu_bytes / GB
        if self.opt.minimise == "cpu":
            self.Hc = self._var("Hc", 0)
        else:
            self.Hc = self.budgets.cpu_bytes / GB

    def xv(self, i: int, c: str):
        """The binary for choice c of unit i, or 0 where the choice is not available."""
        return self.x[i].get(c, 0)

    def rec(self, i: int):
        return pulp.lpSum(self.xv(i, c) for c in ("rg", "rc", "rn", "rz"))

    # -- constraint families ----------------------------------------------------------------

    def _c(self, expr, name: str):
        if isinstance(expr, bool):   # a row with no variable left (e.g. stage 0's memory)
            if not expr:
                self.violated.append(name)
            return
        self.prob += expr, name

    def c_choice(self):
        """choice_i:  sum_c x_{c,i} = 1  (one activation decision per unit)."""
        for i in range(self.U):
            self._c(pulp.lpSum(self.x[i].values()) == 1, f"choice_{i}")

    def c_segments(self):
        """Segment recompute (Chen et al. 2016).

        none_follows_i:  z_i <= rec_{i-1}            (a ``none`` follows a recompute unit)
        seg_len_i:       sum_{t=i-w_seg+1..i} z_t <= w_seg - 1   (segments at most w_seg long)
        seg_chain_k_i:   m_{k,i} >= m_{k,i-1} + z_i - 1,  m_{k,k} = 1
        seg_end_i:       e_i >= rec_i - z_{i+1}
        seg_rec_k_i:     q_{k,i} >= m_{k,i} + e_i - 1
        ck_home_c_k:     sum_e y^c_{k,e} = x_c_k                     (c = rc, rn)
        ck_end_c_k_k:    y^c_{k,k} >= e_k + x_c_k - 1
        ck_end_c_k_i:    y^c_{k,i} >= m_{k,i} + e_i + x_c_k - 2   (X_k returns at sigma_{k,i})
        ck_late_k_i:     m_{k,i} + x_rc_k + x_rn_k <= 1   where sigma_{k,i} < U (no stage to
                         bring X_k back in before the segment's R event)
        """
        U = self.U
        for i in range(U):
            if "rz" in self.x[i]:
                self._c(self.x[i]["rz"] <= self.rec(i - 1), f"none_follows_{i}")
            if i >= self.wseg:
                zs = [self.x[t]["rz"] for t in range(i - self.wseg + 1, i + 1) if "rz" in self.x[t]]
                if len(zs) == self.wseg:
                    self._c(pulp.lpSum(zs) <= self.wseg - 1, f"seg_len_{i}")
        for (k, i), m in self.m.items():
            prev = 1 if i == k + 1 else self.m[k, i - 1]
            self._c(m >= prev + self.x[i]["rz"] - 1, f"seg_chain_{k}_{i}")
        for (k, i), m in self.m.items():
            off = [self.x[k][c] for c in ("rc", "rn") if c in self.x[k]]
            if off and self.ck_back_stage(k, i) < U:
                self._c(m + pulp.lpSum(off) <= 1, f"ck_late_{k}_{i}")
        for k in range(U):
            for c in ("rc", "rn"):
                if c not in self.x[k]:
                    continue
                xs = self.x[k][c]
                ys = {e: v for (cc, kk, e), v in self.y.items() if cc == c and kk == k}
                self._c(pulp.lpSum(ys.values()) == xs, f"ck_home_{c}_{k}")
                if k in ys and k in self.e:
                    self._c(ys[k] >= self.e[k] + xs - 1, f"ck_end_{c}_{k}_{k}")
                for e, v in ys.items():
                    if e != k and e in self.e:
                        self._c(v >= self.m[k, e] + self.e[e] + xs - 2, f"ck_end_{c}_{k}_{e}")
        for i, e in self.e.items():
            nxt = self.xv(i + 1, "rz") if i + 1 < U else 0
            self._c(e >= self.rec(i) - nxt, f"seg_end_{i}")
        for (k, i), q in self.q.items():
            if i in self.e:
                self._c(q >= self.m[k, i] + self.e[i] - 1, f"seg_rec_{k}_{i}")

    def c_shares(self):
        """Every offloaded byte leaves and comes back exactly once.

        out_cpu_i:  sum_s o^c_{i,s} = x_cpu_i      in_cpu_i:  sum_s p^c_{i,s} = x_cpu_i
        out_nvme_i: sum_s o^n_{i,s} = x_nvme_i     in_nvme_i: sum_s p^n_{i,s} = x_nvme_i
        """
        for i in range(self.U):
            for tag, o, p, c in (("cpu", self.oc, self.pc, "cpu"), ("nvme", self.on, self.pn, "nvme")):
                if c not in self.x[i]:
                    continue
                self._c(pulp.lpSum(o[i, s] for s in self._out_window(i)) == self.x[i][c],
                        f"out_{tag}_{i}")
                self._c(pulp.lpSum(p[i, s] for s in self._in_window(i)) == self.x[i][c],
                        f"in_{tag}_{i}")

    def c_prefetch_start(self):
        """(exact_prefetch) Each offloaded unit's prefetch starts in exactly one stage and no
        byte moves in before it.

        pf_mono_c_i_t:  phi^c_{i,t-1} <= phi^c_{i,t}                  (c = cpu, nvme)
        pf_start_c_i:   phi^c_{i,last} = x_c_i          (started by the stage before bwd(i))
        pf_after_c_i_t: p^c_{i,t} <= phi^c_{i,t}
        """
        for i in range(self.U):
            for c, p in (("cpu", self.pc), ("nvme", self.pn)):
                if c not in self.x[i]:
                    continue
                win = list(self._in_window(i))
                for a, t in zip(win, win[1:]):
                    self._c(self.phi[c, i, a] - self.phi[c, i, t] <= 0, f"pf_mono_{c}_{i}_{t}")
                self._c(self.phi[c, i, win[-1]] == self.x[i][c], f"pf_start_{c}_{i}")
                for t in win:
                    self._c(p[i, t] - self.phi[c, i, t] <= 0, f"pf_after_{c}_{i}_{t}")

    def pf_started(self, s: int) -> list:
        """(var, bytes) terms of phi(s) - phi(s-1): the prefetches that start in stage s."""
        terms = []
        for c, i in self.phi_at.get(s, ()):
            terms.append((self.phi[c, i, s], self.A[i]))
            if (c, i, s - 1) in self.phi:
                terms.append((self.phi[c, i, s - 1], -self.A[i]))
        return terms

    def _moved_fwd(self, s: int):
        """Bytes (GB) leaving the GPU during forward stage s: activation shares plus the
        checkpoint X_{s-1} of a unit whose checkpoint is offloaded (moved the stage after)."""
        terms = []
        for i in range(max(0, s - self.w), s):
            if (i, s) in self.oc:
                terms.append((self.oc[i, s], self.A[i]))
            if (i, s) in self.on:
                terms.append((self.on[i, s], self.A[i]))
        k = s - 1
        if k >= 0:
            for c in ("rc", "rn"):
                if c in self.x[k]:
                    terms.append((self.x[k][c], self.X[k]))
        return lin(terms)

    def _written_fwd(self, s: int):
        """NVMe write bytes (GB) in forward stage s."""
        terms = []
        for i in range(max(0, s - self.w), s):
            if (i, s) in self.on:
                terms.append((self.on[i, s], self.A[i]))
        if s - 1 >= 0 and "rn" in self.x[s - 1]:
            terms.append((self.x[s - 1]["rn"], self.X[s - 1]))
        return lin(terms)

    def _hold_after_fwd(self, k: int):
        """Bytes unit k holds on the GPU right after its forward."""
        t = [(self.xv(k, "keep"), self.A[k]), (self.xv(k, "cpu"), self.A[k]),
             (self.xv(k, "nvme"), self.A[k])]
        t += [(self.xv(k, c), self.X[k]) for c in ("rg", "rc", "rn")]
        return lin([(v, a) for v, a in t if not isinstance(v, int)])

    def _pool_on_gpu(self):
        return self.pool if (self.unified and self.pool is not None) else 0

    def c_gpu_forward(self):
        """GPU memory in forward stages, as a running sum.

        held_fwd_s:   M_s = M_{s-1} + hold_{s-1} - moved_{s-1},  M_0 = 0
                      hold_k = A_k (x_keep + x_cpu + x_nvme)_k + X_k (x_rg + x_rc + x_rn)_k
                      moved_s = sum_i A_i (o^c + o^n)_{i,s} + X_{s-1} (x_rc + x_rn)_{s-1}
        gpu_mem_fwd_s: C_s + M_s + A_s + W_s [+ pi on unified memory] <= G
        """
        for s in range(self.U):
            if s >= 1:
                prev = self.M[s - 1] if s - 1 >= 1 else 0
                moved = self._moved_fwd(s - 1) if s - 1 >= 1 else 0
                self._c(self.M[s] == prev + self._hold_after_fwd(s - 1) - moved, f"held_fwd_{s}")
            Ms = self.M[s] if s >= 1 else 0
            self._c(Ms + self._pool_on_gpu() - self.G <= -(self.C[s] + self.A[s] + self.W[s]),
                    f"gpu_mem_fwd_{s}")

    def c_links_forward(self):
        """Transfers never lengthen a forward stage (nothing in the forward waits for them):

        d2h_fwd_s:  moved_s <= B_d2h f_s            (separate host tier only)
        nvme_fwd_s: written_s <= B_w f_s            (on unified memory moved_s is written_s)
        """
        for s in range(1, self.U):
            if not self.unified and (self.has_cpu or self.has_nvme):
                self._c(self._moved_fwd(s) <= self.d2h * self.f[s], f"d2h_fwd_{s}")
            if self.has_nvme:
                self._c(self._written_fwd(s) <= self.wbw * self.f[s], f"nvme_fwd_{s}")

    def c_links_total(self):
        """d2h_total:  sum_i A_i (x_cpu + x_nvme)_i + X_i (x_rc + x_rn)_i <= B_d2h sum_{s=1..U-1} f_s
        nvme_w_total: the same for NVMe-bound bytes and B_w.

        Implied by the per-stage link rows; stated over binaries alone so that the solver's
        knapsack-cover cuts see that only a whole number of blocks fits the forward's link time
        (without it the LP offloads 7.4 blocks of 24 and the last 1% of gap takes minutes).
        """
        fwd_time = sum(self.f[1:self.U])
        if not self.unified and (self.has_cpu or self.has_nvme):
            t = [(self.x[i][c], self.A[i]) for i in range(self.U) for c in ("cpu", "nvme")
                 if c in self.x[i]]
            t += [(self.x[i][c], self.X[i]) for i in range(self.U) for c in ("rc", "rn")
                  if c in self.x[i]]
            if t:
                self._c(lin(t) <= self.d2h * fwd_time, "d2h_total")
        if self.has_nvme:
            t = [(self.x[i]["nvme"], self.A[i]) for i in range(self.U) if "nvme" in self.x[i]]
            t += [(self.x[i]["rn"], self.X[i]) for i in range(self.U) if "rn" in self.x[i]]
            if t:
                self._c(lin(t) <= self.wbw * fwd_time, "nvme_w_total")

    def _arrivals(self, s: int):
        """Bytes (GB) arriving on the GPU in backward stage s (prefetch shares + checkpoints)."""
        i = self.unit_of(s)
        terms = []
        for k in range(max(0, i - self.w), i + 1):
            if (k, s) in self.pc:
                terms.append((self.pc[k, s], self.A[k]))
            if (k, s) in self.pn:
                terms.append((self.pn[k, s], self.A[k]))
        terms += self._ck_arrivals(s, ("rc", "rn"))
        return lin(terms)

    def _held_arrivals(self, s: int):
        """Bytes (GB) the GPU starts holding in backward stage s: the prefetch shares (fast
        model) or the whole buffer of every prefetch that starts in s (exact_prefetch), and the
        offloaded checkpoints that come back in s."""
        if not self.opt.exact_prefetch:
            return self._arrivals(s)
        return lin(self.pf_started(s) + self._ck_arrivals(s, ("rc", "rn")))

    def _ck_arrivals(self, s: int, kinds) -> list:
        """Offloaded checkpoints X_k coming back in stage s (sigma_{k,e} = s)."""
        return [(v, self.X[k]) for k, c, v in self.ck_back.get(s, ()) if c in kinds]

    def _read(self, s: int):
        """NVMe read bytes (GB) in backward stage s."""
        i = self.unit_of(s)
        terms = [(self.pn[k, s], self.A[k]) for k in range(max(0, i - self.w), i + 1)
                 if (k, s) in self.pn]
        terms += self._ck_arrivals(s, ("rn",))
        return lin(terms)

    def _release(self, i: int):
        """Bytes unit i frees at the end of its backward (its A_i if held, its checkpoint)."""
        t = [(self.xv(i, c), self.A[i]) for c in ("keep", "cpu", "nvme")]
        t += [(self.xv(i, c), self.X[i]) for c in ("rg", "rc", "rn")]
        return lin([(v, a) for v, a in t if not isinstance(v, int)])

    def c_gpu_backward(self):
        """GPU memory in backward stages, as a running sum over what is held.

        held_bwd_U:   H_U = sum_{k<U} [A_k x_keep_k + X_k x_rg_k] + arr_U
        held_bwd_s:   H_s = H_{s-1} - rel_{i(s-1)} + arr_s
                      arr_s = sum_k A_k (p^c + p^n)_{k,s} + sum_{k: sigma_k = s} X_k (x_rc + x_rn)_k
        NB: the runtime holds a prefetch's whole buffer from its start, the shares count it
        as it arrives; solve.py escalates to exact_prefetch (arr_s = sum_k A_k (phi_{k,s} -
        phi_{k,s-1}) + checkpoints) or tightens the budget on any overflow.
                      rel_i = A_i (x_keep + x_cpu + x_nvme)_i + X_i (x_rg + x_rc + x_rn)_i
        gpu_mem_bwd_s: C_s + H_s + A_i rec_i + sum_{k<i} A_k m_{k,i} + W_i [+ pi] <= G,  i = i(s)
        """
        U = self.U
        for s in range(U, self.S):
            i = self.unit_of(s)
            if s == U:
                base = []
                for k in range(U):
                    if "keep" in self.x[k]:
                        base.append((self.x[k]["keep"], self.A[k]))
                    if "rg" in self.x[k]:
                        base.append((self.x[k]["rg"], self.X[k]))
                self._c(self.H[s] == lin(base) + self._held_arrivals(s), f"held_bwd_{s}")
            else:
                self._c(self.H[s] == self.H[s - 1] - self._release(self.unit_of(s - 1))
                        + self._held_arrivals(s), f"held_bwd_{s}")
            seg = lin([(self.m[k, i], self.A[k]) for k in range(i)
                                           if (k, i) in self.m])
            self._c(self.H[s] + self.A[i] * self.rec(i) + seg + self._pool_on_gpu() - self.G
                    <= -(self.C[s] + self.W[i]), f"gpu_mem_bwd_{s}")

    def compute_s(self, s: int):
        """Compute seconds of backward stage s: b_i + f_i e_i + sum_k f_k q_{k,i}."""
        i = self.unit_of(s)
        terms = [(self.q[k, i], self.f[k]) for k in range(i) if (k, i) in self.q]
        if i in self.e:
            terms.append((self.e[i], self.f[i]))
        return lin(terms, constant=self.b[i])

    def c_time_backward(self):
        """Stage duration: the longest of compute and each link, never their sum.

        time_comp_s: T_s >= compute_s
        time_h2d_s:  T_s >= arr_s / B_h2d
        time_nvme_s: T_s >= read_s / B_r

        Prefetch windows end the stage before the consumer, so a prefetch that is late shows
        as a link-bound stage, not as an exposed copy added to compute.
        """
        for s in range(self.U, self.S):
            self._c(self.T[s] >= self.compute_s(s), f"time_comp_{s}")
            if not self.unified and (self.has_cpu or self.has_nvme):
                self._c(self.T[s] >= (1 / self.h2d) * self._arrivals(s), f"time_h2d_{s}")
            if self.has_nvme:
                self._c(self.T[s] >= (1 / self.rbw) * self._read(s), f"time_nvme_{s}")

    def c_time_total(self):
        """time_total:  sum_{s>=U} T_s >= sum_i (b_i + f_i rec_i).

        Implied by time_comp in integer solutions (each recomputed unit runs its forward once
        more, in its segment's R event); stated on its own because the LP relaxation can spread
        ``none`` so thinly that no segment seems to end, which makes recompute look free and
        the bound useless.
        """
        terms = [(v, 1.0) for v in self.T.values()]
        for i in range(self.U):
            for c in ("rg", "rc", "rn", "rz"):
                if c in self.x[i]:
                    terms.append((self.x[i][c], -self.f[i]))
        self._c(lin(terms) >= sum(self.b), "time_total")

    def c_capacity(self):
        """Host and NVMe capacity (every offload interval spans the forward/backward boundary,
        so the sum is the peak).

        staging_i:  pi >= n_buf min(A_i, 256 MiB) x_nvme_i ;  pi >= n_buf min(X_i, 256 MiB) x_rn_i
                    (n_buf = 2, or 0 on a CPU device, which has no staging: pi is then absent)
        host_mem:   sum_i A_i x_cpu_i + X_i x_rc_i [+ pi off unified memory] <= C_host
        nvme_mem:   sum_i A_i x_nvme_i + X_i x_rn_i <= C_nvme
        """
        cap, nb = STAGING_CAP_BYTES / GB, self.nbuf
        host, nv = [], []
        for i in range(self.U):
            if "nvme" in self.x[i]:
                if self.pool is not None:
                    self._c(self.pool >= nb * min(self.A[i], cap) * self.x[i]["nvme"],
                            f"staging_a_{i}")
                nv.append((self.x[i]["nvme"], self.A[i]))
            if "rn" in self.x[i]:
                if self.pool is not None:
                    self._c(self.pool >= nb * min(self.X[i], cap) * self.x[i]["rn"],
                            f"staging_x_{i}")
                nv.append((self.x[i]["rn"], self.X[i]))
            if "cpu" in self.x[i]:
                host.append((self.x[i]["cpu"], self.A[i]))
            if "rc" in self.x[i]:
                host.append((self.x[i]["rc"], self.X[i]))
        hexpr = lin(host)
        if self.pool is not None and not self.unified:
            hexpr = hexpr + self.pool
        if host or (self.pool is not None and not self.unified) or self.opt.minimise == "cpu":
            self._c(hexpr - self.Hc <= 0, "host_mem")
        if nv:
            self._c(lin(nv) <= self.budgets.nvme_bytes / GB, "nvme_mem")

    def step_expr(self):
        """step = sum_{s<U} f_s + sum_{s>=U} T_s + t_opt."""
        return pulp.lpSum(self.T.values()) + sum(self.f) + self.optimizer_s

    def objective_constant(self) -> float:
        """K: the objective's constant, sum_{s<U} f_s + t_opt (times the weight of the step).

        Neither CBC (through PuLP's MPS file) nor HiGHS (through PuLP's column API) sees it:
        their objective, incumbent, bound and relative gap are all net of K.
        """
        k = sum(self.f) + self.optimizer_s
        return k if self.opt.minimise == "time" else 1e-4 * k

    def compute_only(self) -> float:
        """sum_i (f_i + b_i) + t_opt: a lower bound on every plan's step time."""
        return sum(self.f) + sum(self.b) + self.optimizer_s

    def objective(self):
        """min step + eps * bytes moved (or G / C_host + eps * step when minimising memory).

        eps = 1e-5 s per GB breaks ties towards moving nothing when moving gains nothing
        (offloading that hides fully behind compute is as fast as keeping, and riskier).
        """
        moved = []
        for i in range(self.U):
            for c, a in (("cpu", self.A[i]), ("nvme", self.A[i]), ("rc", self.X[i]), ("rn", self.X[i])):
                if c in self.x[i]:
                    moved.append((self.x[i][c], 1e-5 * a))
        step = self.step_expr()
        if self.opt.minimise == "gpu":
            return self.G + 1e-4 * step
        if self.opt.minimise == "cpu":
            return self.Hc + 1e-4 * step
        return step + lin(moved)

    def build(self) -> pulp.LpProblem:
        self.prob = pulp.LpProblem("tierplan", pulp.LpMinimize)
        self.violated = []   # constant rows that no decision can satisfy
        self._variables()
        self.prob += self.objective()
        self.c_choice()
        self.c_segments()
        self.c_shares()
        if self.opt.exact_prefetch:
            self.c_prefetch_start()
        self.c_gpu_forward()
        self.c_links_forward()
        self.c_links_total()
        self.c_gpu_backward()
        self.c_time_backward()
        self.c_time_total()
        self.c_capacity()
        return self.prob

    # -- warm start and read-back ------------------------------------------------------------

    def warm_start(self, layers: list[LayerDecision]) -> bool:
        """Set the choice binaries to a baseline's decisions; False if one is unavailable."""
        picks = [decision_choice(d) for d in layers]
        if any(c not in self.x[i] for i, c in enumerate(picks)):
            return False
        for i, c in enumerate(picks):
            for cc, v in self.x[i].items():
                v.setInitialValue(1 if cc == c else 0)
        return True

    def decisions(self) -> list[LayerDecision]:
        out = []
        for i, u in enumerate(self.units):
            c = max(self.x[i], key=lambda cc: self.x[i][cc].value() or 0)
            act, ck = CHOICE_DECISION[c]
            out.append(LayerDecision(u.name, act, ck))
        return out

    def stage_event(self, s: int, layers: list[LayerDecision]) -> str:
        """The compute event that opens stage s: F:i, or R:i / B:i in the backward."""
        i = self.unit_of(s)
        name = self.units[i].name
        if s < self.U:
            return f"F:{name}"
        d = layers[i]
        if d.activation is Activation.RECOMPUTE:
            nxt = layers[i + 1] if i + 1 < self.U else None
            if not (nxt and nxt.activation is Activation.RECOMPUTE and nxt.checkpoint is Tier.NONE):
                return f"R:{name}"
        return f"B:{name}"

    def prefetch_issue(self, layers: list[LayerDecision]) -> dict:
        """unit -> compute event where its prefetch starts: the first backward stage with a
        non-zero arriving share (offloaded activations); with exact_prefetch the stage the
        model chose (phi^c_{i,s} turns 1), where it counts the whole buffer."""
        out = {}
        for i, d in enumerate(layers):
            name = self.units[i].name
            if d.activation in (Activation.CPU, Activation.NVME) and self.phi:
                c = "cpu" if d.activation is Activation.CPU else "nvme"
                win = list(self._in_window(i))
                start = next((t for t in win if (self.phi[c, i, t].value() or 0) > 0.5), win[-1])
                out[name] = self.stage_event(start, layers)
            elif d.activation in (Activation.CPU, Activation.NVME):
                pv = self.pc if d.activation is Activation.CPU else self.pn
                first = next((s for s in self._in_window(i)
                              if (pv[i, s].value() or 0) > SHARE_EPS), self.bwd(i) - 1)
                out[name] = self.stage_event(first, layers)
        # Offloaded checkpoints: the schedule's default (the stage before their segment's R
        # event, sigma_{k,e} in the model) is what the model counts, so they are left out.
        return out

    def prefetch_candidates(self, layers: list[LayerDecision]) -> list[dict]:
        """Other issue points for the same decisions, for solve.py to simulate and pick from.

        The model counts a prefetch's bytes share by share, but the runtime (and the simulator)
        holds the whole buffer from the prefetch's start, so starting at the first stage with
        any share can break the GPU budget (review: a 1e-3 share moved a 1.3 GB buffer three
        stages early on a 4-block profile). Per unit: the stage where most of its bytes arrive,
        the last stage with a share; and the schedule's default one-ahead point ({}). Distinct
        dicts, first-share first.
        """
        picks = {"most": {}, "last": {}}
        for i, d in enumerate(layers):
            name = self.units[i].name
            if d.activation in (Activation.CPU, Activation.NVME):
                pv = self.pc if d.activation is Activation.CPU else self.pn
                vals = [(s, pv[i, s].value() or 0) for s in self._in_window(i)]
                live = [(s, v) for s, v in vals if v > SHARE_EPS] or [(self.bwd(i) - 1, 1.0)]
                most = max(live, key=lambda sv: (sv[1], sv[0]))[0]
                picks["most"][name] = self.stage_event(most, layers)
                picks["last"][name] = self.stage_event(live[-1][0], layers)
        out = [self.prefetch_issue(layers), picks["most"], picks["last"], {}]
        uniq = []
        for c in out:
            if c not in uniq:
                uniq.append(c)
        return uniq

    def stage_seconds(self) -> list[float]:
        return [self.f[s] if s < self.U else float(self.T[s].value() or 0) for s in range(self.S)]


# ----------------------------------------------------------------------------- solving

_CBC_PROGRESS = re.compile(r"Cbc0010I After (\d+) nodes.*?([-\d.e+]+) best solution, best possible "
                           r"([-\d.e+]+) \(([\d.]+) seconds\)")
_CBC_BOUND = re.compile(r"best possible ([-\d.e+]+)")


def step_gap(incumbent: float, bound: float, constant: float) -> float:
    """The gap relative to the whole objective (the step time), from a solver's incumbent and
    bound, both net of the constant K it never saw."""
    return max(0.0, incumbent - bound) / max(abs(incumbent + constant), 1e-12)


def _progress_line(elapsed: float, incumbent: float, gap: float) -> None:
    print(f"  solve: {elapsed:6.1f} s  incumbent {incumbent:.5f}  gap {gap:.2%}", file=sys.stderr)


def _tail_progress(log_path: str, stop: threading.Event, constant: float) -> None:
    """Print elapsed time, incumbent (with K) and gap from CBC's log on stderr (TTY only)."""
    pos = 0
    while not stop.wait(1.0):
        try:
            with open(log_path) as fh:
                fh.seek(pos)
                text = fh.read()
                pos = fh.tell()
        except OSError:
            continue
        for m in _CBC_PROGRESS.finditer(text):
            inc, bound = float(m.group(2)), float(m.group(3))
            _progress_line(float(m.group(4)), inc + constant, step_gap(inc, bound, constant))


class _HighsProgress:
    """HiGHS's MIP interrupt callback, throttled to one line a second."""

    def __init__(self, constant: float):
        self.constant = constant
        self.last = -1.0

    def __call__(self, event) -> None:
        d = event.data_out
        t = float(d.running_time)
        inc, bound = float(d.mip_primal_bound), float(d.mip_dual_bound)
        if t - self.last < 1.0 or not (math.isfinite(inc) and math.isfinite(bound)):
            return
        self.last = t
        _progress_line(t, inc + self.constant, step_gap(inc, bound, self.constant))


def _cbc_gap(log_path: str, objective: float, constant: float, allowed: float | None) -> float | None:
    """Step-relative gap of CBC's answer, from its log.

    The bound is the last ``best possible`` CBC printed (its final ``Lower bound`` line keeps
    only 3 decimals, too coarse at 1%). A completed search has pruned every node whose bound
    is within the allowed gap of the incumbent, so its gap is at most that allowance.
    """
    try:
        text = open(log_path).read()
    except OSError:
        return None
    bounds = _CBC_BOUND.findall(text)
    g = step_gap(objective, float(bounds[-1]), constant) if bounds else None
    if "Search completed" in text or "Result - Optimal solution found" in text:
        if "tolerance" not in text:
            return 0.0
        return min(g, allowed) if g is not None and allowed is not None else (
            g if g is not None else allowed)
    return g


def run_solver(f: Formulation, solver: str = "cbc", time_limit: float | None = 60.0,
               gap: float = 0.01, warm: list[LayerDecision] | None = None,
               progress: bool = False) -> MilpResult:
    """Build (if needed) and solve ``f``; raise ``Infeasible`` when nothing fits.

    The solvers see the objective without its constant K (forward stages and optimizer, a
    third of the step), so their relative gap ``gap`` is about 1.5x stricter than the same gap
    on the step (24 blocks: 2% on their scale, 1.03% on the step's); the reported gap is the
    step's (``step_gap``).
    """
    if not hasattr(f, "prob"):
        f.build()
    use_warm = bool(warm) and f.warm_start(warm) and solver == "cbc"
    K = f.objective_constant()
    # NB: an absolute gap of gap x compute-only (exactly --gap of the step) let CBC stop 2%
    # slower on gpt2-xl at 0.25 (1.193 vs 1.170 simulated): the solvers keep their own,
    # stricter relative gap on the objective net of K; only the reported gap is the step's.
    rel, absolute = gap, None
    fd, log_path = tempfile.mkstemp(prefix="tierplan-cbc-", suffix=".log")
    os.close(fd)
    stop = threading.Event()
    th = None
    if progress and solver == "cbc":
        th = threading.Thread(target=_tail_progress, args=(log_path, stop, K), daemon=True)
        th.start()
    if f.violated:
        raise Infeasible(f"constant rows violated: {', '.join(f.violated)}")
    t0 = time.perf_counter()
    try:
        s = make_solver(solver, time_limit, rel, use_warm, log_path if solver == "cbc" else None,
                        gap_abs=absolute,
                        progress=_HighsProgress(K) if progress and solver == "highs" else None)
        f.prob.solve(s)
        dt = time.perf_counter() - t0
        if f.prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
            raise Infeasible(pulp.LpStatus[f.prob.status])
        obj = float(pulp.value(f.prob.objective))       # with K (PuLP adds it back)
        step = float(pulp.value(f.step_expr()))
        net = obj - K
        if solver == "cbc":
            g = _cbc_gap(log_path, net, K, rel * net / obj)   # its gap, on the step
        else:
            info = f.prob.solverModel.getInfo()
            bound = float(info.mip_dual_bound)
            g = step_gap(net, bound, K) if math.isfinite(bound) else None
        status = "optimal" if f.prob.sol_status == pulp.LpSolutionOptimal else "feasible"
    finally:
        stop.set()
        if th:
            th.join(timeout=2)
        with contextlib.suppress(OSError):   # the solver may not have written its log
            os.unlink(log_path)
    layers = f.decisions()
    return MilpResult(layers=layers, prefetch_issue=f.prefetch_issue(layers),
                      objective=step if f.opt.minimise == "time" else obj,
                      status=status, gap=g, solve_s=dt, variables=len(f.prob.variables()),
                      constraints=f.prob.numConstraints(), solver=solver,
                      stage_s=f.stage_seconds(), window=f.w,
                      prefetch_alternatives=f.prefetch_candidates(layers))


def solve_milp(units, hw, budgets: Budgets, *, optimizer_s: float = 0.0,
               optimizer_workspace_bytes: int = 0, options: Options = Options(),
               solver: str = "cbc", time_limit: float | None = 60.0, gap: float = 0.01,
               warm: list[LayerDecision] | None = None, progress: bool = False) -> MilpResult:
    """Solve the MILP for the shortest step under ``budgets``; ``Infeasible`` if none fits."""
    f = Formulation(units, hw, budgets, optimizer_s, optimizer_workspace_bytes, options)
    return run_solver(f, solver, time_limit, gap, warm, progress)
