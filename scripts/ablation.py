"""Loss-variant ablation: --variants x --seeds runs of grpo.py from one SFT start, each with the same budget, then
one table of held-out greedy pass@1 (mean +- sample std over seeds) at fixed marks, the share of zero-std groups
and the clip fractions.

    python scripts/ablation.py --init runs/sft/model      # 5 variants x 3 seeds x 5 training minutes each
    nice -n 10 python scripts/ablation.py --out /tmp/abl --variants grpo,cispo --seeds 0,1 --steps 20 \\
        --sft_flags "--steps 60"                         # a step budget (for a shared, loaded machine) from a
                                                         # quick SFT start trained first into OUT/sft
    python scripts/ablation.py --out /tmp/abl --table_only   # print the table again from finished runs

The runs go one after another, or --jobs at a time with the cores split between them (a time budget is fair only
if nothing else competes), each in OUT/VARIANT_sSEED, its output in OUT/VARIANT_sSEED.log beside it. A finished
run is not redone: running the same command again resumes an interrupted run and reprints the table. Time budgets
use grpo.py's --max_minutes (training time; the in-loop evals are not counted). Pass@1 at a mark is the newest
eval at or before it (--eval_every sets the resolution); "start" is the SFT model's own, evaluated the way
grpo.py's in-loop eval does.

Every run gets --mu 2 unless --grpo_flags says otherwise: with one update per rollout every ratio is 1 and GSPO /
CISPO reduce to GRPO / DAPO. GSPO gets its paper's clip range and CISPO no lower clip (VARIANT_FLAGS).
"""

import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import flag, parse_config  # noqa: E402

# per variant, what its paper uses where the shared defaults would misrepresent it
VARIANT_FLAGS = {
    "gspo": ["--epsilon", "3e-4", "--epsilon_high", "4e-4"],  # GSPO's sequence-level clip range
    "cispo": ["--epsilon", "1.0"],  # MiniMax-M1: no lower bound on the IS weight, only the upper one is tuned
}


@dataclass
class AblationConfig:
    """Run loss variants x seeds of grpo.py from one SFT start and print the comparison table."""
    # the start
    init: str = flag("", "SFT model dir every run starts from (empty: train one with sft.py into "
                     "OUT/sft, with --sft_flags)")
    sft_flags: str = flag("", "sft.py flags when it trains the start, e.g. '--steps 60'")
    # the grid and the budget
    variants: str = flag("grpo,dapo,dr_grpo,gspo,cispo", "--loss values, comma-separated")
    seeds: str = flag("0,1,2", "grpo.py --seed values, comma-separated")
    minutes: float = flag(5.0, "training minutes per run (used when --steps is 0)")
    steps: int = flag(0, "a step budget per run instead of --minutes (0 = minutes)")
    marks: str = flag("", "where the table reads pass@1: minutes, or steps with --steps (default: "
                      "5 evenly spaced up to the budget)")
    eval_every: int = flag(10, "steps between held-out evals in each run")
    grpo_flags: str = flag("--mu 2", "extra grpo.py flags for every run")
    nproc: int = flag(1, "processes per run (torchrun when > 1)")
    jobs: int = flag(1, "runs at once, each with OMP_NUM_THREADS = cores / (jobs x nproc) unless "
                     "set (1 = one after another)")
    # output
    out: str = flag("runs/ablation", "folder of the runs and table.md")
    table_only: bool = flag(False, "only print the table of the runs already in --out")


def command(script: str, flags: list[str], nproc: int) -> list[str]:
    """The command line of a stage script (torchrun for nproc > 1)."""
    run = [sys.executable] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    return run + [script] + flags


def launch(jobs: list[tuple[str, list[str], Path]], nproc: int, at_once: int) -> None:
    """Run (script, flags, log) jobs from the repo root, at most at_once at a time, each one's output into its
    log; stop at the first failure."""
    env = dict(os.environ)
    if at_once > 1 and "OMP_NUM_THREADS" not in env:  # the cores are split between the jobs, not oversubscribed
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (at_once * nproc)))
    running, todo = [], list(jobs)
    while todo or running:
        while todo and len(running) < at_once:
            script, flags, log = todo.pop(0)
            log.parent.mkdir(parents=True, exist_ok=True)
            cmd = command(script, flags, nproc)
            print(f"$ {shlex.join(cmd[1:])}  > {log}", flush=True)
            f = open(log, "a")
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
            running.append((proc, script, log, f))
        time.sleep(0.5)
        for job in [j for j in running if j[0].poll() is not None]:
            running.remove(job)
            proc, script, log, f = job
            f.close()
            if proc.returncode:
                for other in running:
                    other[0].terminate()
                raise SystemExit(f"error: {script} exited with {proc.returncode}: see {log}")


def start_pass1(init: str, run_flags: list[str], out: Path) -> float:
    """Held-out greedy pass@1 of the start model, evaluated as grpo.py's in-loop eval is (same rows, template,
    length), cached in OUT/start.json."""
    cache = out / "start.json"
    if cache.exists() and json.loads(cache.read_text())["init"] == init:
        return json.loads(cache.read_text())["pass@1"]
    import fast
    from data import load_task, parse_knobs
    from eval import evaluate
    from grpo import GRPOConfig
    from hf import load_model, load_tokenizer

    cfg = parse_config(GRPOConfig, run_flags)
    knobs = parse_knobs(cfg.task_knobs)
    rows = load_task(cfg.task, cfg.eval_split, path=cfg.data_path, seed=cfg.data_seed, **knobs)
    summary, _ = evaluate(fast.use_onednn(load_model(init)), load_tokenizer(init), rows, template=cfg.template,
                          max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)  # fmt: skip
    cache.write_text(json.dumps({"init": init, "pass@1": summary["pass@1"]}))
    return summary["pass@1"]


def summarize(metrics: list[dict], marks: list[float], by_minutes: bool) -> dict:
    """One run's numbers: pass@1 at each mark (newest eval at or before it; None before the first), and the
    per-step means of frac_zero_std / clip_low / clip_high."""
    minutes = lambda m: m.get("train_s", m.get("elapsed_s")) / 60  # training time ("elapsed_s": older grpo.py)
    evals = [m for m in metrics if "eval_pass1" in m]
    at = []
    for mark in marks:
        seen = [m["eval_pass1"] for m in evals if (minutes(m) if by_minutes else m["step"]) <= mark + 1e-9]
        at.append(seen[-1] if seen else None)
    mean = lambda k: sum(m[k] for m in metrics) / len(metrics)
    return {"pass1": at, "zero_std": mean("frac_zero_std"), "clip_low": mean("clip_low"),
            "clip_high": mean("clip_high"), "steps": metrics[-1]["step"], "minutes": minutes(metrics[-1])}


def spread(xs: list, digits: int = 3) -> str:
    """'mean +- sample std' over seeds ('-' if a seed has no value)."""
    if not xs or any(x is None for x in xs):
        return "-"
    m = sum(xs) / len(xs)
    if len(xs) == 1:
        return f"{m:.{digits}f}"
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
    return f"{m:.{digits}f} ± {sd:.{digits}f}"


def table(cfg: AblationConfig, variants, seeds, marks, by_minutes: bool, start: float | None) -> str:
    unit = "min" if by_minutes else "step"
    head = ["variant", "start"] + [f"@{m:g} {unit}" for m in marks] + ["zero-std", "clip_low", "clip_high",
                                                                     "steps", "minutes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    finals = {}
    for v in variants:
        runs = []
        for s in seeds:
            path = Path(cfg.out) / f"{v}_s{s}" / "metrics.jsonl"
            rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
            if rows:
                runs.append(summarize(rows, marks, by_minutes))
        if not runs:
            continue
        finals[v] = [r["pass1"][-1] for r in runs]
        cells = [v, "-" if start is None else f"{start:.3f}"]
        cells += [spread([r["pass1"][i] for r in runs]) for i in range(len(marks))]
        cells += [spread([r["zero_std"] for r in runs])]
        cells += [spread([r[k] for r in runs], digits=5) for k in ("clip_low", "clip_high")]  # small: more digits
        cells += [spread([r["steps"] for r in runs]).replace(".000", ""), spread([r["minutes"] for r in runs])]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(f"\n{len(seeds)} seed(s) each; pass@1: held-out greedy, mean ± sample std over seeds.")
    base = variants[0]
    for v, xs in finals.items():  # a difference counts as larger than the spread if it exceeds both stds summed
        if v == base or base not in finals or None in xs + finals[base] or len(xs) < 2:
            continue
        d = sum(xs) / len(xs) - sum(finals[base]) / len(finals[base])
        sd = lambda ys: math.sqrt(sum((y - sum(ys) / len(ys)) ** 2 for y in ys) / (len(ys) - 1))
        verdict = "larger" if abs(d) > sd(xs) + sd(finals[base]) else "not larger"
        lines.append(f"final pass@1, {v} - {base}: {d:+.3f} ({verdict} than the two seed stds summed)")
    return "\n".join(lines)


def main(argv=None):
    cfg = parse_config(AblationConfig, argv)
    variants, seeds = cfg.variants.split(","), [int(s) for s in cfg.seeds.split(",")]
    by_minutes = cfg.steps <= 0
    budget = cfg.minutes if by_minutes else cfg.steps
    if budget <= 0:
        raise SystemExit("error: --minutes must be > 0 (or give --steps N)")
    if cfg.eval_every < 1:
        raise SystemExit("error: --eval_every must be >= 1: the table reads the runs' held-out evals")
    fifths = [budget * (i + 1) / 5 for i in range(5)]  # steps: rounded up to the next eval
    default_marks = fifths if by_minutes else sorted({min(math.ceil(m / cfg.eval_every) * cfg.eval_every, budget)
                                                      for m in fifths})
    marks = [float(m) for m in cfg.marks.split(",")] if cfg.marks else default_marks
    out = Path(cfg.out)
    init = cfg.init or str(out / "sft" / "model")
    # a step budget: --steps N; a time budget: --max_minutes M, with --steps only an upper bound
    budget_flags = ["--steps", str(cfg.steps)] if not by_minutes else ["--max_minutes", str(cfg.minutes),
                                                                      "--steps", "1000000"]
    shared = ["--init", init, "--eval_every", str(cfg.eval_every), *budget_flags, *shlex.split(cfg.grpo_flags)]
    if not cfg.table_only:
        out.mkdir(parents=True, exist_ok=True)
        (out / "ablation.json").write_text(json.dumps(asdict(cfg), indent=2))
        if not cfg.init:
            sft = ["--out_dir", str(out / "sft"), *shlex.split(cfg.sft_flags)]
            launch([("sft.py", sft, out / "sft.log")], cfg.nproc, 1)
        runs = []
        for v in variants:
            for s in seeds:
                run = out / f"{v}_s{s}"
                flags = [*shared, "--loss", v, "--seed", str(s), *VARIANT_FLAGS.get(v, []), "--out_dir", str(run)]
                runs.append(("grpo.py", flags, out / f"{v}_s{s}.log"))
        launch(runs, cfg.nproc, cfg.jobs)
    start = start_pass1(init, shared, out) if Path(init).exists() else None
    text = table(cfg, variants, seeds, marks, by_minutes, start)
    if out.exists():
        (out / "table.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
