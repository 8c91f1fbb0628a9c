"""Synthetic profiles: near-uniform transformer-like chains built from a few numbers.

Used by tests and benchmarks of the planner and simulator, which must not depend on torch.
Defaults follow the calibration in the design brief (7 ms forward, 1.27 GB saved per block).
"""
from __future__ import annotations

import random

from .formats import PROFILE_SCHEMA, HardwareSpec, Profile, UnitRecord


def uniform_profile(
    n_blocks: int,
    hardware: HardwareSpec,
    *,
    fwd_s: float = 7e-3,
    saved_bytes: int = 1_270_000_000,
    input_bytes: int = 50_000_000,
    param_bytes: int = 200_000_000,
    workspace_bytes: int = 200_000_000,
    head_saved_bytes: int = 2_000_000_000,
    jitter: float = 0.0,
    seed: int = 0,
    name: str = "synthetic",
) -> Profile:
    """A chain: embedding, ``n_blocks`` blocks, head. Backward takes 2x forward (FLOPs too).

    ``jitter`` perturbs each block's time and bytes by up to that fraction (near-uniform
    blocks break the MILP's symmetry the way real profiles do).
    """
    rng = random.Random(seed)

    def j(x):
        return x * (1.0 + jitter * (2 * rng.random() - 1)) if jitter else x

    flops_per_s = hardware.flops_per_s("bf16")
    units = []

    def unit(name, kind, f, saved, params):
        f = j(f)
        saved = int(j(saved))
        units.append(UnitRecord(
            name=name, kind=kind, param_bytes=params, grad_bytes=params,
            optimizer_bytes=6 * params, master_bytes=2 * params, input_bytes=input_bytes, output_bytes=input_bytes,
            saved_bytes=saved, workspace_bytes=workspace_bytes,
            fwd_flops=int(f * flops_per_s), bwd_flops=int(2 * f * flops_per_s),
            fwd_s=f, bwd_s=2 * f, param_count=params // 2))

    unit("embedding", "embedding", fwd_s * 0.05, input_bytes, param_bytes)
    for i in range(n_blocks):
        unit(f"blocks.{i}", "block", fwd_s, saved_bytes, param_bytes)
    unit("head", "head", fwd_s * 1.5, head_saved_bytes, param_bytes)
    return Profile(
        schema=PROFILE_SCHEMA,
        model={"name": name, "config": {"n_blocks": n_blocks}, "batch": 1, "seq": 1,
               "dtype": "bf16", "param_count": sum(u.param_count for u in units),
               "structure_hash": f"synthetic-{n_blocks}", "blocks_path": "blocks",
               "attention": "synthetic", "optimizer": "adamw", "bytes_per_param": 16},
        device="meta", timing="estimated", hardware=hardware.to_dict(), layers=units,
        optimizer_s=0.0, optimizer_workspace_bytes=0)
