"""A Llama-3.x / Qwen2 / Qwen3 decoder: its config, RoPE, RMSNorm, the KV cache, attention, MLP and chunked log-probs.

    model = Transformer(preset_config("demo", vocab_size))   # or hf.load_model(dir): llama / qwen2 / qwen3
    logits = model(tokens)                 # (B, T, vocab) fp32: the one forward entry point
    logp, entropy = model(tokens, targets=next_tokens)   # (B, T) each, without (B, T, vocab) logits in memory

Reading and writing HF directories is hf.py's, LoRA lora.py's, the memory estimate memory.py's, packing rows
packing.py's; the sampler that drives the KV cache lives in sampler.py. The CPU speed paths (oneDNN projections, the
fused decode step, shared prompt slots) are fast.py's, which this file never imports: the stage scripts swap them in.

Module and parameter names are Hugging Face's, so a checkpoint loads by stripping "model." and a strict
load_state_dict, and hf.save_model writes a directory that transformers.AutoModelForCausalLM loads unchanged.
Simplifications: no sliding-window attention, no rope scaling other than llama3, no o_proj/MLP biases (the
Llama `attention_bias`/`mlp_bias` options): such configs are rejected with an error, never silently approximated.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# targets mode: logits are computed for chunks of (row, position) pairs, each at most LOGITS_CHUNK fp32 values (64 MB)
# and never fewer than MIN_CHUNK_TOKENS pairs (a tiny chunk would run the lm_head as hundreds of thin matmuls)
LOGITS_CHUNK = 2**24
MIN_CHUNK_TOKENS = 64
# head_logits without gradients: a bf16 head's fp32 copy is made a slice of the vocabulary at a time, this many bytes
HEAD_COPY_BYTES = 2**28


MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@dataclass(kw_only=True)
class ModelConfig:
    """Field names are Hugging Face's config.json names."""

    model_type: str = "llama"  # "llama" | "qwen2" | "qwen3" (Qwen3: RMSNorm on each q and k head before RoPE)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # default hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None or {"rope_type": "llama3", "factor", "low_freq_factor", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias: always on for qwen2, unsupported for llama and qwen3
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; use a {' / '.join(MODEL_TYPES)} "
                             "checkpoint")
        _check_types(self)  # before any arithmetic on the values
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is odd: RoPE rotates pairs of dimensions")
        self.attention_bias = self.model_type == "qwen2" or self.attention_bias
        if self.model_type != "qwen2" and self.attention_bias:
            raise ValueError(f"{self.model_type} with attention_bias=true (q/k/v/o biases) is not supported")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.rope_scaling is not None and self.rope_scaling.get("rope_type") != "llama3":
            raise ValueError(f"rope_scaling {self.rope_scaling} is not supported (only rope_type llama3)")

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Reads hub configs (top-level rope_theta/rope_scaling) and transformers-5 ones (rope_parameters)."""
        if not isinstance(d, dict):
            raise ValueError(f"expected a JSON object, got {type(d).__name__}")
        if not isinstance(d.get("rope_parameters") or d.get("rope_scaling") or {}, dict):
            raise ValueError(f"rope_scaling={d.get('rope_scaling')!r} is not an object")
        if d.get("model_type") not in MODEL_TYPES:
            raise ValueError(f"model_type {d.get('model_type')!r} is not supported; use a {' / '.join(MODEL_TYPES)} "
                             "checkpoint")
        unsupported = {"hidden_act": "silu", "mlp_bias": False, "use_sliding_window": False}
        for key, ok in unsupported.items():
            if d.get(key, ok) != ok:
                raise ValueError(f"{key}={d[key]!r} is not supported (only {ok!r})")
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        rope["rope_type"] = rope.pop("type", None) or rope.get("rope_type", "default")  # old spelling: "type"
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names - {"rope_theta", "rope_scaling"}}
        kw.setdefault("num_key_value_heads", d.get("num_attention_heads"))  # older configs: no GQA, no key
        return cls(**kw, rope_theta=theta, rope_scaling=None if rope["rope_type"] == "default" else rope)

    def to_hf(self) -> dict:
        """config.json in the top-level layout, which transformers 4.x and 5 both read."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["architectures"] = [MODEL_TYPES[self.model_type]]
        d["hidden_act"] = "silu"
        if self.model_type == "qwen2":
            del d["attention_bias"]  # implied by the architecture
        return d


_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "max_position_embeddings")
_LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _check_types(cfg: ModelConfig):
    """Types and ranges of a config, checked before anything is computed from it (config.json is user input)."""
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)
    is_num = lambda v: is_int(v) or (isinstance(v, float) and math.isfinite(v))
    for name in _INTS:
        v = getattr(cfg, name)
        if not is_int(v) or v < 1:
            raise ValueError(f"{name}={v!r}: expected a positive integer")
    if cfg.head_dim is not None and (not is_int(cfg.head_dim) or cfg.head_dim < 1):
        raise ValueError(f"head_dim={cfg.head_dim!r}: expected a positive integer (or no head_dim)")
    for name in ("rms_norm_eps", "rope_theta"):
        if not is_num(getattr(cfg, name)) or getattr(cfg, name) <= 0:
            raise ValueError(f"{name}={getattr(cfg, name)!r}: expected a positive number")
    for name in ("tie_word_embeddings", "attention_bias"):
        if not isinstance(getattr(cfg, name), bool):
            raise ValueError(f"{name}={getattr(cfg, name)!r}: expected true or false")
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(cfg, name)
        ids = v if isinstance(v, list) and name == "eos_token_id" else [v]
        if not all(i is None or is_int(i) for i in ids):
            raise ValueError(f"{name}={v!r}: expected a token id (an integer) or null")
    if cfg.rope_scaling is not None and cfg.rope_scaling.get("rope_type") == "llama3":
        s = cfg.rope_scaling
        ok = all(is_num(s.get(k)) and s[k] > 0 for k in _LLAMA3_ROPE)
        if not ok or s["high_freq_factor"] <= s["low_freq_factor"]:
            raise ValueError(f"llama3 rope_scaling {s} needs positive numbers {', '.join(_LLAMA3_ROPE)} with "
                             "high_freq_factor > low_freq_factor")


# sizes beyond any model minigrpo is meant for: a config past them is far more likely a typo (or a hostile file)
# than a model, and building it would take minutes or all memory before failing. --size_limits false lifts them.
SIZE_LIMITS = {"num_hidden_layers": 1024, "hidden_size": 65536, "intermediate_size": 262144,
               "num_attention_heads": 1024, "head_dim": 1024, "vocab_size": 2**22, "max_position_embeddings": 2**22}
MAX_PARAMS = 2 * 10**12


def check_size(cfg: ModelConfig):
    """Refuse a config past SIZE_LIMITS or MAX_PARAMS, before anything is allocated (python ints, no tensors)."""
    for name, limit in SIZE_LIMITS.items():
        if getattr(cfg, name) > limit:
            raise ValueError(f"{name}={getattr(cfg, name)} is over minigrpo's sanity limit {limit}: if the model is "
                             "really that large, pass --size_limits false")
    C, D, F = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    block = C * D * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads) + 3 * C * F
    n = cfg.num_hidden_layers * block + cfg.vocab_size * C * (1 if cfg.tie_word_embeddings else 2)
    if n > MAX_PARAMS:
        raise ValueError(f"the config describes {n:.3g} parameters, over minigrpo's sanity limit {MAX_PARAMS:.0g}: "
                         "if the model is really that large, pass --size_limits false")


PRESETS = {
    # the built-in demo's model (sft.py's default), calibrated with its SFT recipe (docs/demo.md): a change
    # here moves the step at which SFT lands in GRPO's band; tests/test_demo.py guards it
    "demo": dict(hidden_size=96, intermediate_size=288, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
    # a small 4-layer model for benchmarks (bench.py) and quick CPU runs
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
    "25m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=4, tie_word_embeddings=True),
}


def preset_config(name: str, vocab_size: int, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    unknown = set(overrides) - {f.name for f in fields(ModelConfig)}
    if unknown:
        raise ValueError(f"unknown config fields {sorted(unknown)}; ModelConfig's are config.json's names")
    return ModelConfig(**{**PRESETS[name], "vocab_size": vocab_size, **overrides})


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """(head_dim // 2,) fp32 RoPE frequencies, with Llama 3.1's long-context rescaling when configured."""
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device="cpu").float() / cfg.head_dim)
    if cfg.rope_scaling is None:
        return inv_freq
    s = cfg.rope_scaling
    old_len, lo, hi = s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated
    scaled = torch.where(wavelen > old_len / lo, inv_freq / s["factor"], inv_freq)
    smooth = (old_len / wavelen - lo) / (hi - lo)
    mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
    return torch.where(mid, (1 - smooth) * scaled / s["factor"] + smooth * scaled, scaled)


def rope_cos_sin(inv_freq, input_pos, dtype):
    """input_pos (B, T) -> cos, sin (B, T, 1, D) in dtype, sin's first half negated (see apply_rope)."""
    freqs = input_pos.unsqueeze(-1).float() * inv_freq  # (B, T, D/2)
    cos = torch.cat((freqs, freqs), dim=-1).cos().unsqueeze(2).to(dtype)
    sin = torch.cat((-freqs, freqs), dim=-1).sin().unsqueeze(2).to(dtype)
    return cos, sin


def apply_rope(x, cos, sin):  # x (B, T, H, D); cos (B, T, 1, D); sin (B, T, 1, D) with its first half negated
    # HF's rotate-half, x * cos + cat(-x2, x1) * sin, in three ops: roll gives cat(x2, x1)
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # normalise in fp32, cast back, then scale: HF's order of operations
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def additive_mask(keep, dtype):
    """keep (any shape) bool -> 0 where True, -inf where False, in dtype: SDPA's additive mask (a bool one SDPA on
    the CPU converts at every call, slowly). Every attention mask in minigrpo is made here."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


class KVCache:
    """Preallocated keys and values, written by slot. k, v: (layers, batch, kv_heads, max_len, head_dim), head-major:
    a row's slots for one head are contiguous, so attention reads them without a copy."""

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, device=None, dtype=torch.float32):
        shape = (cfg.num_hidden_layers, batch, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        # forward writes through per-layer views: torch.compile updates those in place (a slice of the 5-d
        # tensor itself it would copy whole, every step)
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)
        self.max_len = max_len
        self.length = 0  # slots filled; a forward writes the next T slots, then advances it

    def update(self, layer, k, v, start=None):
        """k, v (B, T, kv_heads, D): written at slots start.. (default: length) -> all keys and values up to them,
        (B, kv_heads, start + T, D) each. start is given by a compiled caller, so its graph does not fix it."""
        start = self.length if start is None else start
        T = k.shape[1]
        self.k_layers[layer].narrow(2, start, T).copy_(k.transpose(1, 2))  # (copy_ casts: autocast's k is fp32)
        self.v_layers[layer].narrow(2, start, T).copy_(v.transpose(1, 2))
        return self.k_layers[layer][:, :, : start + T], self.v_layers[layer][:, :, : start + T]

    def keep_rows(self, rows):
        """rows (n,) long: the batch rows to keep, in this order -> the cache's first n rows hold them (a view). In
        place, copying only the rows that move (the sampler's order moves few): a new cache-sized tensor would
        cost its page faults on the CPU (~17 ms for the --vs_trl sampler's 30 MB, 4% of a rollout)."""
        moved = (rows != torch.arange(len(rows), device=rows.device)).nonzero()[:, 0]  # (m,)
        src = rows[moved]
        for x in (self.k, self.v):
            x[:, moved, :, : self.length] = x[:, src, :, : self.length]  # (the source is read whole first)
        self.k, self.v = self.k[:, : len(rows)], self.v[:, : len(rows)]
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)


def expand_kv(device_type: str, dtype, heads: int, kv_heads: int, masked: bool) -> bool:
    """sdpa's rule: give SDPA keys and values expanded to the query heads (repeat_interleave) rather than
    enable_gqa=True, on CUDA where a grouped-query call has a mask or runs in fp32 (transformers' sdpa_attention
    expands for a mask too). Flash attention takes neither a mask nor fp32, and the memory-efficient kernel takes
    no GQA in most torch releases pyproject allows (2.6 on): such a call falls to the math kernel, which keeps
    (B, H, T, S) fp32 scores for backward (~0.6 GB a layer at the README's 1.5B recipe). Expanded, the
    memory-efficient kernel takes it, for 2 (H - Hkv) S D more values (memory.block_activation_bytes counts
    them). The CPU keeps enable_gqa: its kernel takes both."""
    return device_type == "cuda" and heads != kv_heads and (masked or dtype == torch.float32)


def sdpa(q, k, v, mask=None, is_causal=False):
    """F.scaled_dot_product_attention over grouped-query heads, for every SDPA call of minigrpo's forward.
    q (B, H, T, D); k, v (B, Hkv, S, D); mask additive (B or 1, 1, T, S) or None -> (B, H, T, D)"""
    H, Hkv, dev = q.shape[1], k.shape[1], q.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else q.dtype  # what SDPA computes in
    if expand_kv(dev, dtype, H, Hkv, mask is not None):
        k, v = k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)  # (B, H, S, D) each
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)


@contextmanager
def without_cudnn_attention():
    """A decode step's SDPA call on CUDA: any kernel enabled but cuDNN's, which builds an execution graph per
    shape (55-400 ms each, upstream reports) and would meet a new key length at every step. The other flags are
    left as they are (an outer sdpa_kernel still pins them)."""
    was = torch.backends.cuda.cudnn_sdp_enabled()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


def attention(q, k, v, mask):
    """The one masked attention. q (B, T, H, D); k, v (B, Hkv, S, D), each kv head serving H / Hkv query heads;
    mask additive (B or 1, 1, T, S), or None: causal (T == S) or, for one query, every key. -> (B, T, H, D)"""
    B, T, H, D = q.shape
    if T > 1:
        y = sdpa(q.transpose(1, 2), k, v, mask, is_causal=mask is None)  # (B, H, T, D)
        return y.transpose(1, 2)
    q = q.view(B, k.shape[1], -1, D)  # one query: a kv head's query heads act as queries of it (B, Hkv, H / Hkv, D)
    if q.device.type != "cpu":
        with without_cudnn_attention():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).view(B, 1, H, D)
    # on the CPU two matmuls: its SDPA kernel is ~2x slower at decode shapes (docs/speed.md); softmax in fp32, as SDPA
    w = torch.matmul(q * D**-0.5, k.transpose(-1, -2))  # (B, Hkv, H / Hkv, S)
    if mask is not None:
        w = w + mask
    w = w.float().softmax(-1).to(v.dtype)
    return torch.matmul(w, v).view(B, 1, H, D)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.model_type == "qwen3"  # Qwen3: RMSNorm over each head's q and k, before RoPE
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache, layer):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim)  # (B, T, H, D)
        k = self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim)  # (B, T, Hkv, D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = self.v_proj(x).view(B, T, self.n_kv_heads, self.head_dim)
        if hasattr(cache, "attend"):  # a cache that attends itself (the sampler's fast.SharedPromptCache)
            y = cache.attend(layer, q, k, v)
        elif hasattr(mask, "attend"):  # a mask that attends itself (packed rows: packing.Packed)
            y = mask.attend(q, k, v)
        else:
            if cache is not None:
                k, v = cache.update(layer, k, v)  # (B, Hkv, S, D), S = slots filled so far
            else:
                k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, T, D)
            y = attention(q, k, v, mask)  # (B, T, H, D)
        return self.o_proj(y.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.checkpointed = False  # set_activation_checkpointing: recompute this block in backward
        self.draws_random = False  # LoRA dropout: the recompute must replay the same masks

    def forward(self, x, cos, sin, mask, cache, layer):
        if self.checkpointed and torch.is_grad_enabled():
            # keep only the block's input for backward and run the block again there (RNG states are replayed only
            # for LoRA dropout). Under FSDP2 this runs inside the block's fully_shard hooks, as torchtitan's does
            return checkpoint(self._forward, x, cos, sin, mask, cache, layer, use_reentrant=False,
                              preserve_rng_state=self.draws_random)
        return self._forward(x, cos, sin, mask, cache, layer)

    def _forward(self, x, cos, sin, mask, cache, layer):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


def logits_chunk_tokens(vocab_size: int) -> int:
    """(row, position) pairs per log-prob chunk: LOGITS_CHUNK fp32 logits, at least MIN_CHUNK_TOKENS pairs."""
    return max(LOGITS_CHUNK // vocab_size, MIN_CHUNK_TOKENS)


def head_logits(lm_head, x):
    """x (..., C) -> logits (..., V) in fp32 under every precision mode. A bf16 product (autocast's, or bf16
    weights: FSDP2's MixedPrecisionPolicy, --weights_dtype bfloat16) would round them to bf16, a step of 0.125 at
    logits of 16-32: noise in every log-prob and importance ratio. So the head runs outside autocast on fp32 copies
    (bf16 -> fp32 is exact: the product of the values as they are, summed in fp32). An fp32 call is the plain one
    (the same kernel, fast.use_onednn's included). The fp32 copy of a bf16 head is whole where autograd keeps it
    for backward, else made HEAD_COPY_BYTES at a time (memory.py counts both)."""
    w = lm_head.weight  # (V, C)
    if x.dtype == w.dtype == torch.float32 and not torch.is_autocast_enabled(x.device.type):
        return lm_head(x)
    with torch.autocast(x.device.type, enabled=False):
        x = x.float()
        if w.dtype == torch.float32 or (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)):
            return F.linear(x, w.float())
        rows = max(HEAD_COPY_BYTES // (4 * w.shape[1]), 1)  # vocabulary rows per slice
        return torch.cat([F.linear(x, part.float()) for part in w.split(rows)], -1)  # sampling, the reference


def token_logp(hidden, targets, lm_head, temperature):
    """hidden (n, C), targets (n,) -> log p(target) (n,) with grad, entropy (n,) without."""
    logits = head_logits(lm_head, hidden)  # (n, V) fp32: one chunk's worth only
    if temperature != 1:
        logits = logits / temperature
    logz = logits.logsumexp(-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    with torch.no_grad():
        entropy = logz - (logits.softmax(-1) * logits).sum(-1)
    return logp, entropy


def attention_mask(T: int, start: int, attn_mask, segments, dtype, device):
    """Transformer.forward's mask for T queries at cache slots start..start+T-1 (its arguments): additive
    (B or 1, 1, T, S), S = start + T; None for plain causal attention (or none at all for one query); or segments
    itself where it attends itself."""
    if hasattr(segments, "attend"):  # packed rows with shared prompts: attention segment by segment
        return segments
    if segments is not None:  # packed sequences: causal within each segment
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        keep = (segments[:, :, None] == segments[:, None, :]) & causal  # (B, T, T)
        return additive_mask(keep[:, None], dtype)  # (B, 1, T, T)
    if attn_mask is None and (start == 0 or T == 1):
        return None
    q_slot = torch.arange(start, start + T, device=device).unsqueeze(1)  # (T, 1)
    k_slot = torch.arange(start + T, device=device)  # (S,)
    keep = k_slot <= q_slot  # (T, S) causal over slots
    if attn_mask is not None:
        keep = keep & attn_mask[:, None, None, : start + T]  # (B, 1, T, S)
    keep = keep | (k_slot == q_slot)  # a padding query sees itself: no all-masked row, no NaN
    return additive_mask(keep, dtype)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        for name, p in self.named_parameters():  # HF's init: N(0, 0.02) matrices, zero biases, unit norms
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias"):
                nn.init.zeros_(p)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # a plain attribute, not a buffer: model.to(bfloat16) must not round the frequencies
        self.inv_freq = rope_inv_freq(cfg)

    def forward(self, tokens, cache=None, input_pos=None, attn_mask=None, targets=None, temperature=1.0,
                last_only=False, target_pos=None, segments=None):
        """tokens (B, T) long. input_pos (B, T): RoPE positions, default start..start+T-1 where start is the
        number of cache slots already filled. attn_mask (B, S) bool, True = real token: a key mask over token
        positions, or over cache slots when a cache is passed; combined with causal attention.
        targets (B, T): the token following each position -> (logp, entropy), each (B, T), computed in chunks;
        with target_pos (any shape) long, flat indices into the B * T positions, only at those -> target_pos's
        shape each (the lm_head runs on them alone). segments, no cache: several sequences packed in a row, each
        position attending causally within its own segment (give input_pos restarting at 0 for each): (B, T) long
        segment ids, or an object that attends itself, segment by segment (packing.packed_attention's).
        Otherwise -> logits (B, T, V) fp32, or (B, 1, V) for the last position if last_only."""
        B, T = tokens.shape
        start = 0 if cache is None else cache.length
        if cache is not None and start + T > cache.max_len:
            raise ValueError(f"KVCache holds {cache.max_len} slots, {start + T} needed")
        if self.inv_freq.device != tokens.device:
            self.inv_freq = self.inv_freq.to(tokens.device)
        if input_pos is None:
            input_pos = torch.arange(start, start + T, device=tokens.device).expand(B, T)
        x = self.embed_tokens(tokens)  # (B, T, C)
        cos, sin = rope_cos_sin(self.inv_freq, input_pos, x.dtype)  # (B, T, 1, D) each
        mask = attention_mask(T, start, attn_mask, segments, x.dtype, tokens.device)  # once for all layers
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i)
        if cache is not None:
            cache.length += T
        x = self.norm(x)
        if targets is None:
            return head_logits(self.lm_head, x[:, -1:] if last_only else x)
        # chunks of the flattened (row, position) pairs, each recomputed in backward: neither pass holds (B, T, V)
        # fp32 logits. (token_logp draws no random numbers: the RNG states need no stashing for the recompute)
        n = logits_chunk_tokens(self.config.vocab_size)
        h, t = x.flatten(0, 1), targets.flatten()  # (B*T, C), (B*T,)
        shape = (B, T)
        if target_pos is not None:  # only the positions whose log-probs are read: the lm_head runs on those alone
            h, t, shape = h[target_pos.flatten()], t[target_pos.flatten()], target_pos.shape  # (M, C), (M,)
        out = [checkpoint(token_logp, hc, tc, self.lm_head, temperature, use_reentrant=False, preserve_rng_state=False)
               for hc, tc in zip(h.split(n), t.split(n))]
        return torch.cat([o[0] for o in out]).view(shape), torch.cat([o[1] for o in out]).view(shape)

    def set_activation_checkpointing(self, on: bool = True):
        """Recompute each transformer block in backward instead of keeping its activations (--activation_checkpointing):
        training holds one (rows, seq, hidden) input per block plus one block's activations, not every block's, at
        the price of one extra forward per backward (~1/3 more compute). Call it before wrap_model (FSDP2)."""
        for block in self.layers:
            block.checkpointed = on
        return self

