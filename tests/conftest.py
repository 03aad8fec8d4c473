"""Shared fixtures."""

import importlib.machinery
import sys
import types

import pytest
import torch

from hf import char_tokenizer, save_model
from model import Transformer, preset_config


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A random 2-layer Llama (GQA, 4 heads / 2 KV heads) with the char tokenizer, saved as an HF model dir."""
    tok = char_tokenizer()
    cfg = preset_config("tiny", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    save_model(Transformer(cfg), path, tok)
    return path


class FakeWandb(types.ModuleType):
    """Stands in for the wandb package: records init() and log() calls and, like the W&B server, drops a row whose
    step is lower than one its run already has (what a resumed run must avoid)."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logged, self.dropped, self.finished, self.last = [], [], [], 0, {}
        self.util = types.SimpleNamespace(generate_id=lambda: f"id{len(self.inits)}")

    def init(self, **kw):
        self.inits.append(kw)
        return self

    def log(self, row, step=None):
        run = self.inits[-1]["id"]
        if step < self.last.get(run, 0):
            self.dropped.append((run, step))
            return
        self.last[run] = step
        self.logged.append((step, row))

    def finish(self):
        self.finished += 1


@pytest.fixture
def fake_wandb(monkeypatch) -> FakeWandb:
    """`import wandb` gives a recorder for the duration of the test."""
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return fake
