"""LoRA (lora.py): the layer against a hand-written formula, adapters off == the base model bitwise, only adapters
train, the merged export against the adapted model and transformers, the adapter against peft (both directions),
and a LoRA run of sft.py / grpo.py: its checkpoints hold the adapter alone, it resumes bitwise, N ranks == 1."""

import copy
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_sft import TINY, metrics, torchrun
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import checkpoint
import eval as eval_script
import fast
import grpo
import sft
from hf import load_model, save_model
from lora import (
    ADAPTER_PREFIX,
    LORA_TARGETS,
    LoRALinear,
    adapters_off,
    add_lora,
    load_adapter,
    lora_layers,
    merge_lora,
    save_adapter,
)

ALL = LORA_TARGETS


def lora_model(path, rank=4, targets=ALL, seed=1):
    """The model in `path` with adapters whose B is random too (a fresh B = 0 would hide any mistake in B's use)."""
    model = add_lora(load_model(path), rank, alpha=2.0 * rank, targets=targets, seed=seed, base=str(path))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_layers(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
    return model


def tokens(vocab, B=2, T=12, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A random Qwen2 (q/k/v biases, GQA, untied head) saved by transformers itself."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    with torch.no_grad():
        for p in hf.parameters():  # biases and norm gains random too
            p.copy_(torch.randn(p.shape) * (0.3 if p.dim() > 1 else 0.5) + (p.dim() == 1))
    path = tmp_path_factory.mktemp("qwen")
    hf.save_pretrained(path)
    return path


@pytest.fixture(params=["llama-tied", "qwen2-bias"])
def base_dir(request, tiny_dir, qwen_dir):
    return tiny_dir if request.param == "llama-tied" else qwen_dir


# -----------------------------------------------------------------------------
# the layer


def test_layer_output_and_gradients_match_the_formula():
    torch.manual_seed(0)
    base = torch.nn.Linear(6, 5, bias=True).requires_grad_(False)
    W, b = base.weight.clone(), base.bias.clone()
    layer = LoRALinear(base, rank=3, alpha=6.0, dropout=0.0, generator=torch.Generator().manual_seed(0))
    assert torch.equal(layer.lora_B.weight, torch.zeros(5, 3))  # a fresh adapter changes nothing ...
    bound = 1 / 6**0.5
    A = layer.lora_A.weight
    assert A.abs().max() <= bound and A.std() > bound / 3  # ... and A is U(-1/sqrt(in), 1/sqrt(in))
    with torch.no_grad():
        layer.lora_B.weight.copy_(torch.randn(5, 3))
    A, B, s = layer.lora_A.weight.detach().clone(), layer.lora_B.weight.detach().clone(), 6.0 / 3
    x = torch.randn(2, 4, 6, requires_grad=True)
    y = layer(x)
    want = x.detach() @ W.T + b + s * (x.detach() @ A.T) @ B.T  # (2, 4, 5)
    assert torch.allclose(y, want, atol=1e-6)
    g = torch.randn(2, 4, 5)  # upstream gradient of L = sum(g * y)
    y.backward(g)
    xf, gf = x.detach().reshape(-1, 6), g.reshape(-1, 5)  # (8, 6), (8, 5)
    assert torch.allclose(layer.lora_B.weight.grad, s * gf.T @ (xf @ A.T), atol=1e-5)  # dL/dB = s g^T (x A^T)
    assert torch.allclose(layer.lora_A.weight.grad, s * (gf @ B).T @ xf, atol=1e-5)  # dL/dA = s (g B)^T x
    assert torch.allclose(x.grad, g @ W + s * g @ B @ A, atol=1e-5)
    assert base.weight.grad is None and base.bias.grad is None  # the base stays frozen


def test_bad_settings_are_refused(tiny_dir):
    for kw in (dict(rank=0, alpha=1.0), dict(rank=4, alpha=1.0, dropout=1.0),
               dict(rank=4, alpha=1.0, targets=("q_proj", "qproj"))):
        with pytest.raises(ValueError, match="bad LoRA settings"):
            add_lora(load_model(tiny_dir), **kw)


# -----------------------------------------------------------------------------
# the model


def test_adapters_off_is_the_base_model_exactly(base_dir):
    base = load_model(base_dir)
    model = lora_model(base_dir)
    x = tokens(base.config.vocab_size)
    with torch.no_grad():
        ref = base(x)
        assert not torch.allclose(model(x), ref, atol=1e-3)  # the adapters do something ...
        with adapters_off(model):
            assert torch.equal(model(x), ref)  # ... and switched off, the base exactly (the KL reference)
            assert torch.equal(model(x, targets=x)[0], base(x, targets=x)[0])
        assert not torch.allclose(model(x), ref, atol=1e-3)  # on again afterwards


def test_only_adapters_change_in_a_training_step(tiny_dir):
    model = add_lora(load_model(tiny_dir), 4, 8.0, dropout=0.1, seed=0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trained = [p for p in model.parameters() if p.requires_grad]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        k for k in before if ".lora_" in k} and len(trained) == 2 * 7 * 2  # 2 layers x 7 targets x (A, B)
    opt = torch.optim.AdamW(trained, lr=1e-2, weight_decay=0.1)
    x = tokens(model.config.vocab_size)
    for _ in range(2):
        (-model(x, targets=x)[0].mean()).backward()
        opt.step()
        opt.zero_grad()
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(v, after[k]) != (".lora_" in k), k  # every adapter moved, nothing else did


def test_dropout_under_activation_checkpointing_gives_the_same_gradients(tiny_dir):
    """The recompute in backward replays the forward's dropout masks (else the gradient is of another mask)."""
    plain = lora_model(tiny_dir)
    for m in lora_layers(plain).values():
        m.dropout = torch.nn.Dropout(0.5)
    plain.layers[0].draws_random = plain.layers[1].draws_random = True  # what add_lora sets for dropout > 0
    ckpt = copy.deepcopy(plain).set_activation_checkpointing(True)
    x = tokens(plain.config.vocab_size)
    grads = []
    for model in (plain, ckpt):
        torch.manual_seed(5)
        (-model(x, targets=x)[0].mean()).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    for n, g in grads[0].items():
        assert torch.allclose(g, grads[1][n], atol=1e-6), n


def test_merged_export_matches_adapted_model_and_transformers(base_dir, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    # one kernel for both sides (aten's), so 1e-5 measures the merge, not oneDNN's vs MKL's rounding
    # (fast.linear's own test checks oneDNN against a float64 reference)
    monkeypatch.setattr(fast, "ONEDNN", False)

    model = lora_model(base_dir)
    save_model(model, tmp_path / "merged")
    x = tokens(model.config.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True).eval()
    with torch.no_grad():
        want = model(x)
        assert (load_model(tmp_path / "merged")(x) - want).abs().max() <= 1e-5
        assert (hf(x).logits - want).abs().max() <= 1e-4  # transformers vs model.py: test_model.py's tolerance
    merged = merge_lora(copy.deepcopy(model))  # what eval.py --lora_merge does, in memory
    assert not lora_layers(merged)
    assert (merged(x) - want).abs().max() <= 1e-5


def test_peft_loads_our_adapter_and_we_load_peft_s(base_dir, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    model = lora_model(base_dir, targets=("q_proj", "v_proj", "down_proj"))
    save_adapter(model, tmp_path / "ours")
    names = set(load_file(tmp_path / "ours" / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in names and len(names) == 2 * 3 * 2
    x = tokens(model.config.vocab_size)
    hf = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "ours").eval()
    with torch.no_grad():
        want = model(x)
        assert (adapted(x).logits - want).abs().max() <= 1e-4  # (transformers' model: test_model.py's tolerance)
    # the other way: an adapter peft made and saved itself (random B), loaded by load_adapter
    hf = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    cfg = peft.LoraConfig(r=3, lora_alpha=5, target_modules=["k_proj", "o_proj", "up_proj"], init_lora_weights=False)
    theirs = peft.get_peft_model(hf, cfg).eval()
    theirs.save_pretrained(tmp_path / "theirs")
    loaded = load_adapter(load_model(base_dir), tmp_path / "theirs")
    with torch.no_grad():
        assert (loaded(x) - theirs(x).logits).abs().max() <= 1e-4
        assert (load_model(base_dir)(x) - theirs(x).logits).abs().max() > 1e-3  # the adapter mattered


def test_an_adapter_for_another_base_is_refused(tiny_dir, qwen_dir, tmp_path):
    save_adapter(lora_model(tiny_dir), tmp_path / "a")
    with pytest.raises(ValueError, match="do not fit this base model"):
        load_adapter(load_model(qwen_dir), tmp_path / "a")


# -----------------------------------------------------------------------------
# the scripts: sft.py / grpo.py / eval.py with --lora_rank

LORA = ["--lora_rank", "4", "--lora_alpha", "8"]
GRPO = ["--split", "train[:64]", "--eval_split", "test[:4]", "--prompts_per_step", "4", "--group_size", "4",
        "--gen_batch", "2", "--max_new_tokens", "16", "--reward_weights", "overlong=1", "--eval_every", "0",
        "--lr", "1e-2", "--warmup", "1", "--train_micro_batch", "3", "--beta", "0.1", *LORA]  # fmt: skip


def train_state(ckpt):
    """A checkpoint's training state as full tensors, read by DCP's own converter (not checkpoint.py)."""
    out = ckpt.parent / f"{ckpt.name}.pt"
    dcp_to_torch_save(ckpt / checkpoint.TRAIN_STATE, out)
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def sft_lora(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sft_lora")
    sft.main([*TINY, "--init", str(tiny_dir), *LORA, "--lr", "1e-2", "--out_dir", str(out)])
    return out


def test_sft_lora_saves_only_the_adapter_and_exports_merged_and_peft(tiny_dir, sft_lora):
    out = sft_lora
    ckpt = out / "step_000006"
    assert not list(ckpt.glob("model*.safetensors")) and (ckpt / "adapter_model.safetensors").is_file()
    state = train_state(ckpt)
    lora_keys = {k for k in add_lora(load_model(tiny_dir), 4, 8.0).state_dict() if ".lora_" in k}
    assert set(state["model"]) == set(state["optimizer"]) == lora_keys  # the adapters and their AdamW moments
    # OUT/adapter (PEFT) and OUT/model (merged): non-target weights are the base's bitwise, targets W + s B A
    base = load_model(tiny_dir).state_dict()
    adapter = {k.removeprefix(ADAPTER_PREFIX): v for k, v in
               load_file(out / "adapter" / "adapter_model.safetensors").items()}
    assert all(torch.equal(adapter[k], state["model"][k]) for k in lora_keys)
    merged = load_model(out / "model").state_dict()
    for k, w in base.items():
        if ".lora_" in k:
            continue
        proj = k.removesuffix(".weight")
        if proj + ".lora_A.weight" not in adapter:
            assert torch.equal(merged[k], w), k
            continue
        A, B = adapter[proj + ".lora_A.weight"], adapter[proj + ".lora_B.weight"]
        assert B.abs().max() > 0  # the adapter trained
        assert torch.allclose(merged[k], w + 8.0 / 4 * B @ A, atol=1e-6), k
    assert json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_dir)


def test_eval_on_the_adapter_equals_eval_on_the_merged_model(sft_lora, tmp_path):
    args = ["--split", "test[:6]", "--max_new_tokens", "8", "--batch_size", "4"]
    for name in ("adapter", "model", "step_000006"):
        eval_script.main([*args, "--model", str(sft_lora / name), "--out_dir", str(tmp_path / name)])
    got = {n: (tmp_path / n / "completions.jsonl").read_text() for n in ("adapter", "model", "step_000006")}
    assert got["adapter"] == got["model"] == got["step_000006"]
    with pytest.raises(SystemExit, match="not a model directory"):
        eval_script.main([*args, "--model", str(sft_lora / "adapter"), "--lora_base", str(tmp_path)])


@pytest.mark.parametrize("mode", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_sft_lora_two_ranks_match_one(sft_lora, tiny_dir, tmp_path, mode):
    out = tmp_path / mode
    extra = ["--lora_base_dtype", "bfloat16"] if mode == "fsdp" else []  # FSDP2 shards bf16 base + fp32 adapters
    p = torchrun("sft.py", [*TINY, "--init", str(tiny_dir), *LORA, "--lr", "1e-2", "--dist", mode, *extra,
                            "--out_dir", str(out)])  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    ref, got = metrics(sft_lora), metrics(out)
    assert len(ref) == len(got) == 6
    tol = 1e-5 if not extra else 2e-2  # bf16 base weights: another model, close to the fp32 one
    for a, b in zip(ref, got):
        assert abs(a["loss"] - b["loss"]) <= tol, (mode, a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= max(tol, 1e-4) * max(1.0, a["grad_norm"])
    if not extra:
        wa, wb = (load_file(d / "adapter" / "adapter_model.safetensors") for d in (sft_lora, out))
        assert all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)
    else:
        assert json.loads((out / "model" / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.fixture(scope="module")
def grpo_lora(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo_lora") / "run"
    grpo.main(["--init", str(tiny_dir), *GRPO, "--steps", "4", "--save_every", "2", "--keep", "3",
               "--out_dir", str(out)])
    rows = metrics(out)
    assert rows[0]["kl"] == 0 and rows[-1]["kl"] > 0 and rows[0]["grad_norm"] > 0  # fresh adapter: policy == ref
    return out


def test_grpo_lora_resumes_bitwise(tiny_dir, grpo_lora, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(grpo_lora, out)
    grpo.main(["--init", str(tiny_dir), *GRPO, "--steps", "4", "--save_every", "2", "--keep", "3",
               "--out_dir", str(out), "--resume", str(out / "step_000002")])
    a, b = metrics(grpo_lora), metrics(out)
    timing = {"t_generate", "t_score", "t_train", "tokens_per_s", "mem_peak_mb", "train_s", "wall_s"}
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k not in timing} == {k: v for k, v in y.items() if k not in timing}
    sa, sb = train_state(grpo_lora / "step_000004"), train_state(out / "step_000004")
    for part in ("model", "optimizer"):
        assert sa[part].keys() == sb[part].keys()
        for name, v in sa[part].items():
            for k, t in (v.items() if isinstance(v, dict) else [("", v)]):
                assert torch.equal(t, sb[part][name][k] if k else sb[part][name]), (part, name, k)
    wa, wb = (load_file(d / "model" / "model.safetensors") for d in (grpo_lora, out))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_grpo_lora_fsdp_matches_one_process(tiny_dir, grpo_lora, tmp_path):
    """Two FSDP2 ranks == one process, with the KL reference = the sharded policy with its adapters off."""
    p = torchrun("grpo.py", ["--init", str(tiny_dir), *GRPO, "--steps", "4", "--dist", "fsdp",
                             "--out_dir", str(tmp_path / "fsdp")])  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    for a, b in zip(metrics(grpo_lora), metrics(tmp_path / "fsdp"), strict=True):
        for k in ("reward", "kl", "entropy", "grad_norm", "len_mean"):
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["step"], k, a[k], b[k])


def test_bad_lora_flags_are_one_error_line(tiny_dir, tmp_path):
    with pytest.raises(SystemExit, match=r"error: --lora_\*: bad LoRA settings: rank=-1"):
        sft.main(["--init", str(tiny_dir), "--lora_rank", "-1", "--out_dir", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match=r"error: --lora_\*: bad LoRA settings: .*targets \['q_proj', 'qproj'\]"):
        grpo.main(["--init", str(tiny_dir), "--lora_rank", "4", "--lora_targets", "q_proj,qproj",
                   "--out_dir", str(tmp_path / "b")])
