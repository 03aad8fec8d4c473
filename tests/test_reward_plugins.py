"""--reward_fn file.py:fn / module:fn (reward_plugins.py): the user's own reward components, weighted by
--reward_weights, logged like the built-ins; a plug-in that fails is one error line naming it."""

import json
import math
import re
from pathlib import Path

import pytest

import common
import grpo
import reward_plugins
import rewards

PLUGIN = '''
def chars(completion, answer, **row):
    assert {"question", "solution", "numeric"} <= set(row) and "answer" not in row  # the row's other keys
    return len(completion) / 10


def gold_length(completion, answer, **row):
    return len(answer)


def boom(completion, answer, **row):
    raise ValueError("no " + "good")


def nan(completion, answer, **row):
    return float("nan")


def text(completion, answer, **row):
    return "1.0"
'''
TINY = ["--steps", "1", "--prompts_per_step", "2", "--group_size", "4", "--gen_batch", "2", "--max_new_tokens", "12",
        "--eval_every", "0", "--split", "train[:16]", "--log_samples", "8"]  # fmt: skip


@pytest.fixture
def plugin_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(PLUGIN)
    return path


def test_a_plugin_is_a_weighted_component(plugin_file, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))  # the same file as a module
    plugins = reward_plugins.load([f"{plugin_file}:chars", "my_rewards:gold_length"])
    assert [p.name for p in plugins] == ["chars", "gold_length"] and [p.weight for p in plugins] == [1.0, 1.0]
    builtin = reward_plugins.parse_weights("format=0,chars=0.5", plugins)
    assert builtin == {**rewards.DEFAULT_WEIGHTS, "format": 0.0} and plugins[0].weight == 0.5
    row = {"question": "What is 10+1?", "answer": "11", "solution": "10+1=11", "numeric": True}
    response = "<think>10+1=11</think> <answer>11</answer>"
    s = reward_plugins.add_scores(plugins, rewards.reward(response, "11", builtin), response, row)
    assert (s["correct"], s["format"], s["chars"], s["gold_length"]) == (1.0, 1.0, 4.2, 2.0)  # 42 characters
    assert s["reward"] == 1.0 + 0.0 + 0.5 * 4.2 + 1.0 * 2
    assert reward_plugins.parse_weights("", plugins) is None  # the defaults, as without plug-ins


@pytest.mark.parametrize("spec, msg", [
    ("{f}", "expected path/to/file.py:function or module:function"),
    ("{f}:missing", "has no function 'missing'"),
    ("{d}/nope.py:chars", "nope.py: no such file"),
    ("no_such_module_xyz:fn", "importing no_such_module_xyz failed (ModuleNotFoundError"),
    ("{bad}:f", "importing {bad} failed (SyntaxError"),
])  # fmt: skip
def test_a_plugin_that_cannot_load_is_one_error_line(plugin_file, tmp_path, tiny_dir, spec, msg):
    bad = tmp_path / "broken.py"
    bad.write_text("def f(:\n")
    spec, msg = (x.format(f=plugin_file, d=tmp_path, bad=bad) for x in (spec, msg))
    with pytest.raises(SystemExit) as e:
        grpo.main(["--init", str(tiny_dir), "--reward_fn", spec, "--dry_run", "--out_dir", str(tmp_path / "r")])
    assert str(e.value).startswith(f"error: --reward_fn: {spec!r}: ") and msg in str(e.value)
    assert "\n" not in str(e.value)


def test_a_plugin_named_like_a_component_is_refused(tmp_path):
    (tmp_path / "p.py").write_text("def correct(c, a, **row):\n    return 1.0\n")
    with pytest.raises(ValueError, match="a reward component named 'correct' exists already"):
        reward_plugins.load([f"{tmp_path / 'p.py'}:correct"])


def test_reward_fn_repeats_and_the_command_line_replaces_the_file(tmp_path):
    cfg = common.parse_config(grpo.GRPOConfig, ["--reward_fn", "a.py:f", "--reward_fn", "m:g,m:h"])
    assert cfg.reward_fn == ("a.py:f", "m:g", "m:h")
    f = tmp_path / "r.yaml"
    f.write_text("reward_fn: [x.py:one, x.py:two]\n")
    assert common.parse_config(grpo.GRPOConfig, ["--config", str(f)]).reward_fn == ("x.py:one", "x.py:two")
    assert common.parse_config(grpo.GRPOConfig, ["--config", str(f), "--reward_fn", "y:z"]).reward_fn == ("y:z",)


def read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_plugin_from_a_file_changes_the_logged_reward(plugin_file, tiny_dir, tmp_path):
    grpo.main(["--init", str(tiny_dir), *TINY, "--out_dir", str(tmp_path / "plain")])
    grpo.main(["--init", str(tiny_dir), *TINY, "--out_dir", str(tmp_path / "plug"), "--reward_fn",
               f"{plugin_file}:chars", "--reward_weights", "chars=0.5"])
    (plain,), (plug,) = read(tmp_path / "plain" / "metrics.jsonl"), read(tmp_path / "plug" / "metrics.jsonl")
    samples = read(tmp_path / "plug" / "samples.jsonl")
    assert len(samples) == 8
    for s in samples:  # each completion's component and reward, recomputed by hand
        assert s["chars"] == len("<think>" + s["completion"]) / 10
        assert math.isclose(s["reward"], s["correct"] + 0.1 * s["format"] + 0.5 * s["chars"], abs_tol=1e-9)
    # the same rollouts (same seed and start), the reward raised by the plug-in's weighted mean, logged as a metric
    assert "chars" not in plain and plug["chars"] >= 0.7  # at least "<think>"
    assert plug["chars"] == pytest.approx(sum(s["chars"] for s in samples) / len(samples))
    assert plug["reward"] == pytest.approx(plain["reward"] + 0.5 * plug["chars"], abs=1e-6)
    assert plug["correct"] == plain["correct"] and plug["format"] == plain["format"]


@pytest.mark.parametrize("fn, msg", [
    ("boom", "raised ValueError: no good (on a completion to 'What is"),
    ("nan", "returned nan, not a finite number"),
    ("text", "returned '1.0', not a finite number"),
])  # fmt: skip
def test_a_failing_plugin_is_one_error_line_naming_it(plugin_file, tiny_dir, tmp_path, fn, msg):
    with pytest.raises(SystemExit) as e:
        grpo.main(["--init", str(tiny_dir), *TINY, "--out_dir", str(tmp_path / fn), "--reward_fn",
                   f"{plugin_file}:{fn}"])
    assert str(e.value).startswith(f"error: --reward_fn {plugin_file}:{fn} {msg}") and "\n" not in str(e.value)


def test_the_readmes_plugin_example(tmp_path):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    code = re.search(r"\*\*A reward\*\*.*?```python\n(.*?)```", readme, re.S).group(1)
    (tmp_path / "my_rewards.py").write_text(code)
    (brevity,) = reward_plugins.load([f"{tmp_path / 'my_rewards.py'}:brevity"])
    row = {"question": "q", "answer": "4", "solution": None, "numeric": True}
    short, long = (f"<think>{'x' * n}</think> <answer>4</answer>" for n in (100, 500))
    assert reward_plugins.add_scores([brevity], {"reward": 0.0}, short, row)["brevity"] == 0.75
    assert reward_plugins.add_scores([brevity], {"reward": 0.0}, long, row)["brevity"] == 0.0
    assert reward_plugins.add_scores([brevity], {"reward": 0.0}, "4", row)["brevity"] == 0.0  # not well-formed
