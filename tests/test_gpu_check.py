"""scripts/gpu_check.sh --tiny: the GPU acceptance run at toy shapes on the CPU, so it keeps working between GPU
sessions (every part runs: logits vs transformers, the SDPA kernel check, the sampler benchmark, the decode modes,
SFT / GRPO plain and FSDP2 on 1 rank), its results appended part by part."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402


def _run(*args):
    # the script runs `python`: this interpreter's, also where its venv is not activated
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path}
    return subprocess.run(["bash", "scripts/gpu_check.sh", "--tiny", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip


def test_gpu_check_tiny(tmp_path):
    out = tmp_path / "gpu_check.jsonl"
    r = _run("--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    info = rows[0]
    assert info["check"] == "info" and info["torch"] and "cudnn" in info and "cuda" in info
    logits = [x for x in rows if x["check"] == "logits"]
    assert len(logits) == 4 and all(x["ok"] for x in logits)
    assert all(x["vs_fp32"] > 0 for x in logits if x["dtype"] == "bfloat16")  # bf16 compute really ran
    kernels = [x for x in rows if x["check"] == "kernels"]
    assert len(kernels) == 6 and all(x["ok"] for x in kernels), kernels
    sampler = [x for x in rows if x["check"] == "sampler"]
    assert len(sampler) == 4 and all(x["ours_tok_s"] > 0 and x["hf_tok_s"] > 0 for x in sampler)
    decode = {x["mode"]: x for x in rows if x["check"] == "decode"}
    assert set(decode) == {"growing", "shared_prompt", "growing fp32", "fused fp32"}
    assert all(x["tok_s"] > 0 for x in decode.values()) and all(0 <= x["tokens_equal"] <= 1 for x in decode.values())
    assert decode["growing"]["tokens_equal"] == decode["growing fp32"]["tokens_equal"] == 1
    assert decode["fused fp32"]["tokens_equal"] == 1  # the fused step: the fp32 forward's tokens
    train = {(x["stage"], x["dist"]): x for x in rows if x["check"] == "train"}
    assert set(train) == {(s, d) for s in ("sft", "grpo") for d in ("none", "fsdp")}
    assert all(x["steps"] == 2 and x["mem_peak_mb"] > 0 for x in train.values())
    assert all(math.isfinite(train[("grpo", d)]["logprob_gap"]) for d in ("none", "fsdp"))
    md = Path(str(out) + ".md").read_text()
    assert "s_generate" in md and "**train**" in md
    assert "s_generate" in r.stdout  # the printed table
    assert not list(tmp_path.glob("**/step_*"))  # no checkpoint written


def test_gpu_check_parts_write_as_they_go(tmp_path):
    """--only runs the parts named; each part's rows are on disk when it ends (a second command appends); an
    unknown part is one error line."""
    out = tmp_path / "g.jsonl"
    r = _run("--only", "kernels", "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    r = _run("--only", "logits", "--out", str(out))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    checks = [json.loads(line)["check"] for line in out.read_text().splitlines()]
    assert checks == ["info"] + ["kernels"] * 6 + ["info"] + ["logits"] * 4
    md = Path(str(out) + ".md").read_text()
    assert "**kernels**" in md and "**logits**" in md
    r = _run("--only", "logits,bogus", "--out", str(out))
    assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error: --only bogus")


def test_hbm_bandwidth_from_the_device_name():
    assert gpu_check.hbm_gbs("NVIDIA H100 80GB HBM3") == 3350
    assert gpu_check.hbm_gbs("NVIDIA H100 PCIe") == 2000
    assert gpu_check.hbm_gbs("NVIDIA H100 NVL") == 3900
    assert gpu_check.hbm_gbs("NVIDIA H200") == 4800
    assert gpu_check.hbm_gbs("NVIDIA GeForce RTX 4090") is None  # unknown: no bound, not an H200's


def test_missing_compiler_is_one_error_line(monkeypatch):
    import torch

    monkeypatch.setattr(gpu_check.shutil, "which", lambda name: None)
    monkeypatch.delenv("CXX", raising=False)
    assert "C++ compiler" in gpu_check.compiler_missing(torch.device("cpu"))
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: object())
    assert "C compiler" in gpu_check.compiler_missing(torch.device("cuda"))
