#!/usr/bin/env bash
# The GPU acceptance run (#13, #48, #50): logits vs transformers; no SDPA call of a GRPO micro-batch, a padded batch or
# a decode on the math kernel; sampler tok/s vs transformers and the bandwidth bound; the decode modes at GRPO's
# shape; SFT and GRPO steps of the Qwen2.5-1.5B shape, plain and FSDP2 on one rank; rollout tok/s of
# --rollout vllm vs the sampler vs transformers at that shape (needs vllm installed). Every part's rows are appended
# to --out (JSON lines) and OUT.md (a markdown table) as soon as it ends. `--tiny`: the same on the CPU at toy
# shapes (a test runs it). On one H100 (15 minutes of device time, start-up included), three commands:
#   scripts/gpu_check.sh --only logits,kernels,sampler,decode --out "$OUT/gpu_check.jsonl"   # ~4 min
#   scripts/gpu_check.sh --only train --out "$OUT/gpu_check.jsonl"                            # ~4 min
#   scripts/gpu_check.sh --only vllm --out "$OUT/gpu_check.jsonl"    # ~2 min; first: pip install vllm
# Estimated, not measured: model dirs ~10 s each (3 shapes, bf16); logits ~1 min (2 models, 2 loads each);
# kernels ~20 s; sampler ~1.5 min (2 models x 2 batches x warm-up + 2 runs, 128 tokens, ours and HF's generate);
# decode ~1 min (3 modes x 3 runs of 64 rows x 128 tokens); train 4 runs of 5 steps at 1.5B, each ~45-60 s with
# its start (no checkpoint written: --save_checkpoints writes them, ~25 GB each); vllm: the engine's start (~30-60 s)
# and 3 x 3 rollouts of 64 rows x 128 tokens. Needs ~8 GB of free disk.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python scripts/gpu_check.py "$@"
