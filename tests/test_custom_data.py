"""--task custom: any dataset (a local JSONL / JSON / Parquet / CSV file, a directory of splits, or a hub name) with
its own column names (--question_field, --answer_field, --answer_regex, --solution_field) and --system_prompt."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data
import grpo
import rewards
import sft

ROOT = Path(__file__).resolve().parents[1]
RAW = [{"problem": f"Add {a} and {b}.", "worked": f"{a}+{b}={a + b}\n#### {a + b}", "level": str(a % 3)}
       for a, b in [(3, 4), (12, 30), (7, 8), (21, 5), (9, 9), (40, 2)]]
COLUMNS = dict(question_field="problem", answer_field="worked", answer_regex=r"####\s*(\S+)", solution_field="worked")


def write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_custom_rows_from_every_file_format(tmp_path, suffix):
    f = write(tmp_path / f"mine{suffix}", RAW)
    rows = data.load_task("custom", "train[1:3]", path=str(f), columns=COLUMNS)
    assert rows == [
        {"level": "0", "problem": "Add 12 and 30.", "worked": RAW[1]["worked"], "question": "Add 12 and 30.",
         "answer": "42", "solution": "12+30=42", "numeric": True},
        {"level": "1", "problem": "Add 7 and 8.", "worked": RAW[2]["worked"], "question": "Add 7 and 8.",
         "answer": "15", "solution": "7+8=15", "numeric": True},
    ]


def test_custom_columns_without_regex_and_a_directory_of_splits(tmp_path):
    rows = [{"q": "Name the capital of France.", "a": "Paris"}, {"q": "What is half of 9?", "a": 4.5}]
    write(tmp_path / "test.jsonl", rows)
    got = data.load_task("custom", "test", path=str(tmp_path), columns=dict(question_field="q", answer_field="a"))
    assert [(r["question"], r["answer"], r["solution"], r["numeric"]) for r in got] == [
        ("Name the capital of France.", "Paris", None, False), ("What is half of 9?", "4.5", None, True)]


def test_custom_data_errors_name_the_file_row_and_flag(tmp_path):
    f = write(tmp_path / "d.jsonl", RAW[:2] + [{"problem": "No gold here.", "worked": "none"}])
    with pytest.raises(ValueError, match=r"d.jsonl: row 3: field 'worked' does not match --answer_regex"):
        data.load_task("custom", "train", path=str(f), columns=COLUMNS)
    with pytest.raises(ValueError, match=r"d.jsonl: row 1: missing or empty field 'question'"):
        data.load_task("custom", "train", path=str(f), columns={"answer_field": "worked"})
    with pytest.raises(ValueError, match=r"--answer_regex '####\(': not a regular expression"):
        data.load_task("custom", "train", path=str(f), columns={**COLUMNS, "answer_regex": "####("})
    with pytest.raises(ValueError, match="--task custom reads --data_path"):
        data.load_task("custom", "train", columns=COLUMNS)
    cfg = SimpleNamespace(task="gsm8k", data_path=str(f), data_seed=0, task_knobs="", question_field="problem",
                          answer_field="answer", answer_regex="", system_prompt="")
    with pytest.raises(ValueError, match="--question_field is for --task custom"):
        data.load_splits(cfg, "train")


def test_system_prompt_replaces_the_templates_own(tiny_dir):
    from hf import load_tokenizer

    text, start = data.format_prompt("Add 1 and 2.", "r1", system="Answer tersely.")
    assert text == "Answer tersely.\nUser: Add 1 and 2.\nAssistant: <think>" and start == "<think>"
    assert data.format_prompt("Q", "r1")[0] == data.R1_PROMPT.format(question="Q")  # unchanged without one
    tok = load_tokenizer(tiny_dir)
    tok.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert data.format_prompt("Q", "chat", tok, "Be brief.")[0] == "[system] Be brief.\n[user] Q\n"
    with pytest.raises(ValueError, match="template 'short' has no system prompt"):
        data.format_prompt("Q", "short", system="x")
    cfg = SimpleNamespace(task="arith", data_path=None, data_seed=0, task_knobs="", system_prompt="Be brief.")
    (rows,) = data.load_splits(cfg, "test[:2]")
    assert [r["system"] for r in rows] == ["Be brief."] * 2


def test_a_hub_name_offline_is_one_error_line(tiny_dir, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "grpo.py", "--init", str(tiny_dir), "--task", "custom", "--data_path",
                        "someone/some-dataset", "--dry_run", "--out_dir", str(tmp_path / "run")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("error: data: could not load 'someone/some-dataset'")
    assert "pass path= (--data_path) a local .jsonl/.json/.parquet/.csv file" in r.stderr


def test_grpo_trains_two_steps_on_a_custom_jsonl(tiny_dir, tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    write(d / "train.jsonl", RAW)
    write(d / "test.jsonl", RAW[:3])
    out = tmp_path / "run"
    argv = ["--init", str(tiny_dir), "--task", "custom", "--data_path", str(d), "--question_field", "problem",
            "--answer_field", "worked", "--split", "train", "--eval_split", "test", "--eval_every", "2",
            "--prompts_per_step", "2", "--group_size", "2", "--gen_batch", "2", "--max_new_tokens", "12",
            "--log_samples", "4", "--out_dir", str(out)]  # fmt: skip
    grpo.main([*argv, "--answer_regex", r"####\s*(\S+)", "--steps", "2"])
    with pytest.raises(SystemExit, match=r"cannot resume .* --answer_regex ####\\s\*\(\\S\+\) -> "):
        grpo.main([*argv, "--answer_regex", r"####\s*(\d+)", "--steps", "3"])  # other golds: not the same run
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2] and "eval_pass1" in metrics[1]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    gold = {f"{r['problem']}\n<think>": r["worked"].rsplit("#### ", 1)[1] for r in RAW}  # short template prompts
    assert len(samples) == 8 and all(s["prompt"] in gold for s in samples)
    for s in samples:  # each logged reward is the reward against the regex's gold, a number
        want = rewards.reward("<think>" + s["completion"], gold[s["prompt"]], num_tokens=None, numeric=True)
        assert s["correct"] == want["correct"] and s["format"] == want["format"]


def test_sft_trains_on_a_custom_datasets_worked_solutions(tmp_path, capsys):
    f = write(tmp_path / "mine.csv", RAW)
    argv = ["--task", "custom", "--data_path", str(f), "--question_field", "problem", "--answer_field", "worked",
            "--answer_regex", r"####\s*(\S+)", "--split", "train", "--eval_split", "train[:2]", "--steps", "1",
            "--global_batch", "2", "--micro_batch", "2", "--eval_every", "0", "--stop_pass1", "0"]  # fmt: skip
    with pytest.raises(SystemExit, match="has no solution to train on"):
        sft.main([*argv, "--out_dir", str(tmp_path / "none")])  # the answer alone is no worked solution
    sft.main([*argv, "--solution_field", "worked", "--out_dir", str(tmp_path / "s")])
    assert (tmp_path / "s" / "model" / "config.json").is_file()
    # the targets were the reasoning before "#### N", then the regex's gold in the answer tags
    rows = data.load_task("custom", "train", path=str(f), columns={**COLUMNS})
    assert data.sft_target(rows[0]) == "3+4=7</think> <answer>7</answer>"
