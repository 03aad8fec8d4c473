"""
SFT warm start: teach a model the R1 format from worked solutions, with the loss on completion
tokens only.

Launch:
  python sft.py                                   # the char-level demo: fresh tiny model, first 5% of arith train
  torchrun --nproc_per_node=2 sft.py              # the same, data parallel (--dist ddp, or --dist fsdp for FSDP2)
  torchrun --nproc_per_node=8 sft.py --init path/to/Qwen2.5-0.5B --task gsm8k --data_path gsm8k/train.jsonl \
      --template r1 --split train[:10%] --eval_split test[:200] --max_new_tokens 512 ...

One example is [prompt tokens] + [target tokens] + [EOS], where the prompt is
data.format_prompt(question) (it opens the response, e.g. with "<think>") and the target is
data.sft_target(row) ("reasoning</think> <answer>N</answer>"). Labels are -100 on the prompt and on
padding, so only the completion is learned; batches are right-padded.

Batching: B = --global_batch sequences per step over all ranks. Step s trains on items [s*B, (s+1)*B) of
a seeded stream of epoch permutations, rank r on its contiguous share, which it splits into
micro-batches of similar lengths (at most --micro_batch rows and --micro_batch_tokens padded tokens;
packing.micro_batches) for gradient accumulation. The loss is (sum of token losses) / (target tokens
in the whole global batch), so 1 process and N processes, and any micro-batch split, compute the
same step (tests/test_sft.py checks it for DDP and FSDP2).

Stopping: --steps is an upper bound (and the end of the cosine schedule, if --min_lr_ratio < 1);
--max_minutes m stops after m minutes of training (evals excluded; the same measure as grpo.py's, so
"continue SFT for as long as GRPO ran" is one flag, and a timed-out run given more minutes goes on
when resumed). With --stop_pass1 p the run stops once --stop_patience consecutive held-out
evaluations (every --eval_every steps: greedy pass@1 on --eval_split, test problems that are never
trained on, and disjoint from eval.py's default test[:400]) all reach p; one lucky eval is not
enough. Then, with --stop_plateau N, it trains on until pass@1 stops climbing at --stop_floor or
above: the mean of the last N evals at least --stop_floor and at most --stop_delta above the mean of
the N before. (The bar is passed on the way up SFT's jump from memorising to the arithmetic; a start
taken there, or at a false plateau low on the climb, is one where more SFT still gains a lot, so
GRPO's lead over more SFT would say little: docs/demo.md.) A run that never gets to the bar, or to
the floor, says so in one line at the end (demo.sh stops before GRPO, which cannot learn from a
start whose samples are almost all wrong, if eval.py rates it under MIN_START).

The demo's defaults (the `demo` preset of model.py, the 5% slice, this recipe) are calibrated
together. A small model can memorise its worked solutions instead of learning the arithmetic; weight
decay 1.0 at a constant learning rate makes it learn the arithmetic (strong decay penalises the
large weights a lookup table needs) and keeps the trajectory independent of --steps, so a run
resumed with more --steps continues the same one. docs/demo.md has the measurements;
tests/test_demo.py guards them.

Output (--out_dir): config.json (resolved config), metrics.jsonl, step_XXXXXX/ (checkpoint: HF model
dir + train state), latest, tb/ and wandb_run_id (with --tensorboard / --wandb), and model/ (the
final HF model dir: config.json, model.safetensors, tokenizer files; loadable by
transformers.AutoModelForCausalLM, eval.py and grpo.py).

Resume: a killed run continues where it stopped when started again with the same command (--resume
auto, the default, takes the newest complete checkpoint in --out_dir; --resume PATH a given one;
--overwrite starts over). Step s's data, LR and RNG draws are functions of s, and a checkpoint holds
weights, full optimizer state and every rank's RNG states, so the continued run is bitwise the
uninterrupted one (tests/test_resume.py); metrics.jsonl is cut back to the checkpoint's step first.
Under `torchrun --max-restarts=K` a dead worker restarts the group, which resumes (launch it with
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with a shared store a restart can hang, torch#135712).

LoRA (--lora_rank r): the base is frozen and only the adapters train; checkpoints hold the adapter
and its optimizer state, and the end writes OUT/model (merged) and OUT/adapter (PEFT format); see
the README.

Simplifications: no sequence packing (each micro-batch pads to its longest row; length grouping
keeps that small); the loss is a plain token mean over the global batch (long solutions weigh more).
"""

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

import fast
import model as model_lib
from checkpoint import (
    check_finite,
    check_out_dir,
    export_lora,
    publish_model,
    release_run_dir,
    resolve_model_dir,
    resume_point,
    run_record,
    save_checkpoint,
    start_or_resume,
)
from common import (
    DTYPES,
    Progress,
    all_reduce_named,
    any_rank,
    autocast,
    check_flags,
    check_precision,
    checkpoint_due,
    cleanup_dist,
    clip_grad_norm,
    flag,
    free_main_objects,
    grad_sync,
    load_device,
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
from data import encode_prompt, format_prompt, load_splits, parse_knobs, sft_target
from eval import evaluate, sample_line
from hf import char_tokenizer, check_token_ids, load_config, load_model, load_tokenizer, stop_and_pad_ids
from lora import LORA_TARGETS, add_lora, check_lora
from memory import format_memory, memory_estimate, memory_shapes
from packing import micro_batches


@dataclass
class SFTConfig:
    """Supervised fine-tuning on worked solutions (loss on completion tokens only)."""
    init: str | None = flag(None, "HF model dir to start from (none: fresh --model preset)", section="model")
    model: str = flag("demo", "preset for a fresh model with the char tokenizer (model.PRESETS)", section="model")
    model_overrides: str = flag("", "changes to the preset, e.g. 'num_hidden_layers=3'", section="model")
    size_limits: bool = flag(True, "refuse model configs past sanity sizes (model.py SIZE_LIMITS, "
                             "MAX_PARAMS); false lifts them", section="model")

    task: str = flag("arith", "arith | gsm8k | math | custom (--data_path, --question_field, ...)", section="data")
    split: str = flag("train[:5%]", "training problems (with worked solutions)", section="data")
    data_path: str | None = flag(None, "a .jsonl/.json/.parquet/.csv file, a dir of {split}.jsonl|..., or a "
                                 "hub dataset name (gsm8k/math: none = the hub)", section="data")
    data_seed: int = flag(0, "seed of the built-in task's problems", section="data")
    task_knobs: str = flag("", "built-in task knobs, e.g. 'steps=2,high=99' (data.py)", section="data")
    template: str = flag("short", "prompt template: short | r1 | chat", section="data")
    question_field: str = flag("question", "--task custom: the question's column", section="data")
    answer_field: str = flag("answer", "--task custom: the gold answer's column", section="data")
    answer_regex: str = flag("", "--task custom: the gold is this regex's first group in the answer "
                             "column, e.g. '####\\s*(.+)' ('' = the whole column)", section="data")
    solution_field: str | None = flag(None, "--task custom: the worked solution's column (the answer "
                                      "column with --answer_regex: its text before the match)", section="data")
    system_prompt: str = flag("", "replaces the template's system prompt (r1: its preamble, chat: the "
                              "system message; '' = the template's own)", section="data")

    lora_rank: int = flag(0, "LoRA rank r: train low-rank adapters on a frozen base (0 = off, full "
                          "fine-tuning)", section="LoRA (off by default: every weight trains)")
    lora_alpha: float = flag(32.0, "LoRA alpha: the update is scaled by alpha / r",
                             section="LoRA (off by default: every weight trains)")
    lora_dropout: float = flag(0.0, "dropout on the adapters' input (training only)",
                               section="LoRA (off by default: every weight trains)")
    lora_targets: tuple[str, ...] = flag(LORA_TARGETS,
                                         "projections that get adapters (comma list)",
                                         section="LoRA (off by default: every weight trains)")
    lora_base_dtype: str = flag("float32", "dtype of the frozen base weights",
                                choices=["float32", "bfloat16"], section="LoRA (off by default: every weight trains)")

    global_batch: int = flag(32, "sequences per optimizer step, over all ranks", section="optimisation")
    micro_batch: int = flag(16, "sequences per forward/backward, at most (0 = no limit)", section="optimisation")
    steps: int = flag(8000, "optimizer steps (an upper bound with --stop_pass1)", section="optimisation")
    max_minutes: float = flag(0.0, "stop after this much training wall time, eval excluded (0 = "
                              "off)", section="optimisation")
    lr: float = flag(3e-3, "peak learning rate", section="optimisation")
    warmup: int = flag(50, "linear warmup steps", section="optimisation")
    min_lr_ratio: float = flag(1.0, "cosine floor at --steps, as a fraction of --lr (1.0 = "
                               "constant after warmup)", section="optimisation")
    weight_decay: float = flag(1.0, "AdamW weight decay (matrices only)", section="optimisation")
    beta1: float = flag(0.9, "AdamW beta1", section="optimisation")
    beta2: float = flag(0.98, "AdamW beta2", section="optimisation")
    grad_clip: float = flag(1.0, "clip the global grad norm to this (0 = off)", section="optimisation")
    seed: int = flag(0, "seed of the init and the data order", section="optimisation")

    micro_batch_tokens: int = flag(0, "padded tokens per forward/backward, at most (rows x longest "
                                   "row; rows grouped by length; 0 = off)", section="memory")
    activation_checkpointing: bool = flag(False, "recompute each transformer block in backward: "
                                          "activations of one block, not all (+1 forward)", section="memory")
    dry_run: bool = flag(False, "print the memory estimate per rank and exit", section="memory")

    eval_every: int = flag(50, "evaluate held-out greedy pass@1 every N steps (0 = off)",
                           section="held-out evaluation and stopping")
    eval_split: str = flag("test[-200:]", "held-out problems for the in-loop eval",
                           section="held-out evaluation and stopping")
    max_new_tokens: int = flag(64, "completion length limit in the in-loop eval",
                               section="held-out evaluation and stopping")
    stop_pass1: float = flag(0.15, "stop once held-out pass@1 >= this (0 = run --steps)",
                             section="held-out evaluation and stopping")
    stop_patience: int = flag(2, "... in this many consecutive evals (filters lucky ones)",
                              section="held-out evaluation and stopping")
    stop_plateau: int = flag(4, "... and then train on until held-out pass@1 stops climbing: the mean of "
                             "the last N evals at most --stop_delta above the N before (0 = stop at the bar)",
                             section="held-out evaluation and stopping")
    stop_delta: float = flag(0.02, "the rise in pass@1 per --stop_plateau evals that still counts as climbing",
                             section="held-out evaluation and stopping")
    stop_floor: float = flag(0.3, "... and the plateau counts only where the mean of its last --stop_plateau "
                             "evals is at least this (0 = any level)", section="held-out evaluation and stopping")

    dist: str = flag("ddp", "under torchrun: ddp | fsdp", choices=["ddp", "fsdp"], section="infrastructure")
    dist_timeout: float = flag(600.0, "seconds before a stuck collective fails", section="infrastructure")
    dtype: str = flag("float32", "compute dtype; bfloat16: bf16 matmuls over fp32 weights and "
                      "AdamW state (autocast, or FSDP2 mixed precision)",
                      choices=["float32", "bfloat16"], section="infrastructure")
    weights_dtype: str = flag("float32", "storage dtype of weights and AdamW state; bfloat16 "
                              "halves it but loses small updates (needs --dtype bfloat16)",
                              choices=["float32", "bfloat16"], section="infrastructure")
    progress_every: float = flag(30.0, "seconds between progress lines when the output is a file "
                                 "or pipe (a terminal gets a bar)", section="infrastructure")
    out_dir: str = flag("runs/sft", "run directory; the final model goes to OUT/model", section="infrastructure")
    save_every: int = flag(0, "checkpoint every N steps (0 = only at the end)", section="infrastructure")
    save_minutes: float = flag(30.0, "also checkpoint once this much wall time has passed since the "
                               "last checkpoint (0 = off): a crash loses at most that much", section="infrastructure")
    keep: int = flag(2, "checkpoints to keep", section="infrastructure")
    resume: str = flag("auto", "auto: continue from the newest checkpoint in --out_dir (if any) | "
                       "none: start fresh | PATH: that checkpoint", section="infrastructure")
    overwrite: bool = flag(False, "start over, deleting the run already in --out_dir", section="infrastructure")

    wandb: str = flag("", "also log metrics to this Weights & Biases project (pip install wandb; "
                      "WANDB_MODE=offline works)", section="optional loggers (metrics.jsonl is always written)")
    tensorboard: bool = flag(False, "also write TensorBoard events to OUT/tb (pip install "
                             "tensorboard)", section="optional loggers (metrics.jsonl is always written)")


# -----------------------------------------------------------------------------
# examples and the masked loss


def build_example(prompt_ids: list[int], target_ids: list[int], eos_id: int) -> tuple[list[int], list[int]]:
    """[prompt + target + EOS] and its labels: -100 on the prompt (no loss there), the token itself
    elsewhere."""
    ids = prompt_ids + target_ids + [eos_id]
    return ids, [-100] * len(prompt_ids) + target_ids + [eos_id]


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int, device="cpu"):
    """Right-pad to the longest example and shift: inputs (B, L-1), targets (B, L-1) with -100 on
    prompt/padding, built on the host and moved to `device` once."""
    L = max(len(ids) for ids, _ in examples)
    ids = [x + [pad_id] * (L - len(x)) for x, _ in examples]
    labels = [y + [-100] * (L - len(y)) for _, y in examples]
    ids, labels = torch.tensor(ids, device=device), torch.tensor(labels, device=device)
    return ids[:, :-1], labels[:, 1:]  # position t predicts token t + 1


def sft_loss(model, inputs: torch.Tensor, targets: torch.Tensor, dtype: str = "float32") -> torch.Tensor:
    """Sum of -log p(target) over the positions whose label is not -100 (normalise by the caller's
    token count), computed in `dtype` (common.autocast; the log-softmax itself in fp32)."""
    mask = targets != -100  # (B, T)
    with autocast(model, dtype):
        logp, _ = model(inputs, targets=targets.clamp(min=0))  # (B, T) log-probs of the targets, chunked over T
    return -(logp * mask).sum()


def bar_reached(history: list[float], target: float, patience: int) -> bool:
    """Whether `patience` consecutive held-out evals have all reached `target` at some eval so far (one lucky eval
    is not enough; a later dip does not undo it; target 0 = off)."""
    windows = (history[i - patience : i] for i in range(patience, len(history) + 1))
    return target > 0 and patience > 0 and any(min(w) >= target for w in windows)


def should_stop(history: list[float], target: float, patience: int, window: int, delta: float,
                floor: float = 0.0) -> bool:
    """--stop_pass1: the bar reached (bar_reached), and then, with window > 0, held-out
    pass@1 no longer climbing, at `floor` or above: the mean of the last `window` evals is at least `floor` and
    at most `delta` above the mean of the `window` evals before them. (SFT's jump from memorising to the
    arithmetic passes the bar on its way up, and evals of 200 problems scatter by +-0.05, so a low start can
    look flat while more SFT still lifts it a lot: docs/demo.md.)"""
    if not bar_reached(history, target, patience):
        return False
    if window == 0:
        return True
    if len(history) < 2 * window:
        return False
    last, before = sum(history[-window:]) / window, sum(history[-2 * window : -window]) / window
    return floor <= last <= before + delta


def end_warning(history: list[float], step: int, cfg: SFTConfig) -> str | None:
    """The one line a run that ended without its stop rule prints: the bar never reached (a start that leaves
    GRPO almost no signal: all G samples wrong), or the --steps budget spent under --stop_floor."""
    if cfg.stop_pass1 <= 0 or not history:
        return None
    if not bar_reached(history, cfg.stop_pass1, cfg.stop_patience):
        return (f"warning: held-out pass@1 never reached --stop_pass1 {cfg.stop_pass1} in {cfg.stop_patience} "
                f"consecutive evals by step {step} (best {max(history):.3f}, last {history[-1]:.3f}); GRPO from "
                "this start learns little: run again with more --steps (it resumes) or another --seed")
    w = cfg.stop_plateau
    if not w or step < cfg.steps or len(history) < w:
        return None
    mean = sum(history[-w:]) / w
    if mean >= cfg.stop_floor:
        return None
    return (f"warning: held-out pass@1 passed --stop_pass1 {cfg.stop_pass1}, but the mean of its last {w} evals is "
            f"{mean:.3f} < --stop_floor {cfg.stop_floor} at step {step}, the --steps budget: from such a start "
            "more SFT has beaten GRPO (and lost to it: docs/demo.md); run again with more --steps (it resumes)")


# -----------------------------------------------------------------------------
# Setup, in the order main runs it: the flags, the tokenizer, the examples, the model


def check_config(cfg: SFTConfig, d):
    """Refuse bad flags before anything is read."""
    check_flags(cfg,
                at_least_1=("global_batch", "steps", "max_new_tokens", "stop_patience"),
                at_least_0=("micro_batch", "micro_batch_tokens", "warmup", "eval_every", "save_every", "save_minutes",
                            "stop_plateau", "stop_delta", "stop_floor", "keep", "max_minutes", "grad_clip",
                            "weight_decay", "progress_every"),
                positive=("lr", "dist_timeout"))
    check_out_dir(cfg.out_dir, "sft", cfg.init)  # before anything is read: never its own --init
    if cfg.global_batch % d.world_size:
        raise SystemExit(f"error: --global_batch {cfg.global_batch} is not divisible by the world "
                         f"size {d.world_size}")
    check_precision(cfg.dtype, cfg.weights_dtype)
    if cfg.lora_rank:  # before the memory estimate, which sizes the adapters
        with user_input("--lora_*"):
            check_lora(cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets)


def tokenizer_and_config(cfg: SFTConfig):
    """An HF dir's tokenizer and model config (--init), or a fresh --model preset's with the char tokenizer.
    -> (the model dir or None, model config, tokenizer)."""
    if cfg.init is None:
        tok = char_tokenizer()
        with user_input("--model_overrides"):  # a typo, a string where a size goes, a config bomb
            special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                           pad_token_id=tok.pad_token_id)
            overrides = parse_knobs(cfg.model_overrides)
            model_cfg = model_lib.preset_config(cfg.model, **{"vocab_size": len(tok), **special, **overrides})
            if cfg.size_limits:
                model_lib.check_size(model_cfg)
        return None, model_cfg, tok
    with user_input("--init"):  # a run dir whose `latest` is broken
        path = resolve_model_dir(cfg.init)
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise SystemExit(f"error: --init {cfg.init}: not a model directory (needs config.json "
                         "and *.safetensors)")
    with user_input("--init"):  # a bad config.json, no tokenizer, ...
        model_cfg = load_config(path, cfg.size_limits)
        tok = load_tokenizer(path)
    return path, model_cfg, tok


def build_examples(rows: list[dict], tok, template: str, eos_id: int) -> list[tuple[list[int], list[int]]]:
    """Every row as (ids, labels), tokenized once: its prompt, its worked solution, EOS."""
    examples = []
    for r in rows:
        with user_input("--template"):  # e.g. chat on a tokenizer without a chat template, or a failing one
            prompt, response_start = format_prompt(r["question"], template, tok, r.get("system"))  # "<think>"
        with user_input("data"):  # a row without a worked solution
            target = tok.encode(sft_target(r, response_start), add_special_tokens=False)
        examples.append(build_example(encode_prompt(tok, prompt, template), target, eos_id))
    return examples


def check_lengths(cfg: SFTConfig, examples, eval_rows, tok, model_cfg) -> tuple[int, int]:
    """Refuse examples, or eval prompts + --max_new_tokens, past the model's positions, or holding ids past its
    vocabulary. -> the longest example's and the longest eval prompt's tokens."""
    max_len = model_cfg.max_position_embeddings
    with user_input("--template"):
        eval_prompts = [format_prompt(r["question"], cfg.template, tok, r.get("system"))[0] for r in eval_rows]
    eval_ids = [encode_prompt(tok, p, cfg.template) for p in eval_prompts]
    with user_input("--init" if cfg.init else "--model_overrides"):  # ids past the model's vocabulary
        check_token_ids([ids for ids, _ in examples] + eval_ids, model_cfg.vocab_size, "the examples")
    longest = max(len(ids) for ids, _ in examples)
    if longest > max_len:
        raise SystemExit(f"error: the longest example has {longest} tokens > the model's "
                         f"max_position_embeddings {max_len}")
    longest_eval = max(map(len, eval_ids))
    if cfg.eval_every and longest_eval + cfg.max_new_tokens > max_len:
        raise SystemExit(f"error: longest --eval_split prompt ({longest_eval} tokens) + "
                         f"--max_new_tokens={cfg.max_new_tokens} exceeds the model's "
                         f"max_position_embeddings={max_len}: lower --max_new_tokens")
    return longest, longest_eval


def build_model(cfg: SFTConfig, d, path, model_cfg):
    """The HF dir's weights, or the preset initialised from --seed (+ LoRA adapters), wrapped for DDP /
    FSDP2, and AdamW. -> (model, optimizer, parameter count, trained parameter count)."""
    torch.manual_seed(cfg.seed)  # identical init on every rank (FSDP2 does not broadcast rank 0's)
    device = load_device(cfg.dist, d)  # FSDP2: the CPU, sharded onto the GPU as it is wrapped
    if path is not None:
        # a truncated safetensors file, a config that does not fit the weights, ...
        with user_input("--init"):
            dtype = DTYPES[cfg.lora_base_dtype] if cfg.lora_rank else DTYPES[cfg.weights_dtype]
            model = load_model(path, device=device, dtype=dtype,
                               size_limits=cfg.size_limits)
    else:
        model = model_lib.Transformer(model_cfg).to(device, DTYPES[cfg.weights_dtype])
    if cfg.lora_rank:  # freeze the base, add adapters (drawn from the seed: the same on every rank)
        with user_input("--lora_*"):
            add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_dropout,
                     cfg.lora_targets, seed=cfg.seed,
                     base_dtype=DTYPES[cfg.lora_base_dtype], base=cfg.init)
    fast.use_onednn(model)  # fp32 projections through oneDNN where it is the faster kernel (an AMD AVX-512 CPU)
    seed_all(cfg.seed, d.rank)
    n_params = sum(p.numel() for p in model.parameters())
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    model = wrap_model(model, cfg.dist, d, cfg.dtype)
    # weight decay on matrices only (embeddings, projections), not on norm gains or biases
    # (nanoGPT's split)
    trained = [p for p in model.parameters() if p.requires_grad]  # with LoRA: the adapters alone
    matrices = [p for p in trained if p.dim() >= 2]
    vectors = [p for p in trained if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": cfg.weight_decay},
              {"params": vectors, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    return model, opt, n_params, n_train


# -----------------------------------------------------------------------------
# One step, the held-out eval and its stop rule


def sft_step(model, opt, examples, mine: list[int], n_tok: int, cfg: SFTConfig, d, pad_id: int,
             step: int) -> tuple[float, int, torch.Tensor]:
    """One optimizer step on this rank's examples `mine` (n_tok: loss tokens in the global batch):
    gradient accumulation over length-grouped micro-batches, grad clip, AdamW. -> (this rank's summed
    token loss, its input tokens, the grad norm)."""
    W = d.world_size
    model.train()
    losses, n_in = [], 0  # per micro-batch summed token losses (device), input tokens (host)
    # length-grouped micro-batches, as many on every rank; an empty one runs a loss-free row
    # (FSDP2 gathers)
    row_lens = [len(examples[i][0]) - 1 for i in mine]
    groups = micro_batches(row_lens, cfg.micro_batch, cfg.micro_batch_tokens)
    for k, group in enumerate(groups):
        micro = [examples[mine[j]] for j in group]
        loss_free = [([pad_id, pad_id], [-100, -100])]  # for an empty micro-batch
        inputs, targets = collate(micro or loss_free, pad_id, d.device)  # (b, T) each
        with grad_sync(model, k == len(groups) - 1):
            loss = sft_loss(model, inputs, targets, cfg.dtype)
            # DDP / FSDP average gradients over ranks: x W makes it a global sum
            (loss * W / n_tok).backward()
        losses.append(loss.detach())
        n_in += sum(len(ids) - 1 for ids, _ in micro)
    grad_norm = clip_grad_norm(model, cfg.grad_clip)
    check_finite(step, grad_norm, Path(cfg.out_dir))  # NaN/inf: stop before the update, save nothing of it
    opt.step()
    opt.zero_grad(set_to_none=True)
    loss_sum = sum(torch.stack(losses).tolist())  # one device -> host copy
    return loss_sum, n_in, grad_norm


def held_out_eval(model, tok, eval_rows, cfg: SFTConfig, d, step: int, history: list[float], metrics: dict):
    """Greedy pass@1 on --eval_split (every rank takes part), into `metrics`; at the --eval_every grid's
    steps also into `history`. -> whether the stop rule (should_stop) now says stop."""
    summary, records = evaluate(model, tok, eval_rows, template=cfg.template,
                                max_new_tokens=cfg.max_new_tokens, device=d.device, seed=cfg.seed,
                                dtype=cfg.dtype)
    print0(sample_line(records))
    metrics.update(eval_pass1=summary["pass@1"], eval_format=summary["format"],
                   eval_len=summary["len_mean"])
    if step % cfg.eval_every:  # the stop rules see the grid's evals only: an extra one at
        return False  # a --max_minutes stop would shift the plateau window of the run it resumes into
    history.append(summary["pass@1"])
    return should_stop(history, cfg.stop_pass1, cfg.stop_patience, cfg.stop_plateau,
                       cfg.stop_delta, cfg.stop_floor)


def stop_line(step: int, stop: bool, out_of_time: bool, history: list[float], cfg: SFTConfig) -> str | None:
    """The line that says why the run stops at `step` (None: it goes on)."""
    w = cfg.stop_plateau
    if stop and not w:
        return (f"\nstep {step}: held-out pass@1 {history[-cfg.stop_patience:]} >= --stop_pass1 "
                f"{cfg.stop_pass1} in {cfg.stop_patience} consecutive evals: stopping")
    if stop:
        return (f"\nstep {step}: held-out pass@1 reached --stop_pass1 {cfg.stop_pass1} and stopped climbing "
                f"(mean of the last {w} evals {sum(history[-w:]) / w:.3f}, of the {w} before "
                f"{sum(history[-2 * w : -w]) / w:.3f}; --stop_plateau {w}, --stop_delta {cfg.stop_delta}, "
                f"--stop_floor {cfg.stop_floor}): stopping")
    if out_of_time:
        return f"\nstep {step}: --max_minutes {cfg.max_minutes} of training time used: stopping"
    return None


# -----------------------------------------------------------------------------
# The loop, and main


def train(cfg: SFTConfig, d, model, opt, tok, examples, eval_rows, pad_id: int, state: dict, ckpt, record: dict):
    """Steps state["step"] + 1 .. --steps, or until a stop rule or --max_minutes. -> (the last step,
    the newest checkpoint, the eval history, the wall-clock start)."""
    out = Path(cfg.out_dir)
    log = open_metrics_log(cfg, d, state)
    per_rank = cfg.global_batch // d.world_size
    n_targets = [sum(y != -100 for y in labels) for _, labels in examples]  # loss tokens per example
    order = permutation_stream(len(examples), cfg.seed)  # the data order is the same whatever the world size
    pass1, step = None, state["step"]
    history = list(state.get("eval_history", []))  # held-out pass@1 of every eval (--stop_patience)
    train_s, t_start = resumed_clocks(state)
    saved_at = time.perf_counter()  # when the newest checkpoint was written (--save_minutes)
    start = cfg.steps + 1 if stays_stopped(state, cfg.max_minutes) else step + 1
    bar = Progress(cfg.steps, "sft step", initial=step, enabled=d.is_main,
                   every_s=cfg.progress_every)
    for step in range(start, cfg.steps + 1):
        t0 = time.perf_counter()
        reset_peak_mem(d.device)  # mem_peak_mb: this step's
        lr = set_lr(opt, step, cfg)
        batch = [order(i) for i in range((step - 1) * cfg.global_batch, step * cfg.global_batch)]
        n_tok = sum(n_targets[i] for i in batch)  # loss tokens in the global batch (no communication)
        mine = batch[d.rank * per_rank : (d.rank + 1) * per_rank]
        loss_sum, n_in, grad_norm = sft_step(model, opt, examples, mine, n_tok, cfg, d, pad_id, step)
        local = {"loss": loss_sum, "n_in": n_in, "mem_peak_mb": peak_mem_mb(d.device)}
        g = all_reduce_named(local, {"mem_peak_mb": "max"})
        step_s = time.perf_counter() - t0
        train_s += step_s
        metrics = {"step": step, "loss": g["loss"] / n_tok, "lr": lr, "grad_norm": grad_norm.item(),
                   "tokens_per_s": g["n_in"] / step_s, "mem_peak_mb": g["mem_peak_mb"],
                   "train_s": train_s, "wall_s": time.perf_counter() - t_start}
        out_of_time = cfg.max_minutes > 0 and any_rank(train_s > cfg.max_minutes * 60)
        stop = False
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps or out_of_time):
            stop = held_out_eval(model, tok, eval_rows, cfg, d, step, history, metrics)
            pass1 = metrics["eval_pass1"]
        log.write(metrics)
        shown = "-" if pass1 is None else f"{pass1:.3f}"
        bar.update(1, f"loss {metrics['loss']:.3f} | lr {lr:.1e} | pass1 {shown}")
        stopped = "--stop_pass1" if stop else "time" if out_of_time else False  # kept for resume
        line = stop_line(step, stop, out_of_time, history, cfg)
        if line:
            print0(line)
        due = checkpoint_due(cfg, step, saved_at)
        if stopped or step == cfg.steps or due:
            saved_at = time.perf_counter()
            train_state = {"data_position": step * cfg.global_batch, "wall_s": metrics["wall_s"],
                           "stopped": stopped, "eval_history": history, "train_s": train_s}
            ckpt = save_checkpoint(out, step, model, tok, train_state, d, optimizer=opt,
                                   keep=cfg.keep, config=record)
        if stopped:
            break
    bar.close()
    log.close()
    return step, ckpt, history, t_start


def main(argv=None):
    cfg, d = start_stage(SFTConfig, argv)
    check_config(cfg, d)
    # data first: a typo in --task should fail before any model is built.
    # A missing file, a malformed row (named by file and line), a bad split or knob
    with user_input("data"):
        rows, eval_rows = load_splits(cfg, cfg.split, cfg.eval_split)
    path, model_cfg, tok = tokenizer_and_config(cfg)
    with user_input("--init" if cfg.init else "--model_overrides"):  # no stop token, or one past the vocabulary
        eos_ids, pad_id = stop_and_pad_ids(tok, model_cfg)
    # what every target ends with: the tokenizer's EOS (a chat model's end of turn)
    examples = build_examples(rows, tok, cfg.template, eos_ids[0])
    longest, longest_eval = check_lengths(cfg, examples, eval_rows, tok, model_cfg)
    # the memory this run needs; a training row is the longest example shifted by one
    shapes = memory_shapes(cfg, "sft", d.world_size, longest_eval, d.device.type, seq=longest - 1)
    print0(format_memory(memory_estimate(model_cfg, **shapes)))
    if cfg.dry_run:
        return cleanup_dist()
    # the checkpoint to continue from, or None; it must match checkpoint.RESUME_MUST_MATCH, the fresh model's
    # preset and the batch (--micro_batch may change)
    record = run_record(cfg, d)  # the flags + the --init weights' hash: what config.json and each checkpoint keep
    resume_from = resume_point(cfg, d, must_match=("model", "model_overrides", "global_batch"), record=record)
    model, opt, n_params, n_train = build_model(cfg, d, path, model_cfg)
    # load the checkpoint (or start fresh); cut metrics.jsonl back to its step; write config.json
    state = start_or_resume(resume_from, cfg, model, opt, d, record=record)
    limits = [f"<= {cfg.micro_batch} rows"] * (cfg.micro_batch > 0)
    limits += [f"<= {cfg.micro_batch_tokens} tokens"] * (cfg.micro_batch_tokens > 0)
    print0(f"SFT: {n_params / 1e6:.2f}M params ({n_train / 1e6:.3f}M trained), {len(examples)} "
           f"examples ({cfg.task} {cfg.split}), global batch {cfg.global_batch} over {d.world_size} rank(s) "
           f"in micro-batches of {' and '.join(limits) or 'no limit'}, "
           f"dist={cfg.dist if d.world_size > 1 else 'none'}")
    print0(f"config: {asdict(cfg)}")
    step, ckpt, history, t_start = train(cfg, d, model, opt, tok, examples, eval_rows, pad_id, state,
                                         resume_from, record)
    out = Path(cfg.out_dir)
    if cfg.lora_rank:  # the checkpoints hold the adapter alone: write the merged model, the adapter
        export_lora(model, tok, out, d)
    else:
        publish_model(ckpt, out / "model", d)
    warning = end_warning(history, step, cfg)
    if warning:  # say it, rather than silently hand GRPO a start it learns little from
        print0(warning)
    # FSDP2: this rank's own shard
    shards = [getattr(t, "_local_tensor", t) for st in opt.state.values() for t in st.values()]
    opt_bytes = sum(t.numel() * t.element_size() for t in shards)
    print0(f"done: {step} steps in {time.perf_counter() - t_start:.0f}s; optimizer state "
           f"{opt_bytes / 2**20:.1f} MiB (rank 0); model in {out / 'model'}")
    release_run_dir(out)
    cleanup_dist()


if __name__ == "__main__":
    main()
    free_main_objects()
