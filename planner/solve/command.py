"""``plan solve`` at the command line: its options checked and turned into one ``SolveConfig``
(``solve_config``; ``plan sweep`` shares it), the budgets parsed (``parse_budgets``), the plan
written and summed up in one line (``cli_solve``, ``summary_line``).
"""
from __future__ import annotations

import math
import os
import sys
import tempfile
import time
from pathlib import Path

from planner.errors import UserError
from planner.formats import (Budgets, Plan, Profile, load_profile, with_nvme_drives,
                             write_json_atomic)
from planner.formats.fileio import _shown, path_problem
from planner.hardware import load_hardware
from planner.sizes import fmt_bytes, fmt_rate, fmt_seconds, parse_size
from planner.solve import solvers
from planner.solve.config import SolveConfig, warn as _warn
from planner.solve.search import solve

WRITE_S_PER_UNIT = 1e-4


def parse_budgets(args, hw) -> Budgets:
    """Sizes from the command line, checked against the spec (docs: sizes, unified memory)."""
    gpu = parse_size(args.gpu_mem, "--gpu-mem")
    nvme = parse_size(args.nvme_mem if args.nvme_mem is not None else "0", "--nvme-mem")
    if hw.unified_memory:
        cpu = parse_size(args.cpu_mem, "--cpu-mem") if args.cpu_mem is not None else 0
        if cpu != 0:
            raise UserError(f"--cpu-mem {args.cpu_mem}: the spec {hw.name!r} has unified memory "
                            "(no separate host tier); give --cpu-mem 0 or leave it out")
    else:
        cpu = (parse_size(args.cpu_mem, "--cpu-mem") if args.cpu_mem is not None
               else int(hw.host_memory_bytes))
    if gpu > hw.memory_bytes:
        _warn(f"--gpu-mem {args.gpu_mem} is more than the {fmt_bytes(hw.memory_bytes)} of {hw.name}")
    if not hw.unified_memory and cpu > hw.host_memory_bytes:
        _warn(f"--cpu-mem {args.cpu_mem} is more than the {fmt_bytes(hw.host_memory_bytes)} "
              f"host memory of {hw.name}")
    if nvme and not (hw.nvme_read_bandwidth > 0 and hw.nvme_write_bandwidth > 0):
        # the cost model has no NVMe tier here (``has_nvme``): the budget would be recorded
        # in the plan, and named by exit 3, as if it could be used
        _warn(f"--nvme-mem {args.nvme_mem} is ignored: the spec {hw.name} has no NVMe tier "
              "(its NVMe bandwidths are 0)")
        nvme = 0
    if hw.nvme_bytes and nvme > hw.nvme_bytes:
        _warn(f"--nvme-mem {args.nvme_mem} is more than the {fmt_bytes(hw.nvme_bytes)} NVMe "
              f"of {hw.name}")
    return Budgets(gpu, cpu, nvme)


def summary_line(plan: Plan) -> str:
    p, b = plan.predicted, plan.budgets
    ratio = p.step_s / p.compute_s if p.compute_s else float("nan")
    streamed = sum(1 for d in plan.layers if not d.home.resident)
    tail = f"; {streamed} unit(s) with tensors off the device" if streamed else ""
    if plan.engine != "none":
        tail += (f"; per rank of {plan.world_size} ({plan.engine}, {plan.ranks_per_node} per "
                 "node; host and NVMe budgets per node)")
    return (f"{plan.policy} ({plan.solver.origin}): step {fmt_seconds(p.step_s)} = {ratio:.3f}x "
            f"compute-only ({fmt_seconds(p.compute_s)}), {fmt_rate(p.flops, p.step_s)}; peaks GPU "
            f"{fmt_bytes(p.peak_gpu_bytes)} / {fmt_bytes(b.gpu_bytes)}, host "
            f"{fmt_bytes(p.peak_cpu_bytes)} / {fmt_bytes(b.cpu_bytes)}, NVMe "
            f"{fmt_bytes(p.peak_nvme_bytes)} / {fmt_bytes(b.nvme_bytes)}{tail}")


def default_solver() -> str:
    """HiGHS where highspy is installed (``bash setup.sh`` installs it): on this project's
    benchmarks it proves the same gap 1-4x sooner than CBC (docs/formulation.md, Solving);
    else PuLP's bundled CBC."""
    return "highs" if solvers.highs_available() else "cbc"


def check_nvme_dir(args) -> None:
    """``--nvme-dir`` as a path the OS can make (one line, exit 2, before anything is read)."""
    if getattr(args, "nvme_dir", None) is not None:
        why = path_problem(args.nvme_dir)
        if why:
            raise UserError(f"--nvme-dir '{_shown(args.nvme_dir)}': {why}; give a directory "
                            "path (or leave --nvme-dir out for the default)")


def solve_options(args, profile: Profile) -> tuple:
    """``(hw, keyword arguments of SolveConfig.build)`` from ``plan solve``'s options but the
    budgets (also those of ``plan sweep``), each checked: one UserError line per bad value."""
    check_nvme_dir(args)
    if args.hardware:
        hw = load_hardware(args.hardware)
        if hw.name != profile.hardware_spec.name:
            _warn(f"--hardware {args.hardware}: the profile was taken for "
                  f"{profile.hardware_spec.name!r}; times and attention bytes come from the "
                  f"profile's hardware; re-profile with --hardware {args.hardware} for exact "
                  "figures")
    else:
        hw = profile.hardware_spec
    if getattr(args, "nvme_drives", None) is not None:
        hw = with_nvme_drives(hw, args.nvme_drives)
    if args.time_limit is not None and not (math.isfinite(args.time_limit) and args.time_limit > 0):
        raise UserError(f"--time-limit {args.time_limit}: give a positive number of seconds")
    if not (math.isfinite(args.gap) and 0 <= args.gap < 1):
        raise UserError(f"--gap {args.gap}: give a relative gap from 0 to below 1, e.g. 0.005")
    if not 1 <= args.micro_batches <= 4096:
        raise UserError(f"--micro-batches {args.micro_batches}: give 1 to 4096 passes per "
                        "optimizer step")
    nvme_dir = args.nvme_dir or os.path.join(tempfile.gettempdir(), "tierplan-nvme")
    return hw, dict(policy=args.policy, solver=args.solver or default_solver(),
                    time_limit=args.time_limit, gap=args.gap, nvme_dir=nvme_dir,
                    progress=sys.stderr.isatty(), micro_batches=args.micro_batches,
                    stream=args.stream, world_size=args.world_size,
                    ranks_per_node=args.ranks_per_node, engine=args.engine,
                    clip=args.clip, optimizer_overlap=args.optimizer_overlap,
                    micro_batch_order=args.micro_batch_order,
                    shard_homes=getattr(args, "shard_homes", "runnable"))


def default_plan_path(args) -> Path:
    """Where ``plan solve`` writes without ``-o``: ``plans/<profile>-<gpu-mem>.json``."""
    return Path("plans") / f"{Path(args.profile).stem}-{str(args.gpu_mem).strip()}.json"


def cli_solve(args) -> int:
    t_start = time.perf_counter()     # --time-limit bounds the whole command, loading included
    check_nvme_dir(args)
    profile = load_profile(args.profile)
    hw, kw = solve_options(args, profile)
    budgets = parse_budgets(args, hw)
    if kw["time_limit"] is not None:
        # what loading took, and what writing the plan will (~1 s per 10,000 units, measured)
        kw["time_limit"] = max(0.5, kw["time_limit"] - (time.perf_counter() - t_start)
                               - WRITE_S_PER_UNIT * len(profile.layers))
    out = solve(profile, args.profile, SolveConfig.build(hw, budgets, **kw))
    path = Path(args.output) if args.output else default_plan_path(args)
    write_json_atomic(path, out.plan.to_dict())
    print(path)
    print(summary_line(out.plan))
    return 0
