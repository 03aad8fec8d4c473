r"""A corpus of real model outputs for the answer checker (#49): build it from eval.py's completions, compare our
checker with math-verify on it.

    pip install -e ".[bench]"      # math-verify (and sympy): this script only, never imported by verifier.py
    D=$(python scripts/get_model.py smollm2-135m-instruct)
    python eval.py --model $D --task math --data_path ../shared/data/math500 --split "test[:150]" --template chat \
        --max_new_tokens 256 --out_dir runs/corpus_math
    python eval.py --model $D --task gsm8k --data_path ../shared/data/gsm8k --split "test[:150]" --template chat \
        --max_new_tokens 256 --out_dir runs/corpus_gsm8k
    python scripts/answer_corpus.py build --math runs/corpus_math --gsm8k runs/corpus_gsm8k --out candidates.jsonl \
        --keep tests/data/answer_corpus.jsonl
    python scripts/answer_corpus.py compare --corpus tests/data/answer_corpus.jsonl

build: for each completion, the text a checker is given is its last paragraph (after the last blank line; at most
MAX_TEXT_CHARS, whole lines from its end), as if the model had put it in the R1 <answer> block. Each row gets our
verdict (rewards.reward on "<think>...</think> <answer>TEXT</answer>", with the task's `numeric`) and
math-verify's (verify(parse("\boxed{GOLD}"), parse(TEXT)), its defaults: the way open-r1 scores a completion;
kept in the row as `math_verify`), and `verdict`: theirs where the two agree, None where they do not: those rows
are read and decided by hand (`checked: "hand"` and a `note`) before the file goes to tests/data; --keep carries
those decisions over.
compare: both checkers against the recorded verdicts: agreement, false accepts, false rejects, disagreements.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import rewards  # noqa: E402

MAX_TEXT_CHARS = 400
SOURCE = "smollm2-135m-instruct greedy chat 256"  # get_model.py's weights; eval.py --template chat --max_new_tokens 256


def answer_text(response: str) -> str:
    """The last paragraph of a response, at most MAX_TEXT_CHARS (whole lines from its end; one over-long line is
    cut to its last MAX_TEXT_CHARS characters)."""
    paragraphs = [p.strip() for p in response.strip().split("\n\n") if p.strip()]
    if not paragraphs:
        return ""
    lines = paragraphs[-1].splitlines()
    kept = []
    for line in reversed(lines):
        if kept and sum(len(x) + 1 for x in kept) + len(line) > MAX_TEXT_CHARS:
            break
        kept.insert(0, line)
    return "\n".join(kept)[-MAX_TEXT_CHARS:].strip()


def ours(text: str, gold: str, numeric: bool) -> bool:
    return rewards.reward(f"<think>work</think> <answer>{text}</answer>", gold, numeric=numeric)["correct"] == 1.0


def make_mathverify():
    from math_verify import parse, verify

    def check(text: str, gold: str) -> bool:
        return bool(verify(parse(f"\\boxed{{{gold}}}"), parse(text)))

    return check


def build(args):
    mv = make_mathverify()
    hand = {}  # (id, text) -> the row, for rows already decided by hand (--keep): their verdict and note stay
    if args.keep and Path(args.keep).exists():
        for r in map(json.loads, Path(args.keep).read_text().splitlines()):
            if r["checked"] == "hand":
                hand[(r["id"], r["text"])] = r
    rows, disagree = [], 0
    runs = [("math500", r, "math500/test.jsonl") for r in args.math] + [("gsm8k", r, "gsm8k/test.jsonl")
                                                                        for r in args.gsm8k]
    for task, run, data in runs:
        run, _, offset = run.partition("@")  # "runs/corpus_gsm8k_2@96": an eval of test[96:...]
        source_rows = [json.loads(x) for x in (Path(args.data) / data).read_text().splitlines() if x.strip()]
        for rec in map(json.loads, (Path(run) / "completions.jsonl").read_text().splitlines()):
            rec["problem"] += int(offset or 0)
            text = answer_text(rec["response"])
            if not text:
                continue
            numeric = task == "gsm8k"
            pid = source_rows[rec["problem"]].get("unique_id", f"gsm8k/test/{rec['problem']}")
            a, b = ours(text, rec["gold"], numeric), mv(text, rec["gold"])
            disagree += a != b
            row = {"id": pid, "task": task, "gold": rec["gold"], "numeric": numeric, "text": text,
                   "math_verify": b, "verdict": a if a == b else None,
                   "checked": "agree" if a == b else "hand", "note": "", "truncated": rec["truncated"],
                   "source": SOURCE}
            if (pid, text) in hand:
                row.update({k: hand[(pid, text)][k] for k in ("verdict", "checked", "note")})
            rows.append(row)
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(rows)} rows, {disagree} disagreements, {sum(r['verdict'] is None for r in rows)} still to check "
          f"by hand -> {args.out}")


def compare(args):
    rows = [json.loads(x) for x in Path(args.corpus).read_text().splitlines() if x.strip()]
    checkers = {"ours (rewards.reward)": lambda r: ours(r["text"], r["gold"], r["numeric"])}
    try:
        mv = make_mathverify()
        checkers["math-verify"] = lambda r: mv(r["text"], r["gold"])
    except ImportError:
        print("math-verify is not installed: pip install -e \".[bench]\"; ours only")
    n = len(rows)
    right = sum(r["verdict"] for r in rows)
    print(f"{n} rows ({right} right by the verdict, {sum(r['checked'] == 'hand' for r in rows)} checked by hand)")
    print("| checker | agrees with the verdict | false accepts | false rejects |")
    print("|---|---|---|---|")
    got = {}
    for name, check in checkers.items():
        got[name] = [check(r) for r in rows]
        agree = sum(g == r["verdict"] for g, r in zip(got[name], rows))
        fa = sum(g and not r["verdict"] for g, r in zip(got[name], rows))
        fr = sum(r["verdict"] and not g for g, r in zip(got[name], rows))
        print(f"| {name} | {agree}/{n} ({100 * agree / n:.1f}%) | {fa} | {fr} |")
    for name, verdicts in got.items():
        wrong = [(r, g) for g, r in zip(verdicts, rows) if g != r["verdict"]]
        if wrong:
            print(f"\n{name}: {len(wrong)} against the verdict")
            for r, g in wrong:
                print(f"  {r['id']}: gold {r['gold']!r}, says {g}, verdict {r['verdict']} ({r['note']}): "
                      f"{r['text'][-120:]!r}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--math", nargs="*", default=[], help="eval.py --out_dir of MATH-500 runs (DIR@N: of test[N:])")
    b.add_argument("--gsm8k", nargs="*", default=[], help="eval.py --out_dir of GSM8K runs (DIR@N: of test[N:])")
    b.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data"))
    b.add_argument("--out", default="candidates.jsonl")
    b.add_argument("--keep", default="", help="a corpus whose hand-checked verdicts (and notes) carry over")
    c = sub.add_parser("compare")
    c.add_argument("--corpus", default=str(Path(__file__).resolve().parents[1] / "tests" / "data" /
                                           "answer_corpus.jsonl"))
    args = ap.parse_args()
    build(args) if args.cmd == "build" else compare(args)


if __name__ == "__main__":
    main()
