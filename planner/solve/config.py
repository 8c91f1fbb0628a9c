"""The solve configuration: every input of ``plan solve`` other than the profile, checked once
and frozen (``SolveConfig``), and the cost model derived from it.

It is built once, from the command line (``planner.solve.command.solve_config``) or from the
Python API (``planner.solve.search.solve_profile``'s keywords, ``SolveConfig.build``), and passed
down to every strategy. Budgets stay as given (what the plan records); the spec's reserve and
the MILP's margin are taken off in one place, ``planner.costmodel.device_budget``, when a cost
model is derived (``cost_model``; the MILP's variant is ``milp_model``).
"""
from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass

from planner.costmodel import CostModel
from planner.errors import UserError
from planner.formats import CLIPS, Budgets, HardwareSpec, Policy, Profile
from planner.plans import cost_model

STREAM_MODES = ("auto", "on", "off")
OVERLAP_MODES = ("auto", "on", "off", "paced")
ORDER_MODES = ("batch-major", "layer-major", "auto")
# The MILP's rows bound memory in GB with the solvers' feasibility tolerance (1e-6 on the row,
# i.e. a kilobyte) and bytes are rounded to whole numbers when written: solve against the
# budget less this margin, so that every written plan fits to the byte.
MARGIN_BYTES = 4096


def warn(msg: str) -> None:
    print(f"plan: warning: {msg}", file=sys.stderr)


@dataclass(frozen=True)
class SolveConfig:
    """What ``plan solve`` decides by, besides the profile. ``build`` checks and completes it."""

    hw: HardwareSpec
    """The spec the plan is for (``--hardware``, else the profile's)."""
    budgets: Budgets
    """The budgets as given, in bytes: ``--gpu-mem`` per rank, ``--cpu-mem`` and ``--nvme-mem``
    per node. The plan records these; the cost model takes the spec's reserve and the margin
    off the device's (``planner.costmodel.device_budget``) and shares the node's among its
    ranks."""
    policy: str = Policy.OPTIMAL.value
    """``optimal``, ``remat-only`` (nothing moved off the device) or a baseline's name."""
    micro_batches: int = 1
    """K: forward/backward passes per optimizer step (``--micro-batches``)."""
    world_size: int = 1
    """Ranks training together (``--world-size``); the profile and the plan are one rank's."""
    ranks_per_node: int = 1
    """Ranks on each node, sharing its host and NVMe budgets (``--ranks-per-node``)."""
    engine: str = "none"
    """How the ranks share the model: ``fsdp2``, ``ddp`` or ``none`` (one process)."""
    solver: str = "highs"
    """The MILP solver: ``highs`` or ``cbc``."""
    time_limit: float | None = 60.0
    """Seconds for the whole solve (None: no limit)."""
    gap: float = 0.005
    """Relative optimality gap at which a MILP stops."""
    stream: str = "auto"
    """Homes off the device: ``auto`` (when they can pay), ``on`` (always searched), ``off``."""
    optimizer_depth: int = 3
    """Units in flight in the optimizer phase of the main cost model (3: pipelined); where homes
    off the device matter the solve also tries its depth-1 variant (the least memory)."""
    nvme_dir: str | None = None
    """Directory for NVMe offload files, recorded in the plan."""
    progress: bool = False
    """Show the solver's progress on stderr."""
    margin_bytes: int = MARGIN_BYTES
    """Device bytes the MILP keeps free below the budget (its rows' tolerance, ``MARGIN_BYTES``)."""
    clip: str = "global"
    """``global``: the loop clips by the global gradient norm (HF Trainer's default), so no
    update starts before the whole backward; ``none``: it does not (``--clip``)."""
    optimizer_overlap: str = "auto"
    """``auto``: units' optimizer work may run beside the backward where it pays (the plan says
    ``overlapped`` only if some does); ``on``: the fastest plan's decisions written with the
    overlapped schedule even where it is no faster (``search._overlapped``); ``off``: after the
    backward (``--optimizer-overlap``)."""
    shard_homes: str = "runnable"
    """Under ``--engine fsdp2``: ``runnable`` (homes the runtime executes: a block's whole shard
    on the host, stepped on the CPU) or ``all`` (also NVMe and split homes: priced, not yet
    executed) (``--shard-homes``)."""
    micro_batch_order: str = "batch-major"
    """``batch-major`` (K whole passes), ``layer-major`` (every micro-batch through a unit before
    the next) or ``auto`` (both solved, the faster kept) (``--micro-batch-order``)."""

    @classmethod
    def build(cls, hw: HardwareSpec, budgets: Budgets, policy="optimal", *,
              solver: str = "highs", time_limit: float | None = 60.0, gap: float = 0.005,
              nvme_dir: str | None = None, progress: bool = False, micro_batches: int = 1,
              stream: str = "auto", world_size: int = 1, ranks_per_node: int | None = None,
              engine: str | None = None, clip: str = "global",
              optimizer_overlap: str = "auto",
              micro_batch_order: str = "batch-major",
              shard_homes: str = "runnable") -> "SolveConfig":
        """The configuration of these options, checked, with the ranks' defaults filled in
        (``rank_options``). One UserError line per bad value."""
        policy = getattr(policy, "value", policy)
        if stream not in STREAM_MODES:
            raise UserError(f"--stream {stream!r}: use {', '.join(STREAM_MODES)}")
        if clip not in CLIPS:
            raise UserError(f"--clip {clip!r}: use {', '.join(CLIPS)}")
        if optimizer_overlap not in OVERLAP_MODES:
            raise UserError(f"--optimizer-overlap {optimizer_overlap!r}: use "
                            f"{', '.join(OVERLAP_MODES)}")
        if micro_batch_order not in ORDER_MODES:
            raise UserError(f"--micro-batch-order {micro_batch_order!r}: use "
                            f"{', '.join(ORDER_MODES)}")
        if shard_homes not in ("runnable", "all"):
            raise UserError(f"--shard-homes {shard_homes!r}: use runnable, all")
        if int(micro_batches) == 1:
            micro_batch_order = "batch-major"      # one micro-batch: the orders are one
        if optimizer_overlap == "paced":
            if clip != "none":
                raise UserError("--optimizer-overlap paced steps each unit during the backward, "
                                "before a clip by the global norm could see every gradient; "
                                "add --clip none (and clip nothing in the loop)")
            if int(micro_batches) > 1 and micro_batch_order == "batch-major":
                raise UserError(f"--optimizer-overlap paced with --micro-batches "
                                f"{int(micro_batches)} needs each gradient complete after its "
                                "unit's one backward; add --micro-batch-order layer-major")
            micro_batch_order = "layer-major" if int(micro_batches) > 1 else micro_batch_order
        ranks = rank_options(world_size, ranks_per_node, engine)
        if ranks["engine"] != "none" and micro_batch_order != "batch-major":
            raise UserError(f"--micro-batch-order {micro_batch_order}: only batch-major is "
                            f"planned with --engine {ranks['engine']} yet; leave it out")
        if ranks["engine"] != "none" and optimizer_overlap in ("on", "paced"):
            raise UserError(f"--optimizer-overlap {optimizer_overlap}: the optimizer beside the "
                            f"backward is not run under --engine {ranks['engine']} yet; leave "
                            "it out")
        if ranks["engine"] == "ddp" and stream == "on":
            raise UserError("--stream on: homes off the device are not planned under --engine "
                            "ddp (it replicates every tensor); use --engine fsdp2 or --stream "
                            "auto/off")
        return cls(hw=hw, budgets=budgets, policy=policy, micro_batches=int(micro_batches),
                   solver=solver, time_limit=time_limit, gap=gap, stream=stream,
                   nvme_dir=nvme_dir, progress=progress, clip=clip,
                   optimizer_overlap=optimizer_overlap, micro_batch_order=micro_batch_order,
                   shard_homes=shard_homes, **ranks)

    @property
    def allow_offload(self) -> bool:
        """Activations may leave the device (every policy but remat-only)."""
        return self.policy != Policy.REMAT_ONLY.value

    def cost_model(self, profile: Profile) -> CostModel:
        """The cost model of ``profile`` under this configuration: depth ``optimizer_depth``,
        homes off the device unless ``--stream off``. Its variants (depth 1, activations only,
        the MILP's margin) are ``dataclasses.replace`` of it."""
        return cost_model(profile, self.hw, self.budgets, self.micro_batches,
                          allow_streaming=self.stream != "off", allow_offload=self.allow_offload,
                          optimizer_depth=self.optimizer_depth, world_size=self.world_size,
                          ranks_per_node=self.ranks_per_node, engine=self.engine,
                          shard_homes=self.shard_homes,
                          clip=self.clip, optimizer_overlap="after-backward"
                          if self.optimizer_overlap == "off" or self.engine != "none"
                          else "paced" if self.optimizer_overlap == "paced" else "overlapped",
                          micro_batch_order="layer-major"
                          if self.micro_batch_order == "layer-major" else "batch-major")

    def milp_model(self, cm: CostModel) -> CostModel:
        """``cm`` with the MILP's margin kept free below the device budget."""
        return dataclasses.replace(cm, margin_bytes=self.margin_bytes)

    def gpu_budget_for(self, device_bytes: int) -> int:
        """The ``--gpu-mem`` at which a plan peaking at ``device_bytes`` (the MILP's figure)
        is found: twice the margin (at the named budget the time-minimising solve has that
        plan's room and a little more) and the spec's reserve on top; the inverse of
        ``device_budget``."""
        return device_bytes + 2 * self.margin_bytes + int(self.hw.reserved_bytes)


def rank_options(world_size: int = 1, ranks_per_node: int | None = None,
                 engine: str | None = None) -> dict:
    """``world_size``, ``ranks_per_node``, ``engine`` checked, with their defaults: engine
    fsdp2 for N > 1 ranks (none for one), min(N, 8) ranks per node (an HGX/DGX node's
    eight GPUs). One UserError line (exit 2) per bad combination."""
    N = world_size
    if not isinstance(N, int) or not 1 <= N <= 65536:
        raise UserError(f"--world-size {N}: give the number of ranks, 1 to 65536")
    if engine is None:
        engine = "fsdp2" if N > 1 else "none"
    if engine not in ("none", "fsdp2", "ddp"):
        raise UserError(f"--engine {engine!r}: use fsdp2, ddp or none")
    if engine == "none" and N > 1:
        raise UserError(f"--world-size {N} with --engine none: several ranks need an engine "
                        "that shares the work; use --engine fsdp2 or ddp")
    R = min(N, 8) if ranks_per_node is None else ranks_per_node
    if not isinstance(R, int) or not 1 <= R <= N or N % R:
        raise UserError(f"--ranks-per-node {R}: give a divisor of --world-size {N} "
                        "(ranks on each node)")
    return {"world_size": N, "ranks_per_node": R, "engine": engine}
