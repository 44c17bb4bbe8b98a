#!/usr/bin/env bash
# Installs what zeroflat needs and is missing (Debian 12: apt), then configures and builds.
#
#   scripts/setup.sh [BUILD_DIR] [extra cmake arguments...]
#   scripts/setup.sh --packages-only     the system packages, nothing else
#
# Idempotent: packages already installed are left alone, and a configured build directory is
# reused, so running it again only rebuilds what changed. Environment:
#   ZEROFLAT_BUILD_TYPE   Release (default), Debug, RelWithDebInfo
#   ZEROFLAT_JOBS         parallel build jobs (default: the number of cores)
#   ZEROFLAT_VENV         the Python environment to make or use (default: .venv)
#   ZEROFLAT_NO_PYTHON    1: no Python environment, and the build leaves the binding out
#   ZEROFLAT_BUILD_TARGET build only this target (default: everything)
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
  iproute2
  python3-venv python3-dev
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
[[ "$build_dir" == --packages-only ]] && exit 0

# --- the Python environment -------------------------------------------------------------------
# A project virtual environment with torch from PyPI (the binding is built against it),
# DeepSpeed (the drop-in is tested against it) and Transformers (the loader's Hugging Face path),
# from python/requirements.txt. pip keeps
# its downloads in its cache, so a second set-up is quick. ZEROFLAT_NO_PYTHON=1 skips it (the
# build then leaves the binding out).
venv="${ZEROFLAT_VENV:-$here/.venv}"
python_args=()
if [[ "${ZEROFLAT_NO_PYTHON:-0}" != 1 ]]; then
  if [[ ! -x "$venv/bin/python" ]]; then
    log "making the Python environment $venv"
    /usr/bin/python3 -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c "import importlib.metadata as m; [m.version(p) for p in ('torch', 'pytest', 'scikit-build-core', 'deepspeed', 'transformers', 'accelerate', 'zstandard')]" 2>/dev/null; then
    log "installing torch, DeepSpeed, Transformers and the test tools into $venv (pip; the torch wheel is large)"
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q -r "$here/python/requirements.txt" >&2
  else
    log "Python environment: $venv has torch"
  fi
  # Every other DeepSpeed release the drop-in is tested against, each in its own folder on top
  # of the venv's torch (no dependencies installed; pip caches the wheels it builds).
  own="$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('deepspeed'))")"
  for release in $(grep -v '^#' "$here/python/deepspeed-releases.txt"); do
    target="$venv/deepspeed-releases/$release"
    if [[ "$release" == "$own" || -f "$target/deepspeed/__init__.py" ]]; then continue; fi
    log "installing DeepSpeed $release into $target"
    rm -rf "$target.partial"
    DS_BUILD_OPS=0 "$venv/bin/python" -m pip install -q --no-deps --target "$target.partial" \
      "deepspeed==$release" >&2
    mv "$target.partial" "$target"
  done
  # Transformers 4 (its last release), tested beside the venv's 5 in its own folder, with the
  # hub and tokenizers releases it takes (the venv's are Transformers 5's).
  tf4="$venv/transformers-releases/4.57.6"
  if [[ ! -f "$tf4/transformers/__init__.py" ]]; then
    log "installing Transformers 4.57.6 into $tf4"
    rm -rf "$tf4.partial"
    "$venv/bin/python" -m pip install -q --no-deps --target "$tf4.partial" transformers==4.57.6 \
      huggingface_hub==0.36.0 tokenizers==0.22.1 requests==2.34.2 urllib3==2.8.0 \
      certifi==2026.10.19.post1 charset_normalizer==3.5.3 idna==3.21 >&2
    mv "$tf4.partial" "$tf4"
  fi
  python_args=(-DPython3_EXECUTABLE="$venv/bin/python")
fi

# --- configure and build ----------------------------------------------------------------------
jobs="${ZEROFLAT_JOBS:-$(nproc)}"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
if [[ ! -f "$build_dir/CMakeCache.txt" ]]; then
  log "configuring $build_dir"
  cmake -S "$here" -B "$build_dir" -G Ninja \
    -DCMAKE_BUILD_TYPE="${ZEROFLAT_BUILD_TYPE:-Release}" "${launcher[@]}" "${python_args[@]}" \
    "$@" >&2
elif (($# > 0)) || ((${#python_args[@]} > 0)); then
  cmake "$build_dir" "${python_args[@]}" "$@" >&2
fi
target="${ZEROFLAT_BUILD_TARGET:-}"
log "building ${target:-everything} with $jobs jobs"
cmake --build "$build_dir" --parallel "$jobs" ${target:+--target "$target"} >&2
log "built: $build_dir/${target:-zeroflat}"
