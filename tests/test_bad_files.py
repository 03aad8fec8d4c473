"""Broken files a user can hand a stage (issue 17): a model dir's config.json, shard index or tokenizer, a checkpoint's
progress/RNG files, and bad flag values. Each gives one `error:` line naming the file or flag (no traceback) and
leaves every directory involved byte for byte as it was; config bombs fail before anything is allocated."""

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_run_dir import GRPO, fails

import eval as evaluation
import grpo
import sft

ROOT = Path(__file__).resolve().parents[1]

CONFIG_CASES = {  # config.json changes -> (the part of the error after "{dir}/config.json: ")
    "kv_heads_0": ({"num_key_value_heads": 0}, "num_key_value_heads=0: expected a positive integer"),
    "heads_0": ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads=0: expected a positive integer"),
    "string_hidden": ({"hidden_size": "64"}, "hidden_size='64': expected a positive integer"),
    "llama3_no_keys": ({"rope_scaling": {"rope_type": "llama3"}}, "llama3 rope_scaling {'rope_type': 'llama3'} needs"),
    "odd_head_dim": ({"head_dim": 15}, "head_dim=15 is odd"),
    "layers_20000": ({"num_hidden_layers": 20000}, "num_hidden_layers=20000 is over minigrpo's sanity limit 1024"),
    "layers_1e9": ({"num_hidden_layers": 10**9}, "num_hidden_layers=1000000000 is over minigrpo's sanity limit"),
    "hidden_1e9": ({"hidden_size": 10**9, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": None},
                   "hidden_size=1000000000 is over minigrpo's sanity limit 65536"),
    "params_5e13": ({"intermediate_size": 262144, "hidden_size": 65536, "num_hidden_layers": 1024},
                    "the config describes"),
}


@pytest.fixture(scope="module")
def broken(tiny_dir, tmp_path_factory):
    """name -> a copy of the tiny model dir broken one way."""
    root = tmp_path_factory.mktemp("broken")
    out = {}

    def variant(name):
        shutil.copytree(tiny_dir, root / name)
        out[name] = root / name
        return root / name

    for name, (change, _) in CONFIG_CASES.items():
        cfg_file = variant(name) / "config.json"
        cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), **change}))
    (variant("config_list") / "config.json").write_text("[1, 2]")
    (variant("config_not_json") / "config.json").write_text("{hidden_size: 64")
    (variant("index_no_map") / "model.safetensors.index.json").write_text('{"metadata": {}}')
    (variant("index_absolute") / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": str(tiny_dir / "model.safetensors")}}))
    (variant("index_dotdot") / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "../tiny/model.safetensors"}}))
    (variant("bad_tokenizer") / "tokenizer.json").write_text('{"model": 42}')
    weights = variant("truncated") / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    return out


def test_model_dir_table(broken, tmp_path):
    cases = {name: f"{broken[name]}/config.json: {want}" for name, (_, want) in CONFIG_CASES.items()}
    cases |= {
        "config_list": f"{broken['config_list']}/config.json: expected a JSON object, got list",
        "config_not_json": f"{broken['config_not_json']}/config.json: not valid JSON (Expecting property name",
        "index_no_map": f"{broken['index_no_map']}/model.safetensors.index.json: not a shard index",
        "index_absolute": f"{broken['index_absolute']}/model.safetensors.index.json: weight_map names '/",
        "index_dotdot": f"{broken['index_dotdot']}/model.safetensors.index.json: weight_map names '../tiny/",
        "bad_tokenizer": f"{broken['bad_tokenizer']}: unreadable tokenizer files",
        "truncated": f"{broken['truncated']}/model.safetensors: unreadable safetensors file, truncated or corrupt",
    }
    for name, want in cases.items():
        out = tmp_path / "out"
        msg = fails(grpo.main, GRPO + ["--init", str(broken[name]), "--out_dir", str(out)], broken[name], out)
        assert msg.startswith(f"error: --init: {want}"), (name, msg)
        msg = fails(evaluation.main, ["--model", str(broken[name]), "--out_dir", str(out)], broken[name], out)
        assert msg.startswith(f"error: --model: {want}"), (name, msg)


def test_config_bombs_allocate_nothing(broken):
    """Each bomb is refused by config.json's checks alone: peak memory grows by < 100 MB (the time is printed, not
    asserted: the machine is shared)."""
    names = ["layers_20000", "layers_1e9", "hidden_1e9"]
    code = ("import json, resource, sys, time, hf\n"
            "out = {}\n"
            "for path in sys.argv[1:]:\n"
            "    rss, t = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()\n"
            "    try:\n"
            "        hf.load_model(path)\n"
            "    except ValueError:\n"
            "        pass\n"
            "    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "    out[path] = (time.perf_counter() - t, (peak - rss) / 1024)\n"
            "print(json.dumps(out))\n")
    p = subprocess.run([sys.executable, "-c", code, *(str(broken[n]) for n in names)], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    for path, (seconds, mb) in json.loads(p.stdout).items():
        print(f"{Path(path).name}: refused in {seconds:.3f} s, peak RSS +{mb:.1f} MB")
        assert mb < 100, (path, mb)


# -----------------------------------------------------------------------------
# a checkpoint's own files, broken after the fact


@pytest.fixture(scope="module")
def run_dir(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "run"
    grpo.main(GRPO + ["--init", str(tiny_dir), "--out_dir", str(out), "--save_every", "1"])
    return out


class Payload:
    def __reduce__(self):
        return (print, ("pwned",))  # a pickle that would call a function when loaded


def test_checkpoint_files_table(run_dir, tiny_dir, tmp_path, capfd):
    ckpt = "step_000001"
    cases = {  # file in the checkpoint -> (its new bytes, the part of the error after "cannot load checkpoint X: ")
        "rng_garbage": ("rng_rank0.pt", b"\x00garbage" * 10, "rng_rank0.pt: unreadable ("),
        "rng_pickle": ("rng_rank0.pt", pickle.dumps(Payload()), "rng_rank0.pt: unreadable (the weights-only unpickler "
                                                                 "refused it: "),
        "rng_no_keys": ("rng_rank0.pt", None, "rng_rank0.pt: no RNG states (python, numpy, torch) in it"),
        # (progress.json: "cannot resume X: ...", checked before anything is loaded)
        "progress_no_step": ("progress.json", b'{"world_size": 1}', "progress.json: step=null: expected an integer"),
        "progress_step_abc": ("progress.json", b'{"step": "abc"}', 'progress.json: step="abc": expected an integer'),
        "progress_not_json": ("progress.json", b'{"step": 1', "progress.json: not valid JSON (JSONDecodeError: Expect"),
        # #45 item 10: read before DCP, which would log two tracebacks of its own before the error line
        "metadata_garbage": ("train_state/.metadata", b"garbage\n", "train_state/.metadata: not DCP metadata (ValueE"),
        "metadata_empty": ("train_state/.metadata", b"", "train_state/.metadata: not DCP metadata (EOFError: Ran out"),
    }
    import torch

    for name, (file, data, want) in cases.items():
        run = tmp_path / name
        shutil.copytree(run_dir, run)
        if data is None:
            torch.save({"gen": torch.zeros(2)}, run / ckpt / file)
        else:
            (run / ckpt / file).write_bytes(data)
        argv = GRPO + ["--init", str(tiny_dir), "--out_dir", str(run), "--steps", "2"]
        msg = fails(grpo.main, argv, run, tiny_dir)
        lead = "resume" if file == "progress.json" else "load checkpoint"
        assert msg.startswith(f"error: cannot {lead} {run}/{ckpt}: ") and want in msg, (name, msg)
        assert "Traceback" not in capfd.readouterr().err, name


def test_flag_table(tiny_dir, tmp_path):
    out, init = tmp_path / "out", ["--init", str(tiny_dir)]
    cases = [
        (grpo.main, GRPO + init + ["--reward_weights", "foo"], "error: --reward_weights: bad reward weight 'foo'"),
        (grpo.main, GRPO + init + ["--template", "chat"], "error: --template: template 'chat' needs a tokenizer with"),
        (grpo.main, GRPO + init + ["--task_knobs", "steps=abc"], "error: data: bad arith knob steps='abc': expected"),
        (grpo.main, GRPO + init + ["--gen_batch", "0"], "error: --gen_batch 0: need at least 1"),
        (grpo.main, GRPO + init + ["--temperature", "0"], "error: --temperature 0.0: need a positive finite number"),
        (sft.main, ["--template", "chat"], "error: --template: template 'chat' needs a tokenizer with"),
        (sft.main, ["--model_overrides", "hidden_size=abc"], "error: --model_overrides: hidden_size='abc'"),
        (sft.main, ["--model_overrides", "num_hidden_layers=20000"],
         "error: --model_overrides: num_hidden_layers=20000 is over minigrpo's sanity limit 1024"),
        (sft.main, ["--model_overrides", "hiden_size=64"], "error: --model_overrides: unknown config fields"),
        (sft.main, ["--model_overrides", "vocab_size=40"],  # #45 items 5, 10: was a TypeError (vocab_size twice)
         "error: --model_overrides: the examples tokenize to id 99, past config.json's vocab_size 40"),
        (sft.main, ["--model_overrides", "eos_token_id=500"],
         "error: --model_overrides: config.json's eos_token_id 500 is not a token id of this model"),
        (sft.main, ["--global_batch", "0"], "error: --global_batch 0: need at least 1"),
        (evaluation.main, ["--model", str(tiny_dir), "--template", "chat"], "error: --template: template 'chat'"),
        (evaluation.main, ["--model", str(tiny_dir), "--pass_k", "0,8"], "error: --pass_k (0, 8): need at least 1"),
        (evaluation.main, ["--model", str(tmp_path / "nope")], f"error: --model {tmp_path}/nope: not a model dir"),
    ]
    for main, argv, want in cases:
        msg = fails(main, argv + ["--out_dir", str(out)], out, tiny_dir)
        assert msg.startswith(want), (argv, msg)


def test_data_rows_table(tiny_dir, tmp_path):
    """MATH rows: a numeric `answer` is its text (not replaced by the solution's last \\boxed{}); golds no completion
    could match, and answers that are neither text nor number, are one error naming the file and row."""
    import data

    good = {"problem": "p", "solution": "so \\boxed{7}"}
    assert data.math_row({**good, "answer": 3})["answer"] == "3"
    assert data.math_row({**good, "answer": 0.5})["answer"] == "0.5"
    assert data.math_row(good)["answer"] == "7"
    cases = {
        "long_gold": ({**good, "answer": "x" * 1001}, "row 2: the gold answer has 1001 characters, over the 1000"),
        "list_answer": ({**good, "answer": [1]}, "row 2: field 'answer' is [1], not a string or a number"),
        "no_answer": ({"problem": "p", "solution": "none"}, "row 2: no field 'answer' and no \\boxed{...}"),
        "bool_answer": ({**good, "answer": True}, "row 2: field 'answer' is True, not a string or a number"),
        # #45 item 10: a file that is not UTF-8 text or not JSON a parser survives names the file and the row
        "not_utf8": (b'{"problem": "\xff\xfe"}', "row 2: not UTF-8 text (byte "),
        "bomb": ("[" * 100_000, "row 2: not valid JSON (nested too deeply)"),
        "big_int": ('{"problem": "p", "answer": ' + "9" * 5000 + "}", "row 2: not valid JSON (Exceeds the limit"),
    }
    out = tmp_path / "out"
    for name, (row, want) in cases.items():
        path = tmp_path / f"{name}.jsonl"
        row = row.encode() if isinstance(row, str) else row if isinstance(row, bytes) else json.dumps(row).encode()
        path.write_bytes(json.dumps({**good, "answer": "1"}).encode() + b"\n" + row + b"\n")
        argv = GRPO + ["--init", str(tiny_dir), "--task", "math", "--data_path", str(path), "--split", "test",
                       "--eval_split", "test", "--out_dir", str(out)]  # fmt: skip
        msg = fails(grpo.main, argv, out, path)
        assert msg == f"error: data: {path}: {want}" or msg.startswith(f"error: data: {path}: {want}"), (name, msg)


def test_chat_template_errors(tiny_dir, tmp_path):
    """#45 item 10: a chat template that fails (a syntax error, an undefined name, the sandbox refusing an attribute,
    raise_exception, a type error) is one error line naming the template, in every stage, the dirs as they were."""
    from transformers import AutoTokenizer

    templates = {"syntax": "{% for %}", "undefined": "{{ nothing.at.all }}",
                 "sandbox": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
                 "raises": "{{ raise_exception('no system role') }}", "type": "{{ messages + 1 }}"}  # fmt: skip
    out = tmp_path / "out"
    for name, template in templates.items():
        model = tmp_path / name
        shutil.copytree(tiny_dir, model)
        tok = AutoTokenizer.from_pretrained(model)
        tok.chat_template = template
        tok.save_pretrained(model)
        init = ["--init", str(model), "--template", "chat"]
        cases = [(grpo.main, GRPO + init), (sft.main, ["--split", "train[:8]", "--eval_split", "test[:2]"] + init),
                 (evaluation.main, ["--model", str(model), "--template", "chat"])]
        for main, argv in cases:
            msg = fails(main, argv + ["--out_dir", str(out)], out, model)
            assert msg.startswith("error: --template: the tokenizer's chat template fails ("), (name, msg)
