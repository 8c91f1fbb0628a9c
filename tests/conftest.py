"""Shared test helpers.

``plan_for(model, layers_or_policy, batch, seq, ...)`` builds a real ``Plan`` (schedule and
prediction from ``planner.plans.make_plan``) for a torch model without profiling it: the units
are the model's real blocks (names, structure hash) with plausible byte and time figures, so
tests of the runtime's mechanics do not depend on the profiler.
"""
from __future__ import annotations

import pytest
import torch


def _units_for(model, batch, seq, blocks_path=None, inputs=None):
    from planner.blocks import detect_blocks, find_blocks, param_table, structure_hash
    from planner.formats import UnitRecord

    if inputs is None:
        path, blocks = find_blocks(model, blocks_path)
    else:
        def run():
            with torch.random.fork_rng(devices=[]):
                return model(**inputs) if isinstance(inputs, dict) else model(*inputs)
        found = detect_blocks(model, run, blocks_path)
        path, blocks = found.paths, found.pairs()
    p0 = next(model.parameters())
    elt = p0.element_size()
    d = p0.shape[-1] if p0.dim() > 1 else 64
    x = batch * seq * d * elt

    def unit(name, kind, params):
        pb = sum(p.numel() * p.element_size() for p in params)
        return UnitRecord(name=name, kind=kind, param_bytes=pb, grad_bytes=pb,
                          optimizer_bytes=2 * pb, input_bytes=x, output_bytes=x,
                          param_count=sum(p.numel() for p in params),
                          saved_bytes=16 * x, workspace_bytes=4 * x, fwd_flops=10**6,
                          bwd_flops=2 * 10**6, fwd_s=1e-3, bwd_s=2e-3)

    owner = {}
    for n, b in blocks:
        for p in b.parameters():
            owner.setdefault(id(p), n)
    rest = [p for p in dict.fromkeys(model.parameters()) if id(p) not in owner]
    for i, p in enumerate(rest):
        owner[id(p)] = "embedding" if i == 0 else "head"
    units = [unit("embedding", "embedding", rest[:1])]
    units += [unit(n, "block", list(b.parameters())) for n, b in blocks]
    units += [unit("head", "head", rest[1:])]
    fields = {"structure_hash": structure_hash(blocks), "blocks_path": path,
              "blocks": [n for n, _ in blocks], "params": param_table(model, owner)}
    return fields, units


def plan_for(model, layers, batch, seq, *, hardware="cpu-host", nvme_dir=None,
             blocks_path=None, name="test-model", inputs=None, homes=None, micro_batches=1):
    """A Plan for ``model``: ``layers`` is a policy name (keep-all, recompute-all, sqrt,
    offload-all) or a list of ``(activation, checkpoint)`` per block ("keep", None),
    ("recompute", "gpu"|"nvme"|"none"), ("nvme", None). With ``inputs`` (a dict or tuple the
    model is called with) the blocks are found from a traced forward and every input's shape
    is recorded; without, the blocks are found by the container rule and the input guard
    checks ``batch`` x ``seq``. ``homes`` maps a unit name (or "blocks" for every block) to a
    ``Home`` (weights, grads, optimizer, step)."""
    from planner.costmodel.baselines import baseline_layers
    from planner.blocks import identity_hash, input_table
    from planner.formats import Activation, Budgets, LayerDecision, Profile, Tier
    from planner.hardware import load_hardware
    from planner.plans import make_plan

    hw = load_hardware(hardware)
    fields, units = _units_for(model, batch, seq, blocks_path, inputs)
    section = {"name": name, "batch": batch, "seq": seq, "dtype": "fp32", **fields}
    if inputs is not None:
        args, kwargs = ((), inputs) if isinstance(inputs, dict) else (tuple(inputs), {})
        section["inputs"] = input_table(model.forward, args, kwargs)
    section["identity"] = identity_hash(section)
    prof = Profile(model=section, device="meta", timing="estimated", hardware=hw.to_dict(),
                   layers=units)
    if isinstance(layers, str):
        decisions = baseline_layers(layers, units, hw)
    else:
        assert len(layers) == len(units) - 2
        decisions = [LayerDecision("embedding", Activation.KEEP)]
        for u, (act, ck) in zip(units[1:-1], layers):
            decisions.append(LayerDecision(u.name, Activation(act),
                                           Tier(ck) if ck is not None else None))
        decisions.append(LayerDecision("head", Activation.KEEP))
    if homes:
        import dataclasses
        decisions = [dataclasses.replace(d, home=homes.get(d.name, homes.get("blocks", d.home)
                                                           if u.kind == "block" else d.home))
                     for d, u in zip(decisions, units)]
    # a discrete GPU's plan may use the host tier: budget it at the spec's host memory (1 TiB
    # where the spec names none); a unified-memory spec has no host tier
    host = 0 if hw.unified_memory else (hw.host_memory_bytes or 1 << 40)
    budgets = Budgets(hw.memory_bytes, host, hw.nvme_bytes)
    return make_plan(prof, None, hw, budgets, layers if isinstance(layers, str) else "optimal",
                     decisions, nvme_dir=str(nvme_dir) if nvme_dir else None,
                     micro_batches=micro_batches)


@pytest.fixture
def make_plan_for():
    return plan_for


# The fast subset (``pytest -m "not slow"``) is the planner's own tests: formats, schedule,
# simulator, MILP, solve, inspect, diff. Whole modules that train models, profile real ones,
# start processes or drive the CLI under faults are slow as a kind; single slow tests elsewhere
# carry ``@pytest.mark.slow`` themselves.
SLOW_MODULES = {"test_zoo", "test_zoo_adversarial", "test_fuzz", "test_faults",
                "test_distributed", "test_streaming", "test_streaming_idioms", "test_trainer",
                "test_packaging", "test_determinism", "test_calibrate",
                "test_readme", "test_runtime", "test_binding", "test_profiler", "test_cli_errors",
                "test_timing", "test_models", "test_blocks", "test_measure"}


@pytest.fixture
def one_rank_group():
    """A gloo process group of one rank (this process), destroyed after the test."""
    import torch.distributed as dist

    import dist_harness
    dist.init_process_group("gloo", rank=0, world_size=1,
                            init_method=f"tcp://127.0.0.1:{dist_harness.free_port()}")
    yield
    dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
