#!/usr/bin/env bash
# Installs what the test suite needs (CPU torch first, so nothing pulls CUDA wheels), then runs it.
# Usage: bash tests/run_tests.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
python - <<'PY' || pip install --quiet "torch==2.13.0"
import importlib.util, sys
sys.exit(0 if importlib.util.find_spec("torch") else 1)
PY
pip install --quiet -e ".[test]"
# The suite runs on TEST_WORKERS pytest-xdist workers (default 2; 0: in this process), one intra-op thread each;
# tests/conftest.py keeps each module, and each of the layout suite's spawns, on one worker.
workers="${TEST_WORKERS:-2}"
if [ "$workers" != 0 ]; then
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
    exec python -m pytest -q -n "$workers" --dist loadgroup "$@"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
exec python -m pytest -q "$@"
