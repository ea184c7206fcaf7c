#!/usr/bin/env bash
# The Hugging Face Trainer tests on the oldest transformers the integration accepts (setup.py's floor),
# in a second virtual environment beside the project's: bash scripts/test_hf_floor.sh [pytest options...]
# scripts/test.sh runs every test on the newest release; this runs a focused suite on transformers
# 4.57.6 (the last 4.x, whose one-function training loop ds_adabatch/integrations/hf/compat.py plugs
# into): the version checks, the single-process Trainer tests, the ZeRO-2 launch's exactness, resume and
# JSONL checks, the run_clm.py-shaped script under ZeRO-2, and TRL's trainers composed with it.
# Fails when a test fails and when no test ran.
#
# The floor environment is layered on the project's: it holds transformers 4.57.6 (and what that release
# needs in other versions: huggingface_hub 0.x, tokenizers 0.22, a datasets that reads with them) and
# reads everything else — torch, DeepSpeed and its compiled ops, accelerate, TRL, this package — from
# .venv, through a .pth file. So the two environments differ in exactly what the floor run is about,
# and the second one costs one pip install.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FLOOR="transformers==4.57.6"
# transformers 4.57 needs huggingface_hub < 1, and the newest datasets (read from .venv) needs hub >= 1.31:
# the floor takes the last datasets release that runs on hub 0.x (5.0), in its own layer.
FLOOR_WITH=("$FLOOR" "datasets>=3,<5.1")
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
floor_stamp="$FLOOR_VENV/.floor-${FLOOR}-datasets5.0-${main_stamp}"
if [ ! -f "$floor_stamp" ]; then
  echo "[setup] installing $FLOOR into $FLOOR_VENV"
  "$FLOOR_VENV/bin/python" -m pip install --quiet "${FLOOR_WITH[@]}"
  rm -f "$FLOOR_VENV"/.floor-* "$FLOOR_VENV"/.ds_adabatch-*
  touch "$floor_stamp"
  # scripts/test.sh's env.sh finds the project installed (through the layer) and installs nothing more.
  touch "$FLOOR_VENV/$main_stamp"
fi
cd "$ROOT"
export VENV="$FLOOR_VENV"
"$VENV/bin/python" -c "import transformers; assert transformers.__version__ == '${FLOOR#*==}', transformers.__version__; print('[floor] transformers', transformers.__version__, 'from', transformers.__file__)"
# scripts/test.sh runs pytest in the environment VENV names (and fails when no test ran).
# The focused suite: the multi-rank checks run on the ZeRO-2 launches only (-k leaves out the tests of
# the ZeRO-3 and DDP launches, by parameter or by the fixture's test); the newest release runs all
# of them (scripts/test.sh).
SKIP_LAUNCHES="zero3 or ddp or two_rank_checkpoint_resumes_on_one_process or quiet_log_level or micro_batches_of_one"
exec bash "$ROOT/scripts/test.sh" tests/test_hf_versions.py tests/test_hf_compat.py tests/test_hf_config.py tests/test_hf_trainer.py \
  tests/test_hf_clm_script.py tests/test_trl.py -k "not ($SKIP_LAUNCHES)" "$@"
