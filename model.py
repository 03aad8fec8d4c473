"""A Llama-3.x / Qwen2 / Qwen3 decoder: its config, RoPE, RMSNorm, the KV cache, attention, MLP and chunked log-probs.

    model = Transformer(preset_config("demo", vocab_size))   # or hf.load_model(dir): llama / qwen2 / qwen3
    logits = model(tokens)                 # (B, T, vocab) fp32: the one forward entry point
    logp, entropy = model(tokens, targets=next_tokens)   # (B, T) each, without (B, T, vocab) logits in memory

Reading and writing HF directories is hf.py's, LoRA lora.py's, the memory estimate memory.py's; the sampler that
drives the KV cache lives in sampler.py. The CPU speed paths (the oneDNN projections, decode_attention,
SharedPromptCache, packed_attention) still live here too.

Module and parameter names are Hugging Face's, so a checkpoint loads by stripping "model." and a strict
load_state_dict, and hf.save_model writes a directory that transformers.AutoModelForCausalLM loads unchanged.
Simplifications: no sliding-window attention, no rope scaling other than llama3, no o_proj/MLP biases (the
Llama `attention_bias`/`mlp_bias` options): such configs are rejected with an error, never silently approximated.
"""

import math
import os
import platform
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

# targets mode: logits are computed for chunks of (row, position) pairs, each at most LOGITS_CHUNK fp32 values (64 MB)
# and never fewer than MIN_CHUNK_TOKENS pairs (a tiny chunk would run the lm_head as hundreds of thin matmuls)
LOGITS_CHUNK = 2**24
MIN_CHUNK_TOKENS = 64


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


def keep_rows(rows, length: int, *caches) -> tuple:
    """rows (n,) long the batch rows to keep, in this order; caches (layers, batch, kv_heads, slots, D) each -> each
    cache's first n rows holding them (their first `length` slots; a view). In place, copying only the rows that
    move (sampler's order moves few): a new cache-sized tensor would cost its page faults on the CPU (~17 ms for
    the --vs_trl sampler's 30 MB, 4% of a rollout)."""
    moved = (rows != torch.arange(len(rows), device=rows.device)).nonzero()[:, 0]  # (m,)
    src = rows[moved]
    for x in caches:
        x[:, moved, :, :length] = x[:, src, :, :length]  # (the source is read whole before it is written)
    return tuple(x[:, : len(rows)] for x in caches)


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

    def keep_rows(self, rows):  # rows (n,) long: the batch rows to keep, in this order (in place)
        self.k, self.v = keep_rows(rows, self.length, self.k, self.v)
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)

    def update(self, layer, k, v):  # k, v (B, T, kv_heads, D) -> all keys/values so far (B, kv_heads, length + T, D)
        T, end = k.shape[1], self.length + k.shape[1]
        self.k_layers[layer].narrow(2, self.length, T).copy_(k.transpose(1, 2))
        self.v_layers[layer].narrow(2, self.length, T).copy_(v.transpose(1, 2))
        return self.k_layers[layer][:, :, :end], self.v_layers[layer][:, :, :end]


class SharedPromptCache:
    """The sampler's cache for G samples of each of P prompts, decoding one token a step: each prompt's keys and
    values once, k_prompt, v_prompt (layers, P, kv_heads, L, D) with pad_bias (P, 1, 1, L) (0 or -inf: the left
    padding), and the N = P * G rows' own new tokens, k, v (layers, N, kv_heads, max_len, D). A query attends to
    both at once (one softmax over L + length slots) and reads the prompt's slots once for its G rows, not G times.
    rows (n,): which of the N rows (prompt-major, row = prompt * G + sample) are still decoding."""

    def __init__(self, prompt: KVCache, real, G: int, max_len: int):
        self.k_prompt, self.v_prompt = prompt.k, prompt.v  # (layers, P, Hkv, L, D)
        P, L = real.shape  # real (P, L) bool: the prompt slots that hold tokens
        self.pad_bias = torch.zeros(P, 1, 1, L, dtype=prompt.k.dtype, device=real.device).masked_fill_(
            ~real[:, None, None], float("-inf"))
        layers, _, Hkv, _, D = prompt.k.shape
        self.k = prompt.k.new_zeros(layers, P * G, Hkv, max_len, D)
        self.v = torch.zeros_like(self.k)
        self.G, self.max_len, self.length = G, max_len, 0
        self.rows = torch.arange(P * G, device=real.device)

    def keep_rows(self, rows):  # rows (n,) long, indices into the rows left: keep these, in this order (in place)
        self.k, self.v = keep_rows(rows, self.length, self.k, self.v)
        self.rows = self.rows[rows]

    def _to_grid(self, x):  # (n, Hkv, g, X) -> (P, Hkv, G * g, X); rows that have left are zero (and unread)
        N = len(self.pad_bias) * self.G
        if len(x) < N:
            x = x.new_zeros(N, *x.shape[1:]).index_copy_(0, self.rows, x)
        return x.unflatten(0, (len(self.pad_bias), self.G)).transpose(1, 2).flatten(2, 3)

    def _from_grid(self, x):  # (P, Hkv, G * g, X) -> (n, Hkv, g, X): the rows still decoding
        x = x.unflatten(2, (self.G, -1)).transpose(1, 2).flatten(0, 1)
        return x if len(self.rows) == len(x) else x.index_select(0, self.rows)

    def attend(self, layer, q, k, v):
        """q (n, 1, H, D) this step's queries, k, v (n, 1, Hkv, D) its keys and values (written at slot length)
        -> (n, 1, H * D): softmax(q K^T / sqrt(D)) V over the row's prompt slots and its new ones."""
        n, _, H, D = q.shape
        Hkv, L = k.shape[2], self.pad_bias.shape[-1]
        t = self.length + 1
        self.k[layer, :, :, t - 1] = k[:, 0]
        self.v[layer, :, :, t - 1] = v[:, 0]
        q = q.view(n, Hkv, H // Hkv, D) * D**-0.5  # a kv head's H / Hkv query heads side by side
        grid_q = self._to_grid(q)  # (P, Hkv, G * g, D)
        s_prompt = self._from_grid(torch.matmul(grid_q, self.k_prompt[layer].transpose(-1, -2)) + self.pad_bias)
        k_new, v_new = self.k[layer, :, :, :t], self.v[layer, :, :, :t]  # (n, Hkv, t, D)
        w = torch.cat((s_prompt, torch.matmul(q, k_new.transpose(-1, -2))), -1)  # (n, Hkv, g, L + t)
        w = w.float().softmax(-1).to(self.k.dtype)  # (in fp32, as SDPA does)
        y = self._from_grid(torch.matmul(self._to_grid(w[..., :L]), self.v_prompt[layer]))  # (n, Hkv, g, D)
        y = y + torch.matmul(w[..., L:], v_new)  # (n, Hkv, g, D)
        return y.reshape(n, 1, H * D)


class Packed(NamedTuple):  # packed_attention's index maps
    own: torch.Tensor  # (n, L) flat positions of the segments without a prompt (padding: the last), causal
    shared: tuple | None  # segments with one: (q (m, Lq), k (m, Lk) the prompt's then their own, bias (m, 1, Lq, Lk))
    inv: torch.Tensor  # (B T,) each position's index in the two's outputs, (n L + m Lq); 0 for padding


def packed_attention(segments, prefix, dtype) -> Packed:
    """Attention over packed rows segment by segment instead of over whole rows (whose masked pairs grow with the
    square of the width), each segment an SDPA batch entry: segments without a prompt (the prompts themselves,
    sequences alone) causal within themselves; segments with one, their queries against its keys, then their own.
    Two batches, so a long prompt does not pad its short continuations. segments, prefix (B, T) long as
    model.forward's, a segment's id the flat index (row * T + column) of its first position, its positions
    contiguous; -1: padding."""
    seg, pre = segments.flatten(), prefix.flatten()  # (B T,)
    device, real = seg.device, seg >= 0
    starts, lens = torch.unique(seg[real], return_counts=True)  # (S,) each, in flat order
    length = torch.zeros_like(seg).index_put_((starts,), lens)  # (B T,) each segment's length at its id
    p0 = pre[starts]  # (S,) each segment's prompt: itself where it has none
    pl = torch.where(p0 == starts, 0, length[p0])  # (S,) its prompt's length
    has = pl > 0
    n, L, Lq, Lk = torch.stack([(~has).sum(), torch.where(has, 0, lens).max(), torch.where(has, lens, 0).max(),
                                torch.where(has, lens + pl, 0).max()]).tolist()  # one host sync
    last = starts + lens - 1  # (S,)
    i, j = torch.arange(max(L, Lq), device=device), torch.arange(Lk, device=device)
    a, b = (~has).nonzero()[:, 0], has.nonzero()[:, 0]  # (n,), (m,) which segments
    own = torch.minimum(starts[a, None] + i[:L], last[a, None])  # (n, L)
    shared = None
    if len(b):
        col = j - pl[b, None]  # (m, Lk) key j's column in its segment; < 0: in the prompt
        k = torch.where(col < 0, p0[b, None] + j, torch.minimum(starts[b, None] + col, last[b, None]))  # (m, Lk)
        keep = (col[:, None, :] < 0) | (col[:, None, :] <= i[:Lq, None])  # (m, Lq, Lk): the prompt, then causal
        bias = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))[:, None]
        shared = (torch.minimum(starts[b, None] + i[:Lq], last[b, None]), k, bias)
    # each segment's first output row: its group's block, then its place in the group
    rank = torch.empty_like(starts)
    rank[a], rank[b] = torch.arange(len(a), device=device) * L, n * L + torch.arange(len(b), device=device) * Lq
    flat = torch.arange(len(seg), device=device)
    u = (torch.searchsorted(starts, flat, right=True) - 1).clamp(min=0)  # (B T,) each position's segment
    return Packed(own, shared, torch.where(real, rank[u] + flat - starts[u], 0))


def decode_attention(q, k, v, mask):
    """One query step as two batched matmuls (on the CPU ~2x faster than its SDPA kernel at decode shapes; the
    softmax in fp32, as SDPA's). q (B, Hkv, g, D), k, v (B, Hkv, S, D), mask (B, 1, 1, S) additive or None
    -> (B, Hkv, g, D). Traced by torch.compile, the two products are multiply-and-sums that inductor fuses into
    one pass over the keys and one over the values (aten's bmm is a small GEMM per row and head, ~1 us each at
    these shapes: ~40% of a compiled decode step; eagerly the products would be written out)."""
    q = q * q.shape[-1] ** -0.5
    compiling = torch.compiler.is_compiling()
    w = (q[:, :, :, None] * k[:, :, None]).sum(-1) if compiling else torch.matmul(q, k.transpose(-1, -2))
    if mask is not None:  # w (B, Hkv, g, S)
        w = w + mask
    w = w.float().softmax(-1).to(v.dtype)
    return (w[..., None] * v[:, :, None]).sum(-2) if compiling else torch.matmul(w, v)


# fp32 projections on an AMD x86 CPU with AVX-512 go through oneDNN (torch's own CPU kernels library): torch sends
# an fp32 F.linear to MKL's sgemm, which runs ~2.4x below oneDNN's rate on an AVX-512 AMD EPYC (175 against 430
# GFLOP/s at (3500, 256) x (256, 768); docs/speed.md). On an Intel Xeon with AVX-512 MKL is the faster one (oneDNN
# 0.81-0.97x at the same shapes, a GRPO step 12% slower), and where the CPU (or ATEN_CPU_CAPABILITY) stops at AVX2
# the two run alike and oneDNN's per-call cost makes a GRPO step ~4% slower, so aten keeps them there. Same values
# to fp32 rounding. MINIGRPO_ONEDNN=0 turns it off, =1 on whatever the CPU.
_ONEDNN_ENV = os.environ.get("MINIGRPO_ONEDNN", "")
if _ONEDNN_ENV not in ("", "0", "1"):
    raise ValueError(f"MINIGRPO_ONEDNN={_ONEDNN_ENV!r}: use 1 (oneDNN projections on), 0 (off) or leave it unset "
                     "(on where the CPU is an AMD one that runs AVX-512)")


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The x86 vendor string ('AuthenticAMD', 'GenuineIntel', ...) from /proc/cpuinfo (Linux) or, elsewhere,
    platform.processor() (Windows: 'AMD64 Family 25 ... AuthenticAMD'); '' where neither says."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read(1 << 16)
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    proc = platform.processor()
    return next((v for v in ("AuthenticAMD", "GenuineIntel") if v in proc), "")


ONEDNN_AVAILABLE = (platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
ONEDNN = ONEDNN_AVAILABLE and _ONEDNN_ENV != "0" and (_ONEDNN_ENV == "1" or (
    torch.backends.cpu.get_cpu_capability().startswith("AVX512") and cpu_vendor() == "AuthenticAMD"))
# below this many multiply-adds (rows x in x out) aten's kernel is the faster one: oneDNN's per-call cost is
# ~15 us (the demo's 96-wide decode stays on aten; its training rows and a 256-wide model's decode do not)
ONEDNN_MIN_MACS = 2**21


def _onednn(x, w, b=None):  # x (..., in), w (out, in), b (out,) or None -> (..., out)
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """y = x w^T + b with oneDNN forward and input gradient; the weight gradient a plain matmul (oneDNN is no
    faster at its long reduction)."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        ctx.bias = b is not None
        return _onednn(x, w, b)

    @staticmethod
    def backward(ctx, gy):  # gy (..., out)
        x, w = ctx.saved_tensors
        gx = _onednn(gy, w.t()) if ctx.needs_input_grad[0] else None  # (..., in)
        g2 = gy.reshape(-1, gy.shape[-1])  # (rows, out)
        gw = g2.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None  # (out, in)
        gb = g2.sum(0) if ctx.bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def _onednn_runs(w, macs: int, min_macs: int | None = None) -> bool:  # the rule, for linear(), onednn_packed()
    return (ONEDNN and w.device.type == "cpu" and w.dtype == torch.float32 and not isinstance(w, DTensor)
            and macs >= (ONEDNN_MIN_MACS if min_macs is None else min_macs))  # w (out, in)


# _onednn as one opaque op for torch.compile, forward only: inductor would lower the product to its own GEMM (MKL's:
# at a 256-wide model's decode ~2x slower than oneDNN's on packed weights); a Library op costs ~10 us less a call
# than a torch.library.custom_op (whose Python wrappers run at every call)
if not hasattr(torch.ops.minigrpo, "onednn_linear"):  # (defined once per process, whatever imports this file)
    _LIB = torch.library.Library("minigrpo", "DEF")
    _LIB.define("onednn_linear(Tensor x, Tensor packed, Tensor? b, int out) -> Tensor")
    _LIB.impl("onednn_linear", lambda x, packed, b, out: _onednn(x, packed, b), "CompositeExplicitAutograd")
    torch.library.register_fake("minigrpo::onednn_linear", lambda x, packed, b, out: x.new_empty(*x.shape[:-1], out))


def linear(x, w, b=None, packed=None):
    """F.linear, through oneDNN for fp32 on an AMD x86 CPU with AVX-512 (see ONEDNN): x (..., in), w (out, in)
    -> (..., out). packed: onednn_packed(w), which oneDNN then reads instead of w (without gradients; traced by
    torch.compile too, as one op). Otherwise traced, the product is inductor's."""
    if torch.compiler.is_compiling():  # (the op has no gradient: packed copies are for no_grad calls only)
        if packed is None or torch.is_grad_enabled():
            return F.linear(x, w, b)
        return torch.ops.minigrpo.onednn_linear(x, packed, b, w.shape[0])
    if (not _onednn_runs(w, x.numel() * w.shape[0]) or x.device.type != "cpu" or x.dtype != torch.float32
            or torch.is_autocast_enabled("cpu")):
        return F.linear(x, w, b)
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return _OneDNNLinear.apply(x, w, b)
    return _onednn(x, w if packed is None else packed, b)


def onednn_packed(w, rows: int, min_macs: int | None = None):
    """w (out, in) -> a copy in oneDNN's blocked layout for calls of about `rows` rows, or None where linear()
    would not run oneDNN for that many (or below min_macs multiply-adds, if given). oneDNN otherwise reorders w at
    every call: at the sampler's 64-row decode of a 256-wide model that is 10-30% of a projection (docs/speed.md);
    the products are bitwise the same."""
    if rows < 1 or not _onednn_runs(w, rows * w.numel(), min_macs):  # (rows 0: no copies, whatever the size)
        return None
    return torch.ops.mkldnn._reorder_linear_weight(w, rows)


class Linear(nn.Linear):
    """nn.Linear (the same parameters and names) whose forward is linear() above."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * self.head_dim, bias=cfg.attention_bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * self.head_dim, bias=cfg.attention_bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, cfg.hidden_size, bias=False)
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
        if isinstance(cache, SharedPromptCache):  # the sampler's decode step: G rows share each prompt's slots
            return self.o_proj(cache.attend(layer, q, k, v))
        if isinstance(mask, Packed):  # segment by segment (packed_attention), each padded to its batch's longest
            seg = lambda x, at: x.reshape(B * T, -1, self.head_dim).index_select(0, at.flatten()).unflatten(
                0, at.shape).transpose(1, 2)  # (B, T, h, D) -> (n, h, L, D) at (n, L) flat positions
            at = mask.own
            ys = [F.scaled_dot_product_attention(seg(q, at), seg(k, at), seg(v, at), is_causal=True, enable_gqa=True)]
            if mask.shared is not None:
                at, keys, bias = mask.shared
                ys.append(F.scaled_dot_product_attention(seg(q, at), seg(k, keys), seg(v, keys), attn_mask=bias,
                                                         enable_gqa=True))  # (m, H, Lq, D)
            y = torch.cat([y.transpose(1, 2).flatten(0, 1) for y in ys]).index_select(0, mask.inv)  # (B T, H, D)
            return self.o_proj(y.view(B, T, -1))
        if cache is not None:
            k, v = cache.update(layer, k, v)  # (B, Hkv, S, D), S = slots filled so far
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # (B, Hkv, S, D)
        # grouped-query attention: each kv head serves G = n_heads // n_kv_heads query heads
        if T == 1:  # decoding: a kv head's G query heads act as G queries of it (one mask)
            q = q.view(B, self.n_kv_heads, -1, self.head_dim)  # (B, Hkv, G, D)
            # on the CPU two matmuls: its SDPA kernel is ~2x slower at these shapes (docs/speed.md)
            y = decode_attention(q, k, v, mask) if x.device.type == "cpu" else \
                F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, is_causal=mask is None,
                                               enable_gqa=True).transpose(1, 2)  # (B, T, H, D)
        return self.o_proj(y.reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

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


def token_logp(hidden, targets, lm_head, temperature):
    """hidden (n, C), targets (n,) -> log p(target) (n,) with grad, entropy (n,) without."""
    logits = lm_head(hidden).float()  # (n, V): one chunk's worth only
    if temperature != 1:
        logits = logits / temperature
    logz = logits.logsumexp(-1)
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz
    with torch.no_grad():
        entropy = logz - (logits.softmax(-1) * logits).sum(-1)
    return logp, entropy


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
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
                last_only=False, target_pos=None, segments=None, prefix=None):
        """tokens (B, T) long. input_pos (B, T): RoPE positions, default start..start+T-1 where start is the
        number of cache slots already filled. attn_mask (B, S) bool, True = real token: a key mask over token
        positions, or over cache slots when a cache is passed; combined with causal attention.
        targets (B, T): the token following each position -> (logp, entropy), each (B, T), computed in chunks;
        with target_pos (any shape) long, flat indices into the B * T positions, only at those -> target_pos's
        shape each (the lm_head runs on them alone). segments (B, T) long, no cache: several sequences packed in
        a row, each position attending causally within its own segment (give input_pos restarting at 0 for each);
        prefix (B, T) long, with segments: the segment each position also attends to, a prompt that several packed
        sequences share (its own segment where none); then a segment's id must be the flat index (row * T + column)
        of its first position (packed_attention: attention segment by segment, so rows may be of any width).
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
        mask = None  # plain causal attention (or none at all for a single query)
        if prefix is not None:  # shared prompts: attention segment by segment, not over the (wide) rows
            mask = packed_attention(segments, prefix, x.dtype)
        elif segments is not None:  # packed sequences: causal within each segment
            causal = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
            keep = (segments[:, :, None] == segments[:, None, :]) & causal  # (B, T, T)
            mask = torch.where(keep, 0.0, float("-inf")).to(x.dtype)[:, None]  # (B, 1, T, T)
        elif attn_mask is not None or (start > 0 and T > 1):
            q_slot = torch.arange(start, start + T, device=tokens.device).unsqueeze(1)  # (T, 1)
            k_slot = torch.arange(start + T, device=tokens.device)  # (S,)
            keep = k_slot <= q_slot  # (T, S) causal over slots
            if attn_mask is not None:
                keep = keep & attn_mask[:, None, None, : start + T]  # (B, 1, T, S)
            keep = keep | (k_slot == q_slot)  # a padding query sees itself: no all-masked row, no NaN
            # additive float mask, made once for all layers: SDPA on CPU converts a bool one per call, slowly
            mask = torch.where(keep, 0.0, float("-inf")).to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, mask, cache, i)
        if cache is not None:
            cache.length += T
        x = self.norm(x)
        if targets is None:
            return self.lm_head(x[:, -1:] if last_only else x).float()
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

