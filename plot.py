"""Plot one or more runs' metrics.jsonl into one PNG: reward, held-out accuracy, completion length, KL / clip
fraction — against step and against training wall time. Runs are overlaid for comparison.

  python plot.py runs/grpo                               # -> runs/grpo/metrics.png
  python plot.py runs/grpo_s0 runs/grpo_s1 --out cmp.png # overlay two runs

Needs matplotlib (pip install -e ".[plot]").
"""

import argparse
import json
import os

PANELS = [  # (title, metric keys drawn in that panel)
    ("train reward", ["reward"]),
    ("held-out greedy pass@1", ["eval_pass1"]),
    ("completion length (tokens)", ["len_mean"]),
    ("KL / clip fraction", ["kl", "clip_low", "clip_high"]),
]


def read_metrics(path: str) -> list[dict]:
    """A run directory or a metrics.jsonl file -> list of per-step dicts (bad lines name the file and line)."""
    f = os.path.join(path, "metrics.jsonl") if os.path.isdir(path) else path
    if not os.path.exists(f):
        raise SystemExit(f"plot.py: {f} does not exist (give a run directory or a metrics.jsonl file)")
    rows = []
    with open(f) as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise SystemExit(f"plot.py: {f} line {n} is not JSON ({e})") from None
    return rows


def smooth(y: list[float], k: int) -> list[float]:
    """Trailing moving average over k points (k=1: unchanged)."""
    out, acc = [], 0.0
    for i, v in enumerate(y):
        acc += v
        if i >= k:
            acc -= y[i - k]
        out.append(acc / min(i + 1, k))
    return out


def _train_minutes(row: dict) -> float:
    """A row's training wall time (evals excluded), in minutes. Older metrics.jsonl files: grpo.py's elapsed_s was
    this; sft.py's included its evals."""
    return row.get("train_s", row.get("elapsed_s", 0.0)) / 60


def plot(runs: list[str], out: str, smooth_k: int = 10, labels: list[str] | None = None) -> str:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(PANELS), figsize=(4.2 * len(PANELS), 6.5), squeeze=False)
    for ri, run in enumerate(runs):
        rows = read_metrics(run)
        label = labels[ri] if labels else os.path.basename(os.path.normpath(run))
        color = f"C{ri}"
        for pi, (title, keys) in enumerate(PANELS):
            for ki, key in enumerate(keys):
                pts = [(r["step"], _train_minutes(r), r[key]) for r in rows if r.get(key) is not None]
                if not pts:
                    continue
                steps, minutes, y = zip(*pts)
                y = list(y) if key == "eval_pass1" else smooth(list(y), smooth_k)
                style = dict(color=color, ls=["-", "--", ":"][ki], marker="o" if key == "eval_pass1" else None,
                             label=f"{label} {key}" if len(keys) > 1 else label)  # fmt: skip
                axes[0, pi].plot(steps, y, **style)
                axes[1, pi].plot(minutes, y, **style)
            axes[0, pi].set_title(title)
            axes[0, pi].set_xlabel("step")
            axes[1, pi].set_xlabel("training minutes (train_s: evals excluded)")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files")
    p.add_argument("--out", default=None, help="PNG path (default: <first run>/metrics.png)")
    p.add_argument("--smooth", type=int, default=10, help="moving-average window for per-step curves")
    p.add_argument("--labels", default=None, help="comma-separated legend labels, one per run")
    a = p.parse_args(argv)
    first = a.runs[0] if os.path.isdir(a.runs[0]) else os.path.dirname(a.runs[0]) or "."
    out = plot(a.runs, a.out or os.path.join(first, "metrics.png"), a.smooth, a.labels.split(",") if a.labels else None)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
