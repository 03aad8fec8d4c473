"""Bad input (issue 6): every mistake a user can make gives one line `error: ...` naming what and where, a non-zero
exit and no traceback; and it leaves nothing in --out_dir that a later run would pick up (no checkpoint, no `latest`,
no metrics; an existing run stays as it was). In process (sft.main / grpo.main raise SystemExit with the message,
which python prints to stderr and exits 1), except the world-size check, which needs two torchrun ranks."""

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_job

import grpo
import sft
from hf import char_tokenizer, save_model
from model import Transformer, preset_config

ROOT = Path(__file__).resolve().parents[1]
GRPO = ["--split", "train[:64]", "--eval_split", "test[:4]", "--prompts_per_step", "4", "--group_size", "4",
        "--gen_batch", "2", "--max_new_tokens", "16", "--reward_weights", "overlong=1", "--eval_every", "0",
        "--lr", "1e-3", "--warmup", "1", "--train_micro_batch", "3"]  # fmt: skip
SFT = ["--split", "train[:64]", "--eval_split", "test[:4]", "--global_batch", "8", "--micro_batch", "8",
       "--eval_every", "0", "--warmup", "1"]  # fmt: skip


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A good tiny model dir and broken variants: no weights, a truncated safetensors file, no tokenizer; a gsm8k
    file with a malformed second row."""
    root = tmp_path_factory.mktemp("inputs")
    tok = char_tokenizer()
    cfg = preset_config("tiny", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    torch.manual_seed(0)
    save_model(Transformer(cfg), root / "good", tok)
    shutil.copytree(root / "good", root / "no_weights")
    (root / "no_weights" / "model.safetensors").unlink()
    shutil.copytree(root / "good", root / "truncated")
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # an interrupted download
    shutil.copytree(root / "good", root / "no_tokenizer")
    for f in (root / "no_tokenizer").glob("tokenizer*"):
        f.unlink()
    (root / "bad.jsonl").write_text('{"question": "What is 1+1?", "answer": "1+1=2\\n#### 2"}\n{"question": "Wh\n')
    return root


def fails(main, argv: list[str], out: Path) -> str:
    """Run main expecting a user error; return its message. Nothing may be left in a fresh --out_dir."""
    with pytest.raises(SystemExit) as e:
        main(argv + ["--out_dir", str(out)])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    return msg


@pytest.mark.parametrize("case, message", [
    ("missing", "error: --init: {d}/missing: no such model directory"),
    ("no_weights", "error: --init: {d}/no_weights/model.safetensors: weights file not found"),
    ("truncated", "error: --init: {d}/truncated/model.safetensors: unreadable safetensors file, truncated or corrupt"),
    ("no_tokenizer", "error: --init: {d}/no_tokenizer: no tokenizer files"),
])  # fmt: skip
def test_bad_model_dir(dirs, tmp_path, case, message):
    assert fails(grpo.main, GRPO + ["--init", str(dirs / case)], tmp_path / "out").startswith(message.format(d=dirs))
    if case in ("truncated", "no_tokenizer"):  # sft checks the rest itself, before loading
        assert fails(sft.main, SFT + ["--init", str(dirs / case)], tmp_path / "o2").startswith(message.format(d=dirs))


def test_malformed_data_row(dirs, tmp_path):
    data = ["--task", "gsm8k", "--data_path", str(dirs / "bad.jsonl"), "--split", "train", "--eval_split", "train"]
    want = f"error: data: {dirs}/bad.jsonl: row 2: not valid JSON"
    assert fails(grpo.main, GRPO + ["--init", str(dirs / "good")] + data, tmp_path / "out").startswith(want)
    assert fails(sft.main, SFT + data, tmp_path / "out").startswith(want)


def test_incompatible_flags(dirs, tmp_path):
    init = ["--init", str(dirs / "good")]
    msg = fails(grpo.main, GRPO + init + ["--group_size", "1", "--scale_rewards", "group"], tmp_path / "out")
    assert msg.startswith("error: --group_size 1 with --scale_rewards group: the std of one reward is undefined")
    msg = fails(grpo.main, GRPO + init + ["--max_new_tokens", "5000"], tmp_path / "out")
    assert msg == ("error: longest prompt + --max_new_tokens=5000 exceeds the model's max_position_embeddings=2048: "
                   "lower --max_new_tokens")
    msg = fails(sft.main, SFT + ["--model_overrides", "max_position_embeddings=16"], tmp_path / "out")
    assert msg.startswith("error: the longest example has") and "max_position_embeddings 16" in msg
    msg = fails(sft.main, SFT + ["--model_overrides", "max_position_embeddings=80", "--eval_every", "1",
                                 "--max_new_tokens", "200"], tmp_path / "out")  # fmt: skip
    assert msg.startswith("error: longest --eval_split prompt (") and "exceeds the model's max_position_embed" in msg
    assert fails(grpo.main, GRPO + init + ["--lr", "nan"], tmp_path / "out") == (
        "error: --lr nan: need a positive finite number")


def test_prompts_per_step_not_divisible_by_world_size(dirs, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "grpo.py", *GRPO,
           "--init", str(dirs / "good"), "--prompts_per_step", "3", "--out_dir", str(out)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = run_job(cmd, 240, env=env, cwd=ROOT)
    assert p.returncode != 0
    assert "error: --prompts_per_step=3 is not divisible by the world size 2" in p.stderr, p.stderr[-3000:]
    assert 'grpo.py", line' not in p.stderr  # no traceback from the script (torchrun prints its own summary)
    assert not out.exists()


def test_nan_loss_stops_at_the_step_and_keeps_the_last_checkpoint(tmp_path):
    """lr 1e30: step 1's update blows the weights up, step 2's loss is NaN. The run stops at step 2 before the
    optimizer step, saving nothing of it: the step-1 checkpoint stays the newest and metrics end at step 1."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        sft.main(SFT + ["--lr", "1e30", "--steps", "4", "--save_every", "1", "--out_dir", str(out)])
    assert str(e.value.code) == (
        f"error: step 2: the loss or its gradient is not finite (grad norm nan); stopped before the update, nothing "
        f"of this step was saved and the newest checkpoint, {out}/step_000001, is intact. Lower --lr (or check the "
        "data) and restart")
    assert (out / "latest").read_text().strip() == "step_000001"
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(("step_", ".tmp"))) == ["step_000001"]
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1]


# -----------------------------------------------------------------------------
# --resume / --overwrite against an existing run


@pytest.fixture(scope="module")
def run_dir(dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "grpo"
    grpo.main(GRPO + ["--init", str(dirs / "good"), "--steps", "2", "--save_every", "1", "--out_dir", str(out)])
    return out


def snapshot(out: Path) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def resume_fails(dirs, run_dir, extra: list[str]) -> str:
    before = snapshot(run_dir)
    with pytest.raises(SystemExit) as e:
        grpo.main(GRPO + ["--init", str(dirs / "good"), "--steps", "2", "--out_dir", str(run_dir)] + extra)
    assert snapshot(run_dir) == before  # the run is untouched
    return str(e.value.code)


def test_resume_errors(dirs, run_dir, tmp_path):
    assert resume_fails(dirs, run_dir, ["--resume", "none"]) == (
        f"error: --out_dir {run_dir} already holds a run (checkpoints or metrics.jsonl): continue it with --resume "
        "auto, or delete it and start over with --overwrite")
    assert resume_fails(dirs, run_dir, ["--group_size", "2", "--prompts_per_step", "2"]) == (
        f"error: cannot resume {run_dir}/step_000002: this run differs from the one that wrote it in --prompts_per_step"
        " 4 -> 2; --group_size 4 -> 2. Use the old values, or start a new run (another --out_dir, or --overwrite)")
    assert resume_fails(dirs, run_dir, ["--resume", str(tmp_path / "nope")]) == (
        f"error: --resume {tmp_path}/nope: no such checkpoint or run directory")
    assert resume_fails(dirs, run_dir, ["--resume", str(dirs / "good")]) == (
        f"error: --resume {dirs}/good: not a complete checkpoint (no progress.json) nor a run directory holding one")
    assert resume_fails(dirs, run_dir, ["--resume", str(run_dir / "step_000001"), "--overwrite"]) == (
        f"error: --overwrite starts over in --out_dir {run_dir}; it cannot go with --resume {run_dir}/step_000001")
    # a checkpoint whose training state was damaged after the fact (disk trouble, a bad copy)
    broken = tmp_path / "broken"
    shutil.copytree(run_dir / "step_000001", broken)
    shard = broken / "train_state" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    msg = resume_fails(dirs, run_dir, ["--resume", str(broken)])
    assert msg.startswith(f"error: cannot load checkpoint {broken}: ") and "\n" not in msg, msg


def test_overwrite_starts_over(dirs, run_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    (out / "tb").mkdir()  # the old run's logger outputs go too (a new W&B run, no stale TensorBoard events)
    (out / "tb" / "events.out.tfevents.1").write_text("old")
    (out / "wandb_run_id").write_text("abc 7\n")
    grpo.main(GRPO + ["--init", str(dirs / "good"), "--steps", "1", "--out_dir", str(out), "--overwrite"])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "latest", "metrics.jsonl", "minigrpo_run.json",
                                                     "model", "samples.jsonl", "step_000001"]  # fmt: skip
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1
