"""data.py: split syntax, the built-in arithmetic task, file loaders and their errors, prompts and SFT targets."""

import json
from fractions import Fraction
from pathlib import Path

import pytest

import data
from data import format_prompt, load_task, parse_split, sft_target
from rewards import parse_r1, reward

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


# ---------------------------------------------------------------- splits


@pytest.mark.parametrize("split,expected", [
    ("train", ("train", None, None)),
    ("test[:400]", ("test", None, 400)),
    ("train[:10%]", ("train", None, Fraction(1, 10))),
    ("train[10%:]", ("train", Fraction(1, 10), None)),
    ("train[100:200]", ("train", 100, 200)),
    ("train[-50:]", ("train", -50, None)),
    ("train[12.5%:50%]", ("train", Fraction(1, 8), Fraction(1, 2))),
    (" validation[:] ", ("validation", None, None)),
])
def test_parse_split(split, expected):
    assert parse_split(split) == expected


@pytest.mark.parametrize("split", ["", "train[", "train[:10", "train[1:2:3]", "train[abc]", "train[5]", "train[:10%%]",
                                   "train[1.5:]", "train[:150%]", "tr ain", "train[:10]x"])
def test_parse_split_rejects(split):
    with pytest.raises(ValueError, match="bad split"):
        parse_split(split)


@pytest.mark.parametrize("n", [1, 7, 10, 99, 7473])
@pytest.mark.parametrize("pct", [1, 10, 33, 50, 90])
def test_percent_splits_partition(n, pct):
    rows = list(range(n))
    try:
        head = data.select(rows, f"train[:{pct}%]")
    except ValueError:  # too few rows for a non-empty head
        head = []
    try:
        tail = data.select(rows, f"train[{pct}%:]")
    except ValueError:
        tail = []
    assert head + tail == rows


def test_empty_selection_is_an_error():
    with pytest.raises(ValueError, match="selects no rows"):
        data.select(list(range(5)), "train[5:]", "x.jsonl")


# ---------------------------------------------------------------- built-in arithmetic task


def _evaluate(expr: str) -> int:
    """Independent check: tokenize "12+45*3-7" and evaluate with * before + and -, using int arithmetic only."""
    tokens, num = [], ""
    for c in expr:
        if c.isdigit():
            num += c
        else:
            tokens += [int(num), c]
            num = ""
    tokens.append(int(num))
    terms = [tokens[0]]  # fold products first
    for op, value in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            terms[-1] *= value
        else:
            terms += [op, value]
    total = terms[0]
    for op, value in zip(terms[1::2], terms[2::2]):
        total = total + value if op == "+" else total - value
    return total


def _check_step(line: str) -> int:
    """'57-70=-13' -> checks a op b == c with ints and returns c."""
    lhs, rhs = line.split("=")
    i = next(i for i in range(1, len(lhs)) if lhs[i] in "+-*")  # skip a leading minus on a
    a, op, b = int(lhs[:i]), lhs[i], int(lhs[i + 1:])
    assert {"+": a + b, "-": a - b, "*": a * b}[op] == int(rhs), line
    return int(rhs)


@pytest.mark.parametrize("knobs", [{}, {"steps": 4, "ops": "+-*"}, {"steps": 1, "low": 0, "high": 9, "ops": "*"},
                                   {"high": 999, "negative": True}])
def test_arith_solutions_evaluate_to_answer(knobs):
    for row in load_task("arith", "train[:300]", **knobs) + load_task("arith", "test[:100]", **knobs):
        expr = row["question"].removeprefix("What is ").removesuffix("?")
        lines = row["solution"].split("\n")
        values = [_check_step(line) for line in lines]
        assert len(lines) == knobs.get("steps", 2)
        assert str(values[-1]) == row["answer"] == str(_evaluate(expr))
        if not knobs.get("negative"):
            assert min(values) >= 0


def test_arith_default_is_short_and_sized():
    train = load_task("arith", "train")
    assert len(train) == data.ARITH_DEFAULTS["train_size"] and len(load_task("arith", "test")) == 1000
    assert max(len(r["question"]) for r in train) < 60
    assert max(len(r["solution"]) for r in train) < 60
    assert all(set(r["question"][8:-1]) <= set("0123456789+-") for r in train)


def test_arith_is_deterministic_and_seeded():
    a = load_task("arith", "train[:200]")
    assert a == load_task("arith", "train[:200]")
    assert a[50:] == load_task("arith", "train[50:200]")  # row i does not depend on the slice
    assert a != load_task("arith", "train[:200]", seed=1)


def test_arith_splits_are_disjoint():
    train = {r["question"] for r in load_task("arith", "train")}
    for seed in (0, 1):
        test = {r["question"] for r in load_task("arith", "test", seed=seed)}
        assert not train & test
    # also for a tiny problem space where collisions would be certain without the partition
    knobs = {"steps": 1, "low": 0, "high": 9, "train_size": 2000, "test_size": 200}
    small_train = {r["question"] for r in load_task("arith", "train", **knobs)}
    small_test = {r["question"] for r in load_task("arith", "test", seed=3, **knobs)}
    assert small_test and not small_train & small_test


def test_arith_bad_knobs():
    with pytest.raises(ValueError, match="unknown arith knobs"):
        load_task("arith", "train", stepz=3)
    with pytest.raises(ValueError, match="bad arith knobs"):
        load_task("arith", "train", ops="/")
    with pytest.raises(ValueError, match="splits 'train' and 'test'"):
        load_task("arith", "validation")
    with pytest.raises(ValueError, match="unknown task"):
        load_task("countdown", "train")


def test_parse_knobs():
    assert data.parse_knobs("steps=3, high=999,ops=+-*,negative=true") == {
        "steps": 3, "high": 999, "ops": "+-*", "negative": True}
    assert data.parse_knobs("") == {}
    with pytest.raises(ValueError, match="bad task knob"):
        data.parse_knobs("steps")


# ---------------------------------------------------------------- local files and their errors


def _write_jsonl(path: Path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GSM = [{"question": f"Q{i}?", "answer": f"{i} + 1,000 = <<{i}+1000={i + 1000}>>{i + 1000:,}\n#### {i + 1000:,}"}
       for i in range(10)]


def test_gsm8k_row_parsing(tmp_path):
    rows = load_task("gsm8k", "train", path=_write_jsonl(tmp_path / "g.jsonl", GSM))
    assert rows[3] == {"question": "Q3?", "answer": "1003", "solution": "3 + 1,000 = 1,003",
                       "numeric": True}  # notes stripped
    assert load_task("gsm8k", "train[:20%]", path=str(tmp_path / "g.jsonl")) == rows[:2]


def test_json_parquet_and_directory_paths(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    (tmp_path / "train.json").write_text(json.dumps(GSM))
    (tmp_path / "lines.json").write_text("\n".join(json.dumps(r) for r in GSM))  # datasets' to_json style
    pq.write_table(pa.Table.from_pylist(GSM), tmp_path / "test.parquet")
    expected = load_task("gsm8k", "train", path=_write_jsonl(tmp_path / "g.jsonl", GSM))
    assert load_task("gsm8k", "train", path=str(tmp_path / "train.json")) == expected
    assert load_task("gsm8k", "train", path=str(tmp_path / "lines.json")) == expected
    assert load_task("gsm8k", "test", path=str(tmp_path / "test.parquet")) == expected
    assert load_task("gsm8k", "test[:3]", path=str(tmp_path)) == expected[:3]  # directory -> test.parquet
    assert data._find_file("openai/gsm8k", "train") is None  # a hub name, not a file


@pytest.mark.parametrize("bad_row,match", [
    ({"question": "Q?"}, r"row 3: missing or empty field 'answer'"),
    ({"answer": "#### 5"}, r"row 3: missing or empty field 'question'"),
    ({"question": "Q?", "answer": "five"}, r"row 3: field 'answer' has no '#### <number>'"),
    ({"question": "Q?", "answer": "it is #### five"}, r"row 3: field 'answer' has no '#### <number>'"),
    ("{not json", r"row 3: not valid JSON"),
    ("[1, 2]", r"row 3: missing or empty field 'question'"),
])
def test_bad_rows_name_file_row_and_field(tmp_path, bad_row, match):
    path = _write_jsonl(tmp_path / "bad.jsonl", [GSM[0], GSM[1], bad_row])
    with pytest.raises(ValueError, match=match) as err:
        load_task("gsm8k", "train", path=path)
    assert "bad.jsonl" in str(err.value)


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_task("gsm8k", "train", path=str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="no test.jsonl"):
        load_task("gsm8k", "test", path=str(tmp_path))
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.jsonl: split 'train' selects no rows"):
        load_task("gsm8k", "train", path=str(tmp_path / "empty.jsonl"))
    with pytest.raises(ValueError, match="selects no rows"):
        load_task("gsm8k", "train[20:]", path=_write_jsonl(tmp_path / "g.jsonl", GSM))
    with pytest.raises(ValueError, match="takes no knobs"):
        load_task("gsm8k", "train", path=str(tmp_path / "g.jsonl"), steps=3)


def test_math_rows(tmp_path):
    rows = [
        {"problem": "P1", "solution": "so $\\boxed{\\frac{1}{2}}$", "answer": "\\frac12"},
        {"problem": "P2", "solution": "first \\boxed{1}, then \\boxed{\\{1, \\{2\\}\\}}."},
    ]
    got = load_task("math", "test", path=_write_jsonl(tmp_path / "m.jsonl", rows))
    assert [r["answer"] for r in got] == ["\\frac12", "\\{1, \\{2\\}\\}"]  # given answer; else last box, balanced
    assert [r["numeric"] for r in got] == [False, False]  # MATH answers may be expressions
    path = _write_jsonl(tmp_path / "bad.jsonl", rows + [{"problem": "P3", "solution": "no box here"}])
    with pytest.raises(ValueError, match=r"bad.jsonl: row 3: no field 'answer' and no \\boxed"):
        load_task("math", "test[:1]", path=path)  # every row is checked, not only the selected ones


# ---------------------------------------------------------------- prompts and SFT targets


def _tokenizer(template):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.chat_template = template
    return tok


CHAT = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def test_format_prompt_templates():
    prompt, prefix = format_prompt("What is 2+3?", "r1")
    assert prompt.startswith("A conversation between User and Assistant.")
    assert prompt.endswith("User: What is 2+3?\nAssistant: <think>") and prefix == "<think>"
    assert format_prompt("What is 2+3?", "short") == ("What is 2+3?\n<think>", "<think>")

    prompt, prefix = format_prompt("What is 2+3?", "chat", _tokenizer(CHAT))
    assert prompt.startswith("<|system|>") and "<answer>" in prompt
    assert prompt.endswith("<|user|>What is 2+3?\n<|assistant|>") and prefix == ""
    # a template that opens <think> itself (DeepSeek-R1 distills) -> the prompt already opened it
    _, prefix = format_prompt("Q", "chat", _tokenizer(CHAT.replace("<|assistant|>", "<|assistant|><think>\n")))
    assert prefix == "<think>"

    with pytest.raises(ValueError, match="chat template"):
        format_prompt("Q", "chat", _tokenizer(None))
    with pytest.raises(ValueError, match="chat template"):
        format_prompt("Q", "chat")
    with pytest.raises(ValueError, match="unknown template"):
        format_prompt("Q", "alpaca")


def test_sft_target_scores_full_reward():
    row = {"question": "What is 2+3?", "answer": "5", "solution": "2+3=5"}
    assert sft_target(row) == "2+3=5</think> <answer>5</answer>"
    assert sft_target(row, "") == "<think>2+3=5</think> <answer>5</answer>"
    assert parse_r1("<think>" + sft_target(row)) == ("2+3=5", "5")
    for row in load_task("arith", "train[:200]"):
        _, prefix = format_prompt(row["question"], "short")
        assert reward(prefix + sft_target(row, prefix), row["answer"])["correct"] == 1.0
    with pytest.raises(ValueError, match="no solution"):
        sft_target({"question": "Q", "answer": "1", "solution": None})


# ---------------------------------------------------------------- the real benchmarks (skipped without the data)


def _need(path: Path) -> str:
    if not path.exists():
        pytest.skip(f"{path} not present")
    return str(path)


def test_real_gsm8k_loads_and_targets_score():
    folder = _need(DATA / "gsm8k")
    train, test = load_task("gsm8k", "train", path=folder), load_task("gsm8k", "test", path=folder)
    assert (len(train), len(test)) == (7473, 1319)
    assert len(load_task("gsm8k", "train[:10%]", path=folder)) + len(load_task("gsm8k", "train[10%:]", path=folder)) \
        == 7473
    assert train[0]["answer"] == "72" and "<<" not in train[0]["solution"]
    for row in train + test:
        assert "<<" not in row["solution"] and "####" not in row["solution"]
        assert reward("<think>" + sft_target(row), row["answer"])["correct"] == 1.0


def test_real_math500_loads():
    path = _need(DATA / "math500" / "test.jsonl")
    rows = load_task("math", "test", path=path)
    assert len(rows) == 500 and len(load_task("math", "test[:400]", path=path)) == 400
    raw = [json.loads(line) for line in Path(path).read_text().splitlines()]
    assert [r["answer"] for r in rows] == [r["answer"].strip() for r in raw]
    for row in rows:
        assert reward("<think>" + sft_target(row), row["answer"])["correct"] == 1.0


def test_demo_default_splits_partition_train():
    """The demo's premise: SFT's worked solutions and GRPO's answer-only problems are disjoint and cover train, and
    neither stage's in-loop eval nor eval.py's default split reads a training question."""
    import eval as eval_script
    import grpo
    import sft

    sft_cfg, grpo_cfg, eval_cfg = sft.SFTConfig(), grpo.GRPOConfig(), eval_script.EvalConfig()
    sft_q = [r["question"] for r in load_task("arith", sft_cfg.split)]
    grpo_q = [r["question"] for r in load_task("arith", grpo_cfg.split)]
    assert len(sft_q) + len(grpo_q) == data.ARITH_DEFAULTS["train_size"]
    assert sft_q + grpo_q == [r["question"] for r in load_task("arith", "train")]
    held_out = {r["question"] for s in (sft_cfg.eval_split, grpo_cfg.eval_split, eval_cfg.split)
                for r in load_task("arith", s)}
    assert held_out.isdisjoint(sft_q) and held_out.isdisjoint(grpo_q)
