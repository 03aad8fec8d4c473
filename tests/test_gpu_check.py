"""scripts/gpu_check.sh --tiny: the GPU acceptance run at toy shapes on the CPU, so it keeps working between GPU
sessions (every check runs: logits vs transformers, the sampler benchmark, the decode modes, SFT / GRPO plain and
FSDP2 on 1 rank)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_tiny(tmp_path):
    out = tmp_path / "gpu_check.json"
    # the script runs `python`: this interpreter's, also where its venv is not activated
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": path}
    r = subprocess.run(["bash", "scripts/gpu_check.sh", "--tiny", "--out", str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    logits = [x for x in rows if x["check"] == "logits"]
    assert len(logits) == 4 and all(x["ok"] for x in logits)
    assert all(x["vs_fp32"] > 0 for x in logits if x["dtype"] == "bfloat16")  # bf16 compute really ran
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
    assert "s_generate" in r.stdout  # the printed table
