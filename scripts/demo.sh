#!/usr/bin/env bash
# The main job on its built-in default: sets up what is missing, builds, then on this machine's
# CPU flattens one decoder layer of Qwen3-30B-A3B (16 experts, 1.43 GB of bf16 parameters, no
# download) on one rank and on two ranks with the sharded tier, verifying every byte and
# reporting bandwidth against memcpy measured in the same run; then rehearses the seed's 32- and
# 48-layer scenarios at full size on eight simulated H100s; then writes the same layer as a
# safetensors checkpoint (into a temporary directory, removed at the end) and loads it straight
# into the flat buffers at one and two ranks, each reading only its partition, and rehearses the
# 48-layer load; last, DeepSpeed itself saves a small ZeRO-2 checkpoint at two ranks (about 20M
# parameters, on the CPU) and zeroflat resumes it at two and at three ranks, each rank reading
# its share of the fp32 master and Adam's states (the table shows its bytes read against its
# share); then zeroflat's drop-in saves it again in the background (the call returns once the
# state is snapshotted, steps run while it is written), resumes from it, and the command line
# loads what it wrote at three ranks. Needs about 15 GB of free memory and 1.7 GB of disk.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$here/scripts/setup.sh" "$here/build"
zf="$here/build/zeroflat"

show() {
  echo
  echo "\$ zeroflat $*"
  "$zf" "$@"
}
show layout --numels 5,7,3 --dp 4
show run --model qwen3-30b-a3b --layers 1 --experts 16 --verify
show run --model qwen3-30b-a3b --layers 1 --experts 16 --dp 2 --tier sharded --verify
show run --model qwen3-30b-a3b --layers 32 --device sim:h100-80gb --no-data --dp 8
show run --model qwen3-30b-a3b --layers 48 --device sim:h100-80gb --no-data --dp 8
ckpt="$(mktemp -d)"
trap 'rm -rf "$ckpt"' EXIT
show write-checkpoint "$ckpt/qwen3-1-layer" --model qwen3-30b-a3b --layers 1 --experts 16
show load "$ckpt/qwen3-1-layer" --verify
show load "$ckpt/qwen3-1-layer" --dp 2 --verify
show load --model qwen3-30b-a3b --layers 48 --device sim:h100-80gb --no-data --dp 8
python="${ZEROFLAT_VENV:-$here/.venv}/bin/python"
if [[ "${ZEROFLAT_NO_PYTHON:-0}" == 1 || ! -x "$python" ]]; then
  echo
  echo "(the resume of a DeepSpeed checkpoint is left out: it needs the Python environment," \
       "which ZEROFLAT_NO_PYTHON=1 skips)"
  exit 0
fi
echo
echo "\$ python scripts/demo_checkpoint.py \$CKPT --world 2 --stage 2 --zeroflat-save \$CKPT2"
echo "  # DeepSpeed's own save, then zeroflat's in the background, steps while it writes, a resume"
PYTHONPATH="$here/build/python" OMP_NUM_THREADS=1 "$python" "$here/scripts/demo_checkpoint.py" \
  "$ckpt/deepspeed-zero2" --world 2 --stage 2 --zeroflat-save "$ckpt/zeroflat-zero2" 2>&1 |
  grep -v "WARNING" || true
test -f "$ckpt/deepspeed-zero2/latest" || { echo "demo: DeepSpeed did not save the checkpoint" >&2; exit 1; }
test -f "$ckpt/zeroflat-zero2/latest" || { echo "demo: the drop-in did not save the checkpoint" >&2; exit 1; }
show load "$ckpt/deepspeed-zero2" --from deepspeed --dp 2 --verify
show load "$ckpt/deepspeed-zero2" --from deepspeed --dp 3 --verify
show load "$ckpt/zeroflat-zero2" --from deepspeed --dp 3 --verify
