"""A Llama-3.x / Qwen2 decoder, Hugging Face checkpoint I/O, the KV cache and a char-level tokenizer.

    model = load_model("Qwen2.5-0.5B")    # any HF dir of model_type llama or qwen2 (safetensors only)
    logits = model(tokens)                 # (B, T, vocab) fp32: the one forward entry point
    logp, entropy = model(tokens, targets=next_tokens)   # (B, T) each, without (B, T, vocab) logits in memory
    save_model(model, "out/", tokenizer)   # an HF directory again

The sampler that drives the KV cache lives in sampler.py.

Module and parameter names are Hugging Face's, so a checkpoint loads by stripping "model." and a strict
load_state_dict, and save_model writes a directory that transformers.AutoModelForCausalLM loads unchanged.
Simplifications: no sliding-window attention, no rope scaling other than llama3, no o_proj/MLP biases (the
Llama `attention_bias`/`mlp_bias` options): such configs are rejected with an error, never silently approximated.
"""

import json
import math
import os
import platform
import string
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

# targets mode: logits are computed for chunks of (row, position) pairs, each at most LOGITS_CHUNK fp32 values (64 MB)
# and never fewer than MIN_CHUNK_TOKENS pairs (a tiny chunk would run the lm_head as hundreds of thin matmuls)
LOGITS_CHUNK = 2**24
MIN_CHUNK_TOKENS = 64
RUNTIME_CPU_BYTES = 0.5e9  # memory_estimate: the interpreter, torch, a tokenizer and the data, on CPU


@dataclass(kw_only=True)
class ModelConfig:
    """Field names are Hugging Face's config.json names."""

    model_type: str = "llama"  # "llama" | "qwen2"
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
    attention_bias: bool = False  # q/k/v bias: always on for qwen2, unsupported for llama
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.model_type not in ("llama", "qwen2"):
            raise ValueError(f"model_type {self.model_type!r} is not supported; use a llama or qwen2 checkpoint")
        _check_types(self)  # before any arithmetic on the values
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} is odd: RoPE rotates pairs of dimensions")
        self.attention_bias = self.model_type == "qwen2" or self.attention_bias
        if self.model_type == "llama" and self.attention_bias:
            raise ValueError("llama with attention_bias=true (q/k/v/o biases) is not supported")
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
        if d.get("model_type") not in ("llama", "qwen2"):
            raise ValueError(f"model_type {d.get('model_type')!r} is not supported; use a llama or qwen2 checkpoint")
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
        d["architectures"] = ["LlamaForCausalLM" if self.model_type == "llama" else "Qwen2ForCausalLM"]
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

    def forward(self, x, cos, sin, mask, cache, layer):
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.n_heads, self.head_dim), cos, sin)  # (B, T, H, D)
        k = apply_rope(self.k_proj(x).view(B, T, self.n_kv_heads, self.head_dim), cos, sin)  # (B, T, Hkv, D)
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


# LoRA (Hu et al. 2021): a frozen projection W plus a trainable low-rank update, y = W x + (alpha / r) B A x.
# Parameter names are PEFT's (q_proj.lora_A.weight, ...) and the base keeps its HF name (q_proj.weight), so the base
# weights still load strictly by name and the adapter file is PEFT's after a prefix.

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A frozen nn.Linear's weight and bias, plus lora_A (r, in) and lora_B (out, r) in fp32. B starts at zero, so a
    fresh adapter leaves the model unchanged; A starts as PEFT's does (U(-1/sqrt(in), 1/sqrt(in))), from `generator`."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, generator: torch.Generator):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias  # the same tensors, under the same names
        device, n_in = base.weight.device, base.in_features
        self.lora_A = Linear(n_in, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = Linear(rank, base.out_features, bias=False, device=device, dtype=torch.float32)
        with torch.no_grad():
            a = (torch.rand(rank, n_in, generator=generator) * 2 - 1) / math.sqrt(n_in)  # on the CPU: any device
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True  # False: the base projection alone (the KL reference, see adapters_off)

    def forward(self, x):  # x (B, T, in) -> (B, T, out)
        y = linear(x, self.weight, self.bias)
        if not self.enabled:
            return y
        a = self.lora_A(self.dropout(x).to(self.lora_A.weight.dtype))  # (B, T, r)
        return y + (self.lora_B(a) * self.scale).to(y.dtype)

    def delta(self) -> torch.Tensor:
        """(out, in) fp32: what merging adds to the weight, scale * B @ A (full tensors, also under FSDP2)."""
        return self.scale * _full(self.lora_B.weight) @ _full(self.lora_A.weight)


def check_lora(rank: int, alpha: float, dropout: float, targets) -> None:
    """ValueError unless the settings make an adapter (what add_lora and the memory estimate accept)."""
    bad = sorted(set(targets) - set(LORA_TARGETS))
    if rank < 1 or not alpha > 0 or not 0 <= dropout < 1 or bad or not targets:
        raise ValueError(f"bad LoRA settings: rank={rank} (want >= 1), alpha={alpha} (> 0), dropout={dropout} "
                         f"(in [0, 1)), targets {list(targets)} (a non-empty subset of {list(LORA_TARGETS)})")


def add_lora(model: "Transformer", rank: int, alpha: float, dropout: float = 0.0, targets=LORA_TARGETS, *,
             seed: int = 0, base_dtype: torch.dtype | None = None, base: str | None = None) -> "Transformer":
    """Freeze every weight of the model (cast to base_dtype if given) and wrap the `targets` projections of each
    block in LoRALinear, in place; A is drawn from `seed`, so every rank builds the same adapter. `base` names the
    base model in the exported adapter_config.json. Returns the model, with model.lora its settings (PEFT's names)."""
    check_lora(rank, alpha, dropout, targets)
    if base_dtype is not None:
        model.to(base_dtype)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    for block in model.layers:
        block.draws_random = dropout > 0
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if name in targets:
                    setattr(parent, name, LoRALinear(child, rank, alpha, dropout, g))
    model.lora = {"r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
                  "target_modules": [t for t in LORA_TARGETS if t in targets], "base_model_name_or_path": base}
    return model


def lora_layers(model) -> dict[str, LoRALinear]:
    """Name (as in the state dict, DDP's "module." stripped) -> LoRALinear; empty for a model without LoRA."""
    return {k.removeprefix("module."): m for k, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: "Transformer") -> "Transformer":
    """Fold each adapter into its weight, W + scale * B @ A in W's dtype, and drop the adapters: a plain model again
    (in place; not under FSDP2). Returns the model."""
    for name, m in lora_layers(model).items():
        parent, child = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        plain = Linear(m.weight.shape[1], m.weight.shape[0], bias=m.bias is not None, device="meta")
        with torch.no_grad():
            plain.weight = nn.Parameter((m.weight.float() + m.delta()).to(m.weight.dtype), requires_grad=False)
        plain.bias = m.bias
        setattr(parent, child, plain)
    model.lora = None
    return model


@contextmanager
def adapters_off(model):
    """The base model: every LoRA update switched off for the duration (the GRPO reference, no second copy)."""
    layers = lora_layers(model).values()
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True


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


# ---------------------------------------------------------------------------------------------------------------
# Memory estimate: what one rank holds at its peak, from the shapes alone (printed at the start of sft/grpo runs)


def param_count(cfg: ModelConfig) -> int:
    C, HD, KD = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attn = C * HD + 2 * C * KD + HD * C + (HD + 2 * KD) * cfg.attention_bias
    block = attn + 3 * C * cfg.intermediate_size + 2 * C  # + SwiGLU + two norms
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * C
    return cfg.vocab_size * C + cfg.num_hidden_layers * block + C + head


def block_activation_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """What autograd keeps for backward in one Block over `tokens` (row, position) pairs: per token the block
    input, both norms' inputs and outputs (the norm statistics in fp32), q/k/v, attention's output twice (as SDPA
    returns it and reshaped for o_proj) and its logsumexp, and SwiGLU's four intermediate-size tensors (gate, silu,
    up, product). tests/test_memory.py checks it against autograd's saved-tensor hooks."""
    C, I, H = cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads
    HD, KD = H * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_token = (4 * C + 3 * HD + HD + 2 * KD + 4 * I) * dtype_bytes + (H + 2) * 4
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

    # training, the largest micro-batch of n tokens. Checkpointed, each block keeps only its input, and backward
    # recomputes one block at a time; either way backward adds about one block's worth of gradients in flight
    micro = min(rows, max_rows or rows, max(max_tokens // seq, 1) if max_tokens else rows)
    n = micro * seq
    one_block = block_activation_bytes(cfg, n, compute_bytes)
    if lora_rank:
        one_block += lora_activation_bytes(cfg, n, compute_bytes, lora_rank, lora_targets, lora_dropout)
    head_input = n * 2 * C * 4 + n * C * compute_bytes  # the final norm's fp32 input and its output
    acts = {False: (L + 1) * one_block + head_input, True: L * n * C * compute_bytes + 2 * one_block + head_input}
    est["activations"] = acts[activation_checkpointing]
    # one log-prob chunk in backward: logits, their softmax and gradient (fp32), and the head's weight gradient
    est["logits_chunk"] = 3 * min(logits_chunk_tokens(V), n) * V * 4 + head_grad
    # one micro-batch: the gradients take the place of the activations as backward frees them; several: from the
    # second on, all gradients exist alongside the activations
    grads_live = est["gradients"] if rows > micro or lora_rank else head_grad / shard
    train = est["activations"] + est["logits_chunk"] + grads_live + gathered_train

    # generation: the KV cache (each prompt's prefill cache, copied to its samples) and one decode step's logits
    kv_per_slot = 2 * L * cfg.num_key_value_heads * cfg.head_dim * compute_bytes
    est["kv_cache"] = kv_per_slot * (gen_rows * (prompt_len + new_tokens) + gen_prompts * prompt_len)
    prefill = block_activation_bytes(cfg, gen_prompts * prompt_len, compute_bytes) // 2  # no grad: one layer
    gen = est["kv_cache"] + max(prefill, 5 * gen_rows * V * 4) + gathered_gen

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
             "logits_chunk": "logits chunk", "kv_cache": "KV cache", "runtime": "runtime"}
    parts = [f"{label} {est[k] / 1e9:.2f}" for k, label in names.items() if est[k] > 0]
    other = "without" if est["activation_checkpointing"] else "with"
    return (f"memory estimate per rank: {est['peak'] / 1e9:.2f} GB at its peak ({est['phase']}); GB: "
            + ", ".join(parts) + f" (activations {est['activations_other'] / 1e9:.2f} {other} "
            "--activation_checkpointing)")


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face directories: config.json + model.safetensors (or shards + model.safetensors.index.json)


def _shard_files(path: Path) -> list[str]:
    """The weight files of an HF dir: model.safetensors, or the files its shard index names. Those must be plain
    file names in the dir (an index naming "/abs/x" or "../x" would load weights from elsewhere)."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return ["model.safetensors"]
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index}: not a shard index (needs a \"weight_map\" object of tensor -> file name); "
                         "save or download it again")
    files = sorted(set(weight_map.values()))
    for f in files:
        if Path(f).name != f or f in (".", ".."):
            raise ValueError(f"{index}: weight_map names {f[:80]!r}, not a file in {path}; fix the index")
    return files


def _read_state(path: Path) -> dict:
    files = _shard_files(path)
    state = {}
    for name in files:
        if not (path / name).exists():
            hint = " (only pickle weights found: convert them to safetensors)" if any(path.glob("*.bin")) else ""
            raise FileNotFoundError(f"{path / name}: weights file not found{hint}")
        try:
            state.update(load_file(path / name))
        except SafetensorError as e:
            raise ValueError(f"{path / name}: unreadable safetensors file, truncated or corrupt ({e}); "
                             "save or download it again") from None
    return {k.removeprefix("model."): v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}


def load_config(path, size_limits: bool = True) -> ModelConfig:
    """An HF model directory's config.json (no weights read), checked: types, ranges, divisibility and, unless
    size_limits is False, check_size."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model directory (want an HF dir: config.json + model.safetensors)")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path / 'config.json'}: not found; is {path} a Hugging Face model directory?")
    try:
        try:
            d = json.loads((path / "config.json").read_text())
        except ValueError as e:  # (also a file that is not UTF-8)
            raise ValueError(f"not valid JSON ({e})") from None
        cfg = ModelConfig.from_hf(d)
        if size_limits:
            check_size(cfg)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from None
    gen = path / "generation_config.json"
    if gen.is_file():  # chat models list more stop ids there than in config.json (Qwen2.5-Instruct: <|endoftext|>)
        try:
            extra = json.loads(gen.read_text()).get("eos_token_id")
        except ValueError as e:
            raise ValueError(f"{gen}: not valid JSON ({e})") from None
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in _as_list(extra)):
            raise ValueError(f"{gen}: eos_token_id={extra!r}: expected a token id or a list of them")
        ids = list(dict.fromkeys(_as_list(cfg.eos_token_id) + _as_list(extra)))
        cfg.eos_token_id = ids[0] if len(ids) == 1 else ids or None  # saved so, the union stays with the model
    return cfg


def load_model(path, device="cpu", dtype=torch.float32, size_limits: bool = True) -> Transformer:
    """An HF model dir -> Transformer; config.json is checked (load_config) before any weight is read."""
    path = Path(path)
    cfg = load_config(path, size_limits)
    state = _read_state(path)
    if cfg.tie_word_embeddings and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]  # HF omits the tied copy
    with torch.device("meta"):  # shapes only: no memory, no random init
        model = Transformer(cfg)
    want = model.state_dict()
    missing, unexpected = sorted(want.keys() - state.keys()), sorted(state.keys() - want.keys())
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match config.json: missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]} ({len(missing)} and {len(unexpected)} in all)")
    for k, v in want.items():
        if state[k].shape != v.shape:
            raise ValueError(f"{path}: tensor {k} has shape {tuple(state[k].shape)}, config.json implies "
                             f"{tuple(v.shape)}; the config does not belong to these weights")
    # copy=True: safetensors' tensors map the file; a tool rewriting it in place would change or crash the model
    model.load_state_dict({k: v.to(device, dtype, copy=True) for k, v in state.items()}, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # assign=True made two parameters; re-tie them
    return model


def save_model(model, path, tokenizer=None, max_file_bytes: int = 2**31) -> None:
    """Writes an HF model directory: config.json, the weights in safetensors files of at most max_file_bytes
    (model.safetensors, or model-0000k-of-0000n.safetensors + model.safetensors.index.json) and the tokenizer.
    DDP and FSDP2 models work; every rank must call it. Under FSDP2 each tensor is gathered in turn, so no rank
    holds the whole model; rank 0 alone writes, holding at most one file's tensors. A LoRA model is written merged
    (W + scale * B @ A, in W's dtype): a plain model of the same architecture."""
    model = model.module if isinstance(model, DistributedDataParallel) else model
    main = not tdist.is_initialized() or tdist.get_rank() == 0
    tied = model.config.tie_word_embeddings
    lora = {k + ".weight": m for k, m in lora_layers(model).items()}
    state = {k: v for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight") and ".lora_" not in k}  # HF re-ties
    files = [[]]  # tensor names per file, in order, each file <= max_file_bytes (or one tensor larger)
    size = 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()  # global size, also for a DTensor shard
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(k)
        size += nbytes
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    path = Path(path)
    if main:
        path.mkdir(parents=True, exist_ok=True)
        for stale in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
            stale.unlink(missing_ok=True)  # an old file or shard index would mix with the new weights on load
        dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
        cfg = model.config.to_hf() | {"torch_dtype": dtype}
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for keys, name in zip(files, names):
        part = {}
        for k in keys:
            v = _full(state[k])  # FSDP2: a collective
            if k in lora:
                v = (v.float() + lora[k].delta()).to(v.dtype)
            if main:
                part[_hf_name(k)] = v.detach().cpu().contiguous()
        if main:
            save_file(part, path / name, metadata={"format": "pt"})
            _fsync(path / name)
    if main and len(files) > 1:
        total = sum(v.numel() * v.element_size() for v in state.values())
        weight_map = {_hf_name(k): name for keys, name in zip(files, names) for k in keys}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if main and tokenizer is not None:
        tokenizer.save_pretrained(path)


def _full(v: torch.Tensor) -> torch.Tensor:
    return v.full_tensor() if isinstance(v, DTensor) else v


# PEFT's adapter format: adapter_config.json + adapter_model.safetensors, keys named as in PeftModel's state dict
ADAPTER_PREFIX = "base_model.model.model."


def save_adapter(model, path, tokenizer=None) -> None:
    """Writes the LoRA adapter alone as a PEFT adapter dir, which peft.PeftModel.from_pretrained(base, path) loads
    onto the base model (and load_adapter here). Every rank must call it (FSDP2 gathers); rank 0 writes."""
    model = model.module if isinstance(model, DistributedDataParallel) else model
    main = not tdist.is_initialized() or tdist.get_rank() == 0
    tensors = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            v = _full(v)  # FSDP2: a collective, on every rank in the same order
            tensors[ADAPTER_PREFIX + k] = v.detach().cpu().contiguous()
    if not main:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**model.lora, "peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "fan_in_fan_out": False,
           "inference_mode": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}
    (path / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, path / "adapter_model.safetensors", metadata={"format": "pt"})
    _fsync(path / "adapter_model.safetensors")
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def load_adapter(model: "Transformer", path, base_dtype: torch.dtype | None = None) -> "Transformer":
    """Adds the PEFT LoRA adapter in `path` (ours, or one peft saved) to the model, in place; returns the model."""
    path = Path(path)
    try:
        cfg = json.loads((path / "adapter_config.json").read_text())
        targets = cfg["target_modules"]
        targets = [targets] if isinstance(targets, str) else targets
        if cfg.get("peft_type") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora") or cfg.get("rank_pattern"):
            raise ValueError("only plain LoRA adapters are supported (no DoRA, rsLoRA or per-layer ranks)")
        add_lora(model, cfg["r"], cfg["lora_alpha"], 0.0, targets, base_dtype=base_dtype,
                 base=cfg.get("base_model_name_or_path"))
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path / 'adapter_config.json'}: not a usable LoRA adapter config ({e})") from None
    try:
        state = load_file(path / "adapter_model.safetensors")
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{path / 'adapter_model.safetensors'}: unreadable ({e})") from None
    state = {k.removeprefix(ADAPTER_PREFIX).replace(".default.", "."): v for k, v in state.items()}
    want = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    if state.keys() != want.keys() or any(state[k].shape != v.shape for k, v in want.items()):
        raise ValueError(f"{path}: the adapter's tensors do not fit this base model (e.g. "
                         f"{sorted(state.keys() ^ want.keys())[:2]}); is it the base the adapter was trained on?")
    model.load_state_dict(state, strict=False)
    return model


def _hf_name(key: str) -> str:
    return key if key == "lm_head.weight" else "model." + key  # HF nests all but the head in .model


def _fsync(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def load_tokenizer(path):
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path}: no such tokenizer directory")
    if not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        # (transformers' own message for this case is five generic lines that do not name the directory)
        raise FileNotFoundError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json) in it")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # the tokenizers library raises a bare Exception for a malformed tokenizer.json
        raise ValueError(f"{path}: unreadable tokenizer files ({type(e).__name__}: {e}); save or download them "
                         "again") from None


def stop_and_pad_ids(tokenizer, cfg: ModelConfig) -> tuple[list[int], int]:
    """The ids generation stops on and the id padding uses, one rule for every stage (sampler, SFT, eval).
    Stop ids: the tokenizer's eos_token_id first (SFT ends its targets with it), then config.json's eos_token_id (an
    int or a list), which load_model merged with generation_config.json's: Qwen2.5-Instruct stops on <|im_end|> and
    <|endoftext|>, Llama-3.x-Instruct on <|eot_id|> and <|end_of_text|> (and <|eom_id|>).
    Pad id: the tokenizer's pad token, else config.json's pad_token_id, else the first stop id (Llama 3 has no pad
    token). Padding is masked out of attention and the loss everywhere, so which id it is never matters."""
    stops = list(dict.fromkeys(i for i in [tokenizer.eos_token_id, *_as_list(cfg.eos_token_id)] if i is not None))
    if not stops:
        raise ValueError("no stop token: neither the tokenizer nor config.json / generation_config.json names an "
                         "eos_token_id; set one in the model directory's config.json")
    pad = next((i for i in (tokenizer.pad_token_id, cfg.pad_token_id) if i is not None), stops[0])
    return stops, pad


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def char_tokenizer():
    """One token per character: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then "\\n" and printable ASCII.
    encode() adds no special tokens (like Qwen2.5's), so decode(encode(text)) == text exactly."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    chars = ["\n"] + [c for c in string.printable if 32 <= ord(c) < 127]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))  # no merges: every char is its own token
    tok.decoder = decoders.Fuse()  # join the characters back without separators
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)
