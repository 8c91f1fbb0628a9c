"""The anchors' tables on their own machines: what tierplan predicts beside what they measured.

LoHan (RC4ML/LoHan ``evaluation_data.md``; arXiv:2403.06504) on its testbed, spec
``lohan-4090`` (one RTX 4090, 768 GB DDR4, 12 x D7-P5510 in RAID0): a 13B GPT (40 layers,
hidden 5120) at seq 1024 and batch 8/16/32/64, a 175B GPT at batch 8/16, and the 13B batch-32
cell with 1/2/3/6/12 drives. MegaTrain (arXiv:2604.05091) on ``gh200``: a 14B model (Phi-4's
shape, the only 14B config its repository shipped) at batch 96, seq 1024, 264 TFLOPS (issue
25's figure; the paper body was not retrievable, docs/anchors-research.md).

Each cell: the step's batch of sequences split into K micro-batches of b (b from batch / 8 to
the batch), each profiled on the meta device (times estimated from the spec) and solved
batch-major and layer-major as ``plan search`` does, with streaming, the optimizer beside the backward and the clip rule the
system runs (LoHan steps each layer during the backward: ``--clip none``; MegaTrain's config
clips at 1.0: ``global``), then the predicted TFLOPS by the anchors' own formula, 6 x N x
tokens / step. Predictions on spec-sheet numbers, not measurements; nothing is fitted to the
anchors' figures (the spec's efficiency has its own source).

    python bench/anchors.py                     # every cell, 120 s each
    python bench/anchors.py --cells lohan-13b-bs32 --time-limit 30
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]

from planner.formats import Budgets, with_nvme_drives  # noqa: E402
from planner.hardware import load_hardware  # noqa: E402
from planner.sizes import parse_size  # noqa: E402
from planner.solve import default_solver, solve_profile  # noqa: E402

warnings.filterwarnings("ignore", category=DeprecationWarning)

# LoHan's models (its repository's model table, docs/anchors-research.md): GPT-2 style,
# vocabulary 50257, FFN 4 x hidden, tied embeddings.
GPT = """\
name: {name}
family: gpt
n_layers: {layers}
d_model: {hidden}
n_heads: {heads}
d_ff: {ffn}
vocab_size: 50257
max_seq: 1024
dropout: 0.0
norm_eps: 1.0e-5
tie_embeddings: true
dtype: bf16
"""
# Phi-4 (huggingface.co/microsoft/phi-4 config.json): 40 layers, hidden 5120, 40 heads, 10
# key/value heads, intermediate 17920, vocabulary 100352, untied.
PHI4 = """\
name: phi4-14b
family: llama
n_layers: 40
d_model: 5120
n_heads: 40
n_kv_heads: 10
d_ff: 17920
vocab_size: 100352
max_seq: 1024
rope_theta: 250000.0
norm_eps: 1.0e-5
tie_embeddings: false
dtype: bf16
"""
MODELS = {
    "lohan-13b": GPT.format(name="lohan-13b", layers=40, hidden=5120, heads=40, ffn=20480),
    "lohan-175b": GPT.format(name="lohan-175b", layers=96, hidden=12288, heads=96, ffn=49152),
    "phi4-14b": PHI4,
}


@dataclasses.dataclass(frozen=True)
class Cell:
    key: str
    model: str
    batch: int
    hardware: str
    gpu: str
    cpu: str
    nvme: str
    clip: str
    anchor: float            # the anchor's measured TFLOPS (6NT)
    source: str
    drives: int | None = None


def _cells() -> list[Cell]:
    src = "LoHan evaluation_data.md"
    out = [Cell(f"lohan-13b-bs{b}", "lohan-13b", b, "lohan-4090", "24G", "768G", "40T", "none",
                t, f"{src}, Fig. 5(a)/7(a)") for b, t in ((8, 42.8), (16, 84.3), (32, 143.1),
                                                          (64, 155.8))]
    out += [Cell(f"lohan-175b-bs{b}", "lohan-175b", b, "lohan-4090", "24G", "768G", "40T",
                 "none", t, f"{src}, Fig. 7(b)") for b, t in ((8, 52.6), (16, 86.9))]
    out += [Cell(f"lohan-13b-bs32-ssd{n}", "lohan-13b", 32, "lohan-4090", "24G", "768G",
                 f"{max(4, 4 * n)}T", "none", t, f"{src}, Fig. 10(b)", drives=n)
            for n, t in ((1, 37.5), (2, 64.3), (3, 81.1), (6, 121.7), (12, 142.0))]
    out.append(Cell("megatrain-14b", "phi4-14b", 96, "gh200", "95G", "480GB", "0", "global",
                    264.0, "issue 25 (MegaTrain arXiv:2604.05091; unverified)"))
    return out


def run(cell: Cell, args, tmp: Path, profiles: dict) -> dict:
    """The cell's fastest plan over micro-batch sizes b (powers of two from batch / 8 to the
    batch, K = batch / b) and both micro-batch orders, the time limit shared among them
    (``planner.solve.throughput``, what ``plan search`` runs)."""
    from planner.profile import profile_model
    from planner.solve.throughput import candidates, fastest, search
    hw = load_hardware(cell.hardware)
    if cell.drives is not None:
        hw = with_nvme_drives(hw, cell.drives)
    path = tmp / f"{cell.model}.yaml"
    path.write_text(MODELS[cell.model])

    def profile_at(b):
        if (cell.model, b) not in profiles:
            profiles[cell.model, b] = profile_model(str(path), b, 1024, device="meta",
                                                    hardware=hw)
        return profiles[cell.model, b]
    b = Budgets(parse_size(cell.gpu, "--gpu-mem"), parse_size(cell.cpu, "--cpu-mem"),
                parse_size(cell.nvme, "--nvme-mem"))
    tokens = cell.batch * 1024
    cands = [c for c in candidates(tokens, 1024) if c[0] * 8 >= cell.batch]
    overlap = getattr(args, "optimizer_overlap", "auto")
    if overlap == "paced" and cell.clip != "none":
        overlap = "auto"          # paced needs --clip none: a cell that clips keeps its own
    kw = dict(policy="optimal", solver=args.solver, gap=0.005, clip=cell.clip,
              micro_batch_order="auto", nvme_dir=str(tmp / "nvme"), optimizer_overlap=overlap)
    t0 = time.perf_counter()
    cells = search(profile_at, hw, b, kw, cands, tokens, t0 + args.time_limit)
    best = fastest(cells)
    row = dict(cell=cell, solve_s=time.perf_counter() - t0)
    if best is None:
        row.update(exit=3, msg=cells[-1].status if cells else "no candidate")
        return row
    p = best.plan
    row.update(exit=0, step_s=best.step_s, tflops=best.tflops_6nt, bound=best.bound,
               opt_s=p.predicted.optimizer_s, overlap=p.optimizer_overlap,
               origin=f"b{best.batch}xK{best.K} {best.order}, {p.solver.origin}")
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="", help="comma-separated cell keys (default: all)")
    ap.add_argument("--time-limit", type=float, default=120.0,
                    help="seconds per cell, shared by its micro-batch sizes and orders")
    ap.add_argument("--solver", default=None)
    ap.add_argument("--optimizer-overlap", choices=["auto", "off", "paced"], default="auto",
                    help="as plan solve's (paced: the cells that do not clip; the others auto)")
    args = ap.parse_args(argv)
    args.solver = args.solver or default_solver()
    cells = _cells()
    if args.cells:
        want = set(args.cells.split(","))
        cells = [c for c in cells if c.key in want]
    profiles: dict = {}
    print("| cell | hardware | batch | drives | predicted step | optimizer phase | TFLOPS (6NT) "
          "| anchor TFLOPS | predicted / anchor | busiest resource | plan | solve |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for c in cells:
            r = run(c, args, Path(tmp), profiles)
            drives = c.drives if c.drives is not None else load_hardware(c.hardware).nvme_drives
            if r["exit"]:
                print(f"| {c.key} | {c.hardware} | {c.batch} | {drives or '-'} | exit {r['exit']}: "
                      f"{r['msg'][:80]} | | | {c.anchor} | | | | {r['solve_s']:.0f} s |")
                continue
            print(f"| {c.key} | {c.hardware} | {c.batch} | {drives or '-'} | {r['step_s']:.2f} s "
                  f"| {r['opt_s']:.2f} s | {r['tflops']:.1f} | {c.anchor} | "
                  f"{r['tflops'] / c.anchor:.2f} | {r['bound']} | {r['overlap']}, {r['origin']} "
                  f"| {r['solve_s']:.0f} s |", flush=True)
    print("\nAnchors: " + "; ".join(sorted({f"{c.key.split('-bs')[0]}: {c.source}"
                                            for c in cells})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
