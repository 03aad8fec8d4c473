"""Progress fits where it goes (issue 17): a tqdm bar on a terminal, a plain line every N seconds (and the last step)
when stdout is a file or pipe, in every stage; never a flood of carriage-return updates in a log."""

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path

import common
import eval as evaluation

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
SFT = ["sft.py", "--split", "train[:32]", "--eval_split", "test[:4]", "--global_batch", "8", "--micro_batch", "8",
       "--eval_every", "0", "--warmup", "1", "--steps", "6", "--model_overrides", "hidden_size=32,"
       "intermediate_size=64,num_hidden_layers=1"]  # fmt: skip


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_plain_lines_every_n_seconds(monkeypatch):
    """Not a terminal: the first update, then one line per `every_s` seconds, and the last step, with an ETA."""
    clock, out = Clock(), io.StringIO()
    monkeypatch.setattr(common.time, "perf_counter", clock)
    monkeypatch.setattr(sys, "stdout", out)
    bar = common.Progress(100, "sft step", initial=10, every_s=30)
    for step in range(11, 101):
        clock.t += 1.0  # one step per second
        bar.update(1, f"loss {1 / step:.3f}")
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "sft step 11/100 (11%) | loss 0.091 | 1s, eta 1m29s"  # 89 steps left at 1 step/s
    assert [int(line.split()[2].split("/")[0]) for line in lines] == [11, 41, 71, 100]
    assert lines[-1].endswith("| 1m30s, eta 0s") and "\r" not in out.getvalue()


def test_terminal_gets_a_bar():
    """On a terminal (a pty): a tqdm bar, carriage-return updates, no plain progress lines."""
    code = "import common\nbar = common.Progress(3, 'sft step')\nfor _ in range(3):\n    bar.update(1, 'loss 1')\n"
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    q = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=follower, timeout=60)
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 10000)
        except OSError:  # EIO: the child's end is closed and drained
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    text = b"".join(chunks).decode()
    assert q.returncode == 0 and "\r" in text and "3/3" in text and "loss 1" in text and "eta" not in text, text


def test_stages_log_lines_to_a_pipe(tiny_dir, tmp_path, capsys):
    """sft.py to a pipe: a line at the first and the last step (--progress_every 1e9), no carriage returns; eval.py's
    batches the same way."""
    p = subprocess.run([sys.executable, *SFT, "--out_dir", str(tmp_path / "sft"), "--progress_every", "1e9"],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    steps = [line.split()[2] for line in p.stdout.splitlines() if line.startswith("sft step")]
    assert steps == ["1/6", "6/6"] and "\r" not in p.stdout + p.stderr, p.stdout
    evaluation.main(["--model", str(tiny_dir), "--split", "test[:6]", "--batch_size", "2", "--max_new_tokens", "4",
                     "--out_dir", str(tmp_path / "eval"), "--progress_every", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert [line.split()[3] for line in out.splitlines() if line.startswith("eval greedy batch")] == ["1/3", "2/3",
                                                                                                      "3/3"]
