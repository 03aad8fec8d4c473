"""GRPO: R1-style reinforcement learning with group-relative advantages.

One step, top to bottom (follow a batch through `main`):
  1. this rank takes its share of --prompts_per_step prompts (a seeded permutation, sliced by global rank)
  2. the KV-cache sampler draws --group_size G completions per prompt (each prompt prefilled once)
  3. rewards.reward scores every completion (each component is logged)
  4. group advantages A_i = r_i - mean(r) (optionally / (std(r) + eps))
  5. micro-batched forward/backward of the clipped policy loss (+ beta * k3 KL to a frozen reference)
  6. grad clip, AdamW step, metrics (all-reduced over ranks), eval / checkpoint every N steps

Launch:
  python grpo.py --init runs/sft/model                      # one process
  torchrun --nproc_per_node=2 grpo.py --init runs/sft/model # data parallel (DDP; --dist fsdp for FSDP2)
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts=3 --nproc_per_node=2 grpo.py ...
                                                            # a dead worker restarts the group, which resumes

Resume: run the same command again and it continues from the newest complete checkpoint in --out_dir (--resume auto,
the default; --resume PATH: a given checkpoint; --overwrite: start over). Step s's prompts and sampler generators are
derived from (seed, step, prompt index), and a checkpoint holds weights, full optimizer state, every rank's RNG states
and the training clock, so the continuation is bitwise the uninterrupted run; metrics/samples.jsonl are cut back to
the checkpoint's step first.

Simplifications, stated up front:
  - one rollout -> mu policy updates (default 1: the ratio is exactly 1 and no old-log-prob forward is needed);
  - a prompt's G samples stay on one rank, so group statistics need no communication;
  - generation uses the training weights directly (no separate inference engine, no weight sync);
  - advantages use the *sample* std (unbiased, like torch.std) plus eps=1e-4 when --scale_rewards=group.
"""

import gc
import math
import os
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch

import rewards
from checkpoint import check_finite, resume_point, save_checkpoint, start_or_resume
from common import (
    JsonlLogger,
    all_reduce_sum,
    any_rank,
    cleanup_dist,
    init_dist,
    lr_at,
    make_generator,
    parse_config,
    print0,
    seed_all,
    stays_stopped,
    user_input,
    wrap_model,
)
from data import format_prompt, load_task, parse_knobs
from eval import evaluate
from model import load_model, load_tokenizer
from sampler import generate


@dataclass
class GRPOConfig:
    """GRPO from an HF model dir: sample G completions per prompt, score them, update on group advantages."""
    # model and data
    init: str = field(default="runs/sft/model", metadata={"help": "HF model dir to start from"})
    task: str = field(default="arith", metadata={"help": "task: arith | gsm8k | math"})
    split: str = field(default="train[5%:]", metadata={"help": "training problems (answers only are used)"})
    data_path: str | None = field(default=None, metadata={"help": "local file or dir for gsm8k/math (none: the hub)"})
    task_knobs: str = field(default="", metadata={"help": "built-in task difficulty, e.g. 'steps=3,high=999,ops=+-*'"})
    template: str = field(default="short", metadata={"help": "prompt template", "choices": ["short", "r1", "chat"]})
    eval_split: str = field(default="test[:200]", metadata={"help": "held-out problems for in-loop eval"})
    out_dir: str = field(default="runs/grpo", metadata={"help": "run directory (config, metrics, checkpoints)"})
    # GRPO
    prompts_per_step: int = field(default=16, metadata={"help": "prompts per step, over all ranks"})
    group_size: int = field(default=8, metadata={"help": "G: completions sampled per prompt"})
    max_new_tokens: int = field(default=64, metadata={"help": "completion length limit"})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature (trainer log-probs use it too)"})
    top_p: float = field(default=1.0, metadata={"help": "nucleus sampling (<1 makes sampler/trainer log-probs differ)"})
    top_k: int = field(default=0, metadata={"help": "top-k sampling (0 = off)"})
    gen_batch: int = field(default=8, metadata={"help": "prompts per sampler call (x G rows)"})
    loss: str = field(default="dapo", metadata={"help": "grpo: per-seq mean | dapo: token mean | dr_grpo",
                                                "choices": ["grpo", "dapo", "dr_grpo"]})
    scale_rewards: str = field(default="none", metadata={"help": "advantage scaling: group (divide by std) | none",
                                                                   "choices": ["group", "none"]})
    epsilon: float = field(default=0.2, metadata={"help": "PPO clip: lower bound 1 - epsilon"})
    epsilon_high: float = field(default=0.28, metadata={"help": "PPO clip: upper bound 1 + epsilon_high (clip-higher)"})
    beta: float = field(default=0.0, metadata={"help": "k3 KL weight to the frozen init model (0: no reference model)"})
    mu: int = field(default=1, metadata={"help": "policy updates per rollout batch"})
    filter_zero_std: bool = field(default=True, metadata={"help": "drop groups with all-equal rewards from the loss"})
    mask_truncated: bool = field(default=False, metadata={"help": "drop truncated completions from the loss"})
    reward_weights: str = field(default="", metadata={"help": "reward weights, e.g. 'correct=1,format=0.1'"})
    # optimisation
    steps: int = field(default=3000, metadata={"help": "optimizer steps (upper bound when --max_minutes is set)"})
    max_minutes: float = field(default=0.0, metadata={"help": "stop after this much training wall time (0 = off)"})
    lr: float = field(default=1e-4, metadata={"help": "peak learning rate"})
    warmup: int = field(default=10, metadata={"help": "linear warmup steps"})
    min_lr_ratio: float = field(default=1.0, metadata={"help": "cosine floor as a fraction of lr (1.0 = constant)"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay"})
    beta2: float = field(default=0.98, metadata={"help": "AdamW beta2"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the global grad norm to this"})
    train_micro_batch: int = field(default=64, metadata={"help": "rows per forward/backward"})
    # infrastructure
    dist: str = field(default="ddp", metadata={"help": "data parallelism under torchrun", "choices": ["ddp", "fsdp"]})
    dist_timeout: float = field(default=600.0, metadata={"help": "seconds before a stuck collective fails"})
    dtype: str = field(default="float32", metadata={"help": "dtype", "choices": ["float32", "bfloat16"]})
    seed: int = field(default=0, metadata={"help": "RL seed (sampling and data order)"})
    data_seed: int = field(default=0, metadata={"help": "seed of the built-in task's problems"})
    eval_every: int = field(default=50, metadata={"help": "evaluate held-out greedy pass@1 every N steps (0 = off)"})
    save_every: int = field(default=0, metadata={"help": "checkpoint every N steps (0 = only at the end)"})
    keep: int = field(default=2, metadata={"help": "checkpoints to keep"})
    log_samples: int = field(default=2, metadata={"help": "completions per step written to samples.jsonl"})
    resume: str = field(default="auto", metadata={"help": "auto: continue from the newest checkpoint in --out_dir "
                                                          "(if any) | none: start fresh | PATH: that checkpoint"})
    overwrite: bool = field(default=False, metadata={"help": "start over, deleting the run already in --out_dir"})
    # optional loggers (metrics.jsonl is always written)
    wandb: str = field(default="", metadata={"help": "also log metrics to this Weights & Biases project "
                                                      "(pip install wandb; WANDB_MODE=offline works)"})
    tensorboard: bool = field(default=False, metadata={"help": "also write TensorBoard events to OUT/tb "
                                                                "(pip install tensorboard)"})


# what a resumed run must share with the run that wrote its checkpoint (the model, the data, the batch shape):
# --resume refuses a checkpoint that differs in these; other flags (lr, steps, loss, dist, world size, ...) may change
RESUME_MUST_MATCH = ("init", "task", "split", "data_path", "task_knobs", "data_seed", "template", "prompts_per_step",
                     "group_size", "seed", "dtype")


# ----------------------------------------------------------------------------------------------------------------
# The math: pure functions, tensors in and out


def group_advantages(r: torch.Tensor, scale: str, eps: float = 1e-4) -> torch.Tensor:
    """r: (P, G) rewards -> (P, G) advantages r - mean(r), divided by (sample std + eps) when scale == 'group'."""
    adv = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = adv / (r.std(dim=1, keepdim=True) + eps)  # unbiased std, like torch.std / TRL
    return adv


def token_weights(mask: torch.Tensor, loss: str, n_seqs: float, n_tokens: float, max_len: int) -> torch.Tensor:
    """Per-token weight w so that the batch loss is sum(w * l).

    mask: (N, T) float, 1 on completion tokens that count. n_seqs / n_tokens are the *global* counts of counted
    completions / tokens (all ranks), so N ranks together compute the loss of one process on the whole batch.
    """
    if loss == "grpo":  # mean over each completion's tokens, then mean over completions
        return mask / mask.sum(dim=1, keepdim=True).clamp(min=1) / max(n_seqs, 1)
    if loss == "dapo":  # token-level mean over the batch
        return mask / max(n_tokens, 1)
    if loss == "dr_grpo":  # a constant normaliser: no length bias
        return mask / (max(n_seqs, 1) * max_len)
    raise ValueError(f"--loss {loss!r}: expected grpo, dapo or dr_grpo")


def policy_loss(logp, old_logp, ref_logp, adv, eps_low: float, eps_high: float, beta: float):
    """Per-token clipped surrogate (+ k3 KL). logp/old_logp/ref_logp: (N, T); adv: (N, 1). Returns l (N, T), stats.

    l_t = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + beta * kl_t,  rho = exp(logp - old_logp)
    kl_t = exp(ref - logp) - (ref - logp) - 1  (k3: unbiased, always >= 0)
    """
    rho = torch.exp(logp - old_logp)
    l = -torch.minimum(rho * adv, rho.clamp(1 - eps_low, 1 + eps_high) * adv)
    stats = {
        "clip_low": ((rho < 1 - eps_low) & (adv < 0)).float(),  # tokens where the lower clip removed the gradient
        "clip_high": ((rho > 1 + eps_high) & (adv > 0)).float(),
    }
    if beta > 0:
        d = ref_logp - logp
        kl = torch.exp(d) - d - 1
        l = l + beta * kl
        stats["kl"] = kl.detach()
    return l, stats


# ----------------------------------------------------------------------------------------------------------------
# Batch plumbing


def training_batch(prompts: list[list[int]], comp: torch.Tensor, n_comp: list[int], pad_id: int):
    """Right-padded [prompt + completion] rows and where each completion token's log-prob sits.

    prompts: N token lists; comp: (N, Tc) sampled tokens; n_comp: valid completion length per row (EOS included).
    Returns inputs (N, L), targets (N, L), pos (N, Tc): the column of inputs whose next-token prediction is
    completion token t (position len(prompt) - 1 + t, clamped for padding).
    """
    rows = [p + comp[i, : n_comp[i]].tolist() for i, p in enumerate(prompts)]
    L = max(len(r) for r in rows) - 1
    inputs = torch.full((len(rows), L), pad_id, dtype=torch.long)
    targets = torch.full((len(rows), L), -1, dtype=torch.long)  # -1 marks padding (its log-prob is never read)
    for i, r in enumerate(rows):
        inputs[i, : len(r) - 1] = torch.tensor(r[:-1])
        targets[i, : len(r) - 1] = torch.tensor(r[1:])
    t = torch.arange(comp.shape[1])
    pos = torch.tensor([len(p) - 1 for p in prompts])[:, None] + t[None, :]  # (N, Tc)
    return inputs, targets, pos.clamp(max=L - 1)


def completion_logprobs(model, inputs, targets, pos, temperature):
    """Trainer log-probs and entropy at the completion tokens: (N, Tc) each (entropy detached). The model computes
    them chunk by chunk, so full (N, L, vocab) fp32 logits never exist."""
    logp, ent = model(inputs, targets=targets, temperature=temperature)  # (N, L) each
    return logp.gather(1, pos), ent.gather(1, pos)


# ----------------------------------------------------------------------------------------------------------------


def main(argv=None):
    cfg = parse_config(GRPOConfig, argv)
    d = init_dist(cfg.dist_timeout)
    torch.set_flush_denormal(True)  # a tiny-model run once stalled on denormals without this
    seed_all(cfg.seed, d.rank)
    W, P, G = d.world_size, cfg.prompts_per_step, cfg.group_size
    if P % W:
        raise SystemExit(f"error: --prompts_per_step={P} is not divisible by the world size {W}")
    if G < 2 and cfg.scale_rewards == "group":
        raise SystemExit("error: --group_size 1 with --scale_rewards group: the std of one reward is undefined; use "
                         "G >= 2 (or --scale_rewards none)")
    if not 0 < cfg.lr < math.inf:
        raise SystemExit(f"error: --lr {cfg.lr}: need a positive finite learning rate")
    resume_from = resume_point(cfg, d, RESUME_MUST_MATCH)  # the checkpoint to continue from (None: start fresh)
    weights = rewards.parse_weights(cfg.reward_weights) if cfg.reward_weights else None
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.dtype]

    # --- model, reference, tokenizer ---------------------------------------------------------------------------
    with user_input("--init"):  # a missing dir, no weights, a truncated safetensors file, no tokenizer, ...
        model = load_model(cfg.init, device=d.device, dtype=dtype)
        tok = load_tokenizer(cfg.init)
    max_pos = model.config.max_position_embeddings
    eos_ids = sorted({i for i in [tok.eos_token_id, *_as_list(model.config.eos_token_id)] if i is not None})
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else eos_ids[0]
    ref = None
    if cfg.beta > 0:  # frozen copy of the starting policy; with beta = 0 it is never built
        ref = load_model(cfg.init, device=d.device, dtype=dtype).requires_grad_(False).eval()
        if cfg.dist == "fsdp":  # sharded like the policy; under DDP a frozen model needs no wrapper
            ref = wrap_model(ref, "fsdp", d)
    model = wrap_model(model, cfg.dist, d)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, cfg.beta2), weight_decay=cfg.weight_decay)

    # --- data: prompts are tokenized once ------------------------------------------------------------------------
    with user_input("data"):  # a missing file, a malformed row (named by file and line), a bad split or knob
        knobs = parse_knobs(cfg.task_knobs) if cfg.task_knobs else {}
        rows = load_task(cfg.task, cfg.split, path=cfg.data_path, seed=cfg.data_seed, **knobs)
        eval_rows = load_task(cfg.task, cfg.eval_split, path=cfg.data_path, seed=cfg.data_seed, **knobs)
    prompt_text, prefix = zip(*(format_prompt(r["question"], cfg.template, tok) for r in rows))
    prompt_ids = [tok.encode(t) for t in prompt_text]
    if max(len(p) for p in prompt_ids) + cfg.max_new_tokens > max_pos:
        raise SystemExit(f"error: longest prompt + --max_new_tokens={cfg.max_new_tokens} exceeds the model's "
                         f"max_position_embeddings={max_pos}: lower --max_new_tokens")
    order = _permutation_stream(len(rows), cfg.seed)  # global prompt order: epoch after epoch, seeded

    # load the checkpoint (or start fresh); cut metrics/samples.jsonl back to its step; write config.json
    state = start_or_resume(resume_from, cfg, model, opt, d)
    log = JsonlLogger(os.path.join(cfg.out_dir, "metrics.jsonl"), d.is_main, wandb_project=cfg.wandb,
                      tensorboard_dir=os.path.join(cfg.out_dir, "tb") if cfg.tensorboard else None, config=asdict(cfg),
                      start_step=state["step"])
    samples_log = JsonlLogger(os.path.join(cfg.out_dir, "samples.jsonl"), d.is_main)
    print0(f"GRPO: {len(rows)} train prompts, {P} prompts x G={G} per step over {W} rank(s), loss={cfg.loss}")

    t_train = state.get("t_train", 0.0)  # training wall time (eval excluded), for --max_minutes
    first = cfg.steps + 1 if stays_stopped(state, cfg.max_minutes) else state["step"] + 1
    for step in range(first, cfg.steps + 1):
        t0 = time.perf_counter()
        lr = lr_at(step - 1, cfg.warmup, cfg.steps, cfg.lr, cfg.min_lr_ratio)
        for g in opt.param_groups:
            g["lr"] = lr

        # 1. this rank's prompts: a contiguous slice of the step's global prompts
        mine = [order(i) for i in range((step - 1) * P + d.rank * (P // W), (step - 1) * P + (d.rank + 1) * (P // W))]

        # 2. sample G completions per prompt, gen_batch prompts per call; each call's generator is seeded from
        #    (seed, step, global index of its first prompt), so any world size draws the same samples
        toks, cmask, slogp, trunc = [], [], [], []
        model.eval()
        for c in range(0, len(mine), cfg.gen_batch):
            first = (step - 1) * P + d.rank * (P // W) + c
            gen = generate(
                model, [prompt_ids[i] for i in mine[c : c + cfg.gen_batch]], cfg.max_new_tokens,
                num_samples=G, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, eos_ids=eos_ids,
                pad_id=pad_id, generator=make_generator(cfg.seed, step, first, device=d.device),
            )  # fmt: skip
            toks.append(gen.tokens), cmask.append(gen.mask), slogp.append(gen.logprobs), trunc.append(gen.truncated)
        Tc = max(t.shape[1] for t in toks)
        comp = torch.cat([_pad(t, Tc, pad_id) for t in toks])  # (N, Tc), N = len(mine) * G, row = p * G + g
        cmask = torch.cat([_pad(m, Tc, False) for m in cmask])  # (N, Tc) bool, stop token included
        slogp = torch.cat([_pad(x, Tc, 0.0) for x in slogp])  # (N, Tc) sampler log-probs
        trunc = torch.cat(trunc)  # (N,)
        n_comp = cmask.sum(1).tolist()
        t1 = time.perf_counter()

        # 3. score: the response is what the prompt opened ("<think>") + the decoded completion
        texts = tok.batch_decode([comp[i, : n_comp[i]].tolist() for i in range(len(n_comp))], skip_special_tokens=True)
        scores = [
            rewards.reward(prefix[mine[i // G]] + t, rows[mine[i // G]]["answer"], weights,
                           num_tokens=n_comp[i], max_tokens=cfg.max_new_tokens)
            for i, t in enumerate(texts)
        ]  # fmt: skip
        r = torch.tensor([s["reward"] for s in scores], dtype=torch.float32).view(-1, G)  # (P_rank, G)

        # 4. group advantages and which tokens count
        adv = group_advantages(r, cfg.scale_rewards).view(-1, 1)  # (N, 1)
        zero_std = (r.max(1).values == r.min(1).values).repeat_interleave(G)  # (N,)
        keep = torch.ones_like(zero_std)
        if cfg.filter_zero_std:
            keep &= ~zero_std
        if cfg.mask_truncated:
            keep &= ~trunc
        lmask = (cmask & keep[:, None]).float()  # (N, Tc) loss mask
        n_seqs, n_tokens = all_reduce_sum([keep.sum().item(), lmask.sum().item()], d)  # global counts
        w = token_weights(lmask, cfg.loss, n_seqs, n_tokens, cfg.max_new_tokens) * W  # x W: DDP/FSDP average grads
        t2 = time.perf_counter()

        # 5. policy update(s). Rows whose every weight is 0, or whose advantage is 0 without KL, add no gradient:
        #    they are skipped, but every rank runs the same number of micro-batches (collectives must match).
        model.train()
        useful = (w.sum(1) > 0) & ((adv[:, 0] != 0) | (cfg.beta > 0))
        train_rows = useful.nonzero()[:, 0].tolist()
        row_prompts = [prompt_ids[mine[i // G]] for i in range(len(n_comp))]
        inputs, targets, pos = training_batch(row_prompts, comp, n_comp, pad_id)
        mb = cfg.train_micro_batch
        n_micro = int(max(all_reduce_sum([math.ceil(len(train_rows) / mb)], d, op="max")[0], 1))
        micro = [train_rows[k * mb : (k + 1) * mb] for k in range(n_micro)]
        old = {}
        if cfg.mu > 1 or cfg.beta > 0:  # old log-probs before the first update; reference log-probs for KL
            with torch.no_grad():
                for k, idx in enumerate(micro):
                    ix = idx or [0]
                    sl = _slice(inputs, targets, pos, ix)
                    old[k] = completion_logprobs(model, *sl, cfg.temperature)[0] if cfg.mu > 1 else None
                    old[("ref", k)] = completion_logprobs(ref, *sl, cfg.temperature)[0] if ref else None
        acc = {"clip_low": 0.0, "clip_high": 0.0, "kl": 0.0, "entropy": 0.0, "gap": 0.0, "ntok": 0.0}
        for update in range(cfg.mu):
            for k, idx in enumerate(micro):
                ix = idx or [0]  # a rank with nothing to train runs a zero-weight row to keep collectives in step
                last = k == n_micro - 1
                with _no_sync(model, last):
                    logp, ent = completion_logprobs(model, *_slice(inputs, targets, pos, ix), cfg.temperature)
                    old_logp = old[k] if cfg.mu > 1 else logp.detach()
                    ref_logp = old.get(("ref", k))
                    l, st = policy_loss(logp, old_logp, ref_logp, adv[ix], cfg.epsilon, cfg.epsilon_high, cfg.beta)
                    wk = w[ix] if idx else torch.zeros_like(w[ix])
                    (l * wk).sum().backward()
                if update == 0 and idx:  # diagnostics on the first pass over the counted tokens
                    m = lmask[ix]
                    acc["ntok"] += m.sum().item()
                    acc["entropy"] += (ent * m).sum().item()
                    acc["gap"] += ((logp.detach() - slogp[ix]).abs() * m).sum().item()
                    for key in ("clip_low", "clip_high", "kl"):
                        acc[key] += (st[key] * m).sum().item() if key in st else 0.0
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            check_finite(step, grad_norm, cfg.out_dir)  # NaN/inf: stop before the update, nothing of this step saved
            opt.step()
            opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        t_train += t3 - t0

        # 6. metrics, reduced over ranks
        comps = sorted(k for k in scores[0] if k != "reward")
        sums = all_reduce_sum(
            [len(scores), r.sum().item(), (r**2).sum().item(), zero_std.view(-1, G)[:, 0].sum().item(), r.shape[0],
             sum(n_comp), trunc.sum().item(), acc["ntok"], acc["entropy"], acc["gap"], acc["clip_low"],
             acc["clip_high"], acc["kl"]] + [sum(s[c] for s in scores) for c in comps], d)  # fmt: skip
        # the slowest rank sets the pace: max over ranks for lengths, generation time and memory
        len_max, t_gen, mem = all_reduce_sum([max(n_comp), t1 - t0, _peak_mem_mb(d.device)], d, op="max")
        n, nt = sums[0], max(sums[7], 1)
        mean_r = sums[1] / n
        metrics = {
            "step": step, "reward": mean_r, "reward_std": math.sqrt(max(sums[2] / n - mean_r**2, 0.0)),
            **{c: sums[13 + j] / n for j, c in enumerate(comps)},
            "frac_zero_std": sums[3] / sums[4], "clip_low": sums[10] / nt, "clip_high": sums[11] / nt,
            "kl": sums[12] / nt, "entropy": sums[8] / nt, "len_mean": sums[5] / n, "len_max": len_max,
            "truncated": sums[6] / n, "logprob_gap": sums[9] / nt, "t_generate": t_gen, "t_score": t2 - t1,
            "t_train": t3 - t2, "tokens_per_s": sums[5] / (t3 - t0), "mem_peak_mb": mem,
            "lr": lr, "grad_norm": grad_norm.item(), "elapsed_s": t_train,
        }  # fmt: skip
        for i in range(min(cfg.log_samples, len(texts))):
            samples_log.write({"step": step, "prompt": prompt_text[mine[i // G]], "completion": texts[i], **scores[i]})

        done = step == cfg.steps or (cfg.max_minutes > 0 and any_rank(t_train > cfg.max_minutes * 60, d))
        if cfg.eval_every and (step % cfg.eval_every == 0 or done):
            summary, _ = evaluate(model, tok, eval_rows, template=cfg.template, max_new_tokens=cfg.max_new_tokens,
                                  dist=d, seed=cfg.seed)  # fmt: skip
            metrics["eval_pass1"] = summary["pass@1"]
        log.write(metrics)
        print0(
            f"step {step} | reward {mean_r:.3f} | correct {metrics.get('correct', 0):.3f} | zero-std "
            f"{metrics['frac_zero_std']:.2f} | len {metrics['len_mean']:.1f} | gen {t1 - t0:.2f}s train {t3 - t2:.2f}s"
            + (f" | eval pass@1 {metrics['eval_pass1']:.3f}" if "eval_pass1" in metrics else "")
        )
        if done or (cfg.save_every and step % cfg.save_every == 0):
            train_state = {"t_train": t_train, "stopped": "time" if done and step < cfg.steps else False}
            save_checkpoint(cfg.out_dir, step, model, tok, train_state, d, optimizer=opt, keep=cfg.keep,
                            config=asdict(cfg))
        if done:
            break
    log.close()
    samples_log.close()
    cleanup_dist()


# ----------------------------------------------------------------------------------------------------------------
# small helpers


def _as_list(x):
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def _pad(x: torch.Tensor, T: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)


def _slice(inputs, targets, pos, ix):
    """Rows ix, cut to their longest real sequence (micro-batches of short rows cost less)."""
    L = int((targets[ix] != -1).sum(1).max())
    return inputs[ix, :L], targets[ix, :L].clamp(min=0), pos[ix].clamp(max=L - 1)


def _permutation_stream(n: int, seed: int):
    """i -> the i-th prompt of a stream of seeded permutations of range(n) (a new permutation each epoch)."""
    cache = {}

    def at(i):
        epoch = i // n
        if epoch not in cache:
            cache[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        return cache[epoch][i % n]

    return at


def _no_sync(model, last: bool):
    """Skip the gradient all-reduce on all but the last micro-batch (DDP no_sync / FSDP2 requires_gradient_sync)."""
    if last:
        if hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(True)
        return nullcontext()
    if hasattr(model, "no_sync"):
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
    return nullcontext()


def _peak_mem_mb(device) -> float:
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


if __name__ == "__main__":
    main()
    # Free main's objects (DDP/FSDP modules hold the gloo group in reference cycles) while the interpreter is still
    # whole; left to interpreter shutdown, gloo's threads can abort the process after a finished run (SIGABRT,
    # "terminate called without an active exception", seen once in CI on torch 2.13).
    gc.collect()
