"""Memory estimate: what one rank holds at its peak, from the shapes alone (printed at the start of sft/grpo runs).

    print(format_memory(memory_estimate(model_cfg, **memory_shapes(cfg, "grpo", world, prompt_len, "cuda"))))
"""

from common import DTYPES
from lora import LORA_TARGETS
from model import HEAD_COPY_BYTES, ModelConfig, logits_chunk_tokens

RUNTIME_CPU_BYTES = 0.5e9  # memory_estimate: the interpreter, torch, a tokenizer and the data, on CPU
EVAL_BATCH = 32  # prompts per sampler call in an eval: eval.py's --batch_size default, sft/grpo's in-loop evals


def param_count(cfg: ModelConfig) -> int:
    C, HD, KD = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn = C * HD + 2 * C * KD + HD * C + (HD + 2 * KD) * cfg.attention_bias
    attn += 2 * cfg.head_dim * (cfg.model_type == "qwen3")  # q_norm, k_norm
    block = attn + 3 * C * cfg.intermediate_size + 2 * C  # + SwiGLU + two norms
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * C
    return cfg.vocab_size * C + cfg.num_hidden_layers * block + C + head


def block_activation_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int, expanded_kv: bool = False) -> int:
    """What autograd keeps for backward in one Block over `tokens` (row, position) pairs: per token the block
    input, both norms' inputs and outputs (the norm statistics in fp32), q/k/v, attention's output twice (as SDPA
    returns it and reshaped for o_proj) and its logsumexp, and SwiGLU's four intermediate-size tensors (gate, silu,
    up, product). expanded_kv: SDPA's K/V expanded to the query heads (model.expand_kv: on CUDA). tests/test_memory.py
    and tests/test_gpu_paths.py check it against autograd's saved-tensor hooks."""
    C, I, H = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    HD, KD = H * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_token = (4 * C + 3 * HD + HD + 2 * KD + 4 * I) * dtype_bytes + (H + 2) * 4
    per_token += 2 * (HD - KD) * dtype_bytes if expanded_kv else 0
    per_token += 2 * C * (4 - dtype_bytes)  # the norms normalise an fp32 copy of their input
    return tokens * per_token


def lora_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each LoRA target's (in, out) features."""
    C, I = cfg.hidden_size, cfg.intermediate_size
    HD, KD = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    return {"q_proj": (C, HD), "k_proj": (C, KD), "v_proj": (C, KD), "o_proj": (HD, C), "gate_proj": (C, I),
            "up_proj": (C, I), "down_proj": (I, C)}


def lora_param_count(cfg: ModelConfig, rank: int, targets=LORA_TARGETS) -> int:
    """Adapter parameters of add_lora: r x (in + out) per targeted projection and block."""
    shapes = lora_shapes(cfg)
    return cfg.num_hidden_layers * rank * sum(sum(shapes[t]) for t in targets)


def lora_activation_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int, rank: int, targets=LORA_TARGETS,
                          dropout: float = 0.0) -> int:
    """What LoRA changes in one Block's saved tensors (block_activation_bytes + this): each adapter keeps its
    r-dim input for lora_B; the frozen norms no longer keep their fp32 normalised input for a weight gradient; with
    dropout, each adapter keeps its dropped input and mask (counted as two copies: an upper bound)."""
    ins = [lora_shapes(cfg)[t][0] for t in targets]
    per_token = len(targets) * rank * dtype_bytes - 2 * cfg.hidden_size * 4
    per_token += 2 * sum(ins) * dtype_bytes if dropout > 0 else 0
    return tokens * per_token


def memory_estimate(cfg: ModelConfig, *, rows: int, seq: int, max_rows: int = 0, max_tokens: int = 0,
                    gen_rows: int = 0, gen_prompts: int = 0, prompt_len: int = 0, new_tokens: int = 0,
                    param_bytes: int = 4, compute_bytes: int = 4, world_size: int = 1, dist: str = "none",
                    activation_checkpointing: bool = False, reference: bool = False, cpu: bool = True,
                    lora_rank: int = 0, lora_targets=LORA_TARGETS, lora_dropout: float = 0.0,
                    base_bytes: int = 0) -> dict:
    """Bytes one rank holds at its peak, by component: the persistent state plus the largest of three phases
    (generation, the forward/backward of the largest micro-batch, the optimizer step).

    rows: training rows per rank and step, each padded to seq tokens (the worst case), in micro-batches of at
    most max_rows rows and max_tokens padded tokens (0 = no limit; common.micro_batches). gen_rows: rows sampled
    at once, from gen_prompts prompts of prompt_len tokens (each prefilled once), new_tokens each.
    param_bytes: the dtype of weights, gradients and AdamW moments; compute_bytes: of activations and KV cache.
    dist "fsdp" shards the state over world_size ranks; "ddp" keeps replicas plus its gradient buckets.
    lora_rank > 0: only the adapters (fp32) have gradients and AdamW state, the frozen base is held in base_bytes
    (0 = param_bytes) and the KL reference is the base itself (pass reference=False).
    cpu False: a CUDA run (no runtime term; grouped-query attention with K/V expanded, model.expand_kv).
    Live tensors only: allocator caching, the CUDA context and communication buffers come on top; on CPU
    `runtime` stands for the interpreter, torch, the tokenizer and the data."""
    P = param_count(cfg)
    L, C, V = cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size
    lora = lora_param_count(cfg, lora_rank, lora_targets) if lora_rank else 0
    T, tb = (lora, 4) if lora_rank else (P, param_bytes)  # what trains, and its bytes per value
    head_grad = 0 if lora_rank else V * C * param_bytes  # the lm_head's weight gradient (frozen with LoRA)
    sharded = dist == "fsdp" and world_size > 1
    shard = world_size if sharded else 1
    outside = V * C * (2 - cfg.tie_word_embeddings) + C  # embeddings, head, final norm: FSDP2's root
    block = (P - outside) // L  # parameters per block
    est = {
        "weights": (P * (base_bytes or param_bytes) + lora * 4) / shard,
        "gradients": T * tb / shard,
        "optimizer": 2 * T * tb / shard,  # AdamW: exp_avg and exp_avg_sq, in the trained parameters' dtype
        "reference": P * param_bytes / shard if reference else 0,  # GRPO's frozen KL reference
        "ddp_buckets": T * tb if dist == "ddp" and world_size > 1 else 0,
    }
    # FSDP2 gathers a block at a time in training (itself and the next, prefetched) and keeps the root's own
    # parameters gathered from forward to backward; the sampler gathers the whole model
    gathered_train = (2 * block + outside) * compute_bytes if sharded else 0
    gathered_gen = P * compute_bytes if sharded else 0
    # torch.autocast over fp32 weights (one device, DDP) keeps a bf16 copy of every trainable weight it casts, the
    # blocks' projections and their biases (or the LoRA adapters), from the first use to the context's exit:
    # through generation, and through forward and backward; an fp32 LoRA base is cast once for the context too
    # (lora.base_cast). (The head runs in fp32: model.head_logits.) The reference holds its projections in bf16
    # (common.frozen_in_compute_dtype)
    norms = 2 * C + 2 * cfg.head_dim * (cfg.model_type == "qwen3")  # per block, never cast
    projections = L * (block - norms)  # the blocks' projection weights and biases
    autocast = compute_bytes == 2 and not sharded and tb == 4
    fp32_base = lora_rank and (base_bytes or param_bytes) == 4
    cast = lora + projections * fp32_base if lora_rank else projections
    est["autocast_copies"] = cast * 2 if autocast else 0
    if reference and autocast:
        est["reference"] -= projections * 2

    # training, the largest micro-batch of n tokens. Checkpointed, each block keeps only its input, and backward
    # recomputes one block at a time; either way backward adds about one block's worth of gradients in flight
    micro = min(rows, max_rows or rows, max(max_tokens // seq, 1) if max_tokens else rows)
    n = micro * seq
    expanded = not cpu and cfg.num_attention_heads != cfg.num_key_value_heads  # model.expand_kv, at its worst
    one_block = block_activation_bytes(cfg, n, compute_bytes, expanded)
    if lora_rank:
        one_block += lora_activation_bytes(cfg, n, compute_bytes, lora_rank, lora_targets, lora_dropout)
    head_input = n * 2 * C * 4 + n * C * compute_bytes  # the final norm's fp32 input and its output
    acts = {False: (L + 1) * one_block + head_input, True: L * n * C * compute_bytes + 2 * one_block + head_input}
    est["activations"] = acts[activation_checkpointing]
    # one log-prob chunk in backward: logits, their softmax and gradient (fp32), and the head's weight gradient.
    # A bf16 head (bf16 weights, FSDP2's bf16 gathering) runs on an fp32 copy (model.head_logits), whose gradient
    # is fp32 too before it is cast back
    bf16_head = compute_bytes == 2 and (sharded or (base_bytes or param_bytes) == 2)
    head_copy = V * C * 4 if bf16_head else 0
    est["logits_chunk"] = 3 * min(logits_chunk_tokens(V), n) * V * 4 + head_grad + head_copy * (1 + (not lora_rank))
    # one micro-batch: the gradients take the place of the activations as backward frees them; several: from the
    # second on, all gradients exist alongside the activations
    grads_live = est["gradients"] if rows > micro or lora_rank else head_grad / shard
    train = est["activations"] + est["logits_chunk"] + grads_live + gathered_train + est["autocast_copies"]

    # generation: the KV cache (each prompt's prefill cache, copied to its samples) and one decode step's logits
    kv_per_slot = 2 * L * cfg.num_key_value_heads * cfg.head_dim * compute_bytes
    est["kv_cache"] = kv_per_slot * (gen_rows * (prompt_len + new_tokens) + gen_prompts * prompt_len)
    prefill = block_activation_bytes(cfg, gen_prompts * prompt_len, compute_bytes) // 2  # no grad: one layer
    head_slice = min(HEAD_COPY_BYTES, V * C * 4) if bf16_head else 0  # no grad: a slice of the copy at a time
    gen = est["kv_cache"] + max(prefill, 5 * gen_rows * V * 4) + head_slice + gathered_gen + est["autocast_copies"]

    # optimizer step: CUDA's multi-tensor AdamW holds a temporary the size of the state, CPU's one per tensor
    largest = max(max(lora_shapes(cfg)[t]) for t in lora_targets) * lora_rank if lora_rank else max(V * C, block)
    step = est["gradients"] + (largest if cpu else T) * tb / shard
    est["fsdp_gathered"] = max(gathered_train, gathered_gen)
    est["runtime"] = RUNTIME_CPU_BYTES if cpu else 0
    persistent = sum(est[k] for k in ("weights", "optimizer", "reference", "ddp_buckets", "runtime"))
    phases = {"generation": gen, "training": train, "optimizer step": step}
    est["phase"] = max(phases, key=phases.get)
    est["peak"] = persistent + phases[est["phase"]]
    est["activations_other"] = acts[not activation_checkpointing]  # the other --activation_checkpointing setting
    est["activation_checkpointing"] = activation_checkpointing
    return est


def format_memory(est: dict) -> str:
    """The estimate in one line (GB), printed at the start of every sft/grpo run."""
    names = {"weights": "weights", "gradients": "gradients", "optimizer": "AdamW", "reference": "reference",
             "ddp_buckets": "DDP buckets", "fsdp_gathered": "FSDP gathered", "activations": "activations",
             "logits_chunk": "logits chunk", "kv_cache": "KV cache", "autocast_copies": "autocast copies",
             "runtime": "runtime"}
    parts = [f"{label} {est[k] / 1e9:.2f}" for k, label in names.items() if est[k] > 0]
    other = "without" if est["activation_checkpointing"] else "with"
    return (f"memory estimate per rank: {est['peak'] / 1e9:.2f} GB at its peak ({est['phase']}); GB: "
            + ", ".join(parts) + f" (activations {est['activations_other'] / 1e9:.2f} {other} "
            "--activation_checkpointing)")


def lora_estimate_args(cfg) -> dict:
    """memory_estimate's LoRA arguments from a run's --lora_* flags (none without --lora_rank)."""
    if not cfg.lora_rank:
        return {}
    return dict(lora_rank=cfg.lora_rank, lora_targets=cfg.lora_targets, lora_dropout=cfg.lora_dropout,
                base_bytes=DTYPES[cfg.lora_base_dtype].itemsize)


def memory_shapes(cfg, stage: str, world: int, prompt_len: int, device_type: str, seq: int = 0) -> dict:
    """memory_estimate's arguments for a run of `stage` ("sft" or "grpo", cfg its config), at its worst case.
    grpo: prompts of prompt_len tokens (the longest), every completion --max_new_tokens long; with
    --rollout vllm no sampler KV cache (the engine's memory is --vllm_memory's share, outside the estimate).
    sft: every row as long as the longest (seq tokens). Both: the in-loop eval samples batches of
    EVAL_BATCH prompts (of prompt_len tokens), once each, --max_new_tokens long."""
    eval_prompts = EVAL_BATCH if cfg.eval_every else 0
    if stage == "grpo":
        gen_prompts = min(cfg.gen_batch, cfg.prompts_per_step // world)
        rows, max_rows = cfg.prompts_per_step // world * cfg.group_size, cfg.train_micro_batch
        seq = prompt_len + cfg.max_new_tokens - 1
        gen_rows = max(gen_prompts * cfg.group_size, eval_prompts)
        gen_prompts = max(gen_prompts, eval_prompts)
        if cfg.rollout == "vllm":  # the engine samples rollouts and evals in its own memory (--vllm_memory)
            gen_rows = gen_prompts = 0
    elif stage == "sft":
        rows, max_rows = cfg.global_batch // world, cfg.micro_batch
        gen_rows = gen_prompts = eval_prompts
    else:
        raise ValueError(f"stage {stage!r}: want 'sft' or 'grpo'")
    return dict(rows=rows,
                seq=seq,
                max_rows=max_rows,
                max_tokens=cfg.micro_batch_tokens,
                gen_rows=gen_rows,
                gen_prompts=gen_prompts,
                prompt_len=prompt_len,
                new_tokens=cfg.max_new_tokens,
                param_bytes=DTYPES[cfg.weights_dtype].itemsize,  # weights, gradients, AdamW moments
                compute_bytes=DTYPES[cfg.dtype].itemsize,  # activations, KV cache (autocast / FSDP2)
                world_size=world,
                dist=cfg.dist if world > 1 else "none",
                activation_checkpointing=cfg.activation_checkpointing,
                cpu=device_type == "cpu",
                reference=stage == "grpo" and cfg.beta > 0 and not cfg.lora_rank,  # GRPO's KL reference
                **lora_estimate_args(cfg))
