#!/usr/bin/env bash
# The Hugging Face Trainer tests on the oldest transformers the integration accepts (setup.py's floor),
# in a second virtual environment beside the project's: bash scripts/test_hf_floor.sh [pytest options...]
# scripts/test.sh runs them on the newest release; this runs the same tests on transformers 5.18.0.
# Fails when a test fails and when no test ran.
#
# The floor environment is layered on the project's: it holds transformers 5.18.0 (and any dependency
# that release needs in another version) and reads everything else — torch, DeepSpeed and its compiled
# ops, accelerate, this package — from .venv, through a .pth file. So the two environments differ in
# exactly what the floor run is about, and the second one costs one pip install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FLOOR="transformers==5.18.0"
FLOOR_VENV="${HF_FLOOR_VENV:-$ROOT/.venv-hf-floor}"
# The project's environment first (created or updated as scripts/test.sh does).
VENV="$ROOT/.venv" EXTRAS=dev source "$ROOT/scripts/env.sh"
main_stamp="$(basename "$stamp")"
main_site="$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ ! -x "$FLOOR_VENV/bin/python" ]; then
  echo "[setup] creating the floor environment in $FLOOR_VENV (layered on $ROOT/.venv)"
  "${PYTHON:-python3}" -m venv "$FLOOR_VENV"
fi
floor_site="$("$FLOOR_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# addsitedir also reads the .pth files there (the editable install of this package is one of them).
echo "import site; site.addsitedir('$main_site')" > "$floor_site/ds_adabatch_layered_on_project_venv.pth"
floor_stamp="$FLOOR_VENV/.floor-${FLOOR}-${main_stamp}"
if [ ! -f "$floor_stamp" ]; then
  echo "[setup] installing $FLOOR into $FLOOR_VENV"
  "$FLOOR_VENV/bin/python" -m pip install --quiet "$FLOOR"
  rm -f "$FLOOR_VENV"/.floor-* "$FLOOR_VENV"/.ds_adabatch-*
  touch "$floor_stamp"
  # scripts/test.sh's env.sh finds the project installed (through the layer) and installs nothing more.
  touch "$FLOOR_VENV/$main_stamp"
fi
cd "$ROOT"
export VENV="$FLOOR_VENV"
"$VENV/bin/python" -c "import transformers; assert transformers.__version__ == '${FLOOR#*==}', transformers.__version__; print('[floor] transformers', transformers.__version__, 'from', transformers.__file__)"
# scripts/test.sh runs pytest in the environment VENV names (and fails when no test ran).
exec bash "$ROOT/scripts/test.sh" tests/test_hf_versions.py tests/test_hf_config.py tests/test_hf_trainer.py \
  tests/test_hf_clm_script.py tests/test_hf_step_collectives.py "$@"
