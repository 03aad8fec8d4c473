"""The run directory is never clobbered (issue 17): a stage writes only into a new or empty directory or one of its
own runs, never its --init; every check runs before anything is deleted or written; `latest` stays inside the run;
an exclusive lock keeps a second run out (two real processes, one of them killed with SIGKILL). Each bad input gives
one `error:` line and leaves every directory involved byte for byte as it was (hashed before and after)."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import checkpoint
import common
import eval as evaluation
import grpo
import sft

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
GRPO = ["--split", "train[:64]", "--eval_split", "test[:4]", "--prompts_per_step", "2", "--group_size", "2",
        "--gen_batch", "2", "--max_new_tokens", "8", "--eval_every", "0", "--warmup", "1", "--steps", "1"]  # fmt: skip
SFT = ["--split", "train[:64]", "--eval_split", "test[:4]", "--global_batch", "8", "--micro_batch", "8",
       "--eval_every", "0", "--warmup", "1", "--steps", "2"]  # fmt: skip


def tree(path: Path) -> dict | None:
    """Every file's and directory's path -> sha256 of its bytes ("dir" for a directory); None if path is missing."""
    if not path.exists():
        return None
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*"))}  # fmt: skip


def fails(main, argv: list[str], *dirs: Path) -> str:
    """main(argv) must exit with one `error:` line (python prints it and exits 1) and change none of dirs."""
    before = [tree(d) for d in dirs]
    with pytest.raises(SystemExit) as e:
        main(argv)
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "\n" not in msg, msg
    assert [tree(d) for d in dirs] == before
    return msg


def fake_run(path: Path, stage="grpo", marker=True, **files) -> Path:
    """A run dir as a stage leaves it (marker, config.json, metrics.jsonl), without training anything."""
    path.mkdir(parents=True)
    if marker:
        (path / checkpoint.MARKER).write_text(json.dumps({"stage": stage}))
    flags = {"out_dir": str(path), "resume": "auto", "overwrite": False, ("group_size" if stage == "grpo" else
                                                                          "global_batch"): 4}  # fmt: skip
    (path / "config.json").write_text(json.dumps(flags))
    (path / "metrics.jsonl").write_text('{"step": 1}\n')
    for name, text in files.items():
        (path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


@pytest.fixture
def places(tiny_dir, tmp_path):
    """Directories a user might point --out_dir at by mistake, next to a copy of the --init model."""
    init = tmp_path / "init"
    shutil.copytree(tiny_dir, init)
    other = tmp_path / "other"  # not a run: checkpoints and temp dirs of something else
    for d in ("step_000001", ".tmp_step_000002", ".old_x", ".del_y"):
        (other / d).mkdir(parents=True)
        (other / d / "data.bin").write_bytes(os.urandom(64))
    (tmp_path / "a_file").write_text("notes")
    (tmp_path / "loop").symlink_to("loop")  # paths no run can be made in (#45 item 10)
    (tmp_path / "dangling").symlink_to("nowhere")
    fake_run(tmp_path / "sft_run", stage="sft")
    fake_run(tmp_path / "run")
    fake_run(tmp_path / "legacy", marker=False)  # no marker: config.json's flags alone do not make it a run
    for name, text in {"dotdot": "../other/step_000001\n", "absolute": f"{tmp_path}/other/step_000001\n",
                       "long": "step_" + "1" * 5000, "binary": b"\xff\xfe step_000001"}.items():  # fmt: skip
        fake_run(tmp_path / f"latest_{name}", latest=text)
    return tmp_path


def test_out_dir_table(places):
    t, init = places, ["--init", str(places / "init")]
    cases = [  # (main, argv, the error line's start, or a part of it)
        (grpo.main, init + ["--out_dir", str(t / "init")], f"error: --out_dir {t}/init is or holds the --init model"),
        (grpo.main, ["--init", str(t / "run"), "--out_dir", str(t / "run")], "is or holds the --init model"),
        (grpo.main, init + ["--out_dir", str(t / "other")],
         f"error: --out_dir {t}/other exists and is not a minigrpo run (no valid minigrpo_run.json): "
         "grpo.py writes only into a new or empty directory or one of its own runs; nothing was changed. Pick another "
         "--out_dir"),
        (grpo.main, init + ["--out_dir", str(t / "other"), "--overwrite"], "exists and is not a minigrpo run"),
        (grpo.main, init + ["--out_dir", str(t / "sft_run"), "--overwrite"],
         f"error: --out_dir {t}/sft_run exists and is a run of sft.py: grpo.py writes only into"),
        (grpo.main, init + ["--out_dir", str(t / "a_file")], f"error: --out_dir {t}/a_file is a file, not a directory"),
        (grpo.main, init + ["--out_dir", str(t / "loop")], f"error: --out_dir {t}/loop: Symlink loop from '{t}/loop'"),
        (grpo.main, init + ["--out_dir", str(t / "dangling")],
         f"error: --out_dir {t}/dangling is a symlink to nowhere, which does not exist: create it, or pick another"),
        (grpo.main, init + ["--out_dir", str(t / "a_file" / "sub")],
         f"error: --out_dir {t}/a_file/sub is under {t}/a_file, a file, not a directory: pick another --out_dir"),
        (evaluation.main, ["--model", str(t / "init"), "--out_dir", str(t / "a_file" / "sub")], "is under"),
        (sft.main, ["--out_dir", str(t / "loop")], "Symlink loop"),
        (grpo.main, init + ["--out_dir", str(t / "legacy"), "--resume", "none"],
         f"error: --out_dir {t}/legacy exists and is not a minigrpo run"),  # only the marker makes a run
        (grpo.main, init + ["--out_dir", str(t / "run"), "--overwrite", "--gen_batch", "0"],
         "error: --gen_batch 0: need at least 1"),
        (grpo.main, init + ["--out_dir", str(t / "run"), "--overwrite", "--task_knobs", "steps=abc"],
         "error: data: bad arith knob steps='abc'"),
        (grpo.main, ["--init", str(t / "missing"), "--out_dir", str(t / "run"), "--overwrite"],
         f"error: --init: {t}/missing: no such model directory"),
        (grpo.main, init + ["--out_dir", str(t / "run"), "--overwrite", "--reward_weights", "foo"],
         "error: --reward_weights: bad reward weight 'foo'"),
        (evaluation.main, ["--model", str(t / "init"), "--out_dir", str(t / "run")],
         f"error: --out_dir {t}/run exists and is a run of grpo.py: eval.py writes only into"),
        (evaluation.main, ["--model", str(t / "init"), "--out_dir", str(t / "init")], "exists and is not a minigrpo"),
    ]
    for name in ("dotdot", "absolute", "long", "binary"):  # `latest` must name a checkpoint of this run
        cases.append((grpo.main, init + ["--out_dir", str(t / f"latest_{name}")],
                      f"error: --out_dir: {t}/latest_{name}/latest holds b"))
    if importlib_find("wandb") is None:  # the package a flag needs is checked before --overwrite deletes anything
        cases.append((grpo.main, init + ["--out_dir", str(t / "run"), "--overwrite", "--wandb", "proj"],
                      "error: --wandb needs the wandb package: pip install wandb"))
    for main, argv, want in cases:
        msg = fails(main, GRPO + argv if main is grpo.main else argv, *(t / d for d in sorted(os.listdir(t))))
        assert msg.startswith(want) or want in msg, (argv, msg)


def importlib_find(name):
    import importlib.util

    return importlib.util.find_spec(name)


def test_overwrite_deletes_only_what_a_run_writes(tiny_dir, tmp_path):
    out = tmp_path / "run"
    grpo.main(GRPO + ["--init", str(tiny_dir), "--out_dir", str(out), "--save_every", "1"])
    (out / "notes.txt").write_text("mine")  # the user's own files in the run dir
    (out / "eval").mkdir()
    (out / "eval" / "summary.json").write_text("{}")
    (out / "step_notes").write_text("not a checkpoint name")
    grpo.main(GRPO + ["--init", str(tiny_dir), "--out_dir", str(out), "--overwrite"])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "eval", "latest", "metrics.jsonl",
                                                     "minigrpo_run.json", "model", "notes.txt", "samples.jsonl",
                                                     "step_000001", "step_notes"]  # fmt: skip


def test_resave_cut_between_renames_keeps_the_checkpoint(tiny_dir, tmp_path, capsys):
    """save_checkpoint re-saving step N renames step_N to .old_step_N, then .tmp_step_N to step_N: a crash between
    the two leaves no step_N. The restart takes the complete .old copy back instead of deleting both copies."""
    out = tmp_path / "run"
    argv = GRPO + ["--init", str(tiny_dir), "--out_dir", str(out), "--save_every", "1"]
    grpo.main(argv)
    (out / "step_000001").rename(out / ".old_step_000001")
    shutil.copytree(out / ".old_step_000001", out / ".tmp_step_000001")
    assert checkpoint.find_latest(out) == out / ".old_step_000001"
    capsys.readouterr()
    grpo.main(argv)
    assert f"resuming from {out}/step_000001 at step 1" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir() if "step" in p.name) == ["step_000001"]
    assert checkpoint.find_latest(out) == out / "step_000001"


# -----------------------------------------------------------------------------
# the lock: two real processes

HOLD = ("import sys, time, checkpoint; msg = checkpoint.lock_run_dir(sys.argv[1]); print(msg or 'locked', "
        "flush=True); time.sleep(600)")


def test_lock_two_processes_and_sigkill(tiny_dir, tmp_path):
    out = fake_run(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = tree(out)
        stage = [sys.executable, "grpo.py", *GRPO, "--init", str(tiny_dir), "--out_dir", str(out), "--overwrite"]
        p = subprocess.run(stage, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert p.stderr.strip().splitlines()[-1] == (
            f"error: --out_dir {out} is in use by another run (pid {holder.pid} on host {os.uname().nodename}; lock "
            ".lock_node0): wait for it to end, or stop it (a run that dies releases the lock), or pick another "
            "--out_dir")
        assert tree(out) == before  # the holder's run is untouched
        os.kill(holder.pid, signal.SIGKILL)  # dies holding the lock: the OS releases it
        holder.wait(timeout=30)
        p = subprocess.run(stage, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr[-2000:]
        assert json.loads((out / "config.json").read_text())["overwrite"] is True  # the second run went ahead
        assert not list(out.glob(".lock_node*"))  # a finished run leaves no lock file
    finally:
        holder.kill()
        holder.wait(timeout=30)


# -----------------------------------------------------------------------------
# issue 45: hostile and careless files


def test_pruning_touches_only_the_checkpoints_it_wrote(tiny_dir, tmp_path):
    """#45 item 2: --keep prunes only step_N dirs named as save_checkpoint names them and holding a progress.json;
    a user's copies and notes are never deleted and never take a --keep slot."""
    out = tmp_path / "run"
    argv = GRPO + ["--init", str(tiny_dir), "--out_dir", str(out), "--save_every", "1", "--keep", "2"]
    grpo.main(argv + ["--steps", "2"])
    shutil.copytree(out / "step_000002", out / "step_000002_good_backup")  # a complete checkpoint, renamed
    shutil.copytree(out / "step_000001", out / "step_0000001")  # 7 digits: not how step 1 is named
    shutil.copytree(out / "step_000001", out / "step_1")
    (out / "step_notes").mkdir()
    (out / "step_notes" / "todo.txt").write_text("look at step 2")
    (out / "step_000009").write_text("a file, not a dir")
    (out / ".tmp_step_mine").mkdir()  # a hidden dir of the user's, named like an interrupted save's
    (out / ".tmp_step_mine" / "x").write_text("x")
    user = ["step_000002_good_backup", "step_0000001", "step_1", "step_notes", "step_000009", ".tmp_step_mine"]
    before = {name: tree(out / name) for name in user}
    grpo.main(argv + ["--steps", "4"])
    assert {name: tree(out / name) for name in user} == before
    assert sorted(p.name for p in out.glob("step_*")) == sorted(user[:-1] + ["step_000003", "step_000004"])
    assert checkpoint.find_latest(out) == out / "step_000004"
    (out / "latest").unlink()  # without the pointer, the newest of the checkpoints it wrote
    assert checkpoint.find_latest(out) == out / "step_000004"


def test_published_model_is_a_copy(tmp_path):
    """#45 item 9: OUT/model holds copies of the last checkpoint's files: editing one in place (as an editor that
    writes through the file does) leaves the checkpoint as it was."""
    out = tmp_path / "sft"
    sft.main(SFT + ["--out_dir", str(out)])
    ckpt = checkpoint.find_latest(out)
    names = sorted(p.name for p in (out / "model").iterdir())
    assert "tokenizer_config.json" in names and "model.safetensors" in names
    before = tree(ckpt)
    for name in names:
        with open(out / "model" / name, "r+b") as f:  # in place: same inode
            f.seek(0, os.SEEK_END)
            f.write(b" ")
    assert tree(ckpt) == before


def test_only_the_marker_makes_a_run(tiny_dir, tmp_path):
    """#45 item 4: a directory is a run only when its minigrpo_run.json says so; a config.json holding a stage's
    flags (out_dir, resume, ...) or a summary.json like eval.py's proves nothing, and a marker minigrpo did not
    write (another stage name, a JSON bomb, binary) is none."""
    mine = tmp_path / "mine"  # the probe's: config.json with out_dir and resume keys, the user's log and weights
    mine.mkdir()
    (mine / "config.json").write_text(json.dumps({"out_dir": str(mine), "resume": "auto", "overwrite": False}))
    (mine / "metrics.jsonl").write_text('{"step": 1}\n{"step": 5}\n')
    (mine / "model").mkdir()
    (mine / "model" / "pytorch_model.bin").write_bytes(os.urandom(64))
    fake_run(tmp_path / "grpo_like", marker=False)
    (tmp_path / "eval_like").mkdir()
    (tmp_path / "eval_like" / "summary.json").write_text(json.dumps({"config": {}, "model": "m", "greedy": {}}))
    markers = {"number": '{"stage": 5}', "path": '{"stage": "../sft"}', "list": '["sft"]', "binary": b"\xff\xfe",
               "bomb": "[" * 100_000, "long": '{"stage": "sft", "pad": "' + "x" * 10_000 + '"}'}  # fmt: skip
    for name, text in markers.items():
        fake_run(tmp_path / f"marker_{name}", stage="sft", marker=False, **{checkpoint.MARKER: text})
    want = "exists and is not a minigrpo run (no valid minigrpo_run.json)"
    cases = [(sft.main, SFT + ["--out_dir", str(mine)]),
             (sft.main, SFT + ["--out_dir", str(mine), "--overwrite"]),
             (grpo.main, GRPO + ["--init", str(tiny_dir), "--out_dir", str(tmp_path / "grpo_like")]),
             (evaluation.main, ["--model", str(tiny_dir), "--split", "test[:2]", "--out_dir",
                                str(tmp_path / "eval_like")])]  # fmt: skip
    cases += [(sft.main, SFT + ["--out_dir", str(tmp_path / f"marker_{name}")]) for name in markers]
    dirs = [tmp_path / d for d in sorted(os.listdir(tmp_path))]
    for main, argv in cases:
        assert want in fails(main, argv, *dirs), argv


def test_publishing_never_deletes_what_the_user_put_in_out_model(tmp_path):
    """#45 item 3: an --out_dir inside the --init model is refused; a stage replaces OUT/model only when it holds no
    more than the files minigrpo wrote there (minigrpo_files.json lists them), else it refuses at the start, before
    anything is written, whether it would resume, extend, or --overwrite."""
    s = tmp_path / "s"
    sft.main(SFT + ["--out_dir", str(s)])
    model = s / "model"
    init = ["--init", str(model)]
    inside = [(grpo.main, GRPO + init + ["--out_dir", str(model / "grpo")]),
              (grpo.main, GRPO + ["--init", str(s), "--out_dir", str(s / "grpo")]),  # a run dir as --init
              (sft.main, SFT + init + ["--out_dir", str(model / "sft")])]  # fmt: skip
    for main, argv in inside:
        assert "is inside the --init model" in fails(main, argv, tmp_path), argv
    fake_run(model / "grpo")  # what the probe's grpo run left there, before the check above existed
    (model / "NOTES.md").write_text("my notes")
    (model / "my_eval").mkdir()
    (model / "my_eval" / "summary.json").write_text("{}")
    want = f"error: {model} holds files minigrpo did not write there (it holds NOTES.md, grpo/, my_eval/)"
    for extra in ([], ["--steps", "3"], ["--overwrite"], ["--resume", "none", "--overwrite"]):
        assert fails(sft.main, SFT + ["--out_dir", str(s)] + extra, tmp_path).startswith(want), extra
    for name in ("NOTES.md", "my_eval", "grpo"):  # moved out: the same command goes on and replaces OUT/model
        shutil.move(model / name, tmp_path / name)
    (model / "tokenizer_config.json").write_text("{}")  # a file minigrpo wrote, edited: replaced
    sft.main(SFT + ["--out_dir", str(s), "--steps", "3"])
    published, ckpt = tree(model), tree(s / "step_000003")
    assert json.loads((model / checkpoint.PUBLISHED).read_text()) == sorted(published)
    del published[checkpoint.PUBLISHED]
    assert "tokenizer_config.json" in published and all(published[k] == ckpt[k] for k in published)


def test_every_check_runs_before_overwrite_deletes(tiny_dir, tmp_path):
    """#45 item 5: stop / pad ids and the prompts' token ids are checked against the model's vocab_size before
    --overwrite deletes the old run: one error line, and the old run is as it was."""
    from hf import char_tokenizer, save_model
    from model import Transformer, preset_config

    bad = {"eos_negative": {"eos_token_id": -3}, "eos_past": {"eos_token_id": 100},
           "eos_list": {"eos_token_id": [2, 10**6]}}  # fmt: skip
    for name, fields in bad.items():
        shutil.copytree(tiny_dir, tmp_path / name)
        config = json.loads((tmp_path / name / "config.json").read_text())
        (tmp_path / name / "config.json").write_text(json.dumps({**config, **fields}))
    tok = char_tokenizer()  # ~100 tokens; a model of 40: the prompts' characters are past its embeddings
    small = preset_config("tiny", vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)  # fmt: skip
    save_model(Transformer(small), tmp_path / "vocab_small", tok)
    run, sft_run = tmp_path / "run", tmp_path / "sft_run"
    grpo.main(GRPO + ["--init", str(tiny_dir), "--out_dir", str(run)])
    sft.main(SFT + ["--init", str(tiny_dir), "--out_dir", str(sft_run)])
    dirs = [tmp_path / d for d in sorted(os.listdir(tmp_path))]
    for name in [*bad, "vocab_small"]:
        want = "is not a token id of this model" if name in bad else "past config.json's vocab_size 40"
        init = ["--init", str(tmp_path / name)]
        for main, argv in ((grpo.main, GRPO + init + ["--out_dir", str(run), "--overwrite"]),
                           (sft.main, SFT + init + ["--out_dir", str(sft_run), "--overwrite"]),
                           (evaluation.main, ["--model", str(tmp_path / name), "--split", "test[:2]",
                                              "--out_dir", str(tmp_path / "eval_new")])):  # fmt: skip
            msg = fails(main, argv, *dirs)
            assert msg.startswith("error: --") and want in msg, (name, argv, msg)


def test_eval_takes_the_lock_and_every_stage_rechecks_the_marker_under_it(tiny_dir, tmp_path, monkeypatch):
    """#45 item 7: eval.py takes the run dir's lock as sft / grpo do, and every stage checks the marker again under
    the lock: a run of another stage that claimed the (new) directory since the stage's first check turns it away,
    one error line, the other run's files as they were."""
    held = fake_run(tmp_path / "held", stage="eval")
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(held)], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        argv = ["--model", str(tiny_dir), "--split", "test[:2]", "--out_dir", str(held)]
        assert "is in use by another run" in fails(evaluation.main, argv, tmp_path)
    finally:
        holder.kill()
        holder.wait(timeout=30)

    def claimed_meanwhile(module, name, out, stage):
        """module.name, but another stage's run claims out while it runs (after the stage's first check)."""
        real = getattr(module, name)

        def run(*args, **kwargs):
            result = real(*args, **kwargs)
            if not out.exists():
                fake_run(out, stage=stage)
            return result

        monkeypatch.setattr(module, name, run)

    cases = [(evaluation, "load_for_eval", "grpo", ["--model", str(tiny_dir), "--split", "test[:2]"]),
             (grpo, "build_models", "eval", GRPO + ["--init", str(tiny_dir)]),
             (sft, "build_model", "grpo", SFT)]  # fmt: skip
    for module, name, other, argv in cases:
        out = tmp_path / f"new_{module.__name__}"
        with monkeypatch.context():
            claimed_meanwhile(module, name, out, other)
            msg = fails(module.main, argv + ["--out_dir", str(out)], *(p for p in tmp_path.iterdir() if p != out))
        assert msg.startswith(f"error: --out_dir {out} exists and is a run of {other}.py"), msg
        assert json.loads((out / checkpoint.MARKER).read_text())["stage"] == other
        assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", checkpoint.MARKER, "metrics.jsonl"])


def test_a_resume_checks_the_init_weights_not_only_their_path(tiny_dir, tmp_path, capsys):
    """#45 item 8: config.json and every checkpoint keep the sha256 of the --init weights; a resume whose --init
    path is the same but whose weights changed is refused where the run still uses them (a LoRA base, a beta > 0
    reference), one error line, every directory as it was; a full fine-tune at beta 0 resumes with a note."""
    from safetensors.torch import load_file, save_file

    init = tmp_path / "init"
    shutil.copytree(tiny_dir, init)
    lora = ["--lora_rank", "4", "--lora_alpha", "8"]
    cases = {"grpo_lora": (grpo.main, GRPO + lora, "LoRA base"), "sft_lora": (sft.main, SFT + lora, "LoRA base"),
             "grpo_beta": (grpo.main, GRPO + ["--beta", "0.1"], "KL reference (--beta 0.1)"),
             "grpo_full": (grpo.main, GRPO, None)}  # fmt: skip
    for name, (main, argv, _) in cases.items():
        main(argv + ["--init", str(init), "--out_dir", str(tmp_path / name), "--steps", "1"])
    weights = load_file(init / "model.safetensors")
    weights = {k: v + 1e-3 if k.endswith("q_proj.weight") else v for k, v in weights.items()}
    save_file(weights, init / "model.safetensors", metadata={"format": "pt"})  # the SFT run --init names, extended
    dirs = [tmp_path / d for d in sorted(os.listdir(tmp_path))]
    for name, (main, argv, role) in cases.items():
        argv = argv + ["--init", str(init), "--out_dir", str(tmp_path / name), "--steps", "2"]
        if role is None:
            capsys.readouterr()
            main(argv)
            assert f"note: the weights in --init {init} changed" in capsys.readouterr().out
            continue
        msg = fails(main, argv, *dirs)
        assert msg.startswith(f"error: cannot resume {tmp_path / name}/step_000001: the weights in --init {init} "
                              "changed since the run that wrote it started (sha256 ") and f"its {role}:" in msg, msg


def test_rng_files_permissions_and_grpo_model(tiny_dir, tmp_path):
    """#45 item 11: grpo.py (no LoRA) writes OUT/model, as the README's diagram shows; every safetensors file is
    readable as the user's umask says (safetensors' own save_file makes 0600); a checkpoint missing an RNG file of a
    rank that wrote it is refused (the resume would not be bitwise), one error line, the run as it was."""
    run, lora = tmp_path / "run", tmp_path / "lora"
    grpo.main(GRPO + ["--init", str(tiny_dir), "--out_dir", str(run)])
    sft.main(SFT + ["--init", str(tiny_dir), "--out_dir", str(lora), "--lora_rank", "4"])
    ckpt = tree(run / "step_000001")
    assert all(ckpt[k] == v for k, v in tree(run / "model").items() if k != checkpoint.PUBLISHED)
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(tree(run / "model"))
    umask = os.umask(0)
    os.umask(umask)
    files = [*run.rglob("*.safetensors"), *lora.rglob("*.safetensors")]
    assert {f.relative_to(tmp_path).as_posix() for f in files} >= {
        "run/model/model.safetensors", "run/step_000001/model.safetensors", "lora/model/model.safetensors",
        "lora/adapter/adapter_model.safetensors", "lora/step_000002/adapter_model.safetensors"}  # fmt: skip
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: oct(0o666 & ~umask) for f in files}
    (run / "step_000001" / "rng_rank0.pt").unlink()
    msg = fails(grpo.main, GRPO + ["--init", str(tiny_dir), "--out_dir", str(run), "--steps", "2"], tmp_path)
    assert msg == (f"error: cannot resume {run}/step_000001: rng_rank0.pt missing (the random states of the rank(s) "
                   "that wrote it), so the run would not continue as it would have: put the file(s) back, or resume "
                   "from another checkpoint (--resume PATH)")


def test_bad_progress_run_config_and_logs(tiny_dir, tmp_path, monkeypatch):
    """#45 item 10: a checkpoint's progress.json (wrong types, a step that is not its dir's, absurd sizes) and run
    config (a JSON bomb, not an object) are one error line before anything is rewritten; bytes no run wrote in
    metrics.jsonl (not UTF-8, a JSON bomb) are dropped with the torn lines on resume, not a traceback; --dist_timeout
    is checked before init_dist (under torchrun it would wait that long)."""
    run = tmp_path / "run"
    argv = GRPO + ["--init", str(tiny_dir), "--out_dir", str(run)]
    grpo.main(argv)
    ckpt = run / "step_000001"
    good = {name: (ckpt / name).read_bytes() for name in ("progress.json", "run_config.json")}
    progress = json.loads(good["progress.json"])
    bad_progress = {  # progress.json's content -> what the error says after "{ckpt}/progress.json: "
        '{"step": "1"}': 'step="1": expected an integer 0 .. 10^12',
        json.dumps({**progress, "step": 10**30}): f"step={10**30}: expected an integer 0 .. 10^12",
        json.dumps({**progress, "step": 5}): "step=5: expected 1, the step of step_000001",
        json.dumps({**progress, "world_size": 0}): "world_size=0: expected an integer 1 .. 2^20",
        json.dumps({**progress, "train_s": "abc"}): 'train_s="abc": expected a finite number >= 0',
        json.dumps({**progress, "wall_s": None}): "wall_s=null: expected a finite number >= 0",
        json.dumps({**progress, "stopped": 5}): "stopped=5: expected false or a reason",
        json.dumps({**progress, "eval_history": "x"}): 'eval_history="x": expected a list of numbers',
        "[1]": "expected an object",
        "[" * 100_000: "not valid JSON (RecursionError",
        '{"step": 1' + " " * (1 << 20) + "}": "not valid JSON",
    }  # fmt: skip
    for text, want in bad_progress.items():
        (ckpt / "progress.json").write_text(text)
        msg = fails(grpo.main, argv + ["--steps", "2"], tmp_path)
        assert msg.startswith(f"error: cannot resume {ckpt}: {ckpt}/progress.json: {want}"), (text[:40], msg)
    (ckpt / "progress.json").write_bytes(good["progress.json"])
    for text, want in {"[" * 100_000: "(nested too deeply)", '"flags"': "(a str, not an object of flags)"}.items():
        (ckpt / "run_config.json").write_text(text)
        msg = fails(grpo.main, argv + ["--steps", "2"], tmp_path)
        assert msg == f"error: cannot resume {ckpt}: its run config {ckpt}/run_config.json is unreadable {want}", msg
    (ckpt / "run_config.json").write_bytes(good["run_config.json"])
    with open(run / "metrics.jsonl", "ab") as f:
        f.write(b'{"step": 7, "loss": "\xff"}\n' + b"[" * 100_000 + b"\n")
    grpo.main(argv + ["--steps", "2"])
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_bytes().splitlines()] == [1, 2]

    def init_dist(*args, **kwargs):
        raise AssertionError("init_dist ran before --dist_timeout was checked")

    monkeypatch.setattr(common, "init_dist", init_dist)
    for main, args in ((grpo.main, argv), (sft.main, SFT), (evaluation.main, ["--model", str(tiny_dir)])):
        for value in ("0", "-1", "inf", "nan"):
            msg = fails(main, args + ["--dist_timeout", value], tmp_path)
            assert msg == f"error: --dist_timeout {float(value)}: need a positive finite number", msg


def test_a_checkpoint_that_cannot_be_written_is_one_error_line(tiny_dir, tmp_path, monkeypatch):
    """#45 item 10: a full disk while a checkpoint is written (safetensors' SafetensorError, DCP's failure, an
    OSError) stops the run with one error line; the previous checkpoint stays complete and the same command then
    continues from it."""
    import errno
    import traceback

    from safetensors import SafetensorError

    import hf

    run = tmp_path / "run"
    argv = GRPO + ["--init", str(tiny_dir), "--out_dir", str(run), "--save_every", "1"]
    grpo.main(argv)
    full = OSError(errno.ENOSPC, "No space left on device")
    dcp_failure = checkpoint.dcp.CheckpointException("save", {0: (RuntimeError("unexpected pos 4096 vs 8192"),
                                                                  traceback.StackSummary())})  # fmt: skip
    cases = [(hf, "save_safetensors", SafetensorError("Error while serializing: IoError(No space left on device)"),
              "Error while serializing: IoError(No space left on device)"),
             (checkpoint.dcp, "save", dcp_failure, "unexpected pos 4096 vs 8192"),
             (checkpoint, "save_model", full, "[Errno 28] No space left on device")]  # fmt: skip
    ckpt = tree(run / "step_000001")
    for module, name, error, shown in cases:
        def fail(*args, error=error, **kwargs):
            raise error

        with monkeypatch.context() as m:
            m.setattr(module, name, fail)
            with pytest.raises(SystemExit) as e:
                grpo.main(argv + ["--steps", "2"])
        assert e.value.code == (f"error: cannot write checkpoint {run}/step_000002: {shown}; the newest complete "
                                f"checkpoint is {run}/step_000001: free space (or fix the filesystem), then run the "
                                "same command again to continue from it"), e.value.code
        assert tree(run / "step_000001") == ckpt and checkpoint.find_latest(run) == run / "step_000001"
    def fsync(path):  # the disk fills up while OUT/model is copied (the last checkpoint is written)
        if ".tmp_model" in str(path):
            raise full

    with monkeypatch.context() as m:
        m.setattr(checkpoint, "_fsync", fsync)
        with pytest.raises(SystemExit) as e:
            grpo.main(argv + ["--steps", "2"])
    assert e.value.code == (f"error: cannot write {run}/model: [Errno 28] No space left on device; the newest complete "
                            f"checkpoint is {run}/step_000002: free space (or fix the filesystem), then run the same "
                            "command again to continue from it"), e.value.code
    grpo.main(argv + ["--steps", "2"])
    assert checkpoint.find_latest(run) == run / "step_000002"
    assert json.loads((run / "model" / checkpoint.PUBLISHED).read_text()) == sorted(os.listdir(run / "model"))
