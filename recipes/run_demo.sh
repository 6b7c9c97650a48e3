#!/usr/bin/env bash
# The CPU demo end to end: installs dit-mcore (CPU torch first), then trains a small class-conditional
# DiT on scikit-learn's handwritten digits. Sample grids land in runs/digits/samples/.
# Usage: bash recipes/run_demo.sh [overrides, e.g. trainer.max_steps=200 log.dir=/tmp/run]
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY' || pip install --quiet "torch==2.13.0"
import importlib.util, sys
sys.exit(0 if importlib.util.find_spec("torch") else 1)
PY
pip install --quiet -e .
exec python recipes/pretrain_xl.py --yes --factory pretrain_digits "$@"
