"""Reward plug-ins: your own reward functions, without editing rewards.py (grpo.py's --reward_fn, repeatable).

    --reward_fn path/to/file.py:fn    a function in a Python file
    --reward_fn package.module:fn     a function in an importable module

Each is called once per completion as fn(completion, answer, **row) -> float, where completion is the scored response
(what the prompt opened, e.g. "<think>", + the model's text: what rewards.reward scores too), answer the row's gold
answer, and row the problem's other keys (question, solution, numeric, and a --task custom dataset's other
columns). Each becomes a reward component named after fn: weight 1.0 unless --reward_weights name=w says otherwise,
added to the reward and logged every step like the built-in components (correct, format, overlong).

Loading the file runs your code: that is the point, it is yours. The model's text is only ever handed to your
function as a string; nothing here executes it. A function that raises, or returns something other than a finite
number, stops the run with one error line naming it.
"""

import importlib
import importlib.util
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import rewards


@dataclass
class Plugin:
    name: str  # the component's name: the function's (in metrics, samples.jsonl, --reward_weights)
    spec: str  # as given to --reward_fn
    fn: Callable
    weight: float = 1.0


def load(specs) -> list[Plugin]:
    """--reward_fn's 'file.py:fn' / 'module:fn' specs -> plug-ins. ValueError naming the spec when it cannot be."""
    plugins = []
    for spec in specs:
        where, sep, name = spec.rpartition(":")
        if not sep or not where or not name.isidentifier():
            raise ValueError(f"{spec!r}: expected path/to/file.py:function or module:function")
        module = _import(where, spec)
        fn = getattr(module, name, None)
        if not callable(fn):
            raise ValueError(f"{spec!r}: {where} has no function {name!r}")
        taken = {*rewards.DEFAULT_WEIGHTS, "reward", *(p.name for p in plugins)}
        if name in taken:
            raise ValueError(f"{spec!r}: a reward component named {name!r} exists already; rename the function")
        plugins.append(Plugin(name, spec, fn))
    return plugins


def _import(where: str, spec: str):
    """The module of a --reward_fn spec: a .py file by path, else an importable module by name."""
    try:
        if where.endswith(".py"):
            path = Path(where).expanduser()
            if not path.is_file():
                raise ValueError(f"{spec!r}: {path}: no such file")
            loader = importlib.util.spec_from_file_location(f"reward_plugin_{path.stem}", path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
            return module
        return importlib.import_module(where)
    except ValueError:
        raise
    except Exception as e:  # a syntax error, a failing import inside the user's file, no such module
        raise ValueError(f"{spec!r}: importing {where} failed ({type(e).__name__}: {e})") from None


def parse_weights(text: str, plugins: list[Plugin]) -> dict | None:
    """--reward_weights over the built-in components and the plug-ins: sets each plug-in's weight, returns the
    built-in weights for rewards.reward (None when the flag is empty: the defaults)."""
    if not text:
        return None
    given = rewards.parse_weights(text, {**rewards.DEFAULT_WEIGHTS, **{p.name: p.weight for p in plugins}})
    for p in plugins:
        p.weight = given.pop(p.name)
    return given


def add_scores(plugins: list[Plugin], score: dict, response: str, row: dict) -> dict:
    """rewards.reward's score of one response, with each plug-in's component and weighted term added."""
    score = dict(score)
    others = {k: v for k, v in row.items() if k != "answer"}
    for p in plugins:
        try:
            value = p.fn(response, row["answer"], **others)
        except Exception as e:
            raise SystemExit(f"error: --reward_fn {p.spec} raised {type(e).__name__}: {' '.join(str(e).split())} "
                             f"(on a completion to {row.get('question', '')[:60]!r})") from None
        number = not isinstance(value, str) and hasattr(value, "__float__")  # int, float, bool, numpy, 0-d tensor
        if not number or not math.isfinite(float(value)):
            raise SystemExit(f"error: --reward_fn {p.spec} returned {value!r}, not a finite number "
                             f"(on a completion to {row.get('question', '')[:60]!r})")
        score[p.name] = float(value)
        score["reward"] += p.weight * float(value)
    return score
