#!/usr/bin/env bash
# Installs what zeroflat needs and is missing (Debian 12: apt), then configures and builds.
#
#   scripts/setup.sh [BUILD_DIR] [extra cmake arguments...]
#
# Idempotent: packages already installed are left alone, and a configured build directory is
# reused, so running it again only rebuilds what changed. Environment:
#   ZEROFLAT_BUILD_TYPE   Release (default), Debug, RelWithDebInfo
#   ZEROFLAT_JOBS         parallel build jobs (default: the number of cores)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="${1:-$here/build}"
shift || true

log() { printf '[setup] %s\n' "$*" >&2; }

# --- system packages --------------------------------------------------------------------------
packages=(
  build-essential cmake ninja-build pkg-config ccache
  libgtest-dev libgmock-dev libbenchmark-dev
  libxxhash-dev nlohmann-json3-dev
  libopenmpi-dev openmpi-bin
  clang libclang-rt-14-dev
)
missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if ((${#missing[@]} > 0)); then
  if ! command -v apt-get >/dev/null; then
    log "missing packages: ${missing[*]}; this script installs them with apt-get (Debian 12)."
    exit 1
  fi
  sudo=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || { log "need root (or sudo) to install: ${missing[*]}"; exit 1; }
    sudo="sudo"
  fi
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
  log "system packages: all present"
fi

# --- configure and build ----------------------------------------------------------------------
jobs="${ZEROFLAT_JOBS:-$(nproc)}"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  log "configuring $build_dir"
  cmake -S "$here" -B "$build_dir" -G Ninja \
    -DCMAKE_BUILD_TYPE="${ZEROFLAT_BUILD_TYPE:-Release}" "${launcher[@]}" "$@" >&2
elif (($# > 0)); then
  cmake "$build_dir" "$@" >&2
fi
log "building with $jobs jobs"
cmake --build "$build_dir" --parallel "$jobs" >&2
log "built: $build_dir/zeroflat"
