"""Batched sampling with a preallocated KV cache: G completions per prompt, each prompt prefilled once.

    out = generate(model, prompts, max_new_tokens=256, num_samples=8, temperature=1.0, eos_ids=[tok.eos_token_id],
                   generator=torch.Generator().manual_seed(0))
    out.tokens, out.mask, out.logprobs  # (N, T) each, N = len(prompts) * num_samples, row = prompt * G + sample

Prompts are left-padded so every row writes its next token to the same cache slot; per-row RoPE positions
and a key mask make the padding exactly invisible. Each row decodes with the model's forward over its own copy of
its prompt's cache slots, the slots filled so far (shapes grow by one slot a step). The decode loop does a fixed
number of tensor ops per step whatever the batch size, and one host sync ("how many rows are done?"). Finished rows
keep decoding (their tokens are masked) until they are 1/8 of the rows left; then the forward drops them (the last
rows move into their places, in the cache itself), so a batch whose rows stop early stops paying for them. Dropping
rows changes no other row's tokens or draws (each row's uniform is drawn as if all N rows decoded).
On the CPU, fast.py's paths decode instead (generate's fast=; the same tokens): a prompt's G rows attend to its
slots held once (fast.SharedPromptCache), and each step is fast.fused_step, the model's forward at one token in
about half its ops, or that step through torch.compile (grpo.py --compile).
"""

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from model import KVCache


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
             fast="auto") -> Generation:
    """Samples num_samples completions for each prompt (token id lists of any lengths). Randomness comes only
    from `generator` (on the model's device), or from `noise`: (N, max_new_tokens) uniforms in [0, 1) on the
    model's device, row i's draw at step t being noise[i, t], so a row's samples do not depend on which other
    rows share its batch. Works on a plain, DDP-wrapped or FSDP2-sharded model, and computes in the caller's
    precision: under common.autocast (torch.autocast) the KV cache takes the autocast dtype.
    fast: how each token is decoded. "off": the model's forward. "auto": the device's default, DEFAULTS ("shared+fused"
    on the CPU, "off" elsewhere; docs/speed.md, "Decoding speed", says how it was chosen). "shared", "fused",
    "shared+fused", "compile": fast.py's paths (fast.decoder says what each does). Every mode samples the same
    tokens; log-probs agree to float rounding."""
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
    if fast not in FAST_MODES:
        raise ValueError(f"fast={fast!r}: use one of {', '.join(map(repr, FAST_MODES))}")
    mode = DEFAULTS.get(device.type, "off") if fast == "auto" else fast
    with gathered(model):
        return _generate(model, prompts, max_new_tokens, num_samples, temperature, top_p, top_k, eos_ids, pad_id,
                         generator, noise, mode)


FAST_MODES = ("auto", "off", "shared", "fused", "shared+fused", "compile")
# device type -> generate(fast="auto")'s mode: chosen by measurement (docs/speed.md, "Decoding speed"). CUDA: not
# measured yet, so off there too
DEFAULTS = {"cpu": "shared+fused", "cuda": "off"}
DROP_EVERY = 8  # the forward drops the finished rows once they are 1/8 of the rows left


class Decoder:
    """One decode step, the model's forward, and the buffers it works on: a KVCache with keys (n, S) bool, the slots
    each row attends to, or a cache that masks itself (fast.SharedPromptCache) with keys None."""

    def __init__(self, cache, keys):
        self.cache, self.keys = cache, keys

    def open(self, slot: int):  # from now on every row attends to this slot
        if self.keys is not None:
            self.keys[:, slot] = True

    def keep(self, rows):  # rows (n,) long: keep these rows of the cache and the key mask, in this order
        self.cache.keep_rows(rows)
        if self.keys is not None:
            self.keys = self.keys[rows]

    def __call__(self, model, tok, pos):  # tok, pos (n, 1) long -> logits (n, V): writes slot cache.length
        return model(tok, cache=self.cache, input_pos=pos, attn_mask=self.keys, last_only=True)[:, -1]


def per_row_cache(cfg, prefill: KVCache, real, G: int, max_new_tokens: int):
    """Each of the N = P * G rows' own copy of its prompt's filled slots, prefill's (P rows, L slots), in a KVCache
    of N rows and S = L + max_new_tokens slots; and keys (N, S) bool, the prompts' real slots (real (P, L)), the
    decode slots to be opened as they are written."""
    (P, L), S = real.shape, real.shape[1] + max_new_tokens
    cache = KVCache(cfg, P * G, S, real.device, prefill.k.dtype)
    cache.k[..., :L, :].unflatten(1, (P, G)).copy_(prefill.k.unsqueeze(2))  # (layers, P, G, Hkv, L, D)
    cache.v[..., :L, :].unflatten(1, (P, G)).copy_(prefill.v.unsqueeze(2))
    cache.length = L
    keys = torch.zeros(P * G, S, dtype=torch.bool, device=real.device)
    keys[:, :L] = real.repeat_interleave(G, 0)
    return cache, keys


def kept_order(done):
    """done (n,) bool -> the rows not done (m,) long, in the order that moves the fewest: each stays in its place
    but the last ones, which fill the places of finished rows before them (the caches move rows in place)."""
    live = (~done).nonzero()[:, 0]  # (m,) ascending
    keep = torch.arange(len(live), device=done.device)
    keep[done[: len(live)]] = live[live >= len(live)]  # as many finished places before m as live rows after it
    return keep


def _generate(model, prompts, max_new_tokens, G, temperature, top_p, top_k, eos_ids, pad_id, generator, noise,
              mode):
    cfg, weight = model.config, model.embed_tokens.weight  # (unsharded here) the device and compute dtype
    device, dtype = weight.device, weight.dtype
    if torch.is_autocast_enabled(device.type):  # bf16 compute over fp32 weights: the cache holds what it computes
        dtype = torch.get_autocast_dtype(device.type)
    P, N = len(prompts), len(prompts) * G
    # left-pad to L: every prompt ends at slot L - 1, so step t writes slot L + t in every row
    L = max(map(len, prompts))
    tokens = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompts], device=device)  # (P, L)
    real = torch.tensor([[False] * (L - len(p)) + [True] * len(p) for p in prompts], device=device)
    pos = (real.cumsum(1) - 1).clamp(min=0)  # (P, L) RoPE positions: each prompt starts at 0

    # prefill each prompt once; then its G samples attend to its slots: copies of them, or (fast) held once
    prefill = KVCache(cfg, P, L, device, dtype)
    logits = model(tokens, cache=prefill, input_pos=pos, attn_mask=real, last_only=True)[:, -1]  # (P, V)
    pos = pos[:, -1:].repeat_interleave(G, 0) + 1  # (N, 1) position of the first new token
    if mode == "off":
        dec = Decoder(*per_row_cache(cfg, prefill, real, G, max_new_tokens))
    else:
        import fast  # the CPU speed paths: imported only where they are asked for

        dec = fast.decoder(model, prefill, real, G, max_new_tokens, pos, mode)
    del prefill
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
        if n_done >= max(n // DROP_EVERY, 1):  # drop the finished rows
            keep = kept_order(done)
            dec.keep(keep)
            rows = keep if isinstance(rows, slice) else rows[keep]
            done, tok, pos, logits, n = done[keep], tok[keep], pos[keep], logits[keep], len(keep)
        dec.open(L + t)  # from now on every row attends to the slot this token is written to
        logits = dec(model, tok.unsqueeze(1), pos + t)

    out, logprobs = out[:, : t + 1], logprobs[:, : t + 1]
    is_eos = torch.isin(out, eos)
    mask = is_eos.cumsum(1) - is_eos.long() == 0  # (N, T) True through the first EOS
    return Generation(tokens=out.masked_fill(~mask, pad_id), mask=mask, logprobs=logprobs.masked_fill(~mask, 0.0),
                      truncated=~is_eos.any(1))
