"""GRPO: R1-style reinforcement learning with group-relative advantages.

One step, top to bottom (follow a batch through `grpo_step`; docs/architecture.md maps it):
  1. this rank takes its share of --prompts_per_step prompts (a seeded permutation, sliced by global rank)
  2. the KV-cache sampler draws --group_size G completions per prompt (each prompt prefilled once)
  3. rewards.reward scores every completion (each component is logged)
  4. group advantages A_i = r_i - mean(r) (optionally / (std(r) + eps))
  5. micro-batched forward/backward of the --loss policy term (+ beta * k3 KL to a frozen reference: a copy of
     the start model, or with --lora_rank the policy itself with its adapters switched off)
  6. grad clip, AdamW step, metrics (all-reduced over ranks), eval / checkpoint every N steps

Launch:
  python grpo.py --init runs/sft/model                      # one process
  torchrun --nproc_per_node=2 grpo.py --init runs/sft/model # data parallel (DDP; --dist fsdp for FSDP2)
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts=3 --nproc_per_node=2 grpo.py ...
                                                            # a dead worker restarts the group, which resumes

Resume: run the same command again and it continues from the newest complete checkpoint in --out_dir
(--resume auto, the default; --resume PATH: a given checkpoint; --overwrite: start over). Step s's
prompts and sampler generators are derived from (seed, step, prompt index), and a checkpoint holds
weights, full optimizer state, every rank's RNG states and the training clock, so the continuation
is bitwise the uninterrupted run; metrics/samples.jsonl are cut back to the checkpoint's step first.

Simplifications, stated up front:
  - one rollout -> mu policy updates (default 1: the ratio is exactly 1 and no old-log-prob forward is needed);
  - a prompt's G samples stay on one rank, so group statistics need no communication;
  - generation uses the training weights directly (no separate inference engine, no weight sync), unless
    --rollout vllm: then a vLLM engine per rank samples, its weights pushed after each step (rollout_vllm.py);
  - advantages use the *sample* std (unbiased, like torch.std) plus eps=1e-4 when --scale_rewards=group.
"""

import math
import os
import time
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule

import fast
import reward_plugins
import rewards
import rollout_vllm
from checkpoint import (
    check_finite,
    check_out_dir,
    export_lora,
    find_latest,
    publish_model,
    release_run_dir,
    resume_point,
    run_record,
    save_checkpoint,
    start_or_resume,
)
from common import (
    DTYPES,
    JsonlLogger,
    Progress,
    all_reduce_named,
    any_rank,
    autocast,
    check_flags,
    check_precision,
    checkpoint_due,
    cleanup_dist,
    clip_grad_norm,
    cxx_compiler,
    derive_seed,
    flag,
    free_main_objects,
    frozen_in_compute_dtype,
    grad_sync,
    load_device,
    make_generator,
    open_metrics_log,
    peak_mem_mb,
    permutation_stream,
    print0,
    reset_peak_mem,
    resumed_clocks,
    seed_all,
    set_lr,
    start_stage,
    stays_stopped,
    user_input,
    wrap_model,
)
from data import encode_prompt, format_prompt, load_splits
from eval import evaluate, sample_line
from hf import check_token_ids, load_config, load_model, load_tokenizer, stop_and_pad_ids
from lora import LORA_TARGETS, adapters_off, add_lora, check_lora
from memory import format_memory, memory_estimate, memory_shapes
from packing import micro_batch, micro_batches, training_batch
from sampler import generate


@dataclass
class GRPOConfig:
    """GRPO from an HF model dir: sample G completions per prompt, score them, update on group
    advantages."""
    init: str = flag("runs/sft/model", "HF model dir to start from", section="model and data")
    size_limits: bool = flag(True, "refuse model configs past sanity sizes (model.py SIZE_LIMITS, "
                             "MAX_PARAMS); false lifts them", section="model and data")
    task: str = flag("arith", "task: arith | gsm8k | math | custom (--data_path, --question_field, ...)",
                     section="model and data")
    split: str = flag("train[5%:]", "training problems (answers only are used)", section="model and data")
    data_path: str | None = flag(None, "a .jsonl/.json/.parquet/.csv file, a dir of {split}.jsonl|..., or a "
                                 "hub dataset name (gsm8k/math: none = the hub)", section="model and data")
    task_knobs: str = flag("", "built-in task difficulty, e.g. 'steps=3,high=999,ops=+-*'", section="model and data")
    question_field: str = flag("question", "--task custom: the question's column", section="model and data")
    answer_field: str = flag("answer", "--task custom: the gold answer's column", section="model and data")
    answer_regex: str = flag("", "--task custom: the gold is this regex's first group in the answer "
                             "column, e.g. '####\\s*(.+)' ('' = the whole column)", section="model and data")
    system_prompt: str = flag("", "replaces the template's system prompt (r1: its preamble, chat: the "
                              "system message; '' = the template's own)", section="model and data")
    template: str = flag("short", "prompt template", choices=["short", "r1", "chat"], section="model and data")
    eval_split: str = flag("test[:200]", "held-out problems for in-loop eval", section="model and data")
    out_dir: str = flag("runs/grpo", "run directory (config, metrics, checkpoints)", section="model and data")

    lora_rank: int = flag(0, "LoRA rank r: train low-rank adapters on a frozen base; the KL "
                          "reference is the base itself (0 = off)",
                          section="LoRA (off by default: every weight trains)")
    lora_alpha: float = flag(32.0, "LoRA alpha: the update is scaled by alpha / r",
                             section="LoRA (off by default: every weight trains)")
    lora_dropout: float = flag(0.0, "dropout on the adapters' input (training only)",
                               section="LoRA (off by default: every weight trains)")
    lora_targets: tuple[str, ...] = flag(LORA_TARGETS, "projections that get adapters (comma list)",
                                         section="LoRA (off by default: every weight trains)")
    lora_base_dtype: str = flag("float32", "dtype of the frozen base weights",
                                choices=["float32", "bfloat16"], section="LoRA (off by default: every weight trains)")

    prompts_per_step: int = flag(16, "prompts per step, over all ranks", section="GRPO")
    group_size: int = flag(8, "G: completions sampled per prompt", section="GRPO")
    max_new_tokens: int = flag(64, "completion length limit", section="GRPO")
    temperature: float = flag(1.0, "sampling temperature (trainer log-probs use it too)", section="GRPO")
    top_p: float = flag(1.0, "nucleus sampling (<1 makes sampler/trainer log-probs differ)", section="GRPO")
    top_k: int = flag(0, "top-k sampling (0 = off)", section="GRPO")
    gen_batch: int = flag(8, "prompts per sampler call (x G rows); --rollout vllm takes all at once",
                          section="GRPO")
    compile: bool = flag(False, "decode the rollouts through torch.compile (generate's compile=True): "
                         "on an AVX-512 AMD CPU ~1.2x faster for 256+ wide fp32 models without "
                         "LoRA, no faster at the demo's width; the first step compiles (~25 s, ~6 s "
                         "cached); on the CPU it needs a C++ compiler (docs/speed.md)", section="GRPO")
    loss: str = flag("dapo", "grpo: per-seq mean | dapo: token mean | dr_grpo: constant "
                     "denominator | gspo: sequence ratio | cispo: clipped IS weight",
                     choices=["grpo", "dapo", "dr_grpo", "gspo", "cispo"], section="GRPO")
    scale_rewards: str = flag("none", "advantage scaling: group (divide by std) | none",
                              choices=["group", "none"], section="GRPO")
    epsilon: float = flag(0.2, "PPO clip: lower bound 1 - epsilon", section="GRPO")
    epsilon_high: float = flag(0.28, "PPO clip: upper bound 1 + epsilon_high (clip-higher)", section="GRPO")
    beta: float = flag(0.0, "k3 KL weight to the frozen init model (0: no reference model)", section="GRPO")
    mu: int = flag(1, "policy updates per rollout batch", section="GRPO")
    tis_cap: float | None = flag(None, "truncated importance sampling: weight the policy term by "
                                 "min(exp(trainer - sampler logp), C) (0 = off; none: 2 with --rollout vllm, "
                                 "else 0)", section="GRPO")
    rollout: str = flag("sampler", "what samples the rollouts and evals: sampler.py, or a vLLM engine per rank, "
                        "its weights pushed after each step (pip install vllm; docs/vllm.md)",
                        choices=["sampler", "vllm"], section="GRPO")
    vllm_memory: float = flag(0.3, "--rollout vllm: the engine's share of the GPU's memory (weights, "
                              "activations, KV cache); on the CPU, its KV cache's share of the RAM", section="GRPO")
    filter_zero_std: bool = flag(True, "drop groups with all-equal rewards from the loss", section="GRPO")
    mask_truncated: bool = flag(False, "drop truncated completions from the loss", section="GRPO")
    reward_weights: str = flag("", "reward weights, e.g. 'correct=1,format=0.1'", section="GRPO")
    reward_fn: tuple[str, ...] = flag((), "your own reward: path/to/file.py:fn or module:fn, called "
                                      "fn(completion, answer, **row) -> float (repeatable; weight 1 unless "
                                      "--reward_weights fn=w)", section="GRPO", repeat=True)
    reward_tolerance: float = flag(0.0, "relative error at which a decimal answer matches an exact "
                                   "one (0 = exact)", section="GRPO")

    steps: int = flag(3000, "optimizer steps (upper bound when --max_minutes is set)", section="optimisation")
    max_minutes: float = flag(0.0, "stop after this much training wall time (0 = off)", section="optimisation")
    lr: float = flag(1e-4, "peak learning rate", section="optimisation")
    warmup: int = flag(10, "linear warmup steps", section="optimisation")
    min_lr_ratio: float = flag(1.0, "cosine floor as a fraction of lr (1.0 = constant)", section="optimisation")
    weight_decay: float = flag(0.0, "AdamW weight decay", section="optimisation")
    beta2: float = flag(0.98, "AdamW beta2", section="optimisation")
    grad_clip: float = flag(1.0, "clip the global grad norm to this (0 = off)", section="optimisation")
    train_micro_batch: int = flag(64, "rows per forward/backward, at most (0 = no limit)", section="optimisation")

    micro_batch_tokens: int = flag(0, "padded tokens per forward/backward, at most (rows x longest "
                                   "row; rows grouped by length; 0 = off)", section="memory")
    pack: bool = flag(True, "pack a micro-batch's sequences into rows as wide as its longest, "
                      "attention kept within each: no compute on padding", section="memory")
    share_prompt: bool = flag(True, "with --pack: a group's rows hold their prompt once, each "
                              "completion attending to it (the prompt's forward and backward "
                              "done once, not G times)", section="memory")
    activation_checkpointing: bool = flag(False, "recompute each transformer block in backward: "
                                          "activations of one block, not all (+1 forward)", section="memory")
    dry_run: bool = flag(False, "print the memory estimate per rank and exit", section="memory")

    dist: str = flag("ddp", "data parallelism under torchrun", choices=["ddp", "fsdp"], section="infrastructure")
    dist_timeout: float = flag(600.0, "seconds before a stuck collective fails", section="infrastructure")
    progress_every: float = flag(30.0, "seconds between progress lines when the output is a file "
                                 "or pipe (a terminal gets a bar)", section="infrastructure")
    dtype: str = flag("float32", "compute dtype; bfloat16: bf16 matmuls over fp32 weights and "
                      "AdamW state (autocast, or FSDP2 mixed precision)",
                      choices=["float32", "bfloat16"], section="infrastructure")
    weights_dtype: str = flag("float32", "storage dtype of weights and AdamW state; bfloat16 "
                              "halves it but loses small updates (needs --dtype bfloat16)",
                              choices=["float32", "bfloat16"], section="infrastructure")
    seed: int = flag(0, "RL seed (sampling and data order)", section="infrastructure")
    data_seed: int = flag(0, "seed of the built-in task's problems", section="infrastructure")
    eval_every: int = flag(50, "evaluate held-out greedy pass@1 every N steps (0 = off)", section="infrastructure")
    save_every: int = flag(0, "checkpoint every N steps (0 = only at the end)", section="infrastructure")
    save_minutes: float = flag(30.0, "also checkpoint once this much wall time has passed since the "
                               "last checkpoint (0 = off): a crash loses at most that much", section="infrastructure")
    keep: int = flag(2, "checkpoints to keep", section="infrastructure")
    log_samples: int = flag(2, "completions per step written to samples.jsonl", section="infrastructure")
    log_samples_every: int = flag(0, "every N steps, those completions (prompt, completion, reward "
                                  "components) as a table to --wandb / --tensorboard (0 = off)",
                                  section="infrastructure")
    resume: str = flag("auto", "auto: continue from the newest checkpoint in --out_dir (if any) | "
                       "none: start fresh | PATH: that checkpoint", section="infrastructure")
    overwrite: bool = flag(False, "start over, deleting the run already in --out_dir", section="infrastructure")

    wandb: str = flag("", "also log metrics to this Weights & Biases project (pip install wandb; "
                      "WANDB_MODE=offline works)", section="optional loggers (metrics.jsonl is always written)")
    tensorboard: bool = flag(False, "also write TensorBoard events to OUT/tb (pip install "
                             "tensorboard)", section="optional loggers (metrics.jsonl is always written)")


# -----------------------------------------------------------------------------
# The math: pure functions, tensors in and out


def group_advantages(r: torch.Tensor, scale: str, eps: float = 1e-4) -> torch.Tensor:
    """r: (P, G) rewards -> (P, G) advantages r - mean(r), divided by (sample std + eps) when
    scale == 'group'. A group whose rewards are all equal gets exactly 0: the fp32 mean of G equal
    values can miss them in the last bit (G=12 rewards of 1.1: 1.2e-7), which / eps would turn into
    a real advantage."""
    adv = r - r.mean(dim=1, keepdim=True)
    if scale == "group":
        adv = adv / (r.std(dim=1, keepdim=True) + eps)  # unbiased std, like torch.std / TRL
    equal = r.max(dim=1, keepdim=True).values == r.min(dim=1, keepdim=True).values  # (P, 1)
    return adv.masked_fill(equal, 0.0)


def token_weights(mask: torch.Tensor, loss: str, n_seqs: float, n_tokens: float, n_rows: float,
                  max_len: int) -> torch.Tensor:
    """Per-token weight w so that the batch loss is sum(w * l).

    mask: (N, T) float, 1 on completion tokens that count. n_seqs / n_tokens are the *global* counts
    of counted completions / tokens (all ranks), so N ranks together compute the loss of one process
    on the whole batch; n_rows counts every completion of the step's batch, filtered or not
    (dr_grpo's constant denominator).
    """
    if loss in ("grpo", "gspo"):  # mean over each completion's tokens, then mean over completions
        return mask / mask.sum(dim=1, keepdim=True).clamp(min=1) / max(n_seqs, 1)
    if loss in ("dapo", "cispo"):  # token-level mean over the batch
        return mask / max(n_tokens, 1)
    # a constant normaliser: no length bias, no dependence on how many rows were filtered
    if loss == "dr_grpo":
        return mask / (max(n_rows, 1) * max_len)
    raise ValueError(f"--loss {loss!r}: expected grpo, dapo, dr_grpo, gspo or cispo")


def policy_loss(logp, old_logp, adv, mask, loss: str, eps_low: float, eps_high: float, tis=None):
    """Per-token policy term of --loss, l (N, T), and clip stats (N, T). logp/old_logp/mask: (N, T);
    adv: (N, 1); tis: (N, T) truncated importance weights or None.
    With lo, hi = 1 - eps_low, 1 + eps_high:

      grpo/dapo/dr_grpo  l_t = -min(rho_t A, clip(rho_t, lo, hi) A),  rho_t = exp(logp_t - old_t)
      gspo               the same with one ratio per sequence, s = exp(mean over its tokens of (logp - old))
      cispo              l_t = -sg(clip(rho_t, lo, hi)) A logp_t  (every token keeps its gradient)
    and l_t *= tis_t when given. The ratio is read only where mask is 1 (elsewhere 1), so garbage
    there is inert.
    """
    log_ratio = torch.where(mask > 0, logp - old_logp, 0.0)  # (N, T)
    if loss == "gspo":  # length-normalised sequence log-ratio, broadcast to its tokens
        log_ratio = log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # (N, 1)
    rho = torch.exp(log_ratio)
    lo, hi = 1 - eps_low, 1 + eps_high
    if loss == "cispo":  # clipping caps the weight: it never removes a token's gradient
        l = -rho.detach().clamp(lo, hi) * adv * logp
        low, high = rho < lo, rho > hi
    else:
        l = -torch.minimum(rho * adv, rho.clamp(lo, hi) * adv)
        # where the clip removed the gradient
        low, high = (rho < lo) & (adv < 0), (rho > hi) & (adv > 0)
    if tis is not None:
        l = l * tis
    stats = {"clip_low": low.float().expand_as(logp), "clip_high": high.float().expand_as(logp)}
    return l, stats


def tis_weights(old_logp, sampler_logp, cap: float):
    """Truncated importance sampling (N, T): min(exp(old - sampler), cap), a constant. It corrects
    for the trainer (old_logp) and sampler disagreeing on the sampled tokens (bf16 sampling, top-p /
    top-k, an inference engine). exp(min(x, log cap)) is the same number and cannot overflow."""
    return torch.exp((old_logp - sampler_logp).clamp(max=math.log(cap))).detach()


def tis_cap(cfg) -> float:
    """--tis_cap, its default (none) resolved: 2 with --rollout vllm, an engine whose log-probs are another program's
    (as TRL, verl and OpenRLHF default), else 0 (off: the sampler's are the trainer's to rounding)."""
    return cfg.tis_cap if cfg.tis_cap is not None else 2.0 if cfg.rollout == "vllm" else 0.0


def k3_kl(logp, ref_logp, max_log_ratio: float = 20.0):
    """Per-token k3 KL to the reference, (N, T): exp(d) - d - 1 with d = ref - logp (unbiased,
    always >= 0). d is clamped to +-max_log_ratio (as verl does), so a padding or garbage position
    cannot overflow exp() to inf, which times its weight 0 would be NaN, gradients included."""
    d = (ref_logp - logp).clamp(-max_log_ratio, max_log_ratio)
    return torch.exp(d) - d - 1


def loss_mask(r: torch.Tensor, mask: torch.Tensor, truncated: torch.Tensor, filter_zero_std: bool,
              mask_truncated: bool):
    """Which completion tokens count in the loss. r: (P, G) rewards; mask: (N, Tc) bool sampled
    tokens (stop token included), N = P * G; truncated: (N,) bool. Returns lmask (N, Tc) float, keep
    (N,) bool (the completion counts), zero_std (P,) bool (the group's rewards are all equal, so its
    advantages are exactly 0)."""
    G = r.shape[1]
    zero_std = r.max(1).values == r.min(1).values  # (P,)
    keep = torch.ones_like(truncated)  # (N,)
    if filter_zero_std:
        keep &= ~zero_std.repeat_interleave(G)
    if mask_truncated:
        keep &= ~truncated
    return (mask & keep[:, None]).float(), keep, zero_std


# -----------------------------------------------------------------------------
# One step's pieces, in order: rollout -> score -> (advantages, loss mask: above) -> update -> step_metrics.
# Every tensor lives on the model's device; host-side bookkeeping (text, rewards, row lists) crosses over explicitly.


@dataclass
class Rollout:
    """G completions of each of this rank's prompts, row = prompt * G + sample; every tensor on the
    model's device."""
    tokens: torch.Tensor  # (N, Tc) long, pad_id after the stop token
    mask: torch.Tensor  # (N, Tc) bool, True through the stop token
    logprobs: torch.Tensor  # (N, Tc) fp32, the sampler's log-prob of each token (0 where masked)
    truncated: torch.Tensor  # (N,) bool, hit --max_new_tokens without a stop token
    lengths: torch.Tensor  # (N,) long, completion tokens (stop token included)


def rollout(model, prompts: list[list[int]], first: int, step: int, cfg: GRPOConfig, eos_ids, pad_id: int,
            device, engine=None) -> Rollout:
    """Sample cfg.group_size completions per prompt, cfg.gen_batch prompts per sampler call.
    prompts[0] is the step's global prompt number `first`. Each prompt's G rows draw their sampling
    noise from their own generator, seeded from (seed, step, global prompt number), so on the CPU any
    world size and any --gen_batch split draws the same samples (on CUDA the same noise, over logits that differ
    to rounding between batch shapes). engine (--rollout vllm): it samples all the prompts in one call instead,
    each prompt's G rows seeded from the same numbers."""
    model.eval()
    if engine is not None:
        seeds = [derive_seed(cfg.seed, step, first + j) for j in range(len(prompts))]
        parts = [engine.generate(prompts, cfg.max_new_tokens, num_samples=cfg.group_size, temperature=cfg.temperature,
                                 top_p=cfg.top_p, top_k=cfg.top_k, eos_ids=eos_ids, pad_id=pad_id, seeds=seeds)]
        engine.sleep()  # CUDA: its memory is the update's until the next push
    else:
        parts = [sampler_call(model, prompts[c : c + cfg.gen_batch], first + c, step, cfg, eos_ids, pad_id, device)
                 for c in range(0, len(prompts), cfg.gen_batch)]
    # calls stop at different lengths: pad to the longest
    Tc = max(g.tokens.shape[1] for g in parts)
    mask = torch.cat([_pad(g.mask, Tc, False) for g in parts])
    return Rollout(
        tokens=torch.cat([_pad(g.tokens, Tc, pad_id) for g in parts]), mask=mask,
        logprobs=torch.cat([_pad(g.logprobs, Tc, 0.0) for g in parts]),
        truncated=torch.cat([g.truncated for g in parts]), lengths=mask.sum(1),
    )  # fmt: skip


def sampler_call(model, chunk: list[list[int]], first: int, step: int, cfg: GRPOConfig, eos_ids, pad_id: int, device):
    """One sampler.generate call on `chunk`, prompt j being the step's global prompt number first + j."""
    # (len(chunk) * G, max_new_tokens) uniforms, row = prompt * G + sample: prompt j's from its
    # own generator
    draws = []
    for j in range(len(chunk)):
        g = make_generator(cfg.seed, step, first + j, device=device)
        draws.append(torch.rand(cfg.group_size, cfg.max_new_tokens, generator=g, device=device))
    noise = torch.cat(draws)
    # the trainer's compute dtype, so sampler and trainer log-probs agree
    with autocast(model, cfg.dtype):
        return generate(
            model, chunk, cfg.max_new_tokens, num_samples=cfg.group_size,
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            eos_ids=eos_ids, pad_id=pad_id, noise=noise, fast="compile" if cfg.compile else "auto",
        )  # fmt: skip


def score(tok, roll: Rollout, response_starts: list[str], problems: list[dict], cfg: GRPOConfig, weights,
          plugins=()):
    """Decode and score every completion on the host: the scored response is what the prompt opened
    ("<think>") + the decoded completion, against its row's gold answer in the task's answer form,
    then by each --reward_fn plug-in (reward_plugins.py).
    response_starts/problems (task rows): one per prompt. Returns the rewards r
    (P, G) fp32, moved to the rollout's device once, each completion's reward dict and its text."""
    G, lengths = cfg.group_size, roll.lengths.tolist()
    rows = [t[:n] for t, n in zip(roll.tokens.tolist(), lengths)]  # one device -> host copy
    texts = tok.batch_decode(rows, skip_special_tokens=True)
    scores = [
        rewards.reward(response_starts[i // G] + t, problems[i // G]["answer"], weights, num_tokens=lengths[i],
                       max_tokens=cfg.max_new_tokens, tolerance=cfg.reward_tolerance,
                       numeric=problems[i // G].get("numeric", False), question=problems[i // G]["question"])
        for i, t in enumerate(texts)
    ]  # fmt: skip
    if plugins:
        scores = [reward_plugins.add_scores(plugins, s, response_starts[i // G] + t, problems[i // G])
                  for i, (s, t) in enumerate(zip(scores, texts))]  # fmt: skip
    r = torch.tensor([s["reward"] for s in scores], dtype=torch.float32, device=roll.tokens.device)
    return r.view(-1, G), scores, texts


def completion_logprobs(model, mb: dict, temperature, dtype: str = "float32"):
    """Trainer log-probs and entropy at the completion tokens of micro_batch `mb`: (n, Tc) each
    (entropy detached), computed in `dtype` (the log-softmax itself in fp32). The model computes them
    chunk by chunk at those positions alone, so full (n, L, vocab) fp32 logits never exist."""
    with autocast(model, dtype):
        return model(**mb, temperature=temperature)


# what update() sums (this rank's): over the counted tokens of the first pass (ntok, entropy,
# logprob_gap), over the KL's tokens of the first pass (ntok_kl, kl), and over the counted tokens of
# every pass, / mu (clip_*)
UPDATE_STATS = ("ntok", "entropy", "logprob_gap", "ntok_kl", "kl", "clip_low", "clip_high")


def update(model, ref, opt, batch, seq_len: list[int], adv, lmask, w, w_kl, sampler_logp, cfg: GRPOConfig,
           step: int) -> dict:
    """cfg.mu policy updates on one rollout: micro-batched forward/backward of sum(w * policy_loss)
    (+ beta * sum(w_kl * k3_kl)), grad clip, optimizer step. batch: training_batch's (inputs,
    targets, pos, prompt_of); seq_len: each row's real length in it (host); adv (N, 1), lmask / w /
    sampler_logp (N, Tc), w_kl (N, Tc) or None (beta = 0), all on the model's device.

    Rows that add no gradient (no KL weight, and no policy weight or advantage 0) are skipped, but
    every rank runs the same number of micro-batches (collectives must match), a rank without rows
    one zero-weight row. Returns UPDATE_STATS's sums and the last pass's grad_norm."""
    model.train()
    micro = useful_micro_batches(seq_len, adv, w, w_kl, cfg)
    # each micro-batch's row indices on the device, and its columns cut to its longest row
    # (short rows cost less)
    ix = [torch.tensor(idx or [0], device=lmask.device) for idx in micro]
    sliced = [micro_batch(*batch, idx or [0], seq_len, cfg.pack, cfg.share_prompt) for idx in micro]
    old, ref_logp = frozen_logprobs(model, ref, sliced, cfg)
    cap = tis_cap(cfg)  # truncated importance sampling (0: off)
    stats = []  # per counted micro-batch and pass: UPDATE_STATS's sums, on the device
    for pass_i in range(cfg.mu):
        for k, idx in enumerate(micro):
            with grad_sync(model, k == len(micro) - 1):
                logp, ent = completion_logprobs(model, sliced[k], cfg.temperature, cfg.dtype)
                old_logp = old[k] if cfg.mu > 1 else logp.detach()
                m = lmask[ix[k]]
                tis = None
                if cap:
                    tis = tis_weights(old_logp, sampler_logp[ix[k]], cap)
                l, clip = policy_loss(logp, old_logp, adv[ix[k]], m, cfg.loss,
                                      cfg.epsilon, cfg.epsilon_high, tis)
                # the padding micro-batch of a rank without rows adds nothing
                live = 1.0 if idx else 0.0
                loss = (l * w[ix[k]]).sum() * live
                kl = k3_kl(logp, ref_logp[k]) if ref is not None else None
                if kl is not None:
                    loss = loss + cfg.beta * (kl * w_kl[ix[k]]).sum() * live
                loss.backward()
            if idx:
                kl_w = w_kl[ix[k]] if kl is not None else None
                gap = (logp.detach() - sampler_logp[ix[k]]).abs()
                stats.append(micro_stats(m, ent, gap, clip, kl, kl_w, pass_i == 0, cfg.mu))
        grad_norm = clip_grad_norm(model, cfg.grad_clip)
        # NaN/inf: stop before the update, nothing of this step saved
        check_finite(step, grad_norm, cfg.out_dir)
        opt.step()
        opt.zero_grad(set_to_none=True)
    out = dict.fromkeys(UPDATE_STATS, 0.0)
    # one device -> host copy; summed in order
    for row in torch.stack(stats).tolist() if stats else []:
        for name, v in zip(UPDATE_STATS, row):
            out[name] += v
    return {**out, "grad_norm": grad_norm.item()}


def useful_micro_batches(seq_len: list[int], adv, w, w_kl, cfg: GRPOConfig) -> list[list[int]]:
    """The rows that add a gradient (a KL weight, or a policy weight and a nonzero advantage) in
    length-grouped micro-batches within --train_micro_batch rows / --micro_batch_tokens: row indices,
    as many micro-batches on every rank (at least one, maybe empty)."""
    useful = (w.sum(1) > 0) & (adv[:, 0] != 0)  # (N,)
    if w_kl is not None:
        useful |= w_kl.sum(1) > 0
    rows = useful.nonzero()[:, 0].tolist()
    row_lens = [seq_len[i] for i in rows]
    groups = micro_batches(row_lens, cfg.train_micro_batch, cfg.micro_batch_tokens) or [[]]
    return [[rows[j] for j in g] for g in groups]


def frozen_logprobs(model, ref, sliced: list[dict], cfg: GRPOConfig):
    """Per micro-batch, before the first update: the old log-probs (only with --mu > 1; else None, the
    ratio is 1) and the reference's for the KL (only with a ref; else None)."""
    old, ref_logp = [None] * len(sliced), [None] * len(sliced)
    if cfg.mu > 1 or ref is not None:
        with torch.no_grad():
            for k, mb in enumerate(sliced):
                if cfg.mu > 1:
                    old[k] = completion_logprobs(model, mb, cfg.temperature, cfg.dtype)[0]
                # with LoRA, ref is the policy itself and the base is it without adapters
                if ref is not None:
                    with adapters_off(ref):
                        ref_logp[k] = completion_logprobs(ref, mb, cfg.temperature, cfg.dtype)[0]
    if isinstance(ref, FSDPModule) and ref is not model:
        ref.reshard()  # FSDP2 keeps a root's parameters (embeddings, head) gathered after forward, for a backward
    return old, ref_logp


def micro_stats(m, ent, gap, clip: dict, kl, w_kl, first_pass: bool, mu: int) -> torch.Tensor:
    """One micro-batch's UPDATE_STATS sums (a device tensor): the first pass's token counts, entropy,
    |trainer - sampler| gap and KL (0 on later passes: the ratio moves after the first), and every
    pass's clip fractions / mu. m: (n, Tc) counted tokens; kl / w_kl: None without a reference."""
    first = float(first_pass)
    m_kl = (w_kl > 0).float() if kl is not None else torch.zeros_like(m)
    kl_sum = (kl.detach() * m_kl).sum() if kl is not None else m.new_zeros(())
    sums = [m.sum(), (ent * m).sum(), (gap * m).sum(), m_kl.sum(), kl_sum]
    clips = [(clip[key] * m).sum() / mu for key in ("clip_low", "clip_high")]
    return torch.stack([x * first for x in sums] + clips)


def step_metrics(step: int, scores: list[dict], r, zero_std, roll: Rollout, stats: dict, times: dict, lr: float,
                 device) -> dict:
    """The step's metrics (docs/losses.md lists them), reduced over ranks by name: counts and sums add
    up, the slowest rank sets lengths, generation time and memory (max)."""
    lengths = roll.lengths.tolist()
    r_sum, r_sq, n_zero, n_trunc = torch.stack([r.sum(), (r**2).sum(), zero_std.sum().float(),
                                                roll.truncated.sum().float()]).tolist()  # fmt: skip
    comps = sorted(k for k in scores[0] if k != "reward")  # reward components: correct, format, ...
    local = {
        "n": len(scores), "reward": r_sum, "reward_sq": r_sq, "zero_std": n_zero,
        "groups": r.shape[0], "len": sum(lengths), "truncated": n_trunc,
        **{k: stats[k] for k in UPDATE_STATS},
        **{"comp_" + c: sum(s[c] for s in scores) for c in comps},
        "len_max": max(lengths), "t_generate": times["generate"], "mem_peak_mb": peak_mem_mb(device),
    }  # fmt: skip
    g = all_reduce_named(local, {"len_max": "max", "t_generate": "max", "mem_peak_mb": "max"})
    n, nt = g["n"], max(g["ntok"], 1)
    mean_r = g["reward"] / n
    reward_var = max(g["reward_sq"] / n - mean_r**2, 0.0)
    return {
        "step": step,
        "reward": mean_r,
        "reward_std": math.sqrt(reward_var),
        **{c: g["comp_" + c] / n for c in comps},
        "frac_zero_std": g["zero_std"] / g["groups"],
        "clip_low": g["clip_low"] / nt,
        "clip_high": g["clip_high"] / nt,
        "kl": g["kl"] / max(g["ntok_kl"], 1),
        "entropy": g["entropy"] / nt,
        "len_mean": g["len"] / n,
        "len_max": g["len_max"],
        "truncated": g["truncated"] / n,
        "logprob_gap": g["logprob_gap"] / nt,
        "t_generate": g["t_generate"],
        "t_score": times["score"],
        "t_train": times["update"],  # this step's update (train_s: the run's so far)
        "tokens_per_s": g["len"] / times["step"],
        "mem_peak_mb": g["mem_peak_mb"],
        "lr": lr,
        "grad_norm": stats["grad_norm"],
    }


# -----------------------------------------------------------------------------
# Setup, in the order main runs it: the flags, the prompts, the models


def check_config(cfg: GRPOConfig, d) -> tuple[dict | None, list]:
    """Refuse bad flags before anything is read. -> the parsed --reward_weights (None: the defaults) and the
    --reward_fn plug-ins, loaded, with their weights."""
    W, P, G = d.world_size, cfg.prompts_per_step, cfg.group_size
    check_flags(cfg,
                at_least_1=("prompts_per_step", "group_size", "max_new_tokens", "gen_batch", "mu",
                            "steps"),
                at_least_0=("train_micro_batch", "micro_batch_tokens", "top_k", "warmup",
                            "eval_every", "save_every", "save_minutes", "keep", "log_samples", "log_samples_every",
                            "max_minutes", "beta", "weight_decay", "epsilon", "epsilon_high", "grad_clip",
                            "progress_every"),
                positive=("lr", "temperature", "top_p", "dist_timeout"))
    if P % W:
        raise SystemExit(f"error: --prompts_per_step={P} is not divisible by the world size {W}")
    if G < 2 and cfg.scale_rewards == "group":
        raise SystemExit("error: --group_size 1 with --scale_rewards group: the std of one reward "
                         "is undefined; use G >= 2 (or --scale_rewards none)")
    if not 0 <= tis_cap(cfg) < math.inf:
        raise SystemExit(f"error: --tis_cap {cfg.tis_cap}: need 0 (off) or a positive finite cap, "
                         "e.g. 2")
    rewards.check_tolerance(cfg.reward_tolerance)
    if cfg.compile and d.device.type == "cpu" and cxx_compiler() is None:  # inductor builds with one
        raise SystemExit("error: --compile on the CPU needs a C++ compiler (g++ on PATH, or CXX "
                         "naming one): install one, or drop --compile")
    check_out_dir(cfg.out_dir, "grpo", cfg.init)  # before anything is read: never its own --init
    with user_input("--reward_fn"):  # a missing file or function, a failing import
        plugins = reward_plugins.load(cfg.reward_fn)
    with user_input("--reward_weights"):
        weights = reward_plugins.parse_weights(cfg.reward_weights, plugins)
    check_precision(cfg.dtype, cfg.weights_dtype)
    if cfg.lora_rank:  # before the memory estimate, which sizes the adapters
        with user_input("--lora_*"):
            check_lora(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)
    return weights, plugins


@dataclass
class Prompts:
    """The task's training problems and their prompts, formatted and tokenized once (index = problem),
    and the held-out problems of the in-loop eval."""
    rows: list[dict]  # {"question", "answer", ...}
    text: list[str]  # the formatted prompt
    response_start: list[str]  # what the prompt opens the response with (e.g. "<think>"), scored with it
    ids: list[list[int]]  # the prompt's tokens
    eval_rows: list[dict]
    longest: int  # tokens in the longest prompt the sampler will see (training or eval)


def load_prompts(cfg: GRPOConfig, tok, model_cfg) -> Prompts:
    """The --split and --eval_split problems in --template, checked to fit the model's positions and vocabulary."""
    max_pos = model_cfg.max_position_embeddings
    # a missing file, a malformed row (named by file and line), a bad split or knob
    with user_input("data"):
        rows, eval_rows = load_splits(cfg, cfg.split, cfg.eval_split)
    with user_input("--template"):  # e.g. chat on a tokenizer without a chat template
        text, response_start = zip(*(format_prompt(r["question"], cfg.template, tok, r.get("system"))
                                     for r in rows))
    ids = [encode_prompt(tok, t, cfg.template) for t in text]
    if max(len(p) for p in ids) + cfg.max_new_tokens > max_pos:
        raise SystemExit(f"error: longest prompt + --max_new_tokens={cfg.max_new_tokens} exceeds "
                         f"the model's max_position_embeddings={max_pos}: lower --max_new_tokens")
    evals = []
    if cfg.eval_every:
        with user_input("--template"):
            evals = [format_prompt(r["question"], cfg.template, tok, r.get("system"))[0] for r in eval_rows]
    eval_ids = [encode_prompt(tok, t, cfg.template) for t in evals]
    with user_input("--init"):  # a tokenizer of a larger vocabulary than the model's
        check_token_ids(ids + eval_ids, model_cfg.vocab_size, "the prompts")
    longest = max(map(len, ids + eval_ids))
    return Prompts(rows, text, response_start, ids, eval_rows, longest)


def build_models(cfg: GRPOConfig, d):
    """-> the policy (wrapped for DDP / FSDP2), the frozen KL reference (None with beta = 0; with LoRA
    the policy itself, its adapters switched off) and AdamW over the trained parameters."""
    weights_dtype = DTYPES[cfg.weights_dtype]  # fp32 by default: the master copy AdamW updates
    device = load_device(cfg.dist, d)  # FSDP2: the CPU, each model sharded onto the GPU as it is wrapped
    # no weights, a truncated safetensors file, weights that do not fit config.json
    with user_input("--init"):
        base_dtype = DTYPES[cfg.lora_base_dtype] if cfg.lora_rank else weights_dtype
        model = load_model(cfg.init, device=device, dtype=base_dtype, size_limits=cfg.size_limits)
    if cfg.lora_rank:  # freeze the base, add adapters (drawn from the seed: the same on every rank)
        with user_input("--lora_*"):
            add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets,
                     seed=cfg.seed, base=cfg.init)
    fast.use_onednn(model)  # fp32 projections through oneDNN where it is the faster kernel (an AMD AVX-512 CPU)
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    model = wrap_model(model, cfg.dist, d, cfg.dtype)
    ref = None
    # frozen copy of the starting policy; with beta = 0 it is never built
    if cfg.beta > 0 and not cfg.lora_rank:
        ref = load_model(cfg.init, device=device, dtype=weights_dtype,
                         size_limits=cfg.size_limits)
        ref = fast.use_onednn(ref).requires_grad_(False).eval()
        if cfg.dist == "fsdp":  # sharded like the policy; under DDP a frozen model needs no wrapper
            ref = wrap_model(ref, "fsdp", d, cfg.dtype)
        ref = frozen_in_compute_dtype(ref, cfg.dtype)  # under autocast: bf16 projections, cast once
    if cfg.beta > 0 and cfg.lora_rank:
        ref = model  # the reference for free: the same weights with the adapters switched off
    trained = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapters alone
    opt = torch.optim.AdamW(trained, lr=cfg.lr, betas=(0.9, cfg.beta2),
                            weight_decay=cfg.weight_decay)
    return model, ref, opt


# -----------------------------------------------------------------------------
# The step's glue: which prompts, which tokens count, what is logged


def step_prompts(step: int, order, cfg: GRPOConfig, d) -> tuple[int, list[int]]:
    """This rank's prompts at `step`: a contiguous slice of the step's global prompts. -> (the global
    number of the first, their problem indices)."""
    per_rank = cfg.prompts_per_step // d.world_size
    first = (step - 1) * cfg.prompts_per_step + d.rank * per_rank
    return first, [order(i) for i in range(first, first + per_rank)]


def advantages(r, roll: Rollout, cfg: GRPOConfig, world_size: int):
    """Group advantages adv (N, 1) and which tokens count: the policy term counts the kept completions
    (lmask (N, Tc)), the KL term, when beta > 0, every completion. Their per-token loss weights w, w_kl
    (None with beta = 0) use global counts as denominators. -> adv, lmask, w, w_kl, zero_std (P,)."""
    adv = group_advantages(r, cfg.scale_rewards).view(-1, 1)  # (N, 1)
    lmask, keep, zero_std = loss_mask(r, roll.mask, roll.truncated, cfg.filter_zero_std,
                                      cfg.mask_truncated)
    kl_mask = roll.mask.float()
    counts = torch.stack([keep.sum().float(), lmask.sum(), kl_mask.sum()]).tolist()
    c = all_reduce_named(dict(zip(("n_seqs", "n_tokens", "n_kl"), counts)))
    n_rows = cfg.prompts_per_step * cfg.group_size  # every completion of the step's batch, filtered or not
    max_len = cfg.max_new_tokens
    # DDP / FSDP average gradients over ranks: x W makes it the global sum
    w = token_weights(lmask, cfg.loss, c["n_seqs"], c["n_tokens"], n_rows, max_len) * world_size
    w_kl = None
    if cfg.beta > 0:
        w_kl = token_weights(kl_mask, cfg.loss, n_rows, c["n_kl"], n_rows, max_len) * world_size
    return adv, lmask, w, w_kl, zero_std


def training_rows(prompts: list[list[int]], roll: Rollout, group_size: int, pad_id: int):
    """training_batch's [prompt + completion] rows (row = prompt * G + sample) and each row's real
    length (host ints)."""
    row_prompts = [p for p in prompts for _ in range(group_size)]
    lengths = roll.lengths.tolist()
    batch = training_batch(row_prompts, roll.tokens, lengths, pad_id)
    seq_len = [len(p) - 1 + n for p, n in zip(row_prompts, lengths)]
    return batch, seq_len


def write_samples(samples_log, step: int, prompts: list[str], texts: list[str], scores: list[dict],
                  cfg: GRPOConfig) -> list[dict]:
    """The step's first --log_samples completions with their prompt and reward components (-> those rows)."""
    rows = []
    for i in range(min(cfg.log_samples, len(texts))):
        prompt = prompts[i // cfg.group_size]
        rows.append({"step": step, "prompt": prompt, "completion": texts[i], **scores[i]})
        samples_log.write(rows[-1])
    return rows


def grpo_step(step: int, cfg: GRPOConfig, d, model, ref, opt, tok, task: Prompts, weights, plugins, stop_ids,
              order, engine=None):
    """One GRPO step on this rank's share of the step's prompts: rollout -> score -> advantages -> update ->
    metrics (reduced over ranks); with --rollout vllm the updated weights are then pushed to the engine. -> metrics,
    the completions' texts and scores, their problems, and the seconds of the step's parts (metrics' t_generate,
    t_score, t_train: this step's update)."""
    t0 = time.perf_counter()
    reset_peak_mem(d.device)  # mem_peak_mb: this step's
    lr = set_lr(opt, step, cfg)
    eos_ids, pad_id = stop_ids
    first, mine = step_prompts(step, order, cfg, d)
    prompts = [task.ids[i] for i in mine]
    roll = rollout(model, prompts, first, step, cfg, eos_ids, pad_id, d.device, engine)
    t1 = time.perf_counter()
    starts, rows = [task.response_start[i] for i in mine], [task.rows[i] for i in mine]
    r, scores, texts = score(tok, roll, starts, rows, cfg, weights, plugins)  # r: (P_rank, G) on the device
    adv, lmask, w, w_kl, zero_std = advantages(r, roll, cfg, d.world_size)
    t2 = time.perf_counter()
    batch, seq_len = training_rows(prompts, roll, cfg.group_size, pad_id)
    stats = update(model, ref, opt, batch, seq_len, adv, lmask, w, w_kl, roll.logprobs, cfg, step)
    if engine is not None:  # the next rollout (and an eval now) samples from the updated policy
        engine.push(model)
    t3 = time.perf_counter()
    times = {"generate": t1 - t0, "score": t2 - t1, "update": t3 - t2, "step": t3 - t0}
    metrics = step_metrics(step, scores, r, zero_std, roll, stats, times, lr, d.device)
    return metrics, texts, scores, mine, times


# -----------------------------------------------------------------------------
# The loop: one GRPO step after another, each logged, evaluated and checkpointed on schedule


def train(cfg: GRPOConfig, d, model, ref, opt, tok, task: Prompts, weights, plugins, stop_ids, state: dict,
          record: dict, engine=None):
    """Steps state["step"] + 1 .. --steps (or until --max_minutes of training time)."""
    log = open_metrics_log(cfg, d, state)
    samples_log = JsonlLogger(os.path.join(cfg.out_dir, "samples.jsonl"), d.is_main)
    P, G, W = cfg.prompts_per_step, cfg.group_size, d.world_size
    print0(f"GRPO: {len(task.rows)} train prompts, {P} prompts x G={G} per step over {W} rank(s), "
           f"loss={cfg.loss}")
    order = permutation_stream(len(task.rows), cfg.seed * 1_000_003)  # global prompt order, epoch after epoch
    train_s, t_start = resumed_clocks(state)
    saved_at = time.perf_counter()  # when the newest checkpoint was written (--save_minutes)
    start = cfg.steps + 1 if stays_stopped(state, cfg.max_minutes) else state["step"] + 1
    bar = Progress(cfg.steps, "grpo step", initial=start - 1, enabled=d.is_main,
                   every_s=cfg.progress_every)
    out_of_time = False
    for step in range(start, cfg.steps + 1):
        metrics, texts, scores, mine, times = grpo_step(step, cfg, d, model, ref, opt, tok, task, weights,
                                                        plugins, stop_ids, order, engine)
        train_s += times["step"]
        metrics.update(train_s=train_s, wall_s=time.perf_counter() - t_start)
        samples = write_samples(samples_log, step, [task.text[i] for i in mine], texts, scores, cfg)
        if cfg.log_samples_every and step % cfg.log_samples_every == 0:  # a table where people look
            log.table("completions", samples, step)

        out_of_time = cfg.max_minutes > 0 and any_rank(train_s > cfg.max_minutes * 60)
        done = step == cfg.steps or out_of_time
        if cfg.eval_every and (step % cfg.eval_every == 0 or done):
            summary, records = evaluate(model, tok, task.eval_rows, template=cfg.template,
                                        max_new_tokens=cfg.max_new_tokens, device=d.device, seed=cfg.seed,
                                        tolerance=cfg.reward_tolerance, dtype=cfg.dtype, engine=engine)
            metrics["eval_pass1"] = summary["pass@1"]
        log.write(metrics)
        evaluated = f" | eval pass@1 {metrics['eval_pass1']:.3f}" if "eval_pass1" in metrics else ""
        bar.update(1, f"reward {metrics['reward']:.3f} | correct {metrics.get('correct', 0):.3f} | "
                   f"zero-std {metrics['frac_zero_std']:.2f} | len {metrics['len_mean']:.1f} | "
                   f"gen {times['generate']:.2f}s train {times['update']:.2f}s{evaluated}")
        if evaluated:
            print0(sample_line(records))
        due = checkpoint_due(cfg, step, saved_at)
        if done or due:
            saved_at = time.perf_counter()
            stopped = "time" if done and step < cfg.steps else False
            train_state = {"train_s": train_s, "wall_s": metrics["wall_s"], "stopped": stopped}
            save_checkpoint(cfg.out_dir, step, model, tok, train_state, d, optimizer=opt,
                            keep=cfg.keep, config=record)
        if done:
            break
    bar.close()
    if out_of_time and step < cfg.steps:  # (else the bar's last line reads 3%, eta 24h, and the run just ends)
        print0(f"step {step}: --max_minutes {cfg.max_minutes:g} of training time used: stopping (a larger "
               "--max_minutes continues the run)")
    log.close()
    samples_log.close()


def main(argv=None):
    cfg, d = start_stage(GRPOConfig, argv)
    seed_all(cfg.seed, d.rank)
    weights, plugins = check_config(cfg, d)
    # the tokenizer and model config: no weights are read before the memory estimate
    with user_input("--init"):  # a missing dir, a bad config.json, no tokenizer, ...
        model_cfg = load_config(cfg.init, cfg.size_limits)
        tok = load_tokenizer(cfg.init)
        stop_ids = stop_and_pad_ids(tok, model_cfg)  # no stop token: an error naming the dir
    if cfg.rollout == "vllm":  # vLLM installed, the model's shapes supported: said now, not after loading
        rollout_vllm.check(model_cfg, d.device, cfg.vllm_memory)
    task = load_prompts(cfg, tok, model_cfg)
    shapes = memory_shapes(cfg, "grpo", d.world_size, task.longest, d.device.type)
    print0(format_memory(memory_estimate(model_cfg, **shapes)))
    if cfg.rollout == "vllm":
        print0(f"  + the vLLM engine: --vllm_memory {cfg.vllm_memory} of the "
               + ("GPU's memory while it samples (asleep in the update)" if d.device.type == "cuda"
                  else "RAM for its KV cache, plus its own copy of the weights"))
    if cfg.dry_run:
        return cleanup_dist()
    # the checkpoint to continue from, or None; it must match checkpoint.RESUME_MUST_MATCH and the batch shape
    record = run_record(cfg, d)  # the flags + the --init weights' hash: what config.json and each checkpoint keep
    resume_from = resume_point(cfg, d, must_match=("prompts_per_step", "group_size"), record=record)
    model, ref, opt = build_models(cfg, d)
    engine = None
    if cfg.rollout == "vllm":  # this rank's engine, loaded from --init (rollout_vllm.py); a failure writes nothing
        with user_input("--rollout vllm"):
            engine = rollout_vllm.VLLMEngine(cfg.init, d, memory=cfg.vllm_memory, dtype=cfg.dtype,
                                             max_len=task.longest + cfg.max_new_tokens, seed=cfg.seed)
    # load the checkpoint (or start fresh); cut metrics/samples.jsonl back to its step; config.json
    state = start_or_resume(resume_from, cfg, model, opt, d, record=record)
    if engine is not None:  # the resumed (or LoRA / bf16-stored) policy, not --init's weights
        engine.push(model)
    train(cfg, d, model, ref, opt, tok, task, weights, plugins, stop_ids, state, record, engine)
    if cfg.lora_rank:  # the checkpoints hold the adapter alone: write the merged model, the adapter
        export_lora(model, tok, cfg.out_dir, d)
    else:  # OUT/model: the last checkpoint's model files (README's runs/grpo/model)
        publish_model(find_latest(cfg.out_dir), os.path.join(cfg.out_dir, "model"), d)
    print0(f"done: model in {os.path.join(cfg.out_dir, 'model')}")
    release_run_dir(cfg.out_dir)
    if engine is not None:
        engine.close()
    cleanup_dist()


# -----------------------------------------------------------------------------
# small helpers


def _pad(x: torch.Tensor, T: int, value) -> torch.Tensor:
    return torch.nn.functional.pad(x, (0, T - x.shape[1]), value=value)


if __name__ == "__main__":
    main()
    free_main_objects()
