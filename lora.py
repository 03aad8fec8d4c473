"""LoRA adapters on the Transformer's projections: add, merge, switch off, and PEFT's adapter files.

    add_lora(model, rank=16, alpha=32.0)   # freezes the model; only the adapters train
    with adapters_off(model): ...          # the base model (GRPO's KL reference, no second copy)
    save_adapter(model, "out/")            # a PEFT adapter dir; load_adapter(model, "out/") reads it back
"""

import json
import math
import os
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as tdist
import torch.nn as nn
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from model import Transformer

# LoRA (Hu et al. 2021): a frozen projection W plus a trainable low-rank update, y = W x + (alpha / r) B A x.
# Parameter names are PEFT's (q_proj.lora_A.weight, ...) and the base keeps its HF name (q_proj.weight), so the base
# weights still load strictly by name and the adapter file is PEFT's after a prefix.

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRALinear(nn.Module):
    """A frozen nn.Linear's weight and bias, plus lora_A (r, in) and lora_B (out, r) in fp32. B starts at zero, so a
    fresh adapter leaves the model unchanged; A starts as PEFT's does (U(-1/sqrt(in), 1/sqrt(in))), from `generator`."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float, generator: torch.Generator):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias  # the same tensors, under the same names
        device, n_in = base.weight.device, base.in_features
        self.lora_A = nn.Linear(n_in, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device=device, dtype=torch.float32)
        with torch.no_grad():
            a = (torch.rand(rank, n_in, generator=generator) * 2 - 1) / math.sqrt(n_in)  # on the CPU: any device
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()
        self.scale = alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.enabled = True  # False: the base projection alone (the KL reference, see adapters_off)
        self.linear = F.linear  # the base product (fast.use_onednn swaps in oneDNN's)
        self.cast = None  # the weight in the compute dtype, inside base_cast

    def forward(self, x):  # x (B, T, in) -> (B, T, out)
        w = self.weight if self.cast is None else self.cast
        y = self.linear(x, w, self.bias)
        if not self.enabled:
            return y
        a = self.lora_A(self.dropout(x).to(self.lora_A.weight.dtype))  # (B, T, r)
        return y + (self.lora_B(a) * self.scale).to(y.dtype)

    def delta(self) -> torch.Tensor:
        """(out, in) fp32: what merging adds to the weight, scale * B @ A (full tensors, also under FSDP2)."""
        return self.scale * _full(self.lora_B.weight) @ _full(self.lora_A.weight)


def check_lora(rank: int, alpha: float, dropout: float, targets) -> None:
    """ValueError unless the settings make an adapter (what add_lora and the memory estimate accept)."""
    bad = sorted(set(targets) - set(LORA_TARGETS))
    if rank < 1 or not alpha > 0 or not 0 <= dropout < 1 or bad or not targets:
        raise ValueError(f"bad LoRA settings: rank={rank} (want >= 1), alpha={alpha} (> 0), dropout={dropout} "
                         f"(in [0, 1)), targets {list(targets)} (a non-empty subset of {list(LORA_TARGETS)})")


def add_lora(model: "Transformer", rank: int, alpha: float, dropout: float = 0.0, targets=LORA_TARGETS, *,
             seed: int = 0, base_dtype: torch.dtype | None = None, base: str | None = None) -> "Transformer":
    """Freeze every weight of the model (cast to base_dtype if given) and wrap the `targets` projections of each
    block in LoRALinear, in place; A is drawn from `seed`, so every rank builds the same adapter. `base` names the
    base model in the exported adapter_config.json. Returns the model, with model.lora its settings (PEFT's names)."""
    check_lora(rank, alpha, dropout, targets)
    if base_dtype is not None:
        model.to(base_dtype)
    model.requires_grad_(False)
    g = torch.Generator().manual_seed(seed)
    for block in model.layers:
        block.draws_random = dropout > 0
        for parent in (block.self_attn, block.mlp):
            for name, child in list(parent.named_children()):
                if name in targets:
                    setattr(parent, name, LoRALinear(child, rank, alpha, dropout, g))
    model.lora = {"r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
                  "target_modules": [t for t in LORA_TARGETS if t in targets], "base_model_name_or_path": base}
    return model


def lora_layers(model) -> dict[str, LoRALinear]:
    """Name (as in the state dict, DDP's "module." stripped) -> LoRALinear; empty for a model without LoRA."""
    return {k.removeprefix("module."): m for k, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_lora(model: "Transformer") -> "Transformer":
    """Fold each adapter into its weight, W + scale * B @ A in W's dtype, and drop the adapters: a plain model again
    (in place; not under FSDP2). Returns the model."""
    for name, m in lora_layers(model).items():
        parent, child = model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]
        plain = nn.Linear(m.weight.shape[1], m.weight.shape[0], bias=m.bias is not None, device="meta")
        with torch.no_grad():
            plain.weight = nn.Parameter((m.weight.float() + m.delta()).to(m.weight.dtype), requires_grad=False)
        plain.bias = m.bias
        setattr(parent, child, plain)
    model.lora = None
    return model


@contextmanager
def adapters_off(model):
    """The base model: every LoRA update switched off for the duration (the GRPO reference, no second copy)."""
    layers = lora_layers(model).values()
    for m in layers:
        m.enabled = False
    try:
        yield model
    finally:
        for m in layers:
            m.enabled = True


@contextmanager
def base_cast(model, dtype: torch.dtype):
    """Each LoRA layer's frozen base weight cast to `dtype` once, held for the duration (common.autocast enters
    it). torch.autocast caches only the casts of weights that train: a frozen fp32 base would be cast again at
    every call, at each decode step (~6 GB read and written at 1.5B). The same values autocast's cast gives; the
    stored weights are untouched (the merged export stays fp32)."""
    layers = [m for m in lora_layers(model).values() if m.weight.dtype != dtype]
    for m in layers:
        m.cast = m.weight.detach().to(dtype)
    try:
        yield model
    finally:
        for m in layers:
            m.cast = None


def _full(v: torch.Tensor) -> torch.Tensor:
    return v.full_tensor() if isinstance(v, DTensor) else v


def _fsync(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def save_safetensors(tensors: dict, path):
    """safetensors' save_file, fsynced, with the permissions of any file this user creates (save_file makes it 0600:
    unreadable to a shared cluster group)."""
    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    _fsync(path)


# PEFT's adapter format: adapter_config.json + adapter_model.safetensors, keys named as in PeftModel's state dict
ADAPTER_PREFIX = "base_model.model.model."


def save_adapter(model, path, tokenizer=None) -> None:
    """Writes the LoRA adapter alone as a PEFT adapter dir, which peft.PeftModel.from_pretrained(base, path) loads
    onto the base model (and load_adapter here). Every rank must call it (FSDP2 gathers); rank 0 writes."""
    model = model.module if isinstance(model, DistributedDataParallel) else model
    main = not tdist.is_initialized() or tdist.get_rank() == 0
    tensors = {}
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            v = _full(v)  # FSDP2: a collective, on every rank in the same order
            tensors[ADAPTER_PREFIX + k] = v.detach().cpu().contiguous()
    if not main:
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**model.lora, "peft_type": "LORA", "task_type": "CAUSAL_LM", "bias": "none", "fan_in_fan_out": False,
           "inference_mode": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}
    (path / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_safetensors(tensors, path / "adapter_model.safetensors")
    if tokenizer is not None:
        tokenizer.save_pretrained(path)


def load_adapter(model: "Transformer", path, base_dtype: torch.dtype | None = None) -> "Transformer":
    """Adds the PEFT LoRA adapter in `path` (ours, or one peft saved) to the model, in place; returns the model."""
    path = Path(path)
    try:
        cfg = json.loads((path / "adapter_config.json").read_text())
        targets = cfg["target_modules"]
        targets = [targets] if isinstance(targets, str) else targets
        if cfg.get("peft_type") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora") or cfg.get("rank_pattern"):
            raise ValueError("only plain LoRA adapters are supported (no DoRA, rsLoRA or per-layer ranks)")
        add_lora(model, cfg["r"], cfg["lora_alpha"], 0.0, targets, base_dtype=base_dtype,
                 base=cfg.get("base_model_name_or_path"))
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path / 'adapter_config.json'}: not a usable LoRA adapter config ({e})") from None
    try:
        state = load_file(path / "adapter_model.safetensors")
    except (OSError, SafetensorError) as e:
        raise ValueError(f"{path / 'adapter_model.safetensors'}: unreadable ({e})") from None
    state = {k.removeprefix(ADAPTER_PREFIX).replace(".default.", "."): v for k, v in state.items()}
    want = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    if state.keys() != want.keys() or any(state[k].shape != v.shape for k, v in want.items()):
        raise ValueError(f"{path}: the adapter's tensors do not fit this base model (e.g. "
                         f"{sorted(state.keys() ^ want.keys())[:2]}); is it the base the adapter was trained on?")
    model.load_state_dict(state, strict=False)
    return model
