"""Sampler benchmark: sampler.generate vs transformers' generate on the same weights.

    python bench.py            # tiny and 25m presets, CPU (and CUDA when present)
    python bench.py --quick    # fewer repetitions

Both sides get the same checkpoint (save_model, then AutoModelForCausalLM.from_pretrained), the same 64 ragged
prompts of ~32 tokens (left-padded for HF), fp32, plain sampling at temperature 1 and exactly 128 new tokens
(no EOS: eos_ids=() here, eos_token_id=None and min_new_tokens=128 there). Times are medians over repetitions,
the two sides interleaved so background load hits both alike. Also printed: the decode's achieved GFLOP/s (its
matmul FLOPs over its time) next to plain torch.matmul on the same shapes, i.e. this machine's ceiling for them.
Speedups are medians of per-repetition ratios. The last line is machine-readable: the smallest speedup over
all configs and devices. Also timed, reported apart: generate(fast="shared"), each step through the model's forward
instead of fast.fused_step; --compile adds generate(fast="compile").

    python bench.py --vs_trl   # one GRPO step of grpo.py vs TRL's GRPOTrainer, same settings (pip install trl==1.16.0)

--vs_trl: both sides load one HF dir written by save_model (a 3.1M-param Llama: hidden 256, 4 layers, 4 heads,
MHA, intermediate 640, untied, max_pos 512, the char tokenizer) and train it fp32 on 1 process with 2 threads:
8 arith prompts (short template) x G=8, <= 64 new tokens at T=1, beta=0, lr 1e-4, loss dapo, no reward scaling,
and a random reward in [0, 1) so every row trains. The sides alternate step by step (a TRL step, then one of
ours, then the floor), so background load hits both alike. Printed: both medians over --steps steps after
--warmup, their ratio, each side's generate/train split, and the compute floor of our step: a forward+backward
of the trained tokens packed without padding (rows as wide as the longest sequence; with --share_prompt a
group's prompt counts once) plus one forward of the generated tokens, packed the same way. Also timed, on its own
copy of the model and interleaved the same way: grpo.py --compile (the rollouts' decode step through
torch.compile; it compiles inside the warm-up; skipped, one line, without a C++ compiler), with its own ratio
(grpo_compile_vs_trl; grpo_vs_trl is the default's). Without TRL installed the TRL side is skipped (one line) and
the rest still runs.
--ablate adds grpo.py's step without each of its speed-ups (--pack off; --share_prompt off; finished rows kept
in the decode batch; each row its own copy of its prompt's cache slots; the model's forward instead of
fast.fused_step for each decode step), and with every fp32 projection on aten's kernel instead of oneDNN
(fast.ONEDNN off; where it is off by default, AVX2 or an Intel CPU, the other way round), each on its own copy
of the model, interleaved with the rest.
"""

import argparse
import dataclasses
import math
import os
import random
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, GenerationConfig

import fast
import grpo
import packing
import sampler
from common import cxx_compiler
from data import format_prompt, load_task
from hf import char_tokenizer, load_model, load_tokenizer, save_model
from model import ModelConfig, Transformer, preset_config
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
        ours = fast.use_onednn(load_model(d, device))  # as the stage scripts run it
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).to(device).eval()
    g = torch.Generator(device).manual_seed(0)
    lens = torch.randint(28, 37, (BATCH,), generator=torch.Generator().manual_seed(0)).tolist()
    prompts = [torch.randint(3, VOCAB, (n,)).tolist() for n in lens]
    L = max(lens)
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts], device=device)  # HF: left-padded + mask
    attn = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=device)
    hf_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=NEW,
                              min_new_tokens=NEW, eos_token_id=None, pad_token_id=0)

    def run_ours(n=NEW, mode="auto"):
        out = generate(ours, prompts, n, eos_ids=(), generator=g, fast=mode)
        assert out.tokens.shape == (BATCH, n) and out.mask.all()

    def run_hf():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=attn, generation_config=hf_cfg)
        assert out.shape == (BATCH, L + NEW)

    run_ours(), run_hf()  # warm-up
    if compile:  # compiles (tens of seconds on CPU), from scratch: sizes another preset
        torch._dynamo.reset()  # changed would stay symbolic (slower code), and dynamo's recompile limit counts them
        run_ours(mode="compile")
    t = {"ours": [], "hf": [], "prefill": [], "unfused": [], "compiled": []}
    for _ in range(reps):  # interleaved, so a burst of background load hits both sides
        t["ours"].append(timed(run_ours, device))
        t["hf"].append(timed(run_hf, device))
        t["unfused"].append(timed(lambda: run_ours(mode="shared"), device))
        t["prefill"].append(timed(lambda: run_ours(1), device))
        if compile:
            t["compiled"].append(timed(lambda: run_ours(mode="compile"), device))
    med = {k: statistics.median(v) for k, v in t.items() if v}
    speedup = statistics.median(h / o for h, o in zip(t["hf"], t["ours"]))  # of each adjacent pair
    params = sum(p.numel() for p in ours.parameters())
    achieved = decode_flops(cfg, BATCH, sum(lens) / BATCH) / (med["ours"] - med["prefill"]) / 1e9
    print(f"{name} ({params / 1e6:.2f}M params) {device.type}: ours {BATCH * NEW / med['ours']:,.0f} tok/s "
          f"({med['ours']:.2f}s, prefill {med['prefill']:.2f}s), HF generate {BATCH * NEW / med['hf']:,.0f} tok/s "
          f"({med['hf']:.2f}s), speedup {speedup:.2f}x | decode {achieved:.1f} GFLOP/s vs torch.matmul on the same "
          f"shapes {matmul_gflops(cfg, BATCH, device, reps):.1f} GFLOP/s", flush=True)
    fused = statistics.median(u / o for u, o in zip(t["unfused"], t["ours"]))
    print(f"{name} {device.type}: ours with fast=\"shared\" (the model's forward each step) "
          f"{BATCH * NEW / med['unfused']:,.0f} tok/s ({med['unfused']:.2f}s), {med['hf'] / med['unfused']:.2f}x HF "
          f"generate; the fused step {fused:.2f}x it (not in the summary)")
    if compile:
        print(f"{name} {device.type}: ours with fast=\"compile\" {BATCH * NEW / med['compiled']:,.0f} tok/s "
              f"({med['compiled']:.2f}s), {med['hf'] / med['compiled']:.2f}x HF generate (not in the summary)")
    return speedup


# ---------------------------------------------------------------------------------------------------------------
# --vs_trl: one GRPO step, grpo.py's pieces vs TRL's GRPOTrainer


def vs_trl_model_dir(path):
    """The shared model: a fresh Llama written by save_model, with the char tokenizer beside it."""
    tok = char_tokenizer()
    cfg = ModelConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=640, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    save_model(Transformer(cfg), path, tok)


def vs_trl_config(out_dir, steps) -> grpo.GRPOConfig:
    """grpo.py's flags at the comparison's settings (the loss, clip and AdamW values are also TRL's, below)."""
    return grpo.GRPOConfig(prompts_per_step=8, group_size=8, gen_batch=8, max_new_tokens=64, temperature=1.0,
                           loss="dapo", scale_rewards="none", beta=0.0, lr=1e-4, steps=steps, warmup=0,
                           train_micro_batch=64, out_dir=out_dir)


class OurSide:
    """grpo.py's step (main's steps 2-5: rollout, score, advantages and loss mask, update) with a random reward,
    timed in two parts; plus the compute floor of the same step."""

    def __init__(self, model_dir, prompts: list[list[int]], cfg: grpo.GRPOConfig):
        self.model = fast.use_onednn(load_model(model_dir))  # as grpo.py builds it
        self.tok, self.prompts, self.cfg = load_tokenizer(model_dir), prompts, cfg
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, betas=(0.9, cfg.beta2), weight_decay=0.0)
        self.rng = torch.Generator().manual_seed(1)  # the random rewards
        self.times = []  # (generate, train) per step
        self.floors, self.lens = [], []

    def step(self, step: int):
        cfg, P, G = self.cfg, self.cfg.prompts_per_step, self.cfg.group_size
        eos, pad = [self.tok.eos_token_id], self.tok.pad_token_id
        mine = self.prompts[(step - 1) * P : step * P]
        t0 = time.perf_counter()
        roll = grpo.rollout(self.model, mine, (step - 1) * P, step, cfg, eos, pad, torch.device("cpu"))
        t1 = time.perf_counter()
        r = torch.rand(P, G, generator=self.rng)  # the random reward: every group has spread, every row trains
        adv = grpo.group_advantages(r, cfg.scale_rewards).view(-1, 1)  # (N, 1)
        lmask, keep, _ = grpo.loss_mask(r, roll.mask, roll.truncated, cfg.filter_zero_std, cfg.mask_truncated)
        n_seqs, n_tokens = keep.sum().item(), lmask.sum().item()
        w = grpo.token_weights(lmask, cfg.loss, n_seqs, n_tokens, P * G, cfg.max_new_tokens)  # beta = 0: no KL
        row_prompts = [p for p in mine for _ in range(G)]
        lengths = roll.lengths.tolist()
        batch = packing.training_batch(row_prompts, roll.tokens, lengths, pad)
        seq_len = [len(p) - 1 + n for p, n in zip(row_prompts, lengths)]
        grpo.update(self.model, None, self.opt, batch, seq_len, adv, lmask, w, None, roll.logprobs, cfg, step)
        t2 = time.perf_counter()
        self.times.append((t1 - t0, t2 - t1))
        self.lens.append(sum(lengths) / len(lengths))
        # the tokens training must run: each sequence whole, or with --share_prompt (and --pack) each group's
        # prompt once (but its last token, which each row keeps) and each row's own
        trained = seq_len
        if cfg.pack and cfg.share_prompt:
            trained = [len(p) - 1 for p in mine] + [n + 1 for n in lengths]
        return trained, max(seq_len), lengths

    def floor(self, trained: list[int], width: int, gen_len: list[int]):
        """Seconds of the step's unavoidable compute: forward+backward of the trained tokens (training's loss path,
        log-probs and all) and one forward of the generated ones, each packed into rows as wide as its longest
        sequence (the last row padded: under one row's worth of extra tokens)."""
        V = self.model.config.vocab_size
        packed = lambda n, w: torch.randint(3, V, (math.ceil(n / w), w))
        x, y = packed(sum(trained), width), packed(sum(gen_len), max(gen_len))
        self.model.train()
        t0 = time.perf_counter()
        logp, _ = self.model(x, targets=x)
        logp.sum().backward()
        t1 = time.perf_counter()
        with torch.no_grad():
            self.model(y)
        t2 = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        self.floors.append((t1 - t0, t2 - t1))


def trl_trainer(model_dir, prompt_text: list[str], cfg: grpo.GRPOConfig, total_steps: int, out_dir, callback):
    """TRL's GRPOTrainer at the same settings; the generate half of each step is timed by wrapping
    _generate_and_score_completions (generation, reward, advantages)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    rng = random.Random(1)
    reward = lambda completions, **kw: [rng.random() for _ in completions]
    args = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=cfg.prompts_per_step * cfg.group_size,
        gradient_accumulation_steps=1, num_generations=cfg.group_size, max_completion_length=cfg.max_new_tokens,
        temperature=cfg.temperature, top_p=1.0, top_k=0, beta=cfg.beta, learning_rate=cfg.lr,
        lr_scheduler_type="constant", warmup_steps=0, adam_beta2=cfg.beta2, weight_decay=0.0,
        max_grad_norm=cfg.grad_clip, loss_type=cfg.loss, scale_rewards=cfg.scale_rewards, epsilon=cfg.epsilon,
        epsilon_high=cfg.epsilon_high, mask_truncated_completions=False, gradient_checkpointing=False, bf16=False,
        use_cpu=True, max_steps=total_steps, report_to="none", save_strategy="no", logging_steps=10**6,
        disable_tqdm=True, seed=0, dataloader_num_workers=0, log_completions=False,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = Dataset.from_dict({"prompt": prompt_text})
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=load_tokenizer(model_dir), callbacks=[callback])
    inner, trainer.gen_times, trainer.lens = trainer._generate_and_score_completions, [], []

    def timed(inputs):
        t = time.perf_counter()
        out = inner(inputs)
        trainer.gen_times.append(time.perf_counter() - t)
        trainer.lens.append(out["completion_mask"].sum(1).float().mean().item())
        return out

    trainer._generate_and_score_completions = timed
    return trainer


def vs_trl(steps: int, warmup: int, threads: int, trl: bool = True, ablate: bool = False) -> dict:
    """Runs both sides interleaved step by step; prints and returns the medians (seconds)."""
    torch.set_num_threads(threads)
    total = warmup + steps
    with tempfile.TemporaryDirectory() as d:
        model_dir = os.path.join(d, "model")
        vs_trl_model_dir(model_dir)
        cfg = vs_trl_config(os.path.join(d, "ours"), total)
        tok = load_tokenizer(model_dir)
        rows = load_task("arith", cfg.split, seed=cfg.data_seed)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))[: total * 8].tolist()
        text = [format_prompt(rows[i]["question"], "short")[0] for i in order]
        ours = OurSide(model_dir, [tok.encode(t) for t in text], cfg)
        # --ablate: grpo.py's step again without one of its speed-ups each, on its own copy of the model
        # (cfg, sampler.DROP_EVERY, the CPU's decode mode, fast.ONEDNN)
        plain, on = sampler.DEFAULTS["cpu"], fast.ONEDNN
        variants = {"--compile": (dataclasses.replace(cfg, compile=True), sampler.DROP_EVERY, plain, on),
                    "without --pack": (dataclasses.replace(cfg, pack=False), sampler.DROP_EVERY, plain, on),
                    "without --share_prompt": (dataclasses.replace(cfg, share_prompt=False), sampler.DROP_EVERY,
                                               plain, on),
                    "without dropping finished rows": (cfg, math.inf, plain, on),
                    "without the shared prompt slots": (cfg, sampler.DROP_EVERY, "fused", on),
                    "without the fused decode step": (cfg, sampler.DROP_EVERY, "shared", on)}
        if fast.ONEDNN_AVAILABLE:  # the same step with the other kernel for every large fp32 projection
            other = "without oneDNN projections" if on else "with oneDNN projections (MINIGRPO_ONEDNN=1)"
            variants[other] = (cfg, sampler.DROP_EVERY, plain, not on)
        if cxx_compiler() is None:
            print("grpo.py --compile side skipped: no C++ compiler (torch.compile builds its CPU kernels with one)")
            del variants["--compile"]
        variants = variants if ablate else {k: v for k, v in variants.items() if k == "--compile"}
        others = {name: OurSide(model_dir, [tok.encode(t) for t in text], c) for name, (c, *_) in variants.items()}

        def our_step(step):
            ours.floor(*ours.step(step))
            for name, side in others.items():
                defaults = sampler.DROP_EVERY, sampler.DEFAULTS["cpu"], fast.ONEDNN
                sampler.DROP_EVERY, sampler.DEFAULTS["cpu"], fast.ONEDNN = variants[name][1:]
                try:
                    side.step(step)
                finally:
                    sampler.DROP_EVERY, sampler.DEFAULTS["cpu"], fast.ONEDNN = defaults

        try:
            import trl  # noqa: F401
        except ImportError:
            trl = False
            print("TRL side skipped: trl is not installed (pip install -e '.[bench]'); timing grpo.py alone")
        trl_times = []
        if trl:
            from transformers import TrainerCallback

            class Interleave(TrainerCallback):  # a TRL step is on_step_begin..on_step_end; then one of ours
                def on_step_begin(self, args, state, control, **kw):
                    self.t = time.perf_counter()

                def on_step_end(self, args, state, control, **kw):
                    trl_times.append(time.perf_counter() - self.t)
                    our_step(state.global_step)

            trainer = trl_trainer(model_dir, text, cfg, total, os.path.join(d, "trl"), Interleave())
            trainer.train()
        else:
            for step in range(1, total + 1):
                our_step(step)

    med = lambda xs: statistics.median(xs[warmup:])
    res = {"ours": med([g + t for g, t in ours.times]), "ours_gen": med([g for g, _ in ours.times]),
           "ours_train": med([t for _, t in ours.times]), "ours_len": med(ours.lens),
           "floor_train": med([f for f, _ in ours.floors]), "floor_gen": med([g for _, g in ours.floors])}
    res["floor"] = res["floor_train"] + res["floor_gen"]
    print(f"{steps} steps after {warmup} warm-up, {threads} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"grpo.py: median {res['ours']:.2f} s/step (generate {res['ours_gen']:.2f} s, train {res['ours_train']:.2f}"
          f" s; mean completion {res['ours_len']:.1f} tokens)")
    if trl_times:
        res |= {"trl": med(trl_times), "trl_gen": med(trainer.gen_times), "trl_len": med(trainer.lens)}
        res["trl_train"] = med([s - g for s, g in zip(trl_times, trainer.gen_times)])
        res["ratio"] = res["trl"] / res["ours"]
        print(f"TRL GRPOTrainer: median {res['trl']:.2f} s/step (generate {res['trl_gen']:.2f} s, train "
              f"{res['trl_train']:.2f} s; mean completion {res['trl_len']:.1f} tokens)")
    for name, side in others.items():
        gen, train = med([g for g, _ in side.times]), med([t for _, t in side.times])
        res[name] = gen + train
        vs = f"; TRL {res['trl'] / (gen + train):.2f}x it" if trl_times else ""
        print(f"grpo.py {name}: median {gen + train:.2f} s/step (generate {gen:.2f} s, train {train:.2f} s): "
              f"{(gen + train) / res['ours']:.2f}x grpo.py's{vs}")
    print(f"floor of our step: {res['floor']:.2f} s (forward+backward of the trained tokens packed "
          f"{res['floor_train']:.2f} s + one forward of the generated ones {res['floor_gen']:.2f} s); "
          f"grpo.py is {res['ours'] / res['floor']:.2f}x the floor")
    if trl_times:
        if "--compile" in res:
            print(f"grpo_compile_vs_trl speedup={res['trl'] / res['--compile']:.2f}x")
        print(f"grpo_vs_trl speedup={res['ratio']:.2f}x")
    return res


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 repetitions instead of 7")
    p.add_argument("--configs", default="tiny,25m", help="comma-separated presets")
    p.add_argument("--compile", action="store_true", help="also time generate(compile=True), reported apart")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for both sides (0: torch's default; "
                   "--vs_trl: 2)")
    p.add_argument("--vs_trl", action="store_true", help="time one GRPO step against TRL's GRPOTrainer instead")
    p.add_argument("--steps", type=int, default=20, help="--vs_trl: measured steps per side")
    p.add_argument("--warmup", type=int, default=3, help="--vs_trl: steps per side before measuring")
    p.add_argument("--ablate", action="store_true", help="--vs_trl: also time grpo.py's step without each of its "
                   "speed-ups (--pack; --share_prompt; dropping finished rows; shared prompt slots; the fused "
                   "decode step; oneDNN projections), interleaved with the rest")
    args = p.parse_args()
    if args.vs_trl:
        return vs_trl(args.steps, args.warmup, args.threads or 2, ablate=args.ablate)
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
