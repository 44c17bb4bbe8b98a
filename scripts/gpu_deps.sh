#!/usr/bin/env bash
# Stages the build's C++ dependencies for a GPU machine that has CUDA, CMake and PyTorch but no
# package manager and no network: nlohmann_json (headers and its CMake package), xxHash (header
# and shared library) and GoogleTest's sources, copied from this machine's Debian packages into
# one folder. scripts/gpu_check.sh finds that folder (ZEROFLAT_GPU_DEPS, default .gpu-deps in the
# repository root), builds GoogleTest there and puts the folder on CMAKE_PREFIX_PATH.
#
#   scripts/gpu_deps.sh [DIR]        (default .gpu-deps; about 6 MB)
#
# Needs nlohmann-json3-dev, libxxhash-dev and googletest installed here (scripts/setup.sh
# installs them). Run it on an x86-64 machine for an x86-64 GPU machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIR=${1:-.gpu-deps}
PREFIX=$DIR/prefix

need() { [ -e "$1" ] || { echo "gpu_deps: $1 missing: install $2 (scripts/setup.sh does)" >&2; exit 1; }; }
need /usr/include/nlohmann/json.hpp nlohmann-json3-dev
need /usr/share/cmake/nlohmann_json nlohmann-json3-dev
need /usr/include/xxhash.h libxxhash-dev
need /usr/src/googletest/CMakeLists.txt googletest
XXHASH_SO=$(readlink -f /usr/lib/"$(gcc -dumpmachine)"/libxxhash.so)
need "$XXHASH_SO" libxxhash-dev

rm -rf "$DIR"
mkdir -p "$PREFIX/include" "$PREFIX/share/cmake" "$PREFIX/lib"
cp -r /usr/include/nlohmann "$PREFIX/include/"
cp -r /usr/share/cmake/nlohmann_json "$PREFIX/share/cmake/"
cp /usr/include/xxhash.h /usr/include/xxh3.h "$PREFIX/include/"
# Plain copies (no links): the link-time name and the run-time name (its SONAME).
cp "$XXHASH_SO" "$PREFIX/lib/libxxhash.so"
SONAME=$(objdump -p "$XXHASH_SO" | awk '/SONAME/ {print $2}')
[ -z "$SONAME" ] || cp "$XXHASH_SO" "$PREFIX/lib/$SONAME"
cp -r /usr/src/googletest "$DIR/googletest-src"
# Not the repository's files: keep them out of git wherever DIR is inside the checkout.
echo '*' >"$DIR/.gitignore"
echo "gpu_deps: staged in $DIR ($(du -sh "$DIR" | cut -f1)); carry it to the GPU machine" >&2
