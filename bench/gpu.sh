#!/usr/bin/env bash
# One prepared run for a machine with a CUDA GPU (the lent H200, say), at most 8 minutes:
#   1. the GPU and its torch; `plan hardware` there (the spec the rest plans with);
#   2. the CUDA tests (`-m cuda`: the transfer engine's CUDA backend, streaming and offload on
#      the device) and the recording-backend tests that run the same executor code on the CPU;
#   3. layer streaming on the GPU: bench/streaming.py --device cuda for the built-in GPT and
#      LLaMA and GPT-2 as Hugging Face's GPT2Config() gives it, each at a device budget of its
#      static state / 4.2 (static state >= 4x --gpu-mem), for five schedule families: weights
#      after 3 optimizer steps x 2 micro-batches against plain PyTorch on the same GPU, the
#      allocator's peak against the plan's, the step time against the prediction, files left;
#   4. activation plans on a measured profile (gpt2-small, GPT-2 from GPT2Config()): plain and
#      planned step and peak, measured against predicted (examples/train.py --report-out);
#   5. one table of all of it (bench/gpu_table.py) in OUT/table.md.
# Usage: bash bench/gpu.sh [--dry-run] [OUT_DIR]
#   everything goes under OUT_DIR/work and OUT_DIR/gpu.tgz packs it (the device tool brings
#   back at most 8 files). --dry-run (no GPU needed): every command is printed as it would run
#   on the GPU, then its CPU stand-in runs (cpu-host spec, --device cpu, tiny sizes), so the
#   script is checked end to end here before device time is spent.
# Each stage has its own time limit, so one that hangs costs only its own slot.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
case "${1:-}" in
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --dry-run) DRY=1; shift ;;
    -*) echo "bench/gpu.sh: unknown option $1 (use --dry-run, or --help)" >&2; exit 2 ;;
esac
OUT=${1:-${OUT:-/tmp/tierplan-gpu}}
W="${GPU_WORK:-$OUT/work}"
mkdir -p "$W"
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PLAN="$PY -m planner.cli"
T0=$(date +%s)
# stage NAME SECONDS GPU_CMD [CPU_CMD]: run GPU_CMD under a limit (with --dry-run: print it and
# run CPU_CMD, its stand-in, instead; a stage with no stand-in is only printed); never stops
# the script
stage() {
    local name=$1 lim=$2 gpu=$3 cpu=${4:-}
    echo; echo "== $name  (t=$(( $(date +%s) - T0 )) s, limit ${lim} s)"
    if [ $DRY = 1 ]; then
        echo "   on the GPU: $gpu"
        [ -n "$cpu" ] || { echo "-- $name: printed only (no CPU stand-in)"; return; }
        echo "   CPU stand-in: $cpu"
        gpu=$cpu
    fi
    timeout -k 5 "$lim" bash -c "$gpu"
    local rc=$?
    echo "-- $name: rc=$rc"
    echo "$name	$rc" >> "$W/stages.tsv"
}
pack() { tar czf "$OUT/gpu.tgz" -C "$W" . 2>/dev/null; }
trap pack EXIT
: > "$W/stages.tsv"

if [ $DRY = 1 ]; then DEV=cpu; SPEC=cpu-host; else DEV=cuda; SPEC=$W/this-gpu.yaml; fi

stage "the GPU and its torch" 20 \
    "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee $W/gpu.txt; $PY -c \"import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])\" | tee -a $W/gpu.txt" \
    "$PY -c \"import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])\" | tee $W/gpu.txt"

stage "measure this host (plan hardware)" 40 \
    "$PLAN hardware --size 1G -o $W/this-gpu.yaml && cat $W/this-gpu.yaml" \
    "$PLAN hardware --size 64M -o $W/this-host.yaml | tail -3"

stage "CUDA tests and their CPU twins (recording backend)" 70 \
    "$PY -m pytest -q -rs -p no:cacheprovider -m cuda tests 2>&1 | tee $W/tests-cuda.log | tail -15; $PY -m pytest -q -p no:cacheprovider tests/test_transfer.py 2>&1 | tee $W/tests-transfer.log | tail -3" \
    "$PY -m pytest -q -rs -p no:cacheprovider -m cuda tests 2>&1 | tee $W/tests-cuda.log | tail -3; $PY -m pytest -q -p no:cacheprovider tests/test_transfer.py 2>&1 | tee $W/tests-transfer.log | tail -3"

# layer streaming: on the GPU the five batch-major and layer-major families for two models
# (GPU_STREAM_MODELS=gpt,llama,hf-nanochat adds a Hugging Face model from its default config,
# 3.9 GB of static state; GPU_STREAM_FAMILIES=... adds the layer-major overlap families, which
# the 210 s of this stage were not sized for); the stand-in one model, two families
stage "layer streaming on the device, five schedule families" 210 \
    "$PY bench/streaming.py --device cuda --hardware $SPEC --cpu-mem 64G --models ${GPU_STREAM_MODELS:-gpt,llama} --families ${GPU_STREAM_FAMILIES:-batch-major,layer-major,overlap-none,overlap-global,paced} --json $W/streaming.json 2>&1 | tee $W/streaming.log | tail -25" \
    "$PY bench/streaming.py --models gpt --families batch-major,overlap-global --json $W/streaming.json 2>&1 | tee $W/streaming.log | tail -8"

one() {   # one TAG MODEL BATCH SEQ FRACTION STEPS: measured profile, plan, plain and planned steps
    local tag=$1 model=$2 b=$3 s=$4 f=$5 n=$6
    local cm=gpt-tiny cb=2 cs=64 cn=3     # the CPU stand-in: the same commands on gpt-tiny
    stage "$tag: profile $model b=$b s=$s measured on the device" 35 \
        "$PLAN profile $model --batch $b --seq $s --device cuda --hardware $SPEC --optimizer adamw-pure -o $W/$tag-prof.json 2>&1 | tail -2" \
        "$PLAN profile $cm --batch $cb --seq $cs --device cpu --hardware cpu-host --dtype fp32 -o $W/$tag-prof.json 2>&1 | tail -2"
    [ -f "$W/$tag-prof.json" ] || return
    local budget
    budget=$($PY -m planner.solve.budget "$W/$tag-prof.json" --fraction "$f")
    stage "$tag: solve at $f of the blocks' activations ($budget B), host 64G" 25 \
        "$PLAN solve $W/$tag-prof.json --gpu-mem $budget --cpu-mem 64G --time-limit 30 --stream off -o $W/$tag-plan.json 2>&1 | tail -2" \
        "$PLAN solve $W/$tag-prof.json --gpu-mem $budget --time-limit 30 --stream off -o $W/$tag-plan.json 2>&1 | tail -2"
    stage "$tag: $n steps plainly" 30 \
        "$PY examples/train.py --model $model --batch $b --seq $s --steps $n --device cuda 2>&1 | tee $W/$tag-plain.log | tail -1" \
        "$PY examples/train.py --model $cm --batch $cb --seq $cs --steps $cn --dtype fp32 2>&1 | tee $W/$tag-plain.log | tail -1"
    [ -f "$W/$tag-plan.json" ] || return
    stage "$tag: $n steps under the plan" 35 \
        "$PY examples/train.py --model $model --batch $b --seq $s --steps $n --device cuda --plan $W/$tag-plan.json --report-out $W/$tag-report.json 2>&1 | tail -1" \
        "$PY examples/train.py --model $cm --batch $cb --seq $cs --steps $cn --dtype fp32 --plan $W/$tag-plan.json --report-out $W/$tag-report.json 2>&1 | tail -1"
}
for m in ${GPU_MODELS:-hfgpt2}; do   # GPU_MODELS="small hfgpt2": more of them
    case $m in
        small) one small gpt2-small 8 1024 0.4 6 ;;
        hfgpt2) one hfgpt2 examples.hf_models:gpt2_default 8 1024 0.4 6 ;;
    esac
done

stage "one table" 15 "$PY bench/gpu_table.py $W | tee $OUT/table.md" "$PY bench/gpu_table.py $W | tee $OUT/table.md"
echo "== done in $(( $(date +%s) - T0 )) s"
