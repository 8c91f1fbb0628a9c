#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU (the lent H200, say): the CUDA tests and the
# fast subset under that machine's own torch, `plan hardware` there, and for three models
# (gpt2-small and gpt2-xl built in, GPT-2 as Hugging Face's GPT2Config() gives it) a measured
# profile (--optimizer adamw-pure: train.py runs torch's AdamW on the parameters as they are),
# a plan under a tight budget, training steps under it with the report (predicted vs
# measured: allocator peak, pinned host bytes, bytes per link, stalls) beside the same steps
# run plainly (--stream off: the runtime streams weights on a CPU host only, so far); then
# FSDP2 on one or two ranks.
# Usage: bash bench/gpu.sh [OUT_DIR]   — everything it writes goes under OUT_DIR/work, and
# OUT_DIR/gpu.tgz packs it (the device tool brings back at most 8 files).
# Each stage has its own time limit, so one that hangs costs only its own slot.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/tierplan-gpu}}
W="${GPU_WORK:-$OUT/work}"
mkdir -p "$W"
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PLAN="$PY -m planner.cli"
T0=$(date +%s)
stage() {   # stage NAME SECONDS CMD...: run CMD under a limit, log it, never stop the script
    local name=$1 lim=$2; shift 2
    echo; echo "== $name  (t=$(( $(date +%s) - T0 )) s, limit ${lim} s)"
    timeout -k 5 "$lim" bash -c "$*"
    local rc=$?
    echo "-- $name: rc=$rc"
}
pack() { tar czf "$OUT/gpu.tgz" -C "$W" . 2>/dev/null; }
trap pack EXIT

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$W/gpu.txt"
$PY -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])" | tee -a "$W/gpu.txt"

stage "measure this host (plan hardware)" 90 "$PLAN hardware --size 1G -o $W/this-gpu.yaml && cat $W/this-gpu.yaml"
if [ -n "${PROMISES_JOBS:-}" ]; then    # the planner's promise check on the idle CPU cores
    echo "== promises part 1 in the background ($PROMISES_JOBS workers)"
    ( timeout -k 5 "${PROMISES_S:-240}" nice -n 19 $PY bench/promises.py --parts 1 --n 400 --t1 10 ${PROMISES_ARGS:-} \
        --jobs "$PROMISES_JOBS" --out "$W/promises.json" > "$W/promises.log" 2>&1 ) &
fi
stage "CUDA tests" 150 "$PY -m pytest -q -rs -p no:cacheprovider tests/test_runtime.py tests/test_distributed.py -k cuda 2>&1 | tee $W/tests-cuda.log | tail -15"
[ -n "${GPU_SKIP_FAST:-}" ] || stage "fast subset under this torch" 150 "$PY -m pytest -q -p no:cacheprovider -m 'not slow' 2>&1 | tee $W/tests-fast.log | tail -8"

one() {   # one TAG MODEL BATCH SEQ FRACTION STEPS: measured profile, plan, plain and planned steps
    local tag=$1 model=$2 b=$3 s=$4 f=$5 n=$6
    stage "$tag: profile $model b=$b s=$s measured on the GPU" 150 \
        "$PLAN profile $model --batch $b --seq $s --device cuda --hardware $W/this-gpu.yaml --optimizer adamw-pure -o $W/$tag-prof.json 2>&1 | tail -3"
    [ -f "$W/$tag-prof.json" ] || return
    local budget
    budget=$($PY -m planner.solve.budget "$W/$tag-prof.json" --fraction "$f")
    stage "$tag: solve at $f of the blocks' activations ($budget B), host 64G" 90 \
        "$PLAN solve $W/$tag-prof.json --gpu-mem $budget --cpu-mem 64G --time-limit 40 --stream off -o $W/$tag-plan.json 2>&1 | tail -4 && $PLAN inspect $W/$tag-plan.json | head -25"
    stage "$tag: $n steps plainly" 120 \
        "$PY examples/train.py --model $model --batch $b --seq $s --steps $n --device cuda 2>&1 | tail -2"
    [ -f "$W/$tag-plan.json" ] || return
    stage "$tag: $n steps under the plan" 150 \
        "$PY examples/train.py --model $model --batch $b --seq $s --steps $n --device cuda --plan $W/$tag-plan.json --report-out $W/$tag-report.json 2>&1 | tail -4 && $PLAN inspect $W/$tag-plan.json --report $W/$tag-report.json | tail -22"
}
for m in ${GPU_MODELS:-small hfgpt2 xl}; do   # GPU_MODELS: a subset, to rerun some
    case $m in
        small) one small gpt2-small 8 1024 0.4 8 ;;
        hfgpt2) one hfgpt2 examples.hf_models:gpt2_default 8 1024 0.4 8 ;;
        xl) one xl gpt2-xl 8 1024 0.4 6 ;;
    esac
done

NGPU=$(nvidia-smi -L | wc -l)
RANKS=$(( NGPU >= 2 ? 2 : 1 ))
# the shipped spec: plan hardware does not measure the interconnect (intra/inter-node bandwidth)
stage "FSDP2 under torchrun on $RANKS rank(s) (NCCL)" 150 \
    "$PLAN profile gpt2-small --batch 4 --seq 1024 --device meta --hardware h200 -o $W/prof-rank.json && $PLAN solve $W/prof-rank.json --gpu-mem 6G --cpu-mem 64G --world-size $RANKS --engine fsdp2 -o $W/plan-fsdp2.json 2>&1 | tail -2 && $PY -m torch.distributed.run --nproc-per-node $RANKS examples/train.py --fsdp --model gpt2-small --batch 4 --seq 1024 --steps 4 --device cuda --plan $W/plan-fsdp2.json --report-out $W/report-fsdp2.json 2>&1 | tail -30"
wait
[ -f "$W/promises.log" ] && { echo "== promises (background)"; tail -30 "$W/promises.log"; }
echo "== done in $(( $(date +%s) - T0 )) s"
