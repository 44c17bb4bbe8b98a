#!/usr/bin/env bash
# Sets up what is missing, builds, and runs every test: the Release build, then the same suite
# built with AddressSanitizer and UndefinedBehaviorSanitizer (skip it with
# ZEROFLAT_SKIP_SANITIZERS=1), then the model-file parsers under libFuzzer for
# ZEROFLAT_FUZZ_SECONDS (default 60; 0 skips it). ctest runs ZEROFLAT_TEST_JOBS tests at once
# (default: twice the cores: most tests wait on processes they start as much as they compute).
# The sanitizer build (Clang; the fuzz target is one of its targets) compiles from the moment
# the system packages are there, at the lowest CPU priority: through the Python environment's
# downloads and the Release suite it takes only the time they leave idle. The fuzzer runs beside
# the sanitizer suite.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
jobs="${ZEROFLAT_JOBS:-$(nproc)}"
test_jobs="${ZEROFLAT_TEST_JOBS:-$((2 * $(nproc)))}"
fuzz_seconds="${ZEROFLAT_FUZZ_SECONDS:-60}"
sanitize="$([[ "${ZEROFLAT_SKIP_SANITIZERS:-0}" != 1 ]] && echo 1 || echo 0)"
start=$SECONDS

"$here/scripts/setup.sh" --packages-only

build_sanitize() {
  # One Clang build for both: the suite under ASan and UBSan, every object also instrumented for
  # libFuzzer's coverage (fuzzer-no-link), and the fuzz target linked with libFuzzer. The CUDA
  # objects are not instrumented anyway and the Release build compiles them; their host-side
  # logic is in tests that build without CUDA. The Python binding is left out: an instrumented
  # module cannot be loaded into an uninstrumented interpreter. Line tables (-g1) are what the
  # reports need, at a fraction of full debug information's cost. UBSan's `function` check is
  # off: the test stubs of the CUDA libraries, which the library dlopens, declare the entry
  # points with types of their own (the real libraries are not instrumented). A unity build
  # (each target's sources compiled in a few batches): a quarter less compiler time, and the
  # Release build still compiles every source on its own.
  local cache="$here/build-sanitize/CMakeCache.txt"
  if [[ -f "$cache" ]] && ! grep -q "^CMAKE_CXX_COMPILER:[A-Z]*=.*clang" "$cache"; then
    rm -rf "$here/build-sanitize"  # configured with another compiler, which cannot change in place
  fi
  CXX=clang++ CC=clang ZEROFLAT_BUILD_TYPE=Debug ZEROFLAT_BUILD_TARGET="${1:-}" ZEROFLAT_NO_PYTHON=1 \
    "$here/scripts/setup.sh" "$here/build-sanitize" \
    -DZEROFLAT_BUILD_BENCHMARKS=OFF -DZEROFLAT_BUILD_FUZZERS=ON -DZEROFLAT_WITH_CUDA=OFF \
    -DZEROFLAT_WITH_NCCL=OFF -DZEROFLAT_WITH_PYTHON=OFF -DCMAKE_CXX_FLAGS_DEBUG=-g1 \
    -DCMAKE_UNITY_BUILD=ON \
    "-DCMAKE_CXX_FLAGS=-O1 -fsanitize=address,undefined,fuzzer-no-link -fno-sanitize=function -fno-sanitize-recover=all -fno-omit-frame-pointer"
}

background_log="$(mktemp)"
background=""
if [[ "$sanitize" == 1 ]] || ((fuzz_seconds > 0)); then
  echo "[test] the sanitizer build (with the fuzz target) compiles in the background (nice 19)" >&2
  set -m  # a process group of its own, so that a failure here stops its compilers too
  (
    renice -n 19 -p "$BASHPID" >/dev/null
    if [[ "$sanitize" == 1 ]]; then build_sanitize; else build_sanitize model_files_fuzz; fi
  ) >"$background_log" 2>&1 &
  background=$!
  set +m
fi
# wait_job VAR LOG LINES WHAT: waits for the background job whose pid VAR holds, then empties VAR
# (the exit trap kills what is still in it); when the job failed, the last LINES of LOG and
# "WHAT (exit N)", and the run stops.
wait_job() {
  local -n job="$1"
  local rc=0
  wait "$job" || rc=$?
  job=""
  if ((rc != 0)); then
    tail -"$3" "$2" >&2
    echo "[test] $4 (exit $rc)" >&2
    exit 1
  fi
}
finish_background() {
  [[ -z "$background" ]] || wait_job background "$background_log" 60 "the sanitizer build failed"
}
fuzz_pid=""
trap '[[ -z "$background" ]] || kill -- "-$background" 2>/dev/null
      [[ -z "$fuzz_pid" ]] || kill "$fuzz_pid" 2>/dev/null; rm -f "$background_log"' EXIT

"$here/scripts/setup.sh" "$here/build"
echo "[test] Release build: ctest" >&2
ctest --test-dir "$here/build" --output-on-failure --parallel "$test_jobs" --timeout 600
echo "[test] Release suite done in $((SECONDS - start)) s; waiting for the background builds" >&2
finish_background

if ((fuzz_seconds > 0)); then
  corpus="$here/build-sanitize/corpus"
  mkdir -p "$corpus"
  cp -n "$here"/tests/fuzz/corpus/* "$corpus"/
  echo "[test] fuzzing the model-file parsers for ${fuzz_seconds} s" >&2
  fuzz_log="$here/build-sanitize/fuzz.log"
  "$here/build-sanitize/model_files_fuzz" -max_total_time="$fuzz_seconds" -max_len=32768 \
    -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$corpus" 2>"$fuzz_log" &
  fuzz_pid=$!
fi
if [[ "$sanitize" == 1 ]]; then
  echo "[test] ASan+UBSan build: ctest" >&2
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ctest --test-dir "$here/build-sanitize" --output-on-failure --parallel "$test_jobs" --timeout 900
fi
if [[ -n "$fuzz_pid" ]]; then
  wait_job fuzz_pid "$fuzz_log" 40 "the fuzzer found a problem"
  grep -E "^(Done|stat::number_of_executed_units)" "$fuzz_log" >&2 || true
fi
echo "[test] all suites passed in $((SECONDS - start)) s" >&2
