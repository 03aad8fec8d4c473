"""common.py: config flags, LR schedule, generators, JSONL logging, single-process reductions, checkpoints."""

import json
import math
from dataclasses import dataclass, field

import pytest
import torch

import common
import model as model_lib


@dataclass
class Cfg:
    """A test config."""
    lr: float = field(default=1e-3, metadata={"help": "learning rate"})
    steps: int = field(default=10, metadata={"help": "number of steps"})
    name: str = field(default="a", metadata={"help": "a name", "choices": ["a", "b"]})
    flag: bool = field(default=False, metadata={"help": "a switch"})
    on: bool = field(default=True, metadata={"help": "on by default"})
    init: str | None = field(default=None, metadata={"help": "optional path"})
    ks: tuple[int, ...] = field(default=(1, 8), metadata={"help": "k values"})


def test_parse_config_defaults_and_types():
    assert common.parse_config(Cfg, []) == Cfg()
    c = common.parse_config(Cfg, ["--lr", "3e-4", "--steps=5", "--name", "b", "--flag", "--on", "false",
                                  "--init", "x/y", "--ks", "1,4,16"])
    assert c == Cfg(lr=3e-4, steps=5, name="b", flag=True, on=False, init="x/y", ks=(1, 4, 16))
    assert common.parse_config(Cfg, ["--init", "none", "--flag=true"]) == Cfg(flag=True)


def test_parse_config_help_and_errors(capsys):
    with pytest.raises(SystemExit) as e:
        common.parse_config(Cfg, ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--lr" in out and "learning rate" in out and "A test config." in out
    for bad in (["--name", "c"], ["--steps", "x"], ["--flag", "maybe"], ["--nope", "1"]):
        with pytest.raises(SystemExit) as e:
            common.parse_config(Cfg, bad)
        assert e.value.code == 2


def test_lr_schedule():
    lr = [common.lr_at(s, 10, 110, 1.0, 0.1) for s in range(120)]
    assert lr[0] == pytest.approx(0.1) and lr[9] == pytest.approx(1.0)
    assert lr[60] == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the cosine
    assert lr[110] == pytest.approx(0.1) and lr[119] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lr[9:], lr[10:]))


def test_generators_and_single_process_reductions(tmp_path):
    a = torch.rand(4, generator=common.make_generator(1, 2, 3))
    assert torch.equal(a, torch.rand(4, generator=common.make_generator(1, 2, 3)))
    assert not torch.equal(a, torch.rand(4, generator=common.make_generator(1, 3, 2)))
    assert common.all_reduce_sum(2.5) == 2.5 and common.all_reduce_sum([1, 2], op="max") == [1, 2]
    assert common.all_reduce_mean([4.0]) == [4.0]
    assert common.all_gather_list([1, 2]) == [1, 2]
    d = common.init_dist()
    assert (d.rank, d.world_size, d.is_main) == (0, 1, True)
    assert common.wrap_model(torch.nn.Linear(2, 2), "fsdp", d).__class__ is torch.nn.Linear  # nothing to shard


def test_jsonl_logger(tmp_path):
    log = common.JsonlLogger(tmp_path / "m.jsonl")
    log.write({"step": 1, "loss": torch.tensor(0.5)})
    log.write({"step": 2, "loss": 0.25})
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert rows == [{"step": 1, "loss": 0.5}, {"step": 2, "loss": 0.25}]
    common.JsonlLogger(tmp_path / "off.jsonl", enabled=False).write({"a": 1})
    assert not (tmp_path / "off.jsonl").exists()


def _tiny():
    tok = model_lib.char_tokenizer()
    cfg = model_lib.preset_config("tiny", len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model_lib.Transformer(cfg), tok


def test_checkpoint_roundtrip(tmp_path):
    torch.manual_seed(0)
    model, tok = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = common.Dist()
    for step in (1, 2, 3):
        model(torch.randint(0, 50, (2, 5))).sum().backward()
        opt.step()
        opt.zero_grad()
        torch.manual_seed(100 + step)  # the global RNG state the checkpoint must restore
        common.save_checkpoint(tmp_path, step, model, tok, {"data_position": 8 * step}, d, optimizer=opt,
                               rank_state={"gen": common.make_generator(7, step).get_state()}, keep=2)
    after_save = torch.rand(3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000003"]
    assert common.find_latest(tmp_path) == tmp_path / "step_000003"
    assert common.resolve_model_dir(tmp_path) == tmp_path / "step_000003"
    # an interrupted later save (no train_state.pt yet) and a stale tmp dir are ignored
    (tmp_path / "step_000009").mkdir()
    (tmp_path / ".tmp_step_000010").mkdir()
    (tmp_path / "latest").unlink()
    assert common.find_latest(tmp_path) == tmp_path / "step_000003"

    fresh, _ = _tiny()
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    torch.manual_seed(999)
    state, rank_state = common.load_checkpoint(tmp_path / "step_000003", fresh, d, optimizer=opt2)
    assert state["step"] == 3 and state["data_position"] == 24
    assert torch.equal(torch.rand(3), after_save)  # the global torch RNG continues where the save left it
    assert torch.equal(rank_state["gen"], common.make_generator(7, 3).get_state())
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert all(torch.equal(s1[i]["exp_avg"], s2[i]["exp_avg"]) for i in s1)
    # the checkpoint is a self-contained HF model dir; publish_model copies the model files only
    common.publish_model(tmp_path / "step_000003", tmp_path / "model")
    assert {p.name for p in (tmp_path / "model").iterdir()} >= {"config.json", "model.safetensors"}
    assert not list((tmp_path / "model").glob("*.pt"))
    x = torch.randint(0, 50, (1, 6))
    assert torch.allclose(model_lib.load_model(tmp_path / "model")(x), model(x))
    assert math.isfinite(state["optimizer"]["param_groups"][0]["lr"])
