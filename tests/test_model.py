"""model.py against Hugging Face's own Llama/Qwen2 implementations, on tiny random checkpoints."""

import copy
import json
import os
import string
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import fast
import model as M
from hf import char_tokenizer, load_model, load_tokenizer, save_model
from model import ModelConfig, Transformer, preset_config
from packing import packed_attention

SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)  # short original context: all three frequency bands occur
CASES = {  # name: (HF class, config class, config overrides)
    "llama-gqa-llama3rope-untied": (LlamaForCausalLM, LlamaConfig,
                                    dict(num_key_value_heads=2, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)),
    "llama-mha-tied-headdim": (LlamaForCausalLM, LlamaConfig,
                               dict(num_key_value_heads=4, tie_word_embeddings=True, head_dim=16)),
    "qwen2-gqa-tied-bias": (Qwen2ForCausalLM, Qwen2Config,
                            dict(num_key_value_heads=1, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen2-gqa-untied-bias": (Qwen2ForCausalLM, Qwen2Config, dict(num_key_value_heads=2)),
    # Qwen3: per-head q/k RMSNorm; head_dim 16 with 4 heads over hidden 32, wider than hidden / heads (as Qwen3-0.6B)
    "qwen3-gqa-tied-headdim": (Qwen3ForCausalLM, Qwen3Config,
                               dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True, rope_theta=1e6)),
    "qwen3-gqa1-untied": (Qwen3ForCausalLM, Qwen3Config, dict(num_key_value_heads=1)),
}


def randomize(model, seed=0):
    """Every parameter random (biases and norm gains too), O(1) logits: nothing passes by being zero or one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (p.dim() == 1))
    return model


def hf_model(case, seed=0):
    cls, cfg_cls, kw = CASES[case]
    return randomize(cls(cfg_cls(**SIZES, **kw)).eval(), seed)


def tokens(B=3, T=20, seed=0):
    return torch.randint(0, SIZES["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf_both_directions(case, tmp_path):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    x = tokens()
    with torch.no_grad():
        ref = hf(x).logits
        assert (ours(x) - ref).abs().max() <= 1e-4
        # reverse: our writer, HF's reader
        save_model(ours, tmp_path / "ours")
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
        assert type(back) is type(hf)
        assert (back(x).logits - ref).abs().max() <= 1e-4
    assert ours.config.tie_word_embeddings == (ours.lm_head.weight is ours.embed_tokens.weight)


@pytest.mark.parametrize("case", CASES)
def test_cached_decode_matches_hf_full_forward(case, tmp_path):
    """A prefill into the KV cache, then one token per call (the decode path: its own attention on the CPU) against
    HF's forward over the whole sequence; row 1 left-padded by 3 slots, masked as the sampler masks them."""
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    ours, x = load_model(tmp_path), tokens(2, 16)
    real = torch.ones(2, 19, dtype=torch.bool)
    real[1, :3] = False
    slots = torch.cat([torch.zeros(2, 3, dtype=torch.long), x], 1)  # (2, 19): row 0 has 3 real tokens more
    slots[0, :3] = tokens(1, 3, seed=5)
    pos = (real.cumsum(1) - 1).clamp(min=0)
    cache = M.KVCache(ours.config, 2, 19)
    with torch.no_grad():
        want = [hf(slots[:1]).logits[0], hf(x[1:]).logits[0]]  # (19, V), (16, V)
        got = [ours(slots[:, :8], cache=cache, input_pos=pos[:, :8], attn_mask=real[:, :8])]
        for t in range(8, 19):
            got.append(ours(slots[:, t : t + 1], cache=cache, input_pos=pos[:, t : t + 1], attn_mask=real[:, : t + 1]))
        got = torch.cat(got, 1)  # (2, 19, V)
    assert (got[0] - want[0]).abs().max() <= 1e-4
    assert (got[1, 3:] - want[1]).abs().max() <= 1e-4


def test_padded_rows_and_positions_match_unpadded(tmp_path):
    hf_model("qwen2-gqa-untied-bias").save_pretrained(tmp_path)
    ours, x = load_model(tmp_path), tokens(2, 12)
    real = torch.ones(2, 15, dtype=torch.bool)
    real[1, :3] = False  # row 1 left-padded by 3
    padded = torch.cat([torch.zeros(2, 3, dtype=torch.long), x], 1)
    padded[0, :3] = x[0, :3]
    pos = (real.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = ours(padded, input_pos=pos, attn_mask=real)
        assert (out[1, 3:] - ours(x[1:])[0]).abs().max() <= 1e-4
        assert out.isfinite().all()  # padding queries attend to themselves, no NaN


def test_shared_prompt_rows_match_each_sequence_alone(tmp_path):
    """Packed rows with a shared prompt (segments=packing.packed_attention(...): attention segment by segment)
    against HF's forward of each whole sequence alone: a prompt held once with three continuations, one of them in
    the other row, and a sequence of its own. GQA with q/k/v biases."""
    hf = hf_model("qwen2-gqa-untied-bias")
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    t = tokens(1, 24, seed=3)[0].tolist()
    prompt, a, b, c, d = t[:5], t[5:8], t[8:13], t[13:20], t[20:22]  # prompt: 4 shared tokens + its last
    row0 = prompt[:4] + [prompt[4]] + a + [prompt[4]] + b + [0, 0]  # ids 0 (prompt), 4 (a), 8 (b); padding
    row1 = c + [prompt[4]] + d + [0] * 6  # ids 16 (c alone), 23 (d, whose prompt is in row 0); padding
    seg = [[0] * 4 + [4] * 4 + [8] * 6 + [-1] * 2, [16] * 7 + [23] * 3 + [-1] * 6]
    pre = [[0] * 14 + [-1] * 2, [16] * 7 + [0] * 3 + [-1] * 6]
    pos = [[0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7, 8, 9, 0, 0], [0, 1, 2, 3, 4, 5, 6, 4, 5, 6] + [0] * 6]
    T = lambda x: torch.tensor(x)
    with torch.no_grad():
        out = ours(T([row0, row1]), input_pos=T(pos), segments=packed_attention(T(seg), T(pre)))  # (2, 16, V)
        alone = lambda x: hf(T([x])).logits[0]
        want = [(out[0, :8], alone(prompt + a)), (out[0, 8:14], alone(prompt + b)[4:]), (out[1, :7], alone(c)),
                (out[1, 7:10], alone(prompt + d)[4:])]
        for got, ref in want:
            assert (got - ref).abs().max() <= 1e-4
        assert out.isfinite().all()  # padding positions too


def test_both_config_layouts(tmp_path):
    hf = hf_model("llama-gqa-llama3rope-untied")
    hf.save_pretrained(tmp_path)
    new = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in new  # transformers 5 wrote its own layout
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "dtype")}
    rope = dict(new["rope_parameters"])
    old |= {"rope_theta": rope.pop("rope_theta"), "torch_dtype": "float32",
            "rope_scaling": {"type": rope.pop("rope_type")} | rope}  # hub layout, with the old "type" key
    assert ModelConfig.from_hf(old) == ModelConfig.from_hf(new)
    (tmp_path / "config.json").write_text(json.dumps(old))
    x = tokens()
    with torch.no_grad():
        assert (load_model(tmp_path)(x) - hf(x).logits).abs().max() <= 1e-4
    cfg = ModelConfig.from_hf(new)
    assert cfg.rope_theta == 500000.0 and cfg.rope_scaling["rope_type"] == "llama3"
    assert ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_sharded_checkpoint(tmp_path):
    hf = hf_model("qwen2-gqa-tied-bias")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists() and len(list(tmp_path.glob("*.safetensors"))) > 2
    x = tokens()
    with torch.no_grad():
        assert (load_model(tmp_path)(x) - hf(x).logits).abs().max() <= 1e-4


def test_bf16_load_keeps_fp32_rope(tmp_path):
    hf_model("llama-gqa-llama3rope-untied").save_pretrained(tmp_path)
    m = load_model(tmp_path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in m.parameters()) and m.inv_freq.dtype == torch.float32
    with torch.no_grad():
        diff = (m(tokens()) - load_model(tmp_path)(tokens())).abs().max()
    assert diff < 0.5  # bf16 rounding, not garbage


def test_bad_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such model directory"):
        load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    hf_model("llama-mha-tied-headdim").save_pretrained(tmp_path / "ok")
    cfg = json.loads((tmp_path / "ok" / "config.json").read_text())
    weights = (tmp_path / "ok" / "model.safetensors").read_bytes()

    def variant(name, config=cfg, data=weights):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        if data is not None:
            (tmp_path / name / "model.safetensors").write_bytes(data)
        return tmp_path / name

    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(variant("noweights", data=None))
    with pytest.raises(ValueError, match="model_type 'gpt2' is not supported"):
        load_model(variant("gpt2", cfg | {"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="has shape"):
        load_model(variant("shape", cfg | {"intermediate_size": 40}))
    with pytest.raises(ValueError, match="missing .*layers.2"):
        load_model(variant("layers", cfg | {"num_hidden_layers": 3}))
    with pytest.raises(ValueError, match="missing .*lm_head"):  # an untied config needs its own lm_head
        load_model(variant("untied", cfg | {"tie_word_embeddings": False, "model_type": "llama"}))
    with pytest.raises(ValueError, match="truncated or corrupt"):
        load_model(variant("truncated", data=weights[: len(weights) // 2]))
    with pytest.raises(ValueError, match="rope_scaling .* not supported"):
        load_model(variant("yarn", cfg | {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logp_matches_plain_log_softmax(temperature, monkeypatch):
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="qwen2", **SIZES, num_key_value_heads=2)
    ref, ours = Transformer(cfg), Transformer(cfg)
    ours.load_state_dict(randomize(ref).state_dict())
    x, y = tokens(3, 17, seed=1), tokens(3, 17, seed=2)
    monkeypatch.setattr(M, "LOGITS_CHUNK", 5 * SIZES["vocab_size"])  # 5 (row, position) pairs per chunk: 11
    monkeypatch.setattr(M, "MIN_CHUNK_TOKENS", 1)  # chunks, most of them across a row boundary
    logp, entropy = ours(x, targets=y, temperature=temperature)
    full = (ref(x) / temperature).log_softmax(-1)  # (B, T, V)
    want = full.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    assert (logp - want).abs().max() <= 1e-5
    assert (entropy - -(full.exp() * full).sum(-1)).abs().max() <= 1e-4 and not entropy.requires_grad
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(3))
    (logp * w).sum().backward()
    (want * w).sum().backward()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_logp_at_target_positions_matches_the_full_log_softmax():
    torch.manual_seed(0)
    cfg = ModelConfig(model_type="llama", **SIZES, num_key_value_heads=2)
    ref, ours = Transformer(cfg), Transformer(cfg)
    ours.load_state_dict(randomize(ref).state_dict())
    x, y = tokens(3, 17, seed=1), tokens(3, 17, seed=2)
    pos = torch.tensor([[4, 5, 6, 7], [0, 1, 2, 16], [9, 9, 9, 9]])  # (3, 4): ragged rows repeat a clamped position
    logp, entropy = ours(x, targets=y, target_pos=pos + 17 * torch.arange(3)[:, None])  # flat indices
    full = ref(x).log_softmax(-1)  # (B, T, V)
    want = full.gather(-1, y.unsqueeze(-1)).squeeze(-1).gather(1, pos)  # (3, 4)
    assert logp.shape == entropy.shape == (3, 4) and (logp - want).abs().max() <= 1e-5
    assert (entropy - -(full.exp() * full).sum(-1).gather(1, pos)).abs().max() <= 1e-4
    w = torch.randn(logp.shape, generator=torch.Generator().manual_seed(3))
    (logp * w).sum().backward()
    (want * w).sum().backward()
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_presets():
    with torch.device("meta"):
        sizes = {name: sum(p.numel() for p in Transformer(preset_config(name, 99)).parameters()) for name in M.PRESETS}
    assert 0.2e6 < sizes["demo"] < 0.3e6 and 0.5e6 < sizes["tiny"] < 2e6 and 23e6 < sizes["25m"] < 27e6
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("huge", 99)


def test_char_tokenizer_saves_and_loads(tmp_path):
    tok = char_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "Q: 12+7=?\n  A:  <think>19</think>\t é"
    save_model(Transformer(preset_config("tiny", len(tok))), tmp_path, tokenizer=tok)  # one ordinary HF dir
    for t in (tok, AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(tmp_path)):
        ids = t(text)["input_ids"]
        assert len(ids) == len(text) and ids.count(tok.unk_token_id) == 2  # tab and é are not in the vocab
        assert t.decode(t("a  b\n c")["input_ids"]) == "a  b\n c"
        assert t.decode(ids[:5] + [tok.eos_token_id], skip_special_tokens=True) == text[:5]


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=string.printable.replace("\t", "").replace("\r", "").replace("\x0b", "").replace("\x0c", "")))
def test_char_tokenizer_round_trip(text):
    tok = _TOK
    assert tok.decode(tok(text)["input_ids"]) == text


_TOK = char_tokenizer()


@pytest.mark.parametrize("shape, bias, needs", [((3, 50, 480), True, "xwb"), ((70, 480), False, "xw"),
                                                ((2, 90, 480), True, "x"), ((50, 480), False, "w"),
                                                ((1, 2, 48), False, "xw")])  # the last below ONEDNN_MIN_MACS
def test_linear_matches_fp64_reference(shape, bias, needs, monkeypatch):
    """fast.linear (oneDNN on an x86 CPU, on whichever CPU this runs) against F.linear in float64: the output and
    each gradient asked for (the frozen-weight case is LoRA's base, the frozen-input case a first layer's)."""
    monkeypatch.setattr(fast, "ONEDNN", fast.ONEDNN_AVAILABLE)
    g = torch.Generator().manual_seed(len(shape) + shape[-2])
    x = torch.randn(*shape, generator=g).requires_grad_("x" in needs)
    w = (torch.randn(96, shape[-1], generator=g) * 0.05).requires_grad_("w" in needs)
    b = torch.randn(96, generator=g).requires_grad_("b" in needs) if bias else None
    leaves = [t for t in (x, w, b) if t is not None and t.requires_grad]
    y = fast.linear(x, w, b)
    rows = x.numel() // shape[-1]
    if fast.ONEDNN and x.numel() * len(w) >= fast.ONEDNN_MIN_MACS:  # the oneDNN path is the one under test here
        assert type(y.grad_fn).__name__ == "_OneDNNLinearBackward"
    gy = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, leaves, gy)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    want = torch.autograd.grad(ref, leaves, gy.double())
    assert y.dtype == torch.float32 and (y - ref).abs().max() < 1e-5
    for a, r in zip(got, want):
        assert a.dtype == torch.float32 and a.shape == r.shape and (a - r).abs().max() < 1e-4 * max(1, rows / 10)
    with torch.no_grad():
        assert (fast.linear(x, w, b) - ref).abs().max() < 1e-5  # the no-grad call (decode, eval)
        packed = fast.onednn_packed(w.detach(), rows)  # the sampler's weights in oneDNN's own layout
        assert (packed is not None) == (fast.ONEDNN and x.numel() * len(w) >= fast.ONEDNN_MIN_MACS)
        if packed is not None:  # the same kernel without its per-call reorder of w: the same bits
            assert torch.equal(fast.linear(x, w, b, packed), fast.linear(x, w, b))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast keeps its bf16 matmul
        assert fast.linear(x, w, b).dtype == torch.bfloat16


@pytest.mark.skipif(not fast.ONEDNN_AVAILABLE, reason="oneDNN's linear needs an x86 CPU and torch's mkldnn")
def test_use_onednn_swaps_every_projection(monkeypatch):
    """fast.use_onednn(model): every nn.Linear (LoRA's A and B too) and a LoRA layer's base product run through
    fast.linear, in place, the parameters, names and the tied embedding kept; the logits and gradients those of
    the plain model (aten's kernel) to fp32 rounding."""
    from lora import add_lora

    monkeypatch.setattr(fast, "ONEDNN", True)
    monkeypatch.setattr(fast, "ONEDNN_MIN_MACS", 0)  # every product, however small
    torch.manual_seed(0)
    plain = add_lora(Transformer(preset_config("demo", 40)), 4, 8.0, targets=("q_proj", "v_proj"))
    model = fast.use_onednn(copy.deepcopy(plain))
    assert model.lm_head.weight is model.embed_tokens.weight and model.state_dict().keys() == plain.state_dict().keys()
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is fast.OneDNNLinear for m in linears)
    assert model.layers[0].self_attn.q_proj.linear is fast.linear and model.layers[0].self_attn.k_proj in linears
    x = torch.randint(0, 40, (3, 17), generator=torch.Generator().manual_seed(1))
    (a, _), (b, _) = (m(x, targets=x.roll(-1, 1)) for m in (model, plain))
    assert (a - b).abs().max() <= 1e-5
    ga = torch.autograd.grad(a.sum(), [p for p in model.parameters() if p.requires_grad])
    gb = torch.autograd.grad(b.sum(), [p for p in plain.parameters() if p.requires_grad])
    assert all((u - v).abs().max() <= 1e-5 for u, v in zip(ga, gb))
    calls = []
    monkeypatch.setattr(fast, "_onednn", lambda *args: calls.append(1) or F.linear(*args))
    model(x)
    assert len(calls) == 1 + 2 * (7 + 2 * 2)  # lm_head; per layer 7 projections, LoRA's A and B on 2 of them


@pytest.mark.parametrize("order", ["ascending", "sampler", "shuffled"])
def test_keep_rows_in_place_equals_a_gather(order):
    """KVCache / SharedPromptCache.keep_rows move the kept rows into the buffer's first rows in place (no new
    cache-sized tensor): against index_select on a copy, for the sampler's order (few rows move), the plain
    ascending one (most move, sources overlapping destinations) and a shuffle."""
    import sampler

    cfg = ModelConfig(vocab_size=20, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=3, intermediate_size=40)
    g = torch.Generator().manual_seed(0)
    done = torch.rand(16, generator=g) < 0.4  # (16,) rows that finished, some in the first places
    live = (~done).nonzero()[:, 0]
    rows = {"ascending": live, "sampler": sampler.kept_order(done),
            "shuffled": live[torch.randperm(len(live), generator=g)]}[order]
    assert sorted(rows.tolist()) == live.tolist()
    if order == "sampler":  # each live row that can stay does: only the finished places are refilled
        stay = live[live < len(live)]
        assert torch.equal(rows[stay], stay) and (rows != torch.arange(len(rows))).sum() == done[: len(live)].sum()
    cache = M.KVCache(cfg, 16, 12)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    cache.length = 9  # slots [9, 12) are unwritten: nothing needs them
    want_k, want_v = cache.k.index_select(1, rows)[..., :9, :], cache.v.index_select(1, rows)[..., :9, :]
    ptr = cache.k.data_ptr()
    cache.keep_rows(rows)
    assert cache.k.data_ptr() == ptr and cache.k.shape[1] == len(rows)  # the same buffer, its first rows
    assert torch.equal(cache.k[..., :9, :], want_k) and torch.equal(cache.v[..., :9, :], want_v)
    assert all(torch.equal(a, b) for a, b in zip(cache.k_layers, cache.k.unbind(0)))


def test_cpu_vendor_reads_cpuinfo(monkeypatch):
    amd = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n"
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel\t\t: 167\n"
    assert fast.cpu_vendor(amd) == "AuthenticAMD" and fast.cpu_vendor(intel) == "GenuineIntel"
    # without /proc/cpuinfo's line, platform.processor() decides (Windows names the vendor; macOS says "i386")
    monkeypatch.setattr(fast.platform, "processor", lambda: "AMD64 Family 25 Model 1 Stepping 1, AuthenticAMD")
    assert fast.cpu_vendor("") == "AuthenticAMD"
    monkeypatch.setattr(fast.platform, "processor", lambda: "i386")
    assert fast.cpu_vendor("") == ""


@pytest.mark.skipif(not fast.ONEDNN_AVAILABLE, reason="oneDNN's linear needs an x86 CPU and torch's mkldnn")
def test_onednn_only_where_the_cpu_runs_avx512():
    """Where the CPU's kernels stop at AVX2 (here forced, as on most laptops) aten keeps the projections (oneDNN
    is no faster there: docs/speed.md), and so on an Intel CPU (MKL is the faster one there); by default oneDNN runs
    them only on an AMD CPU with AVX-512. MINIGRPO_ONEDNN=1 turns it on anyway, =0 off everywhere."""
    import subprocess
    import sys

    def onednn(**env):
        code = "import fast, torch; print(fast.ONEDNN, torch.backends.cpu.get_cpu_capability())"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                             cwd=Path(M.__file__).parent,
                             env={k: v for k, v in {**os.environ, **env}.items() if v is not None}).stdout.split()
        return out[0] == "True", out[1]

    assert onednn(ATEN_CPU_CAPABILITY="avx2", MINIGRPO_ONEDNN="") == (False, "AVX2")
    assert onednn(ATEN_CPU_CAPABILITY="avx2", MINIGRPO_ONEDNN="1") == (True, "AVX2")
    assert onednn(MINIGRPO_ONEDNN="0")[0] is False
    on, cap = onednn(MINIGRPO_ONEDNN=None, ATEN_CPU_CAPABILITY=None)
    amd = "AuthenticAMD" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else None
    if amd is not None:  # this machine's default: on only for an AMD CPU with AVX-512
        assert on == (amd and cap.startswith("AVX512")), (on, cap, amd)
    bad = subprocess.run([sys.executable, "-c", "import fast"], capture_output=True, text=True,
                         cwd=Path(M.__file__).parent, env={**os.environ, "MINIGRPO_ONEDNN": "yes"})
    assert bad.returncode != 0 and "MINIGRPO_ONEDNN='yes': use 1" in bad.stderr
