"""Tasks: where problems come from, what prompts look like, and what an SFT target is.

Every task gives a list of rows {"question": str, "answer": str (the gold answer), "solution": str | None (worked
reasoning without the final answer line), "numeric": bool}. "numeric" is the task's answer form: True where the
answers are numbers (arith, gsm8k), so a completion's answer must be a number too ("82-18+20" copied from the
question is not the answer 84); False where answers are expressions (math). rewards.reward takes it as `numeric`.

- "arith": built-in, generated multi-step arithmetic in GSM8K's own shape (question; one step per line; "#### N"),
  small enough for a character-level model trained from scratch on a laptop CPU. See ARITH_DEFAULTS for knobs.
- "gsm8k": openai/gsm8k ("main") from the Hugging Face hub, or a local file/directory with question/answer.
- "math": MATH problems with problem/solution (+answer, else the last \\boxed{} of the solution). Hub defaults:
  HuggingFaceH4/MATH-500 for "test", DigitalLearningGmbH/MATH-lighteval (the 7,500 MATH train problems, disjoint
  from MATH-500) for "train".
- "custom": any dataset (`path` required), its columns named by `columns` (custom_row: --question_field,
  --answer_field, --answer_regex, --solution_field). GSM8K is the preset question / answer / '####\\s*(.+)'.

`path` is a local .jsonl/.json/.parquet/.csv file (used as the split whatever its name), a directory holding
{split}.jsonl/.json/.parquet/.csv, or a hub dataset name ("owner/name") loaded with datasets.load_dataset.

Splits use one syntax everywhere (like Hugging Face datasets): "train", "test", "train[:10%]", "train[10%:]",
"test[:400]", "train[100:200]", "train[-50:]". Percent bounds round down, so train[:10%] and train[10%:] always
partition train exactly (e.g. SFT on the first 10%, GRPO on the other 90%).
"""

import csv
import hashlib
import io
import json
import math
import random
import re
from fractions import Fraction
from pathlib import Path

from verifier import MAX_ANSWER_CHARS, last_boxed

TEMPLATES = ("r1", "short", "chat")
THINK = "<think>"

# Built-in task knobs. Defaults: three 2-digit operands with + and -, no negative intermediate results: a difficulty
# the char-level demo model (model.py's `demo` preset) learns on CPU (docs/demo.md has the numbers).
# The problem space (~2.9M expressions at default) is split by a hash of the expression: 1 in TEST_BUCKETS goes
# to test, the rest to train, so train and test never share a question, whatever the sizes or seeds.
ARITH_DEFAULTS = {
    "steps": 2,  # operations per problem (operands = steps + 1); one solution line per operation
    "low": 10,  # operands are drawn uniformly from [low, high]
    "high": 99,
    "ops": "+-",  # any of "+-*"; * binds tighter than + and -, as usual
    "negative": False,  # allow negative intermediate/final results
    "train_size": 20000,
    "test_size": 1000,
}
TEST_BUCKETS = 10

R1_PROMPT = (
    "A conversation between User and Assistant. The User asks a question and the Assistant solves it. "
    "The Assistant first thinks through the reasoning step by step, then gives the final answer. The reasoning "
    "goes inside <think> </think> tags and the answer inside <answer> </answer> tags, i.e., "
    "<think> reasoning here </think> <answer> answer here </answer>.\nUser: {question}\nAssistant: <think>"
)
CHAT_SYSTEM_PROMPT = (
    "Think through the problem step by step inside <think> </think> tags, then give only the final answer inside "
    "<answer> </answer> tags, i.e., <think> reasoning here </think> <answer> answer here </answer>."
)
HUB = {  # task -> split name -> (hub dataset, config)
    "gsm8k": {"train": ("openai/gsm8k", "main"), "test": ("openai/gsm8k", "main")},
    "math": {"train": ("DigitalLearningGmbH/MATH-lighteval", None), "test": ("HuggingFaceH4/MATH-500", None)},
}
SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


# ---------------------------------------------------------------- splits


_SPLIT = re.compile(r"(\w+)(?:\[(-?\d+(?:\.\d+)?%?)?:(-?\d+(?:\.\d+)?%?)?\])?")


def parse_split(split: str) -> tuple[str, int | Fraction | None, int | Fraction | None]:
    """'train[10%:200]' -> ('train', Fraction(1, 10), 200). A Fraction bound is a share of the rows, an int a row."""
    m = _SPLIT.fullmatch(split.strip())
    if not m:
        raise ValueError(f"bad split {split!r}: expected e.g. train, test[:400], train[:10%], train[10%:], train[5:9]")

    def bound(text):
        if text is None:
            return None
        if text.endswith("%"):
            share = Fraction(text[:-1]) / 100
            if abs(share) > 1:
                raise ValueError(f"bad split {split!r}: percent bound {text} is outside -100%..100%")
            return share
        if "." in text:
            raise ValueError(f"bad split {split!r}: row bound {text} must be an integer")
        return int(text)

    return m.group(1), bound(m.group(2)), bound(m.group(3))


def select(rows, split: str, source: str = ""):
    """Apply the [start:stop] part of `split` to rows; an empty selection is an error."""
    _, start, stop = parse_split(split)
    n = len(rows)
    # floor(n * share): train[:10%] + train[10%:] is always all of train
    to_index = lambda b: int(b * n) if isinstance(b, Fraction) else b
    picked = rows[to_index(start) : to_index(stop)]
    if not picked:
        raise ValueError(f"{source or 'dataset'}: split {split!r} selects no rows (it has {n})")
    return picked


# ---------------------------------------------------------------- built-in arithmetic


def _solve(nums: list[int], ops: list[str]) -> tuple[list[str], int]:
    """Solution lines "a+b=c", * first then + and - left to right, and the value."""
    nums, ops, lines = list(nums), list(ops), []
    for level in ("*", "+-"):
        i = 0
        while i < len(ops):
            if ops[i] not in level:
                i += 1
                continue
            a, op, b = nums[i], ops[i], nums[i + 1]
            c = a * b if op == "*" else a + b if op == "+" else a - b
            lines.append(f"{a}{op}{b}={c}")
            nums[i : i + 2] = [c]
            del ops[i]
    return lines, nums[0]


def _test_bucket(expr: str) -> bool:
    """True if this expression belongs to the test split (a hash of the question, independent of any seed)."""
    return int.from_bytes(hashlib.blake2b(expr.encode(), digest_size=8).digest(), "big") % TEST_BUCKETS == 0


def arith_problem(index: int, split: str = "train", seed: int = 0, **knobs) -> dict:
    """Problem `index` of the built-in task, deterministic in (split, seed, index, knobs), in GSM8K's raw shape."""
    k = {**ARITH_DEFAULTS, **knobs}
    if not (k["steps"] >= 1 and 0 <= k["low"] <= k["high"] and k["ops"] and set(k["ops"]) <= set("+-*")):
        raise ValueError(f"bad arith knobs {k}: need steps >= 1, 0 <= low <= high, ops a non-empty subset of '+-*'")
    rng = random.Random(f"arith/{split}/{seed}/{index}")  # str seeds hash with sha512: same across runs/machines
    for _ in range(10_000):  # rejection sampling: right split, and non-negative unless allowed
        nums = [rng.randint(k["low"], k["high"]) for _ in range(k["steps"] + 1)]
        ops = [rng.choice(k["ops"]) for _ in range(k["steps"])]
        expr = "".join(f"{n}{op}" for n, op in zip(nums, ops)) + str(nums[-1])
        if _test_bucket(expr) != (split == "test"):
            continue
        lines, value = _solve(nums, ops)
        if k["negative"] or all(not line.rsplit("=", 1)[1].startswith("-") for line in lines):
            return {"question": f"What is {expr}?", "answer": "\n".join(lines) + f"\n#### {value}"}
    raise ValueError(f"arith knobs {k} leave almost no valid {split} problems; widen the range or set negative=True")


def arith_rows(split: str, seed: int = 0, **knobs) -> list[dict]:
    """The raw rows `split` selects (e.g. "train[:10%]"); only the selected indices are generated."""
    unknown = set(knobs) - set(ARITH_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown arith knobs {sorted(unknown)}; known: {sorted(ARITH_DEFAULTS)}")
    for name, value in knobs.items():  # a knob's type is its default's (steps=abc is not a count)
        want = type(ARITH_DEFAULTS[name])
        if type(value) is not want:
            kind = "true/false" if want is bool else want.__name__
            raise ValueError(f"bad arith knob {name}={value!r}: expected {kind} like its default "
                             f"{ARITH_DEFAULTS[name]!r}")
    split_name = parse_split(split)[0]
    if split_name not in ("train", "test"):
        raise ValueError(f"arith has splits 'train' and 'test', not {split_name!r}")
    size = {**ARITH_DEFAULTS, **knobs}[f"{split_name}_size"]
    gen = {k: v for k, v in knobs.items() if not k.endswith("_size")}
    indices = select(range(size), split, f"arith:{split_name}")
    return [arith_problem(i, split_name, seed, **gen) for i in indices]


def parse_knobs(text: str) -> dict:
    """'steps=3,high=999,ops=+-*' -> {'steps': 3, 'high': 999, 'ops': '+-*'} (for a --task_knobs flag)."""
    knobs = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"bad task knob {item!r}: expected name=value")
        value = value.strip()
        if re.fullmatch(r"-?\d+", value):
            knobs[name.strip()] = int(value)
        elif value.lower() in ("true", "false"):
            knobs[name.strip()] = value.lower() == "true"
        else:
            knobs[name.strip()] = value
    return knobs


# ---------------------------------------------------------------- files and hub


def _read_file(path: Path) -> list[tuple[int, dict]]:
    """(row number, row) pairs from a .jsonl (row number = line number), .json list, .parquet or .csv file (row
    number = the row's line, the header being line 1)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq  # installed with datasets

        return list(enumerate(pq.read_table(path).to_pylist(), 1))
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        row = raw[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}: row {row}: not UTF-8 text (byte {e.start})") from None
    if path.suffix == ".csv":
        return list(enumerate(csv.DictReader(io.StringIO(text, newline="")), 2))
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except (ValueError, RecursionError):
            data = None  # datasets' to_json writes JSON lines even into .json files (errors: named per row below)
        if isinstance(data, dict) and len(data) == 1:  # {"data": [...]}
            data = next(iter(data.values()))
        if isinstance(data, list):
            return list(enumerate(data, 1))
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except (ValueError, RecursionError) as e:  # also a JSON bomb (nesting), an integer of 5000 digits
                why = e.msg if isinstance(e, json.JSONDecodeError) else "nested too deeply" if isinstance(
                    e, RecursionError) else " ".join(str(e).split())
                raise ValueError(f"{path}: row {n}: not valid JSON ({why})") from None
    return rows


def _find_file(path: str, split_name: str) -> Path | None:
    """The local file for `path` (a file, or a directory with {split}.jsonl|.json|.parquet); None for a hub name."""
    p = Path(path).expanduser()
    if p.is_dir():
        for suffix in SUFFIXES:
            if (p / f"{split_name}{suffix}").is_file():
                return p / f"{split_name}{suffix}"
        raise FileNotFoundError(f"{p}: no {split_name}.jsonl, .json, .parquet or .csv in it")
    if p.exists() or p.suffix in SUFFIXES or path.startswith((".", "/", "~")) or path.count("/") != 1:
        return p  # a file path (missing files raise FileNotFoundError when read)
    return None


def _load_raw(task: str, split_name: str, path: str | None) -> tuple[str, list[tuple[int, dict]]]:
    """(source name for errors, numbered raw rows) from a local file or the hub."""
    file = _find_file(path, split_name) if path else None
    if file is not None:
        return str(file), _read_file(file)
    name, config = (path, None) if path else HUB[task].get(split_name, (None, None))
    if name is None:
        raise ValueError(f"{task} has no default hub dataset for split {split_name!r}; pass path=")
    try:
        import datasets

        ds = datasets.load_dataset(name, config, split=split_name)
    except Exception as e:  # offline, unknown name, unknown split: say what to do instead
        raise RuntimeError(
            f"could not load {name!r} split {split_name!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "offline? pass path= (--data_path) a local .jsonl/.json/.parquet/.csv file"
        ) from e
    return f"{name}:{split_name}", list(enumerate(ds, 1))


def _field(row, n: int, source: str, name: str) -> str:
    value = row.get(name) if isinstance(row, dict) else None
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{source}: row {n}: missing or empty field {name!r}")
    return value


_CALC_NOTE = re.compile(r"<<[^<>]*>>")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def gsm8k_row(row, n: int = 1, source: str = "gsm8k") -> dict:
    """GSM8K raw row {question, answer: "reasoning\\n#### N"} -> {question, answer: "N", solution}."""
    question, raw = _field(row, n, source, "question"), _field(row, n, source, "answer")
    reasoning, sep, gold = raw.rpartition("####")
    gold = gold.strip().replace(",", "").replace("$", "")
    if not sep or not _NUMBER.fullmatch(gold):
        raise ValueError(f"{source}: row {n}: field 'answer' has no '#### <number>' final line (got {raw[-40:]!r})")
    solution = _CALC_NOTE.sub("", reasoning).strip() or None  # "48/2 = <<48/2=24>>24" -> "48/2 = 24"
    return {"question": question.strip(), "answer": _gold(gold, n, source), "solution": solution, "numeric": True}


def math_row(row, n: int = 1, source: str = "math") -> dict:
    """MATH raw row {problem, solution[, answer]} -> {question, answer, solution}. A numeric answer (a JSON number)
    is its decimal text; without an answer, the solution's last \\boxed{}."""
    question, solution = _field(row, n, source, "problem"), _field(row, n, source, "solution")
    answer = row.get("answer")
    if isinstance(answer, int | float) and not isinstance(answer, bool) and math.isfinite(answer):
        answer = str(answer)
    elif answer is not None and not isinstance(answer, str):
        raise ValueError(f"{source}: row {n}: field 'answer' is {answer!r}, not a string or a number")
    if answer is None or not answer.strip():
        answer = last_boxed(solution)
        if not answer:
            given = "an empty field 'answer'" if row.get("answer") is not None else "no field 'answer'"
            raise ValueError(f"{source}: row {n}: {given} and no \\boxed{{...}} in field 'solution'")
    return {"question": question.strip(), "answer": _gold(answer.strip(), n, source), "solution": solution.strip(),
            "numeric": False}


def _gold(answer: str, n: int, source: str) -> str:
    """A gold answer verifier.answers_match can match: it rejects answers over MAX_ANSWER_CHARS."""
    if len(answer) > MAX_ANSWER_CHARS:
        raise ValueError(f"{source}: row {n}: the gold answer has {len(answer)} characters, over the "
                         f"{MAX_ANSWER_CHARS} that verifier.answers_match compares, so no completion could ever "
                         "match it: shorten it or drop the row")
    return answer


def custom_row(row, n: int, source: str, question_field: str = "question", answer_field: str = "answer",
               answer_regex: str = "", solution_field: str | None = None) -> dict:
    """Any dataset's raw row -> {question, answer, solution, numeric, + its other columns}. The gold is the answer
    column, or with answer_regex its first group (else the whole match) searched in it: '####\\s*(.+)' reads
    GSM8K's. A solution column that is the answer column itself gives the text before the match. numeric: the
    gold is a plain number (then a completion's answer must be one too, as for GSM8K)."""
    question = _field(row, n, source, question_field)
    raw = row.get(answer_field) if isinstance(row, dict) else None
    if isinstance(raw, int | float) and not isinstance(raw, bool) and math.isfinite(raw):
        raw = str(raw)  # JSON / Parquet numbers
    raw = _field({answer_field: raw}, n, source, answer_field)
    gold, solution = raw.strip(), None
    if answer_regex:
        m = re.search(answer_regex, raw)
        if m is None:
            raise ValueError(f"{source}: row {n}: field {answer_field!r} does not match --answer_regex "
                             f"{answer_regex!r} (ends {raw[-40:]!r})")
        gold = (m.group(1) if m.re.groups else m.group(0)).strip()
        if solution_field == answer_field:  # "reasoning\n#### 42": the reasoning
            solution = raw[: m.start()].strip() or None
    if solution_field and solution_field != answer_field:
        solution = row.get(solution_field) or None
    other = {k: v for k, v in row.items() if k not in ("question", "answer", "solution", "numeric", "system")}
    return {**other, "question": question.strip(), "answer": _gold(gold, n, source), "solution": solution,
            "numeric": bool(_NUMBER.fullmatch(gold))}


# ---------------------------------------------------------------- the one entry point


def load_task(task: str, split: str, *, path: str | None = None, seed: int = 0, columns: dict | None = None,
              **knobs) -> list[dict]:
    """Rows {"question", "answer", "solution"} of `task` for `split` (e.g. "train[:10%]"); see the module docstring.

    seed and knobs only apply to the built-in "arith" task (ARITH_DEFAULTS lists the knobs), columns (custom_row's
    keyword arguments) to "custom".
    """
    split_name = parse_split(split)[0]
    if task == "arith":
        if path:
            raise ValueError("the built-in arith task is generated; it takes no path")
        # the generator writes GSM8K-shaped rows, so the one GSM8K parser serves both
        return [gsm8k_row(r, n, "arith") for n, r in enumerate(arith_rows(split, seed, **knobs), 1)]
    if task not in (*HUB, "custom"):
        raise ValueError(f"unknown task {task!r}: expected arith, gsm8k, math or custom")
    if knobs:
        raise ValueError(f"task {task!r} takes no knobs (got {sorted(knobs)})")
    if task == "custom" and not path:
        raise ValueError("--task custom reads --data_path: a .jsonl/.json/.parquet/.csv file, a directory of "
                         "{split}.jsonl/..., or a hub dataset name")
    if task == "custom" and (columns or {}).get("answer_regex"):
        try:
            re.compile(columns["answer_regex"])
        except re.error as e:
            raise ValueError(f"--answer_regex {columns['answer_regex']!r}: not a regular expression ({e})") from None
    source, raw = _load_raw(task, split_name, path)
    if task == "custom":
        return select([custom_row(r, n, source, **(columns or {})) for n, r in raw], split, source)
    convert = gsm8k_row if task == "gsm8k" else math_row
    return select([convert(r, n, source) for n, r in raw], split, source)


COLUMN_FLAGS = {"question_field": "question", "answer_field": "answer", "answer_regex": "", "solution_field": None}


def load_splits(cfg, *splits: str) -> list[list[dict]]:
    """Each split's rows of a stage's task: its --task, --data_path, --data_seed and --task_knobs; with --task
    custom its column flags (COLUMN_FLAGS); --system_prompt, if given, goes on every row as "system"."""
    knobs = parse_knobs(cfg.task_knobs)
    columns = {k: getattr(cfg, k) for k in COLUMN_FLAGS if hasattr(cfg, k)}
    changed = [k for k, v in columns.items() if v != COLUMN_FLAGS[k]]
    if cfg.task != "custom" and changed:
        raise ValueError(f"--{changed[0]} is for --task custom (--task {cfg.task} knows its columns)")
    columns = columns if cfg.task == "custom" else None
    out = [load_task(cfg.task, s, path=cfg.data_path, seed=cfg.data_seed, columns=columns, **knobs) for s in splits]
    if getattr(cfg, "system_prompt", ""):
        out = [[{**r, "system": cfg.system_prompt} for r in rows] for rows in out]
    return out


# ---------------------------------------------------------------- prompts and targets


def format_prompt(question: str, template: str, tokenizer=None, system: str | None = None) -> tuple[str, str]:
    """(prompt_text, response_prefix). The scored response is response_prefix + completion.

    r1:    the plain-text R1 preamble for base models, ending "Assistant: <think>"  -> prefix "<think>"
    short: "{question}\\n<think>", for the char-level demo (every character is a token) -> prefix "<think>"
    chat:  the tokenizer's chat template, a system prompt asking for the format -> prefix "" (the model opens
           <think> itself), or "<think>" if the template already opens it (e.g. DeepSeek-R1 distills).
    system (--system_prompt): replaces r1's preamble / chat's system prompt; short has none.
    """
    if system and template == "short":
        raise ValueError("--system_prompt: template 'short' has no system prompt; use r1 or chat")
    if template == "r1":
        if system:
            return f"{system}\nUser: {question}\nAssistant: {THINK}", THINK
        return R1_PROMPT.format(question=question), THINK
    if template == "short":
        return f"{question}\n{THINK}", THINK
    if template == "chat":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("template 'chat' needs a tokenizer with a chat template; use 'r1' for base models")
        messages = [{"role": "system", "content": system or CHAT_SYSTEM_PROMPT}, {"role": "user", "content": question}]
        try:  # the template is the model dir's code (jinja2, sandboxed): any error it raises is the dir's
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # TemplateSyntaxError, UndefinedError, SecurityError, raise_exception, TypeError, ...
            raise ValueError(f"the tokenizer's chat template fails ({type(e).__name__}: {e}): fix its chat_template "
                             "(tokenizer_config.json or chat_template.jinja), or use --template r1") from None
        if not isinstance(text, str):
            raise ValueError(f"the tokenizer's chat template gave a {type(text).__name__}, not text")
        return text, THINK if text.rstrip().endswith(THINK) else ""
    raise ValueError(f"unknown template {template!r}: expected one of {TEMPLATES}")


def encode_prompt(tokenizer, text: str, template: str) -> list[int]:
    """Token ids of a format_prompt text. A chat template writes its special tokens itself (Llama 3's
    <|begin_of_text|>), so none are added again, as apply_chat_template(tokenize=True) does; the plain templates get
    the tokenizer's own (a base Llama's BOS; Qwen2.5 and the char tokenizer add none). One BOS either way."""
    return tokenizer.encode(text, add_special_tokens=template != "chat")


def sft_target(row: dict, response_prefix: str = THINK) -> str:
    """The completion SFT trains on: "reasoning</think> <answer>N</answer>" after a prompt that opened <think>.

    With response_prefix "" (chat templates) the target opens the tag itself: "<think>reasoning</think> ...".
    The caller appends EOS.
    """
    if not row.get("solution"):
        raise ValueError(f"row has no solution to train on (question {row.get('question', '')[:60]!r})")
    full = f"{THINK}{row['solution']}</think> <answer>{row['answer']}</answer>"
    if not full.startswith(response_prefix):
        raise ValueError(f"response_prefix must be '' or {THINK!r}, not {response_prefix!r}")
    return full[len(response_prefix) :]
