"""Train a model for a few steps, under a tierplan plan or plainly.

    python examples/train.py --model gpt-tiny --batch 4 --seq 128 --steps 3 --plan PLAN
    torchrun --nproc-per-node 2 examples/train.py --fsdp --model gpt-tiny --plan PLAN

With ``--fsdp`` or ``--ddp`` (under ``torchrun``) every rank builds the same model, wraps it the
usual way (``fully_shard`` on each block, then the root; or ``DistributedDataParallel``), then
applies the same plan (one rank's, from ``plan solve --world-size N``) and trains on its own
batches (``--batch`` is per rank). The process group uses NCCL on CUDA and gloo on a CPU.

MODEL is a built-in name (``planner.models``), a model YAML, or ``package.module:function``
returning ``(module, inputs)``. Tokens are synthetic (seeded), or the bytes of ``--text FILE``
taken as token ids. The optimizer is AdamW; the loss is printed every step and, under a plan,
the measured report at the end (``--report-out FILE`` saves it as JSON).

Exit codes (one line on stderr, never a traceback, for anything a user can cause): 0 done;
2 bad input (``error: ...``: plan, model, paths, arguments); 4 training stopped by the
runtime (``error: ...``: an NVMe file corrupted or unreadable, a full disk, a recomputation
that did not match, out of memory); 130 Ctrl-C (``train: interrupted``); 143 SIGTERM
(``train: terminated by SIGTERM``). On each, the runtime's files are deleted as it unwinds.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

from planner.errors import UserError  # noqa: E402
from planner.sizes import fmt_seconds  # noqa: E402

# Training stopped by the runtime, not by bad input: exit code 4 (see the module docstring).
EXIT_RUNTIME = 4


torch = None     # imported in main's try (_import_torch): seconds in which Ctrl-C is handled


class _Terminated(KeyboardInterrupt):
    """SIGTERM: unwound like Ctrl-C, so the runtime's files go with the training loop."""


_caught: list = []      # the signals whose exceptions were raised, in case one is swallowed


def _on_sigterm(signum, frame):
    _caught.append(_Terminated())
    raise _caught[-1]


def _on_sigint(signum, frame):
    _caught.append(KeyboardInterrupt())
    raise _caught[-1]


def _import_torch() -> None:
    """``import torch`` inside main's try, so that Ctrl-C (or SIGTERM) in its seconds is the
    one-line exit, not a traceback. torch's C code can discard the exception a handler
    raises: the handler records it, and it is raised again once the import returns."""
    global torch
    prev = None
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        prev = signal.signal(signal.SIGINT, _on_sigint)
    try:
        import torch as _torch
    finally:
        if prev is not None:
            signal.signal(signal.SIGINT, prev)
    if _caught:
        raise _caught[0]
    torch = _torch


def _runtime_errors() -> tuple:
    """The errors a user can cause that stop training (exit 4)."""
    import torch
    from runtime.files import OffloadError
    from runtime.recompute import RecomputeMismatch
    return (OffloadError, RecomputeMismatch, torch.OutOfMemoryError, MemoryError)


def _batches(vocab: int, batch: int, seq: int, text: str | None, device, rank: int = 0):
    """Yield ``(input_ids, labels)`` forever: next-token targets from synthetic ids or a file
    (each rank its own stream)."""
    g = torch.Generator().manual_seed(rank)
    if text:
        from planner.formats.fileio import read_bytes
        data = torch.tensor(list(read_bytes(text, "--text")), dtype=torch.long)
        if vocab < 256:
            raise UserError(f"--text needs a vocabulary of at least 256 (bytes), the model has {vocab}")
        if data.numel() < seq + 2:
            raise UserError(f"--text '{text}' has {data.numel()} bytes; give at least {seq + 2}")
    while True:
        if text:
            starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
            ids = torch.stack([data[s:s + seq + 1] for s in starts.tolist()])
        else:
            ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
        yield ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def _build(spec: str, batch: int, seq: int, dtype: str | None, device: str):
    """(model, vocab, labels_shifted): built-in models take next-token labels, Hugging Face
    models shift the labels themselves."""
    from planner.profile import resolve_model
    model, inputs, _, cfg, _ = resolve_model(spec, batch, seq, dtype, device)
    if ":" in spec and not spec.endswith((".yaml", ".yml")):
        vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 256
        if hasattr(model, "config") and hasattr(model.config, "use_cache"):
            model.config.use_cache = False      # a KV cache has no place in training
        return model, int(vocab), False
    return model, int(cfg["vocab_size"]), True


def _start_ranks(engine: str, device: str):
    """Join torchrun's process group; the device this rank computes on."""
    import torch.distributed as dist
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise UserError(f"--{engine} runs one process per rank: start it with torchrun, e.g. "
                        f"torchrun --nproc-per-node 2 examples/train.py --{engine} ...")
    if device.startswith("cuda"):
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = f"cuda:{local}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return device


def _wrap(model, engine: str):
    """The usual way: ``fully_shard`` each block, then the root; or DDP around the model."""
    if engine == "fsdp":
        from torch.distributed.fsdp import fully_shard

        from planner.blocks import find_blocks
        _, blocks = find_blocks(model, None)
        for _, block in blocks:
            fully_shard(block)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel
    return DistributedDataParallel(model)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-tiny")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps")
    ap.add_argument("--micro-batches", type=int, default=1, help="passes per optimizer step")
    ap.add_argument("--clip", type=float, default=None, help="clip the gradients' norm to this")
    ap.add_argument("--plan", help="plan JSON from 'plan solve'; without it, train plainly")
    ap.add_argument("--nvme-dir", help="override the plan's NVMe directory")
    ap.add_argument("--text", help="train on this file's bytes instead of synthetic tokens")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--report-out", help="save the measured report (JSON) here (one file per "
                    "rank, FILE.rankN.json, with --fsdp/--ddp)")
    eng = ap.add_mutually_exclusive_group()
    eng.add_argument("--fsdp", action="store_true", help="shard with FSDP2 (under torchrun)")
    eng.add_argument("--ddp", action="store_true", help="replicate with DDP (under torchrun)")
    args = ap.parse_args(argv)
    engine = "fsdp" if args.fsdp else "ddp" if args.ddp else None
    rank, world = 0, 1
    previous, finished = None, False
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    _caught.clear()
    try:
        _import_torch()
        if engine:
            args.device = _start_ranks(engine, args.device)
            import torch.distributed as dist
            rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)          # the same initial weights on every rank
        model, vocab, shifted = _build(args.model, args.batch, args.seq, args.dtype, args.device)
        model.train()
        wrapped = _wrap(model, engine) if engine else model   # wrap first, then the plan
        opt = torch.optim.AdamW(wrapped.parameters(), lr=args.lr)
        handle = None
        if args.plan:
            from runtime import apply_plan
            handle = apply_plan(wrapped, args.plan, optimizer=opt, nvme_dir=args.nvme_dir)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps))
        torch.manual_seed(rank)       # each rank its own dropout
        data = _batches(vocab, args.batch, args.seq, args.text, args.device, rank)
        K = max(1, args.micro_batches)
        cuda = str(args.device).startswith("cuda")
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        # One step's time has one definition, the report's (docs/runtime.md, "The report"):
        # from the step's first forward to the end of its optimizer step. Under a plan the
        # figures printed are the report's own; without one, this loop measures the same span.
        times = []
        tag = f"rank {rank}/{world}  " if engine else ""
        layer_major = handle is not None and handle.plan.micro_batch_order == "layer-major"
        for step in range(args.steps):
            total = 0.0
            if layer_major:
                # every micro-batch through a unit before the next: the handle runs the step's
                # forwards and backwards (docs/runtime.md, "Layer-major plans")
                mbs = [next(data) for _ in range(K)]
                if cuda:
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                losses = handle.run_micro_batches(
                    mbs, lambda m, mb: m(input_ids=mb[0],
                                         labels=mb[1] if shifted else mb[0]).loss / K)
                total = sum(x.item() for x in losses)
            for k in range(0 if layer_major else K):
                ids, labels = next(data)
                if k == 0:
                    if cuda:
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                out = wrapped(input_ids=ids, labels=labels if shifted else ids)
                (out.loss / K).backward()
                total += out.loss.item() / K
            if args.clip is not None:
                # through the handle: a plan may keep some gradients on disk
                (handle.clip_grad_norm_ if handle else
                 lambda m: torch.nn.utils.clip_grad_norm_(wrapped.parameters(), m))(args.clip)
            opt.step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            if handle is not None and len(handle.report().steps) == step + 1:
                times[-1] = handle.report().steps[-1].step_s
            sched.step()
            opt.zero_grad(set_to_none=True)
            print(f"{tag}step {step + 1}/{args.steps}  loss {total:.4f}  step time "
                  f"{fmt_seconds(times[-1])}", flush=True)
        if len(times) > 1:      # the first step warms up (allocator, kernels): left out
            # the median as the report takes it (the mean of the middle two of an even count)
            m = handle.report().measured if handle is not None else None
            med = m.step_s if m is not None else statistics.median(times[1:])
            print(f"{tag}step time {fmt_seconds(med)}: median of steps 2..{len(times)} (the "
                  "first step is left out)"
                  + (f"; peak allocated {torch.cuda.max_memory_allocated() / 2**30:.3f} GiB"
                     if cuda else ""), flush=True)
        if handle is not None:
            rep = handle.report()
            if args.report_out:
                out = args.report_out
                if engine:
                    p = Path(out)
                    out = str(p.with_name(f"{p.stem}.rank{rank}{p.suffix or '.json'}"))
                print(f"report written to {rep.save(out)}")
            reports = handle.gather_reports() if engine else [rep]
            for r in reports or ():       # every rank's report, printed by rank 0
                print(r)
            handle.remove()
        finished = True
    except UserError as e:
        print(f"error{f' (rank {rank})' if world > 1 else ''}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        # Ctrl-C or SIGTERM: one line, not a traceback; the runtime's files went with the
        # unwinding (the runtime's own SIGTERM exception is a KeyboardInterrupt too)
        if isinstance(e, _Terminated) or type(e).__name__ == "Terminated":
            print("train: terminated by SIGTERM", file=sys.stderr)
            return 128 + signal.SIGTERM
        print("train: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if _caught:
            # an error that followed a signal torch's C code swallowed (during its import):
            # the signal's end, without importing torch again to classify the error
            terminated = isinstance(_caught[0], _Terminated)
            print("train: terminated by SIGTERM" if terminated else "train: interrupted",
                  file=sys.stderr)
            return 128 + signal.SIGTERM if terminated else 130
        if not isinstance(e, _runtime_errors()):
            raise
        line = " ".join(str(e).split()) or type(e).__name__
        print(f"error{f' (rank {rank})' if world > 1 else ''}: {line}", file=sys.stderr)
        return EXIT_RUNTIME
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if engine:
            import torch.distributed as dist
            if dist.is_initialized():
                # every rank past its last collective before any closes its connections: a
                # gloo rank whose peer has already torn down can abort (SIGABRT) on the
                # closed socket while it finishes its own work
                # (on success only: a rank that failed must not wait for peers still training)
                try:
                    if finished:
                        dist.barrier()
                finally:
                    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
