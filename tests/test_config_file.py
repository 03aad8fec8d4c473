"""--config FILE.yaml|.json (common.parse_config): the same fields as the flags, flags override the file, the same
errors as flags, and a run's own config.json is a valid --config ("run it again with one change")."""

import dataclasses
import json

import pytest

import common
import grpo
import sft
from grpo import GRPOConfig

TINY_GRPO = ["--steps", "1", "--prompts_per_step", "2", "--group_size", "2", "--gen_batch", "2",
             "--max_new_tokens", "8", "--eval_every", "0", "--split", "train[:8]"]  # fmt: skip


def test_file_sets_fields_and_flags_override_it(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("lr: 1e-6\ntemplate: chat\nlora_targets: [q_proj, v_proj]\ndata_path: null\n"
                 "filter_zero_std: false\nsteps: 7\n")
    cfg = common.parse_config(GRPOConfig, ["--config", str(f), "--template", "r1", "--steps=9"])
    # the file's values, unless a flag gives one; everything else the dataclass default
    want = dataclasses.replace(GRPOConfig(), lr=1e-6, template="r1", lora_targets=("q_proj", "v_proj"),
                               filter_zero_std=False, steps=9)
    assert cfg == want
    # the flag may come before --config: the command line still wins
    assert common.parse_config(GRPOConfig, ["--steps", "9", "--config", str(f)]).steps == 9
    j = tmp_path / "run.json"
    j.write_text(json.dumps({"lr": 1e-6, "lora_targets": ["q_proj", "v_proj"], "dist": "fsdp"}))
    cfg = common.parse_config(GRPOConfig, ["--config", str(j)])
    assert (cfg.lr, cfg.lora_targets, cfg.dist) == (1e-6, ("q_proj", "v_proj"), "fsdp")


@pytest.mark.parametrize("text, named", [
    ("lrr: 1\n", "unknown key 'lrr': not a flag of"),
    ("template: chat2\n", "key 'template': invalid choice 'chat2'"),
    ("steps: 1.5\n", "key 'steps': invalid value 1.5"),
    ("filter_zero_std: maybe\n", "key 'filter_zero_std': invalid value 'maybe'"),
    ("- lr\n", "expected a mapping of flag names to values, got list"),
    ("steps: [1\n", "ParserError"),
])  # fmt: skip
def test_bad_file_is_one_error_line_naming_file_and_key(tmp_path, capsys, text, named):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(SystemExit) as e:
        common.parse_config(GRPOConfig, ["--config", str(f)])
    assert e.value.code == 2  # as a bad flag
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f": error: --config {f}: " in last and named in last
    with pytest.raises(SystemExit):
        common.parse_config(GRPOConfig, ["--config", str(tmp_path / "missing.yaml")])
    assert "missing.yaml: FileNotFoundError" in capsys.readouterr().err


def test_unknown_key_suggests_the_flag(tmp_path, capsys):
    f = tmp_path / "typo.json"
    f.write_text('{"group_sise": 4}')
    with pytest.raises(SystemExit):
        common.parse_config(GRPOConfig, ["--config", str(f)])
    assert "did you mean 'group_size'?" in capsys.readouterr().err


def test_grpo_config_json_round_trip_and_one_change(tiny_dir, tmp_path):
    argv = ["--init", str(tiny_dir), *TINY_GRPO, "--lr", "3e-3", "--template", "short", "--lora_rank", "0"]
    grpo.main([*argv, "--out_dir", str(tmp_path / "a")])
    saved = tmp_path / "a" / "config.json"
    record = json.loads(saved.read_text())
    assert "init_sha256" in record  # a key the run adds, not a flag: skipped
    first = common.parse_config(GRPOConfig, [*argv, "--out_dir", str(tmp_path / "a")])
    assert common.parse_config(GRPOConfig, ["--config", str(saved)]) == first
    # run it again with one change: one command
    grpo.main(["--config", str(saved), "--out_dir", str(tmp_path / "b"), "--seed", "5"])
    again = json.loads((tmp_path / "b" / "config.json").read_text())
    changed = {k for k in record if record[k] != again[k]}
    assert changed == {"out_dir", "seed"} and again["seed"] == 5
    assert (tmp_path / "b" / "model" / "config.json").is_file()


def test_sft_config_json_round_trip(tmp_path):
    argv = ["--steps", "1", "--global_batch", "2", "--micro_batch", "2", "--eval_every", "0", "--stop_pass1", "0",
            "--split", "train[:8]", "--out_dir", str(tmp_path / "s")]
    sft.main(argv)
    saved = tmp_path / "s" / "config.json"
    assert common.parse_config(sft.SFTConfig, ["--config", str(saved)]) == common.parse_config(sft.SFTConfig, argv)
