"""The simple policies every optimal plan must beat, as decisions of the same type.

Each returns one ``LayerDecision`` per unit; ``planner.plans.make_plan`` turns them into a plan
of the same format as the MILP's, judged by the same simulator (Checkmate does the same with
its baselines). ``embedding`` and ``head`` are always ``keep`` in this version.
"""
from __future__ import annotations

import math

from planner.errors import UserError
from planner.formats import Activation, HardwareSpec, LayerDecision, Policy, Tier, UnitKind, UnitRecord

BASELINES = (Policy.KEEP_ALL, Policy.RECOMPUTE_ALL, Policy.SQRT, Policy.OFFLOAD_ALL)


def sqrt_stride(n_blocks: int) -> int:
    """Chen et al. 2016 (arXiv:1604.06174, section 4.1): with L blocks, checkpoints every
    ceil(sqrt(L)) blocks give O(sqrt(L)) memory for one extra forward."""
    return max(1, math.ceil(math.sqrt(n_blocks)))


def offload_tier(hw: HardwareSpec) -> Activation:
    """The nearest offload tier: host memory where the spec has one, else NVMe."""
    return Activation.NVME if hw.unified_memory else Activation.CPU


def baseline_layers(policy, units: list[UnitRecord], hw: HardwareSpec,
                    chain_breaks=None, kept=None) -> list[LayerDecision]:
    """Decisions of the baseline ``policy`` (keep-all, recompute-all, sqrt, offload-all).
    ``chain_breaks`` (the profile's ``model.chain_breaks``): blocks whose input is not the
    previous block's output, where sqrt starts a segment (no checkpoint 'none' there).
    ``kept`` (the profile's ``model.not_replayable``): blocks that cannot be recomputed, which
    recompute-all and sqrt keep; sqrt starts a segment after each."""
    try:
        policy = Policy(policy)
    except ValueError:
        raise UserError(f"policy {policy!r} is not a baseline; use one of "
                        f"{', '.join(p.value for p in BASELINES)}") from None
    if policy not in BASELINES:
        raise UserError(f"policy {policy.value!r} is not a baseline; use one of "
                        f"{', '.join(p.value for p in BASELINES)}")
    blocks = [i for i, u in enumerate(units) if u.kind == UnitKind.BLOCK.value]
    stride = sqrt_stride(len(blocks))
    position = {i: b for b, i in enumerate(blocks)}   # not blocks.index: O(U^2) at 10,000 units
    breaks, kept = set(chain_breaks or ()), set(kept or ())
    start = 0                                         # where the current run of segments began
    out = []
    for i, u in enumerate(units):
        if u.kind != UnitKind.BLOCK.value or policy is Policy.KEEP_ALL or \
                (u.name in kept and policy is not Policy.OFFLOAD_ALL):
            if u.name in kept and policy is Policy.SQRT:
                start = position[i] + 1
            out.append(LayerDecision(u.name, Activation.KEEP))
        elif policy is Policy.RECOMPUTE_ALL:
            out.append(LayerDecision(u.name, Activation.RECOMPUTE, Tier.GPU))
        elif policy is Policy.SQRT:
            b = position[i]
            if u.name in breaks:
                start = b
            ck = Tier.GPU if (b - start) % stride == 0 else Tier.NONE
            out.append(LayerDecision(u.name, Activation.RECOMPUTE, ck))
        else:
            out.append(LayerDecision(u.name, offload_tier(hw)))
    return out
