"""Issue 29, runtime side: FSDP2 shards homed off the device.

``runtime.shard_for_plan`` wraps each of the plan's blocks with the offload policy its homes
need, then the root; on 2 gloo ranks a model wrapped by it trains 3 steps to every full weight
of plain FSDP2 (<= 1e-6, gathered with ``DTensor.full_tensor()``). A model wrapped by hand
has each block's policy checked by ``apply_plan`` (one line). Homes this runtime does not
execute under FSDP2 (shards on NVMe, a block's tensor classes split between tiers, any home
off the device under DDP) are refused in one line before anything is wrapped or written.

Plans: a 2-rank FSDP2 plan of gpt-tiny from the planner (homes on the device), and
single-process streaming plans (``conftest.plan_for``) relabelled engine fsdp2, with the
homes under test.
"""
from __future__ import annotations

import contextlib
import copy
import json
from pathlib import Path

import pytest
import torch

import dist_harness as H
from conftest import plan_for
from planner.errors import UserError
from planner.formats import Home, Plan, Tier as T
from planner.models import build_model, load_config, make_inputs

B, S = 2, 16
CFG = dict(load_config("gpt-tiny"), n_layers=2, dtype="fp32")
HOST = Home(T.CPU, T.CPU, T.CPU, T.CPU)


def _line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def _model():
    torch.manual_seed(0)
    return build_model(CFG, dtype="fp32")


def _relabelled(home, nvme, engine="fsdp2", unit="blocks") -> Plan:
    d = plan_for(_model(), "keep-all", B, S, nvme_dir=nvme, homes={unit: home}).to_dict()
    d = copy.deepcopy(d)
    d["engine"], d["world_size"] = engine, 1
    return Plan.from_dict(d)


# ----------------------------------------------------------------------------- the policies

def test_policy_for_each_home():
    from runtime.engines import EngineError
    from runtime.sharded import DEVICE, HOST as HOST_KIND, NVME as NVME_KIND, policy_for
    assert policy_for("b", Home(), "cuda", "p") == DEVICE
    assert policy_for("b", HOST, "cuda", "p") == HOST_KIND
    assert policy_for("b", Home(), "cpu", "p") == DEVICE
    # any of the three classes on NVMe (the rest on the device), the step on the device: no
    # FSDP2 policy, the files are the runtime's (NvmeShards)
    for home in (Home(T.NVME, T.GPU, T.NVME, T.GPU), Home(T.NVME, T.GPU, T.GPU, T.GPU),
                 Home(T.GPU, T.GPU, T.NVME, T.GPU), Home(T.NVME, T.NVME, T.NVME, T.GPU),
                 Home(T.GPU, T.NVME, T.GPU, T.GPU)):
        assert policy_for("b", home, "cpu", "p") == NVME_KIND
    for home, dev, want in [
            (HOST, "cpu", "is the device itself"),
            (Home(T.NVME, T.GPU, T.GPU, T.GPU), "cuda", "on a CPU device only so far"),
            (Home(T.GPU, T.GPU, T.NVME, T.CPU), "cpu", "with the step on the device"),
            (Home(T.NVME, T.NVME, T.NVME, T.CPU), "cpu", "with the step on the device"),
            (Home(T.NVME, T.GPU, T.CPU, T.GPU), "cpu", "not mixed with host memory"),
            (Home(T.CPU, T.GPU, T.CPU, T.CPU), "cuda", "moves a group's weights, gradients"),
            (Home(T.GPU, T.GPU, T.CPU, T.CPU), "cuda", "moves a group's weights, gradients")]:
        with pytest.raises(EngineError) as e:
            policy_for("blocks.0", home, dev, "p.json")
        assert want in _line(e) and "blocks.0" in _line(e) and "p.json" in _line(e)


def test_nvme_shards_it_does_not_execute_are_refused_before_anything_is_wrapped_or_written(
        one_rank_group, tmp_path):
    from runtime import apply_plan, shard_for_plan
    from runtime.engines import EngineError, is_fsdp2
    nvme = tmp_path / "nvme"
    # a unit outside the blocks homed on NVMe: FSDP2's root group holds them all
    plan = _relabelled(Home(T.GPU, T.GPU, T.NVME, T.GPU), nvme, unit="embedding")
    model = _model()
    with pytest.raises(EngineError) as e:
        shard_for_plan(model, plan)
    assert "a unit outside the blocks has a home on NVMe" in _line(e)
    assert not any(is_fsdp2(m) for m in model.modules())      # refused before any wrap
    H.wrap(model, "fsdp2")
    with pytest.raises(UserError) as e:
        apply_plan(model, plan, optimizer=torch.optim.AdamW(model.parameters()))
    assert "a unit outside the blocks has a home on NVMe" in _line(e)
    assert not nvme.exists()
    # an executable NVMe home, but an optimizer that is not elementwise: refused, no file left
    plan = _relabelled(Home(T.NVME, T.GPU, T.NVME, T.GPU), nvme)
    with pytest.raises(UserError) as e:
        apply_plan(model, plan, optimizer=torch.optim.LBFGS(model.parameters()))
    assert "LBFGS is not one of the elementwise optimizers" in _line(e)
    with pytest.raises(UserError) as e:
        apply_plan(model, plan)
    assert "pass apply_plan(model, plan, optimizer=opt)" in _line(e)
    # on one rank FSDP2 gathers nothing (its unsharded weights are the shard itself)
    with pytest.raises(UserError) as e:
        apply_plan(model, plan, optimizer=torch.optim.AdamW(model.parameters()))
    assert "over 1 rank" in _line(e) and "engine none" in _line(e)
    assert not any(nvme.rglob("*.bin"))


def test_ddp_keeps_the_refusal(one_rank_group, tmp_path):
    from runtime import apply_plan
    plan = _relabelled(Home(T.NVME, T.NVME, T.NVME, T.GPU), tmp_path / "nvme", engine="ddp")
    wrapped = H.wrap(_model(), "ddp")
    with pytest.raises(UserError) as e:
        apply_plan(wrapped, plan, optimizer=torch.optim.AdamW(wrapped.parameters()))
    assert "off the device under ddp, which is not supported" in _line(e)


def test_a_hand_wrapped_block_whose_policy_differs_from_the_plan_is_refused(one_rank_group,
                                                                            tmp_path):
    from runtime import apply_plan
    from runtime.engines import EngineError
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    plan = _relabelled(Home(), tmp_path / "nvme")
    model = _model()
    blocks = H.blocks_of(model)
    fully_shard(blocks[0])
    fully_shard(blocks[1], offload_policy=CPUOffloadPolicy(pin_memory=False))
    fully_shard(model)
    with pytest.raises(EngineError) as e:
        apply_plan(model, plan)
    assert "block blocks.1 is fully_shard-ed with CPUOffloadPolicy but the plan homes its " \
           "shard on the device" in _line(e)


def test_shard_for_plan_refuses_the_settings_it_owns(one_rank_group, tmp_path):
    from runtime import shard_for_plan
    from runtime.engines import EngineError
    with pytest.raises(EngineError) as e:
        shard_for_plan(_model(), _relabelled(Home(), tmp_path / "n"), reshard_after_forward=False)
    assert "sets reshard_after_forward from the plan" in _line(e)
    d = _relabelled(Home(), tmp_path / "n").to_dict()
    d["engine"] = "none"
    with pytest.raises(EngineError) as e:
        shard_for_plan(_model(), Plan.from_dict(d))
    assert "not fsdp2" in _line(e)


# ----------------------------------------------------------------------------- 2 gloo ranks

STEPS = 3


@contextlib.contextmanager
def _rank(rank, world, port, out_dir):
    """One gloo rank of a test: its process group, then ``out`` (what the body records),
    written to ``rank<N>.json`` with the traceback of any error the body raised (the parent
    reads it), and the group destroyed."""
    import os
    import torch.distributed as dist
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}")
    out = {}
    try:
        yield out
    except BaseException:
        import traceback
        out["error"] = traceback.format_exc()
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
        dist.destroy_process_group()


def _two_rank_worker(rank, world, port, plan, out_dir):
    with _rank(rank, world, port, out_dir) as out:
        from runtime import apply_plan, shard_for_plan
        from runtime.sharded import _actual
        full = {}
        for how in ("plain", "plan"):
            model, batches = H.build("gpt-tiny", rank)
            if how == "plain":
                H.wrap(model, "fsdp2")
            else:
                shard_for_plan(model, plan)
                out["policies"] = [_actual(b) for b in H.blocks_of(model)] + [_actual(model)]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            handle = apply_plan(model, plan, optimizer=opt) if how == "plan" else None
            torch.manual_seed(1234 + rank)
            for k in range(STEPS):
                model(**batches[k % 2]).loss.backward()
                opt.step()
                opt.zero_grad()
            full[how] = [p.full_tensor().detach().clone() if hasattr(p, "full_tensor")
                         else p.detach().clone() for p in model.parameters()]
            if handle is not None:
                out["engine"] = handle.report().to_dict()["engine"]
                handle.remove()
        out["maxdiff"] = max((a - b).abs().max().item()
                             for a, b in zip(full["plain"], full["plan"]))
        out["moved"] = max((a - b).abs().max().item()
                           for a, b in zip(full["plan"], [p.detach() for p in
                                                          H.build("gpt-tiny", rank)[0]
                                                          .parameters()]))


@pytest.mark.slow
def test_two_ranks_sharded_by_the_plan_equal_plain_fsdp2(tmp_path):
    import torch.multiprocessing as mp
    from planner.costmodel.baselines import baseline_layers
    from planner.formats import Budgets
    from planner.hardware import load_hardware
    from planner.plans import cost_model, make_plan, save_plan
    hw, prof = load_hardware("cpu-host"), H.profile("gpt-tiny")
    b = Budgets(hw.memory_bytes, 0, 1 << 30)
    cm = cost_model(prof, hw, b, world_size=2, ranks_per_node=2, engine="fsdp2")
    plan = str(tmp_path / "fsdp2.json")
    save_plan(make_plan(prof, None, hw, b, "recompute-all",
                        baseline_layers("recompute-all", prof.layers, hw), cm=cm), plan)
    mp.spawn(_two_rank_worker, args=(2, H.free_port(), plan, str(tmp_path)), nprocs=2,
             join=True)
    for r in range(2):
        x = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "error" not in x, x.get("error")
        assert x["engine"] == "fsdp2"
        assert x["policies"] == ["device"] * (len(x["policies"]))
        assert x["maxdiff"] <= 1e-6
        assert x["moved"] > 1e-4        # the 3 steps changed the weights (the test can fail)


def test_engine_view_leaves_the_homes_to_fsdp2(tmp_path):
    """Under FSDP2 the runtime's own view of a plan with homes off the device is resident (the
    engine's CPUOffloadPolicy carries the host homes); the activation decisions are kept."""
    from runtime.sharded import engine_view
    plan = _relabelled(Home(T.NVME, T.NVME, T.NVME, T.GPU), tmp_path / "nvme")
    view = engine_view(plan)
    assert any(not d.home.resident for d in plan.layers)
    assert all(d.home.resident for d in view.layers)
    assert [d.activation for d in view.layers] == [d.activation for d in plan.layers]


# ----------------------------------------------------------------------------- NVMe shards

NVME_HOME = Home(T.NVME, T.GPU, T.NVME, T.GPU)
ALL_NVME = Home(T.NVME, T.NVME, T.NVME, T.GPU)


def _nvme_plan(tmp_path, home=NVME_HOME, micro_batches=1) -> tuple[str, Path]:
    """A 2-rank FSDP2 plan of gpt-tiny: keep-all, every block but the first with ``home``,
    priced by the planner's per-rank cost model."""
    import dataclasses
    from planner.costmodel.baselines import baseline_layers
    from planner.formats import Budgets
    from planner.hardware import load_hardware
    from planner.plans import cost_model, make_plan, save_plan
    hw, prof = load_hardware("cpu-host"), H.profile("gpt-tiny")
    b = Budgets(hw.memory_bytes, 0, 1 << 30)
    cm = cost_model(prof, hw, b, world_size=2, ranks_per_node=2, engine="fsdp2",
                    micro_batches=micro_batches)
    blocks = [u.name for u in prof.layers if u.kind == "block"]
    layers = [dataclasses.replace(d, home=home) if d.name in blocks[1:] else d
              for d in baseline_layers("keep-all", prof.layers, hw)]
    nvme = tmp_path / "nvme"
    plan = make_plan(prof, None, hw, b, "optimal", layers, nvme_dir=str(nvme), cm=cm,
                     micro_batches=micro_batches)
    path = str(tmp_path / "fsdp2-nvme.json")
    save_plan(plan, path)
    return path, nvme


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _nvme_worker(rank, world, port, plan, out_dir, K=1, clip=False):
    with _rank(rank, world, port, out_dir) as out:
        from runtime import apply_plan, shard_for_plan
        got = {}
        for how in ("plain", "plan"):
            model, batches = H.build("gpt-tiny", rank)
            if how == "plain":
                H.wrap(model, "fsdp2")
            else:
                shard_for_plan(model, plan)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
            handle = apply_plan(model, plan, optimizer=opt) if how == "plan" else None
            torch.manual_seed(1234 + rank)
            # an optimizer step hook sees the step whole: the homed blocks stepped too (with
            # the clip case only: its reads are not the plan's)
            seen = []
            if clip:
                opt.register_step_post_hook(lambda *a: seen.append(
                    sum(_full(v).double().sum().item() for v in model.state_dict().values())))
                # and a global one (torch.optim's), once a step
                from torch.optim.optimizer import register_optimizer_step_post_hook
                glob = register_optimizer_step_post_hook(
                    lambda o, *a: seen.append(sum(
                        _full(v).double().sum().item() for v in model.state_dict().values()))
                    if o is opt else None)
            model.float()              # a cast after apply_plan (FSDP2 re-pads in _apply)

            def step(k):
                for j in range(K):
                    (model(**batches[(k + j) % 2]).loss / K).backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                    for q in model.parameters():         # through an alias, as code does
                        if q.grad is not None:
                            q.grad.data.mul_(0.5)
                opt.step()
                sched.step()
                (opt.zero_grad if k % 2 == 0 else model.zero_grad)()
            for k in range(STEPS - 1):
                step(k)
            # a checkpoint taken and loaded back mid-run: the last step, run twice from it,
            # gives the same weights both times (what load_state_dict wrote went home)
            saved_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
            o = opt.state_dict()
            saved_osd = {"state": {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                       for k, v in st.items()} for i, st in o["state"].items()},
                         "param_groups": copy.deepcopy(o["param_groups"])}
            rng = torch.get_rng_state()
            step(STEPS - 1)
            # (read through the state dict: a shard on NVMe has no storage between uses)
            first = [_full(v).detach().clone() for v in model.state_dict().values()]
            model.load_state_dict(saved_sd)
            opt.load_state_dict(state_dict=saved_osd)      # by keyword, as DCP calls it
            # the caller's dict is left as it was (torch keeps its tensors where no cast is
            # needed; the plan frees the state it homes)
            out.setdefault("osd_intact", {})[how] = all(
                getattr(v, "_local_tensor", v).untyped_storage().nbytes() > 0
                for st in saved_osd["state"].values() for v in st.values()
                if isinstance(v, torch.Tensor))
            sched.last_epoch -= 1
            torch.set_rng_state(rng)
            step(STEPS - 1)
            again = [_full(v).detach().clone() for v in model.state_dict().values()]
            out.setdefault("reloaded", {})[how] = max((a - b).abs().max().item()
                                                      for a, b in zip(first, again))
            # the state dicts while the plan is applied: the real values (a submodule of a
            # homed block's own too)
            sd = {k: _full(v).detach().clone() for k, v in model.state_dict().items()}
            sub = H.blocks_of(model)[-1].norm1
            sd.update({"sub." + k: _full(v).detach().clone()
                       for k, v in sub.state_dict().items()})
            out.setdefault("hooked", {})[how] = seen
            osd = opt.state_dict()["state"]
            state = {i: {k: _full(v).clone() for k, v in st.items()} for i, st in osd.items()}
            if clip:
                glob.remove()
            if handle is not None:
                rep = handle.report()
                out["moved"] = {k: [rep.measured.moved[k], rep.predicted_moved[k]]
                                for k in ("nvme_read", "nvme_write")}
                handle.remove()
            full = [_full(p).detach().clone() for p in model.parameters()]
            got[how] = (sd, state, full)
        (sd0, st0, w0), (sd1, st1, w1) = got["plain"], got["plan"]
        out["weights"] = max((a - b).abs().max().item() for a, b in zip(w0, w1))
        out["state_dict"] = max((sd0[k] - sd1[k]).abs().max().item() for k in sd0)
        out["state_keys"] = sorted(sd0) == sorted(sd1)
        out["hook_sums"] = max((abs(a - b) for a, b in zip(out["hooked"]["plain"],
                                                           out["hooked"]["plan"])), default=0.0)
        out["hook_steps"] = len(out["hooked"]["plan"])
        out["opt_state"] = max((st0[i][k] - st1[i][k]).abs().max().item()
                               for i in st0 for k in st0[i])
        out["trained"] = max((a - b).abs().max().item() for a, b in
                             zip(w1, [p.detach() for p in H.build("gpt-tiny", rank)[0]
                                      .parameters()]))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["weights+state", "all-three+accumulation+clip"])
def test_two_ranks_with_shards_on_nvme_equal_plain_fsdp2(case, tmp_path):
    """Two gloo ranks, blocks 1 and 2 with their shards on NVMe: the weights and optimizer
    state (one micro-batch a step), or all three classes (two micro-batches a step, clipped
    by torch's own ``clip_grad_norm_``, which reads and scales the gradient placeholders).
    3 AdamW steps (weight decay, a StepLR scheduler, both zero_grad idioms) give every full
    weight, every state-dict entry and every optimizer state of plain FSDP2 (<= 1e-6); a
    checkpoint taken mid-run and loaded back (``model.load_state_dict``,
    ``opt.load_state_dict``) replays the last step to the same weights; without a clip (which
    reads the gradients once more) the bytes moved are the plan's; no file is left."""
    import torch.multiprocessing as mp
    home, K, clip = (NVME_HOME, 1, False) if case == "weights+state" else (ALL_NVME, 2, True)
    plan, nvme = _nvme_plan(tmp_path, home, micro_batches=K)
    mp.spawn(_nvme_worker, args=(2, H.free_port(), plan, str(tmp_path), K, clip), nprocs=2,
             join=True)
    for r in range(2):
        x = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "error" not in x, x.get("error")
        assert x["weights"] <= 1e-6 and x["state_dict"] <= 1e-6 and x["opt_state"] <= 1e-6, x
        assert x["state_keys"]
        assert x["reloaded"]["plain"] == 0.0 and x["reloaded"]["plan"] <= 1e-6, x["reloaded"]
        assert x["osd_intact"] == {"plain": True, "plan": True}
        assert x["hook_steps"] == (2 * (STEPS + 1) if clip else 0) and x["hook_sums"] <= 1e-4, x

        assert x["trained"] > 1e-4          # the steps changed the weights (the test can fail)
        for link, (measured, predicted) in x["moved"].items():
            assert measured >= predicted > 0, (link, measured, predicted)
            if not clip:
                assert measured == predicted, (link, measured, predicted)
    assert not any(nvme.rglob("*.bin")), list(nvme.rglob("*"))


def _scaler_worker(rank, world, port, plan, out_dir):
    with _rank(rank, world, port, out_dir) as out:
        from runtime import apply_plan, shard_for_plan
        got = {}
        for how in ("plain", "plan"):
            model, batches = H.build("gpt-tiny", rank)
            model.eval()                      # no dropout: both runs draw nothing
            H.wrap(model, "fsdp2") if how == "plain" else shard_for_plan(model, plan)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16)
            handle = apply_plan(model, plan, optimizer=opt) if how == "plan" else None
            for k in range(2):
                scaler.scale(model(**batches[k]).loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            got[how] = {k: _full(v).detach().clone() for k, v in model.state_dict().items()}
            if handle is not None:
                handle.remove()
        out["diff"] = max((got["plain"][k] - got["plan"][k]).abs().max().item()
                          for k in got["plain"])


@pytest.mark.slow
def test_two_ranks_fused_adamw_under_grad_scaler_equal_plain_fsdp2(tmp_path):
    """A fused AdamW stepped by torch's GradScaler: the scaler's ``grad_scale`` and
    ``found_inf`` reach the homed blocks' steps too, so they unscale as plain FSDP2 does
    (weights and state on NVMe; a scaler's unscaling writes into the gradients, which a
    gradient shard on NVMe refuses in one line, as in one process)."""
    import torch.multiprocessing as mp
    plan, _ = _nvme_plan(tmp_path, NVME_HOME)
    mp.spawn(_scaler_worker, args=(2, H.free_port(), plan, str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        x = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "error" not in x, x.get("error")
        assert x["diff"] <= 1e-6, x


def _qwen2(rank):
    """A Hugging Face Qwen2 as ``Qwen2Config`` gives it (``use_cache`` and all), sizes aside,
    and this rank's two batches."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(100 + rank)
    ids = [torch.randint(0, 256, (2, 32), generator=g) for _ in range(2)]
    return model, [{"input_ids": i, "labels": i.clone()} for i in ids]


def _hf_worker(rank, world, port, plan, out_dir):
    import warnings
    from torch.distributed.fsdp import fully_shard
    with _rank(rank, world, port, out_dir) as out:
        from runtime import apply_plan, shard_for_plan
        got = {}
        for how in ("plain", "plan"):
            model, batches = _qwen2(rank)
            if how == "plain":
                for layer in model.model.layers:
                    fully_shard(layer)
                fully_shard(model)
            else:
                shard_for_plan(model, plan)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")     # (the key/value cache use_cache fills)
                handle = apply_plan(model, plan, optimizer=opt) if how == "plan" else None
            torch.manual_seed(5)
            for k in range(3):                      # the loop as Trainer-style code writes it
                model(**batches[k % 2]).loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                model.zero_grad()
            got[how] = {k: _full(v).detach().clone() for k, v in model.state_dict().items()}
            if handle is not None:
                handle.remove()
        out["diff"] = max((got["plain"][k] - got["plan"][k]).abs().max().item()
                          for k in got["plain"])


@pytest.mark.slow
def test_two_ranks_of_a_hugging_face_model_from_its_config_with_shards_on_nvme(tmp_path):
    """A Hugging Face Qwen2 from its config, layers 1-3 with all three classes on NVMe, on 2
    gloo ranks: clipped by torch's ``clip_grad_norm_``, ``model.zero_grad()``, 3 steps: every
    state-dict entry equal to plain FSDP2's; no file left."""
    import dataclasses
    import warnings
    import torch.multiprocessing as mp
    from planner.costmodel.baselines import baseline_layers
    from planner.formats import Budgets
    from planner.hardware import load_hardware
    from planner.plans import cost_model, make_plan, save_plan
    from planner.profile import profile_module
    hw = load_hardware("cpu-host")
    model, batches = _qwen2(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prof = profile_module(model, batches[0], name="qwen2", hardware=hw, timing="estimate",
                              batch=2, seq=32)
    b = Budgets(hw.memory_bytes, 0, 1 << 30)
    cm = cost_model(prof, hw, b, world_size=2, ranks_per_node=2, engine="fsdp2")
    blocks = [u.name for u in prof.layers if u.kind == "block"]
    layers = [dataclasses.replace(d, home=ALL_NVME) if d.name in blocks[1:] else d
              for d in baseline_layers("keep-all", prof.layers, hw)]
    nvme = tmp_path / "nvme"
    plan = str(tmp_path / "qwen2.json")
    save_plan(make_plan(prof, None, hw, b, "optimal", layers, nvme_dir=str(nvme), cm=cm), plan)
    mp.spawn(_hf_worker, args=(2, H.free_port(), plan, str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        x = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "error" not in x, x.get("error")
        assert x["diff"] <= 1e-6, x
    assert not any(nvme.rglob("*.bin")), list(nvme.rglob("*"))


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["exception", "sigint"])
def test_no_shard_file_left_when_one_rank_fails(fault, tmp_path):
    """Rank 0 fails in the last block's forward of its second step (an exception, or SIGINT
    to itself) with its shards' files on disk; rank 1 is left in a collective and terminated.
    No file or directory is left."""
    plan, nvme = _nvme_plan(tmp_path, ALL_NVME)
    with pytest.raises(Exception):
        H.run_fault("fsdp2", plan, str(nvme), fault, tmp_path)
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert seen["files"] > 0, "no shard file existed when the fault came"
    assert not nvme.exists(), list(nvme.rglob("*"))
