"""common.py: config flags, LR schedule, generators, JSONL logging, single-process reductions."""

import json
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
import torch

import common
import packing


@dataclass
class Cfg:
    """A test config."""
    lr: float = common.flag(1e-3, "learning rate", section="optimisation")
    steps: int = common.flag(10, "number of steps", section="optimisation")
    name: str = common.flag("a", "a name", choices=["a", "b"], section="naming and switches")
    flag: bool = common.flag(False, "a switch", section="naming and switches")
    on: bool = field(default=True, metadata={"help": "on by default", "section": "naming and switches"})
    init: str | None = common.flag(None, "optional path", section="naming and switches")
    ks: tuple[int, ...] = common.flag((1, 8), "k values", section="naming and switches")


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


def _help_sections(text: str) -> dict[str, list[str]]:
    """--help text -> {section title: [flags in it]} (argparse prints each group as 'title:' then its flags)."""
    sections, title = {}, None
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            title = line[:-1]
            sections[title] = []
        elif title and line.startswith("  -"):
            sections[title].append(line.split()[0].rstrip(","))
    return sections


def test_help_is_grouped_by_each_flags_section(capsys):
    with pytest.raises(SystemExit):
        common.parse_config(Cfg, ["--help"])
    got = _help_sections(capsys.readouterr().out)
    assert got["optimisation"] == ["--lr", "--steps"]
    assert got["naming and switches"] == ["--name", "--flag", "--on", "--init", "--ks"]


@pytest.mark.parametrize("script", ["sft", "grpo", "eval"])
def test_every_script_flag_is_in_a_section(script, capsys):
    mod = __import__(script)
    with pytest.raises(SystemExit):
        mod.main(["--help"])
    text = capsys.readouterr().out
    got = _help_sections(text)
    cfg_cls = next(v for k, v in vars(mod).items() if k.endswith("Config") and v.__module__ == script)
    grouped = [flag for title, flags in got.items() if title != "options" for flag in flags]
    assert sorted(grouped) == sorted(f"--{f.name}" for f in fields(cfg_cls))
    assert len(got) >= 4 and got["options"] == ["-h", "--config"]  # alone outside the sections
    assert "Config(" not in text  # the description is the docstring, not dataclass's generated signature


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
    assert common.all_reduce_named({"a": 2.5, "b": 1}, {"b": "max"}) == {"a": 2.5, "b": 1}
    assert common.any_rank(True) and not common.any_rank(False)
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


def test_jsonl_logger_mirrors_to_wandb(tmp_path, fake_wandb):
    fake = fake_wandb
    log = common.JsonlLogger(tmp_path / "run" / "m.jsonl", wandb_project="proj", config={"lr": 0.1})
    log.write({"step": 1, "loss": torch.tensor(0.5), "note": "text", "ok": True, "n": 3})
    log.close()
    assert fake.logged == [(1, {"loss": 0.5, "n": 3})]  # numbers only, keyed by the step
    assert fake.inits[0]["project"] == "proj" and fake.inits[0]["name"] == "run"
    assert fake.inits[0]["config"] == {"lr": 0.1} and fake.finished == 1
    # resumed from a checkpoint at the last logged step: the same W&B run goes on
    log = common.JsonlLogger(tmp_path / "run" / "m.jsonl", wandb_project="proj", start_step=1)
    log.write({"step": 2, "loss": 0.4})
    log.write({"step": 3, "loss": 0.3})
    log.close()
    assert fake.inits[1]["id"] == fake.inits[0]["id"] and fake.inits[1]["resume"] == "allow"
    # a restart from the step-2 checkpoint after step 3 was logged: a new W&B run, so no step is dropped
    log = common.JsonlLogger(tmp_path / "run" / "m.jsonl", wandb_project="proj", start_step=2)
    log.write({"step": 3, "loss": 0.35})
    log.close()
    assert fake.inits[2]["id"] != fake.inits[0]["id"] and fake.dropped == []
    assert [step for step, _ in fake.logged] == [1, 2, 3, 3]
    # a logger that is not the main rank's opens nothing
    common.JsonlLogger(tmp_path / "run2" / "m.jsonl", enabled=False, wandb_project="proj").write({"step": 1, "a": 1})
    assert len(fake.inits) == 3 and not (tmp_path / "run2").exists()


def test_stays_stopped():
    assert not common.stays_stopped({"step": 5}, 0)
    assert common.stays_stopped({"step": 5, "stopped": "--stop_pass1"}, 10)
    assert common.stays_stopped({"step": 5, "stopped": True}, 0)  # checkpoints written before the reason was kept
    for clock in ("train_s", "t_train"):  # t_train: the clock's key in checkpoints written before the rename
        timed = {"step": 5, "stopped": "time", clock: 120.0}
        assert common.stays_stopped(timed, 2) and common.stays_stopped(timed, 1)
        assert not common.stays_stopped(timed, 3) and not common.stays_stopped(timed, 0)  # more time, or no limit


def test_missing_logger_package_is_one_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(common.importlib.util, "find_spec", lambda name: None)
    for kw, pkg in (({"wandb_project": "p"}, "wandb"), ({"tensorboard_dir": tmp_path / "tb"}, "tensorboard")):
        for enabled in (True, False):  # every rank fails alike, not only the one that logs
            with pytest.raises(SystemExit, match=f"--{pkg} needs the {pkg} package: pip install {pkg}"):
                common.JsonlLogger(tmp_path / "m.jsonl", enabled=enabled, **kw)


def test_jsonl_logger_writes_tensorboard_events(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = common.JsonlLogger(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb")
    for step in (1, 2, 3):
        log.write({"step": step, "reward": 0.25 * step, "text": "x"})
    log.close()
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    assert ea.Tags()["scalars"] == ["reward"]
    assert [(e.step, e.value) for e in ea.Scalars("reward")] == [(1, 0.25), (2, 0.5), (3, 0.75)]
    # resumed from the step-1 checkpoint: steps 2-3 are written again and replace the old ones
    log = common.JsonlLogger(tmp_path / "m.jsonl", tensorboard_dir=tmp_path / "tb", start_step=1)
    for step in (2, 3):
        log.write({"step": step, "reward": 1.0})
    log.close()
    ea = EventAccumulator(str(tmp_path / "tb"))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("reward")] == [(1, 0.25), (2, 1.0), (3, 1.0)]


def test_grad_clip_zero_is_off():
    """--grad_clip 0 means no clipping in both scripts (grpo's once zeroed every gradient instead)."""
    lin = torch.nn.Linear(3, 2)
    for p in lin.parameters():
        p.grad = torch.full_like(p, 10.0)
    norm = common.clip_grad_norm(lin, 0.0)
    assert abs(norm.item() - 10.0 * 8 ** 0.5) < 1e-4  # 8 values of 10: measured, not clipped
    assert all((p.grad == 10.0).all() for p in lin.parameters())
    common.clip_grad_norm(lin, 1.0)
    assert abs(torch.cat([p.grad.flatten() for p in lin.parameters()]).norm().item() - 1.0) < 1e-4


@pytest.mark.parametrize("lengths", [[5, 3, 8, 2, 2, 7, 1], [8] * 4, [1] * 9, [6]])
def test_pack_rows_places_every_sequence_once_within_the_width(lengths):
    rows = packing.pack_rows(lengths, 8)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in r) <= 8 for r in rows)
    # first-fit decreasing is within 11/9 OPT + 1 rows; OPT >= the tokens over the width
    assert len(rows) <= 11 / 9 * -(-sum(lengths) // 8) + 1


def _raise_from(filename: str, func: str, msg: str):
    """Raise RuntimeError(msg) from a frame that says it is `func` in `filename` (as a traceback shows it)."""
    scope = {}
    exec(compile(f"def {func}(m):\n    raise RuntimeError(m)\n", filename, "exec"), scope)  # our own source text
    try:
        scope[func](msg)
    except RuntimeError as e:
        return e


GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] "
                "Timed out waiting 4000ms for send operation to complete")  # as CI's log had it


@pytest.mark.parametrize("where, func, msg, named", [
    ("nn/parallel/distributed.py", "_pre_forward", GLOO_TIMEOUT, "in distributed.py:_pre_forward (at"),  # DDP
    ("distributed/distributed_c10d.py", "all_reduce", GLOO_TIMEOUT, "[rank1]: all_reduce (at"),
    ("_tensor.py", "backward", GLOO_TIMEOUT, "reduce-scatter of backward() (at"),
    (None, "step", GLOO_TIMEOUT, "[rank1]: a collective (at"),  # raised from C++ straight into our code
    ("nn/parallel/distributed.py", "_pre_forward", "shape mismatch", None),  # not a timeout
    (None, "acquire", "lock timed out after 5 s", None),  # a timeout that is not torch.distributed's
])  # fmt: skip
def test_collective_timeout_hint(where, func, msg, named, monkeypatch, capsys):
    """init_dist's excepthook adds its hint to every gloo timeout, wherever in torch it was raised (CI once saw one in
    DDP's forward), and to nothing else."""
    monkeypatch.setattr(sys, "excepthook", lambda *a: print("TRACEBACK", file=sys.stderr))
    common._explain_collective_timeouts(1, 4)
    filename = str(Path(torch.__file__).parent / where) if where else __file__
    err = _raise_from(filename, func, msg)
    sys.excepthook(type(err), err, err.__traceback__)
    printed = capsys.readouterr().err
    assert printed.startswith("TRACEBACK")  # torch's own hook still runs first
    hint = "did not complete within --dist_timeout=4s"
    if named is None:
        assert hint not in printed
    else:
        assert named in printed, printed
        assert hint in printed and "test_common.py" in printed  # and where in our code
