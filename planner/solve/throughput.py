"""The throughput search behind ``plan search``: for a fixed number of tokens per optimizer
step N at sequence length S, which micro-batch size b (and so K = N / (b S) passes per step)
and which micro-batch order give the fastest step that fits.

Each candidate b is profiled (by the caller's ``profile_at``: ``plan search`` profiles on the
meta device, times estimated on the spec) and solved exactly as ``plan solve`` would solve it:
one ``SolveConfig.build`` with ``micro_batches=K``, then ``search.solve``. Every candidate is
solved once per order ``orders_to_try`` returns. The time limit is shared out as the search
goes: each cell (candidate x order) gets the time left, less what profiling the candidates
still to profile is expected to take (the first profile's time each), divided evenly among the
cells still to solve; a cell that finishes early leaves its time to the ones after it.

Two TFLOPS figures per cell: ``6 N_params x tokens / step`` (the anchors' convention: LoHan,
Liao et al. 2024, and MegaTrain, arXiv 2604.05091, count training FLOPs as 6 N T, recompute and
attention left out) and the profile's counted FLOPs of the step (every pass's forward and
backward, plus the forwards the plan recomputes). The bound resource is the one whose stages
(those it sets the length of, ``StageRecord.bound``) take the largest share of the step.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from planner.costmodel import REC
from planner.errors import NoFitError, UserError
from planner.formats import Plan
from planner.plans.simulate import PlanView, check_plan
from planner.solve.config import SolveConfig
from planner.solve.search import solve

ORDERS = ("batch-major", "layer-major")
MAX_MICRO_BATCHES = 4096          # plan solve's --micro-batches limit
MIN_CELL_S = 0.5                  # the least time a cell's solve is given (plan solve's floor)


def orders_to_try(cfg: SolveConfig) -> tuple[str, ...]:
    """The micro-batch orders each candidate is solved for: both with ``--micro-batch-order
    auto`` where they differ (K > 1), else the one asked for (a row each, so the table shows
    what each order gives)."""
    if cfg.micro_batch_order == "auto":
        return ORDERS if cfg.micro_batches > 1 else ORDERS[:1]
    return (cfg.micro_batch_order,)


def with_order(cfg: SolveConfig, order: str) -> SolveConfig:
    """``cfg`` solving micro-batches in ``order``."""
    return dataclasses.replace(cfg, micro_batch_order=order)


def candidates(tokens: int, seq: int, sizes=None) -> list[tuple[int, int]]:
    """``(b, K)`` per candidate micro-batch size, ascending: ``sizes`` as given, else the powers
    of two that divide N / S. One UserError line when N is not a multiple of S or nothing is
    left."""
    if tokens % seq:
        raise UserError(f"--tokens-per-step {tokens}: not a multiple of --seq {seq}; give "
                        f"a multiple, e.g. {max(1, tokens // seq) * seq}")
    seqs = tokens // seq
    if sizes is None:
        sizes = [1 << k for k in range(seqs.bit_length()) if seqs % (1 << k) == 0]
    else:
        bad = [b for b in sizes if b < 1 or seqs % b]
        if bad:
            raise UserError(f"--micro-batch-sizes: {', '.join(map(str, bad))} does not divide "
                            f"the {seqs} sequences of a step (--tokens-per-step / --seq); give "
                            "divisors of it")
    out = [(b, seqs // b) for b in sorted(set(sizes)) if seqs // b <= MAX_MICRO_BATCHES]
    if not out:
        raise UserError(f"--tokens-per-step {tokens}: no micro-batch size gives at most "
                        f"{MAX_MICRO_BATCHES} passes a step; give larger --micro-batch-sizes")
    return out


@dataclass
class Cell:
    """One candidate micro-batch size under one order: its plan's figures, or why none."""

    batch: int
    K: int
    order: str
    plan: Plan | None = None
    step_s: float | None = None
    tokens_per_s: float | None = None
    tflops_6nt: float | None = None
    tflops_counted: float | None = None
    peaks: dict = field(default_factory=dict)
    bound: str | None = None
    bound_share: float | None = None
    origin: str | None = None
    status: str = "not solved"
    solve_s: float = 0.0

    @property
    def fits(self) -> bool:
        return self.plan is not None

    def to_dict(self) -> dict:
        return {"micro_batch": self.batch, "micro_batches": self.K, "order": self.order,
                "fits": self.fits, "step_s": self.step_s, "tokens_per_s": self.tokens_per_s,
                "tflops_6nt": self.tflops_6nt, "tflops_counted": self.tflops_counted,
                "peak_gpu_bytes": self.peaks.get("gpu"), "peak_cpu_bytes": self.peaks.get("cpu"),
                "peak_nvme_bytes": self.peaks.get("nvme"), "bound": self.bound,
                "bound_share": self.bound_share, "origin": self.origin, "status": self.status,
                "solve_s": self.solve_s}


def recompute_flops(plan: Plan) -> float:
    """FLOPs one pass of ``plan`` spends recomputing forwards in its backward: a unit's own
    forward where it is recomputed at its backward stage, and its segment's at the stage that
    recomputes them (the cost model's rule, ``CostModel.loads``)."""
    cm, shares = check_plan(plan)
    v = PlanView(cm, plan.layers, shares)
    f = [float(u.fwd_flops) for u in cm.units]
    total = 0.0
    for i in range(cm.U):
        if any(ch in cm.choices[i] for ch in REC):
            total += v.e(i) * f[i]
        total += sum(v.q(k, i) * f[k] for k in v.recomputed_at(i))
    return total


def bound_of(sim, passes: int | None = None) -> tuple[str, float]:
    """The resource whose stages take most of the step, and its share of the step (``passes``:
    the stage sequences a step runs, K batch-major, 1 layer-major)."""
    K = sim.micro_batches if passes is None else passes
    by: dict[str, float] = {}
    for st in sim.stages:
        t = st.seconds if st.phase == "optimizer" else st.seconds + (K - 1) * st.seconds_rest
        by[st.bound] = by.get(st.bound, 0.0) + t
    total = sum(by.values())
    top = max(by, key=by.get)
    return top, (by[top] / total if total > 0 else 1.0)


def fill(cell: Cell, out, param_count: int, tokens: int) -> None:
    """``cell``'s figures from a solve's outcome."""
    p, step = out.plan, out.plan.predicted.step_s
    cell.plan, cell.step_s, cell.origin = p, step, p.solver.origin
    cell.tokens_per_s = tokens / step
    cell.tflops_6nt = 6.0 * param_count * tokens / step / 1e12
    counted = p.predicted.flops + cell.K * recompute_flops(p)
    cell.tflops_counted = counted / step / 1e12
    cell.peaks = {"gpu": p.predicted.peak_gpu_bytes, "cpu": p.predicted.peak_cpu_bytes,
                  "nvme": p.predicted.peak_nvme_bytes}
    cell.bound, cell.bound_share = bound_of(
        out.sim, 1 if p.micro_batch_order == "layer-major" else p.micro_batches)
    cell.status = "ok"


def _solve_cell(profile, cfg: SolveConfig, cell: Cell, tokens: int, seeds=()) -> None:
    t0 = time.perf_counter()
    try:
        out = solve(profile, None, cfg, seeds)
    except NoFitError as e:
        cell.status = str(e) if str(e).startswith("no plan fits") else f"no plan fits: {e}"
    else:
        fill(cell, out, int(profile.model.get("param_count") or 0), tokens)
    cell.solve_s = time.perf_counter() - t0


def search(profile_at, hw, budgets, solve_kw: dict, cands: list[tuple[int, int]],
           tokens: int, deadline: float, progress=None, reserve_s: float = 0.0,
           profile_s: float | None = None) -> list[Cell]:
    """Every cell of ``cands`` (``(b, K)``, from ``candidates``) under every order, solved by
    ``deadline`` (``time.perf_counter()``; ``reserve_s`` kept for writing the plan).
    ``profile_at(b)`` is the profile at micro-batch size b; ``solve_kw`` the options of
    ``SolveConfig.build`` but the budgets, K and the time limit. ``progress(cell)`` after each;
    ``profile_s``: what one profile takes (else the first one's time)."""
    cfgs = [SolveConfig.build(hw, budgets, **{**solve_kw, "micro_batches": K,
                                              "time_limit": 1.0}) for _, K in cands]
    orders = [orders_to_try(c) for c in cfgs]
    left = sum(len(o) for o in orders)
    cells: list[Cell] = []
    for j, ((b, K), cfg) in enumerate(zip(cands, cfgs)):
        t0 = time.perf_counter()
        try:
            profile = profile_at(b)
        except UserError as e:        # this micro-batch cannot be profiled (e.g. too many tokens)
            for order in orders[j]:
                cells.append(Cell(b, K, order, status=f"not profiled: {e}"))
                left -= 1
                if progress:
                    progress(cells[-1])
            continue
        profile_s = profile_s if profile_s is not None else time.perf_counter() - t0
        for order in orders[j]:
            ahead = profile_s * (len(cands) - j - 1)
            share = (deadline - time.perf_counter() - reserve_s - ahead) / left
            cell = Cell(b, K, order)
            # the fastest plan so far, its decisions planned anew on this profile: a
            # candidate and the MILP's warm start where it beats this cell's baselines
            best = fastest(cells)
            _solve_cell(profile, with_order(dataclasses.replace(
                cfg, time_limit=max(MIN_CELL_S, share)), order), cell, tokens,
                (best.plan,) if best is not None else ())
            left -= 1
            cells.append(cell)
            if progress:
                progress(cell)
    return cells


def fastest(cells: list[Cell]) -> Cell | None:
    """The fitting cell of the shortest step (the smaller b on a tie: less memory)."""
    fit = [c for c in cells if c.fits]
    return min(fit, key=lambda c: (c.step_s, c.batch)) if fit else None
