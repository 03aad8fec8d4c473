"""Real-tokenizer behaviour, on fixtures built here with the `tokenizers` library that act like Llama-3.x-Instruct (a
post-processor adds <|begin_of_text|>, the chat template writes it too, <|eot_id|> and <|end_of_text|> both stop),
an R1 distill (its chat template opens <think>) and Qwen2.5-Instruct (no BOS, <|im_end|> and <|endoftext|> stop,
pad = <|endoftext|>): exactly one BOS per prompt in every stage, generation stops on every stop id."""

import json
import string

import pytest
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, processors
from transformers import PreTrainedTokenizerFast

import data
import eval as eval_lib
import grpo
import rewards
import sft
from hf import load_model, load_tokenizer, save_model, stop_and_pad_ids
from model import Transformer, preset_config

LLAMA_CHAT = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{{ m['content'] }}<|eot_id|>{% endfor %}"
              "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
R1_CHAT = LLAMA_CHAT.replace("<|end_header_id|>\n\n{% endif %}", "<|end_header_id|>\n\n<think>\n{% endif %}")
QWEN_CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
             "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHARS = ["\n"] + [c for c in string.printable if 32 <= ord(c) < 127]
# name -> specials, tokenizer kwargs, chat template, config.json / generation_config.json extras (by token name)
KINDS = {
    "llama": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
              dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>"), LLAMA_CHAT,
              {"bos_token_id": "<|begin_of_text|>", "eos_token_id": "<|end_of_text|>"},
              {"eos_token_id": ["<|end_of_text|>", "<|eot_id|>"]}),
    "qwen": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
             dict(eos_token="<|im_end|>", pad_token="<|endoftext|>"), QWEN_CHAT,
             {"eos_token_id": "<|im_end|>"}, {"eos_token_id": ["<|im_end|>", "<|endoftext|>"]}),
}
KINDS["r1"] = KINDS["llama"][:2] + (R1_CHAT,) + KINDS["llama"][3:]
STOPS = {"llama": ["<|eot_id|>", "<|end_of_text|>"], "r1": ["<|eot_id|>", "<|end_of_text|>"],
         "qwen": ["<|im_end|>", "<|endoftext|>"]}


def _tokenizer(kind) -> PreTrainedTokenizerFast:
    specials, kw, template = KINDS[kind][:3]
    vocab = {c: i for i, c in enumerate(["<unk>"] + CHARS)}
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))  # one token per character
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.decoder = decoders.Fuse()
    if "bos_token" in kw:  # Llama 3: encode() prepends <|begin_of_text|>
        bos = kw["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", chat_template=template,
                                   clean_up_tokenization_spaces=False, **kw)


def _model_dir(kind, path):
    """An HF dir with the fixture tokenizer, a random 1-layer model, config.json and generation_config.json."""
    tok = _tokenizer(kind)
    cfg_extra, gen_extra = KINDS[kind][3:]
    ids = lambda v: [tok.convert_tokens_to_ids(t) for t in v] if isinstance(v, list) else tok.convert_tokens_to_ids(v)
    cfg = preset_config("tiny", len(tok), hidden_size=128, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False,
                        **{k: ids(v) for k, v in cfg_extra.items()})  # fmt: skip
    torch.manual_seed(0)
    save_model(Transformer(cfg), path, tok)
    (path / "generation_config.json").write_text(json.dumps({k: ids(v) for k, v in gen_extra.items()}))
    return path


@pytest.fixture(scope="module", params=list(KINDS))
def model_dir(request, tmp_path_factory):
    return request.param, _model_dir(request.param, tmp_path_factory.mktemp(request.param))


QUESTION = "What is 2+3?"


def test_one_bos_per_prompt(model_dir):
    kind, path = model_dir
    tok = load_tokenizer(path)
    bos = tok.bos_token_id
    for template in ("chat", "r1"):
        text, _ = data.format_prompt(QUESTION, template, tok)
        ids = data.encode_prompt(tok, text, template)
        assert tok.decode(ids, skip_special_tokens=False).count("<|begin_of_text|>") == (kind != "qwen")
        if bos is not None:
            assert ids[0] == bos and ids.count(bos) == 1, (template, ids[:3])
    if kind != "qwen":  # the fixture really reproduces the bug the helper avoids: encode() adds a second BOS
        text, _ = data.format_prompt(QUESTION, "chat", tok)
        assert tok.encode(text)[:2] == [bos, bos]


def test_stop_and_pad_ids(model_dir):
    kind, path = model_dir
    tok = load_tokenizer(path)
    stops, pad = stop_and_pad_ids(tok, load_model(path).config)
    assert stops == tok.convert_tokens_to_ids(STOPS[kind])  # the tokenizer's EOS first: SFT targets end with it
    assert pad == tok.convert_tokens_to_ids("<|endoftext|>" if kind == "qwen" else "<|eot_id|>")
    # the union travels with the model: a saved copy (an SFT output has no generation_config.json) keeps it
    save_model(load_model(path), path.parent / f"{kind}_copy", tok)
    assert stop_and_pad_ids(tok, load_model(path.parent / f"{kind}_copy").config)[0] == stops


def _successor_model(path, succ: dict[int, int]) -> Transformer:
    """The model at `path` rewired so that its greedy next token is succ[current token] (0 if none): attention and
    MLP outputs are zeroed, so the last hidden state is the current token's one-hot embedding."""
    model = load_model(path)
    V, C = model.config.vocab_size, model.config.hidden_size
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.embed_tokens.weight[:, :V] = torch.eye(V)
        model.norm.weight.fill_(1.0)
        for layer in model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        for cur, nxt in succ.items():
            model.lm_head.weight[nxt, cur] = 10.0
    assert C >= V
    return model


def test_generation_stops_on_every_stop_id(model_dir):
    """Through eval.evaluate (the stages' stop rule): every prompt ends in "\\n", the rewired model then emits "A",
    then the token under test, then "\\n" "A" ... again. A stop id ends the completion after 2 tokens; a special token
    that is not a stop id does not."""
    kind, path = model_dir
    tok = load_tokenizer(path)
    nl, a = tok.convert_tokens_to_ids(["\n", "A"])
    rows = [{"question": QUESTION, "answer": "5"}]
    non_stop = "<|start_header_id|>" if kind != "qwen" else "<|im_start|>"
    for name in STOPS[kind] + [non_stop]:
        s = tok.convert_tokens_to_ids(name)
        model = _successor_model(path, {nl: a, a: s, s: nl})
        _, records = eval_lib.evaluate(model, tok, rows, template="chat", max_new_tokens=12)
        if name == non_stop:
            assert records[0]["num_tokens"] == 12 and records[0]["truncated"], name
        else:
            assert records[0]["num_tokens"] == 2 and not records[0]["truncated"], name


def test_r1_prefix_with_chat_template(model_dir):
    """An R1 distill's template opens <think> itself: the response prefix is "<think>", the SFT target goes on from
    there, and prefix + completion is a well-formed response. Other chat templates leave <think> to the model."""
    kind, path = model_dir
    tok = load_tokenizer(path)
    text, prefix = data.format_prompt(QUESTION, "chat", tok)
    assert prefix == ("<think>" if kind == "r1" else "")
    target = data.sft_target({"solution": "2+3=5", "answer": "5"}, prefix)
    assert (prefix + target).startswith("<think>2+3=5</think>")
    assert rewards.reward(prefix + target, "5")["correct"] == 1
    assert rewards.reward(prefix + target, "5")["format"] == 1


def test_stages_encode_with_the_helpers(model_dir, tmp_path, monkeypatch):
    """sft.py and grpo.py prompts carry one BOS; SFT targets end with the tokenizer's EOS; the sampler gets the
    union of stop ids and the documented pad id."""
    kind, path = model_dir
    tok = load_tokenizer(path)
    stops = tok.convert_tokens_to_ids(STOPS[kind])
    seen = {"sft": [], "grpo": []}
    real_build, real_generate = sft.build_example, grpo.generate

    def build(prompt_ids, target_ids, eos_id):
        seen["sft"].append((prompt_ids, eos_id))
        return real_build(prompt_ids, target_ids, eos_id)

    def generate(model, prompts, *args, **kw):
        seen["grpo"].append((prompts, kw["eos_ids"], kw["pad_id"]))
        return real_generate(model, prompts, *args, **kw)

    monkeypatch.setattr(sft, "build_example", build)
    monkeypatch.setattr(grpo, "generate", generate)
    common = ["--init", str(path), "--template", "chat", "--steps", "1", "--eval_every", "0"]
    sft.main(common + ["--out_dir", str(tmp_path / "sft"), "--split", "train[:8]", "--global_batch", "4",
                       "--micro_batch", "4", "--stop_pass1", "0", "--eval_split", "test[:2]"])  # fmt: skip
    grpo.main(common + ["--out_dir", str(tmp_path / "grpo"), "--split", "train[:8]", "--eval_split", "test[:2]",
                        "--prompts_per_step", "2", "--group_size", "2", "--max_new_tokens", "4"])  # fmt: skip
    bos = tok.bos_token_id
    prompts = [p for p, _ in seen["sft"]] + [p for ps, _, _ in seen["grpo"] for p in ps]
    assert len(prompts) == 8 + 2
    for p in prompts:
        assert (p.count(bos), p[0]) == (1, bos) if bos is not None else "<|begin_of_text|>" not in tok.decode(p)
    assert {eos for _, eos in seen["sft"]} == {stops[0]}
    pad = tok.convert_tokens_to_ids("<|endoftext|>" if kind == "qwen" else "<|eot_id|>")
    assert {(tuple(e), p) for _, e, p in seen["grpo"]} == {(tuple(stops), pad)}
