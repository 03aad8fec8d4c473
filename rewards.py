r"""Rewards: is a completion well-formed (R1 format) and is its answer right?

Pure Python on purpose: no torch, no sympy, and nothing ever evaluates model text (no eval/exec/sympify). Model
output is hostile input, so every function here takes time linear (or, on the capped answer, at worst quadratic)
in its input, never raises on any string, and never runs a regex that can backtrack catastrophically.

The R1 format (what earns `format` = 1), checked by `parse_r1` on the full response (the prompt's opening
"<think>" included, i.e. response_prefix + completion):

    <think> reasoning </think> <answer> final answer </answer>

- optional leading whitespace, then "<think>"; the first "</think>" closes it; then only whitespace; then
  "<answer>", the first "</answer>" closes it; then only whitespace, optionally one end-of-sequence marker
  (EOS_MARKERS, for callers that decode special tokens) and whitespace.
- both blocks hold non-whitespace text, and neither holds any of the four tags (no nesting, no second answer).
- tags are exact and case-sensitive ("<Think>", "< think >" do not count).

Answer checking (`answers_match`) normalises both sides, then compares:
- numbers exactly as rationals (fractions.Fraction, never a float tolerance): commas as thousands separators
  ("1,000"; "10,\!080"), "$"/"\$", "%" (dropped: "50%" matches 50, not 0.5), a leading "+", trailing zeros
  (72.00), leading zeros, negatives (also the unicode minus), a/b, \frac{a}{b} (\dfrac, \tfrac, \frac12) and mixed
  numbers (1\frac{4}{5}); one to three trailing unit words ("72 clips", "5.4 \text{ cents}") are dropped when what
  is left is a number. Scientific notation is not parsed.
- LaTeX: the last \boxed{} / \fbox{} if there is one, \text{}/\mbox{}/\mathrm{} unwrapped, \left/\right, ^\circ,
  spacing commands (\! \, \;) and all whitespace dropped, \sqrt2 -> \sqrt{2}, x^{2} -> x^2, "x=5" -> "5",
  "(C)" -> "C"; then string equality.
- tuples, intervals and bare lists element-wise, in order, with the same brackets: "(1,2)" != "(2,1)",
  "(3,4]" != "(3,4)".
Time is bounded: answers over MAX_ANSWER_CHARS are rejected (no real answer is that long; MATH golds are < 200
characters), every scan is hand-written or a regex that cannot backtrack, so one call on any input takes
milliseconds (fuzzed worst case ~12 ms; tests/test_rewards.py asserts a generous 1 s per call).
"""

import re
from fractions import Fraction

MAX_RESPONSE_CHARS = 1_000_000  # parse_r1 rejects longer responses (its scan is linear, this only bounds memory)
MAX_ANSWER_CHARS = 1_000  # answers_match rejects longer answers (MATH golds are < 200 chars)
EOS_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<｜end▁of▁sentence｜>", "</s>", "<eos>")
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")

DEFAULT_WEIGHTS = {"correct": 1.0, "format": 0.1, "overlong": 0.0}
OVERLONG_BUFFER = 0.25  # soft overlong penalty ramps over the last 25% of max_tokens (DAPO's L_cache)


# ---------------------------------------------------------------- format


def parse_r1(response: str) -> tuple[str, str] | None:
    """(think, answer), both stripped, if `response` has the strict R1 structure above; else None."""
    if not isinstance(response, str) or len(response) > MAX_RESPONSE_CHARS:
        return None
    s = response.lstrip()
    if not s.startswith("<think>"):
        return None
    end_think = s.find("</think>")
    if end_think < 0:
        return None
    think = s[len("<think>") : end_think]
    rest = s[end_think + len("</think>") :].lstrip()
    if not rest.startswith("<answer>"):
        return None
    end_answer = rest.find("</answer>")
    if end_answer < 0:
        return None
    answer = rest[len("<answer>") : end_answer]
    tail = rest[end_answer + len("</answer>") :].strip()
    for marker in EOS_MARKERS:  # one trailing EOS marker is fine (decoded with special tokens)
        if tail.startswith(marker):
            tail = tail[len(marker) :].strip()
            break
    if tail or any(t in think or t in answer for t in _TAGS):
        return None
    think, answer = think.strip(), answer.strip()
    if not think or not answer:  # "<think></think>" must not earn the format reward
        return None
    return think, answer


# ---------------------------------------------------------------- normalisation helpers


def _brace_end(s: str, i: int) -> int:
    """Index just past the group opened by s[i] == "{", skipping escaped \\{ \\}; -1 if unbalanced."""
    depth = 0
    j = i
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    return -1


def last_boxed(s: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}) in s, braces balanced; None if there is none."""
    start = max(s.rfind("\\boxed"), s.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if s.startswith("\\boxed", start) else len("\\fbox"))
    while i < len(s) and s[i] == " ":
        i += 1
    if i < len(s) and s[i] == "{":
        end = _brace_end(s, i)
        return s[i + 1 : end - 1] if end > 0 else None
    # "\boxed 5" form: the argument runs to the next "$" or end
    end = s.find("$", i)
    return s[i : end if end >= 0 else len(s)].strip() or None


def _unwrap(s: str, cmd: str, sep: str = " ") -> str:
    """Replace every `cmd{X}` by sep + X + sep (\\text{ cm} -> " cm "); unbalanced groups are left as they are."""
    out, i = [], 0
    while True:
        j = s.find(cmd, i)
        if j < 0:
            break
        k = j + len(cmd)
        if k < len(s) and s[k].isalpha():  # \textbf when looking for \text: a different command
            out.append(s[i:k])
            i = k
            continue
        while k < len(s) and s[k] == " ":
            k += 1
        end = _brace_end(s, k) if k < len(s) and s[k] == "{" else -1
        if end < 0:
            out.append(s[i:k])
            i = k
            continue
        out.append(s[i:j] + sep + s[k + 1 : end - 1] + sep)
        i = end
    out.append(s[i:])
    return "".join(out)


def _latex_arg(s: str, i: int) -> tuple[str, int] | None:
    """One argument at s[i]: a {group}, a \\command, or a single character. Returns (content, next index)."""
    while i < len(s) and s[i] == " ":  # "\frac 59"
        i += 1
    if i >= len(s):
        return None
    if s[i] == "{":
        end = _brace_end(s, i)
        return (s[i + 1 : end - 1], end) if end > 0 else None
    if s[i] == "\\":
        j = i + 1
        while j < len(s) and s[j].isalpha():
            j += 1
        return s[i : max(j, i + 2)], max(j, i + 2)
    return s[i], i + 1


def _brace_args(s: str, cmd: str, nargs: int) -> str:
    """Brace shorthand arguments: \\frac43 -> \\frac{4}{3}, \\frac 59 -> \\frac{5}{9}, \\sqrt2 -> \\sqrt{2}."""
    out, i = [], 0
    while True:
        j = s.find(cmd, i)
        if j < 0:
            break
        k = j + len(cmd)
        if k < len(s) and (s[k].isalpha() or s[k] == "["):  # a longer command name, or \sqrt[3]{x}
            out.append(s[i:k])
            i = k
            continue
        args = []
        for _ in range(nargs):
            arg = _latex_arg(s, k)
            if arg is None:
                break
            args.append(arg[0])
            k = arg[1]
        if len(args) < nargs:
            out.append(s[i:])
            return "".join(out)
        out.append(s[i:j] + cmd + "".join("{" + a + "}" for a in args))
        i = k
    out.append(s[i:])
    return "".join(out)


# Simple, unambiguous patterns (each character can be matched one way only), so matching is linear.
_DECIMAL = re.compile(r"\d+(?:\.\d*)?|\.\d+")
_THOUSANDS = re.compile(r"\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_MIXED = re.compile(r"(\d+)\\frac\{(\d+)\}\{(\d+)\}")
_UNIT_WORD = re.compile(r"[A-Za-z]{2,}\.?(?:\^\d|\^\{\d\})?")
_SPACING = ("\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad", "\\ ", "~")
_DROPPED = ("^{\\circ}", "^\\circ", "\\circ", "°", "\\%", "%", "\\$", "$", "\\displaystyle", "\\(", "\\)", "\\[", "\\]")
_TEXT_COMMANDS = ("\\text", "\\textbf", "\\textit", "\\textrm", "\\mbox", "\\mathrm", "\\mathbf", "\\operatorname")


def to_number(s: str) -> Fraction | None:
    """Exact value of a normalised (space-free) number: 5, -3, +7, 1,000, 0.50, .5, 3/4, \\frac{3}{4}, 1\\frac{4}{5}."""
    sign = 1
    if s and s[0] in "+-":
        sign, s = (-1 if s[0] == "-" else 1), s[1:]
    if not s or len(s) > MAX_ANSWER_CHARS:
        return None
    if _DECIMAL.fullmatch(s) or _THOUSANDS.fullmatch(s):
        whole, _, frac = s.replace(",", "").partition(".")
        return sign * Fraction(int(whole or "0") * 10 ** len(frac) + int(frac or "0"), 10 ** len(frac))
    m = _MIXED.fullmatch(s)
    if m:  # 1\frac{4}{5} is the mixed number 9/5 in MATH answers
        whole, num, den = (int(g) for g in m.groups())
        return sign * (whole + Fraction(num, den)) if den else None
    if s.startswith("\\frac{"):
        num_end = _brace_end(s, len("\\frac"))
        if num_end > 0 and num_end < len(s) and s[num_end] == "{" and _brace_end(s, num_end) == len(s):
            num, den = to_number(s[6 : num_end - 1]), to_number(s[num_end + 1 : -1])
            return sign * num / den if num is not None and den else None
        return None
    if s.count("/") == 1:
        num, den = s.split("/")
        if _DECIMAL.fullmatch(num) and _DECIMAL.fullmatch(den):
            num, den = to_number(num), to_number(den)
            return sign * num / den if den else None
    return None


def normalize(answer: str) -> str | None:
    """Canonical, whitespace-free form of an answer string (LaTeX or plain); None if it is too long to check."""
    s = answer.strip()
    if len(s) > MAX_ANSWER_CHARS:
        return None
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("−", "-")
    s = re.sub(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])", "", s)
    for cmd in _TEXT_COMMANDS:
        s = _unwrap(s, cmd)
    s = s.replace("\\\\", ";")  # matrix/array row separator, kept apart from the "\ " spacing command
    for spacing in _SPACING:
        s = s.replace(spacing, " ")
    for junk in _DROPPED:
        s = s.replace(junk, "")
    s = _brace_args(_brace_args(s.strip().rstrip(".").strip(), "\\frac", 2), "\\sqrt", 1)
    # Trailing unit words ("72 clips", "5.4 cents", "864 inches^2") go only if what is left is a number,
    # so "\text{Evelyn}" or "p - q" are never touched.
    words = []
    for w in s.split():  # "inches ^2" -> "inches^2"
        if w.startswith("^") and words:
            words[-1] += w
        else:
            words.append(w)
    for k in range(1, min(4, len(words))):  # at most three words: "dollars per hour"
        if not _UNIT_WORD.fullmatch(words[-k]):
            break
        if to_number("".join(words[:-k])) is not None:
            s = "".join(words[:-k])
            break
    # Drop all whitespace except one space that separates a command from a letter ("\cot x" is not "\cotx").
    s = re.sub(r"(\\[A-Za-z]+) (?=[A-Za-z])", "\\1\0", " ".join(s.split()))
    s = s.replace(" ", "").replace("\0", " ")
    s = re.sub(r"([\^_])\{(\w)\}", r"\1\2", s)  # x^{2} -> x^2, 4210_{5} -> 4210_5
    # "x=5" -> "5": a single-letter variable assignment (MATH's convention); "y=2x+3" keeps its meaning on both sides
    if len(s) > 2 and s[1] == "=" and s[0].isalpha() and s.count("=") == 1:
        s = s[2:]
    if len(s) == 3 and s[0] == "(" and s[2] == ")" and s[1] in "ABCDE":  # multiple choice "(C)" -> "C"
        s = s[1]
    return s


def _split_top(s: str) -> list[str]:
    """Split s on commas not nested in (), [], {}."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _as_sequence(s: str) -> tuple[str, list[str], str] | None:
    """(open, items, close) for "(1,2)", "[3,4)", "1,-2" (bare list); None if s has no top-level comma."""
    open_, close = "", ""
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]" and _brace_balance_ok(s[1:-1]):
        open_, close, s = s[0], s[-1], s[1:-1]
    items = _split_top(s)
    return (open_, items, close) if len(items) > 1 else None


def _brace_balance_ok(s: str) -> bool:
    depth = 0
    for c in s:
        depth += (c in "([{") - (c in ")]}")
        if depth < 0:
            return False
    return depth == 0


def _atom_equal(a: str, b: str) -> bool:
    if a == b:
        return True
    x, y = to_number(a), to_number(b)
    return x is not None and x == y


def _canonical_atom(s: str) -> str:
    x = to_number(s)
    return s if x is None else str(x)


# ---------------------------------------------------------------- public checks


def answers_match(pred: str, gold: str) -> bool:
    """True if `pred` and `gold` are the same answer (exact rationals, normalised LaTeX, tuples in order)."""
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False
    a, b = normalize(pred), normalize(gold)
    if not a or not b:
        return False
    if _atom_equal(a, b):
        return True
    sa, sb = _as_sequence(a), _as_sequence(b)
    if sa is None or sb is None or sa[0] != sb[0] or sa[2] != sb[2] or len(sa[1]) != len(sb[1]):
        return False
    return all(_atom_equal(x, y) for x, y in zip(sa[1], sb[1]))


def extract_answer(response: str) -> str | None:
    """Canonical answer of an R1 response for majority voting (equal answers give equal strings); None if none.

    Numbers become reduced fractions/integers ("0.50" -> "1/2"), sequences are canonicalised element-wise, so the
    result is itself a valid answer for answers_match.
    """
    parsed = parse_r1(response)
    if parsed is None:
        return None
    s = normalize(parsed[1])
    if not s:
        return None
    if to_number(s) is not None:
        return _canonical_atom(s)
    seq = _as_sequence(s)
    if seq is None:
        return s
    open_, items, close = seq
    return open_ + ",".join(_canonical_atom(x) for x in items) + close


def overlong_penalty(num_tokens: int | None, max_tokens: int | None) -> float:
    """DAPO's soft overlong punishment: 0 until the last OVERLONG_BUFFER of max_tokens, then linear down to -1."""
    if num_tokens is None or max_tokens is None or max_tokens <= 0:
        return 0.0
    buffer = max(1, int(max_tokens * OVERLONG_BUFFER))
    if num_tokens <= max_tokens - buffer:
        return 0.0
    return max(-1.0, (max_tokens - buffer - num_tokens) / buffer)


def reward(response: str, gold: str, weights: dict | None = None, *, num_tokens=None, max_tokens=None) -> dict:
    """Score one response (response_prefix + completion) against the gold answer.

    Returns {"reward": weighted sum, "correct": 0/1, "format": 0/1, "overlong": in [-1, 0]}. `correct` needs the
    strict R1 format: the answer is read from the <answer> block only.
    """
    weights = {**DEFAULT_WEIGHTS, **(weights or {})}  # names not given keep their default weight
    unknown = set(weights) - set(DEFAULT_WEIGHTS)
    if unknown:
        raise ValueError(f"unknown reward weights {sorted(unknown)}; known: {sorted(DEFAULT_WEIGHTS)}")
    parsed = parse_r1(response)
    parts = {
        "correct": float(parsed is not None and answers_match(parsed[1], gold)),
        "format": float(parsed is not None),
        "overlong": overlong_penalty(num_tokens, max_tokens),
    }
    total = sum(weights[k] * v for k, v in parts.items())
    return {"reward": total, **parts}


def parse_weights(text: str) -> dict:
    """'correct=1,format=0.1' -> DEFAULT_WEIGHTS updated with those values (for a --reward_weights flag)."""
    weights = dict(DEFAULT_WEIGHTS)
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or name not in DEFAULT_WEIGHTS:
            raise ValueError(f"bad reward weight {item!r}: expected name=value with name in {sorted(DEFAULT_WEIGHTS)}")
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"bad reward weight {item!r}: {value.strip()!r} is not a number") from None
    return weights
