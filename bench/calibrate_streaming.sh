#!/usr/bin/env bash
# The calibration loop of docs/planning-loop.md on a layer-streaming plan: the built-in GPT of
# bench/streaming.py profiled on this CPU, planned at static state / 4.2 (every unit's tensors
# on the disk tier), trained, calibrated from the run's report (unit times and the NVMe
# bandwidths the run's I/O achieved), re-planned and trained again. Prints predicted against
# measured median step (steps 2-6) for both plans and each run's disk rates; with --buffered
# the runs read and write their files through the page cache (TIERPLAN_NVME_IO=buffered).
# A model file as an argument replaces the GPT (bench/models/llama-stream.yaml: the LLaMA).
# Run it on a quiet host.
set -euo pipefail
R=$(cd "$(dirname "$0")/.." && pwd); P=$R/.venv/bin/python; PLAN=$R/.venv/bin/plan
M=$R/bench/models/gpt-stream.yaml
for a in "$@"; do
  case "$a" in
    --buffered) export TIERPLAN_NVME_IO=buffered ;;
    *.yaml|*.yml) M=$(cd "$(dirname "$a")" && pwd)/$(basename "$a") ;;
    *) echo "usage: $0 [--buffered] [MODEL.yaml]" >&2; exit 2 ;;
  esac
done
D=$(mktemp -d); trap 'rm -rf "$D"' EXIT; cd "$D"
ARGS=(--batch 2 --seq 64 --dtype fp32)
$PLAN profile "$M" "${ARGS[@]}" --device cpu -o prof.json >/dev/null
BUDGET=$($P -c "import json; L=json.load(open('prof.json'))['layers']; print(int(sum(u['param_bytes']+u['grad_bytes']+u['optimizer_bytes'] for u in L)/4.2))")
SOLVE=(--gpu-mem "$BUDGET" --nvme-mem 50G --micro-batches 2 --nvme-dir "$D/nvme" --optimizer-overlap off)
$PLAN solve prof.json "${SOLVE[@]}" -o p1.json | tail -1
$P "$R/examples/train.py" --model "$M" "${ARGS[@]}" --micro-batches 2 --steps 6 --plan p1.json --report-out r1.json >/dev/null
$PLAN calibrate prof.json --report r1.json -o cal.json | tail -1
$PLAN solve cal.json "${SOLVE[@]}" -o p2.json | tail -1
$P "$R/examples/train.py" --model "$M" "${ARGS[@]}" --micro-batches 2 --steps 6 --plan p2.json --report-out r2.json >/dev/null
$P - <<'PY'
import json, statistics
for r in ("r1.json", "r2.json"):
    d = json.load(open(r))
    med = statistics.median(s["step_s"] for s in d["steps"][1:])
    pred = d["predicted"]["step_s"]
    links = {k: f"{v['bytes_per_s'] / 1e9:.2f} GB/s" for k, v in sorted(d["measured_links"].items())
             if v["bytes_per_s"]}
    print(f"{r}: predicted {pred:.3f} s, measured median {med:.3f} s, "
          f"(predicted - measured) / measured {pred / med - 1:+.1%}; {d.get('nvme_io') or '-'}; {links}")
PY
