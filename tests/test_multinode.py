"""Multi-node on one machine: two "nodes" (two torchrun launches, one process each, rendezvous on 127.0.0.1) give the
per-step GRPO metrics of one `torchrun --nproc_per_node=2 --standalone` run, directly and through run_multinode.sh's
plain mode; a node that never starts and a rank that stops answering end the run with a clear error within the
configured timeout. Real subprocesses, gloo, the tiny model of tests/test_grpo.py."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import descendants, run_job, send

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "run_multinode.sh"
# torchrun next to this interpreter comes first on PATH (run_multinode.sh calls `torchrun`); SLURM_* variables are
# dropped so the script takes its plain-host path even when the tests run inside a SLURM job
ENV = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
ENV.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# as in test_grpo.py (a random model never answers correctly; the overlong penalty gives groups reward variance),
# on a small split: tokenizing 18k default prompts in every worker costs more than the steps
FLAGS = ["--split", "train[:64]", "--eval_split", "test[:4]", "--prompts_per_step", "4", "--group_size", "4",
         "--gen_batch", "2", "--max_new_tokens", "16", "--reward_weights", "overlong=1", "--eval_every", "0",
         "--lr", "1e-3", "--warmup", "1", "--train_micro_batch", "3"]  # fmt: skip
TIMING = {"t_generate", "t_score", "t_train", "tokens_per_s", "mem_peak_mb", "train_s", "wall_s"}  # vary by run


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(out_dir / "metrics.jsonl")]


def _grpo(tiny_dir, out_dir, steps=3) -> list[str]:
    return ["grpo.py", "--init", str(tiny_dir), "--out_dir", str(out_dir), "--steps", str(steps)] + FLAGS


def _start(cmd, tmp: Path, **env) -> subprocess.Popen:
    # a session of its own, so that cleanup can end the launcher and every worker it started; TMPDIR keeps torchrun's
    # temporary log directories out of /tmp
    return subprocess.Popen(cmd, env={**ENV, "TMPDIR": str(tmp), **env}, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip


def _stop(procs):
    for p in procs:
        if p.poll() is None:
            pids = [p.pid, *descendants(p.pid)]
            for sig in (signal.SIGCONT, signal.SIGKILL):  # a stopped worker must run to act on the kill
                send(pids, sig)
        p.communicate()


def _finish(procs, timeout=240) -> list[str]:
    """Wait for every process (they run concurrently); return their outputs; fail with the logs if any failed."""
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        _stop(procs)
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    return outs


def _assert_same_metrics(ref: list[dict], got: list[dict]):
    assert len(ref) == len(got) == 3
    for a, b in zip(ref, got):
        assert a.keys() == b.keys()
        for k in a.keys() - TIMING:
            assert b[k] == pytest.approx(a[k], rel=1e-6, abs=1e-9), (a["step"], k, a[k], b[k])


@pytest.fixture(scope="module")
def reference(tiny_dir, tmp_path_factory):
    """Per-step metrics of one node with two processes."""
    out = tmp_path_factory.mktemp("one_node")
    _finish([_start(TORCHRUN + ["--standalone", "--nproc_per_node=2"] + _grpo(tiny_dir, out / "run"), out)])
    ref = _metrics(out / "run")
    assert ref[0]["grad_norm"] > 0  # the comparison covers real updates
    return ref


def test_two_nodes_equal_one_node(tiny_dir, reference, tmp_path):
    """torchrun's classic multi-node form (static rendezvous): --nnodes 2, --node-rank 0/1, one process each."""
    port = _free_port()
    nodes = [_start(TORCHRUN + ["--nnodes=2", f"--node-rank={r}", "--nproc-per-node=1", "--master-addr=127.0.0.1",
                                f"--master-port={port}"] + _grpo(tiny_dir, tmp_path / "run"), tmp_path)
             for r in (0, 1)]  # fmt: skip
    _finish(nodes)
    _assert_same_metrics(reference, _metrics(tmp_path / "run"))


def _script_env(node_rank, port, run_id, tmp_path, **extra) -> dict:
    return dict(NNODES="2", NODE_RANK=str(node_rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                NPROC_PER_NODE="1", RDZV_ID=run_id, LOG_DIR=str(tmp_path / f"logs{node_rank}"), **extra)  # fmt: skip


def test_run_multinode_sh_two_nodes(tiny_dir, reference, tmp_path):
    """The same through run_multinode.sh on two "hosts" (c10d rendezvous hosted by NODE_RANK 0, a shared out_dir)."""
    port = _free_port()
    out = tmp_path / "run"
    nodes = [_start([str(SCRIPT)] + _grpo(tiny_dir, out), tmp_path, **_script_env(r, port, f"t{port}", tmp_path))
             for r in (0, 1)]  # fmt: skip
    outs = _finish(nodes)
    _assert_same_metrics(reference, _metrics(out))
    # lines carry node and global rank; rank 0 (on either node: the rendezvous assigns global ranks) logged the steps
    assert any("rank0]:grpo step 3/" in o for o in outs), outs
    assert all("--dist_timeout=600" in o for o in outs)  # DIST_TIMEOUT's default reached the script
    assert (out / "latest").is_file()  # the checkpoint, written by both nodes' ranks into one directory


def test_dead_node_fails_within_rendezvous_timeout(tiny_dir, tmp_path):
    """The second node never starts: the first one stops after RDZV_TIMEOUT with a rendezvous error and a hint."""
    port = _free_port()
    t0 = time.monotonic()
    node = _start([str(SCRIPT)] + _grpo(tiny_dir, tmp_path / "run"), tmp_path,
                  **_script_env(0, port, f"t{port}", tmp_path, RDZV_TIMEOUT="4"))
    try:
        out = node.communicate(timeout=120)[0]
    finally:
        _stop([node])
    elapsed = time.monotonic() - t0
    assert node.returncode != 0, out[-3000:]
    assert "RendezvousTimeoutError" in out and "not all 2 nodes reached" in out, out[-3000:]
    assert 4 <= elapsed < 4 + 60, elapsed  # it waited for the join timeout, and not much longer


def _worker_pid(run_id: str, rank: int) -> tuple[int, dict] | None:
    """(pid, environment) of the torchrun worker with global `rank` in the rendezvous `run_id`, if it runs yet."""
    for proc in Path("/proc").iterdir():
        try:
            env = dict(kv.split("=", 1) for kv in (proc / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError):
            continue
        if env.get("TORCHELASTIC_RUN_ID") == run_id and env.get("RANK") == str(rank):
            return int(proc.name), env
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc to find the worker")
def test_stopped_rank_fails_within_dist_timeout(tiny_dir, tmp_path):
    """A rank that stops answering (SIGSTOP, mid-run): the other node fails after DIST_TIMEOUT, naming the collective,
    and the stopped rank's node then ends too (its rendezvous host went away) instead of hanging."""
    port = _free_port()
    run_id, out = f"t{port}", tmp_path / "run"
    nodes = [_start([str(SCRIPT)] + _grpo(tiny_dir, out, steps=100_000), tmp_path,
                    **_script_env(r, port, run_id, tmp_path, DIST_TIMEOUT="4", MAX_RESTARTS="0"))
             for r in (0, 1)]  # fmt: skip
    try:
        deadline = time.monotonic() + 120  # training is under way once step 1 is logged
        while not ((out / "metrics.jsonl").is_file() and (out / "metrics.jsonl").stat().st_size):
            assert time.monotonic() < deadline and all(p.poll() is None for p in nodes), "no step logged"
            time.sleep(0.2)
        found = _worker_pid(run_id, 1)
        assert found is not None, "no worker with RANK=1 found in /proc"
        pid, env = found
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        stopped = int(env["NODE_RANK"])  # the node whose worker holds global rank 1
        healthy = nodes[1 - stopped]
        out_healthy = healthy.communicate(timeout=120)[0]
        elapsed = time.monotonic() - t0
        os.kill(pid, signal.SIGCONT)  # a hung rank would get SIGKILL after torchrun's shutdown timeout; save the 30 s
        out_stopped = nodes[stopped].communicate(timeout=120)[0]
    finally:
        _stop(nodes)
    # every message carries both logs' tails: a failure seen once under load must be readable from the CI log alone
    logs = (f"elapsed {elapsed:.1f} s\n--- healthy node:\n{out_healthy[-3000:]}\n"
            f"--- stopped node:\n{out_stopped[-3000:]}")
    assert healthy.returncode != 0 and nodes[stopped].returncode != 0, logs
    assert "Timed out waiting 4000ms" in out_healthy, logs  # --dist_timeout reached gloo
    assert "did not complete within --dist_timeout=4s" in out_healthy, logs  # common.init_dist's hint
    assert elapsed < 4 + 60, logs  # the timeout, plus startup noise on a busy machine: not the 600 s default
    assert "Traceback" in out_stopped, logs  # once resumed, the stopped rank's node finds its peer gone and fails too


def test_slurm_mode_command(tmp_path):
    """Under SLURM (faked: srun prints its arguments, scontrol lists two hosts) one srun starts torchrun on every node,
    with the rendezvous on the allocation's first host and the script's flags passed on intact."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text("#!/usr/bin/env bash\nprintf '%s\\n' \"$@\"\n")
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\nprintf 'gpu-a17\\ngpu-a18\\n'\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    slurm = dict(SLURM_JOB_ID="1234", SLURM_JOB_NODELIST="gpu-a[17-18]", SLURM_JOB_NUM_NODES="2",
                 SLURM_CPUS_PER_TASK="16", PATH=f"{bin_dir}:{ENV['PATH']}")  # fmt: skip
    r = subprocess.run([str(SCRIPT), "grpo.py", "--task_knobs", "steps=2, high=99", "--dist_timeout", "60"],
                       env={**ENV, **slurm}, cwd=ROOT, capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr
    args = r.stdout.splitlines()  # srun's arguments, one a line
    for a in ["--nodes=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--cpus-per-task=16", "torchrun",
              "--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu-a17:21234", "--rdzv-id=1234",
              "--max-restarts=3", "grpo.py", "--dist_timeout=600", "steps=2, high=99"]:  # fmt: skip
        assert a in args, (a, args)
    assert args[-2:] == ["--dist_timeout", "60"]  # the user's flag comes last, so it wins over DIST_TIMEOUT


def test_script_is_clean_bash():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(SCRIPT)], env=ENV, cwd=ROOT, capture_output=True, text=True)  # no script: usage, exit 2
    assert r.returncode == 2 and "sbatch run_multinode.sh" in r.stderr
    r = subprocess.run([str(SCRIPT), "grpo.py"], env={**ENV, "NNODES": "2"}, cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2 and "NODE_RANK" in r.stderr  # plain mode with several nodes needs NODE_RANK/MASTER_ADDR
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (apt-get install shellcheck)")
    r = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_environment_is_never_evaluated(tmp_path):
    """Bash arithmetic evaluates what it reads: each number from the environment is checked as plain decimal first.
    A bad value is one `error:` line (exit 2, before torchrun starts) and the injected command never runs."""
    pwn = tmp_path / "pwned"
    inject = f"PATH[$(touch {pwn})]"
    cases = [  # (environment, its error line)
        ({"NNODES": inject}, f"NNODES='{inject}' must be an integer >= 1"),
        ({"NNODES": "0"}, "NNODES='0' must be an integer >= 1"),
        ({"NNODES": "08"}, "NNODES='08' must be an integer >= 1"),  # (bash would read it as octal, and fail)
        ({"NNODES": "2", "NODE_RANK": inject, "MASTER_ADDR": "h"}, f"NODE_RANK='{inject}' must be an integer from 0 "
                                                                   "to 1"),
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "NODE_RANK='2' must be an integer from 0 to 1"),
        ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999' must be an integer from 1 to 65535"),
        ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS='-1' must be an integer >= 0"),
        ({"RDZV_TIMEOUT": inject}, f"RDZV_TIMEOUT='{inject}' must be an integer >= 1"),
        ({"NPROC_PER_NODE": "abc"}, "NPROC_PER_NODE='abc' must be an integer >= 1"),
        ({"DIST_TIMEOUT": "1e"}, "DIST_TIMEOUT='1e' must be a number of seconds"),
        ({"SLURM_JOB_ID": inject, "SLURM_JOB_NODELIST": "h"}, f"SLURM_JOB_ID='{inject}' must be an integer >= 0"),
        ({"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "h", "SLURM_JOB_NUM_NODES": inject},
         f"NNODES='{inject}' must be an integer >= 1"),
    ]
    for env, want in cases:
        r = subprocess.run([str(SCRIPT), "grpo.py"], env={**ENV, **env}, cwd=ROOT, capture_output=True, text=True)
        assert (r.returncode, r.stderr) == (2, f"run_multinode.sh: error: {want}\n"), env
        assert not pwn.exists(), env


def test_a_hung_job_fails_with_each_process_stack(tmp_path):
    # run_job (conftest), which the torchrun tests use: a parent waiting on a child stuck in a named function,
    # past the timeout, fails the test with the child's Python stack, not only "timed out", and kills the child
    pid_file = tmp_path / "child.pid"
    child = (f"import os, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
             "def stuck_in_here():\n    time.sleep(120)\nstuck_in_here()")
    parent = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {child!r}])"
    with pytest.raises(pytest.fail.Exception) as e:
        run_job([sys.executable, "-c", parent], 3)
    assert "did not end in 3s" in str(e.value) and "in stuck_in_here" in str(e.value), str(e.value)
    stat = Path(f"/proc/{pid_file.read_text()}/stat")
    for _ in range(50):  # SIGKILLed: gone, or a zombie until init reaps it
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the stuck child {pid_file.read_text()} is still running")
