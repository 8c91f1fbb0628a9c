"""FSDP2 shards homed off the device: ``fully_shard`` each block with the offload policy its
plan's homes need (docs/distributed.md, "Shards on host or NVMe").

A per-rank FSDP2 plan says, per unit, where this rank's shard of the weights, gradients and
optimizer state lives between uses (``layers[i].home``, the single-process format). The host
case is FSDP2's own: ``CPUOffloadPolicy`` keeps a group's sharded parameters and gradients in
(pinned) host memory, copies them up before the all-gather and down after the reduce-scatter,
and the user's optimizer steps them on the CPU. It moves a group's three tensor classes
together, so a block's host home is all three on the host with the step on the CPU; any other
mix is refused in one line. On a CPU device host memory is the device: no policy.

NVMe homes for shards (the local shard's bytes in a file between uses) are not executed by
this runtime yet: ``policy_for`` refuses them in one line, naming the fix.

    plan = load_plan("plans/rank.json")
    shard_for_plan(model, plan)                 # the blocks, then the root
    handle = apply_plan(model, plan, optimizer=opt)

A user who wraps by hand gets each block's policy checked by ``apply_plan``
(``check_policies``).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from planner.formats import RESIDENT, Plan, Tier, UnitKind, load_plan

from .binding import bind
from .engines import EngineError

HOST = "host"        # CPUOffloadPolicy
DEVICE = "device"    # no offload policy


def _unified(device_type: str) -> bool:
    return device_type in ("cpu", "meta")


def policy_for(name: str, home, device_type: str, src: str) -> str:
    """``"host"`` (``CPUOffloadPolicy``) or ``"device"`` (none) for a unit's home under FSDP2,
    or one ``EngineError`` line for a home this runtime does not execute under FSDP2."""
    tiers = (home.weights, home.grads, home.optimizer)
    if Tier.NVME in tiers:
        raise EngineError(f"{src}: {name} has home {home.label()}: shards homed on NVMe under "
                          "fsdp2 are not executed by this runtime yet; re-solve with the "
                          "shards on the device or the host (no --nvme homes under "
                          "--engine fsdp2)")
    if home.resident:
        return DEVICE
    if all(t is Tier.CPU for t in tiers) and home.step is Tier.CPU:
        if _unified(device_type):
            raise EngineError(f"{src}: {name} has home {home.label()}, host memory, which on a "
                              f"{device_type} device is the device itself; use a cpu-host plan")
        return HOST
    raise EngineError(f"{src}: {name} has home {home.label()}, but FSDP2 moves a group's "
                      "weights, gradients and optimizer state together (CPUOffloadPolicy): "
                      "re-solve so each block's shard is all on the device or all on the host "
                      "with the step on the CPU")


def _root_policy(plan: Plan, device_type: str, src: str) -> str:
    """The root group holds every unit that is not a block: one policy for all of them."""
    got = {policy_for(u.name, d.home, device_type, src)
           for u, d in zip(plan.units, plan.layers) if u.kind != UnitKind.BLOCK.value}
    if len(got) > 1:
        raise EngineError(f"{src}: the units outside the blocks have different homes, but "
                          "FSDP2's root group holds them all under one offload policy; re-solve "
                          "with one home for them")
    return got.pop() if got else DEVICE


def _policy_obj(kind: str, pin_memory: bool):
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy
    return CPUOffloadPolicy(pin_memory=pin_memory) if kind == HOST else OffloadPolicy()


def _device_type(model: torch.nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def shard_for_plan(model: torch.nn.Module, plan: Plan | str | Path, *, mesh=None,
                   pin_memory: bool = True, **fully_shard_kwargs) -> torch.nn.Module:
    """``fully_shard`` each of the plan's blocks with the offload policy its homes need, then
    the root (the order of docs/distributed.md); returns ``model`` (now an ``FSDPModule``).
    ``mesh`` and further keyword arguments (``mp_policy``, ...) go to every ``fully_shard``
    call; ``reshard_after_forward`` and ``offload_policy`` are the plan's."""
    from torch.distributed.fsdp import fully_shard
    for k in ("offload_policy", "reshard_after_forward"):
        if k in fully_shard_kwargs:
            raise EngineError(f"shard_for_plan sets {k} from the plan; leave it out (or wrap by "
                              "hand and let apply_plan check it)")
    src = str(plan) if not isinstance(plan, Plan) else "the plan"
    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    if plan.engine != "fsdp2":
        raise EngineError(f"{src} is for engine {plan.engine!r}, not fsdp2; solve it with "
                          "'plan solve --world-size N --engine fsdp2'")
    dev = _device_type(model)
    blocks = bind(model, plan, src)
    homes = {u.name: d.home for u, d in zip(plan.units, plan.layers)}
    kinds = [(b, policy_for(name, homes[name], dev, src)) for name, b in blocks]
    root = _root_policy(plan, dev, src)      # every refusal before any module is wrapped
    if mesh is not None:
        fully_shard_kwargs["mesh"] = mesh
    for b, kind in kinds:
        fully_shard(b, offload_policy=_policy_obj(kind, pin_memory), **fully_shard_kwargs)
    fully_shard(model, offload_policy=_policy_obj(root, pin_memory), **fully_shard_kwargs)
    return model


def _actual(m) -> str | None:
    """The FSDP2 group's offload policy as HOST/DEVICE (None: a layout this does not know)."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    try:
        group = m._get_fsdp_state()._fsdp_param_group
    except AttributeError:
        return None
    if group is None:
        return None
    pol = getattr(group, "offload_policy", None)
    if pol is None:
        return None
    return HOST if isinstance(pol, CPUOffloadPolicy) else DEVICE


def check_policies(plan: Plan, root: torch.nn.Module, blocks, src: str) -> None:
    """Each block's FSDP2 offload policy against its plan's homes (a model wrapped by hand)."""
    dev = _device_type(root)
    homes = {u.name: d.home for u, d in zip(plan.units, plan.layers)}
    what = {HOST: "CPUOffloadPolicy", DEVICE: "no offload policy"}
    for name, b in [("the root", root)] + list(blocks):
        want = _root_policy(plan, dev, src) if b is root else policy_for(name, homes[name], dev,
                                                                         src)
        got = _actual(b)
        if got is not None and got != want:
            where = "the root" if b is root else f"block {name}"
            raise EngineError(f"{src}: {where} is fully_shard-ed with {what[got]} but the plan "
                              f"homes its shard on the {'host' if want == HOST else 'device'}; "
                              f"wrap it with {what[want]} (runtime.shard_for_plan does)")


def engine_view(plan: Plan) -> Plan:
    """The plan as this runtime executes it under FSDP2: host homes are the engine's
    (CPUOffloadPolicy), so the runtime streams nothing itself."""
    layers = [d if d.home.resident else dataclasses.replace(d, home=RESIDENT)
              for d in plan.layers]
    return dataclasses.replace(plan, layers=layers)
