"""The memory estimate grpo.py prints at start against the peak host memory the same run reaches, on CPU.

    nice -n 10 python scripts/measure_memory.py                          # Qwen2.5-0.5B's shape, 2 prompts x G=4
    nice -n 10 python scripts/measure_memory.py --shape small --prompts 4 --max_new_tokens 256 --template r1
    nice -n 10 python scripts/measure_memory.py ... -- --activation_checkpointing   # flags after -- go to grpo.py

Writes a random-init HF model dir of the shape (the char tokenizer, the shape's vocab: a random model samples from
all of it and never stops early, so every completion is --max_new_tokens long, the estimate's worst case), then runs
grpo.py on it in a child process for --steps steps with a random reward (every group has reward variance, so every
row trains), one process, fp32, no eval. Prints the estimate, the run's peak RSS (its mem_peak_mb, the kernel's
ru_maxrss) and their ratio. At the default shape the run holds several GB for minutes: run it alone.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096),
    "small": dict(model_type="qwen2", vocab_size=151_936, hidden_size=256, intermediate_size=768,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  max_position_embeddings=4096),
}

# the child: grpo.main with the reward replaced by a seeded random number
CHILD = r"""
import random, sys
import grpo
rng = random.Random(0)
grpo.rewards.reward = lambda *a, **k: {"reward": rng.random(), "correct": 0.0, "format": 0.0}
grpo.main(sys.argv[1:])
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--prompts", type=int, default=2, help="prompts per step (one process)")
    ap.add_argument("--group_size", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--template", default="short", choices=["short", "r1"])
    ap.add_argument("--steps", type=int, default=2, help="the peak is in step 2: AdamW's moments exist from step 1")
    ap.add_argument("--work_dir", default=os.path.join(tempfile.gettempdir(), "minigrpo_measure_memory"))
    args, grpo_flags = ap.parse_known_args()
    grpo_flags = [f for f in grpo_flags if f != "--"]
    import torch

    import model as model_lib
    from hf import char_tokenizer, save_model

    work = Path(args.work_dir)
    model_dir = work / f"model_{args.shape}"
    if not (model_dir / "config.json").is_file():  # built once, in this (parent) process
        torch.manual_seed(0)
        tok = char_tokenizer()
        cfg = model_lib.ModelConfig(**SHAPES[args.shape], bos_token_id=1, eos_token_id=2, pad_token_id=0)
        save_model(model_lib.Transformer(cfg), model_dir, tok)
    run_dir = work / "run"
    flags = ["--init", str(model_dir), "--out_dir", str(run_dir), "--overwrite", "--steps", str(args.steps),
             "--prompts_per_step", str(args.prompts), "--group_size", str(args.group_size), "--gen_batch",
             str(args.prompts), "--max_new_tokens", str(args.max_new_tokens), "--template", args.template,
             "--eval_every", "0", "--warmup", "1", "--save_every", "0", "--keep", "1", *grpo_flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", CHILD, *flags], cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(p.stdout[-2000:] + p.stderr[-3000:])
    line = next(x for x in p.stdout.splitlines() if x.startswith("memory estimate per rank"))
    estimate = float(line.split(":")[1].split("GB")[0])
    rows = [json.loads(x) for x in open(run_dir / "metrics.jsonl")]
    peak = max(r["mem_peak_mb"] for r in rows) * 2**20 / 1e9
    print(f"grpo.py {' '.join(flags[4:])}")
    print(line)
    print(f"measured: peak RSS {peak:.2f} GB; estimate / measured = {estimate / peak:.2f}; per step: "
          + ", ".join(f"gen {r['t_generate']:.0f} s train {r['t_train']:.0f} s" for r in rows))


if __name__ == "__main__":
    main()
