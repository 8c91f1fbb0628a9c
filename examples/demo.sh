#!/usr/bin/env bash
# The main job on the built-in default, on this CPU: profile gpt-tiny (times measured here),
# solve a plan whose GPU budget holds only half of the blocks' activations (so the planner
# must recompute or offload to the local disk), inspect it, and train 3 steps replaying it.
# Outputs go to $OUT_DIR (default: profiles/ and plans/ of this checkout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PLAN=${PLAN_CMD:-.venv/bin/plan}
OUT_DIR=${OUT_DIR:-.}
MODEL=${MODEL:-gpt-tiny}; BATCH=${BATCH:-8}; SEQ=${SEQ:-256}
PROFILE="$OUT_DIR/profiles/$MODEL-b$BATCH-s$SEQ.json"
PLANFILE="$OUT_DIR/plans/$MODEL-demo.json"
NVME_DIR=${NVME_DIR:-$OUT_DIR/tierplan-nvme}

echo "== plan profile: measure $MODEL (batch $BATCH, seq $SEQ) on this CPU"
"$PLAN" profile "$MODEL" --batch "$BATCH" --seq "$SEQ" --dtype fp32 --device cpu --hardware cpu-host -o "$PROFILE"
# The budget: static state + embedding + head + workspace + half of the blocks' activations.
BUDGET=$("$PY" -m planner.solve.budget "$PROFILE" --fraction 0.5)
echo "== plan solve: GPU budget $BUDGET bytes (half of the blocks' activations), 1G on disk"
"$PLAN" solve "$PROFILE" --gpu-mem "$BUDGET" --nvme-mem 1G --nvme-dir "$NVME_DIR" -o "$PLANFILE"
echo "== plan inspect"
"$PLAN" inspect "$PLANFILE"
echo "== train 3 steps replaying the plan"
# A fixed glibc mmap threshold makes freed tensors leave RSS at once, so the report's measured
# peak follows the live tensors (docs/runtime.md, "The report").
MALLOC_MMAP_THRESHOLD_=65536 "$PY" examples/train.py --model "$MODEL" --batch "$BATCH" --seq "$SEQ" --dtype fp32 --steps 3 --plan "$PLANFILE"
