#!/usr/bin/env bash
# bench/plans_snapshot.sh TREE OUT: write the plans a behaviour-preserving change must leave
# alone, from the checkout TREE (its planner on PYTHONPATH, the python on PATH), into OUT:
#   golden/    the golden plans' recipe (tests/golden.py)
#   quality/   bench/quality.py --time-limit 20 (gpt2-xl, llama3-8b at three budgets)
#   capacity/  bench/capacity.py --time-limit 30 on four cases
#   cli/       plan profile + plan solve: every --policy at 2G and 3.5G, streaming with K=4,
#              four ranks, and one exit 3 message
# Compare two snapshots with bench/plans_compare.py A B. Solves that end at their time limit
# depend on the host's speed: snapshot the old tree twice to see that noise.
set -euo pipefail
R=$(cd "$1" && pwd); O=$2; mkdir -p "$O"/golden "$O"/quality "$O"/capacity "$O"/cli
O=$(cd "$O" && pwd)
cd "$R"; export PYTHONPATH=$R
python tests/golden.py "$O/golden" > /dev/null
python bench/quality.py --time-limit 20 --save-plans "$O/quality" > "$O/quality.txt" 2>&1
python bench/capacity.py --time-limit 30 --save-plans "$O/capacity" \
    --cases llama3-8b/4090/k1,llama3-8b/a100/off,llama2-13b/h200/k1,gpt3-175b/a100/k1 \
    > "$O/capacity.txt" 2>&1
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
python -m planner.cli profile gpt2-small --batch 4 --seq 256 --device meta --hardware a100-80g \
    -o "$T/g.json" > /dev/null 2>&1
solve() { local name=$1; shift
  python -m planner.cli solve "$T/g.json" --time-limit 20 -o "$O/cli/$name.json" "$@" \
      > /dev/null 2>&1 || echo "$name exit $?" >> "$O/cli/exits.txt"; }
for pol in keep-all recompute-all sqrt offload-all remat-only optimal; do
  solve "gpt2-$pol" --gpu-mem 2G --cpu-mem 64G --policy $pol
  solve "gpt2-3.5G-$pol" --gpu-mem 3.5G --cpu-mem 64G --policy $pol
done
solve gpt2-stream-k4 --gpu-mem 1G --cpu-mem 64G --nvme-mem 100G --micro-batches 4 --stream on
solve gpt2-ws4 --gpu-mem 2G --cpu-mem 64G --world-size 4
python -m planner.cli solve "$T/g.json" --gpu-mem 100M --cpu-mem 64G --time-limit 20 \
    -o "$O/cli/nofit.json" > "$O/cli/nofit.txt" 2>&1 || echo "nofit exit $?" >> "$O/cli/exits.txt"
