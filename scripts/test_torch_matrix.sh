#!/usr/bin/env bash
# The focused suite (the tests marked `matrix`) on each other torch release setup.py accepts, one
# environment per release beside the project's: bash scripts/test_torch_matrix.sh [VERSION...] [-- pytest options]
# With --prepare first (bash scripts/test_torch_matrix.sh --prepare [VERSION...]) it only prepares the
# releases given, by default every release a run tests, in its order (installs each torch, then builds
# DeepSpeed's CPU ops against each, as below), and runs no test; with --install first, it only installs
# each torch: .ci/run installs them this way, at the lowest CPU priority, while the main suite runs (the
# download waits on the network). A release another run is preparing or installing is waited for (a
# lock per release under the cache), then found done.
# scripts/test.sh runs the whole suite on torch 2.13.0 (.venv); this runs the exactness checks of
# tests/test_loop.py (one 2-rank launch and its 1-rank resume) with DeepSpeed's getting-started tutorial
# and its pipeline example beside them, the JIT-build-lock launch of tests/test_op_builds.py and the
# import checks on torch 2.11.0, 2.12.1, 2.14.1 and 2.15.0 (docs/versions.md). Fails when a test fails
# and when no test ran.
#
# Each release's environment is layered on the project's: a virtual environment (.venv-torch-VERSION, no
# packages of its own) whose .pth file puts that torch (with the CUDA packages PyPI's builds depend on; they
# import and run on a CPU-only machine) before .venv's site-packages, from which DeepSpeed, transformers,
# pytest and this package are read. So the environments differ in exactly the torch release.
#
# Cached, per release, under TORCH_MATRIX_CACHE (default ~/.cache/ds_adabatch/torch-matrix), so that a
# second run on the same machine installs and compiles nothing:
#   torch-VERSION/             that torch and its dependencies (pip install --target; 4.7 to 5.4 GB each)
#   torch_extensions-VERSION/  DeepSpeed's JIT-built ops for it (TORCH_EXTENSIONS_DIR; torch's default
#                              directory is shared by every CUDA 13.0 build, which would rebuild each time)
#   op-build-VERSION.log       the output of building DeepSpeed's CPU ops for it (below)
# TORCH_MATRIX_KEEP=0 removes each release's torch after its run (one release on disk at a time).
# While one release's tests run, the next release is prepared beside them: its torch installed (the
# download waits on the network) and DeepSpeed's CPU ops built against it (the communication op and
# FusedAdam, which the release's first launch would otherwise build while its other launches wait);
# with TORCH_MATRIX_KEEP=0 each release is prepared after the previous run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEFAULT_VERSIONS=(2.11.0 2.12.1 2.14.1 2.15.0)
CACHE="${TORCH_MATRIX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ds_adabatch/torch-matrix}"
prepare_only=0
install_only=0  # prepare stops after the install (--install)
if [ "${1:-}" = "--prepare" ] || [ "${1:-}" = "--install" ]; then
  prepare_only=1
  [ "$1" = "--install" ] && install_only=1
  shift
fi
versions=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do
  versions+=("$1")
  shift
done
[ "${1:-}" = "--" ] && shift
if [ ${#versions[@]} -eq 0 ]; then
  versions=("${DEFAULT_VERSIONS[@]}")
fi

# The project's environment first (created or updated as scripts/test.sh does).
VENV="$ROOT/.venv" EXTRAS=dev source "$ROOT/scripts/env.sh"
main_site="$("$ROOT/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$CACHE"
cd "$ROOT"
export DS_ACCELERATOR=cpu OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# DeepSpeed's ops built without debug information, as tests/conftest.py has the tests build them (the
# same compiler command, so that the tests load what the preparation below built).
export CXX="${CXX:-$ROOT/scripts/c++-without-debug-info}"
# PIP_CONSTRAINT: a machine-wide pip constraint capping torch (some images carry one) would refuse the
# newer releases; this install is about exactly the release named.
pip_install=(env PIP_CONSTRAINT=/dev/null "$ROOT/.venv/bin/python" -m pip install --quiet --no-cache-dir
  --disable-pip-version-check --no-warn-conflicts --no-compile)
pending=""  # the pid of the background job preparing a release (install, environment, op build), if one runs
prepare() {  # prepare_unlocked "$1", holding the release's lock: a second run preparing the same
  # release at the same time (.ci/run installs them beside the main suite) waits, then finds it done.
  if command -v flock >/dev/null 2>&1; then
    (
      flock 9
      prepare_unlocked "$1"
    ) 9>"$CACHE/.prepare-$1.lock"
  else
    prepare_unlocked "$1"
  fi
}
prepare_unlocked() {  # installs torch $1 into its layer unless it is there, makes its environment, builds its op
  local version="$1" layer="$CACHE/torch-$1" venv="$ROOT/.venv-torch-$1"
  if [ ! -f "$layer/.installed" ]; then
    echo "[matrix] installing torch $version into $layer"
    rm -rf "$layer"
    "${pip_install[@]}" --target "$layer" "torch==$version" || {
      echo "error: pip could not install torch $version into $layer" >&2
      return 1
    }
    touch "$layer/.installed"
  fi
  [ "$install_only" = 0 ] || return 0
  [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv --without-pip "$venv"
  local site_dir
  site_dir="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  # addsitedir also reads the .pth files there (the editable install of this package is one of them).
  printf "import site; site.addsitedir('%s'); site.addsitedir('%s')\n" "$layer" "$main_site" \
    >"$site_dir/ds_adabatch_torch_layer.pth"
  # DeepSpeed's ops the launches load on the CPU, JIT-built against this torch on first use: the
  # communication op (every launch) and FusedAdam (Adam configs), about 35 s and 55 s on both cores.
  # Built here, so that they are built while the previous release's tests run rather than inside this
  # release's first launch, which loads them as built.
  local ext="$CACHE/torch_extensions-$version" log="$CACHE/op-build-$version.log"
  if ! TORCH_EXTENSIONS_DIR="$ext" "$venv/bin/python" -c "
from deepspeed.accelerator import get_accelerator
for name in ('ShareMemCommBuilder', 'FusedAdamBuilder'):
    get_accelerator().create_op_builder(name).load(verbose=False)
" >"$log" 2>&1; then
    echo "error: DeepSpeed's CPU ops do not build against torch $version (the log: $log):" >&2
    tail -n 30 "$log" >&2
    return 1
  fi
}
start_prepare() {  # prepare "$1" in the background (pid in $pending)
  prepare "$1" &
  pending=$!
}
# On exit, the background preparation goes too (its pip or compiler first, then its shell).
trap '[ -z "$pending" ] || { pkill -P "$pending" 2>/dev/null; kill "$pending" 2>/dev/null; } || true' EXIT
if [ "$prepare_only" = 1 ]; then
  # Every install first (they wait on the network), then the op builds (they take the CPU), each in
  # the order a run tests the releases.
  installs_only="$install_only"
  install_only=1
  for version in "${versions[@]}"; do
    prepare "$version" || exit 1
    echo "[matrix] torch $version installed"
  done
  [ "$installs_only" = 0 ] || exit 0
  install_only=0
  for version in "${versions[@]}"; do
    began=$SECONDS
    prepare "$version" || exit 1
    echo "[matrix] torch $version prepared (its ops built in $((SECONDS - began)) s)"
  done
  exit 0
fi
summary=()
prefetched=0
for i in "${!versions[@]}"; do
  version="${versions[$i]}"
  layer="$CACHE/torch-$version"
  began=$SECONDS
  [ "$prefetched" = 1 ] || start_prepare "$version"
  if ! wait "$pending"; then
    pending=""
    echo "error: could not prepare torch $version (above)" >&2
    exit 1
  fi
  pending=""
  installed=$((SECONDS - began))
  # The next release is installed and its ops built beside this release's tests.
  following="${versions[$((i + 1))]:-}"
  prefetched=0
  if [ -n "$following" ] && [ "${TORCH_MATRIX_KEEP:-1}" != 0 ]; then
    start_prepare "$following"
    prefetched=1
  fi
  venv="$ROOT/.venv-torch-$version"
  "$venv/bin/python" -c "import torch; v = torch.__version__.split('+')[0]; assert v == '$version', v; print('[matrix] torch', torch.__version__, 'from', torch.__file__)"
  began=$SECONDS
  set +e
  TORCH_EXTENSIONS_DIR="$CACHE/torch_extensions-$version" PATH="$venv/bin:$PATH" \
    "$venv/bin/python" -m pytest -m matrix "$@"
  rc=$?
  set -e
  tested=$((SECONDS - began))
  [ "${TORCH_MATRIX_KEEP:-1}" = 0 ] && rm -rf "$layer" "$venv"
  if [ $rc -eq 5 ]; then
    echo "error: pytest collected no tests on torch $version" >&2
    exit 1
  fi
  if [ $rc -ne 0 ]; then
    echo "error: the focused suite failed on torch $version (pytest exit $rc)" >&2
    exit $rc
  fi
  summary+=("torch $version: install and op build ${installed} s (waited for), tests ${tested} s")
done
printf '[matrix] %s\n' "${summary[@]}"
