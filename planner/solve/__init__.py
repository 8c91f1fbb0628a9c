"""``plan solve``: budgets in, the fastest plan that the simulator says fits out.

Plans come from strategies, each returning ``Candidate(plan, simulation, origin)``:

- the baselines (keep-all, recompute-all, sqrt, offload-all, and stream-all where the spec and
  budgets allow homes off the device), their transfers placed greedily;
- the activation-only MILP (every tensor class at home on the device), always (it finds no
  plan when the static state does not fit);
- the joint MILP (activations and the home of every tensor class), with the optimizer phase
  pipelined (depth 3) and then one unit at a time (depth 1), each warm-started from the best
  candidate so far, when homes off the device are possible and no candidate fits, or
  ``--stream on``, or the best is slower than the compute floor (K forward and backward
  passes) by more than the gap;
- when no strategy found a fitting plan in time, the GPU-minimising joint MILP's plan if it fits.

``_pick`` is the one place that chooses: the fastest candidate that fits; the plan records
which strategy won (``solver.origin``). The MILP and the simulator evaluate the same cost
model, so a MILP plan's objective is its simulated step. When nothing fits, the GPU-minimising
joint MILP names the smallest ``--gpu-mem`` that fits (or the host/NVMe budget that is short).
``docs/formulation.md`` ("Solving") documents the sequence.

Modules:

- ``config``: ``SolveConfig``, the one frozen configuration of a solve (budgets, K, ranks,
  solver, time limit, gap, stream, optimizer depth), and the cost model derived from it;
- ``search``: ``solve`` (the sequence above) and ``solve_profile`` (its keyword face);
- ``strategies``: the candidates (baselines, one MILP solve, seeds), the clock, ``_pick``;
- ``nofit``: the smallest budget that fits and the exit-3 message;
- ``command``: ``plan solve``'s options, budgets and output (``cli_solve``);
- ``throughput``: ``plan search``'s loop: candidate micro-batch sizes and their K, each solved
  by ``solve`` per order (``orders_to_try``) under a share of the time limit, the cells' figures;
- ``budget``: a GPU budget for experiments (``plan sweep`` is ``planner.cli.sweep``);
- ``milp``: the MILP's rows; ``solvers``: the solver wrappers and heuristics; ``highs``.
"""
from planner.solve.command import (WRITE_S_PER_UNIT, check_nvme_dir, cli_solve, default_solver,
                                   parse_budgets, solve_options, summary_line)
from planner.solve.config import MARGIN_BYTES, STREAM_MODES, SolveConfig, rank_options
from planner.solve.search import SolveOutcome, solve, solve_profile
from planner.solve.strategies import (BASELINE_S_PER_UNIT, BUILD_ROWS_PER_S, Candidate,
                                      _seed_candidates, baselines, milp, stream_all_layers)

__all__ = ["BASELINE_S_PER_UNIT", "BUILD_ROWS_PER_S", "Candidate", "MARGIN_BYTES",
           "STREAM_MODES", "SolveConfig", "SolveOutcome", "WRITE_S_PER_UNIT", "_seed_candidates",
           "baselines",
           "check_nvme_dir", "cli_solve", "default_solver", "milp", "parse_budgets",
           "rank_options", "solve", "solve_options", "solve_profile", "stream_all_layers",
           "summary_line"]
