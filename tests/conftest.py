"""Shared fixtures, and run_job: a subprocess (torchrun and its workers) that, if it hangs, fails with stacks."""

import importlib.machinery
import os
import signal
import subprocess
import sys
import time
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


def descendants(pid: int) -> list[int]:
    """Every process below pid (torchrun starts its workers in sessions of their own, out of killpg's reach)."""
    children = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def send(pids: list[int], sig):
    """sig to each pid still alive."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def run_job(cmd: list[str], timeout: float, env=None, **kw) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=True, text=True, ...) for a job that might hang. Past `timeout` every
    process below it gets SIGABRT, which PYTHONFAULTHANDLER turns into each one's Python stack on stderr, then
    the job itself; the test fails with the output, stacks included (not only "timed out")."""
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        below = descendants(p.pid)
        send(below, signal.SIGABRT)  # the workers first: their stacks are the ones that say where
        time.sleep(2)
        send([p.pid], signal.SIGABRT)
        time.sleep(1)
        send([p.pid, *below, *descendants(p.pid)], signal.SIGKILL)  # nothing left holding the pipes
        out, err = p.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))[:300]}\ndid not end in {timeout}s; its output, each process's "
                    f"stack last (PYTHONFAULTHANDLER):\n{out[-3000:]}\n{err[-12000:]}", pytrace=False)
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)
