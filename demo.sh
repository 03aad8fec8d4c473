#!/usr/bin/env bash
# The whole R1 pipeline on a laptop CPU, on the built-in arithmetic task — three stage commands in sequence:
#   1. sft.py   a fresh tiny Llama learns the <think>…</think> <answer>…</answer> format from worked solutions
#               of the first 5% of the training problems (1,000: scarce, on purpose);
#   2. grpo.py  GRPO on the other 95%, rewarded only by whether the final answer is exactly right (+ format);
#   3. eval.py  greedy pass@1, pass@8 / maj@8 (8 samples at T=1) and format rate, before and after GRPO, on 400
#               held-out test problems; then a before/after table and a PNG of the GRPO run.
#
#   bash demo.sh                      # defaults: 2 processes (torchrun), runs/ as the output folder
#   NPROC=1 OUT=/tmp/demo bash demo.sh
#   SFT_FLAGS="--steps 20" GRPO_FLAGS="--steps 5" EVAL_FLAGS="--split test[:16]" bash demo.sh   # a quick try
# Stopped midway? Run it again: each stage resumes from its newest checkpoint (--resume auto). To start over,
# delete $OUT or pick another OUT.
set -euo pipefail
cd "$(dirname "$0")"

NPROC=${NPROC:-2}    # processes per stage (data parallel over CPU cores or GPUs)
OUT=${OUT:-runs}     # everything goes under this folder
read -r -a SFT <<<"${SFT_FLAGS:-}"
read -r -a GRPO <<<"${GRPO_FLAGS:-}"
read -r -a EVAL <<<"${EVAL_FLAGS:-}"

launch() {  # launch SCRIPT FLAGS...: torchrun with NPROC processes, or plain python for one
  if [ "$NPROC" -gt 1 ]; then
    python -m torch.distributed.run --standalone --nproc_per_node="$NPROC" "$@"
  else
    python "$@"
  fi
}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per process: NPROC processes share the cores

echo "== 1/3 SFT warm start -> $OUT/sft/model"
launch sft.py --out_dir "$OUT/sft" ${SFT[@]+"${SFT[@]}"}

echo "== 2/3 GRPO -> $OUT/grpo"
launch grpo.py --init "$OUT/sft/model" --out_dir "$OUT/grpo" ${GRPO[@]+"${GRPO[@]}"}

echo "== 3/3 eval before (SFT) and after (GRPO) on held-out problems"
launch eval.py --model "$OUT/sft/model" --out_dir "$OUT/eval_sft" --samples 8 --temperature 1 ${EVAL[@]+"${EVAL[@]}"}
launch eval.py --model "$OUT/grpo" --out_dir "$OUT/eval_grpo" --samples 8 --temperature 1 ${EVAL[@]+"${EVAL[@]}"}

python - "$OUT" <<'EOF'
import json, sys
out = sys.argv[1]
rows = [("SFT", f"{out}/eval_sft/summary.json"), ("SFT + GRPO", f"{out}/eval_grpo/summary.json")]
print(f"\n{'model':12s} {'greedy pass@1':>14s} {'pass@8 (T=1)':>13s} {'maj@8':>7s} {'format':>7s}")
for name, path in rows:
    s = json.load(open(path))
    g, t = s["greedy"], s["sampled"]
    print(f"{name:12s} {g['pass@1']:14.3f} {t.get('pass@8', float('nan')):13.3f} {t.get('maj@8', float('nan')):7.3f}"
          f" {g['format']:7.3f}")
EOF
if python -c "import matplotlib" 2>/dev/null; then
  python plot.py "$OUT/grpo" --out "$OUT/grpo.png"
else
  echo "(pip install matplotlib, or -e \".[plot]\", for the plot: python plot.py $OUT/grpo)"
fi
