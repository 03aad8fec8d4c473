"""Checkpoint save / load time and peak host memory per rank, at a real model shape with random weights.

    python scripts/measure_checkpoint.py                                  # one process
    torchrun --nproc_per_node=2 scripts/measure_checkpoint.py --dist fsdp  # two ranks, FSDP2
    cd OLD_CHECKOUT && python /path/to/scripts/measure_checkpoint.py       # the same against another version

Builds the model (Qwen2.5-0.5B's shape by default, vocab 151,936), gives AdamW one step of state, then times
save_checkpoint into --out_dir and load_checkpoint into a fresh model + optimizer. Peak RSS is read from the kernel
(VmHWM), reset before each phase (/proc/self/clear_refs), so each figure is that phase's own peak; "+" is the peak
above the RSS the phase started from. Works with this checkout's checkpoint.py and with versions that kept the
checkpoint functions in common.py. Run it alone on a quiet machine: at the default shape each process holds several GB.
"""

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.getcwd())  # the checkout it is run from comes first

import torch

import common
import model as model_lib

try:
    import checkpoint as ckpt_lib
except ImportError:  # a version from before checkpoint.py
    ckpt_lib = common

SHAPES = {
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151_936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6),
    "small": dict(model_type="qwen2", vocab_size=151_936, hidden_size=256, intermediate_size=768,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
}


def rss_gb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in GB."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    raise RuntimeError(field)


def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def build(shape: str, mode: str, d):
    torch.manual_seed(0)
    model = common.wrap_model(model_lib.Transformer(model_lib.ModelConfig(**SHAPES[shape])), mode, d)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, opt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--dist", default="fsdp", choices=["ddp", "fsdp"], help="wrapping under torchrun")
    ap.add_argument("--out_dir", default="/tmp/minigrpo_ckpt_measure")
    args = ap.parse_args()
    d = common.init_dist()
    mode = args.dist if d.world_size > 1 else "none"
    out = Path(args.out_dir)
    if d.is_main:
        shutil.rmtree(out, ignore_errors=True)
    common.barrier()

    model, opt = build(args.shape, mode, d)
    for p in model.parameters():  # one AdamW step: the moments exist
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    rows = {}
    common.barrier()
    rss0 = rss_gb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    ckpt = ckpt_lib.save_checkpoint(out, 1, model, None, {"data_position": 1}, d, optimizer=opt, keep=1)
    rows["save"] = (time.perf_counter() - t0, rss0, rss_gb("VmHWM"))
    del model, opt
    model, opt = build(args.shape, mode, d)  # fresh: what a restarted run has before it loads
    common.barrier()
    rss0 = rss_gb("VmRSS")
    reset_peak()
    t0 = time.perf_counter()
    ckpt_lib.load_checkpoint(ckpt, model, d, optimizer=opt)
    common.barrier()
    rows["load"] = (time.perf_counter() - t0, rss0, rss_gb("VmHWM"))
    lines = [f"rank {d.rank}/{d.world_size} {mode} {phase}: {s:6.1f} s, peak RSS {peak:5.2f} GB (+{peak - r0:.2f} "
             f"over the {r0:.2f} GB before)" for phase, (s, r0, peak) in rows.items()]
    for line in common.all_gather_list(lines):
        common.print0(line)
    if d.is_main:
        size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        print(f"checkpoint {ckpt}: {size / 1e9:.2f} GB on disk, via {ckpt_lib.__name__}.py", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    common.cleanup_dist()


if __name__ == "__main__":
    main()
