"""grpo.py end to end: N-rank DDP / FSDP2 runs give the per-step metrics of one process on the same prompts and seed
(real torchrun subprocesses, gloo), and the chunked log-prob path stays far below full-logits memory."""

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_job

import grpo
import packing
from data import load_splits

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


# a random model never answers correctly; the overlong penalty gives groups reward variance, so there is a gradient.
# --gen_batch 4: one process samples its 4 prompts in one call, each of 2 ranks its 2 (per-call seeding differed)
FLAGS = ["--steps", "3", "--prompts_per_step", "4", "--group_size", "4", "--gen_batch", "4", "--max_new_tokens", "16",
         "--reward_weights", "overlong=1", "--eval_every", "0", "--lr", "1e-3", "--warmup", "1",
         "--train_micro_batch", "3"]  # fmt: skip
KEYS = ["reward", "reward_std", "overlong", "frac_zero_std", "len_mean", "len_max", "truncated", "entropy", "grad_norm",
        "kl", "clip_low", "clip_high"]


def _run(cmd, out_dir):
    r = run_job(cmd + ["--out_dir", str(out_dir)], 300, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return [json.loads(line) for line in open(out_dir / "metrics.jsonl")]


@pytest.mark.parametrize("loss", ["dapo", "grpo"])
def test_two_ranks_equal_one_process(tiny_dir, tmp_path, loss):
    # grpo's runs add the KL (all-reduced denominators over every completion) and a second, off-policy pass
    # (clip fractions measured on it, summed over ranks)
    extra = ["--beta", "0.04", "--mu", "2", "--epsilon", "0.01", "--epsilon_high", "0.01"] if loss == "grpo" else []
    flags = ["--init", str(tiny_dir), "--loss", loss] + FLAGS + extra
    one = _run([sys.executable, "grpo.py"] + flags, tmp_path / "one")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", "grpo.py"]
    modes = ["ddp", "fsdp"] if loss == "dapo" else ["ddp"]
    for mode in modes:
        # FSDP2 with recomputed blocks and micro-batches of <= 70 tokens (1-2 rows): the same steps
        memory = ["--activation_checkpointing", "--micro_batch_tokens", "70"] if mode == "fsdp" else []
        two = _run(torchrun + flags + ["--dist", mode, *memory], tmp_path / mode)
        assert len(one) == len(two) == 3
        for a, b in zip(one, two):
            for k in KEYS:
                assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-5), (mode, a["step"], k, a[k], b[k])
    assert one[0]["grad_norm"] > 0  # the comparison covers real updates, not a zero gradient
    if extra:
        assert one[-1]["kl"] > 0 and one[0]["clip_low"] + one[0]["clip_high"] > 0
    assert one[0]["logprob_gap"] < 1e-4  # sampler and trainer agree on the sampled tokens' log-probs (fp32)
    assert (tmp_path / "one" / "latest").is_file()


_MEM_WORKER = r"""
import resource, sys, torch
import model as M
mode, V, T = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
cfg = M.preset_config("tiny", vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=T)
m = M.Transformer(cfg)
tokens = torch.randint(0, V, (1, T))
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if mode == "chunked":
    logp, _ = m(tokens[:, :-1], targets=tokens[:, 1:])
else:  # the plain version: full (B, T, V) fp32 logits, log_softmax, gather
    logp = m(tokens[:, :-1]).log_softmax(-1).gather(-1, tokens[:, 1:, None])[..., 0]
logp.sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024)  # MiB
"""


def _peak_mib(mode, V, T):
    # glibc keeps freed multi-MB blocks in its heap, so peak RSS would count every chunk ever allocated; with a fixed
    # mmap threshold large blocks go back to the OS when freed and peak RSS measures live memory
    env = {**ENV, "MALLOC_MMAP_THRESHOLD_": "65536"}
    r = subprocess.run([sys.executable, "-c", _MEM_WORKER, mode, str(V), str(T)], env=env, cwd=ROOT,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    return float(r.stdout.split()[-1])


def test_chunked_logprob_memory_qwen_vocab():
    """Vocab 151,936 (Qwen2.5): one full fp32 logits tensor alone is T * V * 4 bytes (4.6 GiB at 8k tokens) and the
    plain log_softmax path holds several; the chunked path (forward + backward) holds a few 110-token chunks (64 MiB
    of logits each) whatever T: flat in T, a fraction of one full tensor. CI measures T = 2048 (8k takes minutes on
    a loaded 2-core CPU); MINIGRPO_LONG_TESTS=1 measures 8192. The plain version is measured at 512 tokens."""
    V = 151_936
    T = 8192 if os.environ.get("MINIGRPO_LONG_TESTS") else 2048
    one_logits_mib = T * V * 4 / 2**20
    chunked = _peak_mib("chunked", V, T)
    assert chunked < 0.35 * one_logits_mib, (chunked, one_logits_mib)
    chunked_small, plain_small = _peak_mib("chunked", V, 512), _peak_mib("full", V, 512)
    assert chunked < 1.25 * chunked_small, (chunked, chunked_small)  # 4x the tokens, about the same memory
    assert plain_small > 2 * chunked_small, (plain_small, chunked_small)
    print(f"peak MiB: chunked T={T}: {chunked:.0f} (one full fp32 logits tensor: {one_logits_mib:.0f}); "
          f"T=512: chunked {chunked_small:.0f}, plain {plain_small:.0f}")


def test_bad_flags_give_one_clear_line(tiny_dir, tmp_path):
    cases = [
        (["--group_size", "1", "--scale_rewards", "group"], "group_size 1"),
        (["--loss", "ppo"], "--loss"),
        (["--tis_cap", "-1"], "--tis_cap"),
    ]
    for extra, msg in cases:
        r = subprocess.run([sys.executable, "grpo.py", "--init", str(tiny_dir), "--out_dir", str(tmp_path / "x")]
                           + extra, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
        assert r.returncode != 0 and msg in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr


def test_save_minutes_checkpoints_by_wall_time(tiny_dir, tmp_path):
    """--save_minutes: with --save_every 0 a checkpoint once the time since the last one passes it (here: every
    step); the default (30 min) writes none in between on a short run."""
    grpo.main(["--init", str(tiny_dir), "--out_dir", str(tmp_path / "a"), *FLAGS, "--save_minutes", "1e-9",
               "--keep", "5"])  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "a").glob("step_*")) == ["step_000001", "step_000002", "step_000003"]
    grpo.main(["--init", str(tiny_dir), "--out_dir", str(tmp_path / "b"), *FLAGS, "--keep", "5"])
    assert sorted(p.name for p in (tmp_path / "b").glob("step_*")) == ["step_000003"]


def test_max_minutes_stops_says_so_and_goes_on_with_more(tiny_dir, tmp_path, capsys):
    out = tmp_path / "timed"
    grpo.main(["--init", str(tiny_dir), "--out_dir", str(out), *FLAGS, "--max_minutes", "1e-9"])  # any step: longer
    printed = capsys.readouterr().out
    assert [json.loads(x)["step"] for x in open(out / "metrics.jsonl")] == [1]
    assert "step 1: --max_minutes 1e-09 of training time used: stopping" in printed
    assert (out / "latest").read_text().strip() == "step_000001" and (out / "model" / "config.json").is_file()
    assert f"done: model in {out / 'model'}" in printed
    grpo.main(["--init", str(tiny_dir), "--out_dir", str(out), *FLAGS])  # no limit: it goes on to --steps
    assert [json.loads(x)["step"] for x in open(out / "metrics.jsonl")] == [1, 2, 3]
    assert "stopping" not in capsys.readouterr().out


def test_each_in_loop_eval_shows_one_sample(tiny_dir, tmp_path, capsys):
    """The console shows one eval completion per in-loop eval: the first held-out problem, its response, verdict."""
    flags = [*FLAGS[:FLAGS.index("--eval_every")], "--eval_every", "2", *FLAGS[FLAGS.index("--eval_every") + 2:]]
    grpo.main(["--init", str(tiny_dir), "--out_dir", str(tmp_path / "a"), *flags, "--eval_split", "test[:3]"])
    shown = [x for x in capsys.readouterr().out.splitlines() if x.startswith("  eval sample: ")]
    (first,) = load_splits(grpo.GRPOConfig(), "test[:1]")[0]
    assert len(shown) == 2 and all(repr(first["question"]) in x and "; gold " in x for x in shown), shown  # 2, 3


def test_optional_loggers_get_every_metric(tiny_dir, tmp_path, fake_wandb):
    """--wandb (a recorder in place of the package) and --tensorboard (when installed) get metrics.jsonl's numbers."""
    tb = importlib.util.find_spec("tensorboard") is not None
    grpo.main(["--init", str(tiny_dir), "--out_dir", str(tmp_path), "--wandb", "demo", "--tensorboard", str(tb),
               *FLAGS])  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [step for step, _ in fake_wandb.logged] == [r["step"] for r in rows] == [1, 2, 3]
    for (_, got), row in zip(fake_wandb.logged, rows):
        assert got == {k: v for k, v in row.items() if k != "step"}
    assert fake_wandb.inits[0]["config"]["group_size"] == 4 and fake_wandb.finished == 1
    if tb:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        ea = EventAccumulator(str(tmp_path / "tb"))
        ea.Reload()
        assert [e.value for e in ea.Scalars("reward")] == pytest.approx([r["reward"] for r in rows])


def test_training_batch_positions():
    """The log-prob of completion token t is read at position len(prompt) - 1 + t of the right-padded row."""
    prompts = [[5, 6, 7], [8]]
    comp = torch.tensor([[1, 2, 0], [3, 4, 9]])
    inputs, targets, pos, prompt_of = packing.training_batch(prompts, comp, [2, 3], pad_id=0)
    assert prompt_of == [(0, 3), (1, 1)]
    assert inputs.tolist() == [[5, 6, 7, 1], [8, 3, 4, 0]]
    assert targets.tolist() == [[6, 7, 1, 2], [3, 4, 9, -1]]  # -1: padding, never read
    assert pos.tolist() == [[2, 3, 3], [0, 1, 2]]  # row 0's third slot is past its EOS (masked), clamped
    for i, p in enumerate(prompts):
        for t in range([2, 3][i]):
            assert targets[i, pos[i, t]].item() == comp[i, t].item()
            assert inputs[i, pos[i, t]].item() == (p + comp[i].tolist())[len(p) - 1 + t]


def test_dr_grpo_filtering_zero_std_groups_changes_nothing(tiny_dir, tmp_path):
    """Zero-std groups have A = 0 exactly, dr_grpo's denominator is a constant and the KL applies to every
    completion: so --filter_zero_std true and false are the same run (step 2 has KL gradient: policy != ref)."""
    flags = ["--init", str(tiny_dir), *FLAGS, "--loss", "dr_grpo", "--beta", "0.1", "--lr", "1e-2", "--steps", "2"]
    runs = {}
    for f in ("true", "false"):
        grpo.main(flags + ["--filter_zero_std", f, "--out_dir", str(tmp_path / f)])
        runs[f] = [json.loads(line) for line in (tmp_path / f / "metrics.jsonl").read_text().splitlines()]
    assert 0 < runs["true"][0]["frac_zero_std"] < 1  # some groups filtered, some not
    assert runs["true"][1]["kl"] > 0
    for a, b in zip(runs["true"], runs["false"]):
        for k in ("grad_norm", "kl", "reward", "len_mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-8), (a["step"], k)


def _tiny_rollout(tiny_dir, **kw):
    from hf import load_model, load_tokenizer

    model, tok = load_model(tiny_dir), load_tokenizer(tiny_dir)
    cfg = grpo.GRPOConfig(group_size=4, max_new_tokens=12, **kw)
    prompts = [tok.encode("12+7="), tok.encode("3*40-5=")]  # different lengths: different left-padding
    return model, tok, cfg, prompts


def test_rollout_draws_the_same_samples_for_any_split(tiny_dir):
    """2 prompts in one sampler call (1 process) = 1 prompt per rank on 2 ranks (first = 0 and 1) = --gen_batch 1.
    Seeded per chunk, this split drew 0 of 8 equal rows."""
    model, tok, cfg, prompts = _tiny_rollout(tiny_dir, gen_batch=8)
    eos, pad = [tok.eos_token_id], tok.pad_token_id or 0

    def rows(roll):
        return [(t[:n], lp[:n]) for t, lp, n in zip(roll.tokens.tolist(), roll.logprobs.tolist(), roll.lengths)]

    together = rows(grpo.rollout(model, prompts, 0, 3, cfg, eos, pad, "cpu"))
    per_rank = rows(grpo.rollout(model, prompts[:1], 0, 3, cfg, eos, pad, "cpu"))
    per_rank += rows(grpo.rollout(model, prompts[1:], 1, 3, cfg, eos, pad, "cpu"))
    cfg.gen_batch = 1
    one_by_one = rows(grpo.rollout(model, prompts, 0, 3, cfg, eos, pad, "cpu"))
    assert len(together) == 8
    for a, b, c in zip(together, per_rank, one_by_one):
        assert a[0] == b[0] == c[0]
        assert a[1] == pytest.approx(b[1], abs=1e-5) and a[1] == pytest.approx(c[1], abs=1e-5)
    assert len({tuple(t) for t, _ in together}) > 2  # real sampling, not a constant


def test_compile_flag_decodes_the_same_rollouts(tiny_dir):
    """--compile: the rollouts decode through torch.compile (fast.fused_step compiled) and draw the eager
    default's tokens, log-probs to float rounding."""
    import fast

    model, tok, cfg, prompts = _tiny_rollout(tiny_dir, gen_batch=8)
    eos, pad = [tok.eos_token_id], tok.pad_token_id or 0
    eager = grpo.rollout(model, prompts, 0, 3, cfg, eos, pad, "cpu")
    torch._dynamo.reset()
    cfg.compile = True
    compiled = grpo.rollout(model, prompts, 0, 3, cfg, eos, pad, "cpu")
    assert torch._dynamo.eval_frame._debug_get_cache_entry_list(fast.fused_step)  # it compiled the step
    assert torch.equal(compiled.tokens, eager.tokens) and torch.equal(compiled.mask, eager.mask)
    assert (compiled.logprobs - eager.logprobs).abs().max() <= 1e-5
    assert len(set(map(tuple, eager.tokens.tolist()))) > 2  # real sampling, not a constant


def test_compile_without_a_cxx_compiler_is_one_clear_line(tiny_dir, tmp_path):
    # inductor builds with $CXX, else g++: neither on PATH, or CXX naming one that is not there
    for env in ({k: v for k, v in ENV.items() if k != "CXX"} | {"PATH": str(tmp_path)},
                ENV | {"CXX": str(tmp_path / "no-such-g++")}):
        r = subprocess.run([sys.executable, "grpo.py", "--init", str(tiny_dir), "--out_dir", str(tmp_path / "x"),
                            "--compile", "true"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and "--compile on the CPU needs a C++ compiler" in r.stderr, r.stderr[-2000:]
        assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()


def test_clip_fractions_are_measured_on_every_pass(tiny_dir):
    """--mu 2: pass 1's ratio is exactly 1 (no clipping); pass 2 sees the weights after one AdamW step. Its clipped
    tokens are recomputed here from the model after the same single step (an independent --mu 1 update), with the
    clip rule written out; the reported sums are over both passes / mu."""
    import copy

    model, tok, cfg, prompts = _tiny_rollout(tiny_dir, mu=2, lr=3e-2, epsilon=0.05, epsilon_high=0.05,
                                             train_micro_batch=64)  # fmt: skip
    torch.manual_seed(0)
    roll = grpo.rollout(model, prompts, 0, 1, cfg, [tok.eos_token_id], 0, "cpu")
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, -1.0, 1.0, 2.0, -2.0])[:, None]
    lmask = roll.mask.float()
    w = lmask / lmask.sum()
    lengths = roll.lengths.tolist()
    rp = [p for p in prompts for _ in range(4)]
    batch = packing.training_batch(rp, roll.tokens, lengths, 0)
    seq_len = [len(p) - 1 + n for p, n in zip(rp, lengths)]

    def run(m, mu):
        c = copy.copy(cfg)
        c.mu = mu
        opt = torch.optim.AdamW(m.parameters(), lr=cfg.lr, betas=(0.9, cfg.beta2), weight_decay=0.0)
        return grpo.update(m, None, opt, batch, seq_len, adv, lmask, w, None, roll.logprobs, c, 1)

    before, after_one = copy.deepcopy(model), copy.deepcopy(model)
    run(after_one, 1)
    stats = run(model, 2)
    inputs, targets, pos, _ = batch
    with torch.no_grad():
        logp = lambda m: m(inputs).log_softmax(-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0].gather(1, pos)
        old, new = logp(before), logp(after_one)
    rho = torch.exp(new - old)
    low = ((rho < 1 - cfg.epsilon) & (adv < 0) & (lmask > 0)).sum().item()
    high = ((rho > 1 + cfg.epsilon_high) & (adv > 0) & (lmask > 0)).sum().item()
    assert low > 0 and high > 0
    assert stats["clip_low"] == pytest.approx(low / 2) and stats["clip_high"] == pytest.approx(high / 2)
    assert stats["ntok"] == lmask.sum().item()  # the first pass's count (not mu x)


@pytest.mark.parametrize("extra", [["--loss", "gspo", "--epsilon", "3e-4", "--epsilon_high", "4e-4"],
                                   ["--loss", "cispo", "--tis_cap", "2", "--top_k", "20"]])  # fmt: skip
def test_gspo_and_cispo_with_tis_run_off_policy(tiny_dir, tmp_path, extra):
    """--mu 2: the second pass is off-policy, so GSPO's per-sequence clip (the paper's 3e-4 / 4e-4) bites; top-k
    sampling makes the sampler's log-probs differ from the trainer's, which is what TIS weights (and logprob_gap
    logs)."""
    grpo.main(["--init", str(tiny_dir), *FLAGS, "--steps", "2", "--mu", "2", "--lr", "1e-2", *extra,
               "--out_dir", str(tmp_path)])  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(math.isfinite(r["grad_norm"]) and math.isfinite(r["clip_low"]) for r in rows)
    informative = [r for r in rows if r["frac_zero_std"] < 1]
    assert informative  # a step with a gradient
    if "gspo" in extra:
        assert all(r["clip_low"] + r["clip_high"] > 0 for r in informative)
    else:
        assert all(r["logprob_gap"] > 1e-3 for r in informative)
