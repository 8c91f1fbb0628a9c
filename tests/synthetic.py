"""Synthetic profiles: near-uniform transformer-like chains built from a few numbers.

Used by tests and benchmarks of the planner and simulator, which must not depend on torch.
Defaults follow the calibration in the design brief (7 ms forward, 1.27 GB saved per block).
"""
from __future__ import annotations

import random

from planner.formats import PROFILE_SCHEMA, HardwareSpec, Profile, UnitRecord


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


def random_profile(seed: int, hardware: HardwareSpec, n_blocks: int | None = None,
                   name: str = "random") -> Profile:
    """A heterogeneous chain for property tests: blocks of different sizes and speeds, some
    with shared side tensors (a mask made by the embedding), a tied embedding and head half of
    the time, parameters and optimizer state of plausible size against the activations.

    Times are drawn so that a block's transfer takes 0.3x to 6x its forward on ``hardware``'s
    links (offloading sometimes hides, sometimes does not), and backward 1.5x to 3x forward.
    """
    rng = random.Random(seed)
    n = n_blocks if n_blocks is not None else rng.randint(3, 40)
    bw = (hardware.nvme_write_bandwidth if hardware.unified_memory
          else min(hardware.d2h_bandwidth, hardware.h2d_bandwidth)) or 1e9
    scale = rng.choice([1e6, 1e7, 1e8, 1e9])           # bytes of a typical block's activations
    tied = rng.random() < 0.5
    shared = int(scale * rng.uniform(0.01, 0.2)) if rng.random() < 0.4 else 0
    flops_per_s = hardware.flops_per_s("bf16")
    units = []

    def unit(uname, kind, a, x, w, params, f, shared_bytes=0, tied_to=(), tied_grad=0):
        b = f * rng.uniform(1.5, 3.0)
        units.append(UnitRecord(
            name=uname, kind=kind, param_bytes=params, grad_bytes=params,
            optimizer_bytes=6 * params, master_bytes=2 * params, input_bytes=x, output_bytes=x,
            saved_bytes=a + shared_bytes, workspace_bytes=w, fwd_flops=int(f * flops_per_s),
            bwd_flops=int(b * flops_per_s), fwd_s=f, bwd_s=b,
            shared_saved_bytes=shared_bytes, shared_from="embedding" if shared_bytes else None,
            param_count=params // 2, tied_to=tuple(tied_to),
            tied_grad_bytes=tied_grad))

    x = int(scale * rng.uniform(0.02, 0.1))
    unit("embedding", "embedding", x, x, x, int(scale * rng.uniform(0.1, 2)),
         scale / bw * rng.uniform(0.01, 0.1), tied_to=("head",) if tied else ())
    for i in range(n):
        a = int(scale * rng.uniform(0.3, 1.7))
        f = a / bw / rng.uniform(0.3, 6.0)
        unit(f"blocks.{i}", "block", a, int(x * rng.uniform(0.5, 1.5)),
             int(a * rng.uniform(0.05, 0.5)), int(scale * rng.uniform(0.02, 1.0)), f,
             shared_bytes=shared)
    unit("head", "head", int(scale * rng.uniform(0.5, 2)), x, x,
         0 if tied else int(scale * rng.uniform(0.1, 2)), scale / bw * rng.uniform(0.05, 0.5),
         tied_to=("embedding",) if tied else (),
         tied_grad=units[0].grad_bytes if tied else 0)
    return Profile(
        schema=PROFILE_SCHEMA,
        model={"name": f"{name}-{seed}", "config": {"seed": seed, "n_blocks": n}, "batch": 1,
               "seq": 1, "dtype": "bf16", "param_count": sum(u.param_count for u in units),
               "structure_hash": f"random-{seed}", "blocks_path": "blocks",
               "attention": "synthetic", "optimizer": "adamw", "bytes_per_param": 16},
        device="meta", timing="estimated", hardware=hardware.to_dict(), layers=units,
        optimizer_s=2.0 * sum(u.static_bytes for u in units) / float(hardware.memory_bandwidth),
        optimizer_workspace_bytes=0)
