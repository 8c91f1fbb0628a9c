#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU (the lent H200, say): the CUDA tests, a
# measured profile, a plan under a tight budget, and training steps under it with the report
# (predicted vs measured: allocator peak, pinned host bytes, bytes per link, stalls).
# Usage: bash bench/gpu.sh [OUT_DIR]   — everything it writes goes under OUT_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/tierplan-gpu}}
mkdir -p "$OUT"
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
PLAN="$PY -m planner.cli"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
echo "== CUDA tests"
$PY -m pytest -q -rs tests/test_runtime.py tests/test_profiler.py -k "cuda" 2>&1 | tee "$OUT/tests.log"
echo "== measure this host"
$PLAN hardware --size 1G -o "$OUT/this-gpu.yaml" 2>&1 | tail -3
echo "== profile gpt2-small (b=8, s=1024, bf16) measured on the GPU"
$PLAN profile gpt2-small --batch 8 --seq 1024 --device cuda --hardware "$OUT/this-gpu.yaml" -o "$OUT/prof.json"
BUDGET=$($PY -m planner.budget "$OUT/prof.json" --fraction 0.4)
echo "== solve at 40% of the blocks' activations ($BUDGET bytes), host 64G"
$PLAN solve "$OUT/prof.json" --gpu-mem "$BUDGET" --cpu-mem 64G -o "$OUT/plan.json"
$PLAN inspect "$OUT/plan.json" --plot "$OUT/plan.png" | head -30
echo "== train 6 steps under the plan, and plainly"
$PY examples/train.py --model gpt2-small --batch 8 --seq 1024 --steps 6 --device cuda \
    --plan "$OUT/plan.json" --report-out "$OUT/report.json"
$PLAN inspect "$OUT/plan.json" --report "$OUT/report.json" | tail -20
echo "== FSDP2 under torchrun: two ranks where there are two GPUs, else one-rank FSDP2 (NCCL)"
NGPU=$(nvidia-smi -L | wc -l)
RANKS=$(( NGPU >= 2 ? 2 : 1 ))
$PY -m pytest -q -rs tests/test_distributed.py -k "cuda" 2>&1 | tee "$OUT/tests-distributed.log"
# the shipped spec: plan hardware does not measure the interconnect (intra/inter-node bandwidth)
$PLAN profile gpt2-small --batch 4 --seq 1024 --device meta --hardware h200 -o "$OUT/prof-rank.json"
$PLAN solve "$OUT/prof-rank.json" --gpu-mem 6G --cpu-mem 64G --world-size $RANKS \
    --engine fsdp2 -o "$OUT/plan-fsdp2.json"
$PY -m torch.distributed.run --nproc-per-node $RANKS examples/train.py --fsdp --model gpt2-small \
    --batch 4 --seq 1024 --steps 4 --device cuda --plan "$OUT/plan-fsdp2.json" \
    --report-out "$OUT/report-fsdp2.json" 2>&1 | tail -40
