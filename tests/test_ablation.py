"""scripts/ablation.py's bookkeeping on hand-made metrics: pass@1 at marks (newest eval at or before each), means
over steps, mean +- sample std over seeds, the table and its "larger than the seed spread" verdict."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("ablation", ROOT / "scripts" / "ablation.py")
ablation = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ablation)


def _metrics(evals: dict, n=6, zero=0.5, clip=0.1):
    """n steps, 30 s of training each; evals {step: pass@1}."""
    rows = []
    for s in range(1, n + 1):
        m = {"step": s, "train_s": 30.0 * s, "frac_zero_std": zero, "clip_low": clip, "clip_high": 2 * clip}
        if s in evals:
            m["eval_pass1"] = evals[s]
        rows.append(m)
    return rows


def test_marks_read_the_newest_eval_at_or_before():
    rows = _metrics({2: 0.1, 4: 0.3, 6: 0.5})
    by_step = ablation.summarize(rows, [1, 2, 5, 6], by_minutes=False)
    assert by_step["pass1"] == [None, 0.1, 0.3, 0.5]
    by_min = ablation.summarize(rows, [0.5, 1.0, 2.5, 3.0], by_minutes=True)  # step 2 = 1.0 min
    assert by_min["pass1"] == [None, 0.1, 0.3, 0.5]
    assert by_step["zero_std"] == 0.5 and by_step["clip_high"] == pytest.approx(0.2) and by_step["steps"] == 6


def test_spread_and_table(tmp_path):
    assert ablation.spread([0.2, 0.4]) == "0.300 ± 0.141"  # sample std: sqrt(0.02)
    assert ablation.spread([0.2]) == "0.200" and ablation.spread([0.2, None]) == "-"
    finals = {("grpo", 0): 0.20, ("grpo", 1): 0.22, ("cispo", 0): 0.40, ("cispo", 1): 0.42,
              ("dapo", 0): 0.10, ("dapo", 1): 0.40}  # fmt: skip
    for (v, s), p in finals.items():
        run = tmp_path / f"{v}_s{s}"
        run.mkdir()
        rows = _metrics({6: p})
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = ablation.AblationConfig(out=str(tmp_path))
    text = ablation.table(cfg, ["grpo", "cispo", "dapo"], [0, 1], [3.0], True, 0.15)
    assert "| cispo | 0.150 | 0.410 ± 0.014 |" in text
    assert "cispo - grpo: +0.200 (larger" in text  # 0.2 > 0.014 + 0.014
    assert "dapo - grpo: +0.040 (not larger" in text  # dapo's seeds spread 0.21
