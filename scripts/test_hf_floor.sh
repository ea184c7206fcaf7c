#!/usr/bin/env bash
# The Hugging Face Trainer tests on the older transformers releases setup.py accepts, each in a virtual
# environment beside the project's: bash scripts/test_hf_floor.sh [RELEASE...] [-- pytest options...]
# scripts/test.sh runs every test on the newest release; this runs a focused suite on each release of
# DEFAULT_RELEASES (docs/versions.md says why these), or on the releases given:
# - 4.57.6, the floor (the last 4.x; ds_adabatch/integrations/hf/compat.py plugs into its one-function
#   training loop): the version checks, the single-process Trainer tests, the ZeRO-2 launch's
#   exactness, resume and JSONL checks, the run_clm.py-shaped script under ZeRO-2, TRL's trainers
#   composed with it, and two clients' own scripts: accelerate's deepspeed_with_config_support.py on two
#   ranks against a big-batch reference and its checkpoint resumed on one process, and DeepSpeed-Chat's
#   step-1 main.py on two ranks (tests/test_accelerate.py; its one-process ZeRO-3 comparison with
#   accelerate's own prepare and its refusals run on the newest release);
# - 5.0.0 and 5.2.0 (the first and last release of 5.x's one-function loop) and 5.3.0 and 5.17.0 (the
#   first and last release of the split loop that still needs the plain Trainer's two fixes,
#   hf/compat.py's PlainTrainerFixes): the version checks, the loop and fix checks and the Trainer's
#   one-process tests, and the two DDP launches: tests/hf_worker.py's (the seed's schedule with a
#   checkpoint resumed on 2 ranks, whose optimizer the plain Trainer of these releases cannot load, and
#   on 1; one step split several ways; three kinds of model, against plain PyTorch) and the
#   run_clm.py-shaped script's (the JSONL against the Trainer's logs, the banner, the checkpoint's
#   stream). Their DeepSpeed launches cost 2-3 minutes each; they ran once (docs/versions.md).
# Fails when a test fails and when no test ran.
#
# Each environment is layered on the project's: it holds that transformers (and what the release needs
# in other versions: 4.57 huggingface_hub 0.x, tokenizers 0.22 and a datasets that reads with them; 5.0-5.17
# huggingface_hub 1.x) and reads everything else — torch, DeepSpeed and its compiled ops, accelerate,
# TRL, this package — from .venv, through a .pth file. So the environments differ in exactly what each
# run is about, and each costs one pip install (kept: a second run installs nothing).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEFAULT_RELEASES=(4.57.6 5.0.0 5.2.0 5.3.0 5.17.0)
releases=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  releases+=("$1")
  shift
done
[ "${1:-}" = "--" ] && shift
[ ${#releases[@]} -gt 0 ] || releases=("${DEFAULT_RELEASES[@]}")

# The project's environment first (created or updated as scripts/test.sh does).
VENV="$ROOT/.venv" EXTRAS=dev source "$ROOT/scripts/env.sh"
main_stamp="$(basename "$stamp")"
main_site="$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cd "$ROOT"

# The floor's suite: the Trainer's multi-rank checks run on the ZeRO-2 launches only (-k leaves out the
# tests of the ZeRO-3 and DDP launches, by parameter or by the fixture's test), and accelerate's example
# on its two-rank launches (-k leaves out its one-process ZeRO-3 comparison and the refusals); the newest
# release runs all of them (scripts/test.sh).
FLOOR_SKIP="zero3 or ddp or two_rank_checkpoint_resumes_on_one_process or quiet_log_level or micro_batches_of_one \
or constant_batch_matches_accelerate or refusals_are_sentences"
FLOOR_SUITE=(tests/test_hf_versions.py tests/test_hf_compat.py tests/test_hf_config.py tests/test_hf_trainer.py
  tests/test_hf_clm_script.py tests/test_trl.py tests/test_accelerate.py -k "not ($FLOOR_SKIP)")
# The other releases' suite: the DDP launches and the one-process checks.
RELEASE_KEEP="test_hf_versions or test_hf_compat or ddp or two_rank_checkpoint or micro_batches_of_one or \
single_process or max_steps or drop_last or fractional or tokens_seen or resume_at_an_epoch or resume_needs"
RELEASE_SUITE=(tests/test_hf_versions.py tests/test_hf_compat.py tests/test_hf_trainer.py tests/test_hf_clm_script.py
  -k "$RELEASE_KEEP")

summary=()
# What release $1 runs with (with), in which environment (venv) and which tests (suite).
describe() {
  if [ "${1%%.*}" = 4 ]; then
    # transformers 4.57 needs huggingface_hub < 1, and the newest datasets (read from .venv) needs hub
    # >= 1.31: the floor takes the last datasets release that runs on hub 0.x (5.0), in its own layer.
    with=("transformers==$1" "datasets>=3,<5.1")
    venv="${HF_FLOOR_VENV:-$ROOT/.venv-hf-floor}"
    suite=("${FLOOR_SUITE[@]}")
  else
    with=("transformers==$1")
    venv="$ROOT/.venv-hf-$1"
    suite=("${RELEASE_SUITE[@]}")
  fi
}
prepare() { # makes release $1's environment and installs into it, unless that was done
  local with venv suite site_dir layer_stamp
  describe "$1"
  if [ ! -x "$venv/bin/python" ]; then
    echo "[hf] creating the transformers $1 environment in $venv (layered on $ROOT/.venv)"
    "${PYTHON:-python3}" -m venv "$venv"
  fi
  site_dir="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # addsitedir also reads the .pth files there (the editable install of this package is one of them).
  echo "import site; site.addsitedir('$main_site')" >"$site_dir/ds_adabatch_layered_on_project_venv.pth"
  layer_stamp="$venv/.floor-$(echo "${with[*]}" | sha1sum | cut -c1-12)-${main_stamp}"
  if [ ! -f "$layer_stamp" ]; then
    echo "[hf] installing ${with[*]} into $venv"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${with[@]}"
    rm -f "$venv"/.floor-* "$venv"/.ds_adabatch-*
    touch "$layer_stamp"
    # scripts/test.sh's env.sh finds the project installed (through the layer) and installs nothing more.
    touch "$venv/$main_stamp"
  fi
}
# While one release's tests run, the next release's environment is installed beside them (pip waits on
# the network, the tests on the CPU).
pending=""
trap '[ -z "$pending" ] || { pkill -P "$pending" 2>/dev/null; kill "$pending" 2>/dev/null; } || true' EXIT
failed=0
for i in "${!releases[@]}"; do
  release="${releases[$i]}"
  began=$SECONDS
  [ -n "$pending" ] || { prepare "$release" & pending=$!; }
  if ! wait "$pending"; then
    pending=""
    echo "error: could not install transformers $release (above)" >&2
    exit 1
  fi
  pending=""
  installed=$((SECONDS - began))
  following="${releases[$((i + 1))]:-}"
  if [ -n "$following" ]; then
    prepare "$following" &
    pending=$!
  fi
  describe "$release"
  "$venv/bin/python" -c "import transformers; assert transformers.__version__ == '$release', transformers.__version__; print('[hf] transformers', transformers.__version__, 'from', transformers.__file__)"
  began=$SECONDS
  set +e
  # scripts/test.sh runs pytest in the environment VENV names (and fails when no test ran).
  VENV="$venv" bash "$ROOT/scripts/test.sh" "${suite[@]}" "$@"
  rc=$?
  set -e
  [ $rc -eq 0 ] || failed=1
  summary+=("transformers $release: exit $rc (install ${installed}s waited for, tests $((SECONDS - began))s)")
done
printf '[hf] %s\n' "${summary[@]}"
exit $failed
