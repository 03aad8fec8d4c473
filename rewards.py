"""Rewards: is a completion well-formed (the R1 format) and is its answer right (verifier.py)? `reward` scores one.

Pure Python, no torch; nothing here or in verifier.py ever evaluates model text. A reward is a weighted sum of
components, each a function below with an entry in DEFAULT_WEIGHTS (--reward_weights changes the weights):
  correct   1 if the <answer> block of a well-formed response matches the gold answer (verifier.answers_match;
            where the task's answers are numbers, `numeric`, the answer must be a number, not an expression; never
            an expression copied from the question, verifier.echoes_question)
  format    1 if the response has the strict R1 structure (parse_r1)
  overlong  DAPO's soft length penalty in [-1, 0] (overlong_penalty; weight 0 by default)

The R1 format (what earns `format` = 1), checked by `parse_r1` on the full response (the prompt's opening
"<think>" included, i.e. response_prefix + completion):

    <think> reasoning </think> <answer> final answer </answer>

- optional leading whitespace, then "<think>"; the first "</think>" closes it; then only whitespace; then
  "<answer>", the first "</answer>" closes it; then only whitespace, optionally one end-of-sequence marker
  (EOS_MARKERS, for callers that decode special tokens) and whitespace.
- both blocks hold non-whitespace text, and neither holds any of the four tags (no nesting, no second answer).
- tags are exact and case-sensitive ("<Think>", "< think >" do not count).
"""

import math

import verifier

DEFAULT_WEIGHTS = {"correct": 1.0, "format": 0.1, "overlong": 0.0}
OVERLONG_BUFFER = 0.25  # soft overlong penalty ramps over the last 25% of max_tokens (DAPO's L_cache)
MAX_RESPONSE_CHARS = 1_000_000  # parse_r1 rejects longer responses (its scan is linear, this only bounds memory)
EOS_MARKERS = ("<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<｜end▁of▁sentence｜>", "</s>", "<eos>")
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def reward(response: str, gold: str, weights: dict | None = None, *, num_tokens=None, max_tokens=None,
           tolerance: float = 0.0, numeric: bool = False, question: str = "") -> dict:
    """Score one response (response_prefix + completion) against the gold answer.

    Returns {"reward": weighted sum, "correct": 0/1, "format": 0/1, "overlong": in [-1, 0]}. `correct` needs the
    strict R1 format: the answer is read from the <answer> block only. `tolerance`, `numeric` (the row's answer form,
    data.py), `question` (the problem: an answer that restates one of its expressions is wrong): see
    verifier.answers_match.
    """
    weights = {**DEFAULT_WEIGHTS, **(weights or {})}  # names not given keep their default weight
    unknown = set(weights) - set(DEFAULT_WEIGHTS)
    if unknown:
        raise ValueError(f"unknown reward weights {sorted(unknown)}; known: {sorted(DEFAULT_WEIGHTS)}")
    parsed = parse_r1(response)
    parts = {
        "correct": float(parsed is not None and verifier.answers_match(parsed[1], gold, tolerance, numeric, question)),
        "format": float(parsed is not None),
        "overlong": overlong_penalty(num_tokens, max_tokens),
    }
    total = sum(weights[k] * v for k, v in parts.items())
    return {"reward": total, **parts}


# ---------------------------------------------------------------- the components


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


def extract_answer(response: str) -> str | None:
    """Canonical answer of an R1 response for majority voting (verifier.canonical_answer of its <answer> block:
    equal answers give equal strings); None if the response is not well-formed or its answer is empty."""
    parsed = parse_r1(response)
    return None if parsed is None else verifier.canonical_answer(parsed[1])


def overlong_penalty(num_tokens: int | None, max_tokens: int | None) -> float:
    """DAPO's soft overlong punishment: 0 until the last OVERLONG_BUFFER of max_tokens, then linear down to -1."""
    if num_tokens is None or max_tokens is None or max_tokens <= 0:
        return 0.0
    buffer = max(1, int(max_tokens * OVERLONG_BUFFER))
    if num_tokens <= max_tokens - buffer:
        return 0.0
    return max(-1.0, (max_tokens - buffer - num_tokens) / buffer)


# ---------------------------------------------------------------- the --reward_weights and --reward_tolerance flags


def parse_weights(text: str, defaults: dict = DEFAULT_WEIGHTS) -> dict:
    """'correct=1,format=0.1' -> defaults (DEFAULT_WEIGHTS; with --reward_fn plug-ins theirs too) updated with those
    values (the --reward_weights flag)."""
    weights = dict(defaults)
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = item.partition("=")
        name = name.strip()
        if not eq or name not in defaults:
            raise ValueError(f"bad reward weight {item!r} in --reward_weights: expected name=value with name in "
                             f"{sorted(defaults)}")
        try:
            weights[name] = float(value)
        except ValueError:
            bad = f"bad reward weight {item!r} in --reward_weights: {value.strip()!r} is not a number"
            raise ValueError(bad) from None
        if not math.isfinite(weights[name]):  # nan would make every reward nan, inf every advantage nan
            raise ValueError(f"bad reward weight {item!r} in --reward_weights: the weight must be a finite number")
    return weights


def check_tolerance(tolerance: float) -> None:
    """Exit with one error line unless --reward_tolerance is a relative error in [0, 1)."""
    if not 0 <= tolerance < 1:  # also catches nan
        raise SystemExit(f"error: --reward_tolerance {tolerance}: expected a relative error in [0, 1) (0 = exact)")
