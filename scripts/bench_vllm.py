"""Rollout throughput side by side: grpo.py --rollout vllm (rollout_vllm.VLLMEngine) vs the hand-written sampler
(sampler.generate, grpo.py's default) vs transformers' generate, on one random-init model of a real shape, for
--prompts prompts x G=--group samples x --new tokens (no stop token: every row decodes all of them). Prints
tokens/s (medians of --repeats runs after a warm-up) and each one's ratio to the sampler, plus the engine's start
and one weight push (grpo.py pays a push per step). docs/speed.md quotes a CPU run; scripts/gpu_check.py's `vllm`
part calls bench() at the Qwen2.5-1.5B shape on a GPU.

    OMP_NUM_THREADS=2 python scripts/bench_vllm.py                  # SmolLM2-135M's shape, fp32, on the CPU
    python scripts/bench_vllm.py --shape qwen2.5-1.5b --dtype bfloat16  # a GPU (pip install vllm)
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import common  # noqa: E402
from bench import timed  # noqa: E402
from hf import char_tokenizer, load_model, save_model  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from sampler import generate  # noqa: E402

SHAPES = {  # the real models' config.json values
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                         rope_theta=1e5, max_position_embeddings=8192, eos_token_id=2, pad_token_id=0),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151_936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
                         rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=32768, eos_token_id=2,
                         pad_token_id=0),
    # CPU test size (head_dim 64: vLLM's CPU attention has no smaller kernel)
    "tiny": dict(model_type="llama", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, eos_token_id=2),
}  # fmt: skip


def make_model(name: str, path: Path, dtype: torch.dtype) -> Path:
    torch.manual_seed(0)
    save_model(Transformer(ModelConfig(**SHAPES[name])).to(dtype), path, char_tokenizer())
    return path


def bench(path, device, dtype: str, P: int, G: int, new: int, prompt_len: int, repeats: int, memory: float,
          engines=("sampler", "vllm", "hf")) -> list[dict]:
    """One row per engine: tok/s over P * G * new tokens (median of `repeats` after a warm-up); the vllm row adds
    its start (load_s) and one push of the policy's weights (push_s). An engine that cannot run here (vllm or
    transformers missing) gets a row with its reason instead."""
    model = load_model(path, device=device)
    prompts = torch.randint(3, model.config.vocab_size, (P, prompt_len),
                            generator=torch.Generator().manual_seed(0)).tolist()  # fmt: skip
    runs, extra = {}, {}

    def ours():
        with common.autocast(model, dtype):  # what grpo.py's rollout runs
            g = generate(model, prompts, new, num_samples=G, temperature=1.0, eos_ids=(),
                         generator=torch.Generator(device=device).manual_seed(0))  # fmt: skip
        assert g.tokens.shape == (P * G, new)

    if "sampler" in engines:
        runs["sampler"] = ours
    if "vllm" in engines:
        try:
            from rollout_vllm import VLLMEngine

            t = time.perf_counter()
            engine = VLLMEngine(path, common.Dist(device=device), memory=memory, dtype=dtype,
                                max_len=prompt_len + new, seed=0)  # fmt: skip
            extra["vllm"] = {"load_s": time.perf_counter() - t,
                             "push_s": timed(lambda: engine.push(model), device)}  # fmt: skip

            def vllm():
                g = engine.generate(prompts, new, num_samples=G, temperature=1.0, eos_ids=(), seeds=list(range(P)))
                assert g.tokens.shape == (P * G, new)

            runs["vllm"] = vllm
        except ImportError as e:
            extra["vllm"] = {"skipped": f"{type(e).__name__}: {e}"}
    if "hf" in engines:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=common.DTYPES[dtype]).to(device).eval()
        ids = torch.tensor(prompts, device=device)

        def hf_run():
            with torch.no_grad():
                out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, num_return_sequences=G,
                                  max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0,
                                  top_k=0, top_p=1.0)  # fmt: skip
            assert out.shape == (P * G, prompt_len + new)

        runs["hf"] = hf_run
    rows = []
    for name in engines:
        row = dict(check="vllm", engine=name, device=str(device), dtype=dtype, prompts=P, group=G, new_tokens=new,
                   **extra.get(name, {}))  # fmt: skip
        if name in runs:
            runs[name]()  # warm-up
            t = statistics.median(timed(runs[name], device) for _ in range(repeats))
            row.update(s=t, tok_s=P * G * new / t)
        rows.append(row)
    base = next((r["tok_s"] for r in rows if r["engine"] == "sampler" and "tok_s" in r), None)
    for r in rows:
        if base and "tok_s" in r:
            r["vs_sampler"] = r["tok_s"] / base
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the sampler's compute dtype (autocast) and vLLM's / transformers' weights")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--new", type=int, default=128, help="new tokens per sample")
    p.add_argument("--prompt_len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory", type=float, default=0.1, help="--vllm_memory (CPU: the KV cache's share of RAM)")
    p.add_argument("--engines", default="sampler,vllm,hf")
    p.add_argument("--out", default="", help="also append the rows to this JSON-lines file")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    weights = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(args.shape, Path(tmp) / args.shape, weights)
        rows = bench(path, device, args.dtype, args.prompts, args.group, args.new, args.prompt_len, args.repeats,
                     args.memory, tuple(args.engines.split(",")))  # fmt: skip
    threads = os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
    print(f"{args.shape}, {args.dtype}, {device}, {args.prompts} prompts x G={args.group} x {args.new} new tokens "
          f"(prompt {args.prompt_len} tokens), median of {args.repeats}, OMP_NUM_THREADS={threads}")
    print("| engine | tok/s | vs sampler | s per rollout | notes |\n|---|---|---|---|---|")
    for r in rows:
        notes = r.get("skipped") or (f"start {r['load_s']:.1f} s, weight push {r['push_s']:.2f} s"
                                     if "load_s" in r else "")  # fmt: skip
        tok_s, vs, s = (f"{r[k]:.3g}" if k in r else "-" for k in ("tok_s", "vs_sampler", "s"))
        print(f"| {r['engine']} | {tok_s} | {vs} | {s} | {notes} |")
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
