"""
Shared plumbing for minigrpo's scripts (sft.py, grpo.py, eval.py), in one flat file:
distributed setup from torchrun's env vars, config dataclass -> command-line flags, seeding,
JSONL metrics, DDP / FSDP2 wrapping, metric all-reduce and the LR schedule.
(The run directory and its checkpoints: checkpoint.py.)
"""

import argparse
import dataclasses
import difflib
import gc
import importlib
import importlib.util
import json
import math
import os
import random
import shutil
import socket
import sys
import time
import traceback
import types
import typing
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as tdist

from lora import base_cast

# -----------------------------------------------------------------------------
# distributed setup


@dataclass
class Dist:
    """This process's place in the torchrun group (the scripts call it `d`; --dist is the parallelism flag)."""
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
        # and hang in init_process_group (pytorch/pytorch#135712)
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
    """After the usual traceback of a timed-out collective, say which one it was and what it means.

    The user need: when one rank of a multi-process run crashes, hangs or is stopped, every other rank fails
    --dist_timeout later in whatever collective it reached next (ours, DDP's forward, backward's reduce-scatter, a
    barrier), and gloo's message, "Timed out waiting ...ms for recv operation to complete", reads as the failure
    itself. The hint names the collective and our line that called it, and says the cause is another rank, whose
    own log shows it. (NCCL's watchdog names the op itself.) Why a sys.excepthook: the timeout can surface from
    any of those places, and the hook sees it whichever raised it; it runs after torch's own hook (the traceback,
    each line prefixed "[rankN]:"), so the hint is the last thing printed, and it changes nothing else."""
    previous, torch_dir = sys.excepthook, os.path.dirname(torch.__file__) + os.sep  # not torchvision/, torchao/

    def hook(kind, err, tb):
        previous(kind, err, tb)  # torch's hook: the traceback, each line prefixed "[rankN]:"
        frames, msg = traceback.extract_tb(tb), str(err)
        dist = [f for f in frames if f.filename.startswith(torch_dir)
                and any(k in f.filename[len(torch_dir):] for k in ("distributed", "parallel"))]  # fmt: skip
        timeout = "timed out" in msg.lower() and (dist or "operation to complete" in msg)
        if not timeout:  # gloo says "Timed out waiting Nms for send/recv operation to complete", wherever it is
            return
        c10d = [f.name for f in dist if f.filename.endswith("distributed_c10d.py")]
        if c10d:  # the collective our code called
            what = c10d[0]
        elif any(f.name == "backward" for f in frames):
            what = "the gradient all-reduce / reduce-scatter of backward()"
        elif dist:  # inside DDP / FSDP itself, e.g. DDP's first-steps bucket rebuild in forward()
            what = f"a collective in {os.path.basename(dist[-1].filename)}:{dist[-1].name}"
        else:
            what = "a collective"
        ours = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames
                if not f.filename.startswith(torch_dir)][-2:]  # fmt: skip
        print(f"[rank{rank}]: {what} (at {' <- '.join(reversed(ours))}) did not complete within --dist_timeout="
              f"{timeout_s:g}s: another rank stopped answering (hung, stopped, crashed or out of memory); its own log "
              "shows where. TORCH_DISTRIBUTED_DEBUG=DETAIL also names that rank.", file=sys.stderr, flush=True)

    sys.excepthook = hook


_ended_group = []  # the default group after cleanup_dist, until free_main_objects lets it go


def cleanup_dist():
    if tdist.is_initialized():
        tdist.barrier()  # every rank done with the group (rank 0 may still be writing): a lone destroy can abort gloo
        _ended_group.append(tdist.group.WORLD)  # see free_main_objects
        tdist.destroy_process_group()


def free_main_objects():
    """Call after a script's main() returns: frees its objects while the interpreter is still whole. DDP / FSDP
    modules hold the gloo group in reference cycles; left to interpreter shutdown, gloo's threads can abort a
    finished run (SIGABRT, "terminate called without an active exception").
    The group itself goes last, from our own reference: its destructor waits for gloo's worker threads, and one of
    them may still be freeing the tensors of a finished collective, which takes the GIL. Dropped by DDP's reducer
    (which holds the GIL while it dies), it hung a finished run about once in 25 on 2 busy cores; the group's own
    Python object lets the GIL go first."""
    gc.collect()
    _ended_group.clear()


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


def reset_peak_mem(device):
    """Start a new peak for peak_mem_mb: at each step's start, so a step's mem_peak_mb is that step's own (not the
    loading transients' or an earlier step's). CUDA only: on the CPU the peak stays the process's so far."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_mem_mb(device) -> float:
    """Peak memory in MiB: on a CUDA device allocated memory since the last reset_peak_mem (the caching
    allocator's high-water mark), else the process's peak resident set size so far (Linux reports KiB)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def all_gather_list(items: list) -> list:
    """Concatenate every rank's python list, in rank order (same result on every rank)."""
    if not is_dist():
        return list(items)
    parts = [None] * tdist.get_world_size()
    tdist.all_gather_object(parts, items)
    return [x for part in parts for x in part]


# -----------------------------------------------------------------------------
# config dataclass -> argparse flags


def flag(default, help: str, choices: list | None = None, section: str | None = None, repeat: bool = False):
    """A config field that parse_config turns into --NAME: its default, its --help line, optional choices, and the
    section of --help it is listed in (sections appear in the order of their first field; None: no section).
    repeat (tuple fields): --NAME may be given several times, each adding to the list."""
    meta = {"help": help, "choices": choices, "section": section, "repeat": repeat}
    return dataclasses.field(default=default, metadata=meta)


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


class _Repeated(argparse.Action):
    """A repeatable comma-list flag: its first use on the command line replaces the default (or the --config
    file's value), later uses add to it."""

    def __call__(self, parser, namespace, values, option_string=None):
        before = getattr(namespace, self.dest) if getattr(self, "given", False) else ()
        self.given = True
        setattr(namespace, self.dest, tuple(before) + tuple(values))


def parse_config(cls, argv: list[str] | None = None):
    """Build an argparse parser from a @dataclass (help from field metadata["help"], optional metadata["choices"]
    and metadata["section"]: see flag) and return an instance. Flags are the field names: --lr 3e-4, --bf16
    true|false (or bare --bf16), --pass_k 1,8 for tuple fields, --init none for Optional fields.
    --config FILE.yaml|.json sets fields from a file first (config_file_defaults); flags given override it."""
    doc = "" if (cls.__doc__ or "").startswith(cls.__name__ + "(") else cls.__doc__  # not dataclass's signature
    parser = argparse.ArgumentParser(description=(doc or "").strip(),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="YAML or JSON file of flag values (a run's config.json too); flags given override it")
    hints, groups = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = dict(type=_flag_type(tp), default=default, help=f.metadata.get("help", " ").replace("%", "%%"),
                  choices=f.metadata.get("choices"))
        if tp is bool:
            kw.update(nargs="?", const=True, metavar="true|false")
        if f.metadata.get("repeat"):
            kw.update(action=_Repeated)
        title = f.metadata.get("section")
        if title and title not in groups:
            groups[title] = parser.add_argument_group(title)
        group = groups[title] if title else parser
        group.add_argument(f"--{f.name}", **kw)
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--config", default=None)
    path = pre.parse_known_args(argv)[0].config
    if path:
        parser.set_defaults(**config_file_defaults(parser, cls, path))
    values = vars(parser.parse_args(argv))
    values.pop("config")
    return cls(**values)


# keys a run's config.json holds that are not flags (checkpoint.run_record adds them): --config skips them
RUN_RECORD_KEYS = ("init_sha256",)


def config_file_defaults(parser, cls, path: str) -> dict:
    """A --config file's {field: value}, each value checked and converted as its flag's would be. A bad file, an
    unknown key or a bad value is parser.error: the usage and one `error:` line naming the file and key."""
    try:
        with open(path, encoding="utf-8") as file:
            if Path(path).suffix in (".yaml", ".yml"):
                import yaml  # pyyaml

                data = yaml.safe_load(file)
            else:
                data = json.load(file)
    except Exception as e:  # missing file, not UTF-8, a YAML / JSON syntax error
        parser.error(f"--config {path}: {type(e).__name__}: {' '.join(str(e).split())}")
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints, out = typing.get_type_hints(cls), {}
    for key, value in data.items():
        if key in RUN_RECORD_KEYS:
            continue
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            parser.error(f"--config {path}: unknown key {key!r}: not a flag of {parser.prog}{hint}")
        # the value as a command line would spell it, through the flag's own parser: one rule for both
        if isinstance(value, list | tuple):
            text = ",".join(str(v) for v in value)
        else:
            text = "none" if value is None else str(value)
        try:
            out[key] = _flag_type(hints[key])(text)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            parser.error(f"--config {path}: key {key!r}: invalid value {value!r} ({e})")
        choices = fields[key].metadata.get("choices")
        if choices and out[key] not in choices:
            parser.error(f"--config {path}: key {key!r}: invalid choice {value!r} (choose from {choices})")
    return out


def start_stage(cls, argv: list[str] | None = None):
    """A stage script's opening: its flags (parse_config) and its process (init_dist) -> (cfg, Dist)."""
    cfg = parse_config(cls, argv)
    check_flags(cfg, positive=("dist_timeout",))  # before init_dist, which waits that long on the other ranks
    d = init_dist(cfg.dist_timeout)
    torch.set_flush_denormal(True)  # CPU arithmetic on denormal floats (tiny weights) is very slow
    return cfg, d


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


def permutation_stream(n: int, seed: int):
    """i -> the i-th item of a stream of seeded permutations of range(n), a new one each epoch (epoch e's from
    seed + e): the data order of every step, whatever the world size."""
    cache = {}

    def at(i: int) -> int:
        epoch = i // n
        if epoch not in cache:
            g = torch.Generator().manual_seed(seed + epoch)
            cache[epoch] = torch.randperm(n, generator=g).tolist()
        return cache[epoch][i % n]

    return at


def check_flags(cfg, at_least_1=(), at_least_0=(), positive=()):
    """One `error:` line for the first flag out of its range (before anything is loaded or written)."""
    for names, ok, need in ((at_least_1, lambda v: v >= 1, "at least 1"), (at_least_0, lambda v: v >= 0, ">= 0"),
                            (positive, lambda v: 0 < v < float("inf"), "a positive finite number")):
        for name in names:
            value = getattr(cfg, name)
            if not all(ok(v) for v in (value if isinstance(value, tuple) else (value,))):
                raise SystemExit(f"error: --{name} {value}: need {need}")


def check_packages(cfg):
    """--wandb / --tensorboard need their package: say so before a run starts (or --overwrite deletes anything).
    A missing package fails on every rank alike (not only on the logging rank, which would hang the others)."""
    for package, wanted in (("wandb", getattr(cfg, "wandb", "")), ("tensorboard", getattr(cfg, "tensorboard", 0))):
        if wanted and importlib.util.find_spec(package) is None:
            raise SystemExit(f"error: --{package} needs the {package} package: pip install {package}")


def cxx_compiler() -> str | None:
    """The C++ compiler torch.compile builds CPU kernels with, as inductor picks it ($CXX, else g++; clang++ on
    macOS), if it is on PATH; else None (compile would fail at its first call)."""
    cxx = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
    return cxx if shutil.which(cxx) else None


class JsonlLogger:
    """Appends one JSON object per line, flushed each time (so `tail -f` works and a crash loses nothing).
    Optionally mirrors each row's numbers to Weights & Biases (wandb_project) and/or TensorBoard (tensorboard_dir),
    keyed by row["step"]; both packages are optional and only imported when asked for."""

    def __init__(self, path, enabled: bool = True, append: bool = True, *, wandb_project: str = "",
                 tensorboard_dir=None, config: dict | None = None, start_step: int = 0):
        check_packages(types.SimpleNamespace(wandb=wandb_project, tensorboard=tensorboard_dir))
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
            if not run_id or int(last) > start_step:  # (wandb 0.31 keeps generate_id only in sdk.lib.runid)
                new_id = getattr(wandb.util, "generate_id", None)
                run_id = (new_id or importlib.import_module("wandb.sdk.lib.runid").generate_id)()
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

    def table(self, name: str, rows: list[dict], step: int):
        """Mirror a table of rows (e.g. a step's completions; columns: the first row's keys) to W&B as a
        wandb.Table and to TensorBoard as a markdown text, at `step`. Nothing without those loggers."""
        if not rows or (self.wandb is None and self.tb is None):
            return
        columns = list(rows[0])
        cells = [[row.get(c) for c in columns] for row in rows]
        if self.wandb is not None:
            import wandb

            self.wandb.log({name: wandb.Table(columns=columns, data=cells)}, step=step)
        if self.tb is not None:  # a markdown table
            lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            lines += ["| " + " | ".join(_markdown_cell(v) for v in row) + " |" for row in cells]
            self.tb.add_text(name, "\n".join(lines), global_step=step)

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


def _markdown_cell(value) -> str:
    """One markdown table cell: floats to 4 digits, | and newlines escaped (a completion stays one row)."""
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", "<br>")


class Progress:
    """Progress that fits where it goes (rank 0 only): a tqdm bar when stdout is a terminal; when it is a file or a
    pipe (SLURM, CI, `tee`), a plain line every `every_s` seconds and at the end, instead of a carriage-return
    update per step. update(n, info): n more done; info, e.g. "loss 1.234", goes in the bar's postfix or the line."""

    def __init__(self, total: int, desc: str, *, initial: int = 0, enabled: bool = True, every_s: float = 30.0):
        self.total, self.desc, self.n, self.first, self.every_s = total, desc, initial, initial, every_s
        self.enabled, self.t0, self.last = enabled and int(os.environ.get("RANK", 0)) == 0, time.perf_counter(), None
        self.bar = None
        if self.enabled and sys.stdout.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, file=sys.stdout)

    def update(self, n: int = 1, info: str = ""):
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
            self.bar.set_postfix_str(info, refresh=False)
        elif self.enabled:
            now = time.perf_counter()
            if self.last is None or now - self.last >= self.every_s or self.n >= self.total:
                self.last = now
                print(self.line(info, now - self.t0), flush=True)

    def line(self, info: str, elapsed: float) -> str:
        """ "grpo step 12/3000 (0%) | reward 0.125 | 1m05s, eta 4h30m": the plain-text form of the bar."""
        done = self.n - self.first
        eta = _duration((self.total - self.n) * elapsed / done) if done > 0 else "?"
        pct = 100 * self.n / max(self.total, 1)
        return f"{self.desc} {self.n}/{self.total} ({pct:.0f}%)" + (f" | {info}" if info else "") + (
            f" | {_duration(elapsed)}, eta {eta}")

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _duration(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


# -----------------------------------------------------------------------------
# precision: --dtype is the compute dtype, --weights_dtype the storage dtype of the weights and AdamW state

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_precision(dtype: str, weights_dtype: str):
    """bf16 weights (--weights_dtype bfloat16) compute in bf16 too: fp32 compute over them would be no more exact."""
    if weights_dtype == "bfloat16" and dtype != "bfloat16":
        raise SystemExit("error: --weights_dtype bfloat16 needs --dtype bfloat16 (bf16 weights compute in bf16)")


def autocast(model: torch.nn.Module, dtype: str):
    """The context every forward of `model` runs in: training, the sampler and eval alike, so all three compute the
    same numbers. --dtype bfloat16 on one device or under DDP: torch.autocast, i.e. matmuls and attention in bf16
    over the (fp32) weights; the model itself keeps logits, log-softmax and RMSNorm statistics in fp32. Under
    FSDP2 the MixedPrecisionPolicy of wrap_model casts the parameters instead, so nothing is needed here. The
    backward pass runs outside it (autograd replays the forward's casts). A LoRA base is cast once for the
    context (lora.base_cast), not at every call."""
    if not uses_autocast(model, dtype):
        return nullcontext()
    device = next(model.parameters()).device  # (a DDP-wrapped model's parameters are its module's)
    ctx = ExitStack()
    ctx.enter_context(torch.autocast(device.type, dtype=DTYPES[dtype]))
    ctx.enter_context(base_cast(model, DTYPES[dtype]))
    return ctx


def uses_autocast(model: torch.nn.Module, dtype: str) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return DTYPES[dtype] != torch.float32 and not isinstance(model, FSDPModule)


def frozen_in_compute_dtype(model: torch.nn.Module, dtype: str) -> torch.nn.Module:
    """A frozen model (GRPO's KL reference outside FSDP2) with its blocks' projections stored in the compute dtype
    where it runs under autocast: autocast casts them to it at every call anyway (it caches only the casts of
    weights that train), so it computes the same values, bitwise, holds them at half the bytes and casts nothing.
    Embeddings, norms and the head keep their dtype (autocast leaves them; model.head_logits reads the head in
    fp32). In place; -> the model."""
    if uses_autocast(model, dtype):
        for m in model.layers.modules():
            if isinstance(m, torch.nn.Linear):
                m.to(DTYPES[dtype])
    return model


# -----------------------------------------------------------------------------
# model wrapping and LR schedule


def wrap_model(model: torch.nn.Module, mode: str, d: Dist, dtype: str = "float32") -> torch.nn.Module:
    """mode "none" | "ddp" | "fsdp". FSDP2 shards each block in model.layers, then the root (torchtitan style),
    with MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=fp32): the parameters are cast to the compute dtype
    (--dtype) when gathered, gradients reduced in fp32 and kept in the weights' dtype (fp32 master weights).
    Single process without torchrun: returned unwrapped (nothing to synchronise)."""
    if mode == "none" or not is_dist():
        return model
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        return DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    if mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[dtype], reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        return model
    raise ValueError(f"--dist must be none, ddp or fsdp, got {mode!r}")


def load_device(mode: str, d: Dist) -> torch.device:
    """Where a model is built before wrap_model: under FSDP2 the CPU, as fully_shard moves each block to the GPU
    as it shards it (and the root last), so a GPU never holds a whole fp32 model (let alone GRPO's two); else the
    run's device."""
    return torch.device("cpu") if mode == "fsdp" and is_dist() else d.device


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
# training-loop helpers


def clip_grad_norm(model, max_norm: float) -> torch.Tensor:
    """Clip the gradients' global norm to max_norm (0 = no clipping, the norm is still measured); returns the norm
    before clipping as a plain tensor (FSDP2's clip_grad_norm_ returns a DTensor: the global norm, replicated)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm if max_norm > 0 else math.inf)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def grad_sync(model, last: bool):
    """The context of one micro-batch's backward. DDP all-reduces only on the last one (no_sync before it): its
    gradients are full-size anyway. FSDP2 reduce-scatters after every micro-batch: skipping that
    (set_requires_gradient_sync(False)) would hold the whole model's unsharded gradients on every rank."""
    return model.no_sync() if hasattr(model, "no_sync") and not last else nullcontext()


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on any: a stop decision every rank must take at the same step."""
    return bool(all_reduce_named({"flag": float(flag)}, {"flag": "max"})["flag"])


def training_seconds(state: dict) -> float:
    """A resumed run's training clock (evals excluded; what --max_minutes counts). Checkpoints written before the
    rename hold it as "t_train", the name of a metric: one step's update seconds."""
    return state.get("train_s", state.get("t_train", 0.0))


def resumed_clocks(state: dict) -> tuple[float, float]:
    """The clocks, continued on resume: -> (training seconds so far, the perf_counter() the run's wall time counts
    from). "elapsed_s": sft's wall time in checkpoints written before the rename."""
    train_s = training_seconds(state)
    wall_s = state.get("wall_s", state.get("elapsed_s", train_s))
    return train_s, time.perf_counter() - wall_s


def set_lr(opt, step: int, cfg) -> float:
    """Set step `step`'s learning rate (lr_at over --lr, --warmup, --steps, --min_lr_ratio) on every param group."""
    lr = lr_at(step - 1, cfg.warmup, cfg.steps, cfg.lr, cfg.min_lr_ratio)
    for g in opt.param_groups:
        g["lr"] = lr
    return lr


def checkpoint_due(cfg, step: int, saved_at: float) -> bool:
    """Whether --save_every or --save_minutes (since `saved_at`, a perf_counter()) asks for a checkpoint at `step`.
    A collective: every rank calls it at every step."""
    late = cfg.save_minutes > 0 and any_rank(time.perf_counter() - saved_at > cfg.save_minutes * 60)
    return bool(late or (cfg.save_every and step % cfg.save_every == 0))


def open_metrics_log(cfg, d: Dist, state: dict) -> "JsonlLogger":
    """OUT/metrics.jsonl (+ --wandb, --tensorboard's OUT/tb), continuing after the resumed step."""
    tb_dir = os.path.join(cfg.out_dir, "tb") if cfg.tensorboard else None
    return JsonlLogger(os.path.join(cfg.out_dir, "metrics.jsonl"), d.is_main, wandb_project=cfg.wandb,
                       tensorboard_dir=tb_dir, config=dataclasses.asdict(cfg), start_step=state["step"])


def stays_stopped(state: dict, max_minutes: float) -> bool:
    """Whether a resumed run that had stopped early stays stopped: one that met its criterion (--stop_pass1) does;
    one that ran out of --max_minutes goes on when given more time (a larger --max_minutes, or 0 = no limit)."""
    reason = state.get("stopped")
    train_s = training_seconds(state)
    if reason == "time" and (max_minutes <= 0 or train_s < max_minutes * 60):
        return False
    if reason:
        print0(f"the run stopped early at step {state['step']} ({'--max_minutes' if reason == 'time' else reason}): "
               "nothing left to train (a larger --max_minutes continues a timed-out run; --overwrite starts over)")
    return bool(reason)


@contextmanager
def user_input(what: str):
    """Bad input a user gave (a missing path, a model dir without weights, a truncated safetensors file, a malformed
    data row) becomes one line, `error: WHAT: reason`, and exit status 1, not a traceback from inside a library. The
    loaders (hf.py, data.py) raise ValueError / OSError / RuntimeError with messages naming the file and row."""
    try:
        yield
    except (OSError, ValueError, RuntimeError) as e:
        raise SystemExit(f"error: {what}: {' '.join(str(e).split())}") from None  # one line, even if e spans several
