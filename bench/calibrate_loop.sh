#!/usr/bin/env bash
# The calibration loop of docs/planning-loop.md in a scratch folder: profile gpt-tiny with one
# core busy, train under its plan, calibrate, re-solve, train again; prints predicted vs
# measured median step (steps 2-6) for both plans. Run it on a quiet host.
set -euo pipefail
R=$(cd "$(dirname "$0")/.." && pwd); P=$R/.venv/bin/python; PLAN=$R/.venv/bin/plan
D=$(mktemp -d); trap 'kill $HOG 2>/dev/null; rm -rf "$D"' EXIT; HOG=; cd "$D"
uptime
python3 -c 'while True: pass' & HOG=$!
$PLAN profile gpt-tiny --batch 8 --seq 256 --dtype fp32 --device cpu -o busy.json >/dev/null
kill $HOG
uptime
$PLAN solve busy.json --gpu-mem 60M --nvme-mem 1G -o p1.json | tail -1
$P $R/examples/train.py --model gpt-tiny --batch 8 --seq 256 --dtype fp32 --steps 6 --plan p1.json --report-out r1.json | tail -3
$PLAN calibrate busy.json --report r1.json -o cal.json | tail -2
$PLAN solve cal.json --gpu-mem 60M --nvme-mem 1G -o p2.json | tail -1
$P $R/examples/train.py --model gpt-tiny --batch 8 --seq 256 --dtype fp32 --steps 6 --plan p2.json --report-out r2.json | tail -3
$P - <<'PY'
import json
for r in ("r1.json", "r2.json"):
    d = json.load(open(r))
    steps = [s["step_s"] for s in d["steps"]][1:]
    steps.sort(); med = steps[len(steps)//2] if len(steps) % 2 else (steps[len(steps)//2-1]+steps[len(steps)//2])/2
    pred = d["predicted"]["step_s"]
    print(r, "predicted", round(pred, 4), "measured median", round(med, 4), "ratio", round(pred / med - 1, 4))
PY
uptime
