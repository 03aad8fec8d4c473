"""Fitting at real scale (#18): per-block activation checkpointing, logit chunk sizes, token-budget micro-batches.

References are independent of the code under test: the same model without checkpointing, one unsplit batch, a
plain (unwrapped) model for the FSDP2 run, and autograd's own record of the tensors it saves for backward."""

import os
import subprocess
import sys
from pathlib import Path

import torch

import model as M

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
CFG = dict(model_type="qwen2", vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=2)


def _model(**kw) -> M.Transformer:
    torch.manual_seed(0)
    m = M.Transformer(M.ModelConfig(**{**CFG, **kw}))
    for p in m.parameters():  # HF's init leaves norms at 1 and biases at 0: move every parameter
        p.data.add_(torch.randn_like(p) * 0.05)
    return m


def _weighted_logp(model, x, y):
    logp, _ = model(x, targets=y)
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(7))
    return (logp * w).sum()


def _saved_bytes(fn) -> int:
    """Bytes autograd keeps for backward while fn runs (distinct storages), as its saved-tensor hooks see them."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def test_activation_checkpointing_same_gradients_less_saved():
    x = torch.randint(0, 61, (3, 40), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, 61, (3, 40), generator=torch.Generator().manual_seed(2))
    plain, ckpt = _model(), _model().set_activation_checkpointing()
    kept_plain, loss_plain = _saved_bytes(lambda: _weighted_logp(plain, x, y))
    kept_ckpt, loss_ckpt = _saved_bytes(lambda: _weighted_logp(ckpt, x, y))
    loss_plain.backward()
    loss_ckpt.backward()
    assert loss_ckpt.item() == loss_plain.item()
    for (name, a), b in zip(ckpt.named_parameters(), plain.parameters()):
        assert (a.grad - b.grad).abs().max() <= 1e-6, name
    assert kept_ckpt < kept_plain / 3, (kept_ckpt, kept_plain)  # the flag really drops the blocks' activations
    with torch.no_grad():  # generation / reference passes: nothing to recompute, the same logits
        assert torch.equal(ckpt(x), plain(x))


_FSDP_WORKER = r"""
import torch, torch.distributed as dist
import common, model as M
from tests.test_memory import _model, _weighted_logp
d = common.init_dist()
x = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(10 + d.rank))
y = torch.randint(0, 61, (2, 24), generator=torch.Generator().manual_seed(20 + d.rank))
ref = _model()  # plain, unwrapped, no checkpointing: this rank's gradient, averaged over ranks by hand
_weighted_logp(ref, x, y).backward()
sharded = common.wrap_model(_model().set_activation_checkpointing(), "fsdp", d)
_weighted_logp(sharded, x, y).backward()
for (name, p), q in zip(sharded.named_parameters(), ref.parameters()):
    want = q.grad.clone()
    dist.all_reduce(want)
    err = (p.grad.full_tensor() - want / d.world_size).abs().max().item()
    assert err <= 1e-6, (name, err)
common.print0("fsdp checkpointed grads ok")
common.cleanup_dist()
"""


def test_activation_checkpointing_under_fsdp2_same_gradients():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "--no-python",
           sys.executable, "-c", _FSDP_WORKER]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "grads ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]


def test_logit_chunks_are_long_at_a_real_vocab():
    """At Qwen2.5's vocab (151,936) and a realistic batch the lm_head runs on >= 64 (row, position) pairs at a time
    (the old per-position split gave 1-token chunks at B=16), and the chunks cover every pair exactly once."""
    assert M.logits_chunk_tokens(151_936) >= 64
    m = _model(vocab_size=151_936, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=1)
    sizes = []
    m.lm_head.register_forward_hook(lambda mod, inp, out: sizes.append(inp[0].shape[0]))
    B, T = 16, 20
    x = torch.randint(0, 151_936, (B, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logp, _ = m(x, targets=x)
    assert sum(sizes) == B * T and min(sizes[:-1]) >= 64 and len(sizes) == -(-B * T // M.logits_chunk_tokens(151_936))
    with torch.no_grad():  # the chunks across row boundaries still give each pair its own log-prob
        want = m(x[3:4]).log_softmax(-1).gather(-1, x[3:4, :, None])[..., 0]
    assert (logp[3:4] - want).abs().max() <= 1e-5
