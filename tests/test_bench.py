"""bench.py --vs_trl's two sides at toy sizes: each runs a real training step (the measurement itself is not a test)."""

import pytest
import torch

import bench
from hf import load_tokenizer


def toy_config(tmp_path):
    cfg = bench.vs_trl_config(str(tmp_path / "ours"), steps=1)
    cfg.prompts_per_step, cfg.group_size, cfg.gen_batch, cfg.max_new_tokens = 2, 3, 2, 6
    return cfg


def test_our_side_trains_and_times_its_floor(tiny_dir, tmp_path):
    tok = load_tokenizer(tiny_dir)
    prompts = [tok.encode("What is 1+2?\n<think>"), tok.encode("3*4?\n")]
    ours = bench.OurSide(tiny_dir, prompts, toy_config(tmp_path))
    before = [p.detach().clone() for p in ours.model.parameters()]
    trained, width, gen_len = ours.step(1)
    assert len(gen_len) == 6 and all(1 <= n <= 6 for n in gen_len)
    # --share_prompt (the default): each prompt's tokens but its last once, then each row's last prompt token and
    # completion; rows as wide as the longest whole sequence
    assert trained == [len(p) - 1 for p in prompts] + [n + 1 for n in gen_len]
    assert width == max(len(prompts[i // 3]) - 1 + n for i, n in enumerate(gen_len))
    assert all(not torch.equal(a, b) for a, b in zip(before, ours.model.parameters()))  # every weight was trained
    ours.floor(trained, width, gen_len)
    assert len(ours.times) == len(ours.floors) == 1 and min(ours.times[0] + ours.floors[0]) > 0
    assert all(p.grad is None for p in ours.model.parameters())  # the floor leaves no gradient behind


@pytest.mark.slow
def test_trl_side_trains(tiny_dir, tmp_path):
    pytest.importorskip("trl")
    steps = []
    from transformers import TrainerCallback

    class Count(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            steps.append(state.global_step)

    trainer = bench.trl_trainer(tiny_dir, ["What is 1+2?\n<think>", "3*4?\n"], toy_config(tmp_path), 1,
                                str(tmp_path / "trl"), Count())
    trainer.train()
    assert steps == [1] and len(trainer.gen_times) == 1 and 1 <= trainer.lens[0] <= 6
