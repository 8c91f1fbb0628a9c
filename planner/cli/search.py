"""``plan search``: the micro-batch size and order of the fastest step at a fixed number of
tokens per step. Checks the arguments, profiles each candidate on the meta device (``plan
profile --device meta``'s entry, ``profile_model``, times estimated on the spec), hands the
loop to ``planner.solve.throughput.search`` (each cell solved as ``plan solve`` solves: the
same options, ``solve_options``, one ``SolveConfig`` and ``solve``), prints one progress line
per cell on stderr and the table, and writes the fastest plan, checked again by the simulator,
through ``plan solve``'s writer. ``docs/streaming.md`` ("Searching the batch") documents it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from planner.cli.sweep import _short_reason
from planner.errors import NoFitError, UserError
from planner.formats import write_json_atomic
from planner.sizes import fmt_bytes, fmt_seconds
from planner.solve.command import WRITE_S_PER_UNIT, check_nvme_dir, parse_budgets, solve_options
from planner.solve.throughput import candidates, fastest, search

# the default --time-limit per candidate micro-batch size (plan solve's default; --help says so)
SEARCH_S_PER_CELL = 60.0



def _sizes(text) -> list[int] | None:
    if text is None:
        return None
    try:
        out = [int(x) for x in str(text).replace(" ", "").split(",") if x]
    except ValueError:
        raise UserError(f"--micro-batch-sizes '{text}': give positive integers separated by "
                        "commas, e.g. 1,2,4") from None
    if not out or min(out) < 1:
        raise UserError(f"--micro-batch-sizes '{text}': give positive integers separated by "
                        "commas, e.g. 1,2,4")
    return out


def _profiler(args, hw):
    """``profile_at(b)``: the meta profile at micro-batch size b, as ``plan profile --device
    meta`` takes it (its own warnings are the profile's, not printed once per candidate)."""
    from planner.profile import WARNING_PREFIX, profile_model

    def profile_at(b: int):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=WARNING_PREFIX)
            return profile_model(args.model, b, int(args.seq), dtype=args.dtype, device="meta",
                                 hardware=hw, optimizer=args.optimizer,
                                 blocks_path=args.blocks, timing="estimate")
    return profile_at


def _cell_args(args) -> argparse.Namespace:
    """The command's options as ``plan solve`` gets them (one rank; K and time set per cell)."""
    a = argparse.Namespace(**vars(args))
    a.micro_batches, a.time_limit = 1, None
    a.world_size, a.ranks_per_node, a.engine = 1, None, None
    return a


def _tf(x) -> str:
    return "" if x is None else f"{x:.3g}"


# 6NT above the FLOPs the profile counted for the step by more than this: the model computes
# fewer than 6 x N_params per token (a mixture of experts runs some of its experts), and the
# 6NT cell is marked, with a footnote under the table
OVERSTATED = 1.5
FOOTNOTE_6NT = ("6NT*: the model computes fewer FLOPs than 6 x N_params x tokens (the FLOPs "
                "counted are below it; e.g. a mixture of experts runs only some experts per "
                "token), so the 6NT column overstates its throughput")


def overstated(c) -> bool:
    """Whether ``c``'s 6NT TFLOPS exceed its counted TFLOPS by more than ``OVERSTATED``."""
    return bool(c.fits and c.tflops_6nt and c.tflops_counted is not None
                and c.tflops_6nt > OVERSTATED * c.tflops_counted)


def row_text(c) -> tuple:
    if not c.fits:
        why = (f"no plan fits ({_short_reason(c.status)})" if c.status.startswith("no plan fits")
               else c.status[:100])
        return (str(c.batch), str(c.K), c.order, "-", "", "", "", "", "", "", "", why)
    return (str(c.batch), str(c.K), c.order, fmt_seconds(c.step_s), f"{c.tokens_per_s:,.0f}",
            _tf(c.tflops_6nt) + ("*" if overstated(c) else ""), _tf(c.tflops_counted),
            fmt_bytes(c.peaks["gpu"]),
            fmt_bytes(c.peaks["cpu"]), fmt_bytes(c.peaks["nvme"]),
            f"{c.bound} {c.bound_share:.0%}", f"ok ({c.origin})")


HEAD = ("micro-batch", "K", "order", "step", "tokens/s", "TFLOPS 6NT", "TFLOPS counted",
        "peak GPU", "peak host", "peak NVMe", "bound", "status")


def table(cells, best) -> str:
    rows = [HEAD] + [row_text(c) for c in cells]
    w = [max(len(r[i]) for r in rows) for i in range(len(HEAD))]
    right = set(range(3, 10)) | {0, 1}
    lines = []
    for k, r in enumerate(rows):
        mark = "*" if k and cells[k - 1] is best else " "
        lines.append(mark + " " + "  ".join(c.rjust(w[i]) if i in right else c.ljust(w[i])
                                            for i, c in enumerate(r)).rstrip())
    if any(overstated(c) for c in cells):
        lines.append(FOOTNOTE_6NT)
    return "\n".join(lines)


def _progress_line(c) -> str:
    state = (f"step {fmt_seconds(c.step_s)}, {c.tokens_per_s:,.0f} tokens/s" if c.fits
             else c.status if not c.status.startswith("no plan fits")
             else f"no plan fits ({_short_reason(c.status)})")
    return f"plan search: micro-batch {c.batch} x K {c.K} ({c.order}): {state} [{c.solve_s:.1f} s]"


def _write(best, args, tokens: int) -> Path:
    """The fastest plan, simulated again (the judge) and written as ``plan solve`` writes."""
    from planner.plans.simulate import simulate
    plan = best.plan
    r = simulate(plan)
    assert r.fits and abs(r.step_s - best.step_s) <= 1e-9 * best.step_s, (r.fits, r.step_s)
    m = plan.model
    assert int(m["batch"]) * int(m["seq"]) * plan.micro_batches == tokens
    name = str(m["name"]).replace("/", "_").replace(":", "_")
    path = Path(args.output) if args.output else (
        Path("plans") / f"{name}-s{args.seq}-n{tokens}-{str(args.gpu_mem).strip()}.json")
    write_json_atomic(path, plan.to_dict())
    return path


def cli_search(args) -> int:
    t_start = time.perf_counter()
    from planner.profile.load import _positive_int
    seq = _positive_int(args.seq, "seq")
    tokens = _positive_int(args.tokens_per_step, "tokens-per-step")
    cands = candidates(tokens, seq, _sizes(args.micro_batch_sizes))
    limit = args.time_limit if args.time_limit is not None else SEARCH_S_PER_CELL * len(cands)
    if not (limit > 0 and limit < float("inf")):
        raise UserError(f"--time-limit {args.time_limit}: give a positive number of seconds")
    check_nvme_dir(args)
    from planner.hardware import load_hardware
    hw = load_hardware(args.hardware)
    budgets = parse_budgets(args, hw)
    profile_at = _profiler(args, hw)
    t0 = time.perf_counter()
    first = profile_at(cands[0][0])              # plan solve's checks need a profile
    profile_s = time.perf_counter() - t0
    cache = {cands[0][0]: first}
    hw, kw = solve_options(_cell_args(args), first)   # --nvme-drives applied to the spec
    budgets = parse_budgets(args, hw)
    kw["progress"] = False                        # one line per cell instead
    kw.pop("micro_batches"), kw.pop("time_limit")
    cells = search(lambda b: cache.pop(b, None) or profile_at(b), hw, budgets, kw, cands,
                   tokens, t_start + limit,
                   progress=lambda c: print(_progress_line(c), file=sys.stderr),
                   reserve_s=WRITE_S_PER_UNIT * len(first.layers), profile_s=profile_s)
    best = fastest(cells)
    if best is None and not any(c.status.startswith("no plan fits") for c in cells):
        raise UserError(f"plan search: no candidate could be solved; at micro-batch "
                        f"{cells[0].batch}: {cells[0].status}")
    if best is None:
        c = cells[0]
        raise NoFitError(f"plan search: no candidate fits ({len(cells)} tried); at micro-batch "
                         f"{c.batch} x K {c.K}: {c.status}", budget="gpu")
    path = _write(best, args, tokens)
    m = best.plan.model
    if args.json:
        print(json.dumps({"schema": "tierplan.search/1", "model": m.get("name"),
                          "hardware": hw.name, "seq": seq, "tokens_per_step": tokens,
                          "param_count": int(m.get("param_count") or 0),
                          "budgets": budgets.to_dict(), "time_limit_s": limit,
                          "best": cells.index(best), "plan": str(path),
                          "rows": [c.to_dict() for c in cells]}, sort_keys=True, indent=1))
        return 0
    print(f"{m.get('name')} s{seq}, {tokens:,} tokens a step on {hw.name}: GPU "
          f"{fmt_bytes(budgets.gpu_bytes)}, host {fmt_bytes(budgets.cpu_bytes)}, NVMe "
          f"{fmt_bytes(budgets.nvme_bytes)}; {int(m.get('param_count') or 0):,} parameters")
    print(table(cells, best))
    print(f"fastest (*): micro-batch {best.batch} x K {best.K}, {best.order}")
    print(path)
    return 0
