r"""Answer equivalence: is a model's answer the same as the gold one? (`answers_match`; rewards.py scores with it.)

Pure Python on purpose: no torch, no sympy, and nothing ever evaluates model text (no eval/exec/sympify). Model
output is hostile input, so every function here takes time linear (or, on the capped answer, at worst quadratic)
in its input, never raises on any string, and never runs a regex that can backtrack catastrophically.

`answers_match` normalises both sides to a whitespace-free string, then compares:
1. the strings, or both as exact numbers (to_number: 72.00, .5, 3/4, \frac{3}{4}, mixed 1\frac{4}{5});
2. else the values of their trees (parse_answer: a bounded recursive-descent parser, no eval/exec/sympy).
Normalisation: the last \boxed{}/\fbox{}; else, in a sentence, its final answer (final_answer: what follows
"answer", a trailing number before unit words, the last math span: "Answer \[ 9 \]" -> 9, "The largest $n$ is
34." -> 34, "It costs 5 euros" -> 5; only where there are prose words, so mathematics is never cut; after GSM8K's
"####" marker only what follows it; Markdown bold "**" dropped); \( \) \[ \]
$ $$ \displaystyle \left \right dropped; \dfrac \tfrac \cfrac -> \frac; \text \textnormal \mbox \mathrm ...
unwrapped; ^\circ, %, $ dropped (50% matches 50, not 0.5); spacing (\! \, \;) and whitespace dropped, except one
space between a command and a letter ("\cot x" is not "\cotx"); \sqrt2 -> \sqrt{2}; up to three trailing unit
words go when what is left is a constant ("72 clips", "2\sqrt{2} cm"); "(C)" -> "C"; a chain from a variable
keeps its answer when it is a computation ("x = 5+5+1 = 11" -> "x=11", the last member equal to an earlier one;
"x = 1/3 \approx 0.33" -> "x=1/3": the member reached through "=" alone wins over an approximation, and
answers_match tries the approximation too when it is that member's rounding, so 0.33 matches as well but
"x = 1/3 \approx 0.5" never matches 0.5; "x \approx 11" -> "x=11"). Thousands separators ("1,000", "1,000.99",
"10,\!080") only when the whole answer is that one number with no space after a comma: "32, 349" is the list
32, 349 (a GSM8K model writes "32,349"; MATH lists are written with ", "). A decimal comma ("1000,99", "1,22",
"0,111": a comma that cannot be a thousands separator) is read as a decimal point only in a prediction whose
gold is one number (a list could never equal it); against a list gold ("-2,1") it stays a list, and "1,000"
is always one thousand, never 1.000.
Values (see the grammar section below for the tree and its bounds):
- rationals exactly (fractions.Fraction), exact roots included (\sqrt{4} = 2, 8^{2/3} = 4); two rationals never
  match approximately unless `tolerance` > 0, with one exception: a decimal of >= FLOAT_PRINT_DIGITS (10)
  significant digits is a print of a rational that it equals rounded or cut off at its last digit
  ("0.0833333333333333" and "0.0833333333" are \frac{1}{12}; "0.0833", "0.333333" are not; "0.1250000001" is not
  \frac18; an irrational gold is never matched by a decimal this way).
- anything with radicals, pi, e, i, functions or variables: evaluated in complex floats at NUM_POINTS seeded
  points (each variable in [0.5, 2.5), the same name the same value on both sides), equal when
  |a - b| <= NUM_RTOL * max(1, |a|, |b|) at every point defined on both sides (at least 3). So 2\sqrt{33}+15
  matches 15+2\sqrt{33}, \frac{x}{7}+\frac{2}{7} matches \frac{x+2}{7}, and a rational within NUM_RTOL of an
  irrational would too (a decimal does not: 1.4142135623 is not \sqrt{2}, see `tolerance`).
- `tolerance` (--reward_tolerance, 0 by default): > 0 lets numbers match within that relative error, so
  1.4142135623730951 matches \sqrt{2} and (at 1e-3) 0.333 matches \frac{1}{3}.
- tuples and intervals in order with the same brackets ("(3,4]" != "(3,4)"); sets, bare lists ("1,-2": MATH's
  "all solutions, separated by commas") and unions order-free; matrices element-wise.
- relations (=, <, >, and <= >= != in ASCII, LaTeX (\le \leq \leqslant \ge \ne \lt \gt ...) or Unicode) side by
  side after writing > as < ("5 \geq x" is "x \leq 5"), = either way round, also with every member negated
  ("-x > -1" is "x < 1"); "x \le 5" matches "(-\infty, 5]"; "k = 1" matches 1. A one-relation statement with
  variables also matches when f = lhs - rhs of one is a constant c != 0 times the other's at every seeded point
  (c > 0 for < and <=): "y = 2x+3" is "2x - y + 3 = 0", "x^2 + 4y^2 = 4" is "\frac{x^2}{4} + y^2 = 1", "2x < 4"
  is "x < 2"; never "2x+4y=3" and "2x+4y=6" (their f differ by a constant: the ratio moves) or "x > 5" and
  "x >= 5". Words (letter runs of 3 or more: "even") are compared as strings only.
Time is bounded: answers over MAX_ANSWER_CHARS are rejected (MATH golds are < 200 characters), every scan is
hand-written or a regex that cannot backtrack, and the tree comparison is capped by MAX_TOKENS, MAX_DEPTH,
MAX_ITEMS, MAX_BITS and STEP_BUDGET (worst case: see the grammar section). tests/test_rewards.py fuzzes it.
"""

import cmath
import functools
import math
import re
import zlib
from fractions import Fraction

MAX_ANSWER_CHARS = 1_000  # answers_match rejects longer answers (MATH golds are < 200 chars)


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


# ---------------------------------------------------------------- the final answer inside a sentence
#
# A model's answer block may hold a sentence: "Answer \[ 9 \]", "Therefore $x \geq 5$ is the solution.", "Final
# Answer: The largest $n$ is 34.", "It costs 5 euros". final_answer picks the answer out of it, in this order:
# \boxed (normalize does that first); then, only where the text has prose words outside its math spans, what
# follows the last "answer"; the trailing number; the last math span. Each scan is one left-to-right pass.

_NUMBER_WORD = re.compile(r"[+-]?(?:\d+(?:[.,]\d+)*|\.\d+)(?:/\d+)?(?:\\?%)?")  # 34, -2.5, 1,000.99, 3/4, 50%
_TRAILING_PUNCTUATION = ".,;:!?"
_SHORT_WORDS = ("is", "so", "So", "it", "It", "we", "We")  # two-letter words; other letter pairs are products
_MAX_WORDS_AFTER_NUMBER = 8  # "It costs 5 euros", "18 dollars per hour", "60 instructions to prepare the two dishes"


def _find_dollar(s: str, i: int, width: int) -> int:
    r"""Index of the next "$" ("$$" if width is 2) at or after i that is not escaped as "\$"; -1 if none."""
    j = s.find("$" * width, i)
    while j > 0 and s[j - 1] == "\\":
        j = s.find("$" * width, j + 1)
    return j


def _math_spans(s: str) -> list[tuple[int, int, int, int]]:
    r"""(start, end, content start, content end) of each $..$, $$..$$, \(..\) and \[..\] in s, left to right. "\$"
    is a dollar sign; an opener without its closer ends the scan ("$18 dollars" has no span)."""
    spans, i = [], 0
    while i < len(s):
        if s[i] == "\\" and s[i + 1 : i + 2] in ("(", "["):
            j = s.find("\\)" if s[i + 1] == "(" else "\\]", i + 2)
            if j < 0:
                break
            spans.append((i, j + 2, i + 2, j))
            i = j + 2
        elif s[i] == "\\":
            i += 2  # an escaped character: "\$" is no delimiter
        elif s[i] == "$":
            width = 2 if s.startswith("$$", i) else 1
            j = _find_dollar(s, i + width, width)
            if j < 0:
                break
            spans.append((i, j + width, i + width, j))
            i = j + width
        else:
            i += 1
    return spans


def _outside(s: str, spans: list) -> str:
    """s with each math span replaced by one space."""
    pieces, last = [], 0
    for start, end, _, _ in spans:
        pieces.append(s[last:start])
        last = end
    pieces.append(s[last:])
    return " ".join(pieces)


def _has_prose(s: str) -> bool:
    r"""True if s has an English word (a run of 3+ letters, or one of _SHORT_WORDS) outside braces and not a
    \command name. So "Answer \[ 9 \]" and "x is 5" are prose; "2xy", "\cot x", "5 \text{ cm}", "\begin{pmatrix}"
    are not."""
    depth, i = 0, 0
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 1
            while i < len(s) and s[i].isascii() and s[i].isalpha():
                i += 1  # a command name is not a word
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
        elif c.isascii() and c.isalpha():
            j = i
            while j < len(s) and s[j].isascii() and s[j].isalpha():
                j += 1
            if depth == 0 and (j - i >= 3 or s[i:j] in _SHORT_WORDS):
                return True
            i = j
            continue
        i += 1
    return False


_OPERATOR_WORDS = ("\\cdot", "\\times", "\\div", "\\pm")
_CURRENCY = "$€£¥₹"  # signs around a number that go with it: "$18", "€12.50", "12.50 €"


def _is_word(w: str) -> bool:
    """A word after a number, not a variable: 2+ ASCII letters ("euros", "cm"; not "x")."""
    return len(w) >= 2 and w.isascii() and w.isalpha()


# words after a number that make it part of a comparison, not the answer: "The answer is 5 more than the 12 ..."
_COMPARING_WORDS = ("more", "less", "fewer", "times", "plus", "minus", "greater", "smaller", "larger", "than")


def _leading_number(s: str) -> str | None:
    r"""The number that s starts with ("42, found in 3 steps" -> "42"), if punctuation, a word or nothing follows
    it: not "3\sqrt{2}", "2x", "3 + x", "3 x", "5 more than 12"."""
    m = _NUMBER_WORD.match(s.lstrip(_CURRENCY))
    if m is None:
        return None
    rest = s.lstrip(_CURRENCY)[m.end() :].lstrip()
    word = rest.split()[0].rstrip(_TRAILING_PUNCTUATION) if rest else ""
    if rest and rest[0] not in _TRAILING_PUNCTUATION and (not _is_word(word) or word.lower() in _COMPARING_WORDS):
        return None
    return m.group().rstrip(_TRAILING_PUNCTUATION)


def _trailing_number(s: str) -> str | None:
    r"""The number that ends s, before at most _MAX_WORDS_AFTER_NUMBER words ("It costs 5 euros." -> "5",
    "The largest is 34." -> "34", "Therefore, Kelian has to read 60 instructions to prepare the two recipes." ->
    "60"), if it is the only word with a digit in its sentence (from the last ".", "?", "!" or line break before
    it) and no operator comes just before it; None if anything but words follows it ("3 \sqrt{2} inches"),
    another number comes before it in its sentence ("x = 1 and y = 2", "72 clips and 3") or it ends an expression
    ("y = x + 3 is the line"). "Jackson is 3 years. Jackson is 4 years." -> "4": the last sentence says it."""
    words, line_ends = [], set()
    for line in s.splitlines():
        words += line.split()
        line_ends.add(len(words) - 1)
    for k in range(len(words) - 1, max(-1, len(words) - 2 - _MAX_WORDS_AFTER_NUMBER), -1):
        word = words[k].rstrip(_TRAILING_PUNCTUATION)
        number = word.removeprefix("\\$").strip(_CURRENCY)  # "$18", "\\$18", "€12.50", "12.50€"
        if _NUMBER_WORD.fullmatch(number):
            start = k  # back to the first word of its sentence
            while start > 0 and start - 1 not in line_ends:
                end = words[start - 1].rstrip("\"')*")[-1:]
                if end and end in ".?!":
                    break
                start -= 1
            others = words[start:k]
            if k - 1 > start and words[k - 1] == "=":  # "the total is 20 + 40 = 60": a computation's result
                i = k - 2
                while i >= start and not any(c.isalpha() for c in words[i].replace("\\times", "")):
                    i -= 1
                done = " ".join(_drop_thousands(w.replace("\\$", "").replace("$", "").replace("\\times", "*"))
                                for w in words[i + 1 : k - 1])
                if done and _chain_consistent([done, _drop_thousands(number)]):
                    others = words[start : i + 1]  # its numbers are no other answer
            if any(c.isdigit() for w in others for c in w):
                return None
            if k and (words[k - 1][-1] in "+-*/^(" or words[k - 1] in _OPERATOR_WORDS):
                return None
            return number
        if not (_is_word(word) or (word and not word.strip(_CURRENCY))) or word.lower() in _COMPARING_WORDS:
            return None
    return None


def _after_answer_word(s: str) -> int:
    """Index just past "is", ":" or "=" after the last whole word "answer" (any case of its first letter or all
    capitals) in s; -1 if there is none."""
    k = max(s.rfind("answer"), s.rfind("Answer"), s.rfind("ANSWER"))
    if k < 0 or (k > 0 and s[k - 1].isalpha()) or s[k + 6 : k + 7].isalpha():
        return -1
    i = k + 6
    for _ in range(3):  # "The answer is: 5", "Answer = 5", "answer: 5"
        while i < len(s) and s[i].isspace():
            i += 1
        if s[i : i + 1] in (":", "="):
            i += 1
        elif s[i : i + 2] == "is" and not s[i + 2 : i + 3].isalpha():
            i += 2
    return i


def _drop_bold(s: str) -> str:
    """Markdown bold markers ("**") out of s, except one between two operands ("2**3" stays: not bold)."""
    if "**" not in s:
        return s
    out, i = [], 0
    while i < len(s):
        if s.startswith("**", i):
            before, after = s[i - 1 : i], s[i + 2 : i + 3]
            if before and after and (before.isalnum() or before in ")}") and (after.isalnum() or after in "({"):
                out.append("**")
            i += 2
            continue
        out.append(s[i])
        i += 1
    return "".join(out)


def final_answer(s: str) -> str:
    r"""The final mathematical answer in s when s is a sentence; s itself when s has no prose words outside its
    math spans (an answer already written as mathematics is never cut: "x \geq 5", "72", "\text{Evelyn}").
      1. what follows the last "answer" ("The answer is 42." -> "42", "Answer \[ 9 \]" -> "9"): a math span that
         starts it, all of it if it has no prose or no space ("The answer is x^2+1." -> "x^2+1"), or a number
         that starts it ("The answer is 42, found in 3 steps" -> "42");
      2. else the number that ends the text after the last math span, before at most 8 words and with no other
         number before it in its sentence but the operands of a computation it is the result of (_trailing_number:
         "The largest $n$ is 34." -> "34", "It costs 5 euros" -> "5", "18 USD" -> "18", "20 + 40 = 60 cups" -> "60");
      3. else the last math span, if no number follows it ("Therefore $x \geq 5$ is the solution." -> "x \geq 5";
         not "To convert $\frac{3}{20}$, multiply by 100. That gives 100, the decimal.").
    Nothing found: s, unchanged (compared as it is, so "72 clips and 3" equals neither 72 nor 3).
    Before all that, GSM8K's answer marker: only what follows the last "####" counts ("... so 18 eggs.\n#### 18"
    -> "18"), and Markdown bold goes ("**Answer:** 18", "The answer is **18**.": _drop_bold)."""
    marker = s.rfind("####")
    if marker >= 0:
        s = s[marker + 4 :].strip()
    s = _drop_bold(s)
    spans = _math_spans(s)
    if not _has_prose(_outside(s, spans)):
        return s
    i = _after_answer_word(s)
    if i >= 0:
        rest = s[i:].strip().rstrip(".").strip()
        span = next((sp for sp in spans if sp[0] >= i), None)
        if span is not None and not s[i : span[0]].strip():
            return s[span[2] : span[3]]
        if rest and (" " not in rest or not _has_prose(_outside(rest, _math_spans(rest)))):
            return rest
        number = _leading_number(rest)
        if number is not None:
            return number
    after = s[spans[-1][1] :] if spans else s
    number = _trailing_number(after)
    if number is not None:
        return number
    # a number after the last span ("$\frac{3}{20}$ ... results in 100, the decimal") means the span is no answer
    if spans and not any(c.isdigit() for c in after):
        return s[spans[-1][2] : spans[-1][3]]
    return s


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
_THOUSANDS = re.compile(r"[+-]?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")  # "1,000", "1,000.99"; never "0,111"
_DECIMAL_COMMA = re.compile(r"[+-]?\d+,\d+")  # "1000,99", "1,22", "0,111": one comma, no space
_MIXED = re.compile(r"(\d+)\\frac\{(\d+)\}\{(\d+)\}")
_UNIT_WORD = re.compile(r"[A-Za-z]{2,}\.?(?:\^\d|\^\{\d\})?")
_SPACING = ("\\!", "\\,", "\\;", "\\:", "\\quad", "\\qquad", "\\ ", "~")
_DROPPED = ("^{\\circ}", "^\\circ", "\\circ", "°", "\\%", "%", "\\$", "$", "€", "£", "¥", "₹", "\\displaystyle", "\\(",
            "\\)", "\\[", "\\]")
_TEXT_COMMANDS = ("\\text", "\\textbf", "\\textit", "\\textrm", "\\mbox", "\\mathrm", "\\mathbf", "\\operatorname",
                  "\\textnormal", "\\textsf", "\\texttt")


def to_number(s: str) -> Fraction | None:
    """Exact value of a normalised (space-free) number: 5, -3, +7, 1,000, 0.50, .5, 3/4, \\frac{3}{4}, 1\\frac{4}{5}."""
    sign = 1
    if s and s[0] in "+-":
        sign, s = (-1 if s[0] == "-" else 1), s[1:]
    if not s or len(s) > MAX_ANSWER_CHARS:
        return None
    if _DECIMAL.fullmatch(s):
        whole, _, frac = s.partition(".")
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


def _decimal_comma(s: str) -> str:
    """"1000,99" -> "1000.99" when s is digits, one comma, digits, and not thousands (those went first: "1,000" is
    1000, never 1.000, in an English context). Only for a prediction whose gold is one number (normalize's
    decimal_comma): against a list gold ("-2,1": MATH's "all solutions") "1,22" stays the list 1, 22."""
    return s.replace(",", ".") if _DECIMAL_COMMA.fullmatch(s) else s


def _drop_thousands(s: str) -> str:
    """"1,000" -> "1000" when the whole string is one number with thousands separators. A comma followed by a
    space is a list separator ("32, 349" is two numbers), so the pattern holds no whitespace."""
    return s.replace(",", "") if _THOUSANDS.fullmatch(s) else s


def _ends_with_command(s: str) -> bool:
    """True if s ends in a LaTeX command name such as "\\cot"."""
    k = len(s)
    while k > 0 and s[k - 1].isascii() and s[k - 1].isalpha():
        k -= 1
    return 0 < k < len(s) and s[k - 1] == "\\"


def normalize(answer: str, decimal_comma: bool = False, rounded: bool = False) -> str | None:
    """Canonical, whitespace-free form of an answer string (LaTeX or plain); None if it is too long to check.
    decimal_comma: read one number with a comma that is no thousands separator as a decimal ("1,22" -> "1.22").
    rounded: a chain with an approximation gives its rounded last member (_chain_answer)."""
    s = answer.strip()
    if len(s) > MAX_ANSWER_CHARS:
        return None
    s = s.replace("−", "-")
    boxed = last_boxed(s)
    s = final_answer(s) if boxed is None else boxed  # "The answer is 42." -> "42" (see final_answer)
    for variant in ("\\dfrac", "\\tfrac", "\\cfrac"):
        s = s.replace(variant, "\\frac")
    s = re.sub(r"\\left(?![A-Za-z])|\\right(?![A-Za-z])", "", s)
    for cmd in _TEXT_COMMANDS:
        s = _unwrap(s, cmd)
    s = s.replace("\\\\", ";")  # matrix/array row separator, kept apart from the "\ " spacing command
    s = re.sub(r",\\!\s*", ",", s).replace("{,}", ",")  # "10,\!080", "10,\! 080", "10{,}080": thousands
    for spacing in _SPACING:
        s = s.replace(spacing, " ")
    for junk in _DROPPED:
        s = s.replace(junk, "")
    s = _brace_args(_brace_args(s.strip().rstrip(".").strip(), "\\frac", 2), "\\sqrt", 1)
    # Trailing unit words ("72 clips", "5.4 cents", "864 inches^2", "2\sqrt{2} cm") go only if what is left
    # is a constant, so "\text{Evelyn}" or "p - q" are never touched.
    words = []
    for w in s.split():  # "inches ^2" -> "inches^2"
        if w.startswith("^") and words:
            words[-1] += w
        else:
            words.append(w)
    s = _drop_thousands(" ".join(words))
    for k in range(1, min(4, len(words))):  # at most three words: "dollars per hour"
        if not _UNIT_WORD.fullmatch(words[-k]):
            break
        left = _drop_thousands(" ".join(words[:-k]))
        if (to_number(left.replace(" ", "")) is not None or _is_constant(left)
                or (decimal_comma and _DECIMAL_COMMA.fullmatch(left))):
            s = left
            break
    if decimal_comma:
        s = _decimal_comma(s)
    # Drop all whitespace except one space that separates a command from a letter ("\cot x" is not "\cotx").
    # (Done piece by piece: no placeholder character, so a NUL in the input stays a NUL.)
    pieces = s.split()
    s = "".join(p if i == 0 or not (_ends_with_command(pieces[i - 1]) and p[0].isascii() and p[0].isalpha())
                else " " + p for i, p in enumerate(pieces))
    s = re.sub(r"([\^_])\{(\w)\}", r"\1\2", s)  # x^{2} -> x^2, 4210_{5} -> 4210_5
    if len(s) == 3 and s[0] == "(" and s[2] == ")" and s[1] in "ABCDE":  # multiple choice "(C)" -> "C"
        s = s[1]
    return _chain_answer(s, rounded)


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


# ---------------------------------------------------------------- the answer grammar: parse to a tree, never eval
#
# A normalised answer is tokenised (numbers, \commands, letter runs, single characters) and parsed by recursive
# descent into a tree of tuples. Nothing is executed: the tree is walked by _exact (fractions.Fraction) and
# _numeric (complex floats at seeded points), both of which only know the node kinds below.
#   expressions  ("num", Fraction, the decimal as written or False) ("const", "pi"|"e"|"i") ("var", name) ("inf",)
#                ("add", [terms]) ("mul", [factors]) ("neg", x) ("inv", x) ("pow", base, exp)
#                ("sqrt", x, index|None) ("fn", "\\sin", x) ("log", x, base|None) ("fact", x) ("abs", x)
#   structures   ("seq", open, close, [items]) tuples and intervals, in order, brackets compared;
#                ("set", [items]) \{..\} and bare comma lists, order-free; ("rel", [exprs], [ops]);
#                ("union", [parts]); ("matrix", [[cells]])
# Bounds: MAX_TOKENS tokens, MAX_DEPTH nested groups, MAX_ITEMS items per collection, exact numbers of at most
# MAX_BITS bits (larger ones are compared numerically), and STEP_BUDGET node visits per answers_match call. The
# parser reads tokens once with fixed lookahead (no backtracking). Worst case of one call: a few O(MAX_TOKENS)
# parses, then at most STEP_BUDGET node visits, each one operation on numbers of at most MAX_BITS bits (an exact
# root: Newton's method on them) or one complex float operation; over the budget the call returns False.

MAX_TOKENS = 400
MAX_DEPTH = 24
MAX_ITEMS = 32
MAX_BITS = 4096
STEP_BUDGET = 20_000
NUM_POINTS = 5  # seeded points at which expressions with variables are evaluated
NUM_RTOL = 1e-10  # relative tolerance of the numeric comparison (|a - b| <= NUM_RTOL * max(1, |a|, |b|))

_TOKEN = re.compile(r"\d+(?:\.\d*)?|\.\d+|\\[A-Za-z]+|\\.|[A-Za-z]+|[<>!]=|\S")  # "<=" is one token
# Relation notation, LaTeX, ASCII and Unicode alike: x >= 5, x \geq 5, x \ge 5 and x ≥ 5 are one relation.
_REL_OPS = {"=": "=", "<": "<", ">": ">", "\\lt": "<", "\\gt": ">", "\\le": "<=", "\\leq": "<=",
            "\\leqslant": "<=", "\\leqq": "<=", "<=": "<=", "≤": "<=", "\\ge": ">=", "\\geq": ">=",
            "\\geqslant": ">=", "\\geqq": ">=", ">=": ">=", "≥": ">=", "\\ne": "!=", "\\neq": "!=", "!=": "!=",
            "≠": "!="}
_FLIP = {"<": ">", ">": "<", "<=": ">=", ">=": "<=", "=": "=", "!=": "!="}
_OPEN, _CLOSE = ("(", "[", "{", "\\{"), (")", "]", "}", "\\}")
_GREEK = {"\\alpha", "\\beta", "\\gamma", "\\delta", "\\epsilon", "\\varepsilon", "\\theta", "\\lambda", "\\mu",
          "\\phi", "\\varphi", "\\psi", "\\rho", "\\sigma", "\\tau", "\\omega", "\\nu", "\\xi", "\\eta", "\\kappa"}
_FUNCS = {
    "\\sin": cmath.sin, "\\cos": cmath.cos, "\\tan": cmath.tan, "\\cot": lambda z: 1 / cmath.tan(z),
    "\\sec": lambda z: 1 / cmath.cos(z), "\\csc": lambda z: 1 / cmath.sin(z), "\\exp": cmath.exp,
    "\\arcsin": cmath.asin, "\\arccos": cmath.acos, "\\arctan": cmath.atan, "\\sinh": cmath.sinh,
    "\\cosh": cmath.cosh, "\\tanh": cmath.tanh, "\\ln": cmath.log, "\\log": cmath.log,  # \log: natural, as sympy
}
_ATOM_COMMANDS = {"\\frac", "\\sqrt", "\\pi", "\\infty", *_GREEK, *_FUNCS}


class _Fail(Exception):
    """The answer is outside the grammar (or over a bound): compare it as a string only."""


def _tokenize(s: str) -> list[str]:
    toks = []
    for m in _TOKEN.finditer(s):
        t = m.group()
        if toks and toks[-1] in ("^", "_") and len(t) > 1 and (t[0].isdigit() or t[0].isalpha()):
            toks.append(t[0])  # LaTeX: x^23 is x^2 * 3, x_12 is x_1 * 2
            t = t[1:]
        toks.append(t)
        if len(toks) > MAX_TOKENS:
            raise _Fail
    return toks


class _Parser:
    """Recursive descent over a token list; every method consumes tokens or raises _Fail (one pass, no backtracking)."""

    def __init__(self, toks: list[str]):
        self.toks, self.i, self.depth = toks, 0, 0

    def peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, want: str | None = None) -> str:
        t = self.peek()
        if t is None or (want is not None and t != want):
            raise _Fail
        self.i += 1
        return t

    def parse(self) -> tuple:
        node = self.expr()
        if self.i != len(self.toks):
            raise _Fail
        return node

    def expr(self) -> tuple:  # term (+|- term)*
        terms = [self.term()]
        while self.peek() in ("+", "-"):
            negative = self.take() == "-"
            t = self.term()
            terms.append(("neg", t) if negative else t)
        return terms[0] if len(terms) == 1 else ("add", terms)

    def term(self) -> tuple:  # signed factors joined by * / \cdot \times \div or juxtaposition (2\sqrt{3}, 3x)
        factors = [self.signed()]
        while True:
            t = self.peek()
            if t in ("*", "\\cdot", "\\times"):
                self.take()
                factors.append(self.signed())
            elif t in ("/", "\\div"):
                self.take()
                factors.append(("inv", self.signed()))
            elif t is not None and _starts_atom(t):
                factors.append(self.power())
            else:
                break
        return factors[0] if len(factors) == 1 else ("mul", factors)

    def signed(self) -> tuple:
        negative = False
        while self.peek() in ("+", "-"):
            negative ^= self.take() == "-"
        node = self.power()
        return ("neg", node) if negative else node

    def power(self) -> tuple:  # atom!* (^ exponent)?
        node = self.atom()
        while self.peek() == "!":
            self.take()
            node = ("fact", node)
        if self.peek() == "^":
            self.take()
            node = ("pow", node, self.exponent())
        return node

    def exponent(self) -> tuple:
        if self.peek() == "{":
            return self.group()
        negative = False
        while self.peek() in ("+", "-"):
            negative ^= self.take() == "-"
        node = self.atom()
        return ("neg", node) if negative else node

    def group(self) -> tuple:  # { expr }
        self.take("{")
        node = self.expr()
        self.take("}")
        return node

    def arg(self) -> tuple:  # a command's argument: {group} or one atom
        return self.group() if self.peek() == "{" else self.atom()

    def atom(self) -> tuple:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Fail
        t = self.take()
        if t[0].isdigit() or t[0] == ".":
            node = self.number(t)
        elif t in ("(", "{", "|"):
            close = {"(": ")", "{": "}", "|": "|"}[t]
            node = self.expr()
            self.take(close)
            node = ("abs", node) if t == "|" else node
        elif t == "\\frac":
            num = self.arg()
            node = ("mul", [num, ("inv", self.arg())])
        elif t == "\\sqrt":
            index = None
            if self.peek() == "[":
                self.take()
                index = self.expr()
                self.take("]")
            node = ("sqrt", self.arg(), index)
        elif t in ("\\pi", "e", "i"):
            node = ("const", t.lstrip("\\"))
        elif t == "\\infty":
            node = ("inf",)
        elif t in _GREEK:
            node = ("var", t)
        elif t in _FUNCS:
            node = self.function(t)
        elif t.isascii() and t.isalpha() and len(t) == 1:
            node = ("var", t + self.subscript())
        elif t.isascii() and t.isalpha() and len(t) == 2:  # "xy" is x*y; longer letter runs are words
            node = ("mul", [self.letter(t[0]), self.letter(t[1])])
        else:
            raise _Fail
        self.depth -= 1
        return node

    def number(self, t: str) -> tuple:
        value = Fraction(t)
        # 1\frac{4}{5} is the mixed number 9/5 in MATH answers (integer, then a fraction of two integers)
        k = self.i
        toks = self.toks
        if "." not in t and toks[k : k + 2] == ["\\frac", "{"] and k + 7 <= len(toks) and toks[k + 3] == "}":
            num, den = toks[k + 2], toks[k + 5]
            if toks[k + 4] == "{" and toks[k + 6] == "}" and num.isdigit() and den.isdigit() and int(den):
                self.i = k + 7
                return ("num", value + Fraction(int(num), int(den)), False)
        return ("num", value, t if "." in t else False)  # a decimal keeps its digits as written

    def subscript(self) -> str:  # x_1, a_{n+1}: part of the variable's name
        if self.peek() != "_":
            return ""
        self.take()
        if self.peek() != "{":
            return "_" + self.take()
        start = self.i
        self.group()
        return "_" + "".join(self.toks[start : self.i])

    @staticmethod
    def letter(c: str) -> tuple:
        return ("const", c) if c in "ei" else ("var", c)

    def function(self, name: str) -> tuple:  # \sin x, \sin(x), \sin^2 x, \log_2 8
        power = base = None
        if self.peek() == "^":
            self.take()
            power = self.exponent()
        if name == "\\log" and self.peek() == "_":
            self.take()
            base = self.arg()
        x = self.power()
        node = ("log", x, base) if name == "\\log" else ("fn", name, x)
        return ("pow", node, power) if power is not None else node


def _starts_atom(t: str) -> bool:
    """Can token t begin a factor of an implicit product (2x, 3\\sqrt{2}, x(y+1))?"""
    return t[0].isdigit() or t[0] == "." or t in ("(", "{") or t in _ATOM_COMMANDS or (t.isascii() and t.isalpha())


def _split(toks: list[str], seps) -> tuple[list[list[str]], list[str]]:
    """Split a token list at separators outside any bracket; returns (parts, separators found)."""
    parts, found, depth, start = [], [], 0, 0
    for k, t in enumerate(toks):
        if t in _OPEN:
            depth += 1
        elif t in _CLOSE:
            depth -= 1
        elif depth == 0 and t in seps:
            parts.append(toks[start:k])
            found.append(t)
            start = k + 1
    parts.append(toks[start:])
    return parts, found


def _balanced(toks: list[str]) -> bool:
    depth = 0
    for t in toks:
        depth += (t in _OPEN) - (t in _CLOSE)
        if depth < 0:
            return False
    return depth == 0


def _structure(toks: list[str], level: int = 0) -> tuple:
    """The tree of a whole answer: union, relation, \\in, set, tuple/interval, bare list, or one expression."""
    if level > 3 or not toks:
        raise _Fail
    parts, _ = _split(toks, ("\\cup",))
    if len(parts) > 1:
        return ("union", [_structure(p, level + 1) for p in parts])
    parts, ops = _split(toks, _REL_OPS)
    if ops:
        return ("rel", [_Parser(p).parse() for p in parts], [_REL_OPS[o] for o in ops])
    if toks.count("\\pm") == 1:  # 1 \pm \sqrt{2}: the set of its two values
        k = toks.index("\\pm")
        return ("set", [_structure(toks[:k] + [sign] + toks[k + 1 :], level + 1) for sign in ("+", "-")])
    parts, _ = _split(toks, ("\\in",))
    if len(parts) == 2 and len(parts[0]) == 1 and parts[0][0].isalpha():  # x \in [1, 2]
        return _structure(parts[1], level + 1)
    if toks == ["\\emptyset"] or toks == ["\\varnothing"]:
        return ("set", [])
    if toks[0] == "\\{" and toks[-1] == "\\}" and _balanced(toks[1:-1]):
        items = _split(toks[1:-1], (",",))[0] if len(toks) > 2 else []
        return ("set", [_structure(p, level + 1) for p in items])
    if toks[0] in ("(", "[") and toks[-1] in (")", "]") and _balanced(toks[1:-1]):
        items = _split(toks[1:-1], (",",))[0]
        if len(items) > 1:
            return ("seq", toks[0], toks[-1], [_structure(p, level + 1) for p in items])
    items = _split(toks, (",",))[0]
    if len(items) > 1:
        return ("set", [_structure(p, level + 1) for p in items])
    return _Parser(toks).parse()


def _matrix(s: str) -> tuple | None:
    """\\begin{pmatrix} a & b ; c & d \\end{pmatrix} (rows already joined by ';') -> ("matrix", rows)."""
    for kind in ("pmatrix", "bmatrix"):
        begin, end = "\\begin{" + kind + "}", "\\end{" + kind + "}"
        if s.startswith(begin) and s.endswith(end):
            rows = s[len(begin) : len(s) - len(end)].split(";")
            return ("matrix", [[parse_answer(c) for c in r.split("&")] for r in rows])
    return None


def parse_answer(s: str) -> tuple:
    """The tree of a normalised answer; raises _Fail outside the grammar or its bounds."""
    if len(s) > MAX_ANSWER_CHARS:
        raise _Fail
    m = _matrix(s)
    return m if m is not None else _structure(_tokenize(s))


def _is_constant(s: str) -> bool:
    """True if s parses as one expression without variables ("2\\sqrt{2}", "\\frac{\\pi}{3}")."""
    try:
        node = _structure(_tokenize(s))
    except (_Fail, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return False
    if node[0] == "rel" and node[2] == ["="] and node[1][0][0] == "var":  # "x = 11 cm"
        node = node[1][1]
    return node[0] not in ("seq", "set", "rel", "union") and not _free_vars(node)


# ---------------------------------------------------------------- values of a tree: exact, then at seeded points


class _Budget:
    """Counts node visits for one answers_match call; over STEP_BUDGET the call gives up (returns False)."""

    def __init__(self):
        self.left = STEP_BUDGET

    def spend(self):
        self.left -= 1
        if self.left < 0:
            raise _Fail


def _free_vars(node: tuple) -> set:
    if node[0] == "var":
        return {node[1]}
    out = set()
    for child in node[1:]:
        for c in child if isinstance(child, list) else [child]:
            if isinstance(c, tuple):
                out |= _free_vars(c)
    return out


def _has_decimal(node: tuple) -> bool:
    if node[0] == "num":
        return bool(node[2])
    return any(_has_decimal(c) for child in node[1:] for c in (child if isinstance(child, list) else [child])
               if isinstance(c, tuple))


def _small(x: Fraction) -> Fraction | None:
    return x if x.numerator.bit_length() + x.denominator.bit_length() <= MAX_BITS else None


def _iroot(n: int, k: int) -> int | None:
    """The integer k-th root of n >= 0 if n is a perfect k-th power, else None (Newton's method on integers)."""
    if n < 2:
        return n
    x = 1 << -(-n.bit_length() // k)  # >= the root
    while True:
        y = ((k - 1) * x + n // x ** (k - 1)) // k
        if y >= x:
            break
        x = y
    return x if x**k == n else None


def _exact_root(x: Fraction, k: int) -> Fraction | None:
    if k < 1 or k > 64 or (x < 0 and k % 2 == 0):
        return None
    num, den = _iroot(abs(x.numerator), k), _iroot(x.denominator, k)
    if num is None or den is None:
        return None
    return Fraction(num if x >= 0 else -num, den)


def _exact(node: tuple, budget: _Budget) -> Fraction | None:
    """The exact rational value of node, or None if it is not (visibly) rational. ZeroDivisionError if undefined."""
    budget.spend()
    kind = node[0]
    if kind == "num":
        if node[2] and _small(node[1]) is None:
            raise ValueError  # a decimal too long to hold exactly matches nothing (not its float rounding)
        return _small(node[1])
    if kind in ("add", "mul"):
        acc = Fraction(0 if kind == "add" else 1)
        for child in node[1]:
            v = _exact(child, budget)
            if v is None:
                return None
            acc = _small(acc + v if kind == "add" else acc * v)
            if acc is None:
                return None
        return acc
    if kind in ("neg", "inv", "abs"):
        v = _exact(node[1], budget)
        if v is None:
            return None
        return -v if kind == "neg" else abs(v) if kind == "abs" else 1 / v
    if kind == "pow":
        base, exp = _exact(node[1], budget), _exact(node[2], budget)
        if base is None or exp is None or exp.denominator > 64:
            return None
        if exp.denominator > 1:
            base = _exact_root(base, exp.denominator)
            if base is None:
                return None
        n = abs(exp.numerator)
        if (base.numerator.bit_length() + base.denominator.bit_length()) * n > MAX_BITS:
            return None
        return base**n if exp >= 0 else 1 / base**n
    if kind == "sqrt":
        x = _exact(node[1], budget)
        k = Fraction(2) if node[2] is None else _exact(node[2], budget)
        if x is None or k is None or k.denominator != 1:
            return None
        return _exact_root(x, k.numerator)
    if kind == "fact":
        x = _exact(node[1], budget)
        if x is None or x.denominator != 1 or not 0 <= x <= 100:
            return None
        return _small(Fraction(math.factorial(int(x))))
    return None  # const, var, inf, fn, log: not rational (or not provably so)


_CONSTS = {"pi": complex(math.pi), "e": complex(math.e), "i": 1j}


def _var_value(name: str, k: int) -> float:
    """The seeded value of variable `name` at point k, in [0.5, 2.5): the same name gets the same value on both
    sides of a comparison (crc32 of the name, not Python's salted hash, so it is the same in every process)."""
    return 0.5 + 2.0 * zlib.crc32(f"{name}/{k}".encode()) / 2**32


def _numeric(node: tuple, k: int, budget: _Budget) -> complex:
    """Complex value of node at seeded point k; raises ZeroDivisionError / OverflowError / ValueError if undefined."""
    budget.spend()
    kind = node[0]
    if kind == "num":
        return complex(float(node[1]))
    if kind == "const":
        return _CONSTS[node[1]]
    if kind == "var":
        return complex(_var_value(node[1], k))
    if kind == "add":
        return _finite(sum(_numeric(c, k, budget) for c in node[1]))
    if kind == "mul":
        acc = complex(1)
        for c in node[1]:
            acc = _finite(acc * _numeric(c, k, budget))
        return acc
    if kind == "neg":
        return 0j - _numeric(node[1], k, budget)  # not -z: that makes the imaginary part -0.0, and sqrt(-4) -2i
    if kind == "inv":
        return 1 / _numeric(node[1], k, budget)
    if kind == "abs":
        return complex(abs(_numeric(node[1], k, budget)))
    if kind == "pow":
        base, exp = _numeric(node[1], k, budget), _numeric(node[2], k, budget)
        if abs(exp) > 10_000:
            raise OverflowError
        return _finite(base**exp)
    if kind == "sqrt":
        x = _numeric(node[1], k, budget)
        if node[2] is None:
            return cmath.sqrt(x)
        n = _numeric(node[2], k, budget)
        if x.imag == 0 and x.real < 0 and n.imag == 0 and n.real % 2 == 1:  # real odd root of a negative
            return complex(-((-x.real) ** (1 / n.real)))
        return _finite(x ** (1 / n))
    if kind == "fn":
        return _finite(_FUNCS[node[1]](_numeric(node[2], k, budget)))
    if kind == "log":
        x = cmath.log(_numeric(node[1], k, budget))
        return x if node[2] is None else x / cmath.log(_numeric(node[2], k, budget))
    if kind == "fact":
        x = _numeric(node[1], k, budget)
        if x.imag != 0 or not 0 <= x.real <= 170:
            raise ValueError
        return complex(math.gamma(x.real + 1))
    raise ValueError  # inf and structures have no numeric value


def _finite(z: complex) -> complex:
    if not (math.isfinite(z.real) and math.isfinite(z.imag)) or abs(z) > 1e200:
        raise OverflowError
    return z


def _inf_sign(node: tuple) -> int:
    """+1 for \\infty, -1 for -\\infty, 0 for anything else."""
    if node == ("inf",):
        return 1
    if node[0] == "neg" and node[1] == ("inf",):
        return -1
    return 0


def _fingerprint(node: tuple, budget: _Budget) -> tuple:
    """What two expressions are compared by: (inf sign, exact value or None, has a decimal, values at the points,
    the digits of a lone decimal such as "0.0833333333333333" or -0.5 as written, else None)."""
    try:
        exact = _exact(node, budget)
    except (ZeroDivisionError, OverflowError, ValueError):
        return (0, None, False, (None,) * NUM_POINTS, None)  # undefined (1/0): equal to nothing
    values = []
    for k in range(NUM_POINTS):
        try:
            values.append(_numeric(node, k, budget))
        except (ZeroDivisionError, OverflowError, ValueError):
            values.append(None)
    lone = node[1] if node[0] == "neg" else node
    written = lone[2] if lone[0] == "num" and lone[2] else None
    return (_inf_sign(node), exact, _has_decimal(node), tuple(values), written)


# A decimal of at least this many significant digits matches an exact rational it is a print of: the rational
# rounded or cut off at the decimal's last digit ("0.0833333333333333" is 1/12, "0.6666666666666666" and
# "0.6666666667" are 2/3; "0.333333" and "0.33" are not 1/3). docs/answer_checking.md says why 10.
FLOAT_PRINT_DIGITS = 10
_MAX_PRINT_PLACES = 400  # longer decimals are compared exactly only (bounds the powers of ten below)


def _float_print_of(written: str, value: Fraction, gold: Fraction) -> bool:
    """True if the decimal `written` (value `value`, its sign included) has >= FLOAT_PRINT_DIGITS significant
    digits and equals the exact `gold` rounded half away from zero, or cut off toward zero, at its last digit."""
    whole, _, frac = written.partition(".")
    if len((whole + frac).lstrip("0")) < FLOAT_PRINT_DIGITS or len(frac) > _MAX_PRINT_PLACES:
        return False
    if (value < 0) != (gold < 0) or gold == 0:
        return False
    scale = 10 ** len(frac)
    printed, exact = abs(value) * scale, abs(gold) * scale  # printed is an integer
    return printed in (math.floor(exact), math.floor(exact + Fraction(1, 2)))


def _close(a, b, rtol: float) -> bool:
    return abs(a - b) <= rtol * max(1.0, abs(a), abs(b))


def _fingerprints_equal(fa: tuple, fb: tuple, tolerance: float) -> bool:
    if fa[0] or fb[0]:
        return fa[0] == fb[0]
    xa, xb = fa[1], fb[1]
    if xa is not None and xb is not None:  # two rationals: exactly, or a float print of one, or within tolerance
        if xa == xb or (fa[4] and not fb[2] and _float_print_of(fa[4], xa, xb)):
            return True
        if fb[4] and not fa[2] and _float_print_of(fb[4], xb, xa):
            return True
        return tolerance > 0 and _close(xa, xb, tolerance)
    # A decimal is an approximation: 1.4142135623 is not \sqrt{2} unless --reward_tolerance says so.
    if tolerance <= 0 and ((xa is not None and fa[2]) or (xb is not None and fb[2])):
        return False
    rtol = max(NUM_RTOL, tolerance)
    valid = 0
    for va, vb in zip(fa[3], fb[3]):
        if va is None or vb is None:
            continue
        if not _close(va, vb, rtol):
            return False
        valid += 1
    return valid >= 3  # at least 3 of the NUM_POINTS points defined on both sides


def _rel_to_interval(node: tuple) -> tuple | None:
    """x < 5 -> (-\\infty, 5); 1 <= x < 2 -> [1, 2); 5 >= x -> (-\\infty, 5]. None if not of that form."""
    exprs, ops = node[1], node[2]
    if all(o in (">", ">=") for o in ops):
        exprs, ops = exprs[::-1], [_FLIP[o] for o in ops[::-1]]
    if not all(o in ("<", "<=") for o in ops) or len(ops) > 2:
        return None
    is_var = [e[0] == "var" for e in exprs]
    if len(ops) == 2 and is_var == [False, True, False]:
        lo, hi = exprs[0], exprs[2]
    elif len(ops) == 1 and is_var == [True, False]:
        lo, hi = ("neg", ("inf",)), exprs[1]
        ops = ["<"] + ops
    elif len(ops) == 1 and is_var == [False, True]:
        lo, hi = exprs[0], ("inf",)
        ops = ops + ["<"]
    else:
        return None
    return ("seq", "(" if ops[0] == "<" else "[", ")" if ops[1] == "<" else "]", [lo, hi])


def _ascending(ends: list, budget: _Budget) -> bool:
    """False if both ends of an interval are real numbers and lo >= hi: 15 < x < -29 is no interval, so it must
    not match the pair (15, -29)."""
    values = []
    for end in ends:
        if end[0] == "inf" or (end[0] == "neg" and end[1] == ("inf",)):
            return True
        v = _fingerprint(end, budget)[3][0]
        if v is None or v.imag != 0:
            return True
        values.append(v.real)
    return values[0] < values[1]


_STRUCTURES = ("seq", "set", "rel", "union", "matrix")


def _trees_equal(a: tuple, b: tuple, tolerance: float, budget: _Budget, cache: dict) -> bool:
    ka, kb = a[0], b[0]
    if ka not in _STRUCTURES and kb not in _STRUCTURES:
        fps = []
        for node in (a, b):
            if id(node) not in cache:
                cache[id(node)] = (node, _fingerprint(node, budget))  # node kept alive so its id stays unique
            fps.append(cache[id(node)][1])
        return _fingerprints_equal(fps[0], fps[1], tolerance)
    same = lambda x, y: _trees_equal(x, y, tolerance, budget, cache)
    if ka == "rel" and kb == "rel":
        return _rels_equal(a, b, same, budget)
    for x, y in ((a, b), (b, a)):
        if x[0] == "rel" and y[0] not in ("rel", "set"):
            if x[2] == ["="] and y[0] not in _STRUCTURES:  # "k = 1" against 1, "2x + 3 = y" against 2x + 3
                lhs, rhs = x[1]
                if lhs[0] == "var" or rhs[0] == "var":
                    return same(rhs if lhs[0] == "var" else lhs, y)
            interval = _rel_to_interval(x) if y[0] in ("seq", "union") else None
            return interval is not None and _ascending(interval[3], budget) and same(interval, y)
    if ka != kb:
        return False
    if ka == "seq":
        return a[1:3] == b[1:3] and len(a[3]) == len(b[3]) and all(map(same, a[3], b[3]))
    if ka == "matrix":
        return [len(r) for r in a[1]] == [len(r) for r in b[1]] and all(
            same(x, y) for ra, rb in zip(a[1], b[1]) for x, y in zip(ra, rb))
    # set and union: order-free, each item of one matched to its own item of the other
    items_a, items_b = a[-1], list(b[-1])
    if len(items_a) != len(items_b) or len(items_a) > MAX_ITEMS:
        return False
    for x in items_a:
        hit = next((j for j, y in enumerate(items_b) if same(x, y)), None)
        if hit is None:
            return False
        items_b.pop(hit)
    return True


def _rels_equal(a: tuple, b: tuple, same, budget: _Budget) -> bool:
    """Relations compare side by side after writing > and >= as < and <= (5 \\geq x is x \\leq 5), also with every
    member of one negated (-x > -1 is x < 1); else as one-relation statements f < 0, f = 0 ... with f = lhs - rhs,
    equal when the two f are proportional (see _proportional)."""
    def canonical(exprs, ops):
        if ops and all(o in (">", ">=") for o in ops):
            return exprs[::-1], [_FLIP[o] for o in ops[::-1]]
        return exprs, ops
    (ea, oa) = canonical(a[1], a[2])
    for eb, ob in (canonical(b[1], b[2]), canonical([("neg", e) for e in b[1]], [_FLIP[o] for o in b[2]])):
        if oa != ob:
            continue
        if all(map(same, ea, eb)):
            return True
        symmetric = all(o in ("=", "!=") for o in oa)  # a = b is b = a
        if symmetric and len(ea) == 2 and same(ea[0], eb[1]) and same(ea[1], eb[0]):
            return True
    (eb, ob) = canonical(b[1], b[2])
    if oa != ob or len(oa) != 1 or any(e[0] in _STRUCTURES for e in ea + eb):
        return False
    diff = lambda e: ("add", [e[0], ("neg", e[1])])
    return _proportional(diff(ea), diff(eb), oa[0] not in ("=", "!="), budget)


def _proportional(fa: tuple, fb: tuple, positive: bool, budget: _Budget) -> bool:
    """f_a = c * f_b for one constant c != 0 (c > 0 if `positive`: an inequality keeps its direction), checked at
    the seeded points: 2x+4y=3 is x+2y=1.5, y=2x+3 is 2x-y+3=0, and -x < -1 is x > 1; but 2x+4y=3 is not 2x+4y=6
    (f_a - f_b is a nonzero constant, so the ratio moves). Only for relations with variables ("1 = 2" is not
    "2 = 4"), the same ones on both sides, and at least 3 points where both f are defined and f_b is not 0."""
    if not _free_vars(fa) or _free_vars(fa) != _free_vars(fb):
        return False
    va, vb = _fingerprint(fa, budget)[3], _fingerprint(fb, budget)[3]
    pairs = [(x, y) for x, y in zip(va, vb) if x is not None and y is not None]
    if len(pairs) < 3 or any(abs(y) <= NUM_RTOL or abs(x) <= NUM_RTOL for x, y in pairs):
        return False  # f vanishes at a seeded point: too close to call
    x0, y0 = max(pairs, key=lambda p: abs(p[1]))
    c = x0 / y0
    if positive and (abs(c.imag) > NUM_RTOL * abs(c) or c.real <= 0):
        return False
    return all(_close(x, c * y, NUM_RTOL * 100) for x, y in pairs)


# ---------------------------------------------------------------- public checks


_VARIABLE = re.compile(r"[A-Za-z](?:_\w|_\{\w+\})?")  # x, a_1, a_{12} (Greek letters: _GREEK)
_ORDER_RELATION = re.compile(r"[<>≤≥≠]|\\(?:le|ge|lt|gt|ne)")


def _chain_answer(s: str, rounded: bool = False) -> str:
    """A chain that starts from a variable is an assignment of its answer: "x=5+5+1=11" -> "x=11"; with
    approximations the exact member wins: "x=1/3\\approx0.33" -> "x=1/3" (the last member reached from the
    variable through "=" alone), and "x\\approx11" -> "x=11" (nothing exact: the last member). rounded: the
    last member instead, "x=0.33", if it is the exact member rounded or cut off at its last digit (_rounds,
    for a gold that asks for a rounding); else the same as without. Anything else (one "=", no
    leading variable, an order relation, a list or an empty member in it, or exact members that are no
    computation: _chain_consistent) is returned as it is."""
    if "=" not in s and "\\approx" not in s and "≈" not in s:
        return s
    members, seps, depth, start, i = [], [], 0, 0, 0
    while i < len(s):  # split at top-level "=", "\approx", "≈" (not the "=" of "<=", ">=", "!=")
        c, width = s[i], 0
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0 and c == "=" and (i == 0 or s[i - 1] not in "<>!"):
            seps.append("=")
            width = 1
        elif depth == 0 and c == "≈":
            seps.append("~")
            width = 1
        elif depth == 0 and s.startswith("\\approx", i) and not s[i + 7 : i + 8].isalpha():
            seps.append("~")
            width = 7
        if width:
            members.append(s[start:i])
            start = i + width
            i += width
        else:
            i += 1
    members.append(s[start:])
    if (len(seps) < 2 and seps != ["~"]) or not all(members) or _ORDER_RELATION.search(s):
        return s
    if any(";" in m or len(_split_top(m)) > 1 for m in members):
        return s  # "x=1,y=2=2": a list of statements, not one chain
    if not (_VARIABLE.fullmatch(members[0]) or members[0] in _GREEK):
        return s
    exact = 0
    while exact < len(seps) and seps[exact] == "=":
        exact += 1
    if exact >= 2 and not _chain_consistent(members[1 : exact + 1]):
        return s
    if rounded and 0 < exact < len(seps) and _rounds(members[exact], members[-1]):
        return members[0] + "=" + members[-1]
    return members[0] + "=" + members[exact if exact else -1]


def _rounds(exact: str, approx: str) -> bool:
    """True if `approx` is a decimal ("0.33", "1.57") that is the constant `exact` ("1/3", "\\frac{\\pi}{2}")
    rounded or cut off at its last digit (within float precision), so "x = 1/3 \\approx 0.33" may answer 0.33,
    but "x = 1/3 \\approx 0.5" never answers 0.5 nor "x = \\frac{\\pi}{2} \\approx 1.58" 1.58."""
    if not _DECIMAL.fullmatch(approx.lstrip("-")) or "." not in approx or len(approx) > 40:
        return False
    try:
        node = parse_answer(exact)
        if _free_vars(node):
            return False  # "y + 1 \approx 2.5": no constant to round
        value = _fingerprint(node, _Budget())[3][0]
    except (_Fail, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return False
    if value is None or value.imag != 0:
        return False
    unit, v, a = 10.0 ** -len(approx.partition(".")[2]), value.real, float(approx)
    slack = 1e-9 * max(1.0, abs(v))
    rounded = abs(v - a) <= unit / 2 + slack
    cut_off = (v >= 0) == (a >= 0) and -slack <= abs(v) - abs(a) < unit + slack
    return rounded or cut_off


def _chain_consistent(members: list[str]) -> bool:
    """True if the last member has the value of some earlier one ("5+5+1", "7", "11": 11 = 5+5+1), so that a chain
    is a computation, not two statements run together ("x=1y=2" from "x = 1 \\quad y = 2", "x=1,y=2"). At most
    MAX_ITEMS members and one budget for the whole check; over them, or outside the grammar: False."""
    if len(members) > MAX_ITEMS:
        return False
    budget, cache = _Budget(), {}
    try:
        last = parse_answer(members[-1])
        for m in members[:-1]:
            if _trees_equal(parse_answer(m), last, 0.0, budget, cache):
                return True
    except (_Fail, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        pass
    return False


def _drop_assignment(s: str, other: str) -> str:
    """"x=5" -> "5" when the other answer has no "=" (MATH's convention: a single-letter assignment is its value;
    "x=5" against "y=5" stays a relation, compared side by side)."""
    if len(s) > 2 and s[1] == "=" and s[0].isalpha() and s.count("=") == 1 and "=" not in other:
        return s[2:]
    return s


def answers_match(pred: str, gold: str, tolerance: float = 0.0, numeric: bool = False, question: str = "") -> bool:
    """True if `pred` and `gold` are the same answer: equal normalised strings, or equal values of their trees
    (see the module docstring). `tolerance` > 0 lets a decimal match an exact value within that relative error.
    numeric: the task's answers are numbers, so `pred` must be one too (to_number's forms after normalisation:
    "84", "$84", "84 apples", "1,000", "0.5", "3/4"), never an expression that evaluates to it ("82-18+20").
    question: the problem's text; an answer that only restates one of its expressions is none (echoes_question)."""
    if not isinstance(pred, str) or not isinstance(gold, str):
        return False
    b = normalize(gold)
    comma = bool(b) and to_number(b) is not None  # "1000,99" against one number
    a = normalize(pred, decimal_comma=comma)
    if question and echoes_question(a, b, question):
        return False
    if _normalized_match(a, b, tolerance, numeric):
        return True
    # "x = 1/3 \\approx 0.33": the exact member was compared; its rounding too, against a gold that is one
    if a and b and ("\\approx" in pred or "≈" in pred):
        rounded = normalize(pred, decimal_comma=comma, rounded=True)
        if rounded != a and _normalized_match(rounded, b, tolerance, numeric):
            return True
    if a and b and ("\\approx" in gold or "≈" in gold):  # the same either way round
        rounded = normalize(gold, rounded=True)
        return rounded != b and _normalized_match(a, rounded, tolerance, numeric)
    return False


def echoes_question(a: str | None, b: str | None, question: str) -> bool:
    r"""Whether the normalised answer `a` restates one of the question's math spans rather than answering it:
    "Simplify $\sqrt{242}$." answered "\sqrt{242}", "Express $\frac{3}{20}$ as a decimal." answered "\frac{3}{20}".
    Equal in value to the gold, so a value check accepts it, and a policy learns to copy the question. A plain
    integer or decimal is never an echo (the question may name the answer), nor is the gold's own text."""
    if not a or a == b or (to_number(a) is not None and "/" not in a and "frac" not in a):
        return False
    return a in _question_expressions(question)


@functools.lru_cache(maxsize=4096)  # a prompt's G samples share one question
def _question_expressions(question: str) -> frozenset:
    """The question's math spans, normalised."""
    spans = (normalize(question[cs:ce]) for _, _, cs, ce in _math_spans(question))
    return frozenset(x for x in spans if x)


def _normalized_match(a: str | None, b: str | None, tolerance: float, numeric: bool) -> bool:
    """answers_match on two normalised answers."""
    if not a or not b:
        return False
    a, b = _drop_assignment(a, b), _drop_assignment(b, a)
    if numeric and to_number(a) is None:
        return False
    if _atom_equal(a, b):
        return True
    sa, sb = _as_sequence(a), _as_sequence(b)
    if sa and sb and sa[0] == sb[0] and sa[2] == sb[2] and len(sa[1]) == len(sb[1]):
        if all(_atom_equal(x, y) for x, y in zip(sa[1], sb[1])):
            return True
    try:
        ta, tb = parse_answer(a), parse_answer(b)
        return _trees_equal(ta, tb, tolerance, _Budget(), {})
    except (_Fail, ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return False  # outside the grammar or over a bound: only the string comparison above counts


def canonical_answer(answer: str) -> str | None:
    """Canonical form of an answer for majority voting (equal answers give equal strings); None if it is empty
    or too long to check.

    Numbers become reduced fractions/integers ("0.50" -> "1/2"), sequences are canonicalised element-wise, so the
    result is itself a valid answer for answers_match.
    """
    s = normalize(answer)
    if s and len(s) > 2 and s[1] == "=" and s[0].isalpha() and s.count("=") == 1:
        s = s[2:]  # "x=5" votes with "5" (a single-letter assignment: MATH's convention)
    if not s:
        return None
    if to_number(s) is not None:
        return _canonical_atom(s)
    seq = _as_sequence(s)
    if seq is None:
        return s
    open_, items, close = seq
    return open_ + ",".join(_canonical_atom(x) for x in items) + close
