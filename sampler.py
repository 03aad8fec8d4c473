"""Batched sampling with a preallocated KV cache: G completions per prompt, each prompt prefilled once.

    out = generate(model, prompts, max_new_tokens=256, num_samples=8, temperature=1.0, eos_ids=[tok.eos_token_id],
                   generator=torch.Generator().manual_seed(0))
    out.tokens, out.mask, out.logprobs  # (N, T) each, N = len(prompts) * num_samples, row = prompt * G + sample

Prompts are left-padded so every row writes its next token to the same cache slot; per-row RoPE positions
and a key mask make the padding exactly invisible. On the CPU (shared_prompt) a prompt's G rows attend to its
slots held once (model.SharedPromptCache), one softmax over them and the row's own new slots; else each row
holds a copy of them. The decode loop does a fixed number of tensor ops per step whatever the batch size, and one
host sync ("how many rows are done?"); on the CPU each step is fused_step, the model's forward at one token in
about half its ops (a small model's decode is their per-call cost). Finished rows keep decoding (their tokens are
masked) until they are 1/8 of the rows left; then the growing forward drops them (the last rows move into their
places, in the cache itself), so a batch whose rows stop early stops paying for them. The static step keeps every
row (fixed shapes). Dropping rows changes no other row's tokens or draws (each row's uniform is drawn as if all N
rows decoded). Where oneDNN runs the projections (model.ONEDNN), the step reads weights packed once per call.
compile=True (off by default; grpo.py --compile; docs/speed.md says why) runs the fused step, where it applies (the
CPU's fp32 default), through torch.compile, its step, row and slot counts symbolic from the first call, so one graph
serves every step and call (one row alone: a second); the large products stay oneDNN's on the packed weights (one
opaque op each), attention becomes fused passes over the keys and values (model.decode_attention), and each row
holds its own copy of its prompt's slots. Elsewhere it compiles the static step.
"""

import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from model import KVCache, SharedPromptCache, decode_attention, linear, onednn_packed, rope_cos_sin


@dataclass
class Generation:
    tokens: torch.Tensor  # (N, T) long, completion tokens; pad_id after the stop token
    mask: torch.Tensor  # (N, T) bool, True up to and including the stop (EOS) token
    logprobs: torch.Tensor  # (N, T) fp32, log-prob of each token under the sampling distribution; 0 where masked
    truncated: torch.Tensor  # (N,) bool, the row hit max_new_tokens without an EOS


def sample(logits, temperature, top_k, top_p, generator, u=None):
    """logits (N, V) fp32 -> token (N,), its log-prob (N,) under the distribution it was drawn from:
    softmax(logits / temperature) restricted to the top-k / top-p set. temperature 0 is greedy, and then the
    log-prob is the model's own (temperature 1). u: (N, 1) uniforms in [0, 1) to draw with (default: from
    generator)."""
    if temperature == 0:
        tok = logits.argmax(-1)
        return tok, logits.log_softmax(-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    if temperature != 1:
        logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token once the mass before it does
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    logp = logits.log_softmax(-1)  # (N, V)
    # inverse-CDF draw, one uniform per row (multinomial draws N * V on CPU). u < total strictly, so the token
    # found, the first whose cumulative mass exceeds u, always has probability > 0
    cdf = logp.exp().cumsum(-1)  # (N, V)
    total = cdf[:, -1:]
    u = (torch.rand(total.shape, generator=generator, device=total.device) if u is None else u) * total
    tok = torch.searchsorted(cdf, torch.minimum(u, total.nextafter(torch.zeros_like(total))), right=True)  # (N, 1)
    return tok.squeeze(-1), logp.gather(-1, tok).squeeze(-1)


@contextmanager
def gathered(model):
    """FSDP2: all-gather the parameters once for the whole generation. Per-forward all-gathers would be slow and
    would hang as soon as ranks stop decoding at different steps. Afterwards FSDP2's defaults are restored:
    sharded parameters, blocks reshard after forward, the root does not."""
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for m in mods:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for m in mods:
            m.set_reshard_after_forward(m is not model, recurse=False)
            m.reshard()


@torch.no_grad()
def generate(model, prompts: list[list[int]], max_new_tokens: int, *, num_samples=1, temperature=1.0, top_p=1.0,
             top_k=0, eos_ids=(), pad_id=0, generator: torch.Generator | None = None, noise=None,
             static=None, compile=None, cuda_graph=None, shared_prompt=None, fused=None) -> Generation:
    """Samples num_samples completions for each prompt (token id lists of any lengths). Randomness comes only
    from `generator` (on the model's device), or from `noise`: (N, max_new_tokens) uniforms in [0, 1) on the
    model's device, row i's draw at step t being noise[i, t], so a row's samples do not depend on which other
    rows share its batch. Works on a plain, DDP-wrapped or FSDP2-sharded model, and computes in the caller's
    precision: under common.autocast (torch.autocast) the KV cache takes the autocast dtype.
    How each token is decoded: static=True uses decode_step (fixed shapes: every step attends over all cache
    slots, masked), else the model's forward over the slots filled so far (shapes grow by one slot a step).
    compile=True runs the step through torch.compile: fused_step where it applies (below; its sizes symbolic, so
    the first call compiles once, ~25 s on a CPU, ~6 s with inductor's cache warm, and that graph serves every step,
    row count and call, one row alone a second; each row holds a copy of its prompt's slots), else decode_step,
    which it then implies. cuda_graph=True replays decode_step as a CUDA graph captured once per batch shape and
    reused across calls (CUDA only, not under FSDP2, whose gathered weights move between calls); it implies static.
    shared_prompt=True (the growing forward, num_samples > 1, not compiled): the G rows of a prompt attend to its
    cache slots held once (model.SharedPromptCache), not to G copies: the prompt's keys and values are read once
    per step for its G samples. fused=True (the growing step): each step runs fused_step, the same arithmetic as
    the model's forward in about half the tensor ops, for an fp32 model without LoRA, autocast or FSDP2 (elsewhere
    the forward runs; fused_layers says where). None picks the device's default, DEFAULTS (docs/speed.md,
    "Decoding speed", says how it was chosen). Every mode samples the same tokens; log-probs agree to float
    rounding."""
    if isinstance(model, DistributedDataParallel):
        model = model.module  # DDP's own forward would broadcast buffers: a collective per step
    cfg = model.config
    if not prompts or not all(len(p) for p in prompts):
        raise ValueError("generate needs a non-empty list of non-empty prompts (lists of token ids)")
    if max_new_tokens < 1 or num_samples < 1 or temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"bad sampling arguments: max_new_tokens={max_new_tokens} num_samples={num_samples} "
                         f"temperature={temperature} top_p={top_p} top_k={top_k}")
    ids = [t for p in prompts for t in p] + list(eos_ids) + [pad_id]
    if min(ids) < 0 or max(ids) >= cfg.vocab_size:
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}): prompts, eos_ids or pad_id do not")
    device = model.embed_tokens.weight.device
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"generator on {generator.device}, model on {device}: use torch.Generator({device.type!r})")
    if noise is not None and tuple(noise.shape) != (len(prompts) * num_samples, max_new_tokens):
        raise ValueError(f"noise of shape {tuple(noise.shape)}: expected (prompts * num_samples, max_new_tokens)")
    default = DEFAULTS.get(device.type, {"static": False, "compile": False, "cuda_graph": False,
                                         "shared_prompt": False, "fused": False})
    shared_prompt = default["shared_prompt"] if shared_prompt is None else shared_prompt
    fused = default["fused"] if fused is None else fused
    compile = default["compile"] if compile is None else compile
    sharded = any(isinstance(m, FSDPModule) for m in model.modules())
    cuda_graph = (default["cuda_graph"] and not sharded) if cuda_graph is None else cuda_graph
    static = cuda_graph or (default["static"] if static is None else static)
    if cuda_graph and (device.type != "cuda" or sharded):
        raise ValueError(f"cuda_graph=True needs an unsharded model on a CUDA device (this one: {device}"
                         f"{', FSDP2-sharded' if sharded else ''})")
    with gathered(model):
        N = len(prompts) * num_samples
        layers = fused_layers(model, N, compile) if fused and not static and not sharded else None
        static = static or (compile and layers is None)  # what compiles where fused_step does not apply
        return _generate(model, prompts, max_new_tokens, num_samples, temperature, top_p, top_k, eos_ids, pad_id,
                         generator, noise, static, compile, cuda_graph, shared_prompt, layers)


# device type -> generate()'s modes when given None: chosen by measurement (docs/speed.md, "Decoding speed"). CUDA: not
# measured yet, so off there too
DEFAULTS = {"cpu": {"static": False, "compile": False, "cuda_graph": False, "shared_prompt": True, "fused": True},
            "cuda": {"static": False, "compile": False, "cuda_graph": False, "shared_prompt": False, "fused": False}}
DROP_EVERY = 8  # the growing forward drops the finished rows once they are 1/8 of the rows left
SLOT_BUCKET = 32  # the cache length is rounded up to a multiple of this: fewer distinct shapes to compile / capture


def decode_step(model, cache: KVCache, tok, pos, slot, keys):
    """One new token per row, static shapes: every tensor keeps its shape from step to step and call to call, so
    torch.compile traces it once and a CUDA graph can replay it. tok, pos (N, 1) long: the token and its RoPE
    position; slot (1,) long: the cache slot it is written to (the same in every row); keys (N, S) bool: the slots
    each row attends to, this step's included. -> logits (N, V) fp32."""
    x = model.embed_tokens(tok)  # (N, 1, C)
    cos, sin = rope_cos_sin(model.inv_freq, pos, x.dtype)  # (N, 1, 1, D)
    mask = torch.zeros(keys.shape, dtype=x.dtype, device=x.device).masked_fill_(~keys, float("-inf"))
    slots = _SlotWriter(cache, slot)
    for i, layer in enumerate(model.layers):
        x = layer(x, cos, sin, mask[:, None, None], slots, i)  # attends over all S slots, masked
    return model.lm_head(model.norm(x))[:, 0].float()


class _SlotWriter:
    """What Attention needs of a cache, at a fixed shape: write this step's keys/values at `slot` (an index tensor,
    not a Python int, so the traced step does not change with it) and return all S slots."""

    def __init__(self, cache: KVCache, slot):
        self.cache, self.slot = cache, slot

    def update(self, layer, k, v):  # k, v (N, 1, Hkv, D) -> (N, Hkv, S, D) each
        # (under autocast k comes out fp32, RoPE's tables being fp32: index_copy_ casts nothing itself)
        self.cache.k_layers[layer].index_copy_(2, self.slot, k.transpose(1, 2).to(self.cache.k.dtype))
        self.cache.v_layers[layer].index_copy_(2, self.slot, v.transpose(1, 2).to(self.cache.v.dtype))
        return self.cache.k_layers[layer], self.cache.v_layers[layer]


FUSED_MAX_BYTES = 2**28  # fused_layers' weight copies stay under this (256 MiB), else the model's forward decodes


# compiled, a weight with fewer entries (in x out) stays inductor's GEMM (MKL's) rather than the oneDNN op: at 64
# rows 10-20 us faster a call at 384 -> 128, even at 256 -> 256, ~2x slower from 128 -> 768 up. By the weight alone,
# not the rows (as linear()'s rule): a choice that changed with the row count would compile the step again
COMPILED_ONEDNN_MIN_WEIGHT = 2**16


def fused_layers(model, rows: int = 0, compiled: bool = False) -> list[tuple] | None:
    """fused_step's weights, per layer: (input norm, q/k/v stacked (out, in), their biases stacked or None, o_proj,
    post-attention norm, gate/up stacked (2 I, in), down_proj), each projection a pair (weight, its
    model.onednn_packed copy for `rows` rows or None; compiled: for weights from COMPILED_ONEDNN_MIN_WEIGHT up). Copies,
    made once per generate call: one matmul where the model runs three, one where it runs two. None where the step
    does not apply: LoRA adapters, weights other than fp32, autocast, or copies over FUSED_MAX_BYTES (there the step
    is its matmuls: fusing saves nothing)."""
    w = model.embed_tokens.weight
    projections = [getattr(b.self_attn, n) for b in model.layers for n in ("q_proj", "k_proj", "v_proj")]
    projections += [getattr(b.mlp, n) for b in model.layers for n in ("gate_proj", "up_proj")]
    if (not all(isinstance(m, nn.Linear) for m in projections) or torch.is_autocast_enabled(w.device.type)
            or any(b.self_attn.qk_norm for b in model.layers)  # Qwen3's q/k norms: the forward decodes
            or any(p.dtype != torch.float32 for p in model.parameters())
            or sum(m.weight.numel() for m in projections) * 4 > FUSED_MAX_BYTES):
        return None
    def pair(w):  # compiled: by the weight's size alone
        if compiled and w.numel() < COMPILED_ONEDNN_MIN_WEIGHT:
            return w, None
        return w, onednn_packed(w, rows, min_macs=0 if compiled else None)

    layers = []
    for b in model.layers:
        a, m = b.self_attn, b.mlp
        qkv = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])  # ((H + 2 Hkv) D, C)
        bias = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]) if a.q_proj.bias is not None else None
        gate_up = torch.cat([m.gate_proj.weight, m.up_proj.weight])  # (2 I, C)
        layers.append((b.input_layernorm.weight, pair(qkv), bias, pair(a.o_proj.weight),
                       b.post_attention_layernorm.weight, pair(gate_up), pair(m.down_proj.weight)))
    return layers


def _rms_norm(x, w, width, eps):  # model.RMSNorm's fp32 forward, the same values in fewer ops
    # rsqrt(eps + sum(x^2) / width): the mean's sum and division; width, eps: 0-d fp32 tensors
    return (x * torch.addcdiv(eps, x.pow(2).sum(-1, keepdim=True), width).rsqrt_()).mul_(w)


def fused_step(model, layers, cache, tok, cos, sin, norm, bias, t):
    """One new token per row: the model's forward at T = 1 (Block, Attention, MLP, RMSNorm, apply_rope,
    decode_attention: the same arithmetic in the same order; with MKL's AVX-512 kernels bitwise the same values
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
        qkv = linear(_rms_norm(x, w_in, *norm), w_qkv[0], b_qkv, w_qkv[1])  # (n, (H + 2 Hkv) D)
        qk = qkv[:, : (H + Hkv) * D].view(n, H + Hkv, D)
        qk = torch.addcmul(qk * cos, qk.roll(D // 2, dims=-1), sin)  # apply_rope, q and k at once
        q, k, v = qk[:, :H], qk[:, H:], qkv[:, (H + Hkv) * D :].view(n, Hkv, D)
        if bias is None:  # the G rows of a prompt attend to its slots held once
            y = cache.attend(i, q[:, None], k[:, None], v[:, None])[:, 0]  # (n, H D)
        else:
            keys, values = cache.k_layers[i], cache.v_layers[i]  # (n, Hkv, S, D)
            keys[:, :, t - 1 : t], values[:, :, t - 1 : t] = k[:, :, None], v[:, :, None]  # (slices: t stays symbolic)
            y = decode_attention(q.reshape(n, Hkv, H // Hkv, D), keys[:, :, :t], values[:, :, :t],
                                 bias[:, None, None, :t]).view(n, H * D)
        x = x + linear(y, w_o[0], None, w_o[1])
        gate_up = linear(_rms_norm(x, w_post, *norm), w_gate_up[0], None, w_gate_up[1])  # (n, 2 I)
        I = gate_up.shape[1] // 2
        x = x + linear(F.silu(gate_up[:, :I]) * gate_up[:, I:], w_down[0], None, w_down[1])
    return linear(_rms_norm(x, model.norm.weight, *norm), model.lm_head.weight)


_compiled = {}  # function -> its torch.compile wrapper, one per process: its graphs are reused across calls


def compiled(step):
    if step not in _compiled:
        # dynamic=None: a size seen to change compiles once more, symbolic (fused_step's are marked so from the start)
        _compiled[step] = torch.compile(step)
    return _compiled[step]


class Decoder:
    """One decode step and the buffers it works on: a KVCache of N rows x S slots and the key mask keys (N, S).
    static=False: the model's forward over the slots filled so far, or fused_step where fuse() gave it its weights
    (then the key mask is an additive one, bias). compile: the step (fused_step or decode_step) through
    torch.compile. With cuda_graph the first call captures the static step (on copies of its inputs) and later
    calls replay it."""

    def __init__(self, cfg, N, S, device, dtype, static, compile, cuda_graph, cache=None):
        self.cache = KVCache(cfg, N, S, device, dtype) if cache is None else cache
        # a SharedPromptCache (given) masks the prompts' padding itself and needs no key mask
        self.keys = torch.zeros(N, S, dtype=torch.bool, device=device) if cache is None else None
        self.step = compiled(decode_step) if compile and static else decode_step
        self.static, self.compile, self.cuda_graph, self.graph = static, compile, cuda_graph, None
        self.layers = self.bias = None

    def fuse(self, model, layers, rope):
        """Decode with fused_step from now on: fused_layers' weights, rope = (cos, sin) (positions, 1, D), and
        RMSNorm's width and eps as 0-d fp32 tensors made once (a Python number becomes one at every call)."""
        self.layers, self.rope = layers, rope
        self.fused = compiled(fused_step) if self.compile else fused_step
        self.norm = tuple(torch.tensor(float(v), dtype=torch.float32, device=rope[0].device)
                          for v in (model.config.hidden_size, model.config.rms_norm_eps))
        if self.keys is not None:  # the key mask, additive: 0 where a row attends
            self.bias = torch.zeros(self.keys.shape, dtype=torch.float32, device=self.keys.device).masked_fill_(
                ~self.keys, float("-inf"))
            self.keys = None

    def open(self, slot: int):  # from now on every row attends to this slot
        if self.keys is not None:
            self.keys[:, slot] = True
        if self.bias is not None:
            self.bias[:, slot] = 0.0

    def keep(self, rows):  # rows (n,) long: keep these rows of the cache and the key mask, in this order
        self.cache.keep_rows(rows)
        if self.keys is not None:
            self.keys = self.keys[rows]
        if self.bias is not None:
            self.bias = self.bias[rows]

    def __call__(self, model, tok, pos, slot):  # -> logits (N, V)
        if self.layers is not None:  # writes slot cache.length (== slot), attends to slots [:slot + 1]
            p, t = pos[:, 0], self.cache.length + 1
            rows = tok[:, 0], self.rope[0][p], self.rope[1][p]
            with _symbolic(rows, self.bias, self.cache) if self.compile else nullcontext():
                logits = self.fused(model, self.layers, self.cache, *rows, self.norm, self.bias, t)
            self.cache.length = t
            return logits
        if not self.static:  # the same, through the model's forward
            return model(tok, cache=self.cache, input_pos=pos, attn_mask=self.keys, last_only=True)[:, -1]
        if not self.cuda_graph:
            return self.step(model, self.cache, tok, pos, slot, self.keys)
        if self.graph is None:
            self.inputs = (tok.clone(), pos.clone(), slot.clone())
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up (and compile) off the capture; it writes only this step's slot
                for _ in range(2):
                    self.step(model, self.cache, *self.inputs, self.keys)
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self.step(model, self.cache, *self.inputs, self.keys)
        for static, new in zip(self.inputs, (tok, pos, slot)):
            static.copy_(new)
        self.graph.replay()
        return self.logits


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


_graphed = {}  # (model, N, S, dtype) -> Decoder: captured CUDA graphs, reused across calls (one entry, the last)


def decoder(model, N, S, device, dtype, static, compile, cuda_graph) -> Decoder:
    if not cuda_graph:
        return Decoder(model.config, N, S, device, dtype, static, compile, False)
    key = (id(model), N, S, device, dtype, compile)
    found = _graphed.get(key)
    if found is None or found[0]() is not model:  # (an id can be reused once its model is gone)
        _graphed.clear()  # the graph holds its cache: keep one
        found = _graphed[key] = (weakref.ref(model), Decoder(model.config, N, S, device, dtype, True, compile, True))
    return found[1]


def kept_order(done):
    """done (n,) bool -> the rows not done (m,) long, in the order that moves the fewest: each stays in its place
    but the last ones, which fill the places of finished rows before them (the caches move rows in place)."""
    live = (~done).nonzero()[:, 0]  # (m,) ascending
    keep = torch.arange(len(live), device=done.device)
    keep[done[: len(live)]] = live[live >= len(live)]  # as many finished places before m as live rows after it
    return keep


def _generate(model, prompts, max_new_tokens, G, temperature, top_p, top_k, eos_ids, pad_id, generator, noise,
              static, compile, cuda_graph, shared_prompt, layers):
    cfg, weight = model.config, model.embed_tokens.weight  # (unsharded here) the device and compute dtype
    device, dtype = weight.device, weight.dtype
    if torch.is_autocast_enabled(device.type):  # bf16 compute over fp32 weights: the cache holds what it computes
        dtype = torch.get_autocast_dtype(device.type)
    P, bucket = len(prompts), SLOT_BUCKET if static else 1
    N, S = P * G, -(-(max(map(len, prompts)) + max_new_tokens) // bucket) * bucket  # rows, cache slots
    # left-pad to L = S - max_new_tokens: every prompt ends at slot L - 1, so step t writes slot L + t in every row
    L = S - max_new_tokens
    tokens = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompts], device=device)  # (P, L)
    real = torch.tensor([[False] * (L - len(p)) + [True] * len(p) for p in prompts], device=device)
    pos = (real.cumsum(1) - 1).clamp(min=0)  # (P, L) RoPE positions: each prompt starts at 0

    # prefill each prompt once, then copy its cache rows to its G samples
    prefill = KVCache(cfg, P, L, device, dtype)
    logits = model(tokens, cache=prefill, input_pos=pos, attn_mask=real, last_only=True)[:, -1]  # (P, V)
    if shared_prompt and G > 1 and not static and not compile:  # the G rows of a prompt attend to its slots once
        shared = SharedPromptCache(prefill, real, G, max_new_tokens)
        dec = Decoder(cfg, N, S, device, dtype, False, False, False, shared)
    else:  # or to their own copies of them
        dec = decoder(model, N, S, device, dtype, static, compile, cuda_graph)
        dec.cache.k[..., :L, :].unflatten(1, (P, G)).copy_(prefill.k.unsqueeze(2))  # (layers, P, G, Hkv, L, D)
        dec.cache.v[..., :L, :].unflatten(1, (P, G)).copy_(prefill.v.unsqueeze(2))
        dec.cache.length = L  # (static: unused)
        dec.keys.zero_()[:, :L] = real.repeat_interleave(G, 0)  # (N, S): the prompts' real slots; decode slots follow
    del prefill
    pos = pos[:, -1:].repeat_interleave(G, 0) + 1  # (N, 1) position of the first new token
    if layers is not None:  # RoPE's tables for every position a new token can take: (positions, 1, D) each
        at = torch.arange(int(pos.max()) + max_new_tokens, device=device)[:, None]
        dec.fuse(model, layers, [x[:, 0] for x in rope_cos_sin(model.inv_freq, at, dtype)])
    slot = torch.tensor([L], device=device)  # (1,) the cache slot of the first new token
    logits = logits.repeat_interleave(G, 0)  # (N, V)

    eos = torch.tensor(list(eos_ids), dtype=torch.long, device=device)
    out = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros(N, max_new_tokens, device=device)
    rows, n = slice(None), N  # the n rows still decoding: all (a slice), then (n,) long once rows are dropped
    done = torch.zeros(N, dtype=torch.bool, device=device)  # (n,) of those, the ones past their stop token
    for t in range(max_new_tokens):
        u = None  # (n, 1) uniforms
        if noise is not None:
            u = noise[rows, t : t + 1]
        elif temperature > 0:  # drawn for all N rows, so dropping rows does not change the others' draws
            u = torch.rand(N, 1, generator=generator, device=device)[rows]
        tok, out_logp = sample(logits, temperature, top_k, top_p, generator, u)
        out[rows, t], logprobs[rows, t] = tok, out_logp
        done |= torch.isin(tok, eos)
        n_done = int(done.sum()) if t < max_new_tokens - 1 else n  # the step's one host sync
        if n_done == n:
            break
        if not static and n_done >= max(n // DROP_EVERY, 1):  # drop the finished rows
            keep = kept_order(done)
            dec.keep(keep)
            rows = keep if isinstance(rows, slice) else rows[keep]
            done, tok, pos, logits, n = done[keep], tok[keep], pos[keep], logits[keep], len(keep)
        dec.open(L + t)  # from now on every row attends to the slot this token is written to
        logits = dec(model, tok.unsqueeze(1), pos + t, slot + t)

    out, logprobs = out[:, : t + 1], logprobs[:, : t + 1]
    is_eos = torch.isin(out, eos)
    mask = is_eos.cumsum(1) - is_eos.long() == 0  # (N, T) True through the first EOS
    return Generation(tokens=out.masked_fill(~mask, pad_id), mask=mask, logprobs=logprobs.masked_fill(~mask, 0.0),
                      truncated=~is_eos.any(1))
