"""The CPU speed paths, apart from the code they speed up: model.py never imports this file.

    fast.use_onednn(model)   # the stage scripts, once the model is built: fp32 projections through oneDNN
    generate(model, ..., fast="auto")   # the sampler asks decoder() below for its decode step

- oneDNN projections: on an AMD CPU with AVX-512 oneDNN runs fp32 products ~2.4x faster than MKL's sgemm, which
  torch's F.linear calls; use_onednn swaps them into a model (as nanochat swaps its fp8 linears in).
- SharedPromptCache: a prompt's G samples attend to its cache slots held once, not to G copies.
- fused_step: the model's forward at one token in about half its tensor ops (a small model's decode is their
  per-call cost), optionally through torch.compile with symbolic sizes (one graph for every step and call).
Each gives the plain path's tokens; docs/speed.md has the measurements that chose them.
"""

import os
import platform
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lora import LoRALinear, lora_layers
from model import KVCache, additive_mask, attention, rope_cos_sin
from sampler import Decoder, per_row_cache

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


class OneDNNLinear(nn.Linear):
    """nn.Linear (the same parameters and names) whose forward is linear() above."""

    def forward(self, x):
        return linear(x, self.weight, self.bias)


def use_onednn(model):
    """The model's projections through linear() above, in place: each nn.Linear becomes a OneDNNLinear (the same
    module, parameters and names) and a LoRA layer's base product (its `linear` attribute, F.linear) becomes
    linear(); the sampler's fused step then uses oneDNN's products too. Where oneDNN does not run (ONEDNN off, not
    fp32, not on the CPU, DTensor shards) the products stay F.linear's. Call it once the model is built (LoRA
    added), before FSDP2 or DDP wraps it. -> the model."""
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = OneDNNLinear
        elif getattr(m, "linear", None) is F.linear:
            m.linear = linear
    return model


def decode_attention(q, k, v, mask):
    """model.attention at one query per row, as torch.compile fuses it: traced, its two products are
    multiply-and-sums that inductor fuses into one pass over the keys and one over the values (aten's bmm is a
    small GEMM per row and head, ~1 us each at these shapes: ~40% of a compiled decode step); eagerly
    model.attention's two matmuls. q (n, 1, H, D), k, v (n, Hkv, S, D), mask (n, 1, 1, S) additive
    -> (n, 1, H, D)."""
    if not torch.compiler.is_compiling():
        return attention(q, k, v, mask)
    n, _, H, D = q.shape
    q = q.reshape(n, k.shape[1], -1, D) * D**-0.5  # (n, Hkv, H / Hkv, D)
    w = (q[:, :, :, None] * k[:, :, None]).sum(-1) + mask  # (n, Hkv, H / Hkv, S)
    w = w.float().softmax(-1).to(v.dtype)
    return (w[..., None] * v[:, :, None]).sum(-2).view(n, 1, H, D)


class SharedPromptCache(KVCache):
    """The sampler's cache for G samples of each of P prompts, decoding one token a step: each prompt's keys and
    values once, k_prompt, v_prompt (layers, P, kv_heads, L, D) with pad_bias (P, 1, 1, L) (0 or -inf: the left
    padding), and the N = P * G rows' own new tokens in this KVCache (layers, N, kv_heads, max_len, D). A query
    attends to both at once (one softmax over L + length slots) and reads the prompt's slots once for its G rows,
    not G times. rows (n,): which of the N rows (prompt-major, row = prompt * G + sample) are still decoding."""

    def __init__(self, cfg, prompt: KVCache, real, G: int, max_len: int):
        P, L = real.shape  # real (P, L) bool: the prompt slots that hold tokens
        super().__init__(cfg, P * G, max_len, real.device, prompt.k.dtype)
        self.k_prompt, self.v_prompt = prompt.k, prompt.v  # (layers, P, Hkv, L, D)
        self.pad_bias = additive_mask(real[:, None, None], prompt.k.dtype)  # (P, 1, 1, L)
        self.G = G
        self.rows = torch.arange(P * G, device=real.device)

    def keep_rows(self, rows):  # rows (n,) long, indices into the rows left: keep these, in this order (in place)
        super().keep_rows(rows)
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
        -> (n, 1, H * D): softmax(q K^T / sqrt(D)) V over the row's prompt slots and its new ones. (g: query heads
        per kv head.)"""
        n, _, H, D = q.shape
        L = self.pad_bias.shape[-1]
        k_new, v_new = self.update(layer, k, v)  # (n, Hkv, t, D)
        q = q.view(n, k.shape[2], -1, D) * D**-0.5  # (n, Hkv, g, D): a kv head's query heads side by side
        grid_q = self._to_grid(q)  # (P, Hkv, G * g, D)
        s_prompt = self._from_grid(torch.matmul(grid_q, self.k_prompt[layer].transpose(-1, -2)) + self.pad_bias)
        w = torch.cat((s_prompt, torch.matmul(q, k_new.transpose(-1, -2))), -1)  # (n, Hkv, g, L + t)
        w = w.float().softmax(-1).to(self.k.dtype)  # (in fp32, as SDPA does)
        y = self._from_grid(torch.matmul(self._to_grid(w[..., :L]), self.v_prompt[layer]))  # (n, Hkv, g, D)
        y = y + torch.matmul(w[..., L:], v_new)  # (n, Hkv, g, D)
        return y.reshape(n, 1, H * D)


FUSED_MAX_BYTES = 2**28  # fused_layers' weight copies stay under this (256 MiB), else the model's forward decodes


# compiled, a weight with fewer entries (in x out) stays inductor's GEMM (MKL's) rather than the oneDNN op: at 64
# rows 10-20 us faster a call at 384 -> 128, even at 256 -> 256, ~2x slower from 128 -> 768 up. By the weight alone,
# not the rows (as linear()'s rule): a choice that changed with the row count would compile the step again
COMPILED_ONEDNN_MIN_WEIGHT = 2**16


def fused_layers(model, rows: int = 0, compile: bool = False) -> list[tuple] | None:
    """fused_step's weights, per layer: (input norm, q/k/v stacked (out, in), their biases stacked or None, o_proj,
    post-attention norm, gate/up stacked (2 I, in), down_proj), each projection a pair (weight, its
    onednn_packed copy for `rows` rows or None; compile: for weights from COMPILED_ONEDNN_MIN_WEIGHT up; None where
    use_onednn did not convert the model). Copies, made once per generate call: one matmul where the model runs
    three, one where it runs two; a LoRA layer's weight merged (W + scale * B @ A, as lora.merge_lora's). None where
    the step does not apply: weights other than fp32, autocast, LoRA dropout in training mode, FSDP2, Qwen3's q/k
    norms, or copies over FUSED_MAX_BYTES (there the step is its matmuls: fusing saves nothing)."""
    w = model.embed_tokens.weight
    projections = [getattr(b.self_attn, n) for b in model.layers for n in ("q_proj", "k_proj", "v_proj")]
    projections += [getattr(b.mlp, n) for b in model.layers for n in ("gate_proj", "up_proj")]
    adapters = lora_layers(model).values()
    if (torch.is_autocast_enabled(w.device.type)
            or any(m.training and not isinstance(m.dropout, nn.Identity) for m in adapters)
            or any(p.dtype != torch.float32 for p in model.parameters())
            or sum(m.weight.numel() for m in projections) * 4 > FUSED_MAX_BYTES
            or any(isinstance(m, FSDPModule) for m in model.modules())
            or any(b.self_attn.qk_norm for b in model.layers)):  # Qwen3's q/k norms: the forward decodes
        return None
    onednn = isinstance(model.lm_head, OneDNNLinear)

    def pair(w):  # compile: by the weight's size alone
        if not onednn or (compile and w.numel() < COMPILED_ONEDNN_MIN_WEIGHT):
            return w, None
        return w, onednn_packed(w, rows, min_macs=0 if compile else None)

    def weight(m):  # (out, in): a LoRA layer's merged (the same products to fp32 rounding), else the weight itself
        return m.weight + m.delta() if isinstance(m, LoRALinear) and m.enabled else m.weight

    layers = []
    for b in model.layers:
        a, m = b.self_attn, b.mlp
        qkv = torch.cat([weight(a.q_proj), weight(a.k_proj), weight(a.v_proj)])  # ((H + 2 Hkv) D, C)
        bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
        gate_up = torch.cat([weight(m.gate_proj), weight(m.up_proj)])  # (2 I, C)
        layers.append((b.input_layernorm.weight, pair(qkv), bias, pair(weight(a.o_proj)),
                       b.post_attention_layernorm.weight, pair(gate_up), pair(weight(m.down_proj))))
    return layers


def _rms_norm(x, w, width, eps):  # model.RMSNorm's fp32 forward, the same values in fewer ops
    # rsqrt(eps + sum(x^2) / width): the mean's sum and division; width, eps: 0-d fp32 tensors
    return (x * torch.addcdiv(eps, x.pow(2).sum(-1, keepdim=True), width).rsqrt_()).mul_(w)


def fused_step(model, layers, cache, tok, cos, sin, norm, bias, t):
    """One new token per row: the model's forward at T = 1 (Block, Attention, MLP, RMSNorm, apply_rope,
    model.attention: the same arithmetic in the same order; with MKL's AVX-512 kernels bitwise the same values
    where widths are multiples of 32, as in every preset; docs/speed.md) in about half its tensor ops, where the
    decode of a small model is their per-call cost: the fused_layers matmuls, RoPE on q and k at once, a key mask
    kept between steps instead of built, RoPE's tables looked up.
    tok (n,) long; cos, sin (n, 1, D) RoPE at each row's position (rope_cos_sin's); norm: RMSNorm's (width, eps)
    as 0-d fp32 tensors; bias (n, S) fp32, 0 on the slots a row attends to (this step's included), -inf elsewhere,
    for a KVCache; None for a SharedPromptCache. t: the slots filled after this step, cache.length + 1 (given, not
    read, so a compiled step does not specialize on it; the caller sets cache.length). -> logits (n, V) fp32."""
    cfg = model.config
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    n = len(tok)
    x = model.embed_tokens.weight[tok]  # (n, C)
    for i, (w_in, w_qkv, b_qkv, w_o, w_post, w_gate_up, w_down) in enumerate(layers):
        qkv = _product(_rms_norm(x, w_in, *norm), w_qkv, b_qkv)  # (n, (H + 2 Hkv) D)
        qk = qkv[:, : (H + Hkv) * D].view(n, H + Hkv, D)
        qk = torch.addcmul(qk * cos, qk.roll(D // 2, dims=-1), sin)  # apply_rope, q and k at once
        q, k, v = qk[:, None, :H], qk[:, None, H:], qkv[:, None, (H + Hkv) * D :].view(n, 1, Hkv, D)
        if bias is None:  # the G rows of a prompt attend to its slots held once
            y = cache.attend(i, q, k, v)  # (n, 1, H D)
        else:
            keys, values = cache.update(i, k, v, start=t - 1)  # (n, Hkv, t, D): t stays symbolic when compiled
            y = decode_attention(q, keys, values, bias[:, None, None, :t])  # (n, 1, H, D)
        x = x + _product(y.view(n, H * D), w_o)
        gate_up = _product(_rms_norm(x, w_post, *norm), w_gate_up)  # (n, 2 I)
        I = gate_up.shape[1] // 2
        x = x + _product(F.silu(gate_up[:, :I]) * gate_up[:, I:], w_down)
    return model.lm_head(_rms_norm(x, model.norm.weight, *norm))


def _product(x, pair, b=None):  # pair: fused_layers' (weight, its packed copy or None)
    w, packed = pair
    return F.linear(x, w, b) if packed is None else linear(x, w, b, packed)


_compiled = {}  # function -> its torch.compile wrapper, one per process: its graphs are reused across calls


def compiled(step):
    if step not in _compiled:
        # dynamic=None: a size seen to change compiles once more, symbolic (fused_step's are marked so from the start)
        _compiled[step] = torch.compile(step)
    return _compiled[step]


class FusedDecoder(Decoder):
    """sampler.Decoder with fused_step for its step: fused_layers' weights, rope = (cos, sin) (positions, 1, D) for
    every position a new token can take, RMSNorm's width and eps as 0-d fp32 tensors made once (a Python number
    becomes one at every call), and the key mask kept additive, bias (n, S) fp32 (None for a SharedPromptCache,
    which masks itself). compile: the step through torch.compile, its sizes symbolic (_symbolic)."""

    def __init__(self, model, layers, cache, keys, rope, compile: bool):
        super().__init__(cache, None)
        self.layers, self.rope, self.compile = layers, rope, compile
        self.step = compiled(fused_step) if compile else fused_step
        self.norm = tuple(torch.tensor(float(v), dtype=torch.float32, device=rope[0].device)
                          for v in (model.config.hidden_size, model.config.rms_norm_eps))
        self.bias = None if keys is None else additive_mask(keys, torch.float32)

    def open(self, slot: int):
        if self.bias is not None:
            self.bias[:, slot] = 0.0

    def keep(self, rows):
        super().keep(rows)
        if self.bias is not None:
            self.bias = self.bias[rows]

    def __call__(self, model, tok, pos):  # writes slot cache.length, attends to the slots up to it
        p, t = pos[:, 0], self.cache.length + 1
        rows = tok[:, 0], self.rope[0][p], self.rope[1][p]
        with _symbolic(rows, self.bias, self.cache) if self.compile else nullcontext():
            logits = self.step(model, self.layers, self.cache, *rows, self.norm, self.bias, t)
        self.cache.length = t
        return logits


def _symbolic(rows, bias, cache: KVCache):
    """For torch.compile of fused_step: its row and slot counts (rows (n, ...) each, bias (n, S), the cache's
    (n, Hkv, S, D) per layer) and its step t symbolic from the first call. Else the first call's sizes are
    specialized and each that changes later compiles again: a process's graphs would depend on its history, and a
    run resumed in a new process would decode to rounding, not bitwise, as the uninterrupted one. (One row left
    still gets a graph of its own: Dynamo specializes sizes 0 and 1; as it depends on n alone, so does it.) -> the
    context the call runs in."""
    for x in (*rows, bias, *cache.k_layers, *cache.v_layers):
        torch._dynamo.maybe_mark_dynamic(x, 0)
    for x in (*cache.k_layers, *cache.v_layers):
        torch._dynamo.maybe_mark_dynamic(x, 2)  # the slots
    torch._dynamo.maybe_mark_dynamic(bias, 1)
    if not hasattr(torch.compiler.config, "dynamic_sources"):  # torch < 2.7: t turns symbolic at the second step
        return nullcontext()
    return torch.compiler.config.patch(dynamic_sources="L['t']")  # fused_step's argument t


def decoder(model, prefill: KVCache, real, G: int, max_new_tokens: int, pos, mode: str) -> Decoder:
    """The sampler's decode step for `mode` (sampler.generate's fast=, resolved): "shared", the G rows of a prompt
    attend to its cache slots held once (SharedPromptCache; G > 1); "fused", each step is fused_step where
    fused_layers applies (else the model's forward); "shared+fused", both; "compile", fused_step through
    torch.compile, each row holding a copy of its prompt's slots (where the step does not apply, the model's
    forward). prefill: the P prompts' cache, real (P, L) bool its filled slots; pos (N, 1) long each row's first
    new position."""
    compile = mode == "compile"
    layers = fused_layers(model, len(real) * G, compile) if compile or "fused" in mode else None
    if "shared" in mode and G > 1:
        cache, keys = SharedPromptCache(model.config, prefill, real, G, max_new_tokens), None
    else:
        cache, keys = per_row_cache(model.config, prefill, real, G, max_new_tokens)
    if layers is None:
        return Decoder(cache, keys)
    at = torch.arange(int(pos.max()) + max_new_tokens, device=pos.device)[:, None]  # every position a token can take
    rope = [x[:, 0] for x in rope_cos_sin(model.inv_freq, at, prefill.k.dtype)]  # cos, sin (positions, 1, D)
    return FusedDecoder(model, layers, cache, keys, rope, compile)
