"""Rollout speed with LoRA: the sampler on the adapted model as is (two extra small matmuls per adapted projection
and token) vs merging the adapters into the weights once per rollout (W += s B A for the sampler, then W restored
from a copy, both timed with it). Interleaved repeats; prints each median and the ratio.

    python scripts/bench_lora.py --preset tiny --overrides hidden_size=96,intermediate_size=288,num_hidden_layers=2
    python scripts/bench_lora.py --preset 25m
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fast  # noqa: E402
import model as M  # noqa: E402
from data import parse_knobs  # noqa: E402
from lora import add_lora, lora_layers  # noqa: E402
from sampler import generate  # noqa: E402


def merged_rollout(model, prompts, args):
    """Merge once, sample, restore the base bitwise from a copy: what a merge-per-rollout sampler would pay."""
    layers = lora_layers(model).values()
    saved = [m.weight.detach().clone() for m in layers]
    with torch.no_grad():
        for m in layers:
            m.weight += m.delta().to(m.weight.dtype)
            m.enabled = False
        out = generate(model, prompts, args.new_tokens, num_samples=args.group, eos_ids=[], temperature=1.0,
                       generator=torch.Generator().manual_seed(0))
        for m, w in zip(layers, saved):
            m.weight.copy_(w)
            m.enabled = True
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny")
    p.add_argument("--overrides", default="")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new_tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch.set_flush_denormal(True)  # as the training scripts do
    torch.manual_seed(0)
    model = M.Transformer(M.preset_config(args.preset, 100, **parse_knobs(args.overrides))).eval()
    fast.use_onednn(add_lora(model, args.rank, 2.0 * args.rank))  # as grpo.py runs it
    prompts = [list(range(1, 20 + i)) for i in range(args.prompts)]
    plain = lambda: generate(model, prompts, args.new_tokens, num_samples=args.group, eos_ids=[], temperature=1.0,
                             generator=torch.Generator().manual_seed(0))
    times = {"unmerged": [], "merge_per_rollout": []}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for name, fn in (("unmerged", plain), ("merge_per_rollout", lambda: merged_rollout(model, prompts, args))):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    rows = args.prompts * args.group
    print(f"{args.preset} {args.overrides or ''} rank {args.rank}: {rows} rows x {args.new_tokens} tokens, "
          f"unmerged {med['unmerged']:.3f}s, merge per rollout {med['merge_per_rollout']:.3f}s, "
          f"unmerged / merged = {med['unmerged'] / med['merge_per_rollout']:.2f}")


if __name__ == "__main__":
    main()
