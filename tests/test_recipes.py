"""recipes/*.yaml: each recipe is exactly the flag line it replaced (README, docs/real_models.md,
scripts/demo_real.sh), and its stage runs it with --dry_run on a stand-in model directory of the real model's
config.json shape (config and tokenizer only: a dry run reads no weights) and a few GSM8K-shaped rows."""

import json
from pathlib import Path

import pytest

import common
import eval as eval_stage
import grpo
import sft
from hf import char_tokenizer
from model import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
QWEN25 = dict(model_type="qwen2", vocab_size=151_936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
              num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=32768)
LLAMA3B = dict(model_type="llama", vocab_size=128_256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
               num_attention_heads=24, num_key_value_heads=8, tie_word_embeddings=True, rope_theta=5e5,
               max_position_embeddings=131072,
               rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192))
QWEN3 = dict(model_type="qwen3", vocab_size=151_936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True,
             max_position_embeddings=40960, rope_theta=1e6)
SMOLLM2 = dict(model_type="llama", vocab_size=49_152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, max_position_embeddings=8192,
               rope_theta=1e5)
DEMO_TASK = "--task arith --template chat --max_new_tokens 48"
GSM8K_TASK = "--task gsm8k --data_path ../shared/data/gsm8k --template chat --max_new_tokens 256"
# recipe -> (stage, the model's shape, the command line it replaced, as written there, less the launcher)
RECIPES = {
    "qwen2.5-1.5b-gsm8k-grpo.yaml": (grpo, QWEN25, """--init ckpt/qwen2.5-1.5b-instruct --task gsm8k --template chat
        --split train --eval_split test[:500] --max_new_tokens 512 --prompts_per_step 64 --group_size 16
        --gen_batch 8 --train_micro_batch 16 --lr 1e-6 --dtype bfloat16 --dist fsdp --out_dir runs/qwen-gsm8k"""),
    "llama3.2-3b-gsm8k-sft.yaml": (sft, LLAMA3B, """--init ckpt/llama-3.2-3b --task gsm8k --template r1
        --split train[:10%] --eval_split test[:200] --max_new_tokens 512 --lr 1e-5 --global_batch 64 --micro_batch 4
        --steps 200 --out_dir runs/llama3b-sft"""),
    "llama3.2-3b-gsm8k-grpo.yaml": (grpo, LLAMA3B, """--init runs/llama3b-sft/model --task gsm8k --template r1
        --split train[10%:] --max_new_tokens 512 --prompts_per_step 64 --group_size 16 --beta 0.04 --loss grpo
        --lr 1e-6 --dtype bfloat16 --dist fsdp --out_dir runs/llama3b-grpo"""),
    "llama3.2-3b-lora-24gb.yaml": (grpo, LLAMA3B, """--init ckpt/llama-3.2-3b-instruct --task gsm8k --template chat
        --split train --lora_rank 16 --lora_base_dtype bfloat16 --dtype bfloat16 --beta 0.04 --lr 1e-5
        --max_new_tokens 512 --prompts_per_step 16 --group_size 8 --gen_batch 4 --train_micro_batch 2
        --out_dir runs/llama3b-lora"""),
    "qwen3-1.7b-gsm8k-grpo.yaml": (grpo, QWEN3, """--init ckpt/qwen3-1.7b --task gsm8k --template chat --split train
        --eval_split test[:500] --max_new_tokens 1024 --prompts_per_step 32 --group_size 8 --gen_batch 8
        --train_micro_batch 8 --lr 1e-6 --dtype bfloat16 --activation_checkpointing --out_dir runs/qwen3-gsm8k"""),
    # scripts/demo_real.sh's stages (its --init "$MODEL" stays a flag: the model's directory is get_model.py's)
    "smollm2-arith-sft.yaml": (sft, SMOLLM2, f"""{DEMO_TASK} --split train[:1000] --steps 100 --global_batch 8
        --micro_batch 8 --lr 5e-5 --warmup 5 --weight_decay 0 --stop_pass1 0 --eval_every 25 --eval_split test[-64:]
        --out_dir runs_real/sft"""),
    "smollm2-arith-grpo.yaml": (grpo, SMOLLM2, f"""--init runs_real/sft/model {DEMO_TASK} --split train[1000:]
        --prompts_per_step 16 --group_size 4 --lora_rank 16 --lora_alpha 32 --lr 1e-4 --warmup 3 --beta 0 --steps 80
        --eval_every 20 --eval_split test[:200] --seed 0 --out_dir runs_real/grpo_s0"""),
    "smollm2-arith-eval.yaml": (eval_stage, SMOLLM2, f"""--model runs_real/grpo_s0/model {DEMO_TASK}
        --split test[:200] --out_dir runs_real/eval_grpo_s0"""),
    # the seed's experiment at our scale (docs/real_models.md)
    "smollm2-gsm8k-sft.yaml": (sft, SMOLLM2, f"""{GSM8K_TASK} --split train[:10%] --steps 40 --global_batch 8
        --micro_batch 4 --lr 5e-5 --warmup 5 --weight_decay 0 --stop_pass1 0 --eval_every 0
        --out_dir runs_real/gsm8k_sft"""),
    "smollm2-gsm8k-grpo.yaml": (grpo, SMOLLM2, f"""--init runs_real/gsm8k_sft/model {GSM8K_TASK}
        --split train[10%:] --prompts_per_step 16 --group_size 4 --train_micro_batch 16 --lr 1e-5 --warmup 3
        --beta 0 --steps 1000 --max_minutes 45 --eval_every 0 --out_dir runs_real/gsm8k_grpo"""),
    "smollm2-gsm8k-eval.yaml": (eval_stage, SMOLLM2, f"""--model runs_real/gsm8k_grpo/model {GSM8K_TASK}
        --split test[:200] --out_dir runs_real/eval_gsm8k_grpo"""),
}
CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def config_class(stage):
    return next(v for k, v in vars(stage).items() if k.endswith("Config") and v.__module__ == stage.__name__)


def test_every_recipe_is_listed():
    assert sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")) == sorted(RECIPES)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_is_the_command_it_replaced(name):
    stage, _, line = RECIPES[name]
    cls = config_class(stage)
    from_file = common.parse_config(cls, ["--config", str(ROOT / "recipes" / name)])
    assert from_file == common.parse_config(cls, line.split())
    assert from_file != cls()  # (the recipe sets something)


def stand_in(path: Path, shape: dict) -> Path:
    """A model dir with the real model's config.json and a char tokenizer with a chat template; no weights."""
    path.mkdir()
    tok = char_tokenizer()
    tok.chat_template = CHAT
    tok.save_pretrained(path)
    (path / "config.json").write_text(json.dumps(ModelConfig(**shape, eos_token_id=2).to_hf()))
    (path / "model.safetensors").write_bytes(b"")  # sft.py looks for the file; a dry run never reads it
    return path


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("gsm8k")
    for split in ("train", "test"):
        rows = [{"question": f"Ann has {i} apples and buys 2. How many now?", "answer": f"{i}+2={i + 2}\n#### {i + 2}"}
                for i in range(20)]
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


@pytest.mark.parametrize("name", sorted(n for n, (stage, *_) in RECIPES.items() if stage is not eval_stage))
def test_recipe_dry_run(name, gsm8k_dir, tmp_path, capsys):
    stage, shape, _ = RECIPES[name]
    model = stand_in(tmp_path / "model", shape)
    out = tmp_path / "run"
    argv = ["--config", str(ROOT / "recipes" / name), "--init", str(model), "--out_dir", str(out), "--dry_run"]
    cfg = common.parse_config(config_class(stage), argv)
    if cfg.task == "gsm8k":
        argv += ["--data_path", str(gsm8k_dir)]
    stage.main(argv)
    printed = capsys.readouterr().out
    assert "memory estimate per rank:" in printed and not out.exists()
