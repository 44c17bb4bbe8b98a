#!/usr/bin/env bash
# Sets up what is missing, builds, and runs every test: the Release build, then the same suite
# built with AddressSanitizer and UndefinedBehaviorSanitizer (skip it with
# ZEROFLAT_SKIP_SANITIZERS=1), then the model-file parsers under libFuzzer for
# ZEROFLAT_FUZZ_SECONDS (default 60; 0 skips it).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${ZEROFLAT_JOBS:-$(nproc)}"
start=$SECONDS

"$here/scripts/setup.sh" "$here/build"
echo "[test] Release build: ctest" >&2
ctest --test-dir "$here/build" --output-on-failure --parallel "$jobs" --timeout 600

if [[ "${ZEROFLAT_SKIP_SANITIZERS:-0}" != 1 ]]; then
  # The CUDA objects are not instrumented anyway and the Release build compiles them; their
  # host-side logic is in tests that build without CUDA. The Python binding is left out: an
  # instrumented module cannot be loaded into an uninstrumented interpreter.
  ZEROFLAT_BUILD_TYPE=Debug "$here/scripts/setup.sh" "$here/build-sanitize" \
    -DZEROFLAT_BUILD_BENCHMARKS=OFF -DZEROFLAT_WITH_CUDA=OFF -DZEROFLAT_WITH_NCCL=OFF \
    -DZEROFLAT_WITH_PYTHON=OFF \
    "-DCMAKE_CXX_FLAGS=-O1 -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer"
  echo "[test] ASan+UBSan build: ctest" >&2
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir "$here/build-sanitize" --output-on-failure --parallel "$jobs" --timeout 900
fi
fuzz_seconds="${ZEROFLAT_FUZZ_SECONDS:-60}"
if ((fuzz_seconds > 0)); then
  CXX=clang++ CC=clang ZEROFLAT_BUILD_TYPE=RelWithDebInfo ZEROFLAT_BUILD_TARGET=model_files_fuzz \
    "$here/scripts/setup.sh" "$here/build-fuzz" \
    -DZEROFLAT_BUILD_TESTS=OFF -DZEROFLAT_BUILD_BENCHMARKS=OFF -DZEROFLAT_BUILD_FUZZERS=ON \
    -DZEROFLAT_WITH_CUDA=OFF -DZEROFLAT_WITH_NCCL=OFF -DZEROFLAT_WITH_MPI=OFF \
    -DZEROFLAT_WITH_PYTHON=OFF \
    "-DCMAKE_CXX_FLAGS=-fsanitize=address,undefined,fuzzer-no-link -fno-sanitize-recover=undefined"
  corpus="$here/build-fuzz/corpus"
  mkdir -p "$corpus"
  cp -n "$here"/tests/fuzz/corpus/* "$corpus"/
  echo "[test] fuzzing the model-file parsers for ${fuzz_seconds} s" >&2
  "$here/build-fuzz/model_files_fuzz" -max_total_time="$fuzz_seconds" -max_len=8192 \
    -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$corpus" 2>"$here/build-fuzz/fuzz.log" ||
    { tail -40 "$here/build-fuzz/fuzz.log" >&2; echo "[test] the fuzzer found a problem" >&2; exit 1; }
  grep -E "^(Done|stat::number_of_executed_units)" "$here/build-fuzz/fuzz.log" >&2 || true
fi
echo "[test] all suites passed in $((SECONDS - start)) s" >&2
