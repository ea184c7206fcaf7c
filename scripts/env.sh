# Creates or reuses the project's virtual environment and installs what it needs.
# Sourced by scripts/train.sh and scripts/test.sh; safe to run again (it skips work already done).
#   VENV=path   where the environment lives (default: .venv in the project root)
#   EXTRAS=...  pip extras to install (default: dev)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
EXTRAS="${EXTRAS:-dev}"
PY="${PYTHON:-python3}"

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating virtual environment in $VENV"
  "$PY" -m venv "$VENV"
fi
# Re-install only when the package's requirements or the requested extras changed.
stamp="$VENV/.ds_adabatch-$(cat "$ROOT/setup.py" | sha1sum | cut -c1-12)-$EXTRAS"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing torch 2.13.0 (CPU build where no GPU wheel is wanted) and ds_adabatch[$EXTRAS]"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
  # torch first and pinned: an unpinned torch pulled in by deepspeed would fetch the CUDA build.
  "$VENV/bin/python" -m pip install --quiet "torch==2.13.0"
  "$VENV/bin/python" -m pip install --quiet -e "$ROOT[$EXTRAS]"
  rm -f "$VENV"/.ds_adabatch-*
  touch "$stamp"
fi
export PATH="$VENV/bin:$PATH"
# No GPU here: DeepSpeed's CPU accelerator (gloo). A machine with CUDA keeps DeepSpeed's own choice.
if ! "$VENV/bin/python" -c "import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  export DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}"
fi
