#!/usr/bin/env bash
# The goodput checks that need one CUDA GPU, in one go (about 7 minutes on an H200):
#   1. a smoke run of time_to_target.py on the GPU (bf16, ZeRO 2), which stops the script if it fails;
#   2. the GPU time-to-target sweep (issue: goodput), policies in turns: fixed 32/64/128/256, linear, goodput,
#      goodput-adascale (goodput with lr_scaling "adascale");
#   3. what a steady goodput step costs against a constant batch of the same size, with and without its
#      noise splits, and a linear ramp's (goodput_step_cost.py on the GPU model at batch 256).
# SEED (default 0) sets the sweep's data order and initial weights. Opt-in (each adds device time):
# EXTRA_POLICIES="goodput-adascale-1 goodput-pollux" adds policies to the sweep; ALLOC_CHECK=1
# runs step 3 again under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (on one H200 a new batch size
# cost ~101 ms once, ~84 ms under it: the caching allocator's growth is about a sixth, BENCHMARKS.md).
# (benchmarks/host_cost.py --model large builds DeepSpeed's FusedAdam, whose JIT build in DeepSpeed 0.19.8
# cannot parse a TORCH_CUDA_ARCH_LIST entry such as "9.0a": run it with that variable set to e.g. "9.0".)
#
#   bash benchmarks/gpu_goodput.sh [OUT]      # OUT: where the logs and results go (default gpu_goodput_out)
#   SKIP_SMOKE=1 SEED=2 TRAIN_SECONDS=30 bash benchmarks/gpu_goodput.sh OUT   # no smoke run, another seed
#
# Wheels in .whl/ (deepspeed, pydantic, hjson, ...) are installed into /tmp/site first where the machine
# cannot reach a package registry; elsewhere install the project as the README says.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-gpu_goodput_out}}"
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/site:$PWD"
fi
export PYTHONUNBUFFERED=1 DS_ACCELERATOR=cuda TOKENIZERS_PARALLELISM=false
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch, deepspeed, pydantic, transformers as t; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', t.__version__, 'cuda', torch.cuda.is_available())"
    nproc
} 2>&1 | tee "$OUT/env.txt"

if [ -z "${SKIP_SMOKE:-}" ]; then
echo "== smoke: one goodput policy in this process, its output shown"
timeout 150 python3 benchmarks/time_to_target.py --device cuda --smoke --policy goodput --out /tmp/ttt_smoke >"$OUT/smoke.log" 2>&1
code=$?
tail -n 30 "$OUT/smoke.log"
[ "$code" = 0 ] || { echo "smoke failed ($code)"; exit 1; }
fi

echo "== time to target"
timeout "${TTT_TIMEOUT:-360}" python3 benchmarks/time_to_target.py --device cuda --seconds "${TRAIN_SECONDS:-35}" \
    --seed "${SEED:-0}" --interleave \
    --only fixed-32 fixed-64 fixed-128 fixed-256 linear goodput goodput-adascale ${EXTRA_POLICIES:-} --out /tmp/ttt 2>&1 | tee "$OUT/time_to_target.log"
cp /tmp/ttt/results.json "$OUT/time_to_target.json" 2>/dev/null
cp /tmp/ttt/time_to_target.png "$OUT/" 2>/dev/null

echo "== goodput step cost"
timeout "${STEP_COST_TIMEOUT:-150}" python3 benchmarks/goodput_step_cost.py --device cuda --model gpu --batch 256 \
    --rounds 12 --steps 10 2>&1 | grep -v '^\[ds_adabatch\]' | tee "$OUT/goodput_step_cost.log"
if [ -n "${ALLOC_CHECK:-}" ]; then
    echo "== goodput step cost, expandable segments"
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${STEP_COST_TIMEOUT:-150}" python3 benchmarks/goodput_step_cost.py \
        --device cuda --model gpu --batch 256 --rounds 12 --steps 10 2>&1 | grep -v '^\[ds_adabatch\]' \
        | tee "$OUT/goodput_step_cost_expandable.log"
fi
date -u
