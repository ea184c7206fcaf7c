#!/usr/bin/env bash
# The container image: build it, run the main job in it, run docker/pytorchjob.yaml across containers.
#
#   bash scripts/image.sh build [--base REF] [--ca FILE] [--wheels DIR] [--build-arg K=V ...]
#   bash scripts/image.sh tag [build options]      # the image the checkout's content maps to
#   bash scripts/image.sh run [--nproc N] [--data DIR] [--name NAME] [--image REF] [train_lm.py options...]
#   bash scripts/image.sh exec [--image REF] -- COMMAND [ARGS...]
#   bash scripts/image.sh cluster [--nodes N] [--nproc N] [--data DIR] [--name NAME] [--subnet A.B.C]
#                                 [--manifest YAML] [--image REF] [train_lm.py options...]
#
# build   docker/Dockerfile with podman, tagged localhost/ds_adabatch:<content hash> and :latest. The
#         hash covers every file the image copies, the base image and the build arguments: a second
#         build of unchanged inputs reuses the image (prints "up to date"); a new build removes the
#         images of earlier contents (their tags, then the project's images left without one). Two
#         builds on one machine run one after the other: the second finds the first's image.
#   --base REF     base image. Default localhost/bookworm-base, built here when missing from Debian's
#                  packages (debootstrap --variant=minbase bookworm + podman import; needs root and
#                  debootstrap), so no image registry is needed. With a registry: --base python:3.11-slim.
#   --ca FILE      a CA bundle pip must trust during the build (a TLS-intercepting proxy in front of the
#                  package index). Default: this machine's pip's (PIP_CERT, else its config's cert) when
#                  that names a file. Passed as a build secret, not stored in the image.
#   --wheels DIR   a folder of wheels pip looks in first, e.g. the CPU build of torch. Default: this
#                  machine's pip's (PIP_FIND_LINKS, else its config's find-links) when that names a
#                  folder. Mounted for the build only (-v DIR:/wheels:ro).
#   --build-arg K=V  the Dockerfile's arguments: TORCH, TORCH_INDEX, EXTRAS, PREBUILD_CPU_OPS.
# run     the main job on N ranks (default 2) in one container (named NAME), no network; DIR (default
#         runs/container) is mounted at /data and the job writes to /data/train_lm unless told otherwise
#         (--out). The options after these are the main job's, appended to its default command line.
# exec    COMMAND in a container of the image (removed when it ends), no network, e.g.
#         `bash scripts/image.sh exec -- python -c "import ds_adabatch"`.
# cluster docker/pytorchjob.yaml's Worker pods as containers, one per network namespace of
#         scripts/netns-cluster.sh (needs root): the training operator's PET_* environment, the pods'
#         hostnames, the manifest's command line with the given options appended, DIR (default
#         runs/cluster) as the claimed volume in every pod; --nodes pods (default: its replicas) of
#         --nproc processes (default: its nprocPerNode). Ends when every container has; exits with worker
#         0's status. `podman kill NAME-worker-1` from another shell is the loss of node 1. Defaults:
#         NAME dsab, the nodes at A.B.C.1.. with A.B.C 10.213.0, YAML docker/pytorchjob.yaml. Needs
#         pyyaml in $PYTHON (default python3).
# run, exec and cluster build the image first when the checkout's content has none (or use --image REF).
#
# PODMAN_RUNTIME=crun|runc picks the OCI runtime; by default runc where the machine mounts cgroups in
# "hybrid" mode with a controller on the cgroup2 side, which crun refuses ("cgroups in hybrid mode not
# supported").
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPO=localhost/ds_adabatch
BASE_DEFAULT=localhost/bookworm-base

die() {
  echo "image.sh: $*" >&2
  exit 1
}

value() { # the value of option $1, or a clear error
  [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"
  printf '%s' "$2"
}

command -v podman >/dev/null 2>&1 || die "podman is not installed (Debian: apt-get install podman)"

PODMAN=(podman)
runtime="${PODMAN_RUNTIME:-}"
if [ -z "$runtime" ] && [ -r /sys/fs/cgroup/unified/cgroup.controllers ] &&
  [ -n "$(cat /sys/fs/cgroup/unified/cgroup.controllers)" ]; then
  command -v runc >/dev/null 2>&1 ||
    die "this machine's cgroups are in hybrid mode with controllers on cgroup2, which crun refuses: apt-get install runc"
  runtime=runc
fi
[ -n "$runtime" ] && PODMAN+=(--runtime "$runtime")

# podman asks for resource limits above the caller's own by default (1048576 open files); where the
# caller may not raise its limits (no CAP_SYS_RESOURCE, as in a sandbox) no container starts. Ask for
# what this shell has: its hard limits, processes capped at kernel.pid_max (more cannot exist anyway).
nofile="$(ulimit -Hn)"
[ "$nofile" = unlimited ] && nofile=1048576
nproc="$(ulimit -Hu)"
pid_max="$(cat /proc/sys/kernel/pid_max 2>/dev/null || echo 32768)"
if [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; then nproc="$pid_max"; fi
LIMITS=(--ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc")

build_base() { # the Debian base from distribution packages: no image registry involved
  local ref="$1" dir
  [ "$(id -u)" = 0 ] || die "building $ref from Debian's packages needs root (debootstrap); or pass --base python:3.11-slim"
  command -v debootstrap >/dev/null 2>&1 || die "building $ref needs debootstrap (apt-get install debootstrap); or pass --base python:3.11-slim"
  dir="$(mktemp -d "${TMPDIR:-/var/tmp}/dsab-rootfs.XXXXXX")"
  echo "[image] building $ref: debootstrap --variant=minbase bookworm" >&2
  if ! debootstrap --variant=minbase bookworm "$dir" "${DEBIAN_MIRROR:-http://deb.debian.org/debian}" >"$dir.log" 2>&1; then
    tail -20 "$dir.log" >&2
    rm -rf "$dir" "$dir.log"
    die "debootstrap failed (log above)"
  fi
  # The downloaded .deb files are not part of the system: leave them out of the image.
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* "$dir.log"
  tar -C "$dir" -c . | "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' - "$ref" >/dev/null
  rm -rf "$dir"
}

pip_config() { # a global setting of this machine's pip (the last file that sets it), or nothing
  "${PYTHON:-python3}" -m pip config list 2>/dev/null | sed -n "s/^global\.$1='\(.*\)'\$/\1/p" | tail -1
}

content_hash() { # everything the image is made of: the files it copies, the base, the build settings
  (
    cd "$ROOT"
    printf '%s\n' "$@"
    find docker/Dockerfile docker/pip-install.sh scripts/c++-without-debug-info .dockerignore setup.py pyproject.toml README.md \
      ds_adabatch runners ds_configs -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 |
      sort -z | xargs -0 sha256sum
  ) | sha256sum | cut -c1-16
}

# Sets IMAGE to the image of the checkout's current content (getting the base if needed); BUILD_OPTS
# to the options that build it.
# One build at a time on the machine (podman's store is the machine's): a second build, or a tag that
# would build the base, waits for the first (a lock under TMPDIR, held until this script exits), then
# finds what it built.
resolve() {
  if command -v flock >/dev/null 2>&1; then
    exec 9>"${TMPDIR:-/tmp}/ds_adabatch-image.lock"
    flock 9 || true
  fi
  local base="$BASE_DEFAULT" ca="" wheels="" build_args=()
  # Defaults: the CA bundle and the wheelhouse this machine's pip uses (its environment, then its config).
  local cert="${PIP_CERT:-$(pip_config cert)}" links="${PIP_FIND_LINKS:-$(pip_config find-links)}"
  if [ -n "$cert" ] && [ -f "$cert" ]; then ca="$cert"; fi
  links="${links%% *}"
  if [ -n "$links" ] && [ -d "$links" ]; then wheels="$links"; fi
  while [ $# -gt 0 ]; do
    case "$1" in
      --base) base="$(value "$@")"; shift 2 ;;
      --ca) ca="$(value "$@")"; shift 2 ;;
      --wheels) wheels="$(value "$@")"; shift 2 ;;
      --build-arg) build_args+=(--build-arg "$(value "$@")"); shift 2 ;;
      *) die "build: unknown option $1" ;;
    esac
  done
  [ -z "$ca" ] || [ -f "$ca" ] || die "--ca $ca: no such file"
  [ -z "$wheels" ] || [ -d "$wheels" ] || die "--wheels $wheels: no such folder"

  if ! "${PODMAN[@]}" image exists "$base"; then
    if [ "$base" = "$BASE_DEFAULT" ]; then build_base "$base"; else "${PODMAN[@]}" pull -q "$base" >/dev/null; fi
  fi
  local base_id wheel_list="" hash
  base_id="$("${PODMAN[@]}" image inspect --format '{{.Id}}' "$base")"
  [ -n "$wheels" ] && wheel_list="$(ls "$wheels")"
  hash="$(content_hash "$base_id" "${build_args[*]:-}" "$wheel_list")"
  IMAGE="$REPO:$hash"
  BUILD_OPTS=(--build-arg "BASE=$base" "${build_args[@]}" --label "ds_adabatch.content=$hash")
  [ -n "$ca" ] && BUILD_OPTS+=(--secret "id=pip-ca,src=$ca")
  # The wheelhouse's file names: a build argument (part of the RUN steps' cache key) and a label
  # (what the image was built with, which tests/test_container.py reads).
  [ -n "$wheels" ] && BUILD_OPTS+=(-v "$wheels:/wheels:ro" --build-arg "WHEELHOUSE=${wheel_list//$'\n'/ }"
    --label "ds_adabatch.wheelhouse=${wheel_list//$'\n'/ }")
  return 0
}

# Sets IMAGE to the image of the checkout's current content, building it (and the base) if needed.
build() {
  resolve "$@"
  if "${PODMAN[@]}" image exists "$IMAGE"; then
    echo "[image] $IMAGE is up to date" >&2
  else
    echo "[image] building $IMAGE" >&2
    # Host network for the build: pip and apt reach their registries without podman creating a
    # network (and firewall rules) for it.
    "${PODMAN[@]}" build --network host "${LIMITS[@]}" "${BUILD_OPTS[@]}" -f "$ROOT/docker/Dockerfile" \
      -t "$IMAGE" "$ROOT" >&2
    "${PODMAN[@]}" tag "$IMAGE" "$REPO:latest"
    # Earlier contents are superseded (latest has moved): untag them, then remove the images of this
    # project left without a name (its label; layers this image shares stay, and so does an image a
    # container still runs), so that repeated builds do not fill the disk.
    local old
    for old in $("${PODMAN[@]}" images --format '{{.Repository}}:{{.Tag}}' --filter "reference=$REPO"); do
      [ "$old" = "$IMAGE" ] || [ "$old" = "$REPO:latest" ] || "${PODMAN[@]}" untag "$old" "$old" >/dev/null 2>&1 || true
    done
    "${PODMAN[@]}" image prune -f --filter label=ds_adabatch.content >/dev/null 2>&1 || true
  fi
  "${PODMAN[@]}" tag "$IMAGE" "$REPO:latest"
}

main() {
  cmd="${1:-}"
  [ $# -gt 0 ] && shift
  case "$cmd" in
    build)
      build "$@"
      echo "$IMAGE"
      ;;
    tag)
      resolve "$@"
      echo "$IMAGE"
      ;;
    run)
      nprocs=2 data="$ROOT/runs/container" IMAGE="" name=()
      while [ $# -gt 0 ]; do
        case "$1" in
          --nproc) nprocs="$(value "$@")"; shift 2 ;;
          --name) name=(--name "$(value "$@")"); shift 2 ;;
          --data) data="$(value "$@")"; shift 2 ;;
          --image) IMAGE="$(value "$@")"; shift 2 ;;
          --) shift; break ;;
          *) break ;;
        esac
      done
      [ -n "$IMAGE" ] || build
      mkdir -p "$data"
      # One node needs no network: the ranks meet over the container's loopback.
      exec "${PODMAN[@]}" run --rm "${name[@]}" --network none "${LIMITS[@]}" -e GLOO_SOCKET_IFNAME=lo \
        -v "$(cd "$data" && pwd):/data" "$IMAGE" \
        torchrun --nproc-per-node "$nprocs" runners/train_lm.py --config ds_configs/lm_ramp.json \
        --out /data/train_lm "$@"
      ;;
    exec)
      IMAGE=""
      while [ $# -gt 0 ]; do
        case "$1" in
          --image) IMAGE="$(value "$@")"; shift 2 ;;
          --) shift; break ;;
          *) break ;;
        esac
      done
      [ $# -gt 0 ] || die "exec needs a command: bash scripts/image.sh exec [--image REF] -- COMMAND [ARGS...]"
      [ -n "$IMAGE" ] || build
      exec "${PODMAN[@]}" run --rm --network none "${LIMITS[@]}" "$IMAGE" "$@"
      ;;
    cluster)
      IMAGE="" pass=()
      while [ $# -gt 0 ]; do
        case "$1" in
          --image) IMAGE="$(value "$@")"; shift 2 ;;
          --nodes | --nproc | --data | --name | --subnet | --manifest) pass+=("$1" "$(value "$@")"); shift 2 ;;
          --) shift; break ;;
          *) break ;;
        esac
      done
      [ -n "$IMAGE" ] || build
      [ "$(id -u)" = 0 ] || die "cluster needs root (network namespaces)"
      exec "${PYTHON:-python3}" "$ROOT/docker/podman_pytorchjob.py" --image "$IMAGE" \
        --podman "${PODMAN[*]}" --run-opt="${LIMITS[*]}" "${pass[@]}" -- "$@"
      ;;
    *)
      awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}" >&2
      exit 2
      ;;
  esac
}

# One line, parsed whole before it runs: editing this file while a build runs cannot derail it.
main "$@"; exit $?
