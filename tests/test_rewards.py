"""rewards.py: answer matching tables, strict R1 parsing, reward components, fuzzing, and the real GSM8K/MATH golds."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rewards
from rewards import answers_match, extract_answer, parse_r1, parse_weights, reward

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
TIME_BOUND_S = 1.0  # documented per-call bound; measured worst is ~10 ms, the slack is for a busy shared machine

# (prediction, gold, should match)
MATCH_CASES = [
    # plain numbers and the ways people write them
    ("72", "72", True),
    ("72.0", "72", True),
    ("72.00", "72", True),
    ("072", "72", True),
    ("+72", "72", True),
    ("$72", "72", True),
    ("\\$72", "72", True),
    ("72.", "72", True),
    ("72 clips", "72", True),
    ("72 dollars per hour", "72", True),
    ("1,000", "1000", True),
    ("1000", "1,000", True),
    ("10,\\!080", "10080", True),
    ("\\$32,\\!348", "32348", True),
    ("\\$18.90", "18.9", True),
    ("50%", "50", True),
    ("50\\%", "50", True),
    ("-3", "-3", True),
    ("−5", "-5", True),
    ("-0", "0", True),
    ("0", "0.0", True),
    (".0000672", "0.0000672", True),
    ("1.50", "1.5", True),
    # exact rationals
    ("1/2", "0.5", True),
    ("\\frac{1}{2}", "0.5", True),
    ("\\dfrac{1}{2}", "1/2", True),
    ("\\tfrac12", "1/2", True),
    ("\\frac 59", "5/9", True),
    ("\\frac9{19}", "9/19", True),
    ("\\frac{-3}{8}", "-\\frac{3}{8}", True),
    ("-3/8", "-0.375", True),
    ("1\\frac{4}{5}", "9/5", True),
    ("137 \\frac{1}{2}", "137.5", True),
    ("0.1", "1/10", True),
    ("1.5", "3/2", True),
    # MATH LaTeX
    ("\\boxed{5}", "5", True),
    ("The answer is \\boxed{\\frac{3}{56}}", "\\dfrac{3}{56}", True),
    ("\\text{Evelyn}", "Evelyn", True),
    ("Evelyn", "\\text{Evelyn}", True),
    ("x=5", "5", True),
    ("5", "x=5", True),
    ("90^\\circ", "90", True),
    ("90°", "90", True),
    ("\\frac{270}7\\text{ degrees}", "270/7", True),
    ("5.4 \\text{ cents}", "5.4", True),
    ("864 \\mbox{ inches}^2", "864", True),
    ("11\\sqrt2", "11\\sqrt{2}", True),
    ("2 \\sqrt{5}", "2\\sqrt5", True),
    ("\\cot x", "\\cot  x", True),
    ("2k+2", "2k + 2", True),
    ("p-q", "p - q", True),
    ("(C)", "\\text{(C)}", True),
    ("C", "\\text{(C)}", True),
    ("4210_5", "4210_{5}", True),
    ("x^{2}", "x^2", True),
    ("\\infty", "\\infty", True),
    ("\\begin{pmatrix} -1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}-1\\\\2\\end{pmatrix}", True),
    # tuples and intervals, element-wise in order
    ("(1,2)", "(1,2)", True),
    ("(1, 2)", "(1,2)", True),
    ("(0.5, 2)", "(\\frac{1}{2},2)", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True),
    ("(2,\\infty)", "(2, \\infty)", True),
    ("1,-2", "1, -2", True),
    ("3,5,7", "3, 5, 7", True),
    # negatives: near misses must not match
    ("18", "180", False),
    ("180", "18", False),
    ("1/2", "2", False),
    ("2", "1/2", False),
    ("-3", "3", False),
    ("10", "10.5", False),
    ("0.333", "1/3", False),
    ("\\pi", "3.14", False),
    ("1e5", "100000", False),
    ("50%", "0.5", False),
    ("(1,2)", "(2,1)", False),
    ("(1,2)", "(1,2,3)", False),
    ("(3,4]", "(3,4)", False),
    ("[3,4]", "(3,4)", False),
    ("1,-2", "-2,1", False),
    ("evelyn", "Evelyn", False),
    ("q-p", "p - q", False),
    ("2k", "2", False),
    ("3R^2", "3", False),
    ("\\cotx", "\\cot x", False),
    ("1/0", "0", False),
    ("", "5", False),
    ("5", "", False),
    ("   ", "5", False),
    ("\\boxed{}", "5", False),
    ("5,5", "55", False),
    ("72 clips and 3", "72", False),
]


@pytest.mark.parametrize("pred,gold,expected", MATCH_CASES)
def test_answers_match(pred, gold, expected):
    assert answers_match(pred, gold) is expected


def test_enough_cases():
    assert len(MATCH_CASES) >= 60 and len(PARSE_CASES) >= 20


# (response, expected parse_r1 result)
PARSE_CASES = [
    ("<think>2+2=4</think> <answer>4</answer>", ("2+2=4", "4")),
    ("<think>\n2+2=4\n</think>\n<answer> 4 </answer>\n", ("2+2=4", "4")),
    ("  <think>a</think><answer>b</answer>", ("a", "b")),
    ("<think>a</think> <answer>b</answer><|endoftext|>", ("a", "b")),
    ("<think>a</think> <answer>b</answer> <eos>\n", ("a", "b")),
    ("<think>x < 3 and y > 2</think> <answer>x<3</answer>", ("x < 3 and y > 2", "x<3")),
    # malformed
    ("", None),
    ("4", None),
    ("<answer>4</answer>", None),
    ("<think>a</think>", None),
    ("<think>a <answer>4</answer>", None),
    ("<think>a</think> <answer>4", None),
    ("<think>a</think> then <answer>4</answer>", None),
    ("text <think>a</think> <answer>4</answer>", None),
    ("<think>a</think> <answer>4</answer> more text", None),
    ("<think>a</think> <answer>4</answer><answer>5</answer>", None),
    ("<think>a</think> <answer>4</answer></answer>", None),
    ("<think>a</think> <answer>4</answer><|endoftext|><|endoftext|>", None),
    ("<Think>a</Think> <answer>4</answer>", None),
    ("< think>a</think> <answer>4</answer>", None),
    # reward hacking: empty reasoning, nesting, extra tags
    ("<think></think> <answer>4</answer>", None),
    ("<think>  \n </think> <answer>4</answer>", None),
    ("<think>a</think> <answer> </answer>", None),
    ("<think><think>a</think></think> <answer>4</answer>", None),
    ("<think>a <answer>3</answer></think> <answer>4</answer>", None),
    ("<think>a</think> <answer><think>4</answer>", None),
    ("<think>a</think></think> <answer>4</answer>", None),
    ("<think>" * 100_000, None),
    ("<think>a</think> <answer>" + "4" * 10_000 + "</answer>", ("a", "4" * 10_000)),
]


@pytest.mark.parametrize("response,expected", PARSE_CASES)
def test_parse_r1(response, expected):
    assert parse_r1(response) == expected


def test_reward_components_and_weights():
    good = "<think>6*7=42</think> <answer>42</answer>"
    assert reward(good, "42") == {"reward": 1.1, "correct": 1.0, "format": 1.0, "overlong": 0.0}
    assert reward("<think>6*7=41</think> <answer>41</answer>", "42")["reward"] == pytest.approx(0.1)
    # no format, no correctness: the answer is only read from a well-formed response
    assert reward("42", "42") == {"reward": 0.0, "correct": 0.0, "format": 0.0, "overlong": 0.0}
    assert reward("<think></think> <answer>42</answer>", "42")["reward"] == 0.0
    assert reward(good, "42", {"format": 0.0})["reward"] == 1.0  # unnamed weights keep their defaults
    assert reward(good, "42", parse_weights("correct=2,format=0.5"))["reward"] == 2.5
    with pytest.raises(ValueError, match="unknown reward weights"):
        reward(good, "42", {"corect": 1.0})


def test_overlong_penalty():
    good = "<think>a</think> <answer>1</answer>"
    w = {"overlong": 1.0}
    # max 100 tokens, soft buffer = the last 25: no penalty up to 75, linear to -1 at 100, -1 beyond
    assert reward(good, "1", w, num_tokens=75, max_tokens=100)["overlong"] == 0.0
    assert reward(good, "1", w, num_tokens=90, max_tokens=100)["overlong"] == pytest.approx(-0.6)
    assert reward(good, "1", w, num_tokens=100, max_tokens=100)["overlong"] == -1.0
    assert reward(good, "1", w, num_tokens=500, max_tokens=100)["overlong"] == -1.0
    assert reward(good, "1", w, num_tokens=90, max_tokens=100)["reward"] == pytest.approx(1.1 - 0.6)
    assert reward(good, "1", num_tokens=100, max_tokens=100)["reward"] == pytest.approx(1.1)  # weight 0 by default
    assert reward(good, "1", w)["overlong"] == 0.0  # no lengths given


def test_parse_weights():
    assert parse_weights("") == rewards.DEFAULT_WEIGHTS
    assert parse_weights("correct=1, format=0.25,overlong=0.5") == {"correct": 1.0, "format": 0.25, "overlong": 0.5}
    for bad in ("correct", "speed=1", "format=lots"):
        with pytest.raises(ValueError, match="bad reward weight"):
            parse_weights(bad)


def test_extract_answer_votes_equal_answers_together():
    wrap = "<think>r</think> <answer>{}</answer>".format
    assert extract_answer(wrap("0.50")) == extract_answer(wrap("\\frac{1}{2}")) == extract_answer(wrap("1/2")) == "1/2"
    assert extract_answer(wrap("1,000 apples")) == extract_answer(wrap("1000")) == "1000"
    assert extract_answer(wrap("(0.5, 2)")) == extract_answer(wrap("\\left(\\frac12,2\\right)")) == "(1/2,2)"
    assert extract_answer(wrap("\\text{Evelyn}")) == "Evelyn"
    assert extract_answer("no format 42") is None
    for answer in ("0.50", "(0.5, 2)", "\\frac{\\pi}{2}", "x=3"):  # the voted key is itself a checkable answer
        assert answers_match(extract_answer(wrap(answer)), answer)


def test_rewards_does_not_import_torch():
    code = "import sys, rewards; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------- fuzzing: never raises, bounded time


def _timed_all(text: str) -> None:
    """Every public entry point on `text`, each call under TIME_BOUND_S, none raising."""
    wrapped = f"<think>r</think> <answer>{text}</answer>"
    calls = [
        lambda: parse_r1(text),
        lambda: parse_r1(wrapped),
        lambda: answers_match(text, text),
        lambda: answers_match(text, "1/2"),
        lambda: answers_match("(1,2)", text),
        lambda: extract_answer(wrapped),
        lambda: reward(wrapped, text, num_tokens=len(text), max_tokens=100),
    ]
    for call in calls:
        start = time.perf_counter()
        call()
        assert time.perf_counter() - start < TIME_BOUND_S


FRAGMENTS = ["<think>", "</think>", "<answer>", "</answer>", "{", "}", "\\boxed{", "\\frac", "\\frac{", "\\text{",
             "\\sqrt", "\\left(", "\\right)", "(", ")", "[", ",", "1", "9" * 50, "/", ".", "-", "+", "$", "%", "\\",
             "\\!", " ", "\n", "x=", "^\\circ", " cm", "é", "∞", "−", "\u200b", "😀", "<|endoftext|>"]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


@FUZZ
@given(st.text(max_size=3000))
def test_fuzz_arbitrary_text(text):
    _timed_all(text)


@FUZZ
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=400).map("".join))
def test_fuzz_adversarial_fragments(text):
    _timed_all(text)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.sampled_from(FRAGMENTS), st.sampled_from([10, 150, 333, 999, 100_000]))
def test_fuzz_long_repeats(fragment, count):
    # deep nesting and 100k repeated tags/braces/digits, just under and far over the answer cap
    _timed_all(fragment * count)


# ---------------------------------------------------------------- the real benchmarks (skipped without the data)


def _jsonl(path):
    if not path.exists():
        pytest.skip(f"{path} not present")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("split", ["train", "test"])
def test_gsm8k_golds_score_correct(split):
    rows = _jsonl(DATA / "gsm8k" / f"{split}.jsonl")
    misses = []
    for row in rows:
        written = row["answer"].split("####")[-1].strip()  # as printed, e.g. "1,080"
        gold = written.replace(",", "")
        if reward(f"<think>{row['answer']}</think> <answer>{written}</answer>", gold)["correct"] != 1.0:
            misses.append(written)
    assert not misses, misses[:10]


def test_math500_golds_match_themselves():
    rows = _jsonl(DATA / "math500" / "test.jsonl")
    misses = []
    for row in rows:
        gold = row["answer"]
        boxed_ok = answers_match(f"The answer is $\\boxed{{{gold}}}$.", gold)
        block_ok = reward(f"<think>work</think> <answer>{gold}</answer>", gold)["correct"] == 1.0
        solution_ok = answers_match(rewards.last_boxed(row["solution"]) or "", gold)  # the solution's own \boxed{}
        if not (boxed_ok and block_ok and solution_ok):
            misses.append(gold)
    assert not misses, misses[:10]
