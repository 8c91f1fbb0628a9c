"""Train a model for a few steps, under a tierplan plan or plainly.

    python examples/train.py --model gpt-tiny --batch 4 --seq 128 --steps 3 --plan PLAN

MODEL is a built-in name (``planner.models``), a model YAML, or ``package.module:function``
returning ``(module, inputs)``. Tokens are synthetic (seeded), or the bytes of ``--text FILE``
taken as token ids. The optimizer is AdamW; the loss is printed every step and, under a plan,
the measured report at the end (``--report-out FILE`` saves it as JSON).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # run from a checkout

from planner.errors import UserError  # noqa: E402


def _batches(vocab: int, batch: int, seq: int, text: str | None, device):
    """Yield ``(input_ids, labels)`` forever: next-token targets from synthetic ids or a file."""
    g = torch.Generator().manual_seed(0)
    if text:
        data = torch.tensor(list(Path(text).read_bytes()), dtype=torch.long)
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
    from planner.profiler import resolve_model
    model, inputs, _, cfg, _ = resolve_model(spec, batch, seq, dtype, device)
    if ":" in spec and not spec.endswith((".yaml", ".yml")):
        vocab = getattr(getattr(model, "config", None), "vocab_size", None) or 256
        if hasattr(model, "config") and hasattr(model.config, "use_cache"):
            model.config.use_cache = False      # a KV cache has no place in training
        return model, int(vocab), False
    return model, int(cfg["vocab_size"]), True


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
    ap.add_argument("--report-out", help="save the measured report (JSON) here")
    args = ap.parse_args(argv)
    try:
        torch.manual_seed(0)
        model, vocab, shifted = _build(args.model, args.batch, args.seq, args.dtype, args.device)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        handle = None
        if args.plan:
            from runtime import apply_plan
            handle = apply_plan(model, args.plan, optimizer=opt, nvme_dir=args.nvme_dir)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(1, args.steps))
        data = _batches(vocab, args.batch, args.seq, args.text, args.device)
        K = max(1, args.micro_batches)
        for step in range(args.steps):
            total = 0.0
            for _ in range(K):
                ids, labels = next(data)
                out = model(input_ids=ids, labels=labels if shifted else ids)
                (out.loss / K).backward()
                total += out.loss.item() / K
            if args.clip is not None:
                # through the handle: a plan may keep some gradients on disk
                (handle.clip_grad_norm_ if handle else
                 lambda m: torch.nn.utils.clip_grad_norm_(model.parameters(), m))(args.clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            print(f"step {step + 1}/{args.steps}  loss {total:.4f}", flush=True)
        if handle is not None:
            rep = handle.report()
            print(rep)
            if args.report_out:
                print(f"report written to {rep.save(args.report_out)}")
            handle.remove()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
