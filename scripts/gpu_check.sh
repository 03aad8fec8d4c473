#!/usr/bin/env bash
# The GPU acceptance run (#13): logits vs transformers, sampler tok/s vs transformers and the bandwidth bound, the
# decode modes (growing, shared prompt, compiled, fused) at GRPO's shape, SFT and GRPO steps of the
# Qwen2.5-1.5B shape, plain and FSDP2 on one rank; one JSON file and a table. Prepared to finish in ~10 minutes on
# one H200 (not yet run on one). `scripts/gpu_check.sh --tiny` runs the same on the CPU at toy shapes (a test does).
#   scripts/gpu_check.sh [--out gpu_check.json] [--hbm_gbs 4800] [--only logits,sampler,decode,train]
#   scripts/gpu_check.sh --out "$OUT/gpu_check.json"    # on a lent device machine: the JSON comes back
# Needs ~30 GB of free disk (model dirs, one 1.5B checkpoint at a time) and ~60 GB of GPU memory.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python scripts/gpu_check.py "$@"
