#!/usr/bin/env bash
# The main job: a byte-level GPT-2 on 2 ranks whose global batch ramps 8 -> 64 (ds_configs/lm_ramp.json).
# Usage: bash scripts/train.sh [--nproc N] [train_lm.py options...]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS=dev source "$ROOT/scripts/env.sh"
nproc=2
if [ "${1:-}" = "--nproc" ]; then nproc="$2"; shift 2; fi
cd "$ROOT"
port=$(python -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
exec python -m torch.distributed.run --nproc-per-node "$nproc" --master-port "$port" \
  runners/train_lm.py --config ds_configs/lm_ramp.json "$@"
