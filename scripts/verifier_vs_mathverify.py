r"""Our answer check (verifier.answers_match) against math-verify on a corpus built from MATH-500 golds.

    pip install -e ".[bench]"      # math-verify (and sympy): this script only, never imported by verifier.py
    python scripts/verifier_vs_mathverify.py --data ../shared/data/math500/test.jsonl

The corpus: every gold answer rewritten by hand-written rules into forms that are the same answer ("same") or a
different one ("differ"), plus fuzzed ones: random chains of 2-3 "same" rules (still the same answer) and such a
chain with one "differ" rule in it (a different answer). The label comes from the rule, not from either checker.
A third label, "approx", is a decimal rounding of an irrational or non-terminating gold (0.0833 for 1/12): wrong
for an exact task (our default) and right for math-verify's default rounding; it is counted on its own line.

Prints, for each checker, agreement with the labels, false accepts (a "differ" case scored correct) and false
rejects (a "same" case scored wrong), the median and worst time per call (parse both + compare, interleaved on
the same case), then every case where the two checkers disagree, grouped by rule.
"""

import argparse
import json
import random
import re
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import verifier  # noqa: E402

# ---------------------------------------------------------------- rewrite rules: gold -> candidate or None

INT = re.compile(r"-?\d+")
FRAC = re.compile(r"(-?)\\frac\{(\d+)\}\{(\d+)\}")
SQRT = re.compile(r"(\d*)\\sqrt\{(\d+)\}")
SUM = re.compile(r"^([^+\-,()=]+)([+-])([^+\-,()=]+)$")  # exactly two terms, no sign, list, group or relation
INEQ = re.compile(r"^([a-z])\s*(\\le|\\leq|\\ge|\\geq|<|>)\s*(.+)$")
THOUSANDS = re.compile(r"(\\\$)?\d{1,3}(,(\\!)?\s*\d{3})+")
PI_FRAC = re.compile(r"\\frac\{(\d*)\\pi\}\{(\d+)\}")
POWER = re.compile(r"\^(\d)")
STRICT = {"\\le": "<", "\\leq": "<", "\\ge": ">", "\\geq": ">"}
GE = "\\ge"
FLIP = {"\\le": "\\ge", "\\leq": "\\geq", "\\ge": "\\le", "\\geq": "\\leq", "<": ">", ">": "<"}


def is_int(g):
    return INT.fullmatch(g) is not None


def terminating(n, d):
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    return d == 1


def items(g):
    """Top-level comma items of a bare list or tuple body, or None (also for one number written with thousands
    separators, such as 10,\\!080 or \\$32,\\!348)."""
    if THOUSANDS.fullmatch(g):
        return None
    body = g[1:-1] if g[:1] in "([" and g[-1:] in ")]" else g
    depth, parts, start = 0, [], 0
    for i, c in enumerate(body):
        depth += (c in "([{") - (c in ")]}")
        if c == "," and depth == 0:
            parts.append(body[start:i])
            start = i + 1
    parts.append(body[start:])
    return [p.strip() for p in parts] if len(parts) > 1 and depth == 0 else None


SAME = {
    "dollars": lambda g: f"$${g}$$",
    "paren_delims": lambda g: f"\\( {g} \\)",
    "bracket_delims": lambda g: f"\\[ {g} \\]",
    "boxed_sentence": lambda g: f"The final answer is $\\boxed{{{g}}}$.",
    "x_equals": lambda g: f"x = {g}" if "," not in g and "=" not in g and "\\le" not in g else None,
    "cfrac": lambda g: g.replace("\\frac", "\\cfrac") if "\\frac" in g else None,
    "dfrac": lambda g: g.replace("\\frac", "\\dfrac") if "\\frac" in g else None,
    "units": lambda g: f"{g} \\text{{ units}}" if is_int(g) else None,
    "textnormal_unit": lambda g: f"{g}\\textnormal{{ cm}}^2" if is_int(g) else None,
    "trailing_zeros": lambda g: f"{g}.00" if is_int(g) else None,
    "thousands": lambda g: f"{int(g):,}" if is_int(g) and abs(int(g)) >= 1000 else None,
    "unreduced": lambda g: FRAC.sub(lambda m: f"{m[1]}\\frac{{{2 * int(m[2])}}}{{{2 * int(m[3])}}}", g)
    if FRAC.fullmatch(g) else None,
    "slash": lambda g: FRAC.sub(lambda m: f"{m[1]}{m[2]}/{m[3]}", g) if FRAC.fullmatch(g) else None,
    "decimal": lambda g: (lambda m: f"{m[1]}{int(m[2]) / int(m[3])}" if terminating(int(m[2]), int(m[3])) else None)(
        FRAC.fullmatch(g)) if FRAC.fullmatch(g) else None,
    "sqrt_in": lambda g: (lambda m: f"\\sqrt{{{int(m[1]) ** 2 * int(m[2])}}}")(SQRT.fullmatch(g))
    if SQRT.fullmatch(g) and SQRT.fullmatch(g)[1] else None,
    "sqrt_out": lambda g: f"\\frac{{{g}}}{{1}}" if "\\sqrt" in g and "," not in g else None,
    "reorder_sum": lambda g: (lambda m: f"{m[3]}{m[2]}{m[1]}" if m[2] == "+" else f"-{m[3]}+{m[1]}")(SUM.match(g))
    if SUM.match(g) and "\\" not in g.replace("\\sqrt", "").replace("\\pi", "") else None,
    "left_right": lambda g: f"\\left({g[1:-1]}\\right)" if g[:1] == "(" and g[-1:] == ")" else None,
    "list_reorder": lambda g: ", ".join(reversed(items(g))) if items(g) and g[:1] not in "([" else None,
    "ineq_flip": lambda g: (lambda m: f"{m[3]} {FLIP[m[2]]} {m[1]}")(INEQ.match(g)) if INEQ.match(g) else None,
    "pi_coef": lambda g: (lambda m: f"\\frac{{{m[1] or 1}}}{{{m[2]}}}\\pi")(PI_FRAC.fullmatch(g))
    if PI_FRAC.fullmatch(g) else None,
    "frac_power": lambda g: (lambda m: f"{m[1]}{m[2]} \\cdot {m[3]}^{{-1}}")(FRAC.fullmatch(g))
    if FRAC.fullmatch(g) else None,
    "sqrt_power": lambda g: (lambda m: f"{m[1] or 1} \\cdot {m[2]}^{{\\frac{{1}}{{2}}}}")(SQRT.fullmatch(g))
    if SQRT.fullmatch(g) else None,
    "times_one": lambda g: f"1 \\cdot \\left({g}\\right)" if re.fullmatch(r"[-\w\\{}^+ ]+", g) and "\\text" not in g
    and "_" not in g else None,
    "neg_frac": lambda g: (lambda m: f"\\frac{{-{m[2]}}}{{{m[3]}}}")(FRAC.fullmatch(g)) if FRAC.fullmatch(g)
    and FRAC.fullmatch(g)[1] else None,
    "set_braces": lambda g: f"\\{{{g}\\}}" if items(g) and g[:1] not in "([" else None,
    "interval_ineq": lambda g: interval_to_ineq(g, strict_ok=True),
    "spaces": lambda g: " ".join(g.replace(",", " , ").split())
    if len(g) > 1 and not THOUSANDS.fullmatch(g) else None,
}

DIFFER = {
    "plus_one": lambda g: str(int(g) + 1) if is_int(g) else None,
    "times_ten": lambda g: str(int(g) * 10) if is_int(g) and g != "0" else None,
    "negate": lambda g: str(-int(g)) if is_int(g) and g != "0" else None,
    "list_split": lambda g: f"{g[:-3]}, {g[-3:]}" if is_int(g) and abs(int(g)) >= 1000 else None,
    "flip_frac": lambda g: FRAC.sub(lambda m: f"{m[1]}\\frac{{{m[3]}}}{{{m[2]}}}", g)
    if FRAC.fullmatch(g) and FRAC.fullmatch(g)[2] != FRAC.fullmatch(g)[3] else None,
    "num_plus_one": lambda g: FRAC.sub(lambda m: f"{m[1]}\\frac{{{int(m[2]) + 1}}}{{{m[3]}}}", g)
    if FRAC.fullmatch(g) else None,
    "sqrt_plus_one": lambda g: SQRT.sub(lambda m: f"{m[1]}\\sqrt{{{int(m[2]) + 1}}}", g, count=1)
    if SQRT.search(g) else None,
    "sign_flip": lambda g: (lambda m: f"{m[1]}{'-' if m[2] == '+' else '+'}{m[3]}")(SUM.match(g))
    if SUM.match(g) else None,
    "tuple_swap": lambda g: f"({', '.join(reversed(items(g)))})" if g[:1] == "(" and items(g)
    and len(set(items(g))) > 1 and "\\infty" not in g else None,
    "bracket": lambda g: "[" + g[1:] if g[:1] == "(" and g[-1:] in ")]" and items(g) else None,
    "drop_item": lambda g: ", ".join(items(g)[1:]) if items(g) and g[:1] not in "([" else None,
    "variable": lambda g: g.replace("x", "y")  # x \\in [1, 2] names no variable of the answer: skipped
    if re.search(r"(?<![a-z\\])x(?![a-z])", g) and "\\in" not in g else None,
    "ineq_strict": lambda g: (lambda m: f"{m[1]} {STRICT[m[2]]} {m[3]}")(INEQ.match(g))
    if INEQ.match(g) and INEQ.match(g)[2] in STRICT else None,
    "exponent": lambda g: POWER.sub(lambda m: f"^{int(m[1]) + 1}", g, count=1)
    if POWER.search(g) and "\\mbox" not in g and "\\text" not in g else None,  # not a unit's power (cm^2)
    "interval_ineq_wrong": lambda g: interval_to_ineq(g, strict_ok=False),
    "close_frac": lambda g: (lambda m: f"{m[1]}\\frac{{{1000 * int(m[2]) + 1}}}{{{1000 * int(m[3])}}}")(
        FRAC.fullmatch(g)) if FRAC.fullmatch(g) else None,  # within 0.1% of the gold, but not it
    "pi_twice": lambda g: f"2{g}" if "\\pi" in g and "," not in g else None,
}


def interval_to_ineq(g, strict_ok):
    """(a, b] -> a < x \\le b; (-\\infty, b) -> x < b; with strict_ok False, the first bracket's meaning flipped."""
    m = re.fullmatch(r"([(\[])([^,]+),([^,]+)([)\]])", g.replace(" ", ""))
    if not m:
        return None
    lo_op = ("<" if m[1] == "(" else "\\le") if strict_ok else ("\\le" if m[1] == "(" else "<")
    hi_op = "<" if m[4] == ")" else "\\le"
    lo, hi = m[2], m[3]
    if "infty" in lo and "infty" in hi:
        return None
    if "infty" in lo:
        return f"x {hi_op} {hi}" if strict_ok else None
    if "infty" in hi:
        return f"x {'>' if lo_op == '<' else GE} {lo}"
    return f"{lo} {lo_op} x {hi_op} {hi}"


def approx(g):
    """A 6-digit decimal rounding of a non-terminating rational or an irrational gold, or None."""
    m = FRAC.fullmatch(g)
    if m and not terminating(int(m[2]), int(m[3])):
        return f"{m[1]}{int(m[2]) / int(m[3]):.6f}"
    m = SQRT.fullmatch(g)
    if m:
        return f"{int(m[1] or 1) * int(m[2]) ** 0.5:.6f}"
    return None


INTERVAL_RULES = {"interval_ineq", "interval_ineq_wrong", "bracket"}  # only where the problem asks for an interval
POINT_RULES = {"tuple_swap"}  # only where it does not: (2, 4) is then an ordered pair


def applies(name, interval):
    return (name not in INTERVAL_RULES or interval) and (name not in POINT_RULES or not interval)


def build_corpus(rows, seed=0):
    """[(rule, gold, candidate, label)] with label in same | differ | approx; rows: (gold, problem)."""
    rng, cases = random.Random(seed), []
    for g, problem in rows:
        interval = "interval" in problem.lower()
        for kind, rules in (("same", SAME), ("differ", DIFFER)):
            for name, rule in rules.items():
                c = rule(g) if applies(name, interval) else None
                if c is not None and c != g:
                    cases.append((name, g, c, kind))
        a = approx(g)
        if a is not None:
            cases.append(("approx", g, a, "approx"))
        # fuzzed: chains of same-rules (still the same answer), and a chain with one differ-rule in it
        for kind in ("same", "differ"):
            chain, c = [], g
            steps = rng.sample([n for n in sorted(SAME) if applies(n, interval)], k=rng.randint(2, 3))
            if kind == "differ":  # change the value first, then rewrite its form
                steps.insert(0, rng.choice([n for n in sorted(DIFFER) if applies(n, interval)]))
            for name in steps:
                out = (DIFFER if name in DIFFER else SAME)[name](c)
                if out is not None:
                    chain.append(name)
                    c = out
            if c != g and (kind == "same" or any(n in DIFFER for n in chain)):
                cases.append(("fuzz:" + "+".join(chain), g, c, kind))
    return cases


# ---------------------------------------------------------------- the two checkers


def ours(pred, gold):
    return verifier.answers_match(pred, gold)


def make_mathverify():
    from math_verify import parse, verify

    def check(pred, gold):
        has_delims = any(d in pred for d in ("$", "\\(", "\\[", "\\boxed"))
        return bool(verify(parse(f"\\boxed{{{gold}}}"), parse(pred if has_delims else f"${pred}$")))

    return check


ADVERSARIAL = [  # built to hit every bound of verifier.py: caps, depth, budget, big numbers, long lists
    "(" * 500 + "1" + ")" * 500, "\\sqrt{" * 300 + "2" + "}" * 300, "9^{" * 200 + "9" + "}" * 200,
    "+".join(f"\\frac{{1}}{{{p}}}" for p in range(2, 80)), "x" + "+x" * 199, ",".join(["\\sqrt{2}x"] * 60),
    "\\{" + ",".join(str(k) for k in range(31)) + "\\}", "2^{4096}" + "*2^{4096}" * 40, "9" * 999,
    "|" * 300, "\\frac" * 200, "-" * 999, "x<" * 150 + "1", "(1,2)\\cup" * 80 + "(3,4)", "1 \\pm " * 100,
]


def fuzz_inputs(n, seed):
    """The adversarial strings above and n random concatenations of grammar fragments."""
    parts = ["\\frac{", "\\sqrt[", "{", "}", "(", ")", "^", "9", "99999", "x", "\\pi", "e", "i", ",", "=", "<",
             "\\le", "\\cup", "\\{", "\\}", "|", "!", "\\pm", "\\sin", "+", "-", "/", ".", " ", "\\infty", "_"]
    rng = random.Random(seed)
    return ADVERSARIAL + ["".join(rng.choice(parts) for _ in range(rng.randrange(1, 300))) for _ in range(n)]


def timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/math500/test.jsonl", help="MATH-500 test.jsonl")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N golds (0 = all)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the fuzzed rewrites")
    ap.add_argument("--show", type=int, default=40, help="disagreements listed per group")
    ap.add_argument("--fuzz", type=int, default=2000, help="random inputs for ours' worst-case time (0 = skip)")
    args = ap.parse_args(argv)
    path = Path(args.data)
    if not path.is_file():
        raise SystemExit(f"error: --data {path}: no such file (the MATH-500 test.jsonl)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [(r["answer"], r["problem"]) for r in rows[: args.limit or len(rows)]]
    golds = [g for g, _ in rows]
    cases = build_corpus(rows, args.seed)
    mv = make_mathverify()
    results = []  # (rule, gold, pred, label, ours, mv)
    times = {"ours": [], "math-verify": []}
    for rule, gold, pred, label in cases:
        a, ta = timed(ours, pred, gold)
        b, tb = timed(mv, pred, gold)
        times["ours"].append(ta)
        times["math-verify"].append(tb)
        results.append((rule, gold, pred, label, a, b))

    print(f"corpus: {len(cases)} cases from {len(golds)} MATH-500 golds "
          f"({sum(r[3] == 'same' for r in results)} same, {sum(r[3] == 'differ' for r in results)} differ, "
          f"{sum(r[3] == 'approx' for r in results)} approx)\n")
    print("| checker | agree with label | false accepts | false rejects | approx accepted | median ms | worst ms |")
    print("|---|---|---|---|---|---|---|")
    exact = [r for r in results if r[3] != "approx"]
    for k, name in ((4, "ours"), (5, "math-verify")):
        agree = sum(r[k] == (r[3] == "same") for r in exact)
        fa = sum(r[k] for r in exact if r[3] == "differ")
        fr = sum(not r[k] for r in exact if r[3] == "same")
        ap_ok = sum(r[k] for r in results if r[3] == "approx")
        t = times[name]
        print(f"| {name} | {agree}/{len(exact)} ({100 * agree / len(exact):.1f}%) | {fa} | {fr} | "
              f"{ap_ok}/{len(results) - len(exact)} | {1e3 * statistics.median(t):.2f} | {1e3 * max(t):.1f} |")
    for k, name in ((4, "ours"), (5, "math-verify")):
        wrong = [r for r in exact if r[k] != (r[3] == "same")]
        print(f"{name} wrong on {len(wrong)} labelled cases:")
        for r in wrong[: args.show]:
            print(f"    {r[3]} ours={int(r[4])} mv={int(r[5])}  {r[1]!r} -> {r[2]!r}  [{r[0]}]")
    both = sum(r[4] == r[5] for r in results)
    print(f"\nthe two agree with each other on {both}/{len(results)} cases\n")

    if args.fuzz:
        fuzz = [timed(ours, text, gold)[1] for text in fuzz_inputs(args.fuzz, args.seed) for gold in golds[:3]]
        print(f"ours on {len(fuzz)} adversarial/fuzzed calls: median {1e3 * statistics.median(fuzz):.2f} ms, "
              f"worst {1e3 * max(fuzz):.1f} ms\n")

    groups = defaultdict(list)
    for r in results:
        if r[4] != r[5]:
            groups[(r[3], r[0].split(":")[0] if r[0].startswith("fuzz") else r[0])].append(r)
    print("disagreements (label, rule: ours / math-verify, gold -> candidate):")
    for (label, rule), rows in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        print(f"- {label} {rule}: {len(rows)}")
        for r in rows[: args.show]:
            print(f"    ours={int(r[4])} mv={int(r[5])}  {r[1]!r} -> {r[2]!r}  [{r[0]}]")


if __name__ == "__main__":
    main()
