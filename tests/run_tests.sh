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
# Two workers, one intra-op thread each (two each would oversubscribe the 2-core CI machine)
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest -q -n "${TEST_WORKERS:-2}" --dist loadgroup "$@"
