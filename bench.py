"""Sampler benchmark: sampler.generate vs transformers' generate on the same weights.

    python bench.py            # tiny and 25m presets, CPU (and CUDA when present); ~2 minutes on 2 idle cores
    python bench.py --quick    # fewer repetitions

Both sides get the same checkpoint (save_model, then AutoModelForCausalLM.from_pretrained), the same 64 ragged
prompts of ~32 tokens (left-padded for HF), fp32, plain sampling at temperature 1 and exactly 128 new tokens
(no EOS: eos_ids=() here, eos_token_id=None and min_new_tokens=128 there). Times are medians over repetitions,
the two sides interleaved so background load hits both alike. Also printed: the decode's achieved GFLOP/s (its
matmul FLOPs over its time) next to plain torch.matmul on the same shapes, i.e. this machine's ceiling for them.
Speedups are medians of per-repetition ratios. The last line is machine-readable: the smallest speedup over
all configs and devices. --compile adds generate(compile=True) timings, reported apart from the summary.
"""

import argparse
import os
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from model import Transformer, load_model, preset_config, save_model
from sampler import generate

BATCH, NEW, VOCAB = 64, 128, 100


def timed(fn, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t


def decode_flops(cfg, N, prompt_len):
    """Matmul FLOPs of the NEW - 1 decode steps: the linear layers plus attention over the growing cache."""
    C, H, D, kv = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads
    linear = C * (H + 2 * kv) * D + H * D * C + 3 * C * cfg.intermediate_size  # weights per layer
    per_step = 2 * N * (cfg.num_hidden_layers * linear + C * cfg.vocab_size)
    keys = sum(prompt_len + t for t in range(1, NEW))  # slots attended, summed over steps
    return (NEW - 1) * per_step + cfg.num_hidden_layers * 4 * N * H * D * keys


def matmul_gflops(cfg, N, device, reps):
    """torch.matmul alone on one decode step's linear shapes: (N, in) @ (in, out)."""
    C, H, D, kv, I = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads, \
        cfg.intermediate_size
    shapes = [(C, H * D), (C, kv * D), (C, kv * D), (H * D, C), (C, I), (C, I), (I, C)] * cfg.num_hidden_layers
    shapes.append((C, cfg.vocab_size))
    xs = [(torch.randn(N, i, device=device), torch.randn(i, o, device=device)) for i, o in shapes]
    flops = sum(2 * N * i * o for i, o in shapes)
    run = lambda: [torch.matmul(x, w) for x, w in xs]
    run()
    return flops / statistics.median(timed(run, device) for _ in range(reps * 10)) / 1e9


def bench(name, device, reps, compile):
    torch.manual_seed(0)
    cfg = preset_config(name, VOCAB)
    with tempfile.TemporaryDirectory() as d:
        save_model(Transformer(cfg), d)
        ours = load_model(d, device)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(device).eval()
    g = torch.Generator(device).manual_seed(0)
    lens = torch.randint(28, 37, (BATCH,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [torch.randint(3, VOCAB, (n,)).tolist() for n in lens]
    L = max(lens)
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts], device=device)  # HF: left-padded + mask
    attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=device)
    hf_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW,
                              min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)

    def run_ours(n=NEW, compile=False):
        out = generate(ours, prompts, n, eos_ids=(), generator=g, compile=compile)
        assert out.tokens.shape == (BATCH, n) and out.mask.all()

    def run_hf():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=attn, generation_config=hf_cfg)
        assert out.shape == (BATCH, L + NEW)

    run_ours(), run_hf()  # warm-up
    if compile:
        run_ours(compile=True)  # compiles (tens of seconds on CPU)
    t = {"ours": [], "hf": [], "prefill": [], "compiled": []}
    for _ in range(reps):  # interleaved, so a burst of background load hits both sides
        t["ours"].append(timed(run_ours, device))
        t["hf"].append(timed(run_hf, device))
        t["prefill"].append(timed(lambda: run_ours(1), device))
        if compile:
            t["compiled"].append(timed(lambda: run_ours(compile=True), device))
    med = {k: statistics.median(v) for k, v in t.items() if v}
    speedup = statistics.median(h / o for h, o in zip(t["hf"], t["ours"]))  # of each adjacent pair
    params = sum(p.numel() for p in ours.parameters())
    achieved = decode_flops(cfg, BATCH, sum(lens) / BATCH) / (med["ours"] - med["prefill"]) / 1e9
    print(f"{name} ({params / 1e6:.2f}M params) {device.type}: ours {BATCH * NEW / med['ours']:,.0f} tok/s "
          f"({med['ours']:.2f}s, prefill {med['prefill']:.2f}s), HF generate {BATCH * NEW / med['hf']:,.0f} tok/s "
          f"({med['hf']:.2f}s), speedup {speedup:.2f}x | decode {achieved:.1f} GFLOP/s vs torch.matmul on the same "
          f"shapes {matmul_gflops(cfg, BATCH, device, reps):.1f} GFLOP/s", flush=True)
    if compile:
        print(f"{name} {device.type}: ours with compile=True {BATCH * NEW / med['compiled']:,.0f} tok/s "
              f"({med['compiled']:.2f}s), {med['hf'] / med['compiled']:.2f}x HF generate (not in the summary)")
    return speedup


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 repetitions instead of 7")
    p.add_argument("--configs", default="tiny,25m", help="comma-separated presets")
    p.add_argument("--compile", action="store_true", help="also time generate(compile=True), reported apart")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for both sides (0: torch's default)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    results = {}
    print(f"batch {BATCH}, prompts 28-36 tokens, {NEW} new tokens, fp32, {torch.get_num_threads()} CPU threads, "
          f"load average {os.getloadavg()[0]:.1f} (other processes skew CPU timings)")
    for device in devices:
        for name in args.configs.split(","):
            s = results[f"{name}/{device.type}"] = bench(name, device, 3 if args.quick else 7, args.compile)
            print(f"sampler_vs_hf_generate config={name} device={device.type} speedup={s:.2f}x", flush=True)
    worst = min(results, key=results.get)
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"sampler_vs_hf_generate speedup={results[worst]:.2f}x (worst of {', '.join(results)}: {worst})")


if __name__ == "__main__":
    main()
