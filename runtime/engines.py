"""Sharded engines the user already runs: PyTorch FSDP2 (``fully_shard``) and DDP.

tierplan never reimplements a collective. The engine gathers, reduces and reshards on its own
hooks; the plan only counts what the engine holds and moves (the planner's cost model, its ranks
section) and the runtime replays the plan's activation decisions inside it, the same on every
rank. This module finds which engine wraps a model, checks that it is wrapped as the plan
assumes and in the documented order (docs/distributed.md), and knows which tensors are the
engine's (gathered weights are not activations to offload).

The order: wrap first, then apply the plan.

    for block in model.blocks: fully_shard(block)      # or: model = DDP(model)
    fully_shard(model)
    handle = apply_plan(model, plan, ...)

Every refusal is one ``UnsupportedModelError`` line (a ``UserError``: exit code 2 in the CLI,
no traceback in the example).
"""
from __future__ import annotations

import torch

from planner.formats import UserError

ORDER = ("wrap first, then apply the plan: fully_shard each block, then the root (or wrap the "
         "model in DistributedDataParallel), then apply_plan (docs/distributed.md)")


class UnsupportedModelError(UserError, ValueError):
    """A combination the runtime does not support yet (torch.compile, FSDP1, DataParallel, own
    checkpointing), or a sharded engine wrapped in an order or a way the plan does not assume."""


class EngineError(UnsupportedModelError):
    """The model is not wrapped the way the plan assumes (one line: what, and the fix)."""


def _fsdp_module_cls():
    try:
        from torch.distributed.fsdp import FSDPModule
        return FSDPModule
    except ImportError:        # a torch without FSDP2
        return None


def _ddp_cls():
    try:
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel
    except ImportError:
        return None


def is_fsdp2(m: torch.nn.Module) -> bool:
    cls = _fsdp_module_cls()
    return cls is not None and isinstance(m, cls)


def is_ddp(m: torch.nn.Module) -> bool:
    cls = _ddp_cls()
    return cls is not None and isinstance(m, cls)


def detect(model: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """``(engine, module the plan binds to)``: ``("ddp", model.module)`` for a model wrapped in
    DDP, ``("fsdp2", model)`` for a model whose root is ``fully_shard``-ed, else
    ``("none", model)``. FSDP1, DataParallel and an engine wrapped inside the model are
    refused."""
    for name, m in model.named_modules():
        names = {c.__name__ for c in type(m).__mro__}
        where = f" ({name})" if name else ""
        if "FullyShardedDataParallel" in names:
            raise EngineError(f"the model{where} is wrapped in FSDP1 (FullyShardedDataParallel); "
                              "tierplan composes with FSDP2: use torch.distributed.fsdp."
                              "fully_shard on each block, then the root")
        if "DataParallel" in names and "DistributedDataParallel" not in names:
            raise EngineError(f"the model{where} is wrapped in DataParallel; use "
                              "DistributedDataParallel under torchrun")
        if name and is_ddp(m):
            raise EngineError(f"module{where} is wrapped in DDP inside the model; wrap the whole "
                              "model in DistributedDataParallel and give apply_plan the wrapper")
    if is_ddp(model):
        return "ddp", model.module
    if is_fsdp2(model):
        return "fsdp2", model
    if any(is_fsdp2(m) for m in model.modules()):
        raise EngineError("some modules are fully_shard-ed but the root is not; call "
                          "fully_shard(model) after the blocks, then apply_plan")
    return "none", model


def check(plan, engine: str, inner: torch.nn.Module, blocks, src: str) -> None:
    """The model's engine, the process group and the FSDP2 grouping against the plan."""
    want = plan.engine
    if engine != want:
        if want == "none":
            raise EngineError(f"{src} is a one-process plan but the model is wrapped in "
                              f"{engine}; solve one rank's plan with 'plan solve --world-size N "
                              f"--engine {engine}'")
        if engine == "none":
            raise EngineError(f"{src} is for {want} across {plan.world_size} rank(s) but the model "
                              f"is not wrapped in {want}; {ORDER}")
        raise EngineError(f"{src} is for {want} but the model is wrapped in {engine}; solve "
                          f"with --engine {engine} or wrap the model in {want}")
    if want == "none":
        return
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise EngineError(f"{src} is for {plan.world_size} rank(s) of {want} but no process group "
                          "is initialised; run under torchrun and call "
                          "torch.distributed.init_process_group() before wrapping")
    n = dist.get_world_size()
    if n != plan.world_size:
        raise EngineError(f"{src} is one rank's plan of {plan.world_size} but this job has "
                          f"{n} rank(s); solve with 'plan solve --world-size {n}'")
    if want == "fsdp2":
        _check_fsdp2(inner, blocks, src)


def _check_fsdp2(root, blocks, src: str) -> None:
    """Each block its own FSDP2 group and the root the only other one, each block resharded
    after its forward: what the plan's memory and collectives count."""
    block_ids = {id(b) for _, b in blocks}
    for name, b in blocks:
        if not is_fsdp2(b):
            raise EngineError(f"{src}: block {name} is not fully_shard-ed; the plan counts one "
                              f"FSDP2 group per block: call fully_shard on each block, then on "
                              "the root, before apply_plan")
        if not _reshards_after_forward(b):
            raise EngineError(f"{src}: block {name} keeps its gathered weights after its forward "
                              "(reshard_after_forward=False); the plan counts them gathered only "
                              "around its forward and backward: use the default (True)")
    for name, m in root.named_modules():
        if name and id(m) not in block_ids and is_fsdp2(m):
            raise EngineError(f"{src}: module {name} is an FSDP2 group of its own; the plan "
                              "assumes one group per block and the root holding the rest: "
                              "fully_shard only the blocks and the root")


def _reshards_after_forward(m) -> bool:
    """FSDP2 keeps the setting on the module's parameter group (a private field: unknown
    layouts count as resharding, the default)."""
    try:
        group = m._get_fsdp_state()._fsdp_param_group
    except AttributeError:
        return True
    if group is None:
        return True
    return getattr(group, "post_forward_mesh_info", True) is not None


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (an FSDP2 parameter between uses), else the tensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def wrapped_after(runner_model, cls_at_apply) -> str | None:
    """Why the model's wrapping changed since ``apply_plan`` (an engine applied after the
    plan: the wrong order), or None."""
    if type(runner_model) is not cls_at_apply and is_fsdp2(runner_model):
        return "fully_shard was called after apply_plan"
    ddp = _ddp_cls()
    if ddp is not None and getattr(ddp, "_active_ddp_module", None) is not None:
        return "the model was wrapped in DistributedDataParallel after apply_plan"
    return None


def gather_objects(obj):
    """Every rank's ``obj`` on rank 0 (a list in rank order), None on the others; ``[obj]``
    without a process group."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
