"""--log_samples_every N: every N steps the step's samples.jsonl rows (prompt, completion, reward components) go to
W&B as a wandb.Table and to TensorBoard as a markdown text (common.JsonlLogger.table)."""

import json
import os
from pathlib import Path

import pytest

import common
import grpo

FLAGS = ["--steps", "2", "--prompts_per_step", "2", "--group_size", "2", "--gen_batch", "2", "--max_new_tokens", "10",
         "--eval_every", "0", "--split", "train[:8]", "--log_samples", "3", "--log_samples_every", "2"]  # fmt: skip


class Table:
    """Stands in for wandb.Table: keeps what it was given."""

    def __init__(self, columns, data):
        self.columns, self.data = columns, data


def test_grpo_logs_its_completions_as_a_table(tiny_dir, tmp_path, fake_wandb, monkeypatch):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setattr(fake_wandb, "Table", Table, raising=False)
    grpo.main(["--init", str(tiny_dir), "--out_dir", str(tmp_path), "--wandb", "demo", "--tensorboard", *FLAGS])
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    want = [s for s in samples if s["step"] == 2]
    assert len(want) == 3
    tables = [(step, row["completions"]) for step, row in fake_wandb.logged if "completions" in row]
    assert [step for step, _ in tables] == [2]  # every 2nd step only
    table = tables[0][1]
    assert table.columns == ["step", "prompt", "completion", "reward", "correct", "format", "overlong"]
    assert table.data == [[s[c] for c in table.columns] for s in want]
    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"tensors": 0})
    ea.Reload()
    (event,) = ea.Tensors("completions/text_summary")
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 2 and text.count("\n") == 2 + 3 - 1  # header, rule, one line per completion
    for s in want:
        assert s["completion"].replace("|", "\\|").replace("\n", "<br>") in text


def test_the_table_through_wandbs_offline_mode(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    rows = [{"step": 4, "prompt": "What is 1+2?\n<think>", "completion": "1+2=3</think> <answer>3</answer>",
             "reward": 1.1, "correct": 1.0},
            {"step": 4, "prompt": "What is 1+2?\n<think>", "completion": "no", "reward": 0.0, "correct": 0.0}]
    log = common.JsonlLogger(tmp_path / "metrics.jsonl", wandb_project="demo")
    log.table("completions", rows, step=4)
    log.write({"step": 4, "reward": 0.55})
    log.close()
    (path,) = Path(tmp_path / "wandb").glob("offline-run-*/files/media/table/completions_*.table.json")
    saved = json.loads(path.read_text())
    assert saved["columns"] == list(rows[0]) and saved["data"] == [list(r.values()) for r in rows]
    assert wandb.run is None and not os.environ.get("WANDB_API_KEY")  # (offline: no account was needed)
