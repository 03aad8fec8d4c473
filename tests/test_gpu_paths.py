"""The CUDA-only branches of the forward, probed on the CPU (#48): which arguments SDPA gets on CUDA, what the
memory estimate counts for them, and the per-step peak memory."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import common
import grpo
import model as M
import sft
from memory import block_activation_bytes, format_memory, lora_param_count, memory_estimate
from packing import packed_attention
from tests.test_memory import ENV, ROOT, _saved_bytes

BF16, FP32 = torch.bfloat16, torch.float32
CFG = dict(model_type="qwen2", vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2)


def _model(**kw) -> M.Transformer:
    torch.manual_seed(0)
    m = M.Transformer(M.ModelConfig(**{**CFG, **kw}))
    for p in m.parameters():
        p.data.add_(torch.randn_like(p) * 0.05)
    return m


def test_expand_kv_rule():
    """#48 item 1, the dispatch rule: on CUDA a grouped-query call with a mask (flash takes none) or in fp32 (flash
    takes none) gets its K/V heads expanded, so the memory-efficient kernel can take it instead of the math one;
    a causal bf16 one keeps enable_gqa (flash takes it); the CPU and equal head counts are left alone."""
    assert M.expand_kv("cuda", BF16, 12, 2, masked=True)
    assert M.expand_kv("cuda", FP32, 12, 2, masked=False)
    assert not M.expand_kv("cuda", BF16, 12, 2, masked=False)
    assert not M.expand_kv("cuda", BF16, 12, 12, masked=True)
    assert not M.expand_kv("cpu", BF16, 12, 2, masked=True) and not M.expand_kv("cpu", FP32, 12, 2, masked=True)


def test_decode_sdpa_keeps_off_cudnn(monkeypatch):
    """#48 item 6, the dispatch rule: off the CPU a decode step's SDPA call (one query) runs with cuDNN's kernel
    disabled (it would build a graph per key length: a new one every step), the other kernels as they were (an
    outer sdpa_kernel's pin kept); the flags are restored after it, and prefill (several queries) is left to SDPA's own
    choice. (Meta tensors stand in for CUDA ones: SDPA computes their shapes only.)"""
    backends = torch.backends.cuda
    seen = []
    real = F.scaled_dot_product_attention

    def sdpa(*a, **k):
        seen.append((backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled(),
                     backends.math_sdp_enabled()))
        return real(*a, **k)

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    before = (backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled(),
                           backends.mem_efficient_sdp_enabled(), backends.math_sdp_enabled())
    assert before[0], "cuDNN attention is on by default (the test needs the flag it checks)"
    q, kv = torch.randn(3, 1, 4, 8, device="meta"), torch.randn(3, 2, 7, 8, device="meta")
    mask = torch.zeros(3, 1, 1, 7, device="meta")
    assert M.attention(q, kv, kv, mask).shape == (3, 1, 4, 8)
    assert M.attention(q, kv, kv, None).shape == (3, 1, 4, 8)
    assert seen == [(False, True, True, True)] * 2
    seen_flags = (backends.cudnn_sdp_enabled(), backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled(),
                  backends.math_sdp_enabled())
    assert seen_flags == before
    seen.clear()
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):  # gpu_check's pin stays
        M.attention(q, kv, kv, mask)
    assert seen == [(False, True, True, False)]
    seen.clear()
    autocast_on = torch.is_autocast_enabled  # (meta has no autocast state: off)
    monkeypatch.setattr(torch, "is_autocast_enabled", lambda *a: a[:1] != ("meta",) and autocast_on(*a))
    M.attention(torch.randn(3, 7, 4, 8, device="meta"), kv, kv, None)  # prefill: SDPA's choice, cuDNN included
    assert seen == [before]
    M.attention(torch.randn(3, 1, 4, 8), torch.randn(3, 2, 7, 8), torch.randn(3, 2, 7, 8), None)  # CPU: matmuls
    assert len(seen) == 1


def _inputs():
    """Three forwards that attend with a mask: padded rows, packed segments, packed rows sharing a prompt."""
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 61, (2, 12), generator=g)
    pad = torch.ones(2, 12, dtype=torch.bool)
    pad[1, :3] = False  # row 1 left-padded
    seg = torch.tensor([[0] * 5 + [5] * 7, [12] * 12])
    pos = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])
    # row 0: a prompt (id 0) and two continuations of it (ids 4, 8); row 1: a sequence alone
    shared = packed_attention(torch.tensor([[0] * 4 + [4] * 4 + [8] * 4, [12] * 12]),
                              torch.tensor([[0] * 12, [12] * 12]))
    spos = torch.tensor([list(range(8)) + list(range(4, 8)), list(range(12))])
    return [dict(tokens=x, attn_mask=pad), dict(tokens=x, input_pos=pos, segments=seg),
            dict(tokens=x, input_pos=spos, segments=shared)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_branch_gives_sdpa_equal_heads_where_masked(monkeypatch, dtype):
    """#48 item 1, the call: with the rule answering as on CUDA, every masked (and every fp32) SDPA call of the
    training forwards gets K/V with the query's head count and no enable_gqa; the outputs equal the enable_gqa
    ones (as the CPU computes them)."""
    model = _model()
    ctx = lambda: torch.autocast("cpu", dtype=BF16, enabled=dtype == "bfloat16")
    with torch.no_grad(), ctx():
        want = [model(**kw) for kw in _inputs()]
    calls, real_sdpa, real_rule = [], F.scaled_dot_product_attention, M.expand_kv

    def record(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False, **kw):
        calls.append((q.shape[1], k.shape[1], v.shape[1], attn_mask is not None, enable_gqa))
        return real_sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, enable_gqa=enable_gqa, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    monkeypatch.setattr(M, "expand_kv", lambda device, *a, **k: real_rule("cuda", *a, **k), raising=False)
    with torch.no_grad(), ctx():
        got = [model(**kw) for kw in _inputs()]
    masked = [c for c in calls if c[3]]
    assert len(masked) >= 3 * 2  # each forward, each layer
    for H, Hk, Hv, has_mask, gqa in calls:
        if has_mask or dtype == "float32":
            assert (Hk, Hv, gqa) == (H, H, False), calls
        else:  # causal bf16: flash attention takes GQA itself
            assert (Hk, gqa) == (2, True)
    for a, b in zip(got, want):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_estimate_counts_the_expanded_kv(monkeypatch):
    """What autograd keeps for backward in one block when K/V are expanded (the fp32 CUDA forward), against
    block_activation_bytes(expanded_kv=True): a 2-block model's saved bytes minus a 1-block one's."""
    cfg = M.ModelConfig(**CFG)
    real_rule = M.expand_kv
    monkeypatch.setattr(M, "expand_kv", lambda device, *a, **k: real_rule("cuda", *a, **k), raising=False)
    x = torch.randint(0, 61, (3, 40), generator=torch.Generator().manual_seed(1))
    saved = []
    for layers in (2, 1):
        model = _model()
        model.layers = model.layers[:layers]
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        saved.append(_saved_bytes(lambda m=model: m(x), exclude=params)[0])
    want = block_activation_bytes(cfg, 3 * 40, 4, expanded_kv=True)
    assert want > block_activation_bytes(cfg, 3 * 40, 4)
    assert abs((saved[0] - saved[1]) - want) <= 0.02 * want, (saved[0] - saved[1], want)


# -----------------------------------------------------------------------------
# #48 item 5: memory


def test_peak_memory_is_reset_at_each_step(monkeypatch, tiny_dir, tmp_path):
    """mem_peak_mb is the step's own: each SFT and GRPO step starts a new peak (on CUDA the allocator's,
    torch.cuda.reset_peak_memory_stats; mocked here), so it is neither monotone nor the loading transients'."""
    resets = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: resets.append(device))
    common.reset_peak_mem(torch.device("cuda", 0))
    common.reset_peak_mem("cpu")  # the CPU's peak is the process's: nothing to reset
    assert resets == [torch.device("cuda", 0)]
    calls = []
    for mod in (sft, grpo):
        monkeypatch.setattr(mod, "reset_peak_mem", lambda device: calls.append(device), raising=False)
    fast = ["--task", "arith", "--split", "train[:16]", "--max_new_tokens", "8", "--eval_every", "0"]
    sft.main(["--init", str(tiny_dir), "--out_dir", str(tmp_path / "sft"), *fast, "--global_batch", "2",
              "--steps", "3", "--stop_pass1", "0"])
    assert len(calls) == 3
    grpo.main(["--init", str(tiny_dir), "--out_dir", str(tmp_path / "grpo"), *fast, "--prompts_per_step", "2",
               "--group_size", "2", "--steps", "2", "--reward_weights", "overlong=1"])
    assert len(calls) == 5


def test_estimate_counts_autocasts_weight_copies():
    """Autocast over fp32 weights (one device, DDP) holds a bf16 copy of each trainable projection weight and bias
    from forward through backward and through generation; of an fp32 LoRA base for the context (lora.base_cast);
    the reference stores its projections in bf16 (common.frozen_in_compute_dtype). CFG by hand: per block q 32x32
    + 32, k and v 16x32 + 16 each, o 32x32, gate / up / down 48x32 each: 7744 values, 2 blocks, 2 bytes each."""
    cfg = M.ModelConfig(**CFG)
    shapes = dict(rows=4, seq=40, gen_rows=4, gen_prompts=2, prompt_len=10, new_tokens=30, cpu=False)
    assert 7744 == 32 * 32 + 32 + 2 * (16 * 32 + 16) + 32 * 32 + 3 * 48 * 32
    est = memory_estimate(cfg, **shapes, compute_bytes=2)
    assert est["autocast_copies"] == 7744 * 2 * 2
    model = _model()
    cast = sum(p.numel() for m in model.layers.modules() if isinstance(m, torch.nn.Linear) for p in m.parameters())
    assert est["autocast_copies"] == 2 * cast
    fp32 = memory_estimate(cfg, **shapes)
    assert fp32["autocast_copies"] == 0 and est["peak"] > 0
    assert memory_estimate(cfg, **shapes, compute_bytes=2, param_bytes=2)["autocast_copies"] == 0  # bf16 weights
    fsdp = memory_estimate(cfg, **shapes, compute_bytes=2, world_size=2, dist="fsdp")  # MixedPrecisionPolicy casts
    assert fsdp["autocast_copies"] == 0
    lora = memory_estimate(cfg, **shapes, compute_bytes=2, lora_rank=2, base_bytes=2)  # the adapters alone train
    assert lora["autocast_copies"] == 2 * lora_param_count(cfg, 2)
    lora = memory_estimate(cfg, **shapes, compute_bytes=2, lora_rank=2)  # + an fp32 base, cast once (base_cast)
    assert lora["autocast_copies"] == 2 * lora_param_count(cfg, 2) + 2 * cast
    ref = memory_estimate(cfg, **shapes, compute_bytes=2, reference=True)  # its projections held in bf16
    assert ref["reference"] == 4 * sum(p.numel() for p in model.parameters()) - 2 * cast
    assert "autocast copies" in format_memory(est)


_FSDP_LOAD_WORKER = r"""
import dataclasses, gc, sys
import torch
import torch.distributed.fsdp as fsdp
from torch.distributed.tensor import DTensor
import common, grpo
from hf import load_model

init = sys.argv[1]
d = common.init_dist()
cfg = common.parse_config(grpo.GRPOConfig, ["--init", init, "--dist", "fsdp", "--beta", "0.1"])
full = load_model(init)  # the unsharded load: the reference for every check below
n_full = sum(p.numel() for p in full.parameters())

# 1. unsharded parameters on the device whenever a fully_shard starts ("meta" stands in for the GPU: FSDP2's mesh
# is gloo's CPU, so what sits on meta was put there by the loading, not by sharding)
loaded, on_device = [], []
real_load, real_shard = grpo.load_model, fsdp.fully_shard
def load(*a, **k):
    loaded.append(real_load(*a, **k))
    return loaded[-1]
def shard(module, **k):
    on = [p for m in loaded for p in m.parameters() if p.device.type == "meta" and not isinstance(p, DTensor)]
    on_device.append(sum(p.numel() for p in on))
    return real_shard(module, **k)
grpo.load_model, fsdp.fully_shard = load, shard
grpo.build_models(cfg, dataclasses.replace(d, device=torch.device("meta")))
grpo.load_model, fsdp.fully_shard = real_load, real_shard
common.print0(f"unsharded on the device at a fully_shard: at most {max(on_device) / n_full:.2f} models")
assert max(on_device) == 0, (on_device, n_full)

# 2. sharded as loaded: the policy and the reference gather to the unsharded load, bitwise
model, ref, _ = grpo.build_models(cfg, d)
want = full.state_dict()
for m in (model, ref):
    for k, v in m.state_dict().items():
        assert torch.equal(v.full_tensor() if isinstance(v, DTensor) else v, want[k]), k

# 3. the reference's root (embeddings, head) resharded after its forward passes, the blocks' too
tokens = torch.randint(3, full.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
grpo.frozen_logprobs(model, ref, [dict(tokens=tokens, targets=tokens)], cfg)
for name, p in ref.named_parameters():
    assert isinstance(p, DTensor), f"{name} left gathered after the reference's forward"
common.print0("fsdp load ok")
common.cleanup_dist()
del model, ref, full, loaded
gc.collect()
"""


def test_fsdp2_shards_as_it_loads_and_reshards_the_reference(tiny_dir):
    """#48 item 5, on 2 gloo processes: under FSDP2 the models are read to the CPU and fully_shard moves them to
    the device a block at a time (no unsharded parameter on the device when a fully_shard starts; before, both full
    fp32 models sat there), the sharded policy and reference equal the unsharded load bitwise, and the
    reference's root is resharded after its forward passes (FSDP2 keeps a root gathered for a backward)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "--no-python",
           sys.executable, "-c", _FSDP_LOAD_WORKER, str(tiny_dir)]
    r = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0 and "fsdp load ok" in r.stdout, r.stdout[-3000:] + r.stderr[-3000:]
