"""
The run directory's lifecycle: which checkpoint a run continues from, loading it, saving new ones atomically,
pruning old ones, cutting the logs back on resume and publishing the final model. The only module that knows
a checkpoint's file names and state keys.

    ckpt = resume_point(cfg, d, must_match)                # before anything is loaded or written
    state = start_or_resume(ckpt, cfg, model, opt, d)      # {"step": 0} fresh, else the saved progress
    ...
    save_checkpoint(cfg.out_dir, step, model, tok, {"train_s": t}, d, optimizer=opt, config=asdict(cfg))
    publish_model(find_latest(cfg.out_dir), out / "model")  # rank 0: a plain HF model dir

One run directory:
    run/minigrpo_run.json    the marker: "this is a run of STAGE" (written when the run is created)
    run/.lock_node{k}        node k's lock while a run holds the directory (fcntl.flock; the OS drops it when the
                             process dies, so a crashed run never blocks the next)
    run/config.json          resolved config of the run
    run/metrics.jsonl        one JSON object per step (samples.jsonl: a few completions per step, grpo.py)
    run/step_000200/         a complete checkpoint:
        config.json, model*.safetensors, tokenizer files   the weights as an HF model dir (eval.py, transformers)
        train_state/         model + optimizer state in torch.distributed.checkpoint's (DCP) format, one file per rank
        rng_rank{r}.pt       rank r's RNG states (python, numpy, torch, cuda) + its own extras, one file per rank
        progress.json        step, world size, data position, clock, ...: written last, the mark of a complete one
        run_config.json      the config that wrote it (what --resume compares a new run against)
    run/latest               name of the newest complete checkpoint, written last
    run/model/               at the end: copies of the last checkpoint's model files (publish_model; LoRA: the merged
                             model, and run/adapter/), minigrpo_files.json naming them: a later publish replaces only
                             those, and a run refuses to start while anything else is there

Sharded: under FSDP2 each rank writes and reads only its own shard of the weights and the optimizer state
(under DDP the replicated tensors are split among the ranks for writing); no rank ever builds the full state. DCP
reshards on load, so a checkpoint written by N ranks loads on M ranks under none, DDP or FSDP2. The HF weights are a
second copy, for eval.py / transformers / --init: gathered one tensor at a time, written by rank 0 in files of at
most 2 GiB (hf.save_model). Only tensors go into train_state/: optimizer hyperparameters come from the flags of
the resumed run (the LR from its schedule), and DCP's pickled metadata file is read through an allowlist.

Atomic: everything is written into run/.tmp_step_N/, fsynced, renamed to run/step_N/, and `latest` is updated last;
a crash at any instant leaves the previous checkpoint the newest complete one. Several nodes need the run directory
on a shared filesystem (each rank writes its own files into it). DCP does not promise to read checkpoints written
by another torch version: resume with the torch that wrote them (the HF weights load anywhere).

Safe: a stage only ever deletes or rewrites a directory that is one of its own runs (check_out_dir: its marker, and
nothing else, says so), never the --init model; every check runs before anything is written, and the writes happen
under the lock (start_or_resume).
"""

import dataclasses
import errno
import fcntl
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import socket
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from safetensors import SafetensorError
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from common import (
    Dist,
    all_gather_list,
    barrier,
    check_packages,
    is_dist,
    print0,
    save_json,
    unwrap_model,
    user_input,
)
from hf import save_model
from lora import lora_layers, save_adapter

# the names a checkpoint dir holds besides the HF model files
TRAIN_STATE = "train_state"  # DCP dir: {"model": weights, "optimizer": AdamW moments and step counts}
PROGRESS = "progress.json"  # step, world_size + the script's own progress (data position, clock, ...)
RUN_CONFIG = "run_config.json"
RNG = "rng_rank{}.pt"
MARKER = "minigrpo_run.json"  # in a run dir: {"stage": "sft" | "grpo" | "eval", "created": ..., "by": ...}
STEP_NAME = re.compile(r"step_\d{6,}")  # what `latest` may hold: a checkpoint's name in the same dir
TRAINING_FILES = (TRAIN_STATE, PROGRESS, RUN_CONFIG)  # (+ rng_rank*.pt): not part of the HF model dir
# what a resumed run must share with the run that wrote its checkpoint, in every stage (the start model, the data,
# the seed, the stored weights' dtype, the LoRA adapters): resume_point refuses a checkpoint that differs in these or
# in the stage's own `must_match` (e.g. its batch shape); other flags (lr, steps, loss, dist, world size, the compute
# --dtype, ...) may change. The --init weights are also compared by content (run_record's init_sha256)
RESUME_MUST_MATCH = ("init", "task", "split", "data_path", "data_seed", "task_knobs", "template", "seed",
                     "weights_dtype", "lora_rank", "lora_alpha", "lora_targets", "lora_base_dtype",
                     "question_field", "answer_field", "answer_regex", "solution_field", "system_prompt")

# DCP warns on every save/load in a plain `python script.py` run that it assumes one process: it is right
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# -----------------------------------------------------------------------------
# finding checkpoints


def find_latest(run_dir) -> Path | None:
    """Newest complete checkpoint of a run dir: the one `latest` names, else the highest complete step_* dir. A
    checkpoint whose re-save was cut between its two renames counts as its .old_step_* copy (start_or_resume renames
    it back). Raises ValueError for a `latest` that is not a checkpoint name of this dir (e.g. "../x")."""
    run_dir = Path(run_dir)
    name = _read_latest(run_dir)
    if name is not None:
        ckpt = _complete_copy(run_dir, name)
        if ckpt is not None:
            return ckpt
    names = {p.name for p in _checkpoints(run_dir)} | {p.name[5:] for p in _restorable(run_dir)}
    done = [c for c in (_complete_copy(run_dir, n) for n in sorted(names, key=_step_of)) if c is not None]
    return done[-1] if done else None


def _checkpoints(run_dir: Path, prefix: str = "") -> list[Path]:
    """The checkpoints minigrpo wrote in run_dir, oldest first: dirs named step_N exactly as save_checkpoint names
    them, holding a progress.json. Nothing else is pruned, dropped or resumed from, nor takes a --keep slot (a user's
    step_000002_backup/ or step_notes/). prefix ".tmp_", ".old_", ".del_": the dirs of an interrupted save or delete,
    .{prefix}step_N, complete or not."""
    found = [p for p in run_dir.glob(f"{prefix}step_*") if _is_step_name(p.name[len(prefix):])
             and p.is_dir() and not p.is_symlink() and (prefix or is_checkpoint(p))]  # fmt: skip
    return sorted(found, key=lambda p: _step_of(p.name[len(prefix):]))


def _is_step_name(name: str) -> bool:
    return bool(STEP_NAME.fullmatch(name)) and name == f"step_{_step_of(name):06d}"  # not step_0000001


def _step_of(name: str) -> int:
    return int(name.removeprefix("step_"))


def _read_latest(run_dir: Path) -> str | None:
    pointer = run_dir / "latest"
    if not pointer.is_file():
        return None
    with open(pointer, "rb") as f:
        raw = f.read(200)
    try:
        name = raw.decode("utf-8").strip() if len(raw) <= 64 else None
    except UnicodeDecodeError:
        name = None
    if name is None or not STEP_NAME.fullmatch(name):  # confined: a plain step_N name, never a path
        shown = repr(raw[:40]) + ("..." if len(raw) > 40 else "")
        raise ValueError(f"{pointer} holds {shown}, not a checkpoint name like step_000200: fix it or delete it "
                         "(the newest complete step_* dir is then used)")
    return name


def _complete_copy(run_dir: Path, name: str) -> Path | None:
    """run_dir/name if it is a complete checkpoint, else its complete .old_ copy when name itself is missing."""
    if is_checkpoint(run_dir / name):
        return run_dir / name
    old = run_dir / f".old_{name}"
    return old if not (run_dir / name).exists() and is_checkpoint(old) else None


def _restorable(run_dir: Path) -> list[Path]:
    """Complete .old_step_N copies whose step_N is missing: a re-save of step N cut between its two renames."""
    return [p for p in _checkpoints(run_dir, ".old_") if is_checkpoint(p) and not (run_dir / p.name[5:]).exists()]


def is_checkpoint(path) -> bool:
    return (Path(path) / PROGRESS).is_file()


def resolve_model_dir(path) -> Path:
    """An HF model dir as given, or a run dir's newest checkpoint (so `--model runs/sft` works)."""
    path = Path(path)
    if not (path / "config.json").is_file() or (path / "latest").is_file():
        ckpt = find_latest(path) if path.is_dir() else None
        if ckpt is not None:
            return ckpt
    return path


# -----------------------------------------------------------------------------
# save


def save_checkpoint(run_dir, step: int, model, tokenizer, extra_state: dict | None, d: Dist, *, optimizer=None,
                    rank_state: dict | None = None, keep: int = 3, config: dict | None = None) -> Path:
    """Write run_dir/step_{step:06d}/ atomically; every rank must call it (each writes its shard).
    extra_state: the run's progress shared by all ranks (data position, clock, ...), JSON-able; saved with `step`.
    rank_state: this rank's own tensors/numbers (e.g. generator states), saved beside its RNG states.
    config: the run's resolved config (what --resume checks a new run against).
    Then all but the newest `keep` checkpoints are deleted."""
    run_dir = Path(run_dir)
    name = f"step_{step:06d}"
    final, tmp = run_dir / name, run_dir / f".tmp_{name}"
    if d.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        with _writing(final):
            tmp.mkdir(parents=True)
    barrier()
    # every rank: its RNG file, its shard of the training state, its part in gathering the HF weights
    with _writing(final):
        _write_fsynced(tmp / RNG.format(d.rank), lambda f: torch.save({"rng": _rng_state(), **(rank_state or {})}, f))
        state, _ = _train_state(model, optimizer)
        dcp.save(state, checkpoint_id=tmp / TRAIN_STATE, no_dist=not is_dist())
        if lora_layers(model):  # LoRA: only what trains, the adapter (PEFT format); the base stays where it is
            save_adapter(model, tmp, tokenizer)
        else:
            save_model(model, tmp, tokenizer)  # rank 0 writes, one file (<= 2 GiB) at a time
    barrier()  # every rank's files are written and fsynced
    if d.is_main:
        with _writing(final):
            _finish_checkpoint(tmp, final, step, d, extra_state, config, keep)
    barrier()
    return final


@contextmanager
def _writing(final: Path, what: str = "checkpoint "):
    """A checkpoint (or OUT/model) that cannot be written (a full disk, a read-only or vanished filesystem) stops the
    run with one error line; the newest complete checkpoint stays the one the same command continues from."""
    try:
        yield
    except (OSError, SafetensorError, dcp.CheckpointException) as e:
        try:
            latest = find_latest(final.parent)
        except ValueError:
            latest = None
        raise SystemExit(f"error: cannot write {what}{final}: {_one_line(e)}; the newest complete checkpoint is "
                         f"{latest or 'none'}: free space (or fix the filesystem), then run the same command again "
                         "to continue from it") from None


def _finish_checkpoint(tmp: Path, final: Path, step: int, d: Dist, extra_state, config, keep: int):
    """Rank 0: the run config and progress.json (last: the mark of a complete checkpoint), the renames, `latest`,
    the pruning."""
    run_dir, name = final.parent, final.name
    if config is not None:
        _write_fsynced(tmp / RUN_CONFIG, lambda f: f.write(_json(config)))
    progress = {"step": step, "world_size": d.world_size, **(extra_state or {})}
    _write_fsynced(tmp / PROGRESS, lambda f: f.write(_json(progress)))
    _fault("after_tmp_write", step)
    for path in (tmp / TRAIN_STATE, tmp):
        _fsync(path)
    old = run_dir / f".old_{name}"
    if final.exists():  # re-saving the same step: move the old copy aside, then delete it
        final.rename(old)
    tmp.rename(final)
    _fsync(run_dir)
    _write_latest(run_dir, name)
    shutil.rmtree(old, ignore_errors=True)
    for stale in _checkpoints(run_dir)[:-keep] if keep > 0 else []:
        if stale.name != name:
            _remove_dir(stale)


def _train_state(model, optimizer) -> tuple[dict, dict | None]:
    """What train_state/ holds, {"model": weights, "optimizer": per-parameter state}, keyed by parameter name (DDP's
    "module." stripped; a tied lm_head.weight left out) and as this rank holds them: DTensor shards under FSDP2,
    whole tensors otherwise; tensors only (an optimizer's param_groups, its hyperparameters, are not saved). Also
    returns the optimizer's full state dict, whose "state" is the same tensors. Loading reads into these tensors."""
    # frozen weights (the base of a LoRA model) are not training state: they come from --init again
    state, optim_sd = {"model": get_model_state_dict(model, options=_TRAINABLE)}, None
    if unwrap_model(model).config.tie_word_embeddings:  # one tensor under two names: keep one
        state["model"].pop("lm_head.weight", None)
    if optimizer is not None:
        optim_sd = get_optimizer_state_dict(model, optimizer)  # a fresh optimizer gets zero moments first
        state["optimizer"] = optim_sd["state"]
    return state, optim_sd


# the trainable tensors only; loading them leaves the frozen ones as they are (DCP itself fails on a missing one)
_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)


def _write_fsynced(path: Path, write):
    with open(path, "wb" if path.suffix == ".pt" else "w") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _json(obj) -> str:
    return json.dumps(obj, indent=2, default=str) + "\n"


def _fsync(path: Path):  # a file or a directory
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_latest(run_dir: Path, name: str):
    """The pointer: tmp file + fsync + rename, so it always names a complete checkpoint."""
    _write_fsynced(run_dir / "latest.tmp", lambda f: f.write(name + "\n"))
    os.replace(run_dir / "latest.tmp", run_dir / "latest")
    _fsync(run_dir)


def _remove_dir(path: Path):
    """Rename, then delete: a crash midway leaves a .del_* dir, never a step_* dir with files missing."""
    doomed = path.with_name(f".del_{path.name}")
    path.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _fault(point: str, step: int):
    """Test hook, off unless the environment sets it: MINIGRPO_FAULT=after_tmp_write[@STEP] makes save_checkpoint
    exit abruptly (os._exit, no cleanup, as under kill -9) once the checkpoint's files are written but not yet
    published, so tests can check that a crash mid-save leaves the previous checkpoint the one a restart loads."""
    want = os.environ.get("MINIGRPO_FAULT", "")
    name, _, at = want.partition("@")
    if name == point and (not at or int(at) == step):
        print(f"MINIGRPO_FAULT={want}: exiting inside save_checkpoint of step {step}", file=sys.stderr, flush=True)
        os._exit(86)


def publish_model(ckpt_dir, dst, d: Dist):
    """Every rank: rank 0 makes dst a plain HF model dir holding copies of the checkpoint's model files (copies, not
    hard links: editing OUT/model/tokenizer_config.json must not edit the checkpoint), replaced atomically (tmp dir +
    rename); refused, every rank stopping, when dst holds what minigrpo did not write (_check_published)."""
    ckpt_dir, dst = Path(ckpt_dir), Path(dst)
    _check_published(dst, d)
    if d.is_main:
        tmp = dst.with_name(f".tmp_{dst.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        with _writing(dst, ""):
            tmp.mkdir(parents=True)
            for f in ckpt_dir.iterdir():
                if not f.is_file() or f.name in TRAINING_FILES or f.name.startswith("rng_rank"):
                    continue  # training state, not the model
                shutil.copy2(f, tmp / f.name)
                _fsync(tmp / f.name)
            _swap_in(tmp, dst)
    barrier()


def export_lora(model, tokenizer, out_dir, d: Dist):
    """Every rank (FSDP2 gathers): a LoRA run's result as OUT/model, the merged HF model dir (transformers, eval.py,
    --init), and OUT/adapter, the adapter alone in PEFT's format; each written to a tmp dir, then renamed."""
    for name in ("model", "adapter"):
        _check_published(Path(out_dir) / name, d)
    for name, save in (("model", save_model), ("adapter", save_adapter)):
        dst = Path(out_dir) / name
        tmp = dst.with_name(f".tmp_{name}")
        if d.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        with _writing(dst, ""):
            save(model, tmp, tokenizer)
            if d.is_main:
                _swap_in(tmp, dst)
    barrier()


# what a published dir (OUT/model, OUT/adapter) records: the names minigrpo wrote into it, all a later publish replaces
PUBLISHED = "minigrpo_files.json"


def _swap_in(tmp: Path, dst: Path):
    """Rank 0: record tmp's file names in it, then replace dst (checked: only minigrpo's files) with it."""
    _write_fsynced(tmp / PUBLISHED, lambda f: f.write(_json(sorted(p.name for p in tmp.iterdir()))))
    _fsync(tmp)
    if _foreign(dst):  # (a file that appeared since the check at the start of the run: keep it)
        raise SystemExit(_foreign_error(dst))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    _fsync(dst.parent)


def _foreign(dst: Path) -> list[str]:
    """What in a published dir minigrpo did not write there: every name its PUBLISHED record does not list (a dir
    published before the record existed: every name its run's newest checkpoint does not hold). [] if dst is missing;
    ["."] if it is not a plain directory."""
    if not dst.exists() and not dst.is_symlink():
        return []
    if dst.is_symlink() or not dst.is_dir():
        return ["."]
    try:
        with open(dst / PUBLISHED, "rb") as f:
            ours = json.loads(f.read(1 << 20))
        ours = {n for n in ours if isinstance(n, str)} if isinstance(ours, list) else set()
    except (OSError, ValueError, RecursionError):
        try:
            ckpt = find_latest(dst.parent)
        except ValueError:
            ckpt = None
        ours = {p.name for p in ckpt.iterdir()} if ckpt is not None else set()
    ours.add(PUBLISHED)
    return sorted(p.name + "/" * p.is_dir() for p in dst.iterdir() if p.name not in ours or not p.is_file())


def _foreign_error(dst: Path) -> str:
    found = _foreign(dst)
    shown = "it is not a plain directory" if found == ["."] else f"it holds {', '.join(found[:5])}" + (
        f" and {len(found) - 5} more" if len(found) > 5 else "")
    return (f"error: {dst} holds files minigrpo did not write there ({shown}): a run replaces {dst} at its end; "
            f"move them out of {dst.name}/ (or pick another --out_dir)")


def _check_published(dst: Path, d: Dist):
    """Every rank: stop (rank 0 says why) when dst holds what minigrpo did not write, before anything is replaced."""
    msgs = all_gather_list([_foreign_error(dst)] if d.is_main and _foreign(dst) else [])
    if msgs:
        raise SystemExit(msgs[0] if d.is_main else 1)


# -----------------------------------------------------------------------------
# load


def load_checkpoint(ckpt_dir, model, d: Dist, *, optimizer=None) -> tuple[dict, dict]:
    """Load weights (+ optimizer state) into the (possibly wrapped) model, each rank reading its own shard, and
    restore this rank's RNG states. Returns (progress, rank_state). A rank the checkpoint has no RNG file for (it
    was saved by fewer ranks) keeps its seeded RNG states. Nothing is unpickled beyond an allowlist of DCP's own
    metadata classes (tensors load with weights_only=True)."""
    ckpt_dir = Path(ckpt_dir)
    progress = _read_progress(ckpt_dir)
    state, optim_sd = _train_state(model, optimizer)
    _Reader(ckpt_dir / TRAIN_STATE).read_metadata()  # first: a bad file is one line, not DCP's logged tracebacks
    dcp.load(state, storage_reader=_Reader(ckpt_dir / TRAIN_STATE), planner=_TensorsOnly(), no_dist=not is_dist())
    if unwrap_model(model).config.tie_word_embeddings and "embed_tokens.weight" in state["model"]:
        state["model"]["lm_head.weight"] = state["model"]["embed_tokens.weight"]
    set_model_state_dict(model, state["model"], options=_TRAINABLE)
    if optimizer is not None:  # the loaded moments with the current hyperparameters
        set_optimizer_state_dict(model, optimizer, optim_sd)
    rank_state = {}
    rng_file = ckpt_dir / RNG.format(d.rank)
    if not rng_file.is_file() and d.rank < progress.get("world_size", 1):
        raise ValueError(f"{rng_file}: missing, though rank {d.rank} wrote the checkpoint: the run would not continue "
                         "as it would have")
    if rng_file.is_file():
        try:
            rank_state = torch.load(rng_file, map_location="cpu", weights_only=True)  # CPU tensors, whoever wrote it
        except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:  # garbage, or a pickle of code
            refused = re.search(r"WeightsUnpickler error:\s*([^\n]+)", str(e))
            why = f"the weights-only unpickler refused it: {refused.group(1)}" if refused else "not a torch.save file"
            raise ValueError(f"{rng_file}: unreadable ({why}); was it written by minigrpo?") from None
        rng = rank_state.pop("rng", None) if isinstance(rank_state, dict) else None
        if not isinstance(rng, dict) or not {"python", "numpy", "torch"} <= rng.keys():
            raise ValueError(f"{rng_file}: no RNG states (python, numpy, torch) in it; not written by minigrpo")
        _set_rng_state(rng)
    return progress, rank_state


def _read_progress(ckpt: Path) -> dict:
    """A checkpoint's progress.json, checked (types and ranges of what the scripts read back, the step its dir is
    named for), or a ValueError naming the file."""
    path = ckpt / PROGRESS
    try:
        with open(path, "rb") as f:
            progress = json.loads(f.read(1 << 20))  # ~200 bytes; past a MiB it is cut, so not valid JSON
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(progress, dict):
        raise ValueError(f"{path}: expected an object {{\"step\": N, ...}}, got {json.dumps(progress)[:80]}")
    name = ckpt.name.removeprefix(".old_")
    for key, ok, need in _PROGRESS_FIELDS:
        if key in progress or key == "step":
            value = progress.get(key)
            if not ok(value) or (key == "step" and _is_step_name(name) and value != _step_of(name)):
                need = f"{_step_of(name)}, the step of {name}" if key == "step" and ok(value) else need
                raise ValueError(f"{path}: {key}={json.dumps(value)[:40]}: expected {need}; was it written by "
                                 "minigrpo?")
    return progress


_int = lambda v, low, high: isinstance(v, int) and not isinstance(v, bool) and low <= v <= high
_num = lambda v: isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < float("inf")
# progress.json's fields that the scripts read back: (name, check, what it needs)
_PROGRESS_FIELDS = [("step", lambda v: _int(v, 0, 10**12), "an integer 0 .. 10^12"),
                    ("world_size", lambda v: _int(v, 1, 2**20), "an integer 1 .. 2^20"),
                    ("data_position", lambda v: _int(v, 0, 10**15), "an integer >= 0"),
                    *((k, _num, "a finite number >= 0") for k in ("train_s", "wall_s", "t_train", "elapsed_s")),
                    ("stopped", lambda v: v is False or isinstance(v, str), "false or a reason"),
                    ("eval_history", lambda v: isinstance(v, list) and all(map(_num, v)), "a list of numbers")]


# what DCP's pickled .metadata file may name: its own dataclasses, shapes, dtypes, layouts and paths. Not
# BytesStorageMetadata: DCP reads a "bytes" entry with torch.load(weights_only=False), i.e. it runs any pickle, and
# minigrpo saves only tensors.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "TensorProperties",
                                              "ChunkStorageMetadata", "MetadataIndex", "StorageMeta",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"} | {n for n in dir(torch) if isinstance(getattr(torch, n), torch.dtype)},
    "pathlib": {"PosixPath", "WindowsPath", "Path"},
}


class _AllowlistUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if name not in _METADATA_CLASSES.get(module, ()):
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")
        return super().find_class(module, name)


class _Reader(dcp.FileSystemReader):
    """DCP's file reader, reading the .metadata pickle through the allowlist above: tensors only, each stored in a
    file of this directory."""

    def read_metadata(self, *args, **kwargs):
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _AllowlistUnpickler(f).load()
        except OSError:
            raise
        except Exception as e:  # garbage: whatever the unpickler makes of it
            raise ValueError(f"{path}: not DCP metadata ({type(e).__name__}: {_one_line(e)})") from None
        _check_metadata(path, metadata)
        metadata.storage_meta = metadata.storage_meta or dcp.metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _check_metadata(path: Path, metadata) -> None:
    if not isinstance(metadata, dcp.metadata.Metadata):
        raise ValueError(f"{path}: not DCP metadata ({type(metadata).__name__})")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(entry, dcp.metadata.TensorStorageMetadata):
            raise ValueError(f"{path}: {key!r} is not a tensor; minigrpo saves only tensors")
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise ValueError(f"{path}: storage file {name!r} is not a file name in this directory")


class _TensorsOnly(dcp.DefaultLoadPlanner):
    """DCP's load planner, refusing what is not a tensor (its load_bytes unpickles with weights_only=False)."""

    def load_bytes(self, read_item, value):
        raise ValueError(f"{read_item.dest_index.fqn} is stored as bytes, not a tensor; minigrpo saves only tensors")


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



# -----------------------------------------------------------------------------
# the run directory: is it a run (and whose), its lock


STAGES = ("sft", "grpo", "eval")


def run_stage(path) -> str | None:
    """The stage whose run a directory holds, as its marker (minigrpo_run.json) says; None if it has no marker
    (whatever else it holds: a config.json with a stage's flags is no proof) or one minigrpo did not write."""
    try:
        with open(Path(path) / MARKER, "rb") as f:
            obj = json.loads(f.read(4096))  # a marker is ~100 bytes: a longer file is cut, so not valid JSON
    except (OSError, ValueError, RecursionError):
        return None
    stage = obj.get("stage") if isinstance(obj, dict) else None
    return stage if stage in STAGES else None


def check_out_dir(out, stage: str, init=None, what: str = "--out_dir"):
    """Read only. Refuse an out_dir a run of `stage` must not write into: an existing non-empty directory that is not
    such a run (a model dir, another stage's run, anything else), one that is, holds or is inside the --init model,
    or (sft, grpo) one whose model/ or adapter/, which the run replaces at its end, holds files it did not write;
    or a path no run can write into (a symlink loop, a dangling symlink, a path under a file, a read-only dir)."""
    out = Path(out)
    _check_writable(out, what)
    if init is not None and Path(init).exists():
        init_dir = Path(init).resolve()
        if init_dir == out.resolve() or out.resolve() in init_dir.parents:
            raise SystemExit(f"error: {what} {out} is or holds the --init model {init}: this run would overwrite or "
                             f"prune it; pick another {what}")
        if init_dir in out.resolve().parents:
            raise SystemExit(f"error: {what} {out} is inside the --init model {init}: whatever rewrites {init} (its "
                             f"own stage run again) would delete this run; pick a {what} outside it")
    if not out.exists():
        return
    if not out.is_dir():
        raise SystemExit(f"error: {what} {out} is a file, not a directory: pick another {what}")
    found = run_stage(out)
    if found == stage and stage != "eval":
        for sub in ("model", "adapter"):
            if _foreign(out / sub):
                raise SystemExit(_foreign_error(out / sub) + "; nothing was changed")
    if found == stage or not any(f for f in out.iterdir() if not f.name.startswith(".lock_node")):
        return
    what_it_is = f"a run of {found}.py" if found else f"not a minigrpo run (no valid {MARKER})"
    raise SystemExit(f"error: {what} {out} exists and is {what_it_is}: {stage}.py writes only into a new or empty "
                     f"directory or one of its own runs; nothing was changed. Pick another {what}")


def _check_writable(out: Path, what: str):
    try:
        real = out.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise SystemExit(f"error: {what} {out}: {_one_line(e)}: pick another {what}") from None
    if out.is_symlink() and not out.exists():
        raise SystemExit(f"error: {what} {out} is a symlink to {os.readlink(out)}, which does not exist: create it, "
                         f"or pick another {what}")
    above = next(p for p in (real, *real.parents) if p.exists())  # the dir it is made in (or itself)
    if above != real and not above.is_dir():
        raise SystemExit(f"error: {what} {out} is under {above}, a file, not a directory: pick another {what}")
    if above.is_dir() and not os.access(above, os.W_OK | os.X_OK):
        raise SystemExit(f"error: {what} {out}: {above} is not writable by this user: pick another {what}")


def mark_run_dir(out, stage: str):
    """Create the run dir (if needed) and its marker: from now on check_out_dir knows it as a `stage` run."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).is_file():
        save_json(out / MARKER, {"stage": stage, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                 "by": f"pid {os.getpid()} on host {socket.gethostname()}"})


_HELD: dict[str, int] = {}  # run dir -> the open file descriptor of this process's lock on it


def lock_run_dir(out) -> str | None:
    """Take this node's exclusive lock on the run dir (fcntl.flock on out/.lock_node{k}, k = torchrun's GROUP_RANK):
    the node's leader calls it. Returns None when held, else the one-line error naming the holder. The OS releases
    the lock when the process dies, however it dies. Idempotent within a process. (One file per node: on a shared
    filesystem whose flock is coherent across hosts, NFS or GPFS, the nodes of one run must not contend; a second
    run is caught by its node 0.)"""
    out = Path(out)
    key = str(out.resolve())
    if key in _HELD:
        return None
    path = out / f".lock_node{int(os.environ.get('GROUP_RANK', 0))}"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.read(fd, 200).decode("utf-8", "replace").strip() or "a process that is starting"
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                return (f"error: --out_dir {out} is in use by another run ({holder}; lock {path.name}): wait for it "
                        "to end, or stop it (a run that dies releases the lock), or pick another --out_dir")
            print(f"warning: cannot lock {path} ({e}): this filesystem has no flock, so nothing stops a second run "
                  "on the same --out_dir", file=sys.stderr, flush=True)  # fmt: skip
            return None
        if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
            break  # (else a releasing run unlinked the file between our open and flock: take the new one)
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode())
    _HELD[key] = fd
    return None


def release_run_dir(out):
    """Drop this process's lock on the run dir (the end of a run; a dying process drops it anyway)."""
    fd = _HELD.pop(str(Path(out).resolve()), None)
    if fd is not None:
        (Path(out) / f".lock_node{int(os.environ.get('GROUP_RANK', 0))}").unlink(missing_ok=True)
        os.close(fd)


def _take_run_dir(out: Path, d: Dist):
    """Every node's leader locks the run dir; if any cannot, every rank stops (global rank 0 says why)."""
    msg = lock_run_dir(out) if int(os.environ.get("LOCAL_RANK", 0)) == 0 else None
    msgs = all_gather_list([msg] if msg else [])
    if msgs:
        raise SystemExit(msgs[0] if d.is_main else 1)


def claim_run_dir(out, stage: str, d: Dist):
    """Every rank, once every check has passed (eval.py; start_or_resume does the same for sft / grpo): take the run
    dir's lock (each node's leader; the dir is made if needed), check it again under the lock (another stage's run
    may have claimed it since check_out_dir), mark it. A refusal leaves the directory as it was."""
    out = Path(out)
    created = not out.exists()
    barrier()  # every rank has seen whether out existed
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        out.mkdir(parents=True, exist_ok=True)
    try:
        _take_run_dir(out, d)
        msgs = all_gather_list([msg] if d.is_main and (msg := _recheck(out, stage)) else [])
        if msgs:
            raise SystemExit(msgs[0] if d.is_main else 1)
    except SystemExit:
        _let_go(out, created)
        raise
    if d.is_main:
        mark_run_dir(out, stage)
    barrier()


def _recheck(out: Path, stage: str, init=None) -> str | None:
    """Under the lock: check_out_dir's error line, if the dir is no longer one this stage may write into."""
    try:
        check_out_dir(out, stage, init)
    except SystemExit as e:
        return str(e.code)
    return None


def _let_go(out: Path, created: bool):
    """A run that stops before writing anything: no lock file, and no dir if it made it."""
    release_run_dir(out)
    only_locks = out.is_dir() and all(f.name.startswith(".lock_node") for f in out.iterdir())
    if created and only_locks and int(os.environ.get("LOCAL_RANK", 0)) == 0:
        shutil.rmtree(out, ignore_errors=True)


def _stage(cfg) -> str:
    return type(cfg).__name__.removesuffix("Config").lower()  # SFTConfig -> "sft", GRPOConfig -> "grpo"


# -----------------------------------------------------------------------------
# resume: which checkpoint, then load it and ready the run directory


def _has_run(out: Path) -> bool:
    metrics = out / "metrics.jsonl"
    return (out / "latest").exists() or bool(_checkpoints(out)) or (metrics.is_file() and metrics.stat().st_size > 0)


def run_record(cfg, d: Dist) -> dict:
    """What a run's config.json and its checkpoints' run_config.json hold: the resolved flags, and init_sha256, the
    content hash of the --init weights (weights_sha256; computed once, by rank 0), so that a resume can tell a
    changed base model or KL reference from the one the run started from, not only a changed path."""
    sha = None
    if getattr(cfg, "init", None) and d.is_main:
        with user_input("--init"):
            sha = weights_sha256(resolve_model_dir(cfg.init))
    return {**dataclasses.asdict(cfg), "init_sha256": all_gather_list([sha] if d.is_main else [])[0]}


def weights_sha256(model_dir) -> str:
    """sha256 over a model dir's *.safetensors files, each file's name and bytes in name order."""
    h = hashlib.sha256()
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        h.update(path.name.encode() + b"\0")
        with open(path, "rb") as f:
            while chunk := f.read(1 << 23):
                h.update(chunk)
    return h.hexdigest()


def _same(a, b) -> bool:
    if isinstance(a, str) and isinstance(b, str) and ("/" in a or "/" in b):  # paths: runs/x/ == runs/x
        return os.path.normpath(a) == os.path.normpath(b)
    return a == b or (isinstance(a, list) and tuple(a) == b)  # JSON turns tuples into lists


def resume_point(cfg, d: Dist, must_match: tuple[str, ...], record: dict | None = None) -> Path | None:
    """The checkpoint this run continues from, per cfg.resume; checked, with the out dir (check_out_dir) and the
    logger packages, before anything is loaded or written.
      auto (default): the newest complete checkpoint in cfg.out_dir; None (start fresh) when there is none.
      none: None; refuses an out_dir that already holds a run (checkpoints or metrics) unless cfg.overwrite.
      PATH: that checkpoint dir, or the newest checkpoint of that run dir.
    cfg.overwrite means: start over, deleting the run in out_dir (so it goes with auto or none, not a PATH).
    A checkpoint written by a run whose config differs in a RESUME_MUST_MATCH field or one of the stage's
    `must_match` (model, data, batch shape: what makes continuing it meaningless) is refused with every difference
    listed, as is one whose --init weights hashed otherwise (record: run_record's, with the hash); other changes are
    printed."""
    out = Path(cfg.out_dir)
    check_out_dir(out, _stage(cfg), getattr(cfg, "init", None))
    check_packages(cfg)  # --wandb / --tensorboard: before --overwrite deletes anything
    if cfg.overwrite and cfg.resume not in ("auto", "none"):
        raise SystemExit(f"error: --overwrite starts over in --out_dir {out}; it cannot go with --resume {cfg.resume}")
    if cfg.resume == "none" or cfg.overwrite:
        if _has_run(out) and not cfg.overwrite:
            raise SystemExit(f"error: --out_dir {out} already holds a run (checkpoints or metrics.jsonl): continue it "
                             "with --resume auto, or delete it and start over with --overwrite")
        return None
    if cfg.resume == "auto":
        with user_input("--out_dir"):  # a `latest` that is not a checkpoint name
            ckpt = find_latest(out) if out.is_dir() else None
        if ckpt is None:
            if _has_run(out):  # killed before its first checkpoint: nothing to continue from
                print0(f"{out}: no complete checkpoint to resume from; starting from step 0")
            return None
    else:
        path = Path(cfg.resume)
        if not path.is_dir():
            raise SystemExit(f"error: --resume {path}: no such checkpoint or run directory")
        with user_input("--resume"):
            ckpt = path if is_checkpoint(path) else find_latest(path)
        if ckpt is None:
            raise SystemExit(f"error: --resume {path}: not a complete checkpoint (no {PROGRESS}) nor a run "
                             "directory holding one")
    _check_complete(ckpt, d)
    saved_file = ckpt / RUN_CONFIG if (ckpt / RUN_CONFIG).is_file() else ckpt.parent / "config.json"
    try:
        with open(saved_file, "rb") as f:
            saved = json.loads(f.read(1 << 20))  # a few KB; past a MiB it is cut, so not valid JSON
        if not isinstance(saved, dict):
            raise ValueError(f"a {type(saved).__name__}, not an object of flags")
    except (OSError, ValueError, RecursionError) as e:
        why = "nested too deeply" if isinstance(e, RecursionError) else _one_line(e)
        raise SystemExit(f"error: cannot resume {ckpt}: its run config {saved_file} is unreadable ({why})") from None
    now = record or dataclasses.asdict(cfg)
    was, sha = saved.get("init_sha256"), now.get("init_sha256")
    if was and sha and was != sha and _same(saved.get("init"), now["init"]):
        role = "LoRA base" if now.get("lora_rank") else ""
        role = role or (f"KL reference (--beta {now['beta']})" if now.get("beta") else "")
        changes = f"the weights in --init {cfg.init} changed since the run that wrote it started (sha256 {was[:12]}..."
        if not role:  # a full fine-tune with beta 0 uses them only as its start: the checkpoint replaces them
            print0(f"note: {changes} then, {sha[:12]}... now); this run uses them only as its start, which the "
                   "checkpoint replaces")
        else:
            raise SystemExit(f"error: cannot resume {ckpt}: {changes} then, {sha[:12]}... now), and they are its "
                             f"{role}: point --init at the weights the run started from, or start a new run (another "
                             "--out_dir, or --overwrite)")
    fixed = ("resume", "overwrite", "init_sha256")
    changed = [k for k in now if k in saved and not _same(saved[k], now[k]) and k not in fixed]
    diffs = [f"--{k} {saved[k]} -> {now[k]}" for k in changed if k in RESUME_MUST_MATCH + must_match]
    if diffs:
        raise SystemExit(f"error: cannot resume {ckpt}: this run differs from the one that wrote it in "
                         f"{'; '.join(diffs)}. Use the old values, or start a new run (another --out_dir, or "
                         "--overwrite)")
    if changed:
        print0(f"resuming with changed flags: {', '.join(f'--{k} {saved[k]} -> {now[k]}' for k in changed)}")
    return ckpt


def _check_complete(ckpt: Path, d: Dist):
    """Every rank, before anything is loaded or written: the checkpoint's progress.json is sound and each rank it
    was written by that this run has (ranks past the world size of the run that saved it start from their seeds:
    a changed world size continues to rounding anyway) finds its RNG file, without which it would not be bitwise."""
    try:  # wrong types, a step not the checkpoint's (10^30), a world size of 0
        progress = _read_progress(ckpt)
    except (OSError, ValueError) as e:
        raise SystemExit(f"error: cannot resume {ckpt}: {_one_line(e)}") from None
    missing = [RNG.format(r) for r in range(min(progress.get("world_size", 1), d.world_size))
               if not (ckpt / RNG.format(r)).is_file()]  # fmt: skip
    if missing:
        raise SystemExit(f"error: cannot resume {ckpt}: {', '.join(missing)} missing (the random states of the "
                         "rank(s) that wrote it), so the run would not continue as it would have: put the file(s) "
                         "back, or resume from another checkpoint (--resume PATH)")


def truncate_jsonl(path, step: int):
    """Keep the rows of a per-step JSONL log with row["step"] <= step, byte for byte, and drop a torn last line
    (a crash mid-write), so a resumed run's log reads as one uninterrupted run. Atomic (tmp file + rename)."""
    path = Path(path)
    if not path.is_file():
        return
    keep = []
    for line in path.read_bytes().splitlines():
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):  # a torn line, or bytes no run wrote (not UTF-8, a JSON bomb)
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            keep.append(line + b"\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(keep))
    os.replace(tmp, path)


def start_or_resume(ckpt: Path | None, cfg, model, optimizer, d: Dist,
                    logs: tuple[str, ...] = ("metrics.jsonl", "samples.jsonl"), record: dict | None = None) -> dict:
    """Take the run dir's lock (each node's leader), then load the checkpoint resume_point chose (weights, optimizer,
    this rank's RNG states) or start fresh, then ready cfg.out_dir (rank 0): mark it as a run, delete the old run
    (--overwrite: only what a run writes) and leftovers of interrupted saves, cut the logs back to the resumed step,
    drop checkpoints newer than it (an abandoned future), write config.json. A failure before that point (the lock
    is taken, the checkpoint does not load) leaves the directory as it was. The lock is held until release_run_dir.
    Returns the progress: {"step": 0} when fresh, else what save_checkpoint stored (step, data position, ...)."""
    out = Path(cfg.out_dir)
    state, created = {"step": 0}, not out.exists()
    barrier()  # every rank has seen whether out_dir existed
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        out.mkdir(parents=True, exist_ok=True)
    try:
        _take_run_dir(out, d)
        # under the lock, nothing else changes the dir: is it still what resume_point saw, its marker and its
        # checkpoints? (another run may have claimed or written it meanwhile); then put back a checkpoint whose
        # re-save was cut between its two renames
        msg = None
        if d.is_main:
            msg = _recheck(out, _stage(cfg), getattr(cfg, "init", None)) or _changed_since_resume_point(cfg, out, ckpt)
        if not msg and d.is_main:
            for old in _restorable(out):
                old.rename(out / old.name[5:])
        msgs = all_gather_list([msg] if msg else [])
        if msgs:
            raise SystemExit(msgs[0] if d.is_main else 1)
        if ckpt is not None and ckpt.name.startswith(".old_"):
            ckpt = ckpt.with_name(ckpt.name[5:])
        if ckpt is not None:
            try:
                state, _ = load_checkpoint(ckpt, model, d, optimizer=optimizer)
            except (OSError, ValueError, RuntimeError, EOFError, KeyError, TypeError, pickle.UnpicklingError,
                    dcp.CheckpointException) as e:  # fmt: skip
                raise SystemExit(f"error: cannot load checkpoint {ckpt}: {_one_line(e)}") from None
    except SystemExit:  # leave the dir as it was: no lock file, and no dir if this run made it
        _let_go(out, created)
        raise
    if ckpt is not None:
        saved_world = state.get("world_size", d.world_size)
        print0(f"resuming from {ckpt} at step {state['step']}"
               + (f" (saved by {saved_world} rank(s), now {d.world_size}: the continuation matches an "
                  "uninterrupted run only to rounding)" if saved_world != d.world_size else ""))  # fmt: skip
    if d.is_main:
        mark_run_dir(out, _stage(cfg))
        doomed = [path for prefix in (".tmp_", ".old_", ".del_") for path in _checkpoints(out, prefix)]
        doomed += [path for path in (out / ".tmp_model", out / ".tmp_adapter") if path.is_dir()]  # interrupted
        if cfg.overwrite:
            if _has_run(out):
                print0(f"--overwrite: deleting the previous run in {out}")
            doomed += [*_checkpoints(out), out / "model", out / "adapter", out / "tb", out / "wandb"]  # a run's
            for f in ("latest", "config.json", "wandb_run_id", *logs):
                (out / f).unlink(missing_ok=True)
        newer = [path for path in _checkpoints(out) if _step_of(path.name) > state["step"] and path not in doomed]
        if newer:
            print0(f"dropping checkpoints after step {state['step']}: {', '.join(sorted(p.name for p in newer))}")
        for path in doomed + newer:
            shutil.rmtree(path, ignore_errors=True)
        if ckpt is not None and ckpt.parent.resolve() == out.resolve():
            _write_latest(out, ckpt.name)  # after a rewind (--resume PATH) it named a dropped checkpoint
        for f in logs:
            truncate_jsonl(out / f, state["step"])
        save_json(out / "config.json", record or dataclasses.asdict(cfg))
    barrier()
    return state


def _changed_since_resume_point(cfg, out: Path, ckpt: Path | None) -> str | None:
    """Under the lock: the one-line error if out_dir no longer holds what resume_point decided on, else None."""
    try:
        if cfg.overwrite:
            return None
        if cfg.resume == "auto":
            same = (find_latest(out) if out.is_dir() else None) == ckpt
        elif cfg.resume == "none":
            same = not _has_run(out)
        else:
            same = ckpt is not None and (is_checkpoint(ckpt) or is_checkpoint(ckpt.with_name(ckpt.name[5:])))
    except ValueError as e:
        return f"error: {e}"
    return None if same else (f"error: --out_dir {out} changed while this run was starting (another run wrote to "
                              "it meanwhile); nothing was changed: start this run again")


def _one_line(e: BaseException) -> str:
    """DCP wraps a rank's error in a CheckpointException whose text is a traceback: keep its last line."""
    if isinstance(e, dcp.CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]  # rank -> (exception, traceback)
    return " ".join(str(e).split())


def check_finite(step: int, grad_norm, out_dir) -> None:
    """Stop the run at a non-finite loss/gradient, before the optimizer step writes NaN into the weights: nothing of
    this step is saved, and the newest checkpoint stays the one a restart continues from. (grad_norm is the global
    norm, the same on every rank, so every rank stops together.)"""
    if torch.isfinite(grad_norm):
        return
    ckpt = find_latest(out_dir)
    where = f"the newest checkpoint, {ckpt}, is intact" if ckpt else "no checkpoint was written"
    raise SystemExit(f"error: step {step}: the loss or its gradient is not finite (grad norm {grad_norm.item()}); "
                     f"stopped before the update, nothing of this step was saved and {where}. Lower --lr (or check "
                     "the data) and restart")
