"""
Shared plumbing for minigrpo's scripts (sft.py, grpo.py, eval.py), in one flat file:
distributed setup from torchrun's env vars, config dataclass -> command-line flags, seeding,
JSONL metrics, DDP / FSDP2 wrapping, metric all-reduce, the LR schedule and run-directory checkpoints.

Run directory layout (one per training run):
    run/config.json      resolved config of the run
    run/metrics.jsonl    one JSON object per step (samples.jsonl: a few completions per step, grpo.py)
    run/step_000200/     complete checkpoint: an HF model dir (config.json, model.safetensors, tokenizer files)
                         + train_state.pt (full optimizer state, step, data position, ...) + rng_rank{r}.pt (one per
                         rank) + run_config.json (the config that wrote it; --resume compares against it)
    run/latest           name of the newest complete checkpoint, written last

Checkpoints hold *full* (unsharded) state gathered on rank 0, not torch.distributed.checkpoint's sharded format:
any world size and any of none/ddp/fsdp loads them, and a checkpoint is one plain directory that only rank 0 writes.
The price is that rank 0 holds the whole optimizer state (2x the fp32 parameters) in CPU memory while saving: fine
for the <= 1B-parameter models minigrpo trains; beyond that, DCP's sharded save is the next step.
"""

import argparse
import dataclasses
import importlib.util
import inspect
import io
import json
import os
import random
import re
import shutil
import socket
import sys
import traceback
import types
import typing
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as tdist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

# -----------------------------------------------------------------------------
# distributed setup


@dataclass
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_dist(timeout_s: float = 600, device: str | None = None) -> Dist:
    """Join the torchrun process group if launched by torchrun (RANK/LOCAL_RANK/WORLD_SIZE set), else run as one
    process. nccl + cuda:LOCAL_RANK when CUDA is available (and device isn't forced to "cpu"), else gloo + cpu.
    timeout_s (the scripts' --dist_timeout) bounds every collective: a rank that stops answering makes the others
    fail after it (gloo raises in the waiting call; NCCL's watchdog aborts the process) instead of hanging the run."""
    use_cuda = torch.cuda.is_available() and device != "cpu"
    if "RANK" not in os.environ:  # plain `python script.py`
        return Dist(device=torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu"))
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    dev = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if rank == 0 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0 and \
            os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        # torchrun keeps one store for all restarts, and the restarted group can read the dead group's addresses
        # and hang in init_process_group (pytorch/pytorch#135712; seen on torch 2.13 + gloo)
        print(f"warning: torchrun --max-restarts={os.environ['TORCHELASTIC_MAX_RESTARTS']} with torchrun's shared "
              "TCP store: a restarted group can hang at start; launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 "
              "(run_multinode.sh sets it)", file=sys.stderr, flush=True)  # fmt: skip
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s),
                                 device_id=dev if use_cuda else None)
        _explain_collective_timeouts(rank, timeout_s)
    # one line per rank: which host and node hold which rank (GROUP_RANK is torchrun's node index)
    print(f"[dist] rank {rank}/{world} local_rank {local_rank} node {os.environ.get('GROUP_RANK', '?')} on "
          f"{socket.gethostname()}: {tdist.get_backend()}, {dev}, collective timeout {timeout_s:g}s",
          file=sys.stderr, flush=True)  # fmt: skip
    return Dist(rank, local_rank, world, dev)


def _explain_collective_timeouts(rank: int, timeout_s: float):
    """After the usual traceback of a timed-out collective, say which one and what it means. (gloo in torch 2.13 only
    says "Timed out waiting 600000ms for recv operation to complete"; NCCL's watchdog names the op itself.)"""
    previous, torch_dir = sys.excepthook, os.path.dirname(torch.__file__)

    def hook(kind, err, tb):
        previous(kind, err, tb)  # torch's hook: the traceback, each line prefixed "[rankN]:"
        frames = traceback.extract_tb(tb)
        c10d = [f.name for f in frames if f.filename.endswith("distributed_c10d.py")]
        in_backward = any(f.name == "backward" for f in frames)
        if "timed out" not in str(err).lower() or not (c10d or in_backward):
            return
        what = c10d[0] if c10d else "the gradient all-reduce / reduce-scatter of backward()"  # [0]: the one called
        ours = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames
                if not f.filename.startswith(torch_dir)][-2:]  # fmt: skip
        print(f"[rank{rank}]: {what} (at {' <- '.join(reversed(ours))}) did not complete within --dist_timeout="
              f"{timeout_s:g}s: another rank stopped answering (hung, stopped, crashed or out of memory); its own log "
              "shows where. TORCH_DISTRIBUTED_DEBUG=DETAIL also names that rank.", file=sys.stderr, flush=True)

    sys.excepthook = hook


def cleanup_dist():
    if tdist.is_initialized():
        tdist.barrier()  # every rank done with the group (rank 0 may still be writing): a lone destroy can abort gloo
        tdist.destroy_process_group()


def is_dist() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def barrier():
    if is_dist():
        tdist.barrier()


def print0(*args, **kwargs):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*args, **kwargs, flush=True)


def _comm_device() -> torch.device:
    # nccl only moves CUDA tensors; gloo moves CPU ones
    if tdist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


_OPS = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX, "min": tdist.ReduceOp.MIN}


def all_reduce_sum(x, dist: "Dist | None" = None, op: str = "sum"):
    """Reduce over ranks a python number, a list of numbers (one collective for all) or a tensor; returns the same
    kind. op: "sum" | "max" | "min". A no-op in a single process. (`dist` is accepted for readability; the default
    process group is used.)"""
    if not is_dist():
        return x
    if torch.is_tensor(x):
        out = x.detach().to(_comm_device(), copy=True)
        tdist.all_reduce(out, op=_OPS[op])
        return out.to(x.device)
    t = torch.tensor(x, dtype=torch.float64, device=_comm_device())
    tdist.all_reduce(t, op=_OPS[op])
    return t.tolist()


def all_reduce_named(values: dict, ops: dict | None = None) -> dict:
    """Reduce named numbers over ranks: values {name: python number}, ops {name: "sum" | "max" | "min"} (a name not
    in ops is summed). One collective per distinct op, each over the names in values' order, so every rank must pass
    the same names. A no-op in a single process (the values come back as given)."""
    if not is_dist():
        return dict(values)
    ops, out = ops or {}, dict(values)
    for op in sorted({ops.get(k, "sum") for k in values}):
        names = [k for k in values if ops.get(k, "sum") == op]
        t = torch.tensor([float(values[k]) for k in names], dtype=torch.float64, device=_comm_device())
        tdist.all_reduce(t, op=_OPS[op])
        out.update(zip(names, t.tolist()))
    return out


def peak_mem_mb(device) -> float:
    """Peak memory of this process so far, in MiB: allocated CUDA memory on a CUDA device (the caching allocator's
    high-water mark), else the peak resident set size (Linux reports KiB)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def all_reduce_mean(x, dist: "Dist | None" = None):
    world = tdist.get_world_size() if is_dist() else 1
    out = all_reduce_sum(x)
    return [v / world for v in out] if isinstance(out, list) else out / world


def all_gather_list(items: list) -> list:
    """Concatenate every rank's python list, in rank order (same result on every rank)."""
    if not is_dist():
        return list(items)
    parts = [None] * tdist.get_world_size()
    tdist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


# -----------------------------------------------------------------------------
# config dataclass -> argparse flags


def _parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if s.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def _flag_type(tp):
    """argparse `type` for a dataclass field type: int, float, str, bool, X | None, tuple[X, ...] (comma list)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):  # Optional[X]: "none" -> None
        inner = _flag_type(next(a for a in args if a is not type(None)))
        return lambda s: None if s.lower() in ("none", "null", "") else inner(s)
    if origin in (tuple, list):
        inner = _flag_type(args[0])
        return lambda s: origin(inner(v) for v in s.split(",") if v.strip())
    return _parse_bool if tp is bool else tp


def parse_config(cls, argv: list[str] | None = None):
    """Build an argparse parser from a @dataclass (help from field metadata["help"], optional metadata["choices"])
    and return an instance. Flags are the field names: --lr 3e-4, --bf16 true|false (or bare --bf16),
    --pass_k 1,8 for tuple fields, --init none for Optional fields."""
    doc = "" if (cls.__doc__ or "").startswith(cls.__name__ + "(") else cls.__doc__  # not dataclass's signature
    parser = argparse.ArgumentParser(description=(doc or "").strip(),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints, sections, groups = typing.get_type_hints(cls), _sections(cls), {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = dict(type=_flag_type(tp), default=default, help=f.metadata.get("help", " ").replace("%", "%%"),
                  choices=f.metadata.get("choices"))
        if tp is bool:
            kw.update(nargs="?", const=True, metavar="true|false")
        title = sections.get(f.name)
        if title and title not in groups:
            groups[title] = parser.add_argument_group(title)
        group = groups[title] if title else parser
        group.add_argument(f"--{f.name}", **kw)
    return cls(**vars(parser.parse_args(argv)))


def _sections(cls) -> dict[str, str]:
    """field name -> the `# title` comment line above it in the dataclass body: the section of --help it goes in."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):  # no source (e.g. a class made in a REPL): one flat list of flags
        return {}
    names, title, out = {f.name for f in dataclasses.fields(cls)}, None, {}
    for line in lines:  # titles are comment lines at the fields' indentation, pragmas aside
        if (m := re.match(r"    #\s*(.+?)\s*$", line)) and not re.match(r"(fmt|noqa|type|ruff|pragma)\b", m.group(1)):
            title = m.group(1)
        elif (m := re.match(r"    (\w+)\s*:", line)) and m.group(1) in names and title:
            out[m.group(1)] = title
    return out


def save_json(path, obj):
    """Write JSON atomically (tmp file + rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    os.replace(tmp, path)


# -----------------------------------------------------------------------------
# seeding and logging


def seed_all(seed: int, rank: int = 0):
    """Seed python, numpy and torch global RNGs from (seed, rank). Code that must be reproducible across world
    sizes draws from explicit generators (make_generator) instead."""
    s = seed + 1000 * rank
    random.seed(s)
    np.random.seed(s % 2**32)
    torch.manual_seed(s)


def derive_seed(seed: int, *ints: int) -> int:
    """A 63-bit seed mixing (seed, *ints), e.g. (seed, step, rank); nearby inputs give unrelated streams."""
    return int(np.random.SeedSequence([seed, *ints]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def make_generator(seed: int, *ints: int, device="cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(derive_seed(seed, *ints))
    return g


class JsonlLogger:
    """Appends one JSON object per line, flushed each time (so `tail -f` works and a crash loses nothing).
    Optionally mirrors each row's numbers to Weights & Biases (wandb_project) and/or TensorBoard (tensorboard_dir),
    keyed by row["step"]; both packages are optional and only imported when asked for."""

    def __init__(self, path, enabled: bool = True, append: bool = True, *, wandb_project: str = "",
                 tensorboard_dir=None, config: dict | None = None, start_step: int = 0):
        # a missing package fails on every rank alike (not only on the logging rank, which would hang the others)
        for package, wanted in (("wandb", wandb_project), ("tensorboard", tensorboard_dir)):
            if wanted and importlib.util.find_spec(package) is None:
                raise SystemExit(f"error: --{package} needs the {package} package: pip install {package}")
        self.f = self.wandb = self.tb = None
        if not enabled:
            return
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "a" if append else "w")
        if wandb_project:
            import wandb

            # OUT/wandb_run_id: "<id> <last logged step>". A resumed run continues the same W&B run; one that rewound
            # behind steps W&B already has (a restart from an older checkpoint) gets a new W&B run, since W&B drops
            # any step lower than one it has seen
            run_dir = Path(path).parent
            self.wandb_file = run_dir / "wandb_run_id"
            run_id, last = (self.wandb_file.read_text().split() + ["0"])[:2] if self.wandb_file.is_file() else ("", 0)
            if not run_id or int(last) > start_step:
                run_id = wandb.util.generate_id()
            self.wandb = wandb.init(project=wandb_project, name=run_dir.name, id=run_id, resume="allow",
                                    dir=str(run_dir), config=config)
            self.wandb_id = run_id
            self.wandb_file.write_text(f"{run_id} {start_step}\n")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step: on resume, TensorBoard hides the events of steps after the checkpoint written before
            self.tb = SummaryWriter(log_dir=str(tensorboard_dir), flush_secs=10,
                                    purge_step=start_step + 1 if start_step else None)

    def write(self, row: dict):
        if self.f is None:
            return
        row = {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
        self.f.write(json.dumps(row) + "\n")
        self.f.flush()
        nums = {k: v for k, v in row.items() if isinstance(v, int | float) and not isinstance(v, bool) and k != "step"}
        if self.wandb is not None:
            self.wandb.log(nums, step=row.get("step"))
            self.wandb_file.write_text(f"{self.wandb_id} {row.get('step', 0)}\n")
        if self.tb is not None:
            for k, v in nums.items():
                self.tb.add_scalar(k, v, global_step=row.get("step"))

    def close(self):
        if self.f is not None:
            self.f.close()
            self.f = None
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None


# -----------------------------------------------------------------------------
# model wrapping and LR schedule


def wrap_model(model: torch.nn.Module, mode: str, dist: Dist) -> torch.nn.Module:
    """mode "none" | "ddp" | "fsdp". FSDP2 shards each block in model.layers, then the root (torchtitan style);
    on CUDA params compute in bf16 with fp32 gradient reduction, on CPU everything stays fp32.
    Single process without torchrun: returned unwrapped (nothing to synchronise)."""
    if mode == "none" or not is_dist():
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[dist.local_rank] if dist.device.type == "cuda" else None)
    if mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy()  # fp32
        if dist.device.type == "cuda":
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    raise ValueError(f"--dist must be none, ddp or fsdp, got {mode!r}")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The underlying Transformer (DDP keeps it in .module; FSDP2 shards in place, so it is the model itself)."""
    return getattr(model, "module", model)


def lr_at(step: int, warmup: int, total: int, peak: float, min_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine decay from peak to peak * min_ratio at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    # a python float, not np.float64: param_groups keep it, and checkpoints load with weights_only=True
    return float(peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + np.cos(np.pi * progress))))


# -----------------------------------------------------------------------------
# checkpoints and resume

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # gathered on rank 0, others get {}


def _fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"python": random.getstate(), "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()),
                                                   *np_state[2:]), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict):
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _gather_to_main(blob: bytes) -> list[bytes] | None:
    """Every rank's bytes, in rank order, on rank 0 (None elsewhere)."""
    if not is_dist():
        return [blob]
    out = [None] * tdist.get_world_size() if tdist.get_rank() == 0 else None
    tdist.gather_object(blob, out, dst=0)
    return out


def _fault(point: str, step: int):
    """Test hook, off unless the environment sets it: MINIGRPO_FAULT=after_tmp_write[@STEP] makes save_checkpoint
    exit abruptly (os._exit, no cleanup, as under kill -9) once the checkpoint's files are written but not yet
    published, so tests can check that a crash mid-save leaves the previous checkpoint the one a restart loads."""
    want = os.environ.get("MINIGRPO_FAULT", "")
    name, _, at = want.partition("@")
    if name == point and (not at or int(at) == step):
        print(f"MINIGRPO_FAULT={want}: exiting inside save_checkpoint of step {step}", file=sys.stderr, flush=True)
        os._exit(86)


def save_checkpoint(run_dir, step: int, model, tokenizer, extra_state: dict | None, dist: Dist, *, optimizer=None,
                    rank_state: dict | None = None, keep: int = 3, config: dict | None = None) -> Path:
    """Write run_dir/step_{step:06d}/ atomically; every rank must call it (FSDP gathers the weights).
    extra_state: dict shared by all ranks (data position, ...), saved in train_state.pt with `step`.
    optimizer: gathered to a full state dict keyed by parameter name (correct for DDP and FSDP, loadable at any
    world size; prefer it to putting opt.state_dict() in extra_state, which under FSDP would hold one shard).
    rank_state: this rank's own dict (e.g. generator states), saved beside its global RNG states in rng_rank{r}.pt.
    config: the run's resolved config, saved as run_config.json (what --resume checks a new run against).
    Everything is gathered onto rank 0, which alone writes (no shared filesystem needed for saving): a temporary dir,
    fsynced, renamed into place; `latest` is updated last; then all but the newest `keep` checkpoints are deleted.
    A crash at any instant leaves the previous checkpoint loadable."""
    import model as model_lib

    run_dir = Path(run_dir)
    name = f"step_{step:06d}"
    final, tmp = run_dir / name, run_dir / f".tmp_{name}"
    # collectives first (every rank): the full optimizer state and every rank's RNG states, gathered onto rank 0
    optim_sd = get_optimizer_state_dict(model, optimizer, options=_FULL) if optimizer is not None else None
    # (serialized here: gather_object's own pickling of tensors fails in torch 2.13; rank 0 writes the bytes as is)
    buf = io.BytesIO()
    torch.save({"rng": _rng_state(), **(rank_state or {})}, buf)
    rank_states = _gather_to_main(buf.getvalue())
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    model_lib.save_model(model, tmp, tokenizer)  # every rank: FSDP gathers each tensor; rank 0 writes
    if dist.is_main:
        for r, blob in enumerate(rank_states):
            (tmp / f"rng_rank{r}.pt").write_bytes(blob)
        if config is not None:
            (tmp / "run_config.json").write_text(json.dumps(config, indent=2, default=str) + "\n")
        torch.save({"step": step, "world_size": dist.world_size, "optimizer": optim_sd, **(extra_state or {})},
                   tmp / "train_state.pt")
        _fault("after_tmp_write", step)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        old = run_dir / f".old_{name}"
        if final.exists():  # re-saving the same step: move the old copy aside, then delete it
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(run_dir)
        _write_latest(run_dir, name)
        shutil.rmtree(old, ignore_errors=True)
        for stale in sorted(run_dir.glob("step_*"))[:-keep] if keep > 0 else []:
            if stale.name != name:
                _remove_dir(stale)
    barrier()
    return final


def _write_latest(run_dir: Path, name: str):
    """The pointer: tmp file + fsync + rename, so it always names a complete checkpoint."""
    with open(run_dir / "latest.tmp", "w") as fh:
        fh.write(name + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(run_dir / "latest.tmp", run_dir / "latest")
    _fsync_dir(run_dir)


def _remove_dir(path: Path):
    """Rename, then delete: a crash midway leaves a .del_* dir, never a step_* dir with files missing."""
    doomed = path.with_name(f".del_{path.name}")
    path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def publish_model(ckpt_dir, dst):
    """Rank 0: make dst a plain HF model dir holding the checkpoint's model files (hard links when possible, so no
    extra disk), replaced atomically (tmp dir + rename)."""
    ckpt_dir, dst = Path(ckpt_dir), Path(dst)
    tmp = dst.with_name(f".tmp_{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in ckpt_dir.iterdir():
        # train_state.pt / rng_rank*.pt / run_config.json are training state, not the model
        if f.is_file() and f.suffix != ".pt" and f.name != "run_config.json":
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copy2(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)


def find_latest(run_dir) -> Path | None:
    """Newest complete checkpoint of a run dir: the one `latest` names, else the highest complete step_* dir."""
    run_dir = Path(run_dir)
    pointer = run_dir / "latest"
    if pointer.is_file():
        ckpt = run_dir / pointer.read_text().strip()
        if (ckpt / "train_state.pt").is_file():
            return ckpt
    done = [d for d in sorted(run_dir.glob("step_*")) if (d / "train_state.pt").is_file()]
    return done[-1] if done else None


def resolve_model_dir(path) -> Path:
    """An HF model dir as given, or a run dir's newest checkpoint (so `--model runs/sft` works)."""
    path = Path(path)
    if not (path / "config.json").is_file() or (path / "latest").is_file():
        ckpt = find_latest(path)
        if ckpt is not None:
            return ckpt
    return path


def load_checkpoint(ckpt_dir, model, dist: Dist, *, optimizer=None) -> tuple[dict, dict]:
    """Load weights (+ optimizer state) into the (possibly wrapped) model and restore this rank's RNG states.
    Returns (train_state, rank_state). Loading never unpickles code (safetensors + weights_only=True).
    A rank the checkpoint has no RNG file for (it was saved by fewer ranks) keeps its seeded RNG states."""
    import model as model_lib

    ckpt_dir = Path(ckpt_dir)
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_lib.load_model(ckpt_dir).state_dict(), options=full)
    # map_location: a checkpoint is CPU tensors whatever device wrote it; set_*_state_dict copies them where they go
    train_state = torch.load(ckpt_dir / "train_state.pt", map_location="cpu", weights_only=True)
    if optimizer is not None and train_state.get("optimizer") is not None:
        set_optimizer_state_dict(model, optimizer, train_state["optimizer"], options=full)
    rank_state = {}
    rng_file = ckpt_dir / f"rng_rank{dist.rank}.pt"
    if rng_file.is_file():
        rank_state = torch.load(rng_file, map_location="cpu", weights_only=True)
        _set_rng_state(rank_state.pop("rng"))
    return train_state, rank_state


def _has_run(out: Path) -> bool:
    metrics = out / "metrics.jsonl"
    return (out / "latest").exists() or any(out.glob("step_*")) or (metrics.is_file() and metrics.stat().st_size > 0)


def _same(a, b) -> bool:
    if isinstance(a, str) and isinstance(b, str) and ("/" in a or "/" in b):  # paths: runs/x/ == runs/x
        return os.path.normpath(a) == os.path.normpath(b)
    return a == b or (isinstance(a, list) and tuple(a) == b)  # JSON turns tuples into lists


def resume_point(cfg, dist: Dist, must_match: tuple[str, ...]) -> Path | None:
    """The checkpoint this run continues from, per cfg.resume; checked before anything is loaded or written.
      auto (default): the newest complete checkpoint in cfg.out_dir; None (start fresh) when there is none.
      none: None; refuses an out_dir that already holds a run (checkpoints or metrics) unless cfg.overwrite.
      PATH: that checkpoint dir, or the newest checkpoint of that run dir.
    cfg.overwrite means: start over, deleting the run in out_dir (so it goes with auto or none, not a PATH).
    A checkpoint written by a run whose config differs in a `must_match` field (model, data, batch shape: what
    makes continuing it meaningless) is refused with every difference listed; other changes are printed."""
    out = Path(cfg.out_dir)
    if cfg.overwrite and cfg.resume not in ("auto", "none"):
        raise SystemExit(f"error: --overwrite starts over in --out_dir {out}; it cannot go with --resume {cfg.resume}")
    if cfg.resume == "none" or cfg.overwrite:
        if _has_run(out) and not cfg.overwrite:
            raise SystemExit(f"error: --out_dir {out} already holds a run (checkpoints or metrics.jsonl): continue it "
                             "with --resume auto, or delete it and start over with --overwrite")
        return None
    if cfg.resume == "auto":
        ckpt = find_latest(out) if out.is_dir() else None
        if ckpt is None:
            if _has_run(out):  # killed before its first checkpoint: nothing to continue from
                print0(f"{out}: no complete checkpoint to resume from; starting from step 0")
            return None
    else:
        path = Path(cfg.resume)
        if not path.is_dir():
            raise SystemExit(f"error: --resume {path}: no such checkpoint or run directory")
        ckpt = path if (path / "train_state.pt").is_file() else find_latest(path)
        if ckpt is None:
            raise SystemExit(f"error: --resume {path}: not a complete checkpoint (no train_state.pt) nor a run "
                             "directory holding one")
    saved_file = ckpt / "run_config.json" if (ckpt / "run_config.json").is_file() else ckpt.parent / "config.json"
    try:
        saved = json.loads(saved_file.read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot resume {ckpt}: its run config {saved_file} is unreadable ({e})") from None
    now = dataclasses.asdict(cfg)
    changed = [k for k in now if k in saved and not _same(saved[k], now[k]) and k not in ("resume", "overwrite")]
    diffs = [f"--{k} {saved[k]} -> {now[k]}" for k in changed if k in must_match]
    if diffs:
        raise SystemExit(f"error: cannot resume {ckpt}: this run differs from the one that wrote it in "
                         f"{'; '.join(diffs)}. Use the old values, or start a new run (another --out_dir, or "
                         "--overwrite)")
    if changed:
        print0(f"resuming with changed flags: {', '.join(f'--{k} {saved[k]} -> {now[k]}' for k in changed)}")
    return ckpt


def truncate_jsonl(path, step: int):
    """Keep the rows of a per-step JSONL log with row["step"] <= step, byte for byte, and drop a torn last line
    (a crash mid-write), so a resumed run's log reads as one uninterrupted run. Atomic (tmp file + rename)."""
    path = Path(path)
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            keep.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(keep))
    os.replace(tmp, path)


def start_or_resume(ckpt: Path | None, cfg, model, optimizer, dist: Dist,
                    logs: tuple[str, ...] = ("metrics.jsonl", "samples.jsonl")) -> dict:
    """Load the checkpoint resume_point chose (weights, optimizer, this rank's RNG states) or start fresh, then
    ready cfg.out_dir (rank 0): delete the old run (--overwrite) and leftovers of interrupted saves, cut the logs back
    to the resumed step, drop checkpoints newer than it (an abandoned future), write config.json.
    Returns the train state: {"step": 0} when fresh, else what save_checkpoint stored (step, data position, ...)."""
    out = Path(cfg.out_dir)
    state = {"step": 0}
    if ckpt is not None:
        try:
            state, _ = load_checkpoint(ckpt, model, dist, optimizer=optimizer)
        except (OSError, ValueError, RuntimeError, EOFError) as e:
            raise SystemExit(f"error: cannot load checkpoint {ckpt}: {' '.join(str(e).split())}") from None
        saved_world = state.get("world_size", dist.world_size)
        print0(f"resuming from {ckpt} at step {state['step']}"
               + (f" (saved by {saved_world} rank(s), now {dist.world_size}: the continuation matches an "
                  "uninterrupted run only to rounding)" if saved_world != dist.world_size else ""))  # fmt: skip
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        doomed = [*out.glob(".tmp_*"), *out.glob(".old_*"), *out.glob(".del_*")]  # interrupted saves / deletes
        if cfg.overwrite:
            if _has_run(out):
                print0(f"--overwrite: deleting the previous run in {out}")
            doomed += [*out.glob("step_*"), out / "model", out / "tb", out / "wandb"]
            for f in ("latest", "config.json", "wandb_run_id", *logs):
                (out / f).unlink(missing_ok=True)
        newer = [d for d in out.glob("step_*") if d.name > f"step_{state['step']:06d}" and d not in doomed]
        if newer:
            print0(f"dropping checkpoints after step {state['step']}: {', '.join(sorted(d.name for d in newer))}")
        for d in doomed + newer:
            shutil.rmtree(d, ignore_errors=True)
        if ckpt is not None and ckpt.parent.resolve() == out.resolve():
            _write_latest(out, ckpt.name)  # after a rewind (--resume PATH) it named a dropped checkpoint
        for f in logs:
            truncate_jsonl(out / f, state["step"])
        save_json(out / "config.json", dataclasses.asdict(cfg))
    barrier()
    return state


def any_rank(flag: bool, dist: Dist) -> bool:
    """True on every rank when it is true on any: a stop decision every rank must take at the same step."""
    return bool(all_reduce_sum([float(flag)], dist, op="max")[0])


def stays_stopped(state: dict, max_minutes: float) -> bool:
    """Whether a resumed run that had stopped early stays stopped: one that met its criterion (--stop_pass1) does;
    one that ran out of --max_minutes goes on when given more time (a larger --max_minutes, or 0 = no limit)."""
    reason = state.get("stopped")
    if reason == "time" and (max_minutes <= 0 or state.get("t_train", 0.0) < max_minutes * 60):
        return False
    if reason:
        print0(f"the run stopped early at step {state['step']} ({'--max_minutes' if reason == 'time' else reason}): "
               "nothing left to train (a larger --max_minutes continues a timed-out run; --overwrite starts over)")
    return bool(reason)


def check_finite(step: int, grad_norm, out_dir) -> None:
    """Stop the run at a non-finite loss/gradient, before the optimizer step writes NaN into the weights: nothing of
    this step is saved, and the newest checkpoint stays the one a restart continues from. (grad_norm is the global
    norm, the same on every rank, so every rank stops together.)"""
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a DTensor
    if torch.isfinite(grad_norm):
        return
    ckpt = find_latest(out_dir)
    where = f"the newest checkpoint, {ckpt}, is intact" if ckpt else "no checkpoint was written"
    raise SystemExit(f"error: step {step}: the loss or its gradient is not finite (grad norm {grad_norm.item()}); "
                     f"stopped before the update, nothing of this step was saved and {where}. Lower --lr (or check "
                     "the data) and restart")


@contextmanager
def user_input(what: str):
    """Bad input a user gave (a missing path, a model dir without weights, a truncated safetensors file, a malformed
    data row) becomes one line, `error: WHAT: reason`, and exit status 1, not a traceback from inside a library. The
    loaders (model.py, data.py) raise ValueError / OSError / RuntimeError with messages naming the file and row."""
    try:
        yield
    except (OSError, ValueError, RuntimeError) as e:
        raise SystemExit(f"error: {what}: {' '.join(str(e).split())}") from None  # one line, even if e spans several
