"""Hugging Face directories <-> Transformer: config.json + model.safetensors (or shards + their index), and the
tokenizer helpers every stage shares.

    model = load_model("Qwen2.5-0.5B")    # any HF dir of model_type llama, qwen2 or qwen3 (safetensors)
    save_model(model, "out/", tokenizer)   # an HF directory again (a LoRA model merged)

load_config reads config.json and checks it (ModelConfig's checks, model.check_size) before any weight is read;
char_tokenizer is the demo's tokenizer.
"""

import json
import string
from pathlib import Path

import torch
import torch.distributed as tdist
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch.nn.parallel import DistributedDataParallel

from lora import _full, lora_layers, save_safetensors
from model import ModelConfig, Transformer, check_size


def _shard_files(path: Path) -> list[str]:
    """The weight files of an HF dir: model.safetensors, or the files its shard index names. Those must be plain
    file names in the dir (an index naming "/abs/x" or "../x" would load weights from elsewhere)."""
    index = path / "model.safetensors.index.json"
    if not index.exists():
        return ["model.safetensors"]
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise ValueError(f"{index}: not a shard index (needs a \"weight_map\" object of tensor -> file name); "
                         "save or download it again")
    files = sorted(set(weight_map.values()))
    for f in files:
        if Path(f).name != f or f in (".", ".."):
            raise ValueError(f"{index}: weight_map names {f[:80]!r}, not a file in {path}; fix the index")
    return files


def _read_state(path: Path) -> dict:
    files = _shard_files(path)
    state = {}
    for name in files:
        if not (path / name).exists():
            hint = " (only pickle weights found: convert them to safetensors)" if any(path.glob("*.bin")) else ""
            raise FileNotFoundError(f"{path / name}: weights file not found{hint}")
        try:
            state.update(load_file(path / name))
        except SafetensorError as e:
            raise ValueError(f"{path / name}: unreadable safetensors file, truncated or corrupt ({e}); "
                             "save or download it again") from None
    return {k.removeprefix("model."): v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}


def load_config(path, size_limits: bool = True) -> ModelConfig:
    """An HF model directory's config.json (no weights read), checked: types, ranges, divisibility and, unless
    size_limits is False, check_size."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model directory (want an HF dir: config.json + model.safetensors)")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path / 'config.json'}: not found; is {path} a Hugging Face model directory?")
    try:
        try:
            d = json.loads((path / "config.json").read_text())
        except ValueError as e:  # (also a file that is not UTF-8)
            raise ValueError(f"not valid JSON ({e})") from None
        cfg = ModelConfig.from_hf(d)
        if size_limits:
            check_size(cfg)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from None
    gen = path / "generation_config.json"
    if gen.is_file():  # chat models list more stop ids there than in config.json (Qwen2.5-Instruct: <|endoftext|>)
        try:
            extra = json.loads(gen.read_text()).get("eos_token_id")
        except ValueError as e:
            raise ValueError(f"{gen}: not valid JSON ({e})") from None
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in _as_list(extra)):
            raise ValueError(f"{gen}: eos_token_id={extra!r}: expected a token id or a list of them")
        ids = list(dict.fromkeys(_as_list(cfg.eos_token_id) + _as_list(extra)))
        cfg.eos_token_id = ids[0] if len(ids) == 1 else ids or None  # saved so, the union stays with the model
    return cfg


def load_model(path, device="cpu", dtype=torch.float32, size_limits: bool = True) -> Transformer:
    """An HF model dir -> Transformer; config.json is checked (load_config) before any weight is read."""
    path = Path(path)
    cfg = load_config(path, size_limits)
    state = _read_state(path)
    if cfg.tie_word_embeddings and "embed_tokens.weight" in state:
        state["lm_head.weight"] = state["embed_tokens.weight"]  # HF omits the tied copy
    with torch.device("meta"):  # shapes only: no memory, no random init
        model = Transformer(cfg)
    want = model.state_dict()
    missing, unexpected = sorted(want.keys() - state.keys()), sorted(state.keys() - want.keys())
    if missing or unexpected:
        raise ValueError(f"{path}: weights do not match config.json: missing {missing[:4]}, unexpected "
                         f"{unexpected[:4]} ({len(missing)} and {len(unexpected)} in all)")
    for k, v in want.items():
        if state[k].shape != v.shape:
            raise ValueError(f"{path}: tensor {k} has shape {tuple(state[k].shape)}, config.json implies "
                             f"{tuple(v.shape)}; the config does not belong to these weights")
    # copy=True: safetensors' tensors map the file; a tool rewriting it in place would change or crash the model
    model.load_state_dict({k: v.to(device, dtype, copy=True) for k, v in state.items()}, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # assign=True made two parameters; re-tie them
    return model


def save_model(model, path, tokenizer=None, max_file_bytes: int = 2**31) -> None:
    """Writes an HF model directory: config.json, the weights in safetensors files of at most max_file_bytes
    (model.safetensors, or model-0000k-of-0000n.safetensors + model.safetensors.index.json) and the tokenizer.
    DDP and FSDP2 models work; every rank must call it. Under FSDP2 each tensor is gathered in turn, so no rank
    holds the whole model; rank 0 alone writes, holding at most one file's tensors. A LoRA model is written merged
    (W + scale * B @ A, in W's dtype): a plain model of the same architecture."""
    model = model.module if isinstance(model, DistributedDataParallel) else model
    main = not tdist.is_initialized() or tdist.get_rank() == 0
    tied = model.config.tie_word_embeddings
    lora = {k + ".weight": m for k, m in lora_layers(model).items()}
    state = {k: v for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight") and ".lora_" not in k}  # HF re-ties
    files = [[]]  # tensor names per file, in order, each file <= max_file_bytes (or one tensor larger)
    size = 0
    for k, v in state.items():
        nbytes = v.numel() * v.element_size()  # global size, also for a DTensor shard
        if files[-1] and size + nbytes > max_file_bytes:
            files.append([])
            size = 0
        files[-1].append(k)
        size += nbytes
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    path = Path(path)
    if main:
        path.mkdir(parents=True, exist_ok=True)
        for stale in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
            stale.unlink(missing_ok=True)  # an old file or shard index would mix with the new weights on load
        dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
        cfg = model.config.to_hf() | {"torch_dtype": dtype}
        (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for keys, name in zip(files, names):
        part = {}
        for k in keys:
            v = _full(state[k])  # FSDP2: a collective
            if k in lora:
                v = (v.float() + lora[k].delta()).to(v.dtype)
            if main:
                part[_hf_name(k)] = v.detach().cpu().contiguous()
        if main:
            save_safetensors(part, path / name)
    if main and len(files) > 1:
        total = sum(v.numel() * v.element_size() for v in state.values())
        weight_map = {_hf_name(k): name for keys, name in zip(files, names) for k in keys}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if main and tokenizer is not None:
        tokenizer.save_pretrained(path)


def _hf_name(key: str) -> str:
    return key if key == "lm_head.weight" else "model." + key  # HF nests all but the head in .model


def load_tokenizer(path):
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path}: no such tokenizer directory")
    if not any((Path(path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        # (transformers' own message for this case is five generic lines that do not name the directory)
        raise FileNotFoundError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json) in it")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # the tokenizers library raises a bare Exception for a malformed tokenizer.json
        raise ValueError(f"{path}: unreadable tokenizer files ({type(e).__name__}: {e}); save or download them "
                         "again") from None


def stop_and_pad_ids(tokenizer, cfg: ModelConfig) -> tuple[list[int], int]:
    """The ids generation stops on and the id padding uses, one rule for every stage (sampler, SFT, eval).
    Stop ids: the tokenizer's eos_token_id first (SFT ends its targets with it), then config.json's eos_token_id (an
    int or a list), which load_model merged with generation_config.json's: Qwen2.5-Instruct stops on <|im_end|> and
    <|endoftext|>, Llama-3.x-Instruct on <|eot_id|> and <|end_of_text|> (and <|eom_id|>).
    Pad id: the tokenizer's pad token, else config.json's pad_token_id, else the first stop id (Llama 3 has no pad
    token). Padding is masked out of attention and the loss everywhere, so which id it is never matters."""
    stops = list(dict.fromkeys(i for i in [tokenizer.eos_token_id, *_as_list(cfg.eos_token_id)] if i is not None))
    if not stops:
        raise ValueError("no stop token: neither the tokenizer nor config.json / generation_config.json names an "
                         "eos_token_id; set one in the model directory's config.json")
    pad = next((i for i in (tokenizer.pad_token_id, cfg.pad_token_id) if i is not None), stops[0])
    named = {"the tokenizer's eos_token_id": tokenizer.eos_token_id, "config.json's eos_token_id": cfg.eos_token_id,
             "the tokenizer's pad_token_id": tokenizer.pad_token_id, "config.json's pad_token_id": cfg.pad_token_id}
    for what, ids in named.items():
        for i in set(_as_list(ids)) & {*stops, pad}:  # (the ids in use: a pad the tokenizer overrides is not)
            if not (isinstance(i, int) and not isinstance(i, bool) and 0 <= i < cfg.vocab_size):
                raise ValueError(f"{what} {i} is not a token id of this model (0 .. vocab_size - 1 = "
                                 f"{cfg.vocab_size - 1}): fix it in the model directory")
    return stops, pad


def check_token_ids(seqs, vocab_size: int, what: str):
    """A ValueError when a tokenized text holds an id past the model's embeddings (a tokenizer of a larger
    vocabulary than config.json's vocab_size): say so before anything runs, not as an index error at step 1."""
    top = max((max(ids) for ids in seqs if ids), default=-1)
    if top >= vocab_size:
        raise ValueError(f"{what} tokenize to id {top}, past config.json's vocab_size {vocab_size}: the tokenizer "
                         "does not belong to this model")


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def char_tokenizer():
    """One token per character: <pad>=0, <bos>=1, <eos>=2, <unk>=3, then "\\n" and printable ASCII.
    encode() adds no special tokens (like Qwen2.5's), so decode(encode(text)) == text exactly."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<bos>", "<eos>", "<unk>"]
    chars = ["\n"] + [c for c in string.printable if 32 <= ord(c) < 127]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    tok = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))  # no merges: every char is its own token
    tok.decoder = decoders.Fuse()  # join the characters back without separators
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)
