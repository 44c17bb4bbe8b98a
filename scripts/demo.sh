#!/usr/bin/env bash
# The main job on its built-in default: sets up what is missing, builds, then on this machine's
# CPU flattens one decoder layer of Qwen3-30B-A3B (16 experts, 1.43 GB of bf16 parameters, no
# download) on one rank and on two ranks with the sharded tier, verifying every byte and
# reporting bandwidth against memcpy measured in the same run; then rehearses the seed's 32- and
# 48-layer scenarios at full size on eight simulated H100s; then writes the same layer as a
# safetensors checkpoint (into a temporary directory, removed at the end) and loads it straight
# into the flat buffers at one and two ranks, each reading only its partition, and rehearses the
# 48-layer load. Needs about 15 GB of free memory and 1.5 GB of disk.
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
