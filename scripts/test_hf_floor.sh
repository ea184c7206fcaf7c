#!/usr/bin/env bash
# The Hugging Face Trainer tests on the oldest transformers the integration accepts (setup.py's floor),
# in a second virtual environment beside the project's: bash scripts/test_hf_floor.sh [pytest options...]
# scripts/test.sh runs them on the newest release; this runs the same tests on transformers 5.18.0.
# Fails when a test fails and when no test ran.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FLOOR="transformers==5.18.0"
export VENV="${HF_FLOOR_VENV:-$ROOT/.venv-hf-floor}"
EXTRAS=dev source "$ROOT/scripts/env.sh"
floor_stamp="$VENV/.floor-${FLOOR}"
if [ ! -f "$floor_stamp" ]; then
  echo "[setup] installing $FLOOR into $VENV"
  "$VENV/bin/python" -m pip install --quiet "$FLOOR"
  touch "$floor_stamp"
fi
cd "$ROOT"
python -c "import transformers; assert transformers.__version__ == '${FLOOR#*==}', transformers.__version__; print('[floor] transformers', transformers.__version__)"
# scripts/test.sh runs pytest in the environment VENV names (and fails when no test ran).
exec bash "$ROOT/scripts/test.sh" tests/test_hf_versions.py tests/test_hf_config.py tests/test_hf_trainer.py \
  tests/test_hf_clm_script.py tests/test_hf_step_collectives.py "$@"
