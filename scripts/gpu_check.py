"""The GPU acceptance run (#13), on random-init weights at real shapes (nothing is downloaded). Run it as
scripts/gpu_check.sh; --tiny runs the same checks at toy shapes on the CPU (a default test does, so it keeps working).

  (a) logits: our Transformer vs transformers' on the same weights, fp32 and bf16 (autocast over fp32 weights)
  (b) sampler: tok/s of sampler.generate (bf16 autocast, as grpo.py samples) vs transformers' generate (bf16
      weights) vs the bandwidth bound: bytes of bf16 weights + KV cache read per decode step / --hbm_gbs
  (b2) decode modes at GRPO's shape (8 prompts x G=8): tok/s of generate's growing forward (G copies of each
      prompt's cache, fast="off", or fast="shared": one), compiled, and in fp32 the growing forward and
      fast.fused_step; tokens equal to the growing forward's (the fraction: bf16 rounding differs between
      modes), to choose sampler.DEFAULTS["cuda"]
  (c) training: SFT and GRPO steps of the 1.5B shape (8 prompts x G=8, 256 new tokens), plain and --dist fsdp on 1
      rank: s/step (generate / train) and peak memory, from each run's metrics.jsonl
  (d) everything in one JSON file (--out) and a printed table

    python scripts/gpu_check.py --make_model qwen2.5-0.5b --out_dir /tmp/qwen05b   # just write a random HF dir
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import common  # noqa: E402
from hf import char_tokenizer, save_model  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402
from sampler import generate  # noqa: E402

QWEN = dict(model_type="qwen2", vocab_size=151_936, tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
            max_position_embeddings=32768, bos_token_id=None, eos_token_id=2, pad_token_id=0)  # fmt: skip
SHAPES = {  # the real models' config.json values
    "qwen2.5-0.5b": dict(QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "qwen2.5-1.5b": dict(QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128_256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, rope_theta=5e5,
                         tie_word_embeddings=True, max_position_embeddings=131072, eos_token_id=2, pad_token_id=0,
                         rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)),
}
TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)  # fmt: skip


def shape(name: str, tiny: bool) -> dict:
    return {**SHAPES[name], **TINY} if tiny else SHAPES[name]


def make_model(name: str, path: Path, tiny: bool = False, device="cpu") -> Path:
    """A random-init HF dir of shape `name` (bf16 weights: half the bytes to write and read), with the char
    tokenizer: the model's other ids decode to nothing, which is all a timing run needs."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(ModelConfig(**shape(name, tiny)))
    save_model(model.to(torch.bfloat16), path, char_tokenizer())
    return path


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


# ---------------------------------------------------------------------------------------------------------------
# (a) logits vs transformers


def check_logits(name, path, device, tiny) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from hf import load_model

    ours = load_model(path, device=device)  # fp32 weights, as the trainers hold them
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    g = torch.Generator(device=device).manual_seed(0)
    tokens = torch.randint(0, ours.config.vocab_size, (2, 32 if tiny else 256), device=device, generator=g)
    rows, fp32 = [], None
    for dtype in ("float32", "bfloat16"):
        hf_ctx = torch.autocast(device.type, dtype=torch.bfloat16) if dtype == "bfloat16" else nullcontext()
        with torch.no_grad(), common.autocast(ours, dtype):
            a = ours(tokens)
        with torch.no_grad(), hf_ctx:
            b = hf(tokens).logits.float()
        fp32 = a if fp32 is None else fp32
        err, scale = (a - b).abs().max().item(), b.abs().max().item()
        tol = 1e-4 if dtype == "float32" else 5e-2  # relative to the largest logit
        # vs_fp32: how far bf16 compute is from fp32 (the size of the bf16 rounding our error should stay within)
        rows.append(dict(check="logits", model=name, dtype=dtype, max_abs_err=err, rel_err=err / scale,
                         vs_fp32=(a - fp32).abs().max().item() / scale, ok=err / scale < tol))  # fmt: skip
    del ours, hf
    return rows


# ---------------------------------------------------------------------------------------------------------------
# (b) sampler vs transformers generate vs the bandwidth bound


def decode_bytes(cfg: ModelConfig, n_params: int, batch: int, context: float) -> float:
    """Bytes one decode step reads: every bf16 weight once (the embedding lookup reads a row; a tied embedding is
    read as the head anyway), plus the bf16 K and V of `context` cached positions for every row."""
    kv = 2 * cfg.num_hidden_layers * batch * context * cfg.num_key_value_heads * cfg.head_dim * 2
    return 2 * n_params + kv


def bench_sampler(name, path, device, tiny, hbm_gbs) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from hf import load_model

    ours = load_model(path, device=device)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(device).eval()
    return [_bench(name, ours, hf, B, device, tiny, hbm_gbs) for B in ((1, 4) if tiny else (1, 64))]


def _bench(name, ours, hf, B, device, tiny, hbm_gbs) -> dict:
    cfg = ours.config
    n_params = sum(p.numel() for p in ours.parameters())  # (tied: counted once)
    if not cfg.tie_word_embeddings:
        n_params -= ours.embed_tokens.weight.numel()
    L, new = (8, 8) if tiny else (64, 128)
    prompts = torch.randint(3, cfg.vocab_size, (B, L), generator=torch.Generator().manual_seed(B)).tolist()
    ids = torch.tensor(prompts, device=device)
    gen = torch.Generator(device=device).manual_seed(0)

    def ours_run():
        with common.autocast(ours, "bfloat16"):  # what grpo.py's rollout runs
            generate(ours, prompts, new, temperature=1.0, eos_ids=(), generator=gen)

    def hf_run():
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=new,
                        min_new_tokens=new, eos_token_id=None, pad_token_id=0, top_k=0, top_p=1.0)

    ours_run(), hf_run()  # warm-up: allocator, kernels
    reps = 1 if tiny else 3
    t_ours = statistics.median(timed(ours_run, device) for _ in range(reps))
    t_hf = statistics.median(timed(hf_run, device) for _ in range(reps))
    bound = B / (decode_bytes(cfg, n_params, B, L + new / 2) / (hbm_gbs * 1e9))  # tok/s
    return dict(check="sampler", model=name, batch=B, new_tokens=new, ours_tok_s=B * new / t_ours,
                hf_tok_s=B * new / t_hf, bound_tok_s=bound, ours_vs_hf=t_hf / t_ours,
                ours_of_bound=B * new / t_ours / bound)  # fmt: skip


def bench_decode_modes(name, path, device, tiny) -> list[dict]:
    from hf import load_model

    model = load_model(path, device=device)
    P, G, L, new = (2, 2, 8, 8) if tiny else (8, 8, 64, 128)
    prompts = torch.randint(3, model.config.vocab_size, (P, L), generator=torch.Generator().manual_seed(1)).tolist()
    modes = {"growing": "off", "shared_prompt": "shared"}  # generate's fast=
    if not tiny:  # (compiling on the CPU takes a minute: not in the test's toy run)
        modes["compile"] = "compile"
    # fast.fused_step runs on fp32 weights without autocast: the growing forward and it, both in fp32 (their
    # tokens against the fp32 forward's, their speed against the bf16 growing forward's)
    modes |= {"growing fp32": "off", "fused fp32": "fused"}

    def run(mode_name, mode):
        with common.autocast(model, "float32" if mode_name.endswith("fp32") else "bfloat16"):
            return generate(model, prompts, new, num_samples=G, temperature=1.0, eos_ids=(),
                            generator=torch.Generator(device=device).manual_seed(0), fast=mode)

    rows, ref = [], {}
    for mode_name, mode in modes.items():
        out = run(mode_name, mode)  # warm-up: compiles / captures
        ref.setdefault(mode_name.endswith("fp32"), out.tokens)
        t = statistics.median(timed(lambda: run(mode_name, mode), device) for _ in range(1 if tiny else 2))  # noqa: B023
        rows.append(dict(check="decode", model=name, mode=mode_name, rows=P * G, new_tokens=new, tok_s=P * G * new / t,
                         tokens_equal=(out.tokens == ref[mode_name.endswith("fp32")]).float().mean().item()))
    for r in rows:
        r["vs_growing"] = r["tok_s"] / rows[0]["tok_s"]
    return rows


# ---------------------------------------------------------------------------------------------------------------
# (c) SFT and GRPO steps, plain and FSDP2 on one rank


def train_runs(path, work: Path, device, tiny) -> list[dict]:
    steps = 2 if tiny else 5
    common_flags = ["--init", str(path), "--task", "arith", "--template", "r1", "--steps", str(steps),
                    "--eval_every", "0", "--dtype", "bfloat16", "--warmup", "1", "--overwrite"]  # fmt: skip
    sft = ["sft.py", *common_flags, "--global_batch", "16", "--micro_batch", "16", "--stop_pass1", "0",
           "--split", "train[:256]"]  # fmt: skip
    P, G, new = (2, 2, 8) if tiny else (8, 8, 256)
    # a random model's rewards are all equal: --beta (KL) and no zero-std filter keep every row in the update
    grpo = ["grpo.py", *common_flags, "--prompts_per_step", str(P), "--group_size", str(G), "--gen_batch", str(P),
            "--max_new_tokens", str(new), "--beta", "0.04", "--filter_zero_std", "false", "--lr", "1e-6",
            "--train_micro_batch", "16", "--split", "train[:256]"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    rows = []
    for stage, args in (("sft", sft), ("grpo", grpo)):
        for dist in ("none", "fsdp"):
            out = work / f"{stage}_{dist}"
            cmd = [sys.executable, *args] if dist == "none" else [*torchrun, *args, "--dist", "fsdp"]
            t = time.perf_counter()
            r = subprocess.run(cmd + ["--out_dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t
            if r.returncode != 0:
                raise SystemExit(f"error: {stage} --dist {dist} failed:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
            m = [json.loads(line) for line in open(out / "metrics.jsonl")]
            later = m[1:] or m  # step 1 pays for warm-up
            row = dict(check="train", stage=stage, dist=dist, steps=len(m), wall_s=wall,
                       mem_peak_mb=max(x["mem_peak_mb"] for x in m))  # fmt: skip
            if stage == "sft":
                wall = [x.get("wall_s", x.get("elapsed_s")) for x in m]  # wall time ("elapsed_s": older sft.py)
                t_steps = [b - a for a, b in zip(wall, wall[1:])] or wall[:1]
                row.update(s_per_step=statistics.mean(t_steps), tokens_per_s=statistics.mean(x["tokens_per_s"]
                                                                                          for x in later))
            else:
                row.update(s_generate=statistics.mean(x["t_generate"] for x in later),
                           s_train=statistics.mean(x["t_train"] for x in later),
                           logprob_gap=statistics.mean(x["logprob_gap"] for x in m))
            rows.append(row)
            subprocess.run(["rm", "-rf", str(out)])  # checkpoints of the 1.5B shape: ~24 GB each
    return rows


# ---------------------------------------------------------------------------------------------------------------


def table(rows: list[dict]) -> str:
    lines = []
    for check in ("logits", "sampler", "decode", "train"):
        part = [r for r in rows if r["check"] == check]
        if not part:
            continue
        keys = list(dict.fromkeys(k for r in part for k in r if k != "check"))
        cell = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
        lines.append("  ".join(f"{k:>12s}" for k in keys))
        lines += ["  ".join(f"{cell(r.get(k, '')):>12s}" for k in keys) for r in part]
        lines.append("")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU (what the default test runs)")
    p.add_argument("--out", default="gpu_check.json", help="the JSON file of every figure")
    p.add_argument("--hbm_gbs", type=float, default=4800.0, help="memory bandwidth, GB/s (H200: 4800)")
    p.add_argument("--only", default="logits,sampler,decode,train", help="which checks (comma list)")
    p.add_argument("--make_model", default="", help="only write a random HF dir of this shape to --out_dir")
    p.add_argument("--out_dir", default="", help="with --make_model: where")
    args = p.parse_args()
    if args.make_model:
        print(make_model(args.make_model, Path(args.out_dir), args.tiny))
        return
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("error: no GPU here; --tiny runs the CPU version")
    only, rows, t0 = args.only.split(","), [], time.perf_counter()
    info = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                tiny=args.tiny, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), hbm_gbs=args.hbm_gbs)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        dirs = {n: make_model(n, tmp / n, args.tiny, device) for n in SHAPES}
        for name in ("qwen2.5-0.5b", "llama-3.2-1b"):
            rows += check_logits(name, dirs[name], device, args.tiny) if "logits" in only else []
        print(f"[{time.perf_counter() - t0:.0f}s] logits done", flush=True)
        for name in ("qwen2.5-0.5b", "qwen2.5-1.5b"):
            rows += bench_sampler(name, dirs[name], device, args.tiny, args.hbm_gbs) if "sampler" in only else []
        print(f"[{time.perf_counter() - t0:.0f}s] sampler done", flush=True)
        rows += bench_decode_modes("qwen2.5-0.5b", dirs["qwen2.5-0.5b"], device, args.tiny) if "decode" in only else []
        print(f"[{time.perf_counter() - t0:.0f}s] decode modes done", flush=True)
        if "train" in only:
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the subprocesses need the GPU memory
            rows += train_runs(dirs["qwen2.5-1.5b"], tmp, device, args.tiny)
    info["total_s"] = time.perf_counter() - t0
    common.save_json(args.out, {"info": info, "rows": rows})
    print(json.dumps(info))
    print(table(rows))
    bad = [r for r in rows if r.get("ok") is False]
    if bad:
        raise SystemExit(f"error: logits differ from transformers': {bad}")


if __name__ == "__main__":
    main()
