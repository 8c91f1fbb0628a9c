"""Two ranks on CPU with gloo, for the distributed tests and ``bench/distributed.py``.

The parent builds the models' profiles and every plan (it has pulp; the ranks only read plan
files), then ``run(engine, cases, ...)`` starts ``world`` processes with
``torch.multiprocessing.spawn``; each trains every case for two AdamW steps (dropout on, its
own data and dropout seed per rank) with the engine alone and under each plan, and writes, per
case, the largest difference of its gradients and weights from the engine alone, whether its
offload directory was left empty, and its report. The parent reads those files back.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
B, S, LAYERS = 2, 32, 3
CONFIG = None        # the model "config": a built-in GPT config of a bench's own size
DEVICE = "cpu"       # cuda:<rank> in the CUDA tests (NCCL)


# ----------------------------------------------------------------------------- models

def build(name: str, rank: int = 0):
    """``(model, batches)``: the same weights on every rank, each rank its own two batches,
    on ``DEVICE``."""
    model, batches = _build_cpu(name, rank)
    if DEVICE != "cpu":
        model = model.to(DEVICE)
        batches = [{k: v.to(DEVICE) for k, v in b.items()} for b in batches]
    return model, batches


def _build_cpu(name: str, rank: int):
    if name == "hf-llama":
        sys.path.insert(0, str(REPO))
        from examples import hf_models
        model, inputs = hf_models.llama(B, S, n_layer=LAYERS)
        model.config.use_cache = False
        g = torch.Generator().manual_seed(100 + rank)
        batches = []
        for _ in range(2):
            ids = torch.randint(0, hf_models.VOCAB, (B, S), generator=g)
            batches.append({"input_ids": ids, "labels": ids.clone()})
        return model, batches
    from planner.models import build_model, load_config, make_inputs
    cfg = dict(CONFIG) if name == "config" else dict(load_config(name), n_layers=LAYERS,
                                                      dtype="fp32")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = build_model(cfg, dtype="fp32")
    model.train()
    return model, [make_inputs(cfg, B, S, seed=100 + 10 * rank + k) for k in range(2)]


def blocks_of(model) -> list:
    """The blocks the plan names, as modules (for ``fully_shard``)."""
    for path in ("blocks", "model.layers", "transformer.h"):
        try:
            return list(model.get_submodule(path))
        except AttributeError:
            continue
    raise AssertionError("no blocks found")


def wrap(model, engine: str):
    """The usual way: ``fully_shard`` on each block, then the root; or DDP."""
    if engine == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for b in blocks_of(model):
            fully_shard(b)
        fully_shard(model)
        return model
    if engine == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        return DistributedDataParallel(model)
    return model


def profile(name: str, hardware: str = "cpu-host"):
    """The model's profile for ``hardware`` (bytes measured on CPU, times estimated)."""
    from planner.hardware import load_hardware
    from planner.profile import profile_module
    model, batches = _build_cpu(name, 0)
    return profile_module(model, batches[0], name=name, hardware=load_hardware(hardware),
                          timing="estimate", batch=B, seq=S)


# ----------------------------------------------------------------------------- one rank

POLICIES = ("keep-all", "recompute-all", "offload-all", "optimal")


def plans(name: str, engine: str, folder, world: int = 2) -> list[tuple]:
    """``(model, policy, plan file, nvme dir)`` for every policy of ``POLICIES``: the baselines
    (offload-all sends every block to NVMe, this host's offload tier) and the optimal plan at a
    tight per-rank budget: 40% of the way from the lowest baseline peak to keep-all's."""
    from planner.costmodel.baselines import baseline_layers
    from planner.formats import Budgets
    from planner.hardware import load_hardware
    from planner.plans import cost_model, make_plan, save_plan
    from planner.solve import solve_profile
    hw = load_hardware("cpu-host")
    folder = Path(folder)
    prof = profile(name)
    ranks = {"world_size": world, "ranks_per_node": world, "engine": engine}
    out = []
    loose = Budgets(hw.memory_bytes, 0, 1 << 30)
    cm = cost_model(prof, hw, loose, **ranks)
    peaks = {}
    for pol in POLICIES:
        nvme = str(folder / f"nvme-{name}-{pol}")
        if pol == "optimal":
            low = min(peaks.values())
            # a budget holds the spec's reserve beside the plan's peak
            tight = Budgets(int(low + 0.4 * (peaks["keep-all"] - low)) + hw.reserved_bytes, 0,
                            1 << 30)
            plan = solve_profile(prof, None, hw, tight, "optimal", time_limit=60,
                                 nvme_dir=nvme, **ranks).plan
        else:
            plan = make_plan(prof, None, hw, loose, pol, baseline_layers(pol, prof.layers, hw),
                             nvme_dir=nvme, cm=cm)
            peaks[pol] = plan.predicted.peak_gpu_bytes
        path = folder / f"{name}-{engine}-{pol}.json"
        save_plan(plan, path)
        out.append((name, pol, str(path), nvme))
    return out


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


class _GatherCount:
    """Counts FSDP2's all-gathers (its ``foreach_all_gather``, a private name: tests only)."""

    def __init__(self):
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg
        self.pg, self.real, self.n = pg, pg.foreach_all_gather, 0

    def __enter__(self):
        def counting(*a, **k):
            self.n += 1
            return self.real(*a, **k)
        self.pg.foreach_all_gather = counting
        return self

    def __exit__(self, *exc):
        self.pg.foreach_all_gather = self.real


def train(name: str, engine: str, plan, nvme_dir, rank: int, steps: int = 2):
    """Gradients (per step) and final weights of this rank's shard / replica, the report and
    the number of FSDP2 all-gathers."""
    with _GatherCount() as count:
        out = _train(name, engine, plan, nvme_dir, rank, steps)
    return (*out, count.n)


def _train(name: str, engine: str, plan, nvme_dir, rank: int, steps: int):
    from runtime import apply_plan
    model, batches = build(name, rank)
    wrapped = wrap(model, engine)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    handle = apply_plan(wrapped, plan, optimizer=opt, nvme_dir=nvme_dir) if plan else None
    torch.manual_seed(1234 + rank)
    grads = []
    for k in range(steps):
        loss = wrapped(**batches[k % 2]).loss
        loss.backward()
        grads.append([_local(p.grad).clone() for p in wrapped.parameters()])
        opt.step()
        opt.zero_grad()
    report = None
    if handle is not None:
        report = handle.report().to_dict()
        gathered = handle.gather_reports()
        if rank == 0:
            report["gathered_ranks"] = [r.rank for r in gathered]
        handle.remove()
    # after remove(): a shard homed on NVMe (runtime/sharded.py) has no storage between uses
    weights = [_local(p).detach().clone() for p in wrapped.parameters()]
    return grads, weights, report


def _maxdiff(a, b) -> float:
    return max(((x - y).abs().max().item() for x, y in zip(a, b)), default=0.0)


def worker(rank: int, world: int, port: int, engine: str, cases: list, out_dir: str,
           steps: int = 2, compare: bool = True, settings: dict | None = None):
    """One rank: for each model, the engine alone (unless not ``compare``), then every plan of
    ``cases``; ``settings`` sets this module's B, S and CONFIG in the child."""
    global B, S, CONFIG, DEVICE
    if settings:
        B, S, CONFIG = settings["B"], settings["S"], settings["CONFIG"]
        DEVICE = settings.get("DEVICE", "cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    if DEVICE.startswith("cuda"):
        DEVICE = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if DEVICE.startswith("cuda") else "gloo", rank=rank,
                            world_size=world)
    out = {}
    try:
        base = {}
        for name, label, plan_path, nvme in cases:
            if compare and name not in base:
                base[name] = train(name, engine, None, None, rank, steps)
            g0, w0, _, n0 = base.get(name, ([], [], None, 0))
            g, w, rep, n = train(name, engine, plan_path, nvme, rank, steps)
            dist.barrier()       # every rank has removed its handle: nothing may be left
            left = sorted(str(p) for p in Path(nvme).rglob("*")) if Path(nvme).exists() else []
            out[f"{name}/{label}"] = {
                "grad_diff": max((_maxdiff(g[k], g0[k]) for k in range(len(g0))), default=0.0),
                "weight_diff": _maxdiff(w, w0), "left": left, "report": rep,
                "nonzero_grads": sum(int(x.abs().sum() > 0) for x in g[-1]),
                "gathers": n, "gathers_plain": n0}
    except BaseException:
        out["error"] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(engine: str, cases: list, out_dir, world: int = 2, steps: int = 2,
        compare: bool = True) -> list[dict]:
    """Every rank's results (rank order); raises with a rank's traceback if one failed."""
    import torch.multiprocessing as mp
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    settings = {"B": B, "S": S, "CONFIG": CONFIG, "DEVICE": DEVICE}
    mp.spawn(worker, args=(world, free_port(), engine, cases, str(out_dir), steps, compare,
                           settings), nprocs=world, join=True)
    res = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
    for r, x in enumerate(res):
        if "error" in x:
            raise AssertionError(f"rank {r} failed:\n{x['error']}")
    return res


# ----------------------------------------------------------------------------- faults

def fault_worker(rank: int, world: int, port: int, engine: str, plan: str, nvme: str,
                 fault: str, out_dir: str):
    """Rank 0 fails in the last block's forward of its second step (``exception``: a
    RuntimeError; ``sigint``: SIGINT to itself, i.e. Ctrl-C), with offload files on disk; the
    other ranks train on and are left waiting in a collective."""
    import datetime
    import signal
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from runtime import apply_plan
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    model, batches = build("gpt-tiny", rank)
    wrapped = wrap(model, engine)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    handle = apply_plan(wrapped, plan, optimizer=opt, nvme_dir=nvme)
    step = [0]

    def hook(mod, args, out):
        if rank == 0 and step[0] == 1:
            files = sum(1 for _ in Path(nvme).rglob("*.bin"))
            Path(out_dir, "seen.json").write_text(json.dumps({"files": files}))
            if fault == "sigint":
                # Ctrl-C as at a terminal, also when the suite runs in the background with
                # SIGINT inherited as ignored (the kill would then do nothing)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                os.kill(os.getpid(), signal.SIGINT)
            raise RuntimeError("tierplan test: a fault injected on rank 0")

    blocks_of(model)[-1].register_forward_hook(hook)
    for k in range(2):
        step[0] = k
        wrapped(**batches[k]).loss.backward()
        opt.step()
        opt.zero_grad()
    handle.remove()
    dist.destroy_process_group()


def run_fault(engine: str, plan: str, nvme: str, fault: str, out_dir, world: int = 2):
    import torch.multiprocessing as mp
    mp.spawn(fault_worker, args=(world, free_port(), engine, plan, nvme, fault, str(out_dir)),
             nprocs=world, join=True)
