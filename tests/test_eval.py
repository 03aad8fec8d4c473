"""eval.py: pass@k and maj@k against hand-computed cases, and 2 ranks give exactly the results of 1."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import eval as evaluation
import model as model_lib
from hf import char_tokenizer, save_model

ROOT = Path(__file__).resolve().parents[1]


def test_pass_at_k_hand_computed():
    # n = 5 samples, c = 2 correct. pass@k = 1 - C(3, k) / C(5, k):
    # k=1: 1 - 3/5 = 0.4;  k=2: 1 - 3/10 = 0.7;  k=3: 1 - 1/10 = 0.9;  k=4: 3 wrong ones cannot fill 4 draws -> 1
    assert evaluation.pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert evaluation.pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert evaluation.pass_at_k(5, 2, 3) == pytest.approx(0.9)
    assert evaluation.pass_at_k(5, 2, 4) == 1.0
    assert evaluation.pass_at_k(8, 0, 8) == 0.0 and evaluation.pass_at_k(1, 1, 1) == 1.0
    # against brute force over all k-subsets of a concrete sample list
    from itertools import combinations

    samples = [1, 0, 0, 1, 0, 0, 0]
    for k in range(1, 8):
        subsets = list(combinations(samples, k))
        assert evaluation.pass_at_k(7, 2, k) == pytest.approx(sum(map(any, subsets)) / len(subsets))


def test_majority_vote():
    assert evaluation.majority_vote(["5", None, "7", "7", "5", "7"]) == "7"
    assert evaluation.majority_vote(["5", "7", "7", "5"]) == "5"  # a 2-2 tie: the answer seen first wins
    assert evaluation.majority_vote([None, "7", "5", "5", "7"]) == "7"  # no-answer samples don't vote
    assert evaluation.majority_vote([None, None]) is None


def _rec(answer, gold, correct, fmt=1.0, n=10, trunc=False):
    return {"answer": answer, "gold": gold, "correct": float(correct), "format": fmt, "reward": correct + 0.1 * fmt,
            "num_tokens": n, "truncated": trunc}


def test_summary_on_a_constructed_case():
    # problem 0 (gold 7): answers 7 5 5 7 -> pass@1 0.5; maj@4 is a 2-2 tie -> "7" (first) -> right;
    #   maj@2 on "7","5" -> tie -> "7" -> right
    # problem 1 (gold 3): answers None 4 4 3 -> pass@1 0.25, pass@2 = 1 - C(3,2)/C(4,2) = 0.5; maj@4 "4" -> wrong;
    #   maj@2 on None,"4" -> "4" -> wrong
    recs = [_rec("7", "7", 1), _rec("5", "7", 0), _rec("5", "7", 0), _rec("7", "7", 1),
            _rec(None, "3", 0, fmt=0.0, n=30, trunc=True), _rec("4", "3", 0), _rec("4", "3", 0), _rec("3", "3", 1)]
    s = evaluation.summarize(recs, 4, pass_k=(1, 2, 4, 8))
    assert s["n_problems"] == 2 and s["samples"] == 4
    assert s["pass@1"] == pytest.approx((0.5 + 0.25) / 2)
    assert s["pass@2"] == pytest.approx(((1 - 1 / 6) + 0.5) / 2)  # problem 0: 1 - C(2,2)/C(4,2)
    assert s["pass@4"] == 1.0 and "pass@8" not in s  # k > n is not estimable
    assert s["maj@2"] == 0.5 and s["maj@4"] == 0.5 and "maj@1" not in s
    assert s["format"] == 7 / 8 and s["truncated"] == 1 / 8 and s["len_mean"] == (7 * 10 + 30) / 8
    assert math.isclose(s["correct"], 3 / 8)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny_model")
    torch.manual_seed(0)
    tok = char_tokenizer()
    cfg = model_lib.preset_config("tiny", len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
    model = model_lib.Transformer(cfg)
    with torch.no_grad():  # make EOS likely so completions have varied lengths (some stop, some are truncated)
        model.lm_head.weight[tok.eos_token_id] += 0.15 * torch.randn(32)
    save_model(model, d, tok)
    return d


def test_two_ranks_match_one(tiny_model_dir, tmp_path):
    # 10 problems in batches of 4 -> 3 batches: with 2 ranks, rank 1 runs a dummy batch in the second round
    args = ["--model", str(tiny_model_dir), "--split", "test[:10]", "--batch_size", "4", "--samples", "3",
            "--temperature", "1.0", "--pass_k", "1,2", "--max_new_tokens", "12"]
    evaluation.main([*args, "--out_dir", str(tmp_path / "one")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                        str(ROOT / "eval.py"), *args, "--out_dir", str(tmp_path / "two")],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "pass@2" in p.stdout and "greedy" in p.stdout and "sampled" in p.stdout  # the table
    one, two = (json.loads((tmp_path / r / "summary.json").read_text()) for r in ("one", "two"))
    for mode in ("greedy", "sampled"):
        for s in (one[mode], two[mode]):
            s.pop("time_s")
        assert one[mode] == two[mode], mode
    assert one["sampled"]["n_problems"] == 10 and one["sampled"]["samples"] == 3
    lines = [(tmp_path / r / "completions.jsonl").read_text().splitlines() for r in ("one", "two")]
    assert len(lines[0]) == 10 + 30 and lines[0] == lines[1]
    recs = [json.loads(line) for line in lines[0]]
    assert {"mode", "problem", "sample", "response", "answer", "reward", "correct", "format", "num_tokens",
            "truncated"} <= set(recs[0])
    assert 0 < sum(r["truncated"] for r in recs) < len(recs)  # the case is not degenerate: some rows stopped


def test_help_and_bad_model_dir(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        evaluation.main(["--help"])
    assert e.value.code == 0 and "--pass_k" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a model directory"):
        evaluation.main(["--model", str(tmp_path), "--out_dir", str(tmp_path / "o")])


def _copying(tok, rows, samples, pad_id):
    """A stand-in for sampler.generate: every completion copies its question's expression as the answer
    ("What is 82-18+20?" -> <answer>82-18+20</answer>), the policy #45 item 6 found scoring full marks."""
    from sampler import Generation
    texts = [f"x</think> <answer>{r['question'][len('What is '):-1]}</answer>" for r in rows for _ in range(samples)]
    ids = [tok.encode(t) + [tok.eos_token_id] for t in texts]
    T = max(map(len, ids))
    tokens = torch.tensor([i + [pad_id] * (T - len(i)) for i in ids])
    mask = torch.tensor([[j < len(i) for j in range(T)] for i in ids])
    return Generation(tokens=tokens, mask=mask, logprobs=torch.zeros(tokens.shape), truncated=~mask[:, -1] & False)


def test_a_policy_copying_the_question_scores_nothing(tiny_model_dir, monkeypatch):
    # eval.py and grpo.py score arith answers in its answer form (numbers), greedy and maj@k alike
    import grpo
    from data import load_task
    from hf import load_model, load_tokenizer
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    rows = load_task("arith", "test[:6]")
    monkeypatch.setattr(evaluation, "generate", lambda m, ids, n, num_samples=1, **k: _copying(
        tok, rows[: len(ids)], num_samples, tok.pad_token_id))
    summary, records = evaluation.evaluate(model, tok, rows, template="r1", max_new_tokens=40, samples=2,
                                           temperature=1.0, pass_k=(1, 2))
    assert [r["format"] for r in records] == [1.0] * 12  # well-formed, so only the answer form decides
    assert summary["pass@1"] == summary["maj@2"] == summary["correct"] == 0.0
    roll = _copying(tok, rows, 2, tok.pad_token_id)
    roll = grpo.Rollout(roll.tokens, roll.mask, roll.logprobs, roll.truncated, roll.mask.sum(1))
    cfg = grpo.GRPOConfig(group_size=2, max_new_tokens=40)
    r, scores, _ = grpo.score(tok, roll, ["<think>"] * 6, rows, cfg, None)
    assert r.shape == (6, 2) and [s["format"] for s in scores] == [1.0] * 12
    assert sum(s["correct"] for s in scores) == 0.0
