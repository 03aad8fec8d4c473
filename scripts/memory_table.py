"""The README's memory table: grpo.py's own estimate (memory.memory_estimate, what every run prints at start and
`--dry_run` prints alone) per GPU, for four model shapes at the README's GSM8K recipe, on 1 and 8 GPUs; then
the README's single-GPU LoRA recipes for 3B and 8B.

    python scripts/memory_table.py                  # the recipe: --dtype bfloat16 --dist fsdp, G=16, 512 new tokens
    python scripts/memory_table.py --prompt_len 300

Shapes are the models' published config.json values (no download needed). Prompts are taken --prompt_len tokens
long and every completion --max_new_tokens long: the worst case the estimate assumes.
"""

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpo  # noqa: E402
from common import parse_config  # noqa: E402
from memory import lora_param_count, memory_estimate, memory_shapes, param_count  # noqa: E402
from model import ModelConfig  # noqa: E402

SHAPES = {
    "Qwen2.5-0.5B": dict(model_type="qwen2", vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "Qwen2.5-1.5B": dict(model_type="qwen2", vocab_size=151_936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "Llama-3.2-3B": dict(model_type="llama", vocab_size=128_256, hidden_size=3072, intermediate_size=8192,
                         num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True),
    "Llama-3.1-8B": dict(model_type="llama", vocab_size=128_256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt_len", type=int, default=256, help="tokens in the longest prompt (GSM8K + template)")
    ap.add_argument("--micro_batch_tokens", type=int, default=16384, help="the budget of the last two columns")
    args = ap.parse_args()
    recipe = grpo.GRPOConfig(prompts_per_step=64, group_size=16, max_new_tokens=512, gen_batch=8,
                             train_micro_batch=16, dtype="bfloat16", dist="fsdp", beta=0.04)
    budget = replace(recipe, activation_checkpointing=True, train_micro_batch=0,
                     micro_batch_tokens=args.micro_batch_tokens)
    print(f"GB per GPU; recipe: --prompts_per_step 64 --group_size 16 --max_new_tokens 512 --gen_batch 8 "
          f"--train_micro_batch 16 --beta 0.04 --dtype bfloat16 --dist fsdp, prompts of {args.prompt_len} tokens; "
          f"AC: + --activation_checkpointing --micro_batch_tokens {args.micro_batch_tokens} --train_micro_batch 0")
    print()
    print("| model | params | 1 GPU | 1 GPU, AC | 8 GPUs | 8 GPUs, AC |")
    print("|---|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        cfg = ModelConfig(**shape)
        cells = []
        for world, flags in [(1, recipe), (1, budget), (8, recipe), (8, budget)]:
            est = memory_estimate(cfg, **memory_shapes(flags, "grpo", world, args.prompt_len, "cuda"))
            phase = {"generation": "gen", "training": "train", "optimizer step": "step"}[est["phase"]]
            cells.append(f"{est['peak'] / 1e9:.1f} ({phase})")
        print(f"| {name} | {param_count(cfg) / 1e9:.2f}B | " + " | ".join(cells) + " |")
    lora_table(args.prompt_len)


# the README's single-GPU LoRA recipes (grpo.py flags besides --init, --task, --template, --split, --out_dir)
LORA_RECIPES = {
    "Llama-3.2-3B": "--lora_rank 16 --lora_base_dtype bfloat16 --dtype bfloat16 --beta 0.04 --max_new_tokens 512 "
                    "--prompts_per_step 16 --group_size 8 --gen_batch 4 --train_micro_batch 2",
    "Llama-3.1-8B": "--lora_rank 16 --lora_base_dtype bfloat16 --dtype bfloat16 --beta 0.04 --max_new_tokens 512 "
                    "--prompts_per_step 16 --group_size 8 --gen_batch 2 --train_micro_batch 2 "
                    "--activation_checkpointing",
}


def lora_table(prompt_len: int):
    """The LoRA recipes on one GPU: the estimate's parts, and full fine-tuning at the same flags for contrast."""
    print(f"\nLoRA on one GPU, GB (prompts of {prompt_len} tokens; + ~1.5 GB of CUDA context and workspace):\n")
    print("| model | adapters | base | adapters + AdamW | KV cache | activations | peak | full fine-tuning |")
    print("|---|---|---|---|---|---|---|---|")
    for name, flags in LORA_RECIPES.items():
        cfg = ModelConfig(**SHAPES[name])
        run = parse_config(grpo.GRPOConfig, flags.split())
        est = memory_estimate(cfg, **memory_shapes(run, "grpo", 1, prompt_len, "cuda"))
        full = replace(run, lora_rank=0, weights_dtype="float32")
        full_est = memory_estimate(cfg, **memory_shapes(full, "grpo", 1, prompt_len, "cuda"))
        p = lora_param_count(cfg, run.lora_rank, run.lora_targets)
        base = est["weights"] - 4 * p
        gb = lambda x: f"{x / 1e9:.1f}"
        print(f"| {name} | {p / 1e6:.1f}M | {gb(base)} | {gb(4 * p + est['gradients'] + est['optimizer'])} | "
              f"{gb(est['kv_cache'])} | {gb(est['activations'])} | {gb(est['peak'])} ({est['phase']}) | "
              f"{gb(full_est['peak'])} |")


if __name__ == "__main__":
    main()
