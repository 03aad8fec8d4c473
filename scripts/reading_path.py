"""The reading path of one GRPO step: every function of ours that grpo.py's `grpo_step` runs, in the order it first
runs, its lines (def to last line, docstring included), and the calls that cross into another file (#46).

    python scripts/reading_path.py            # as on a CUDA device: generate(fast="auto") decodes with the forward
    python scripts/reading_path.py --cpu      # the CPU's defaults: fast.py's decode paths, oneDNN projections

It traces the second step of a 3-step demo run (the first compiles and warms up nothing the second skips) from a
1-step SFT start, both in a temporary directory. "lines": the union of the functions' line ranges per file (a
nested function counts once); "jumps": the distinct functions reached by a call from another file.
"""

import argparse
import os
import sys
import tempfile
from collections import defaultdict
from contextlib import redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fast  # noqa: E402
import grpo  # noqa: E402
import sampler  # noqa: E402
import sft  # noqa: E402

OURS = {str(p) for p in ROOT.glob("*.py")}


def ours(code) -> bool:
    return code.co_filename in OURS and not code.co_name.startswith("<")  # (comprehensions: their function's lines)


def trace_step(argv: list[str]) -> tuple[list, set]:
    """-> the functions grpo_step's second call runs (code objects, first-run order), the calls between them."""
    order, edges = {}, set()

    def profile(frame, event, arg):
        if event != "call" or not ours(frame.f_code):
            return
        order.setdefault(frame.f_code, len(order))
        caller = frame.f_back
        while caller is not None and not ours(caller.f_code):
            caller = caller.f_back
        if caller is not None:
            edges.add((caller.f_code, frame.f_code))

    step, calls = grpo.grpo_step, [0]

    def traced(*args, **kwargs):
        calls[0] += 1
        sys.setprofile(profile if calls[0] == 2 else None)
        try:
            return step(*args, **kwargs)
        finally:
            sys.setprofile(None)

    grpo.grpo_step = traced
    try:
        grpo.main(argv)
    finally:
        grpo.grpo_step = step
    return sorted(order, key=order.get), edges


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="the CPU's defaults (default: as on a CUDA device)")
    args = p.parse_args()
    if not args.cpu:  # what a CUDA device runs: sampler.DEFAULTS["cuda"], no oneDNN swap
        sampler.DEFAULTS["cpu"] = sampler.DEFAULTS["cuda"]
        fast.use_onednn = lambda model: model
    with tempfile.TemporaryDirectory() as tmp, redirect_stdout(open(os.devnull, "w")):
        sft.main(["--steps", "1", "--eval_every", "0", "--out_dir", f"{tmp}/sft"])
        funcs, edges = trace_step(["--init", f"{tmp}/sft/model", "--steps", "3", "--eval_every", "0",
                                   "--save_every", "0", "--out_dir", f"{tmp}/grpo"])
    lines = defaultdict(set)
    print(f"{'file':14s} {'function':34s} {'line':>5s} {'lines':>5s}")
    for code in funcs:
        last = max(line for *_, line in code.co_lines() if line)
        lines[code.co_filename] |= set(range(code.co_firstlineno, last + 1))
        print(f"{Path(code.co_filename).name:14s} {code.co_qualname:34s} {code.co_firstlineno:5d} "
              f"{last - code.co_firstlineno + 1:5d}")
    jumps = {b for a, b in edges if a.co_filename != b.co_filename}
    print(f"\n{'CPU' if args.cpu else 'CUDA'} defaults: {len(funcs)} functions, "
          f"{sum(map(len, lines.values()))} lines in {len(lines)} files, {len(jumps)} jumps into another file:")
    for code in sorted(jumps, key=funcs.index):
        callers = sorted({Path(a.co_filename).name + ":" + a.co_qualname for a, b in edges if b is code
                          and a.co_filename != code.co_filename})
        print(f"  {Path(code.co_filename).name}:{code.co_qualname} <- {', '.join(callers)}")


if __name__ == "__main__":
    main()
