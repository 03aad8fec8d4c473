"""rewards.py and verifier.py: answer matching tables, strict R1 parsing, reward components, fuzzing, real golds."""

import ast
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rewards
import verifier
from rewards import extract_answer, parse_r1, parse_weights, reward
from verifier import answers_match

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
    ("1,-2", "-2,1", True),  # a bare list is "all the solutions, separated by commas": order-free
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


# Copying the question (#45 item 6): where the task's answers are numbers (arith, gsm8k: numeric=True) an answer
# must be a number, however it is written; an expression that evaluates to the gold is not one. Where answers
# are expressions (math: numeric=False) it still counts.
ANSWER_FORMS = [
    # (answer, gold, numeric, correct)
    ("82-18+20", "84", True, False),  # arith: the question "What is 82-18+20?" copied
    ("82-18+20", "84", False, True),
    ("6*7", "42", True, False),
    ("2 \\cdot 21", "42", True, False),
    ("40+2 apples", "42", True, False),
    ("\\sqrt{1764}", "42", True, False),
    ("84", "84", True, True),
    ("$84", "84", True, True),
    ("84 apples", "84", True, True),
    ("84.00", "84", True, True),
    ("\\boxed{84}", "84", True, True),
    ("1,000", "1000", True, True),
    ("x = 84", "84", True, True),
    ("3/4", "0.75", True, True),
    ("-3", "-3", True, True),
    ("85", "84", True, False),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{\\sqrt{3}}{2}", False, True),  # math keeps its expressions
    ("x = 82-18+20 = 84", "84", True, True),  # a chain from a variable: its last member, a number (#49)
    ("x \\approx 84", "84", True, True),
    ("82-18+20 = 84", "84", True, False),  # no variable first: a relation, not a number
    ("x = 84 = 82-18+20", "84", True, False),  # the last member is an expression
]


@pytest.mark.parametrize("answer, gold, numeric, correct", ANSWER_FORMS)
def test_numeric_answer_form(answer, gold, numeric, correct):
    assert answers_match(answer, gold, numeric=numeric) is correct
    got = reward(f"<think>x</think> <answer>{answer}</answer>", gold, numeric=numeric)
    assert got["correct"] == float(correct) and got["format"] == 1.0


def test_copying_the_question_scores_nothing_on_arith():
    from data import load_task
    rows = load_task("arith", "test[:200]")
    assert all(r["numeric"] for r in rows)
    copies = [f"<think>x</think> <answer>{r['question'][len('What is '):-1]}</answer>" for r in rows]
    assert sum(reward(c, r["answer"])["correct"] for c, r in zip(copies, rows)) == len(rows)  # by value: all
    assert sum(reward(c, r["answer"], numeric=r["numeric"])["correct"] for c, r in zip(copies, rows)) == 0


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
    for bad in ("correct=nan", "format=inf", "overlong=-inf", "correct=1e999", "format=NaN"):
        with pytest.raises(ValueError, match="in --reward_weights: the weight must be a finite number"):
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


def test_rewards_does_not_import_torch_or_sympy():
    code = ("import sys, rewards, verifier; verifier.answers_match('\\\\sqrt8', '2\\\\sqrt2'); "
            "print([m for m in ('torch', 'sympy', 'math_verify') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_rewards_never_evaluates_text():
    # no call of eval/exec/compile/__import__ anywhere in rewards.py or verifier.py: answers are parsed, never run
    for module in (rewards, verifier):
        tree = ast.parse(Path(module.__file__).read_text())
        called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
        assert not called & {"eval", "exec", "compile", "__import__"}


# ---------------------------------------------------------------- the answer grammar: values, not strings
# Each pair is written by hand from the mathematics (not from this code's output): EQUIVALENT pairs are the same
# answer, DIFFERENT pairs are not, whatever their surface similarity.

EQUIVALENT = [
    # delimiters and wrappers a model puts around the answer
    ("\\( 9 \\)", "9"), ("\\[ 9 \\]", "9"), ("$$ 9 $$", "9"), ("$9$", "9"), ("\\(\\frac{1}{2}\\)", "0.5"),
    ("\\left( \\frac{1}{3} \\right)", "\\frac13"), ("\\cfrac{1}{3}", "1/3"), ("\\displaystyle\\frac{2}{3}", "2/3"),
    ("12 \\textnormal{ miles}", "12"), ("5 \\mbox{ cm}^2", "5"), ("2\\sqrt{2} \\text{ cm}", "2\\sqrt2"),
    ("\\frac{\\pi}{3} \\text{ radians}", "\\frac{\\pi}{3}"), ("10{,}080", "10080"), ("\\textbf{7}", "7"),
    # a trailing equation
    ("x = 11", "11"), ("k=1", "1"), ("\\theta = \\frac{\\pi}{4}", "\\frac{\\pi}{4}"), ("a_1 = 3", "3"),
    ("n = 2\\sqrt{3}", "\\sqrt{12}"), ("11", "x=11"),
    # sums and products reordered
    ("15+2\\sqrt{33}", "2\\sqrt{33}+15"), ("6-5i", "-5i+6"), ("3+4i", "4i+3"), ("x+y", "y+x"), ("ab", "ba"),
    ("2x", "x \\cdot 2"), ("2 \\times 3", "6"), ("-13x+3", "3-13x"), ("a-b+c", "c+a-b"), ("2xy", "y \\cdot 2x"),
    # fractions combined or split
    ("\\frac{x}{7}+\\frac{2}{7}", "\\frac{x+2}{7}"), ("\\frac{1}{2}+\\frac{1}{3}", "\\frac{5}{6}"),
    ("\\frac{3}{6}", "\\frac12"), ("\\frac{-1}{2}", "-\\frac12"), ("\\frac{1}{-2}", "-0.5"), ("6/4", "3/2"),
    ("\\frac{2x}{4}", "\\frac{x}{2}"), ("\\frac{x^2-1}{x-1}", "x+1"), ("\\frac{1}{x}+\\frac{1}{y}", "\\frac{x+y}{xy}"),
    ("\\frac{\\frac{1}{2}}{3}", "\\frac16"), ("\\frac{4}{\\sqrt{2}}", "2\\sqrt{2}"), ("1\\frac{1}{2}", "\\frac32"),
    # radicals
    ("\\sqrt8", "2\\sqrt2"), ("\\sqrt{12}", "2\\sqrt{3}"), ("\\sqrt{4}", "2"), ("\\sqrt[3]{8}", "2"),
    ("\\sqrt[3]{-27}", "-3"), ("\\sqrt{\\frac{1}{4}}", "\\frac12"), ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt3"),
    ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"), ("\\sqrt{2}\\sqrt{3}", "\\sqrt6"), ("\\sqrt{50}", "5\\sqrt{2}"),
    ("2^{1/2}", "\\sqrt2"), ("8^{2/3}", "4"), ("\\sqrt{18}+\\sqrt{2}", "4\\sqrt2"), ("3\\sqrt{3}", "\\sqrt{27}"),
    ("\\frac{2}{\\sqrt{3}-1}", "\\sqrt{3}+1"), ("\\sqrt{-4}", "2i"), ("(1+\\sqrt{5})/2", "\\frac{1+\\sqrt5}{2}"),
    # powers, pi, e, functions
    ("2^{10}", "1024"), ("x^2 \\cdot x^3", "x^5"), ("(x+1)^2", "x^2+2x+1"), ("x^{-1}", "\\frac1x"), ("2^{-2}", "0.25"),
    ("\\pi r^2", "r^2\\pi"), ("2\\pi", "\\pi+\\pi"), ("\\frac{\\pi}{2}", "0.5\\pi"),
    ("\\frac{3\\pi}{4}", "\\frac34\\pi"),
    ("e^2", "e \\cdot e"), ("e^{i\\pi}", "-1"), ("\\sin^2 x + \\cos^2 x", "1"), ("\\ln(e^3)", "3"),
    ("\\log_2 8", "3"), ("5!", "120"), ("\\frac{6!}{4!}", "30"), ("|-3|", "3"), ("(2+i)(2-i)", "5"), ("i^2", "-1"),
    ("\\sin(\\pi/6)", "\\frac12"), ("\\alpha + \\beta", "\\beta + \\alpha"),
    ("4\\pi\\sqrt{3}", "\\sqrt{48}\\pi"),
    # decimals against decimals, exact rationals
    ("0.5", "\\frac{1}{2}"), ("1.25", "\\frac54"), ("0.125", "1/8"), ("-2.5", "-\\frac52"), ("3.0", "3"),
    ("2.50", "5/2"), ("\\frac{0.5}{2}", "0.25"),
    # relations and inequalities written from the other side
    ("5 \\geq x", "x \\leq 5"), ("x > 3", "3 < x"), ("1 < x < 2", "2 > x > 1"), ("y = 2x+3", "y = 3+2x"),
    ("2x+3 = y", "y = 2x + 3"), ("x \\ge -1", "-1 \\le x"), ("a \\neq b", "b \\ne a"), ("x<5", "x \\lt 5"),
    # inequalities against intervals
    ("x \\le 5", "(-\\infty, 5]"), ("x > 2", "(2, \\infty)"), ("1 \\le x < 3", "[1, 3)"), ("-2 < x \\le 0", "(-2,0]"),
    ("x \\in [0, 1]", "[0,1]"), ("x\\geq \\frac12", "[0.5,\\infty)"),
    # tuples and intervals in order, values compared inside
    ("(1, \\sqrt{4})", "(1,2)"), ("(\\frac12, 0.25)", "(0.5, \\frac14)"), ("[\\sqrt2, \\pi)", "[2^{1/2}, \\pi)"),
    ("(3, \\frac{\\pi}{2})", "\\left( 3, \\frac{\\pi}{2} \\right)"), ("(-\\infty, 0)", "(-\\infty,0)"),
    ("(x+1, 2)", "(1+x, 2)"),
    # sets, bare lists and unions are order-free
    ("-2,1", "1,-2"), ("3, 5, 7", "7, 3, 5"), ("\\{1,2\\}", "\\{2,1\\}"), ("\\{1, 2, 3\\}", "3,1,2"),
    ("\\sqrt2, -\\sqrt2", "-\\sqrt{2}, \\sqrt{2}"), ("(9,36) \\cup (0,9)", "(0,9) \\cup (9,36)"),
    ("(-\\infty, 2) \\cup (3, \\infty)", "(3,\\infty)\\cup(-\\infty,2)"), ("\\emptyset", "\\{\\}"),
    ("1 \\pm \\sqrt{2}", "1+\\sqrt2, 1-\\sqrt2"), ("\\pm 3", "3, -3"), ("11,\\! 111,\\! 100", "11111100"),
    # matrices element-wise
    ("\\begin{pmatrix} 16/49 \\\\ 48/49 \\end{pmatrix}",
     "\\begin{pmatrix}\\frac{16}{49}\\\\\\frac{48}{49}\\end{pmatrix}"),
    ("\\begin{pmatrix} 1 & \\sqrt4 \\\\ 0 & 1 \\end{pmatrix}", "\\begin{pmatrix}1&2\\\\0&1\\end{pmatrix}"),
    # thousands, kept for GSM8K
    ("1,000", "1000"), ("10,\\!080", "10080"), ("-1,234", "-1234"), ("\\$1,000.50", "1000.5"),
    # relation notation (#49): ASCII, LaTeX and Unicode spellings of one relation
    ("x >= 5", "x \\geq 5"), ("x \\ge 5", "x \\geq 5"), ("x <= 5", "x \\leq 5"), ("x\\le 5", "x <= 5"),
    ("a != b", "a \\neq b"), ("a \\ne b", "a != b"), ("x \\gt 3", "x > 3"), ("x \\lt 3", "x < 3"), ("x ≥ 5", "x >= 5"),
    ("x ≤ 5", "x \\le 5"), ("a ≠ b", "a \\ne b"), ("x >= 5", "[5, \\infty)"), ("-1 <= x < 3", "[-1, 3)"),
    ("x \\geqslant 2", "x >= 2"),
    # both sides times -1 (the direction flips), and a chain of two
    ("-x > -1", "x < 1"), ("-x \\geq -5", "x \\leq 5"), ("-2 < -x < -1", "1 < x < 2"), ("-y \\ne 3", "y \\ne -3"),
    # chains from a variable: the last member is the answer; with \\approx the exact member, and its rounding
    # against a rounded gold (#49)
    ("x = 1/3 \\approx 0.33", "0.33"), ("\\theta = \\frac{\\pi}{2} \\approx 1.57", "1.57"),
    ("x = \\frac23 \\approx 0.66", "0.66"),
    ("x = 5+5+1 = 11", "11"), ("x = 5+5+1 = 11", "x = 11"), ("x = 5 + 6 = 7 + 4 = 11", "11"), ("x \\approx 11", "11"),
    ("x = 5+5+1 = 7 = 11", "11"), ("x = 2/6 = 1/3 \\approx 0.33", "\\frac13"),
    ("x ≈ 11", "11"), ("x = 1/3 \\approx 0.33", "1/3"), ("x = \\frac{1}{3} \\approx 0.333", "\\frac13"),
    ("a_1 = 2+1 = 3", "3"), ("\\theta = \\frac{\\pi}{2} \\approx 1.57", "\\frac{\\pi}{2}"),
    # equations up to a nonzero factor or rearrangement (f = lhs - rhs proportional at the seeded points)
    ("-5x + 7y - 11z - 4 = 0", "5x - 7y + 11z + 4 = 0"), ("\\frac{x^2}{4} + y^2 = 1", "x^2 + 4y^2 = 4"),
    ("y = 2x + 3", "2x - y + 3 = 0"), ("y = -2x", "2x + y = 0"), ("2x + 4y = 3", "x + 2y = \\frac32"),
    ("10x - 14y + 22z + 8 = 0", "5x - 7y + 11z + 4 = 0"), ("x + y = 1", "y = 1 - x"), ("2x = 10", "x = 5"),
    ("y = \\frac{1}{2}x - 1", "x - 2y - 2 = 0"), ("2x < 4", "x < 2"), ("-3x \\le 6", "x \\ge -2"),
]

DIFFERENT = [
    # near misses in value
    ("\\sqrt8", "\\sqrt2"), ("2\\sqrt3", "3\\sqrt2"), ("15+2\\sqrt{33}", "15+3\\sqrt{33}"),
    ("\\frac{x}{7}", "\\frac{x}{8}"), ("\\frac{x+2}{7}", "\\frac{x}{7}+2"), ("\\frac{1}{12}", "\\frac{1}{13}"),
    ("\\pi", "2\\pi"), ("\\frac{\\pi}{2}", "\\frac{\\pi}{3}"),
    ("e^2", "e^3"), ("2^{10}", "1023"), ("\\sqrt{4}", "-2"), ("\\sqrt[3]{8}", "3"), ("\\sqrt[3]{9}", "\\sqrt{3}"),
    ("(x+1)^2", "x^2+1"), ("x^2", "2x"), ("x^3", "x^2"), ("\\frac{1}{x}", "x"), ("x+y", "x-y"), ("x-y", "y-x"),
    ("xy", "x+y"), ("2x", "x^2"), ("x", "y"), ("a", "b"), ("k", "1"), ("3R^2", "3R"), ("\\sin x", "\\cos x"),
    ("\\sin^2 x", "\\sin x"), ("\\ln 2", "\\ln 3"), ("5!", "5"), ("|x|", "x+1"), ("i", "1"), ("3+4i", "3-4i"),
    ("6-5i", "6+5i"), ("2i", "2"), ("\\alpha", "\\beta"), ("x_1", "x_2"), ("-\\frac{1}{2}", "\\frac{1}{2}"),
    ("1\\frac{1}{2}", "\\frac12"), ("\\frac{1}{2}\\frac{1}{2}", "\\frac14 + 1"), ("10^{100}", "10^{100}+1"),
    ("2^{1/2}", "2^{1/3}"), ("8^{2/3}", "8^{3/2}"), ("\\sqrt{-4}", "2"), ("e^{i\\pi}", "1"),
    # decimals are approximations (exact tasks): not equal to the irrational they round
    ("\\pi", "3.14"), ("\\pi", "3.14159265358979"), ("\\sqrt{2}", "1.414"), ("\\sqrt2", "1.4142135623730951"),
    ("\\frac{1}{3}", "0.333"), ("\\frac{1}{3}", "0.333333"), ("\\frac{1}{12}", "0.0833"),
    ("e", "2.718281828459045"), ("\\frac{2}{3}", "0.67"), ("0.1", "0.10000001"),
    # relations
    ("x < 5", "x \\le 5"), ("x > 5", "x < 5"), ("x \\ge 3", "x \\le 3"), ("1 < x < 2", "1 \\le x \\le 2"),
    ("y = 2x+3", "y = 2x-3"), ("y = x", "y = 2x"), ("x = 11", "12"), ("x = 5", "y = 5"),
    ("a \\ne b", "a = b"), ("x < 5", "5"),
    ("x \\le 5", "(-\\infty, 5)"), ("x > 2", "[2, \\infty)"), ("x > 2", "(-\\infty, 2)"), ("1 \\le x < 3", "[1, 3]"),
    ("15 < x < -29", "(15, -29)"), ("x < 2 < 1", "(2, 1)"),
    # tuples, intervals: order and brackets matter
    ("(1,2)", "(2,1)"), ("(1,2)", "[1,2]"), ("(3,4]", "(3,4)"), ("[0,1)", "(0,1]"), ("(1,2)", "(1,2,3)"),
    ("(1,\\sqrt2)", "(1,\\sqrt3)"), ("(2, \\infty)", "(2, -\\infty)"), ("(-\\infty, 2)", "(-\\infty, 3)"),
    ("(1,2)", "1,2"), ("(0, \\infty)", "(0, 100)"),
    # sets, lists, unions
    ("1,2", "1,2,3"), ("1,2", "1,3"), ("1,1,2", "1,2,2"), ("\\{1,2\\}", "\\{1,3\\}"), ("\\sqrt2,-\\sqrt2", "\\sqrt2"),
    ("(0,9) \\cup (9,36)", "(0,36)"), ("(0,9) \\cup (9,36)", "(0,9) \\cup [9,36)"), ("\\emptyset", "0"),
    ("32, 349", "32349"), ("1 \\pm \\sqrt{2}", "1+\\sqrt2"), ("\\pm 3", "3"), ("1, 000", "1000"), ("5,5", "55"),
    # relation notation (#49): the strict and the non-strict relation are different answers
    ("x > 5", "x >= 5"), ("x > 5", "x \\geq 5"), ("x < 5", "x <= 5"), ("x \\lt 5", "x \\le 5"), ("x ≥ 5", "x > 5"),
    ("a != b", "a = b"), ("x >= 5", "x <= 5"), ("x >= 5", "(5, \\infty)"), ("x \\gt 3", "x \\ge 3"),
    ("-x > -1", "x > 1"), ("-x > -1", "x > -1"), ("-x < 1", "x < -1"), ("-2 < -x < -1", "-2 < x < -1"),
    ("-2x < 4", "x < -2"), ("2x < 4", "x > 2"),
    # chains: the last member counts; an approximation answers a rounded gold only if it is the exact member's
    # rounding or cut-off (#49)
    ("x = 5+5+1 = 11", "12"), ("x = 5+5+1 = 11", "x = 10"), ("x \\approx 11", "12"), ("x = 1/3 \\approx 0.5", "0.5"),
    ("x = 1/3 \\approx 0.33", "0.34"), ("\\theta = \\frac{\\pi}{2} \\approx 1.58", "1.58"),
    ("x = 2/3 \\approx 0.65", "0.65"), ("x = y + 1 \\approx 2.5", "2.5"),
    ("x = 5+5+1 = 11", "y = 11"), ("x \\approx 0.33", "\\frac13"),
    ("x = 1 \\quad y = 2", "2"), ("x = 1, y = 2 = 2", "2"), ("x = y = 5", "5"), ("x = 2y + 1 = 7", "7"),
    # equations: a different constant, a different slope, a power, or no variable at all
    ("2x + 4y = 3", "2x + 4y = 6"), ("y = 2x + 3", "y = 2x - 3"), ("y = 2x + 3", "2x + y + 3 = 0"), ("y = x", "y = 2x"),
    ("x = 2", "x^2 = 4"), ("x^2 + 4y^2 = 4", "x^2 + 4y^2 = 1"), ("5x - 7y + 11z + 4 = 0", "5x - 7y + 11z - 4 = 0"),
    ("1 = 2", "2 = 4"), ("x + y = 1", "x + z = 1"),
    # matrices
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}2\\\\1\\end{pmatrix}"),
    ("\\begin{pmatrix}1&2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    # words, text and malformed input are never read as arithmetic
    ("even", "neve"), ("odd", "dod"), ("\\text{even}", "\\text{odd}"), ("Evelyn", "evelyn"), ("cat", "act"),
    ("\\cot\0x", "\\cot x"), ("\\cotx", "\\cot x"), ("1/0", "0"), ("\\frac{1}{0}", "\\frac{2}{0}"), ("0/0", "0/0 + 1"),
    ("x/0", "y/0"), ("\\infty", "-\\infty"), ("\\infty", "10^{100}"), ("\\frac{\\infty}{2}", "\\infty"),
    ("((((1))))", "2"), ("1e5", "100000"), ("2^{100000}", "2^{100001}"), ("9^{9^{9}}", "9^{9^{9}}+1"),
    ("(1", "1"), ("1)", "1"), ("\\sqrt", "\\sqrt{}"), ("x=", "="), ("", "0"), ("{", "}"), ("\\frac{1}{2", "0.5"),
    ("A", "B"), ("(A)", "(B)"), ("\\text{(C)}", "D"),
]


@pytest.mark.parametrize("pred,gold", EQUIVALENT)
def test_equivalent_forms_match(pred, gold):
    assert answers_match(pred, gold) and answers_match(gold, pred)


@pytest.mark.parametrize("pred,gold", DIFFERENT)
def test_different_answers_stay_apart(pred, gold):
    assert not answers_match(pred, gold) and not answers_match(gold, pred)


def test_grammar_tables_are_large():
    assert len(EQUIVALENT) >= 100 and len(DIFFERENT) >= 100


# The answer inside a sentence (#49), one way round: (what the <answer> block holds, gold, numeric, correct).
# \boxed first; else, where there are prose words outside the math spans, what follows "answer", the trailing
# number (up to 4 words after it), the last math span. A numeric task still refuses an expression.
PROSE = [
    ("Answer \\[ 9 \\]", "9", False, True),
    ("Answer $$ 9 $$", "9", False, True),
    ("Answer: \\( \\frac{3}{4} \\)", "0.75", False, True),
    ("Therefore $x \\geq 5$ is the solution.", "x \\ge 5", False, True),
    ("Therefore $x \\geq 5$ is the solution.", "[5, \\infty)", False, True),
    ("Final Answer: The largest $n$ is 34.", "34", False, True),
    ("Final Answer: The largest $n$ is 34.", "34", True, True),
    ("The answer is 42.", "42", True, True),
    ("The answer is: 42", "42", True, True),
    ("answer = 42", "42", True, True),
    ("The answer is 42, found in 3 steps.", "42", True, True),
    ("The answer is $\\frac12$, because $2 \\cdot \\frac12 = 1$.", "1/2", False, True),
    ("The final answer is x^2 + 1.", "x^2+1", False, True),
    ("The answer is Evelyn.", "\\text{Evelyn}", False, True),
    ("The answer is (C).", "\\text{(C)}", False, True),
    ("The answer is −5.", "-5", True, True),
    ("The answer is \\boxed{7}, not 8.", "7", False, True),  # \boxed first
    ("$18 dollars", "18", True, True),
    ("18 USD", "18", True, True),
    ("It costs 5 euros", "5", True, True),
    ("It costs 1000,99 euros.", "1000.99", True, True),
    ("The total is \\$1,000.99 dollars.", "1000.99", True, True),
    ("\\$18.90 is the price", "18.9", True, True),
    ("She has 18 dollars per hour left.", "18", True, True),
    ("x = 5 is the answer", "5", True, True),
    ("Thus x = 84.", "84", True, True),
    ("For $n = 3$ there are 2 solutions.", "2", True, True),
    ("So $x = 5+5+1 = 11$.", "11", False, True),
    ("The solution set is $(-\\infty, 2) \\cup (3, \\infty)$.", "(-\\infty,2)\\cup(3,\\infty)", False, True),
    # must differ: the wrong member of the sentence, a number that is part of an expression, near misses
    ("Answer \\[ 9 \\]", "8", False, False),
    ("Final Answer: The largest $n$ is 34.", "n", False, False),
    ("The answer is 42, not 24.", "24", True, False),
    ("Therefore $x \\geq 5$ is the solution.", "x > 5", False, False),
    ("It costs 5 euros", "50", True, False),
    ("3 \\sqrt{2} inches", "3", False, False),  # not a trailing number: an expression follows it
    ("2\\sqrt{2} inches", "2", False, False),
    ("72 clips and 3", "72", True, False),
    ("72 clips and 3", "3", True, False),  # two numbers: no trailing-number guess
    ("x = 1 and y = 2", "2", True, False),
    ("y = x + 3 is the line", "3", False, False),  # the number ends an expression
    ("The answer is 3 + x, clearly.", "3", False, False),
    ("The answer is 3 x, clearly.", "3", False, False),
    ("It is 5 x", "5", False, False),
    ("$x = 1$ and y is 2", "1", False, False),
    ("The answer is 1,000.", "1", True, False),
    ("The answer is 1.000 dollars.", "1000", True, False),
    ("The answer is not given by any number here.", "42", True, False),
    # a numeric task still needs a number: the question copied into a sentence is not one
    ("The answer is 82-18+20.", "84", True, False),
    ("It is $82-18+20$.", "84", True, False),
    ("The answer is $6 \\cdot 7$.", "42", True, False),
    ("The answer is 82-18+20.", "84", False, True),  # math answers may be expressions
]


@pytest.mark.parametrize("answer, gold, numeric, correct", PROSE)
def test_answer_inside_a_sentence(answer, gold, numeric, correct):
    assert answers_match(answer, gold, numeric=numeric) is correct
    got = reward(f"<think>x</think> <answer>{answer}</answer>", gold, numeric=numeric)
    assert got["correct"] == float(correct)


def test_mathematics_is_never_cut():
    # final_answer leaves an answer alone unless it has prose words outside its math spans
    for answer in ["72", "x \\geq 5", "\\text{Evelyn}", "Evelyn", "5 \\text{ cm}", "2xy", "\\cot x", "1,-2",
                   "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "864 \\mbox{ inches}^2", "x \\in [0, 1]", "$x$ = $5$",
                   "\\frac{270}7\\text{ degrees}", "y = 2x + 3", "\\$32,\\!348", "(3, \\frac{\\pi}{2})", "5 cm"]:
        assert verifier.final_answer(answer) == answer


# Decimal commas (#49), one way round: (pred, gold, match). A prediction that is digits, one comma, digits, and no
# thousands separator ("1000,99", "1,22": not 3 digits after the comma; "0,111": no thousands group starts with 0)
# is a decimal when its gold is one number, since a list could never equal that gold. Against a list gold
# ("-2,1", MATH's "all solutions") it stays a list; "1,000" is always one thousand (an English context), never 1.000.
DECIMAL_COMMAS = [
    ("1000,99", "1000.99", True),
    ("1,22", "1.22", True),
    ("0,111", "0.111", True),
    ("0,5", "\\frac12", True),
    ("-2,1", "-2.1", True),
    ("1000,99 euros", "1000.99", True),
    ("1,22 cm", "1.22", True),
    ("1,000.99", "1000.99", True),  # thousands and a decimal point together
    ("\\$1,000.99", "1000.99", True),
    ("58,500", "58500", True),
    ("1,000", "1000", True),
    # must differ
    ("1,000", "1.000", False),
    ("1,000", "1", False),
    ("1,234", "1.234", False),
    ("1.000", "1,000", False),
    ("0,111", "111", False),
    ("1000,99", "100099", False),
    ("1,22", "122", False),
    ("1,22", "1.2", False),
    ("32, 349", "32.349", False),  # a space after the comma: a list
    ("32, 349", "32349", False),
    ("-2.1", "-2,1", False),  # the gold is the list -2, 1
    ("1,5", "1,-5", False),
    ("1,2,3", "1.23", False),
    ("1,000,99", "1000.99", False),
]


@pytest.mark.parametrize("pred,gold,expected", DECIMAL_COMMAS)
def test_decimal_commas(pred, gold, expected):
    assert answers_match(pred, gold) is expected
    assert answers_match(pred, gold, numeric=True) is expected  # the comma is read before the numeric check


# Decimal against exact only within --reward_tolerance: (pred, gold, tolerance, match)
TOLERANCE_CASES = [
    ("0.0833333333333333", "\\frac{1}{12}", 1e-9, True),
    ("0.0833333333333333", "\\frac{1}{12}", 0.0, True),  # a float print of 1/12 (FLOAT_PRINT_DIGITS, #49)
    ("0.0833333", "\\frac{1}{12}", 0.0, False),  # 6 significant digits: a hand rounding
    ("3.14159265358979", "\\pi", 1e-9, True),
    ("3.14", "\\pi", 1e-9, False),
    ("3.14", "\\pi", 1e-3, True),
    ("1.414", "\\sqrt2", 1e-3, True),
    ("1.414", "\\sqrt2", 1e-4, False),
    ("0.333", "\\frac13", 1e-2, True),
    ("0.333", "\\frac13", 1e-4, False),
    ("(0.5, 1.7320508)", "(\\frac12, \\sqrt3)", 1e-6, True),
    ("7", "7.0000001", 1e-6, True),
    ("7", "8", 0.1, False),  # 1/8 relative error
    # why the default stays 0 and 1e-12 is the evaluation setting (docs/answer_checking.md, #49): 1e-6 admits
    # hand roundings and off-by-one integers; 1e-12 admits only full float prints
    ("1000001", "1000000", 1e-6, True),
    ("0.333333", "\\frac13", 1e-6, True),
    ("1000001", "1000000", 1e-12, False),
    ("0.333333", "\\frac13", 1e-12, False),
    ("3.14159", "\\pi", 1e-12, False),
    ("0.0833333333333333", "\\frac{1}{12}", 1e-12, True),
    ("1.4142135623730951", "\\sqrt2", 1e-12, True),
    ("\\begin{pmatrix} 0.3333333333333333 \\\\ 0.5 \\end{pmatrix}", "\\begin{pmatrix} 1/3 \\\\ 1/2 \\end{pmatrix}",
     1e-12, True),
    ("[0.3333333333333333, 0.6666666666666666]", "[\\frac13, \\frac23]", 1e-12, True),
]


@pytest.mark.parametrize("pred,gold,tolerance,expected", TOLERANCE_CASES)
def test_reward_tolerance(pred, gold, tolerance, expected):
    assert answers_match(pred, gold, tolerance) is expected
    wrapped = f"<think>r</think> <answer>{pred}</answer>"
    assert reward(wrapped, gold, tolerance=tolerance)["correct"] == float(expected)


def test_check_tolerance_rejects_bad_values():
    rewards.check_tolerance(0.0)
    rewards.check_tolerance(1e-6)
    for bad in (-1e-9, 1.0, float("nan"), float("inf")):
        with pytest.raises(SystemExit, match="error: --reward_tolerance"):
            rewards.check_tolerance(bad)


def test_bounds_give_up_cleanly():
    # over the token, depth and item caps the tree comparison is skipped: only equal strings match
    deep = "(" * 40 + "1" + ")" * 40
    assert answers_match(deep, deep) and not answers_match(deep, "1")
    many = "+".join(["1"] * 300)
    assert not answers_match(many, "300")  # over MAX_TOKENS
    assert answers_match("+".join(["1"] * 100), "100")  # under it
    big_list = ",".join(str(k) for k in range(40))
    shuffled = ",".join(str(k) for k in reversed(range(40)))
    assert not answers_match(big_list, shuffled)  # over MAX_ITEMS: not matched order-free
    assert answers_match(",".join(str(k) for k in range(20)), ",".join(str(k) for k in reversed(range(20))))


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
             "\\!", " ", "\n", "x=", "^\\circ", " cm", "é", "∞", "−", "\u200b", "😀", "<|endoftext|>",
             # the answer grammar: operators, relations, sets, roots, constants, functions, variables
             "^", "^{", "*", "\\cdot", "!", "|", "=", "<", "\\le", "\\geq", "\\cup", "\\{", "\\}", "\\in",
             "\\sqrt[", "]", "\\pi", "\\infty", "e", "i", "x", "y", "_", "\\sin", "\\log_", "\\alpha", "0", "2", "\\0",
             "\\begin{pmatrix}", "\\end{pmatrix}", "&", "\\\\", "1.5", "\\text{ cm}", "{,}", "\x00", "9^{9^{9}}",
             # sentences, relation notation, chains, decimal commas (#49)
             "The answer is ", "Answer: ", "answer", " euros", " is ", "$$", "\\(", "\\)", "\\[", "\\]", "\\$",
             ">=", "<=", "!=", "≥", "\\ne", "\\approx", "≈", "1,22", "0,111", "1,000.99", "x = ",
             "####", "**", "€", "£", " more ", ". ", "0.0833333333333333"]
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


def _fuzz_many(n: int, seed: int) -> None:
    """n random fragment strings (up to 60 fragments), each against one MATH-like gold, with and without
    --reward_tolerance, and against itself: no call may raise."""
    rng = random.Random(seed)
    golds = ["\\frac{\\sqrt{3}}{2}", "(1,2)", "x \\le 5", "2\\sqrt{2}", "1,-2", "\\{1,2\\}", "12", "\\pi"]
    for k in range(n):
        text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randrange(1, 60)))
        answers_match(text, golds[k % len(golds)], 1e-6 if k % 2 else 0.0)
        reward(f"<think>r</think> <answer>{text}</answer>", text)


def test_fuzz_no_exception():
    _fuzz_many(2_000, seed=0)


@pytest.mark.slow
def test_fuzz_no_exception_100k():
    _fuzz_many(100_000, seed=1)


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
        solution_ok = answers_match(verifier.last_boxed(row["solution"]) or "", gold)  # the solution's own \boxed{}
        if not (boxed_ok and block_ok and solution_ok):
            misses.append(gold)
    assert not misses, misses[:10]
