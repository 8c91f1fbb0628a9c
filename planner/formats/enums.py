"""The names every file shares: the schema identifiers and the enumerations of unit kinds,
activations, memory tiers, policies and engines.
"""
from __future__ import annotations

import enum

PROFILE_SCHEMA = "tierplan.profile/1"
PLAN_SCHEMA = "tierplan.plan/3"
PLAN_SCHEMA_V2 = "tierplan.plan/2"   # still loads: optimizer after the backward, batch-major
PLAN_SCHEMA_V1 = "tierplan.plan/1"   # still loads: every tensor class at home on the GPU
HARDWARE_SCHEMA = "tierplan.hardware/1"
REPORT_SCHEMA = "tierplan.report/1"


class UnitKind(str, enum.Enum):
    EMBEDDING = "embedding"
    BLOCK = "block"
    HEAD = "head"


class Activation(str, enum.Enum):
    """What happens to a unit's saved activations between its forward and its backward."""

    KEEP = "keep"            # stay on the GPU
    RECOMPUTE = "recompute"  # dropped after forward, recomputed at backward from a checkpoint
    CPU = "cpu"              # offloaded to pinned host memory, prefetched back
    NVME = "nvme"            # offloaded through pinned staging to files on NVMe, read back


class Tier(str, enum.Enum):
    """A memory tier: where a checkpoint, weights, gradients or optimizer state live, and
    (``gpu``/``cpu`` only) where an optimizer step runs."""

    GPU = "gpu"
    CPU = "cpu"
    NVME = "nvme"
    NONE = "none"  # itself recomputed from the nearest earlier checkpoint (segment recompute)


class Policy(str, enum.Enum):
    OPTIMAL = "optimal"
    KEEP_ALL = "keep-all"
    RECOMPUTE_ALL = "recompute-all"
    SQRT = "sqrt"
    OFFLOAD_ALL = "offload-all"
    REMAT_ONLY = "remat-only"  # the MILP with offloading disabled (a benchmark peer)


ENGINES = ("none", "fsdp2", "ddp")   # how the ranks share the model
# The schedule families a plan names (``tierplan.plan/3``; docs/file-formats.md, Schedule):
# when a unit's optimizer step may run, whether the loop clips by the global gradient norm,
# and the order micro-batches take through the units.
OPTIMIZER_OVERLAPS = ("after-backward", "overlapped", "paced")
CLIPS = ("global", "none")
MICRO_BATCH_ORDERS = ("batch-major", "layer-major")


def paced_possible(clip: str, engine: str, micro_batches: int, order: str) -> bool:
    """Whether ``optimizer_overlap: paced`` can run: each unit's step right after its one
    backward needs the gradient complete there (one pass per step: K = 1 or layer-major), no
    clip by the global norm, and the plan's own path stepping it (no engine)."""
    return clip == "none" and engine == "none" and (micro_batches == 1 or order == "layer-major")
