#!/usr/bin/env bash
# Sets up what is missing, builds, and runs every test: the Release build, then the same suite
# built with AddressSanitizer and UndefinedBehaviorSanitizer (skip it with
# ZEROFLAT_SKIP_SANITIZERS=1).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${ZEROFLAT_JOBS:-$(nproc)}"
start=$SECONDS

"$here/scripts/setup.sh" "$here/build"
echo "[test] Release build: ctest" >&2
ctest --test-dir "$here/build" --output-on-failure --parallel "$jobs" --timeout 600

if [[ "${ZEROFLAT_SKIP_SANITIZERS:-0}" != 1 ]]; then
  ZEROFLAT_BUILD_TYPE=Debug "$here/scripts/setup.sh" "$here/build-sanitize" \
    -DZEROFLAT_BUILD_BENCHMARKS=OFF \
    "-DCMAKE_CXX_FLAGS=-O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
  echo "[test] ASan+UBSan build: ctest" >&2
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir "$here/build-sanitize" --output-on-failure --parallel "$jobs" --timeout 900
fi
echo "[test] all suites passed in $((SECONDS - start)) s" >&2
