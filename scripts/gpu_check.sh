#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU (an H200 in this project's runs; no network, no
# package installs): builds the CUDA parts, runs the GPU tests, the GPU benchmark, torch.cat on
# the same tensors, `zeroflat run` on cuda:0, the loader into cuda:0 and, with the Python binding
# built against the machine's torch, zeroflat.fsdp.load into CUDA DTensors; then prints one
# summary table. With OUT set, the table goes to $OUT/gpu-results.md and every step's output to
# $OUT/gpu-logs.tar.gz. On a machine without nlohmann_json, xxHash or GoogleTest (no package
# manager, no network), stage them first with scripts/gpu_deps.sh and bring the folder along.
#
#   scripts/gpu_check.sh [BUILD_DIR]        (default build-gpu; about 5 minutes on an H200)
#   ZEROFLAT_GPU_DEPS=DIR                   (what scripts/gpu_deps.sh staged; default .gpu-deps)
#
# Every part runs even when an earlier one failed; the exit status is non-zero when a GPU test
# failed (or every GPU test skipped on a machine whose driver sees a GPU).
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$(pwd)
BUILD=${1:-build-gpu}
LOGS=$(mktemp -d)
trap 'rm -rf "$LOGS"' EXIT
STARTED=$(date +%s)

say() { printf '== %s (%ds)\n' "$*" "$(($(date +%s) - STARTED))" >&2; }
# ZEROFLAT_GPU_BUDGET=SECONDS: the whole run's time (a leased machine's command limit); each step's
# limit is cut to what is left of it, 20 s kept for the summary, and a step with under 10 s left
# is skipped. 0 (the default): no budget.
BUDGET=${ZEROFLAT_GPU_BUDGET:-0}
# ZEROFLAT_GPU_PARTS=native,python (the default, "all": both): native is the C++ GPU tests and
# benchmarks, the command line on cuda:0; python the binding, the CUDA DTensor load and the
# Hugging Face load benchmark. A rerun of one part spends less of a leased machine.
PARTS=${ZEROFLAT_GPU_PARTS:-all}
want() { [ "$PARTS" = all ] || [[ ",$PARTS," == *",$1,"* ]]; }
left() { echo $((BUDGET - ($(date +%s) - STARTED) - 20)); }
# Runs a step with a time limit, its output to a log; never stops the script.
step() {
  local name=$1 limit=$2
  shift 2
  if [ "$BUDGET" -gt 0 ]; then
    local rest
    rest=$(left)
    if [ "$rest" -lt 10 ]; then
      echo "skipped: the time budget (ZEROFLAT_GPU_BUDGET=$BUDGET s) is spent" >"$LOGS/$name.err"
      echo 124 >"$LOGS/$name.rc"
      say "$name skipped: the time budget is spent"
      return 124
    fi
    [ "$rest" -lt "$limit" ] && limit=$rest
  fi
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$LOGS/$name.out" 2>"$LOGS/$name.err"
  local rc=$?
  echo "$rc" >"$LOGS/$name.rc"
  [ "$rc" -eq 0 ] || say "$name failed (exit $rc): $(tail -n 3 "$LOGS/$name.err" | tr '\n' ' ')"
  return "$rc"
}

# --- tools ---------------------------------------------------------------------------------------
PYTHON=""
for p in python3 python; do
  if command -v "$p" >/dev/null && "$p" -c 'import torch' 2>/dev/null; then PYTHON=$p; break; fi
done
[ -n "$PYTHON" ] || PYTHON=$(command -v python3 || true)
find_tool() {  # on PATH, or next to the Python (pip installs cmake and ninja there)
  command -v "$1" 2>/dev/null && return
  if [ -n "$PYTHON" ]; then
    local bin
    bin=$("$PYTHON" -c 'import sys, os; print(os.path.join(sys.prefix, "bin"))' 2>/dev/null)
    [ -x "$bin/$1" ] && echo "$bin/$1"
  fi
}
CMAKE=$(find_tool cmake)
CTEST=$(find_tool ctest)
NINJA=$(find_tool ninja)
NVCC=$(command -v nvcc || { [ -x /usr/local/cuda/bin/nvcc ] && echo /usr/local/cuda/bin/nvcc; })
CARD=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null |
  head -n 1)
# The commit measured: ZEROFLAT_COMMIT where the tree was copied without its own history (a
# leased machine's copy can carry a stale .git), else git's.
COMMIT=${ZEROFLAT_COMMIT:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
if [ -z "${ZEROFLAT_COMMIT:-}" ] && [ "$COMMIT" != unknown ] &&
  [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  COMMIT="$COMMIT (with uncommitted changes)"
fi
NVCC_VERSION=$([ -n "$NVCC" ] && "$NVCC" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
NOTES=()
# NCCL from the toolkit, else the one pip installed with torch (nvidia-nccl-*; its library has
# only the versioned name, so it is passed by path; the build tree's RPATH then finds it).
NCCL_ARGS=()
if [ -n "$NVCC" ] && [ -n "$PYTHON" ] && [ ! -e "$(dirname "$NVCC")/../include/nccl.h" ] &&
  [ ! -e /usr/include/nccl.h ]; then
  NCCL_DIR=$("$PYTHON" -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null)
  NCCL_LIB=$(find "${NCCL_DIR:-/nonexistent}/lib" -maxdepth 1 -name "libnccl.so*" 2>/dev/null |
    head -n 1)
  if [ -n "$NCCL_LIB" ] && [ -f "$NCCL_DIR/include/nccl.h" ]; then
    NCCL_ARGS=(-DNCCL_INCLUDE_DIR="$NCCL_DIR/include" -DNCCL_LIBRARY="$NCCL_LIB")
    NOTES+=("NCCL from the Python packages: $NCCL_LIB")
  fi
fi
say "tools: cmake ${CMAKE:-none}, ninja ${NINJA:-none}, nvcc ${NVCC:-none}, python ${PYTHON:-none}"

# --- dependencies staged by scripts/gpu_deps.sh (a machine with no package manager) -----------
DEPS=${ZEROFLAT_GPU_DEPS:-$ROOT/.gpu-deps}
PREFIX_ARGS=()
if [ -n "$CMAKE" ] && [ -d "$DEPS/prefix" ]; then
  if [ -d "$DEPS/googletest-src" ] && [ ! -d "$DEPS/prefix/lib/cmake/GTest" ]; then
    say "GoogleTest from $DEPS"
    step gtest_configure 120 "$CMAKE" -S "$DEPS/googletest-src" -B "$DEPS/googletest-build" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$DEPS/prefix" \
      -DCMAKE_INSTALL_LIBDIR=lib -DBUILD_GMOCK=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON &&
      step gtest_build 300 "$CMAKE" --build "$DEPS/googletest-build" -j "$(nproc)" --target install
  fi
  PREFIX_ARGS=(-DCMAKE_PREFIX_PATH="$(cd "$DEPS/prefix" && pwd)")
  NOTES+=("dependencies from $DEPS (scripts/gpu_deps.sh)")
fi

# --- build: the library with CUDA, its GPU tests and benchmark, the Python binding ---------------
# One build tree for all of them (the library is compiled once). Without torch in the Python, or
# where the binding does not configure, the rest still builds; likewise without GoogleTest.
TESTS=ON
WITH_PYTHON=OFF
want python && [ -n "$PYTHON" ] && "$PYTHON" -c 'import torch' 2>/dev/null && WITH_PYTHON=ON
BUILT=0
PYTHON_BUILT=0
if [ -z "$CMAKE" ]; then
  NOTES+=("no cmake on this machine: nothing built")
elif [ -z "$NVCC" ]; then
  NOTES+=("no nvcc on this machine: nothing built")
else
  GEN=(-G "Unix Makefiles")
  [ -n "$NINJA" ] && GEN=(-G Ninja -DCMAKE_MAKE_PROGRAM="$NINJA")
  configure() {
    rm -rf "$BUILD"
    local py=()
    [ "$WITH_PYTHON" = ON ] && py=(-DPython3_EXECUTABLE="$(command -v "$PYTHON")")
    step configure 300 "$CMAKE" -S "$ROOT" -B "$BUILD" "${GEN[@]}" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_COMPILER="$NVCC" -DZEROFLAT_WITH_CUDA=ON -DZEROFLAT_WITH_MPI=OFF \
      -DZEROFLAT_WITH_PYTHON="$WITH_PYTHON" "${py[@]+"${py[@]}"}" -DZEROFLAT_BUILD_BENCHMARKS=OFF \
      -DZEROFLAT_BUILD_TESTS="$TESTS" "${PREFIX_ARGS[@]+"${PREFIX_ARGS[@]}"}" \
      "${NCCL_ARGS[@]+"${NCCL_ARGS[@]}"}"
  }
  say "configure (tests $TESTS, Python binding $WITH_PYTHON)"
  if ! configure && [ "$WITH_PYTHON" = ON ] &&
    grep -qiE "python|torch" "$LOGS/configure.err"; then
    NOTES+=("the Python binding did not configure: $(grep -m 2 -E 'Error|error' \
      "$LOGS/configure.err" | cut -c1-300 | tr '\n' ' ')")
    WITH_PYTHON=OFF
    configure
  fi
  if [ "$(cat "$LOGS/configure.rc")" != 0 ] && grep -q GTest "$LOGS/configure.err"; then
    TESTS=OFF
    NOTES+=("GoogleTest not found (scripts/gpu_deps.sh stages it): GPU tests not built")
    configure
  fi
  if [ "$(cat "$LOGS/configure.rc")" = 0 ]; then
    TARGETS=(zeroflat)
    want native && TARGETS+=(zeroflat_cli gpu_bench)
    want native && [ "$TESTS" = ON ] && TARGETS+=(cuda_device_test)
    say "build ${TARGETS[*]}"
    if step build 420 "$CMAKE" --build "$BUILD" -j "$(nproc)" --target "${TARGETS[@]}"; then
      BUILT=1
    else
      NOTES+=("build failed: $(grep -h -m 3 -E 'error|Error' "$LOGS/build.out" "$LOGS/build.err" |
        cut -c1-300 | tr '\n' ' ')")
    fi
    if [ "$WITH_PYTHON" = ON ]; then
      say "build the Python binding"
      if step build_python 420 "$CMAKE" --build "$BUILD" -j "$(nproc)" --target zeroflat_python
      then
        PYTHON_BUILT=1
      else
        NOTES+=("the Python binding did not build: $(grep -h -m 2 -E 'error' \
          "$LOGS/build_python.out" "$LOGS/build_python.err" | cut -c1-300 | tr '\n' ' ')")
      fi
    fi
  else
    NOTES+=("configure failed: $(grep -m 3 -E 'Error|error' "$LOGS/configure.err" |
      cut -c1-300 | tr '\n' ' ')")
  fi
fi

# --- GPU tests -----------------------------------------------------------------------------------
if [ "$BUILT" = 1 ] && [ "$TESTS" = ON ] && want native; then
  say "ctest -L gpu"
  step ctest 300 "${CTEST:-ctest}" --test-dir "$BUILD" -L gpu -LE python --output-on-failure --timeout 240
fi

# --- FSDP2 into CUDA DTensors (the Python binding, built against this machine's torch) ----------
PYPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
if [ "$PYTHON_BUILT" = 1 ]; then
  say "zeroflat.fsdp.load into CUDA DTensors"
  step fsdp_cuda 240 env PYTHONPATH="$PYPATH" "$PYTHON" "$ROOT/python/tests/test_fsdp_cuda.py"
fi

# --- benchmarks ----------------------------------------------------------------------------------
# The native part's benchmarks: with the build, and only when asked for.
NATIVE=0
[ "$BUILT" = 1 ] && want native && NATIVE=1
if [ "$NATIVE" = 1 ]; then
  say "gpu_bench"
  step gpu_bench 300 "$BUILD/gpu_bench" --numels "$LOGS/numels.json"
fi
if [ "$NATIVE" = 1 ] && [ -n "$PYTHON" ]; then
  say "torch_cat_bench"
  NUMELS=()
  [ -s "$LOGS/numels.json" ] && NUMELS=(--numels "$LOGS/numels.json")
  step torch 240 "$PYTHON" "$ROOT/benchmarks/torch_cat_bench.py" "${NUMELS[@]}"
fi
if [ "$NATIVE" = 1 ]; then
  say "zeroflat run on cuda:0 and on the cpu"
  step run_cuda 240 "$BUILD/zeroflat" run --device cuda:0 --model qwen3-30b-a3b --layers 4 \
    --verify --json
  step run_cpu 240 "$BUILD/zeroflat" run --device cpu --model qwen3-30b-a3b --layers 4 --json
  # The checkpoint loader into cuda:0 (through its ring of pinned chunks) against a plain read
  # into pinned memory plus one cudaMemcpy of the same bytes (the load's ceiling on a GPU), warm
  # and cold, then the same checkpoint loaded on the host: the same checksum.
  say "zeroflat load into cuda:0"
  CKPT=$LOGS/checkpoint
  if step write_checkpoint 120 "$BUILD/zeroflat" write-checkpoint "$CKPT" --model qwen3-30b-a3b \
    --layers 1 --experts 16 --quiet; then
    step load_cuda 120 "$BUILD/zeroflat" load "$CKPT" --device cuda:0 --verify --json --quiet
    step load_cuda_cold 120 "$BUILD/zeroflat" load "$CKPT" --device cuda:0 --cold --json --quiet
    # The ring's chunk size, warm: where the pinned ring stands against its ceiling.
    for RING in 64 256; do
      step "load_cuda_ring$RING" 120 "$BUILD/zeroflat" load "$CKPT" --device cuda:0 \
        --ring "${RING}MiB" --json --quiet
    done
    step load_cpu 120 "$BUILD/zeroflat" load "$CKPT" --device cpu --json --quiet
    rm -rf "$CKPT"
  fi
fi

# --- a Hugging Face checkpoint onto the GPU against Transformers and DCP (last: the longest) -----
if [ "$PYTHON_BUILT" = 1 ]; then
  # A Hugging Face checkpoint onto the GPU (0.92 GB, the shape of performance.md's FSDP2 table):
  # zeroflat against Transformers' from_pretrained and DCP's HF reader at its best thread count,
  # cold and warm, 3 rounds in fresh processes. Needs Transformers 5 in the Python.
  if [ "$(cat "$LOGS/fsdp_cuda.rc")" = 0 ] &&
    "$PYTHON" -c 'from transformers import DistributedConfig' 2>/dev/null; then
    ROUNDS=3
    [ "$BUDGET" -gt 0 ] && [ "$(left)" -lt 240 ] && ROUNDS=1 && NOTES+=("fsdp_load_bench: 1 round (the time budget)")
    say "fsdp_load_bench --device cuda, $ROUNDS round(s)"
    step fsdp_bench 330 env PYTHONPATH="$PYPATH" "$PYTHON" "$ROOT/benchmarks/fsdp_load_bench.py" \
      --device cuda --ranks 1 --cache cold,warm --repeat "$ROUNDS" --hidden 1024 --layers 12 \
      --vocab 151936 --methods transformers,zeroflat,dcp-best,zeroflat-dcp --dcp-threads 8 \
      --timeout 120 --dir "$LOGS/fsdp_checkpoint" --save "$LOGS/fsdp_bench.json"
    rm -rf "$LOGS/fsdp_checkpoint"
  else
    NOTES+=("fsdp_load_bench not run: no Transformers 5 here, or the CUDA DTensor load failed")
  fi
fi

# --- summary -------------------------------------------------------------------------------------
say "summary"
SUMMARY=$LOGS/gpu-results.md
export LOGS CARD COMMIT BUILT TESTS NVCC_VERSION
NOTES_TEXT=$(printf '%s\n' "${NOTES[@]+"${NOTES[@]}"}")
export NOTES_TEXT
if [ -n "$PYTHON" ]; then
  "$PYTHON" - >"$SUMMARY" <<'PY'
import datetime
import json
import os
import re

logs = os.environ["LOGS"]


def read(name, ext):
    try:
        with open(os.path.join(logs, f"{name}.{ext}")) as f:
            return f.read()
    except OSError:
        return None


def load(name):
    text = read(name, "out")
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def rc(name):
    r = read(name, "rc")
    return None if r is None else int(r.strip())


def tail(name, n=300):
    return (read(name, "err") or "").strip().replace("\n", " ")[-n:]


def fmt_ms(x):
    return "-" if x is None else (f"{x:.3f} ms" if x < 10 else f"{x:.1f} ms")


def fmt_bytes(b):
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b} B"


def met(value, target):
    m = re.match(r"([<>]=?)\s*([\d.]+)", target or "")
    if value is None or not m:
        return ""
    bound = float(m.group(2))
    ok = {"<": value < bound, "<=": value <= bound, ">": value > bound,
          ">=": value >= bound}[m.group(1)]
    return "yes" if ok else "**no**"


lines = []


def row(*cells):
    lines.append("| " + " | ".join(str(c) for c in cells) + " |")


lines.append(f"# zeroflat GPU check, {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}")
lines.append("")
lines.append(f"- card: {os.environ.get('CARD') or 'unknown (no nvidia-smi)'}")
lines.append(f"- commit: {os.environ.get('COMMIT')}")
lines.append(f"- nvcc: {os.environ.get('NVCC_VERSION') or 'none'}")
for note in filter(None, os.environ.get("NOTES_TEXT", "").split("\n")):
    lines.append(f"- note: {note}")
lines.append("")
row("figure", "zeroflat", "reference", "ratio", "target", "met")
row(*["---"] * 6)

# GPU tests
ctest = read("ctest", "out")
if ctest is not None:
    # "100% tests passed, 0 tests failed out of 11", or (newer CMake) "100% tests passed out of 11"
    m = re.search(r"(\d+)% tests passed,? (?:(\d+) tests failed )?out of (\d+)", ctest)
    skipped = len(re.findall(r"\(Skipped\)", ctest))
    if m:
        failed, total = int(m.group(2) or 0), int(m.group(3))
        passed = total - failed - skipped
        row("GPU tests (ctest -L gpu)",
            f"{passed} passed, {failed} failed, {skipped} skipped of {total}", "", "",
            "all pass", "yes" if failed == 0 and skipped == 0 else "**no**")
    else:
        row("GPU tests (ctest -L gpu)", f"no result (exit {rc('ctest')})", "", "", "", "**no**")
elif os.environ.get("TESTS") == "OFF":
    row("GPU tests", "not built (no GoogleTest)", "", "", "", "")

# zeroflat against its ceilings
bench = load("gpu_bench")
zf = {}
if bench and "rows" in bench:
    for r in bench["rows"]:
        name = f"{r['group']}: {r['name']} ({r['tensors']:,} tensors, {fmt_bytes(r['bytes'])})"
        if r.get("verified") is False:
            name += " **VERIFY FAILED**"
        extra = ", ".join(f"{k} {fmt_ms(v)}" for k, v in r.items()
                          if k.endswith("_ms") and k not in ("zeroflat_ms", "reference_ms"))
        ours = fmt_ms(r["zeroflat_ms"]) + (f" ({extra})" if extra else "")
        target = r.get("target", "")
        # A time target ("< 25 ms") is met by the time itself, a ratio target by the ratio.
        value = r["zeroflat_ms"] if target.startswith("<") else r.get("ratio")
        shown = fmt_ms(value) if target.startswith("<") else f"{value:.3f}"
        ok = "**no**" if r.get("verified") is False else met(value, target)
        row(name, ours, f"{fmt_ms(r['reference_ms'])} {r['reference']}", shown, target, ok)
        if r["group"] == "model":
            zf[r["name"]] = r
elif bench and "error" in bench:
    row("gpu_bench", f"failed: {bench['error']}", "", "", "", "**no**")
elif rc("gpu_bench") is not None:
    row("gpu_bench", f"failed (exit {rc('gpu_bench')}): {tail('gpu_bench')}", "", "", "", "**no**")

# zeroflat against torch.cat on the same tensors
torch = load("torch")
if torch and "rows" in torch:
    for t in torch["rows"]:
        name = t["name"]
        if "error" in t:
            row(f"torch.cat, {name}", "", t["error"], "", "", "")
            continue
        copy, e2e = zf.get(name), zf.get(name + ", end to end")
        target = ">= 1.1" if t["tensors"] == 12579 else ""
        label = f"{name} ({t['tensors']:,} tensors)"
        if copy:
            for key, what in (("cat_out_ms", "torch.cat(out=)"),
                              ("flatten_warm_ms", "_flatten_dense_tensors, output cached")):
                ratio = t[key] / copy["zeroflat_ms"]
                row(f"GPU flatten (copy) / {what}, {label}", fmt_ms(copy["zeroflat_ms"]),
                    fmt_ms(t[key]), f"{ratio:.3f}", target, met(ratio, target))
        else:
            row(f"torch.cat(out=), {label}", "", fmt_ms(t["cat_out_ms"]), "", "", "")
        if e2e:
            ratio = t["flatten_cold_ms"] / e2e["zeroflat_ms"]
            row(f"GPU flatten (end to end) / _flatten_dense_tensors, fresh output, {label}",
                fmt_ms(e2e["zeroflat_ms"]), fmt_ms(t["flatten_cold_ms"]), f"{ratio:.3f}", target,
                met(ratio, target))
    row(f"(torch {torch.get('torch')}, CUDA {torch.get('cuda')})", "", "", "", "", "")
elif torch and "error" in torch:
    row("torch_cat_bench", "", f"failed: {torch['error']}", "", "", "")
elif rc("torch") is not None:
    row("torch_cat_bench", "", f"failed (exit {rc('torch')}): {tail('torch')}", "", "", "")


def find(doc, key):
    if isinstance(doc, dict):
        if key in doc:
            return doc[key]
        doc = list(doc.values())
    if isinstance(doc, list):
        for v in doc:
            r = find(v, key)
            if r is not None:
                return r
    return None


# zeroflat run, on the GPU and on the host: the same model must give the same checksum
runs = {}
keys = ["outcome", "tier", "verified", "flatten_gbps", "flatten_over_memcpy", "end_to_end_gbps",
        "end_to_end_over_fresh_memcpy", "predicted_peak_device_bytes",
        "measured_peak_device_bytes", "checksum"]
for dev, spec in (("cuda", "cuda:0"), ("cpu", "cpu")):
    code = rc(f"run_{dev}")
    if code is None:
        continue
    doc = load(f"run_{dev}")
    label = f"zeroflat run --device {spec}, 4 layers"
    if code != 0 or doc is None:
        row(label, f"failed (exit {code}): {tail(f'run_{dev}')}", "", "", "",
            "**no**" if dev == "cuda" else "")
        continue
    runs[dev] = doc
    row(label, ", ".join(f"{k} {find(doc, k)}" for k in keys if find(doc, k) is not None),
        "", "", "", "")
if "cuda" in runs and "cpu" in runs:
    a, b = find(runs["cuda"], "checksum"), find(runs["cpu"], "checksum")
    if a is not None and b is not None:
        row("checksum cuda:0 = cpu", a, b, "", "equal", "yes" if a == b else "**no**")

# zeroflat load into cuda:0 against a plain read plus cudaMemcpy of the same bytes
loads = {}
for name, label in (("load_cuda", "warm"), ("load_cuda_cold", "cold"),
                    ("load_cuda_ring64", "warm, --ring 64MiB"),
                    ("load_cuda_ring256", "warm, --ring 256MiB"), ("load_cpu", "cpu")):
    code = rc(name)
    if code is None:
        continue
    doc = load(name)
    if code != 0 or doc is None:
        row(f"zeroflat load ({label}), 1 layer, 16 experts", f"failed (exit {code}): {tail(name)}",
            "", "", "", "**no**")
        continue
    loads[label] = doc
    if label == "cpu":
        continue
    r0 = doc["ranks"][0]
    ceiling = (doc.get("ceiling") or {}).get("read_gbps")
    ratio = doc["read_gbps"] / ceiling if ceiling else None
    row(f"load into cuda:0 through the pinned ring, {label} ({fmt_bytes(doc['checkpoint_bytes'])}, "
        f"page cache {doc.get('page_cache')})",
        f"{doc['read_gbps']:.2f} GB/s, peak {fmt_bytes(r0['measured_peak_device_bytes'])} "
        f"(predicted {fmt_bytes(r0['predicted_peak_device_bytes'])})"
        + (", verified" if r0.get("verified") else ""),
        f"{ceiling:.2f} GB/s read + cudaMemcpy" if ceiling else "-",
        f"{ratio:.3f}" if ratio else "-", ">= 0.8", met(ratio, ">= 0.8"))
code = rc("fsdp_cuda")
if code is not None:
    text = (read("fsdp_cuda", "out") or "").strip().splitlines()
    row("zeroflat.fsdp.load into CUDA DTensors (FSDP2, bf16 checkpoint into fp32 and bf16)",
        text[-1] if text else f"exit {code}: {tail('fsdp_cuda')}", "", "", "passed",
        "yes" if code == 0 else "**no**")
# A Hugging Face checkpoint onto the GPU: zeroflat against Transformers and DCP's reader
bench = None
try:
    with open(os.path.join(logs, "fsdp_bench.json")) as f:
        bench = json.load(f)
except (OSError, ValueError):
    if rc("fsdp_bench") not in (None, 0):
        row("fsdp_load_bench --device cuda", f"failed (exit {rc('fsdp_bench')}): "
            f"{tail('fsdp_bench')}", "", "", "", "**no**")
for r in (bench or {}).get("rows", []):
    where = f"{r['ranks']} rank(s) on cuda, {r['cache']} ({bench['checkpoint_gb']:.2f} GB)"
    for ours, theirs, need in (("zeroflat", "transformers", 1.0),
                               ("zeroflat-dcp", "dcp-best", 1.5 if r["cache"] == "cold" else 1.0)):
        rounds = r.get(f"{ours} vs {theirs}")
        if not rounds:
            continue
        o, t = r[ours], r[theirs]
        row(f"HF checkpoint to ready, {where}: {ours} / {theirs} (each round "
            f"{', '.join(f'{x:.2f}' for x in rounds)}; devices {'/'.join(o.get('devices', []))})",
            f"{o['median']:.2f} s", f"{t['median']:.2f} s", f"{sorted(rounds)[len(rounds) // 2]:.3f}",
            f">= {need:g} every round", "yes" if min(rounds) >= need else "**no**")
    if not r.get("same_values", True):
        row(f"HF checkpoint, {where}: the same values every way", "NO", "", "", "equal", "**no**")
if "warm" in loads and "cpu" in loads:
    a = loads["warm"]["ranks"][0]["checksum"]
    b = loads["cpu"]["ranks"][0]["checksum"]
    row("load checksum cuda:0 = cpu", a, b, "", "equal", "yes" if a == b else "**no**")
print("\n".join(lines))
PY
else
  {
    echo "# zeroflat GPU check (no Python: raw results)"
    for f in "$LOGS"/*.out; do echo "## $(basename "$f")"; tail -c 4000 "$f"; done
  } >"$SUMMARY"
fi
cat "$SUMMARY"

if [ -n "${OUT:-}" ]; then
  # Two files (a device machine returns few): the table, and every step's output in one archive.
  cp "$SUMMARY" "$OUT/gpu-results.md"
  tar -czf "$OUT/gpu-logs.tar.gz" -C "$LOGS" --exclude=checkpoint . 2>/dev/null
fi

# --- exit status ---------------------------------------------------------------------------------
STATUS=0
if [ -f "$LOGS/ctest.rc" ]; then
  [ "$(cat "$LOGS/ctest.rc")" = 0 ] || STATUS=1
  if [ -n "$CARD" ] && grep -q "tests passed" "$LOGS/ctest.out" &&
    ! grep -qE "Test +#[0-9]+: .* Passed" "$LOGS/ctest.out"; then
    say "every GPU test skipped although nvidia-smi sees $CARD"
    STATUS=1
  fi
elif [ "$TESTS" = ON ] && [ -n "$CARD" ] && want native; then
  STATUS=1  # a GPU machine where the tests could not even be built
fi
if [ -f "$LOGS/fsdp_cuda.rc" ]; then
  FSDP_RC=$(cat "$LOGS/fsdp_cuda.rc")
  # A failure, or a skip (77) on a machine whose driver sees a GPU.
  if [ "$FSDP_RC" != 0 ] && { [ "$FSDP_RC" != 77 ] || [ -n "$CARD" ]; }; then STATUS=1; fi
fi
say "done, exit $STATUS"
exit "$STATUS"
