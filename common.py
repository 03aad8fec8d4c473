"""
Shared plumbing for minigrpo's scripts (sft.py, grpo.py, eval.py), in one flat file:
distributed setup from torchrun's env vars, config dataclass -> command-line flags, seeding,
JSONL metrics, DDP / FSDP2 wrapping, metric all-reduce, the LR schedule and run-directory checkpoints.

Run directory layout (one per training run):
    run/config.json      resolved config of the run
    run/metrics.jsonl    one JSON object per step
    run/step_000200/     complete checkpoint: an HF model dir (config.json, model.safetensors, tokenizer files)
                         + train_state.pt (optimizer, step, data position, ...) + rng_rank{r}.pt (one per rank)
    run/latest           name of the newest complete checkpoint, written last
"""

import argparse
import dataclasses
import json
import os
import random
import shutil
import types
import typing
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
    process. nccl + cuda:LOCAL_RANK when CUDA is available (and device isn't forced to "cpu"), else gloo + cpu."""
    use_cuda = torch.cuda.is_available() and device != "cpu"
    if "RANK" not in os.environ:  # plain `python script.py`
        return Dist(device=torch.device("cuda" if use_cuda else "cpu"))
    rank, local_rank, world = (int(os.environ[k]) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    dev = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(dev)
    if not tdist.is_initialized():
        tdist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s),
                                 device_id=dev if use_cuda else None)
    return Dist(rank, local_rank, world, dev)


def cleanup_dist():
    if tdist.is_initialized():
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
    parser = argparse.ArgumentParser(description=(cls.__doc__ or "").strip(),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = dict(type=_flag_type(tp), default=default, help=f.metadata.get("help", " "),
                  choices=f.metadata.get("choices"))
        if tp is bool:
            kw.update(nargs="?", const=True, metavar="true|false")
        parser.add_argument(f"--{f.name}", **kw)
    return cls(**vars(parser.parse_args(argv)))


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
    """Appends one JSON object per line, flushed each time (so `tail -f` works and a crash loses nothing)."""

    def __init__(self, path, enabled: bool = True, append: bool = True):
        self.f = None
        if enabled:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.f = open(path, "a" if append else "w")

    def write(self, row: dict):
        if self.f is not None:
            row = {k: (v.item() if hasattr(v, "item") else v) for k, v in row.items()}
            self.f.write(json.dumps(row) + "\n")
            self.f.flush()

    def close(self):
        if self.f is not None:
            self.f.close()


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
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + np.cos(np.pi * progress)))


# -----------------------------------------------------------------------------
# checkpoints

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


def save_checkpoint(run_dir, step: int, model, tokenizer, extra_state: dict | None, dist: Dist, *, optimizer=None,
                    rank_state: dict | None = None, keep: int = 3) -> Path:
    """Write run_dir/step_{step:06d}/ atomically; every rank must call it (FSDP gathers the weights).
    extra_state: dict shared by all ranks (data position, ...), saved by rank 0 in train_state.pt with `step`.
    optimizer: gathered to a full state dict (correct for DDP and FSDP; prefer it to putting opt.state_dict() in
    extra_state, which under FSDP would hold only rank 0's shard).
    rank_state: this rank's own dict (e.g. sampler generator states), saved beside its global RNG states.
    Everything is written into a temporary dir, fsynced, renamed into place; `latest` is updated last; then all but
    the newest `keep` checkpoints are deleted. A crash at any instant leaves the previous checkpoint loadable."""
    import model as model_lib

    run_dir = Path(run_dir)
    name = f"step_{step:06d}"
    final, tmp = run_dir / name, run_dir / f".tmp_{name}"
    # collective first (every rank): the full optimizer state gathered onto rank 0
    optim_sd = get_optimizer_state_dict(model, optimizer, options=_FULL) if optimizer is not None else None
    if dist.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    model_lib.save_model(model, tmp, tokenizer)  # every rank: FSDP gathers each tensor; rank 0 writes
    torch.save({"rng": _rng_state(), **(rank_state or {})}, tmp / f"rng_rank{dist.rank}.pt")
    if dist.is_main:
        torch.save({"step": step, "world_size": dist.world_size, "optimizer": optim_sd, **(extra_state or {})},
                   tmp / "train_state.pt")
    barrier()  # every rank's file is written before rank 0 publishes the directory
    if dist.is_main:
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(tmp)
        old = run_dir / f".old_{name}"
        if final.exists():  # re-saving the same step: move the old copy aside, then delete it
            final.rename(old)
        tmp.rename(final)
        _fsync_dir(run_dir)
        with open(run_dir / "latest.tmp", "w") as fh:  # the pointer: tmp + fsync + rename, last of all
            fh.write(name + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(run_dir / "latest.tmp", run_dir / "latest")
        _fsync_dir(run_dir)
        shutil.rmtree(old, ignore_errors=True)
        for stale in sorted(run_dir.glob("step_*"))[:-keep] if keep > 0 else []:
            if stale.name != name:
                shutil.rmtree(stale, ignore_errors=True)
    barrier()
    return final


def publish_model(ckpt_dir, dst):
    """Rank 0: make dst a plain HF model dir holding the checkpoint's model files (hard links when possible, so no
    extra disk), replaced atomically (tmp dir + rename)."""
    ckpt_dir, dst = Path(ckpt_dir), Path(dst)
    tmp = dst.with_name(f".tmp_{dst.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in ckpt_dir.iterdir():
        if f.is_file() and f.suffix != ".pt":  # train_state.pt / rng_rank*.pt are training state, not the model
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
    Returns (train_state, rank_state). Loading never unpickles code (safetensors + weights_only=True)."""
    import model as model_lib

    ckpt_dir = Path(ckpt_dir)
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_lib.load_model(ckpt_dir).state_dict(), options=full)
    train_state = torch.load(ckpt_dir / "train_state.pt", weights_only=True)
    if optimizer is not None and train_state.get("optimizer") is not None:
        set_optimizer_state_dict(model, optimizer, train_state["optimizer"], options=full)
    rank_state = {}
    rng_file = ckpt_dir / f"rng_rank{dist.rank}.pt"
    if rng_file.is_file():
        rank_state = torch.load(rng_file, weights_only=True)
        _set_rng_state(rank_state.pop("rng"))
    return train_state, rank_state
