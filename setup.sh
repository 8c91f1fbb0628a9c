#!/usr/bin/env bash
# Set up tierplan in ./.venv and (unless --no-demo) run the main job on the built-in default:
# profile gpt-tiny on this CPU, solve a plan under a tight memory budget, inspect it, and
# train a few steps replaying it (activations really go to the local disk and come back).
#
# torch: a torch already importable by python3 (for example a user's CUDA build) is kept —
# the venv sees the system site-packages. Only when none is found do we install the CPU build
# pinned by TORCH_SPEC (default torch==2.13.0).
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv --system-site-packages .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q "${TORCH_SPEC:-torch==2.13.0}"
fi
"$VPY" -m pip install -q -e ".[test]"
[ "${1:-}" = "--no-demo" ] && exit 0
exec bash examples/demo.sh
