"""The GPU acceptance run (#13, #48, #50), on random-init weights at real shapes (nothing is downloaded). Run it as
scripts/gpu_check.sh; --tiny runs the same checks at toy shapes on the CPU (a default test does, so it keeps working).
Each part is one question; --only picks parts, and every row is appended to --out (JSON lines, first an "info"
line: device, torch / CUDA / cuDNN / transformers versions) and the markdown table --out.md rewritten as soon as
its part is done, so a run killed later keeps what it measured. On one H100, in two commands of ~4 minutes each
and a third for vllm (the estimate: README of scripts/gpu_check.sh):

  logits   our Transformer vs transformers' on the same weights, fp32 and bf16 (autocast over fp32 weights)
  kernels  a GRPO micro-batch (packed rows with a shared prompt: masked grouped-query attention), a padded batch and
           a decode, forward and backward, inside sdpa_kernel([FLASH, EFFICIENT]): raises if any SDPA call would
           take the math kernel (#48 item 1); bf16 autocast and fp32
  sampler  tok/s of sampler.generate (bf16 autocast, as grpo.py samples) vs transformers' generate (bf16 weights)
           vs the bandwidth bound: bytes of bf16 weights + KV cache read per decode step / the HBM bandwidth (from
           the device name, or --hbm_gbs; none for an unknown device)
  decode   decode modes at GRPO's shape (8 prompts x G=8): tok/s of the growing forward (G copies of each prompt's
           cache) and fast="shared" (one), bf16, and the growing forward in fp32; tokens equal to the growing
           forward's (the fraction: bf16 rounding differs between modes), to choose sampler.DEFAULTS["cuda"]. The
           fused and compiled steps apply only to fp32 models under fast.FUSED_MAX_BYTES (none at these shapes:
           there they are the growing forward), so they run in --tiny only, or with --compile
  train    SFT and GRPO steps of the 1.5B shape (8 prompts x G=8, 256 new tokens), plain and --dist fsdp on 1
           rank: s/step (generate / train) and peak memory per step, from each run's metrics.jsonl. No checkpoint
           is written (~25 GB each at 1.5B) unless --save_checkpoints
  vllm     rollout tok/s at the 1.5B shape, bf16, 8 prompts x G=8 x 128 new tokens: grpo.py --rollout vllm's
           engine vs the sampler vs transformers' generate, and the engine's start and weight push
           (scripts/bench_vllm.py); needs `pip install vllm` (without it: one row saying so)

    python scripts/gpu_check.py --make_model qwen2.5-0.5b --out_dir /tmp/qwen05b   # just write a random HF dir
"""

import argparse
import importlib
import importlib.util
import json
import os
import shutil
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
PARTS = ("logits", "kernels", "sampler", "decode", "train", "vllm")  # the order they run in
# HBM bandwidth, GB/s, by the first of these names in torch.cuda.get_device_name() (NVIDIA's data sheets)
HBM_GBS = {"H200": 4800, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
           "A100 80GB PCIe": 1935, "A100": 1555}  # fmt: skip


def shape(name: str, tiny: bool) -> dict:
    return {**SHAPES[name], **TINY} if tiny else SHAPES[name]


def hbm_gbs(device_name: str) -> float | None:
    """The device's memory bandwidth from its name (H100 SXM, NVL, PCIe, H200, A100), None if unknown."""
    return next((float(v) for k, v in HBM_GBS.items() if k in device_name), None)


def versions(device) -> dict:
    import transformers

    cuda = device.type == "cuda"
    return dict(device=torch.cuda.get_device_name() if cuda else "cpu", torch=torch.__version__,
                cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version() if cuda else None,
                transformers=transformers.__version__)  # fmt: skip


def compiler_missing(device) -> str | None:
    """Why torch.compile cannot build kernels here (None: it can). Inductor's CUDA kernels are Triton's, whose
    launcher Triton builds with a C compiler ($CC, cc, gcc or clang); on the CPU it builds C++ (common.cxx_compiler)."""
    if device.type == "cpu":
        return None if common.cxx_compiler() else "no C++ compiler (g++ or $CXX) on PATH"
    if importlib.util.find_spec("triton") is None:
        return "no Triton (pip install triton)"
    if not any(shutil.which(c) for c in (os.environ.get("CC", ""), "cc", "gcc", "clang") if c):
        return "no C compiler ($CC, cc, gcc or clang) on PATH, which Triton builds its launcher with"
    return None


def make_model(name: str, path: Path, tiny: bool = False, device="cpu") -> Path:
    """A random-init HF dir of shape `name` (bf16 weights: half the bytes to write and read), with the char
    tokenizer: the model's other ids decode to nothing, which is all a timing run needs."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(ModelConfig(**shape(name, tiny)))
    save_model(model.to(torch.bfloat16), path, char_tokenizer())
    return path


def hf_model(path, dtype):
    """transformers' model in dtype (its keyword is dtype= from 4.56, torch_dtype= before; pyproject allows 4.45)."""
    import transformers
    from transformers import AutoModelForCausalLM

    new = tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 56)
    return AutoModelForCausalLM.from_pretrained(path, **{"dtype" if new else "torch_dtype": dtype})


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
# logits vs transformers


def check_logits(name, path, device, tiny) -> list[dict]:
    from hf import load_model

    ours = load_model(path, device=device)  # fp32 weights, as the trainers hold them
    hf = hf_model(path, torch.float32).to(device).eval()
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
# kernels: no SDPA call of a training micro-batch or a decode takes the math kernel


def check_kernels(name, device, tiny) -> list[dict]:
    """A GRPO micro-batch of packed rows sharing a prompt, a padded batch and a short decode, inside
    sdpa_kernel([FLASH_ATTENTION, EFFICIENT_ATTENTION]): SDPA raises where neither takes a call (the math kernel
    would have: #48 item 1). ok False with the error where it raises."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from packing import packed_attention

    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(ModelConfig(**shape(name, tiny)))
    V, W = model.config.vocab_size, 64 if tiny else 1024
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, V, (2, W), generator=g).to(device)
    n = W // 4  # row 0: a prompt of n tokens and three continuations of it; row 1: a sequence alone
    seg = torch.tensor([[0] * n + [n] * n + [2 * n] * n + [3 * n] * n, [W] * W])
    pre = torch.tensor([[0] * W, [W] * W])
    pos = torch.tensor([list(range(2 * n)) + list(range(n, 2 * n)) * 2, list(range(W))])
    pad = torch.ones(2, W, dtype=torch.bool, device=device)
    pad[1, : W // 3] = False
    batches = {"grpo packed": dict(input_pos=pos.to(device), segments=packed_attention(seg.to(device), pre.to(device))),
               "padded": dict(attn_mask=pad)}  # fmt: skip
    rows = []
    for dtype in ("bfloat16", "float32"):
        for what in (*batches, "decode"):
            err = None
            try:
                with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
                    with common.autocast(model, dtype):
                        if what == "decode":
                            generate(model, tokens[:, :8].tolist(), 4, temperature=1.0, eos_ids=(),
                                     generator=torch.Generator(device=device).manual_seed(0), fast="off")
                        else:
                            logp, _ = model(tokens, targets=tokens, **batches[what])
                    if what != "decode":
                        logp.sum().backward()
            except RuntimeError as e:
                err = str(e).strip().splitlines()[0][:200]
            model.zero_grad(set_to_none=True)
            rows.append(dict(check="kernels", model=name, dtype=dtype, batch=what, ok=err is None, error=err))
    return rows


# ---------------------------------------------------------------------------------------------------------------
# sampler vs transformers generate vs the bandwidth bound


def decode_bytes(cfg: ModelConfig, n_params: int, batch: int, context: float) -> float:
    """Bytes one decode step reads: every weight once, in bf16 (autocast's cached copies) but the head in fp32
    (model.head_logits: fp32 logits; the embedding lookup reads a row, and a tied embedding is read as the head
    anyway), plus the bf16 K and V of `context` cached positions for every row."""
    kv = 2 * cfg.num_hidden_layers * batch * context * cfg.num_key_value_heads * cfg.head_dim * 2
    return 2 * n_params + 2 * cfg.vocab_size * cfg.hidden_size + kv


def bench_sampler(name, path, device, tiny, gbs) -> list[dict]:
    from hf import load_model

    ours = load_model(path, device=device)
    hf = hf_model(path, torch.bfloat16).to(device).eval()
    return [_bench(name, ours, hf, B, device, tiny, gbs) for B in ((1, 4) if tiny else (1, 64))]


def _bench(name, ours, hf, B, device, tiny, gbs) -> dict:
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
    reps = 1 if tiny else 2
    t_ours = statistics.median(timed(ours_run, device) for _ in range(reps))
    t_hf = statistics.median(timed(hf_run, device) for _ in range(reps))
    row = dict(check="sampler", model=name, batch=B, new_tokens=new, ours_tok_s=B * new / t_ours,
               hf_tok_s=B * new / t_hf, ours_vs_hf=t_hf / t_ours)  # fmt: skip
    if gbs:
        bound = B / (decode_bytes(cfg, n_params, B, L + new / 2) / (gbs * 1e9))  # tok/s
        row.update(bound_tok_s=bound, ours_of_bound=B * new / t_ours / bound)
    return row


def bench_decode_modes(name, path, device, tiny, compile) -> list[dict]:
    from hf import load_model

    model = load_model(path, device=device)
    P, G, L, new = (2, 2, 8, 8) if tiny else (8, 8, 64, 128)
    prompts = torch.randint(3, model.config.vocab_size, (P, L), generator=torch.Generator().manual_seed(1)).tolist()
    modes = {"growing": "off", "shared_prompt": "shared", "growing fp32": "off"}  # generate's fast=
    if tiny:  # fast.fused_step: fp32 weights without autocast, small models only (at real shapes: the growing one)
        modes["fused fp32"] = "fused"
    if compile:  # the fused step through torch.compile (needs a compiler)
        missing = compiler_missing(device)
        if missing:
            print(f"error: --compile: {missing}; the compiled decode mode is skipped", flush=True)
        else:
            modes["compile fp32"] = "compile"

    def run(mode_name, mode):
        with common.autocast(model, "float32" if mode_name.endswith("fp32") else "bfloat16"):
            return generate(model, prompts, new, num_samples=G, temperature=1.0, eos_ids=(),
                            generator=torch.Generator(device=device).manual_seed(0), fast=mode)

    rows, ref = [], {}
    for mode_name, mode in modes.items():
        out = run(mode_name, mode)  # warm-up (compiles)
        ref.setdefault(mode_name.endswith("fp32"), out.tokens)
        t = statistics.median(timed(lambda: run(mode_name, mode), device) for _ in range(1 if tiny else 2))  # noqa: B023
        rows.append(dict(check="decode", model=name, mode=mode_name, rows=P * G, new_tokens=new, tok_s=P * G * new / t,
                         tokens_equal=(out.tokens == ref[mode_name.endswith("fp32")]).float().mean().item()))
    for r in rows:
        r["vs_growing"] = r["tok_s"] / rows[0]["tok_s"]
    return rows


# ---------------------------------------------------------------------------------------------------------------
# SFT and GRPO steps, plain and FSDP2 on one rank


def run_stage(stage: str, argv: list[str], save: bool):
    """sft.main / grpo.main(argv) in this process (torchrun starts it as `gpu_check.py --stage ...`), writing no
    checkpoint and no model unless save: a timing run needs none, and at 1.5B each is ~25 GB."""
    mod = importlib.import_module(stage)
    if not save:
        mod.save_checkpoint = lambda *a, **k: None
        if hasattr(mod, "publish_model"):
            mod.publish_model = lambda *a, **k: None
    mod.main(argv)


def train_runs(path, work: Path, device, tiny, save) -> list[dict]:
    steps = 2 if tiny else 5
    common_flags = ["--init", str(path), "--task", "arith", "--template", "r1", "--steps", str(steps),
                    "--eval_every", "0", "--dtype", "bfloat16", "--warmup", "1", "--overwrite"]  # fmt: skip
    sft = ["sft", *common_flags, "--global_batch", "16", "--micro_batch", "16", "--stop_pass1", "0",
           "--split", "train[:256]"]  # fmt: skip
    P, G, new = (2, 2, 8) if tiny else (8, 8, 256)
    # a random model's rewards are all equal: --beta (KL) and no zero-std filter keep every row in the update
    grpo = ["grpo", *common_flags, "--prompts_per_step", str(P), "--group_size", str(G), "--gen_batch", str(P),
            "--max_new_tokens", str(new), "--beta", "0.04", "--filter_zero_std", "false", "--lr", "1e-6",
            "--train_micro_batch", "16", "--split", "train[:256]"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    me = [str(Path(__file__).resolve()), "--stage"] + ["--save_checkpoints"] * save
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1"]
    rows = []
    for stage, args in (("sft", sft), ("grpo", grpo)):
        for dist in ("none", "fsdp"):
            out = work / f"{stage}_{dist}"
            cmd = [sys.executable, *me, *args] if dist == "none" else [*torchrun, *me, *args, "--dist", "fsdp"]
            t = time.perf_counter()
            r = subprocess.run(cmd + ["--out_dir", str(out)], cwd=ROOT, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t
            if r.returncode != 0:
                tail = (r.stdout[-1500:] + r.stderr[-2500:]).strip().splitlines()
                print(f"error: {stage} --dist {dist} failed (exit {r.returncode}):", *tail[-30:], sep="\n", flush=True)
                rows.append(dict(check="train", stage=stage, dist=dist, ok=False, error=tail[-1] if tail else ""))
                continue
            m = [json.loads(line) for line in open(out / "metrics.jsonl")]
            later = m[1:] or m  # step 1 pays for warm-up
            row = dict(check="train", stage=stage, dist=dist, steps=len(m), wall_s=wall,
                       mem_peak_mb=max(x["mem_peak_mb"] for x in later))  # fmt: skip
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
            shutil.rmtree(out, ignore_errors=True)
    return rows


def bench_vllm(path, device, tiny) -> list[dict]:
    """scripts/bench_vllm.py's rows at this shape (bf16; the engine takes half the GPU's memory)."""
    if importlib.util.find_spec("vllm") is None:
        return [dict(check="vllm", skipped="vllm is not installed (pip install vllm)")]
    if tiny:  # TINY's head_dim 16 has no vLLM CPU kernel
        return [dict(check="vllm", skipped="--tiny: the toy shape's head_dim 16 has no vLLM CPU kernel")]
    sys.path.insert(0, str(ROOT / "scripts"))
    import bench_vllm as b

    torch.cuda.empty_cache()
    return b.bench(path, device, "bfloat16", 8, 8, 128, 64, repeats=3, memory=0.5)


# ---------------------------------------------------------------------------------------------------------------
# results: JSON lines, appended part by part, and a markdown table of all of them


def append_rows(path: Path, rows: list[dict]):
    with open(path, "a") as f:
        for r in rows:
            f.write(json.dumps(r, default=str) + "\n")
        f.flush()
        os.fsync(f.fileno())


def table(rows: list[dict]) -> str:
    """Markdown: one table per check, the info lines first."""
    cell = lambda v: f"{v:.3g}" if isinstance(v, float) else "" if v is None else str(v)
    lines = []
    for check in ("info", *PARTS):
        part = [r for r in rows if r["check"] == check]
        if not part:
            continue
        keys = list(dict.fromkeys(k for r in part for k in r if k != "check"))
        lines += [f"**{check}**", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in part]
        lines.append("")
    return "\n".join(lines)


def main():
    if sys.argv[1:2] == ["--stage"]:  # a training run of train_runs: gpu_check.py --stage [--save_checkpoints] NAME ...
        save = sys.argv[2] == "--save_checkpoints"
        return run_stage(sys.argv[2 + save], sys.argv[3 + save :], save)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="toy shapes on the CPU (what the default test runs)")
    p.add_argument("--out", default="gpu_check.jsonl", help="JSON lines, appended after every part (and OUT.md)")
    p.add_argument("--hbm_gbs", type=float, default=0.0, help="memory bandwidth, GB/s (default: from the device "
                   "name, H100 3350, H200 4800; no bound for an unknown device)")
    p.add_argument("--only", default=",".join(PARTS), help=f"which parts, a comma list of {', '.join(PARTS)}")
    p.add_argument("--compile", action="store_true", help="also the compiled decode mode (needs Triton and a C "
                   "compiler on CUDA)")
    p.add_argument("--save_checkpoints", action="store_true", help="let the training runs write their checkpoints")
    p.add_argument("--make_model", default="", help="only write a random HF dir of this shape to --out_dir")
    p.add_argument("--out_dir", default="", help="with --make_model: where")
    args = p.parse_args()
    if args.make_model:
        print(make_model(args.make_model, Path(args.out_dir), args.tiny))
        return
    only = [x for x in args.only.split(",") if x]
    unknown = set(only) - set(PARTS)
    if unknown:
        raise SystemExit(f"error: --only {','.join(sorted(unknown))}: the parts are {', '.join(PARTS)}")
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("error: no GPU here; --tiny runs the CPU version")
    info = dict(check="info", **versions(device), tiny=args.tiny, parts=",".join(only),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    info["hbm_gbs"] = args.hbm_gbs or (hbm_gbs(info["device"]) if device.type == "cuda" else None)
    out, md = Path(args.out), Path(args.out + ".md")
    append_rows(out, [info])
    t0, bad = time.perf_counter(), []

    def done(part, rows):  # every part's rows on disk as soon as it ends
        append_rows(out, rows)
        md.write_text(table([json.loads(line) for line in open(out)]))
        bad.extend(r for r in rows if r.get("ok") is False)
        print(f"[{time.perf_counter() - t0:.0f}s] {part} done", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}

        def model_dir(name):  # made once, when a part first needs it
            if name not in dirs:
                dirs[name] = make_model(name, Path(tmp) / name, args.tiny, device)
            return dirs[name]

        for part in (x for x in PARTS if x in only):
            if part == "logits":
                rows = [r for n in ("qwen2.5-0.5b", "llama-3.2-1b") for r in check_logits(n, model_dir(n), device,
                                                                                           args.tiny)]
            elif part == "kernels":
                rows = check_kernels("qwen2.5-0.5b", device, args.tiny)
            elif part == "sampler":
                rows = [r for n in ("qwen2.5-0.5b", "qwen2.5-1.5b")
                        for r in bench_sampler(n, model_dir(n), device, args.tiny, info["hbm_gbs"])]
            elif part == "decode":
                rows = bench_decode_modes("qwen2.5-0.5b", model_dir("qwen2.5-0.5b"), device, args.tiny, args.compile)
            elif part == "train":
                if device.type == "cuda":
                    torch.cuda.empty_cache()  # the subprocesses need the GPU memory
                rows = train_runs(model_dir("qwen2.5-1.5b"), Path(tmp), device, args.tiny, args.save_checkpoints)
            else:
                rows = bench_vllm(model_dir("qwen2.5-1.5b"), device, args.tiny)
            done(part, rows)
    print(md.read_text())
    if bad:
        raise SystemExit(f"error: {len(bad)} check(s) failed: {bad}")


if __name__ == "__main__":
    main()
