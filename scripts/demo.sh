#!/usr/bin/env bash
# The main job on its built-in default: sets up what is missing, builds, then flattens one
# decoder layer of Qwen3-30B-A3B (16 experts, 1.43 GB of bf16 parameters, no download) on this
# machine's CPU, verifies every byte, and reports bandwidth against memcpy measured in the same
# run. Needs about 5 GB of free memory.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$here/scripts/setup.sh" "$here/build"
zf="$here/build/zeroflat"

echo
echo "\$ zeroflat layout --numels 5,7,3 --dp 4"
"$zf" layout --numels 5,7,3 --dp 4
echo
echo "\$ zeroflat run --model qwen3-30b-a3b --layers 1 --experts 16 --verify"
"$zf" run --model qwen3-30b-a3b --layers 1 --experts 16 --verify
