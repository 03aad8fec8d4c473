"""Fitting at real scale (#18): per-block activation checkpointing, logit chunk sizes, token-budget micro-batches.

References are independent of the code under test: the same model without checkpointing, one unsplit batch, a
plain (unwrapped) model for the FSDP2 run, and autograd's own record of the tensors it saves for backward."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grpo
import model as M
import packing
import sft
from lora import LORA_TARGETS, add_lora
from memory import (
    block_activation_bytes,
    lora_activation_bytes,
    lora_param_count,
    memory_estimate,
    memory_shapes,
    param_count,
)

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


def _saved_bytes(fn, exclude=frozenset()):
    """Bytes autograd keeps for backward while fn runs (distinct storages, those in `exclude` aside), as its
    saved-tensor hooks see them; and fn's result."""
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in exclude:
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
# free what holds the gloo group while the interpreter is whole (left to shutdown, gloo can abort the process)
del sharded, ref, p, q
import gc; gc.collect()
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


# -----------------------------------------------------------------------------
# micro-batches by a token budget


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 60), max_size=30), st.integers(0, 6), st.integers(0, 150))
def test_micro_batches_partition_within_budgets(lengths, max_rows, max_tokens):
    groups = packing.micro_batches(lengths, max_rows, max_tokens)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))  # every row exactly once
    longest = [max(lengths[i] for i in g) for g in groups]
    assert longest == sorted(longest, reverse=True)  # grouped by length, longest first
    for g in groups:
        assert g == sorted(g)  # a micro-batch keeps the rows' order
        assert max_rows == 0 or len(g) <= max_rows
        assert max_tokens == 0 or len(g) == 1 or len(g) * max(lengths[i] for i in g) <= max_tokens


def test_micro_batches_group_similar_lengths():
    # two long and two short rows, interleaved: paired by length, not by position (padding 2 tokens, not 88)
    assert packing.micro_batches([5, 50, 6, 49], max_rows=2) == [[1, 3], [0, 2]]
    assert packing.micro_batches([5, 50, 6, 49], max_rows=0, max_tokens=100) == [[1, 3], [0, 2]]
    assert packing.micro_batches([5, 50, 6, 49], max_rows=0, max_tokens=0) == [[0, 1, 2, 3]]
    assert packing.micro_batches([500, 6], max_rows=8, max_tokens=100) == [[0], [1]]  # a long row goes alone


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_sft_token_budget_same_loss_and_grads_as_one_batch():
    """SFT examples of mixed lengths, accumulated over token-budget micro-batches (sft.py's loop), against one
    unsplit forward/backward whose loss is written out from full log-softmax logits."""
    gen = torch.Generator().manual_seed(0)
    examples = []
    for n_prompt, n_target in [(3, 9), (12, 2), (5, 5), (2, 20), (7, 1), (9, 8)]:
        ids = torch.randint(3, 61, (n_prompt + n_target,), generator=gen).tolist()
        examples.append(sft.build_example(ids[:n_prompt], ids[n_prompt:], eos_id=2))
    model = _model()
    groups = packing.micro_batches([len(x) - 1 for x, _ in examples], max_rows=0, max_tokens=30)
    assert len(groups) >= 3
    total = 0.0
    for g in groups:
        inputs, targets = sft.collate([examples[i] for i in g], pad_id=0)
        loss = sft.sft_loss(model, inputs, targets)
        loss.backward()
        total += loss.item()
    split = _grads(model)
    model.zero_grad()
    inputs, targets = sft.collate(examples, pad_id=0)  # (6, 22): one batch, padded to the longest
    logp = model(inputs).log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    want = -(logp * (targets != -100)).sum()
    want.backward()
    assert abs(total - want.item()) <= 1e-5 * abs(want.item())
    for a, b in zip(split, _grads(model)):
        assert (a - b).abs().max() <= 1e-5


class _RecordingOptimizer:
    """Stands in for AdamW in grpo.update: keeps the gradients it was asked to apply."""

    def __init__(self, model):
        self.model, self.grads = model, None

    def step(self):
        self.grads = _grads(self.model)

    def zero_grad(self, set_to_none=True):
        self.model.zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize("grouped", [False, True])
def test_grpo_update_token_budget_same_grads_as_one_batch(tmp_path, grouped):
    """grpo.update over token-budget micro-batches (rows of mixed prompt and completion lengths) gives the gradient
    of one unsplit batch: with one update the surrogate's gradient is -A * grad log p per counted token, written
    out here from full log-softmax logits. grouped: rows of one prompt, as GRPO's groups, which --share_prompt
    packs holding their prompt once (3 prompts of 3, 3 and 2 rows, one prompt a single token)."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 61, (n,), generator=gen).tolist() for n in (4, 11, 6, 3, 9, 5)]
    n_comp = [7, 2, 12, 5, 1, 2]
    adv = [0.5, -1.0, 0.25, 0.0, 1.5, -0.75]  # row 3: advantage 0, skipped
    if grouped:
        prompts = [prompts[0]] * 3 + [prompts[1]] * 3 + [[7]] * 2
        n_comp, adv = [7, 2, 12, 5, 1, 9, 3, 4], [0.5, -1.0, 0.25, 1.0, 0.0, 1.5, -0.75, 2.0]
    N, Tc = len(prompts), max(n_comp)
    comp = torch.randint(3, 61, (N, Tc), generator=gen)
    mask = torch.arange(Tc)[None, :] < torch.tensor(n_comp)[:, None]  # (N, Tc)
    adv = torch.tensor(adv)[:, None]
    w = mask.float() / mask.sum()  # dapo-like token weights
    batch = packing.training_batch(prompts, comp, n_comp, pad_id=0)
    seq_len = [len(p) - 1 + n for p, n in zip(prompts, n_comp)]
    trained = [i for i in range(N) if adv[i] != 0]
    if not grouped:  # seq_len 10, 12, 17, 7, 9, 6: the 5 rows that train packed into 4 rows of 17 tokens:
        # [17], [12], [10, 6], [9]
        assert packing.micro_batch(*batch, trained, seq_len, True)["tokens"].shape == (4, 17)
        # --share_prompt with no prompt shared: still one row of them all (54 < 4 x 17 tokens), attended segment by
        # segment (packing.packed_attention), not through a dense mask over the whole row
        mb = packing.micro_batch(*batch, trained, seq_len, True, share=True)
        assert mb["tokens"].shape == (1, 54) and isinstance(mb["segments"], packing.Packed)
    else:  # seq_len 10, 5, 15, 15, (11), 19, 3, 4; shared, all in one row: [3 + 7 + 2 + 12 = 24, 10 + 5 + 9 = 24,
        # 3, 4] (the single-token prompt shares nothing)
        mb = packing.micro_batch(*batch, trained, seq_len, True, share=True)
        assert mb["tokens"].shape == (1, 55) and isinstance(mb["segments"], packing.Packed)
    grads = []
    # one batch, padded or packed (--pack: sequences share rows; --share_prompt: a group's rows their prompt);
    # token budgets (and a row cap) splitting it
    for rows, tokens, pack, share in [(0, 0, False, False), (0, 0, True, False), (0, 0, True, True),
                                      (0, 25, True, True), (2, 18, True, True), (3, 40, True, True)]:
        cfg = grpo.GRPOConfig(train_micro_batch=rows, micro_batch_tokens=tokens, pack=pack, share_prompt=share,
                              grad_clip=1e9, out_dir=str(tmp_path))
        model = _model()
        opt = _RecordingOptimizer(model)
        grpo.update(model, None, opt, batch, seq_len, adv, mask.float(), w, None, torch.zeros(N, Tc), cfg, 1)
        grads.append(opt.grads)
    model = _model()
    inputs, targets, pos, _ = batch
    logp = model(inputs).log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0].gather(1, pos)
    (-(w * adv * logp).sum()).backward()
    for got in grads:
        for a, b in zip(got, _grads(model)):
            assert (a - b).abs().max() <= 1e-6


# -----------------------------------------------------------------------------
# the memory estimate


MHA = dict(num_attention_heads=8, num_key_value_heads=8, hidden_size=64, intermediate_size=160)


@pytest.mark.parametrize("kw", [dict(num_attention_heads=4, num_key_value_heads=2), MHA])
def test_estimate_counts_what_autograd_saves(kw):
    """memory_estimate's parts against the real thing: the parameter count of the built model, and the bytes autograd
    keeps for backward in one block (fp32; GQA and MHA): a 3-block model's saved bytes minus a 2-block one's."""
    cfg = M.ModelConfig(**{**CFG, **kw})
    model = _model(**kw)
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())
    x = torch.randint(0, 61, (3, 40), generator=torch.Generator().manual_seed(1))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    three, _ = _saved_bytes(lambda: model(x), exclude=params)
    model.layers = model.layers[:2]
    two, _ = _saved_bytes(lambda: model(x), exclude=params)
    want = block_activation_bytes(cfg, 3 * 40, 4)
    assert abs((three - two) - want) <= 0.02 * want, (three - two, want)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_estimate_counts_what_autograd_saves(dropout):
    """The LoRA terms against the real thing: add_lora's adapter count, and one adapted block's saved bytes (fp32;
    exact without dropout, an upper bound within 35% with it)."""
    cfg = M.ModelConfig(**CFG)
    targets = ("q_proj", "v_proj", "o_proj", "down_proj") if dropout else LORA_TARGETS
    x = torch.randint(0, 61, (3, 40), generator=torch.Generator().manual_seed(1))
    saved = []
    for layers in (3, 2):
        model = _model()
        model.layers = model.layers[:layers]
        add_lora(model, 4, 8.0, dropout, targets)
        if layers == 3:
            adapters = sum(p.numel() for p in model.parameters() if p.requires_grad)
            assert lora_param_count(cfg, 4, targets) == adapters
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved.append(_saved_bytes(lambda m=model: m(x), exclude=params)[0])
    got = saved[0] - saved[1]
    want = block_activation_bytes(cfg, 120, 4) + lora_activation_bytes(cfg, 120, 4, 4, targets, dropout)
    if dropout:
        assert got <= want <= 1.35 * got, (got, want)
    else:
        assert abs(got - want) <= 0.02 * want, (got, want)


def test_lora_estimate_trains_only_the_adapters():
    cfg = M.ModelConfig(**{**CFG, "vocab_size": 128_256, "hidden_size": 3072, "intermediate_size": 8192,
                           "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8,
                           "tie_word_embeddings": True})  # Llama-3.2-3B's shape
    base = dict(rows=16, seq=700, max_rows=2, gen_rows=32, gen_prompts=4, prompt_len=200, new_tokens=512,
                cpu=False, compute_bytes=2)  # the README's 3B LoRA recipe
    full = memory_estimate(cfg, **base, reference=True)
    lora = memory_estimate(cfg, **base, lora_rank=16, base_bytes=2)
    p = lora_param_count(cfg, 16)
    assert 24e6 < p < 25e6  # rank 16 on all seven projections of the 3B
    assert lora["weights"] == 2 * param_count(cfg) + 4 * p
    assert lora["gradients"] == 4 * p and lora["optimizer"] == 8 * p and lora["reference"] == 0
    assert full["peak"] > 60e9 > 20e9 > lora["peak"]  # full: + fp32 master weights, gradients, AdamW, reference


def test_estimate_scales_with_the_flags():
    cfg = M.ModelConfig(**{**CFG, "vocab_size": 151_936, "hidden_size": 896, "intermediate_size": 4864,
                           "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                           "tie_word_embeddings": True})
    base = dict(rows=64, seq=700, gen_rows=128, gen_prompts=8, prompt_len=200, new_tokens=500, cpu=False)
    one = memory_estimate(cfg, **base)
    assert one["weights"] == 4 * param_count(cfg) and one["optimizer"] == 2 * one["weights"]
    ckpt = memory_estimate(cfg, **base, activation_checkpointing=True)
    assert ckpt["activations"] < one["activations"] / 5 and ckpt["activations_other"] == one["activations"]
    budget = memory_estimate(cfg, **base, max_tokens=8 * 700)  # 8 rows per micro-batch instead of 64
    assert budget["activations"] < one["activations"] / 6
    fsdp = memory_estimate(cfg, **base, world_size=8, dist="fsdp")
    assert fsdp["optimizer"] == one["optimizer"] / 8 and fsdp["peak"] < one["peak"]
    assert one["kv_cache"] == 2 * 24 * 2 * 64 * 4 * (128 * 700 + 8 * 200)  # layers x (k, v) x heads x dim x fp32


def test_dry_run_prints_the_estimate_and_writes_nothing(tiny_dir, tmp_path, capsys):
    out = tmp_path / "run"
    grpo.main(["--init", str(tiny_dir), "--dry_run", "--out_dir", str(out)])
    sft.main(["--dry_run", "--out_dir", str(out)])
    printed = capsys.readouterr().out
    assert printed.count("memory estimate per rank:") == 2 and not out.exists()


def test_vllm_rollouts_take_no_sampler_kv_cache():
    # with --rollout vllm the sampler never runs (rollouts and evals go through the engine): no KV cache term,
    # whatever --gen_batch says; the sampler's is layers x (k, v) x heads x dim x fp32 x cached tokens
    cfg = M.ModelConfig(**{**CFG, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                           "hidden_size": 256})
    for rollout, kv in (("sampler", 2 * 4 * 2 * 64 * 4 * (8 * 4 * 110 + 8 * 10)), ("vllm", 0)):
        run = grpo.GRPOConfig(rollout=rollout, prompts_per_step=8, group_size=4, gen_batch=8, max_new_tokens=100,
                              eval_every=0)
        shapes = memory_shapes(run, "grpo", 1, prompt_len=10, device_type="cuda")
        assert memory_estimate(cfg, **shapes)["kv_cache"] == kv
