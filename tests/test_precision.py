"""Mixed precision: --dtype bfloat16 computes in bf16 over fp32 master weights and AdamW state, so small updates are
kept; --weights_dtype bfloat16 (bf16 storage) loses them. CPU autocast bf16 stands in for a GPU's."""

import json

import pytest
import torch
from safetensors.torch import load_file

import common
import grpo
import sft
from hf import char_tokenizer, load_model, save_model
from lora import add_lora, lora_layers
from model import Transformer, preset_config

# 20 AdamW steps at lr 1e-6: each weight moves ~2e-5, far above fp32's resolution at 0.02 (~2e-9) and far below
# bf16's (~1e-4; 0.008 at the norms' 1.0)
SFT = ["--task", "arith", "--split", "train[:64]", "--global_batch", "8", "--micro_batch", "8", "--steps", "20",
       "--lr", "1e-6", "--warmup", "0", "--min_lr_ratio", "1", "--weight_decay", "0", "--eval_every", "0",
       "--stop_pass1", "0"]  # fmt: skip


@pytest.fixture(scope="module")
def init_dir(tmp_path_factory):
    tok = char_tokenizer()
    # tied embeddings: every row gets a gradient through the head (an untied row of an unused char would not move)
    cfg = preset_config("tiny", len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("init")
    save_model(Transformer(cfg), path, tok)
    return path


def _weights(path) -> dict:
    """The stored tensors of an HF dir, in the dtype they were saved in."""
    return load_file(path / "model.safetensors")


def _changed(before: dict, after: dict) -> float:
    """Fraction of all weights whose stored value changed (compared in the trained model's dtype)."""
    changed = sum((before[k].to(b.dtype) != b).sum().item() for k, b in after.items())
    return changed / sum(b.numel() for b in after.values())


def _sft(init_dir, out, *flags):
    sft.main(["--init", str(init_dir), "--out_dir", str(out), *SFT, *flags])
    losses = [json.loads(line)["loss"] for line in open(out / "metrics.jsonl")]
    return _weights(out / "model"), losses


def test_bf16_compute_keeps_small_updates_bf16_storage_loses_them(init_dir, tmp_path):
    init = _weights(init_dir)
    fp32, fp32_loss = _sft(init_dir, tmp_path / "fp32")
    mixed, mixed_loss = _sft(init_dir, tmp_path / "mixed", "--dtype", "bfloat16")
    stored, _ = _sft(init_dir, tmp_path / "stored", "--dtype", "bfloat16", "--weights_dtype", "bfloat16")
    # fp32 master weights: saved as fp32, and (nearly) every weight moved, as with fp32 compute
    assert {v.dtype for v in mixed.values()} == {torch.float32}
    assert _changed(init, fp32) >= 0.99
    assert _changed(init, mixed) >= 0.99
    # the bf16 run really computed in bf16 (its loss differs from fp32's), and stayed close to it
    assert mixed_loss[0] != fp32_loss[0]
    assert mixed_loss[0] == pytest.approx(fp32_loss[0], rel=1e-2)
    # bf16 storage: the same updates round away in most weights
    assert {v.dtype for v in stored.values()} == {torch.bfloat16}
    assert _changed(init, stored) < 0.5
    print(f"weights changed by 20 steps at lr 1e-6: fp32 {_changed(init, fp32):.2%}, bf16 compute (fp32 master) "
          f"{_changed(init, mixed):.2%}, bf16 storage {_changed(init, stored):.2%}")


def test_bf16_weights_need_bf16_compute(init_dir, tmp_path):
    with pytest.raises(SystemExit, match="--weights_dtype bfloat16 needs --dtype bfloat16"):
        sft.main(["--init", str(init_dir), "--out_dir", str(tmp_path), "--weights_dtype", "bfloat16"])


def test_autocast_context():
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with common.autocast(model, "bfloat16"):
        assert model(x).dtype == torch.bfloat16
    with common.autocast(model, "float32"):
        assert model(x).dtype == torch.float32


def test_model_keeps_logits_and_norm_statistics_fp32_under_autocast(init_dir):
    model = load_model(init_dir)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12))
    with common.autocast(model, "bfloat16"):
        logits = model(tokens)
        logp, ent = model(tokens, targets=tokens)
        norm_in = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    assert logits.dtype == logp.dtype == ent.dtype == torch.float32
    want = model(tokens)  # fp32 compute
    assert (logits - want).abs().max() < 0.05 * want.abs().max()  # bf16 matmuls: close, not equal
    assert not torch.equal(logits, want)
    ref = model.layers[0].input_layernorm(norm_in.float())
    assert (model.layers[0].input_layernorm(norm_in).float() - ref).abs().max() < 1e-2


def _final_hidden(model, tokens, **kw):
    """model(tokens, **kw) and the final norm's output (B, T, C), the LM head's input, as it was computed."""
    seen = []
    hook = model.norm.register_forward_hook(lambda m, args, out: seen.append(out.detach()))
    out = model(tokens, **kw)
    hook.remove()
    return out, seen[0]


@pytest.mark.parametrize("mode", ["autocast", "bf16 weights"])
def test_lm_head_and_log_softmax_run_in_fp32(init_dir, mode):
    """#48 item 4: the logits are an fp32 product of the head's input as the model computed it (fp32 under autocast,
    bf16 with bf16 weights, as FSDP2's MixedPrecisionPolicy gathers them) and the head's weight, never a bf16 one
    rounded to bf16 (a step of 0.125 at logits of 16-32); the log-probs are their fp32 log-softmax. common.autocast
    says so in its docstring."""
    model = load_model(init_dir)
    if mode == "bf16 weights":
        model = model.to(torch.bfloat16)
    ctx = lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode == "autocast")
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), ctx():
        logits, h = _final_hidden(model, tokens)
        (logp, _), h2 = _final_hidden(model, tokens, targets=tokens)
    w = model.lm_head.weight
    want = torch.nn.functional.linear(h.float(), w.float())  # fp32, outside autocast
    bf16 = torch.nn.functional.linear(h.bfloat16(), w.bfloat16()).float()  # what a bf16 head computes
    assert logits.dtype == logp.dtype == torch.float32
    assert torch.equal(logits, want)
    assert not torch.equal(logits, bf16)
    assert not torch.equal(logits, logits.bfloat16().float())  # not rounded to bf16 on the way
    z = torch.nn.functional.linear(h2.flatten(0, 1).float(), w.float())  # (B T, V)
    want_logp = (z.gather(-1, tokens.flatten()[:, None])[:, 0] - z.logsumexp(-1)).view(2, 12)
    assert torch.equal(logp, want_logp)
    assert "keeps logits, log-softmax and RMSNorm statistics in fp32" in " ".join(common.autocast.__doc__.split())


def test_bf16_head_without_grad_is_cast_a_slice_at_a_time(init_dir, monkeypatch):
    """Sampling and the reference (no gradients): a bf16 head's fp32 copy is made a few vocabulary rows at a time,
    not whole; the logits are the whole fp32 product's, to fp32 rounding (a GEMM's blocking depends on its
    shape), far from a bf16 product's."""
    import model as M

    model = load_model(init_dir).to(torch.bfloat16)
    C = model.config.hidden_size
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    sizes = []
    real = torch.nn.functional.linear
    monkeypatch.setattr(M.F, "linear", lambda x, w, b=None: sizes.append(w.shape[0]) or real(x, w, b))
    monkeypatch.setattr(M, "HEAD_COPY_BYTES", 4 * C * 7)  # 7 rows of the vocabulary a slice
    with torch.no_grad():
        logits, h = _final_hidden(model, tokens)
    with torch.no_grad():
        want = real(h.float(), model.lm_head.weight.float())
        bf16 = real(h, model.lm_head.weight).float()
    assert (logits - want).abs().max() <= 1e-6 * want.abs().max() < (bf16 - want).abs().max()
    n = -(-model.config.vocab_size // 7)
    head = sizes[-n:]  # the head's calls: the model's last
    assert max(head) == 7 and sum(head) == model.config.vocab_size


GRPO = ["--steps", "1", "--prompts_per_step", "4", "--group_size", "4", "--gen_batch", "4", "--max_new_tokens", "16",
        "--reward_weights", "overlong=1", "--eval_every", "0", "--lr", "1e-3", "--warmup", "1"]  # fmt: skip


def test_grpo_bf16_logprob_gap(init_dir, tmp_path, capsys):
    """The sampler and the trainer both compute under the same autocast: their log-probs of the sampled tokens agree
    to bf16 accuracy (not to fp32's, as the KV-cache decode and the full forward round differently)."""
    gaps = {}
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / dtype
        grpo.main(["--init", str(init_dir), "--out_dir", str(out), "--dtype", dtype, *GRPO])
        rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
        gaps[dtype] = rows[0]["logprob_gap"]
        assert rows[0]["grad_norm"] > 0
        assert {v.dtype for v in _weights(out / "step_000001").values()} == {torch.float32}
    with capsys.disabled():
        print(f"\nlogprob_gap (mean |sampler - trainer| per token): fp32 {gaps['float32']:.2e}, "
              f"bf16 {gaps['bfloat16']:.2e}")
    assert gaps["float32"] < 1e-4
    assert 0 < gaps["bfloat16"] < 0.05


def _to_copies_of(weights, fn) -> int:
    """How many times fn() casts (aten._to_copy) one of `weights` (by storage)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ptrs = {w.untyped_storage().data_ptr() for w in weights}
    n = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].untyped_storage().data_ptr() in ptrs:
                n[0] += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return n[0]


def test_reference_holds_bf16_projections_and_computes_the_same(init_dir):
    """#48 item 5: at --dtype bfloat16 (one device, DDP) GRPO's KL reference stores its blocks' projections in
    bf16 (autocast cast them at every call: it caches only the casts of weights that train) and computes the same
    log-probs, bitwise, as an fp32 copy under torch.autocast; embeddings and norms stay fp32."""
    cfg = common.parse_config(grpo.GRPOConfig, ["--init", str(init_dir), "--beta", "0.1", "--dtype", "bfloat16"])
    _, ref, _ = grpo.build_models(cfg, common.Dist())
    dtypes = {n: p.dtype for n, p in ref.named_parameters()}
    assert dtypes["layers.0.self_attn.q_proj.weight"] == dtypes["layers.1.mlp.down_proj.weight"] == torch.bfloat16
    assert dtypes["embed_tokens.weight"] == dtypes["layers.0.input_layernorm.weight"] == torch.float32
    fp32 = load_model(init_dir)  # the reference as it was: fp32, cast by autocast at each call
    tokens = torch.randint(3, fp32.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = fp32(tokens, targets=tokens)
    projections = [p for n, p in ref.named_parameters() if n.endswith("proj.weight")]
    got = []
    with torch.no_grad(), common.autocast(ref, "bfloat16"):
        assert _to_copies_of(projections, lambda: got.append(ref(tokens, targets=tokens)[0])) == 0  # no casts
    assert torch.equal(got[0], want)
    cfg32 = common.parse_config(grpo.GRPOConfig, ["--init", str(init_dir), "--beta", "0.1"])
    assert {p.dtype for p in grpo.build_models(cfg32, common.Dist())[1].parameters()} == {torch.float32}


def test_lora_base_is_cast_once_per_autocast_context(init_dir):
    """#48 item 5: under common.autocast an fp32 LoRA base is cast to bf16 once for the context (lora.base_cast),
    not at every forward (torch.autocast alone casts a frozen weight at each call: 3 forwards, 3 casts each), with
    the same outputs, bitwise; the stored base stays fp32. With a bf16 base there is nothing to cast."""
    model = add_lora(load_model(init_dir), 2, 4.0)
    with torch.no_grad():
        for m in lora_layers(model).values():
            m.lora_B.weight.normal_(generator=torch.Generator().manual_seed(1))  # adapters that change the output
    base = [m.weight for m in lora_layers(model).values()]
    tokens = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))

    def three_forwards(ctx):
        with torch.no_grad(), ctx:
            return [model(tokens) for _ in range(3)]

    plain = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    assert _to_copies_of(base, lambda: three_forwards(plain())) == 3 * len(base)  # the count, as it was
    assert _to_copies_of(base, lambda: three_forwards(common.autocast(model, "bfloat16"))) == len(base)
    want, got = three_forwards(plain()), three_forwards(common.autocast(model, "bfloat16"))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert {w.dtype for w in base} == {torch.float32} and all(m.cast is None for m in lora_layers(model).values())
    x = tokens[:, :5]
    with common.autocast(model, "bfloat16"):  # with gradients too: autograd keeps the cast copy it used
        model(x, targets=x)[0].sum().backward()
    assert all(m.lora_B.weight.grad is not None for m in lora_layers(model).values())
