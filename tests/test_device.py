"""Every tensor lives where it is used: sft.py, grpo.py (with its in-loop eval, checkpoint save and resume) and eval.py
run whole on a second device, and any op that mixes it with a CPU tensor fails, as it would on a GPU.

The CPU wheel has no second device that runs this code (torch._lazy breaks on linear of a view, FakeTensorMode
cannot run .item() / .tolist() / the sampler's stop test), so the device is made here: a tensor subclass that holds
real CPU data but says it lives on "meta" (a device type autograd and the checkpoint code know), and a dispatch
mode that runs every op on the data and raises on a device mix. CUDA's rules are kept: a CPU 0-dim tensor may
take part as a scalar; copies between devices (.to, .cpu, .tolist, .item, copy_) are allowed; a random op needs a
generator of its own device. The test that it catches misplacement: test_harness_catches_misplacement.
torch.autocast on the device is emulated (DeviceAutocast), so --dtype bfloat16's paths run there too.
One process only: gloo's Python bindings refuse the subclass ("Unable to cast Python instance of type OnDevice"),
and DDP's reducer and FSDP2's DTensors call collectives from C++, so a two-process run on this device would need
the collectives reimplemented here; DDP and FSDP2 run over gloo on the CPU (tests/test_multinode.py and others).
"""

import types

import pytest
import torch
import torch.distributed.checkpoint.default_planner
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

import common
import eval as eval_lib
import grpo
import sft

DEV = torch.device("meta")
aten = torch.ops.aten
CROSSING = {aten._to_copy.default, aten.copy_.default, aten._local_scalar_dense.default, aten.lift_fresh.default}


class OnDevice(torch.Tensor):
    """Real CPU data (.elem) that reports device DEV."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(), dtype=elem.dtype,
                                                storage_offset=elem.storage_offset(), device=DEV,
                                                requires_grad=elem.requires_grad)  # fmt: skip
        r.elem = elem
        return r

    def tolist(self):  # a device -> host copy, like CUDA's
        return self.elem.tolist()

    def __repr__(self):
        return f"OnDevice({self.elem!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} on a device tensor outside the harness")


class DeviceGenerator(torch.Generator):
    """A generator of device DEV (its state lives on the CPU, like the data). The dispatcher hands ops a plain
    torch.Generator for it, so the harness knows device generators by their seeds."""

    seeds = set()

    @property
    def device(self):
        return DEV

    def manual_seed(self, seed):
        DeviceGenerator.seeds.add(seed)
        return super().manual_seed(seed)


class DeviceAutocast:
    """torch.autocast for DEV, which torch has not (meta has no autocast): while it is entered, HostData casts the
    floating inputs of the products and attention (autocast's lower-precision ops) on DEV to its dtype, before
    autograd, as autocast does, and torch.is_autocast_enabled / get_autocast_dtype report it for DEV, as the model
    and the sampler read them."""

    active = []  # the entered contexts' dtypes (None: entered with enabled=False)

    def __init__(self, device_type=None, dtype=torch.bfloat16, enabled=True, **kw):
        self.dtype = dtype if enabled else None

    def __enter__(self):
        DeviceAutocast.active.append(self.dtype)

    def __exit__(self, *exc):
        DeviceAutocast.active.pop()

    @staticmethod
    def dtype():
        return DeviceAutocast.active[-1] if DeviceAutocast.active else None


LOWER = {F.linear, torch.matmul, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.mm, torch.bmm, torch.addmm,
         torch.baddbmm, F.scaled_dot_product_attention}


def _autocast_args(func, args, kwargs):
    """DeviceAutocast's casts of one call's arguments (where any is on DEV)."""
    dtype = DeviceAutocast.dtype()
    flat = tree_flatten((args, kwargs))[0]
    if func not in LOWER or dtype is None or not any(isinstance(t, OnDevice) for t in flat):
        return args, kwargs
    cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return tree_map(cast, args), tree_map(cast, kwargs)


class SecondDevice(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        seen = []

        def unwrap(t):
            if isinstance(t, OnDevice):
                seen.append("dev")
                return t.elem
            if isinstance(t, torch.Tensor):
                assert t.device.type == "cpu", f"{func}: a real {t.device} tensor (data lost) entered the harness"
                if t.dim() > 0 or func in CROSSING:  # (a CPU 0-dim tensor may mix in as a scalar)
                    seen.append("cpu")
            return t

        a, k = tree_map(unwrap, args), tree_map(unwrap, kwargs)
        target = k.get("device")
        if target is not None:
            target = torch.device(target)
            k["device"] = torch.device("cpu") if target.type == DEV.type else target
        if func not in CROSSING and "dev" in seen and "cpu" in seen:
            raise RuntimeError(f"device mix: {func} got tensors on {DEV.type} and on cpu")
        gen = k.get("generator")
        on_dev = target.type == DEV.type if target is not None else "dev" in seen
        if gen is not None and (gen.initial_seed() in DeviceGenerator.seeds) != on_dev:
            raise RuntimeError(f"{func}: a generator on {gen.device} for a tensor on {DEV if on_dev else 'cpu'}")
        out = func(*a, **k)
        if func is aten.copy_.default or func._schema.name.endswith("_"):  # in place: the same (wrapped) tensor
            return args[0]
        if func in (aten._to_copy.default,) and target is not None:
            on_dev = target.type == DEV.type
        if func is aten._local_scalar_dense.default:
            on_dev = False
        return tree_map(lambda t: OnDevice(t) if on_dev and isinstance(t, torch.Tensor) else t, out)


class HostData(TorchFunctionMode):
    """torch.tensor(data, device=DEV) would copy the data to a real (empty) meta tensor below the dispatch mode: build
    it on the CPU, then copy it over through the harness, as CUDA does. Also DeviceAutocast's casts."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = _autocast_args(func, args, dict(kwargs or {}))
        if func in (torch.tensor, torch.as_tensor) and torch.device(kwargs.get("device") or "cpu").type == DEV.type:
            kwargs.pop("device")
            return func(*args, **kwargs).to(DEV)
        return func(*args, **kwargs)


def _make_generator(seed, *ints, device="cpu"):
    g = DeviceGenerator() if torch.device(device).type == DEV.type else torch.Generator(device="cpu")
    g.manual_seed(common.derive_seed(seed, *ints))
    return g


@pytest.fixture
def second_device(monkeypatch):
    """Scripts see DEV as their device (init_dist), make generators for it, and run inside the harness."""
    dist = lambda *a, **k: common.Dist(device=DEV)
    monkeypatch.setattr(common, "init_dist", dist)  # (every stage opens with common.start_stage)
    for mod in (grpo, eval_lib):
        monkeypatch.setattr(mod, "make_generator", _make_generator)
    # torch.utils.checkpoint looks up torch.<device type> for RNG and autocast state (never used: no RNG stashing)
    monkeypatch.setattr(torch, DEV.type, types.SimpleNamespace(), raising=False)
    # DCP's loader takes a meta tensor for one still to be materialised; these hold data already
    monkeypatch.setattr(torch.distributed.checkpoint.default_planner, "_init_state_dict", lambda state: None)
    # autocast on DEV: DeviceAutocast (meta has none of its own)
    real = torch.autocast, torch.is_autocast_enabled, torch.get_autocast_dtype
    on_dev = lambda *a, **k: torch.device(k.get("device_type", a[0] if a else "cpu")).type == DEV.type
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: (DeviceAutocast if on_dev(*a, **k) else real[0])(*a, **k))
    monkeypatch.setattr(torch, "is_autocast_enabled",
                        lambda *a: DeviceAutocast.dtype() is not None if a[:1] == (DEV.type,) else real[1](*a))
    monkeypatch.setattr(torch, "get_autocast_dtype",
                        lambda d: DeviceAutocast.dtype() if d == DEV.type else real[2](d))
    # module.to(dtype) on DEV: swap the tensors (param.data = t would keep the wrapper's old .elem)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with SecondDevice(), HostData():
            yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def test_harness_catches_misplacement(second_device):
    x = torch.ones(3, device=DEV)
    assert x.device == DEV and (x * 2).sum().item() == 6.0 and x.tolist() == [1.0, 1.0, 1.0]
    assert (x + torch.tensor(1.0)).device == DEV  # a CPU scalar tensor is fine, as on CUDA
    with pytest.raises(RuntimeError, match="device mix"):
        x + torch.ones(3)
    with pytest.raises(RuntimeError, match="device mix"):
        torch.nn.Embedding(5, 2).to(DEV)(torch.tensor([1, 2]))  # CPU token ids into a device embedding
    with pytest.raises(RuntimeError, match="generator on cpu"):
        torch.rand(2, device=DEV, generator=torch.Generator())
    w = torch.randn(4, 2, device=DEV, requires_grad=True)
    (torch.randn(3, 4, device=DEV) @ w).sum().backward()
    assert w.grad.device == DEV
    with torch.autocast(DEV.type, dtype=torch.bfloat16):  # DeviceAutocast: products in bf16, gradients in fp32
        assert torch.is_autocast_enabled(DEV.type) and torch.get_autocast_dtype(DEV.type) == torch.bfloat16
        y = torch.randn(3, 4, device=DEV) @ w
        with torch.autocast(DEV.type, enabled=False):
            assert (torch.randn(3, 4, device=DEV) @ w).dtype == torch.float32
    assert y.dtype == torch.bfloat16 and not torch.is_autocast_enabled(DEV.type)
    y.sum().backward()
    assert w.grad.dtype == torch.float32 and w.grad.device == DEV


FAST = ["--task", "arith", "--split", "train[:16]", "--eval_split", "test[:4]", "--max_new_tokens", "8"]


def test_sft_grpo_eval_on_a_second_device(second_device, tiny_dir, tmp_path):
    """An SFT run with its in-loop eval and final checkpoint; GRPO steps with a KL reference, in-loop eval and a
    checkpoint, then resumed from it; eval.py with sampling. Any CPU tensor meeting a device one fails them."""
    sft.main(["--init", str(tiny_dir), "--out_dir", str(tmp_path / "sft"), *FAST, "--global_batch", "4",
              "--micro_batch", "2", "--steps", "2", "--eval_every", "2", "--stop_pass1", "0"])  # fmt: skip
    flags = ["--init", str(tmp_path / "sft" / "model"), "--out_dir", str(tmp_path / "grpo"), *FAST,
             "--prompts_per_step", "2", "--group_size", "4", "--gen_batch", "1", "--train_micro_batch", "3",
             "--reward_weights", "overlong=1", "--beta", "0.1", "--mu", "2", "--eval_every", "1",
             "--save_every", "1"]  # fmt: skip
    grpo.main(flags + ["--steps", "1"])
    grpo.main(flags + ["--steps", "2"])  # resumes from step 1's checkpoint
    eval_lib.main(["--model", str(tmp_path / "grpo"), "--out_dir", str(tmp_path / "eval"), "--task", "arith",
                   "--split", "test[:3]", "--max_new_tokens", "8", "--samples", "2", "--batch_size", "2"])
    assert (tmp_path / "eval" / "summary.json").is_file()


BF16 = ["--dtype", "bfloat16", "--beta", "0.1"]


@pytest.mark.parametrize("flags", [["--share_prompt", "false"], ["--lora_rank", "2", "--beta", "0.1"], BF16,
                                   BF16 + ["--lora_rank", "2"]],
                         ids=["packed-segments", "lora", "bf16-autocast", "bf16-lora"])
def test_grpo_paths_on_a_second_device(second_device, tiny_dir, tmp_path, flags):
    """#48 item 2: the paths the default run does not take. --share_prompt false: the training batch without
    shared prompts (packed by segment ids where sequences fit: test_packed_forward_on_a_second_device); LoRA with
    the base as the KL reference (lora_A made on the CPU, without device=, fails here: checked by mutation);
    --dtype bfloat16 under DeviceAutocast, with the reference's bf16 projections and the LoRA base's cast
    (model.head_logits' fp32 input moved to the CPU, lora.base_cast's copy or common.frozen_in_compute_dtype's
    projections made there, fails here: checked by mutation)."""
    grpo.main(["--init", str(tiny_dir), "--out_dir", str(tmp_path / "grpo"), *FAST, "--prompts_per_step", "2",
               "--group_size", "4", "--gen_batch", "2", "--reward_weights", "overlong=1", "--eval_every", "0",
               "--steps", "1", *flags])  # fmt: skip
    assert (tmp_path / "grpo" / "metrics.jsonl").is_file()


@pytest.mark.parametrize("expand", [False, True], ids=["enable_gqa", "expanded-kv"])
def test_packed_forward_on_a_second_device(second_device, tiny_dir, monkeypatch, expand):
    """#48 item 2: a forward and backward over packed rows masked by segment ids (grpo.py --share_prompt false packs
    rows so where sequences fit; the tiny GRPO runs above rarely do), on the device: the causal mask
    model.attention_mask builds must be made there (a torch.ones(T, T) without device= fails here: checked by
    mutation). expanded-kv: with K/V expanded to the query heads before SDPA, as on CUDA (model.expand_kv)."""
    import model as M
    from hf import load_model

    if expand:
        monkeypatch.setattr(M, "expand_kv", lambda *a: True)

    model = load_model(tiny_dir).to(DEV)
    tokens = torch.randint(3, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(DEV)
    seg = torch.tensor([[0] * 5 + [5] * 7, [12] * 12]).to(DEV)
    pos = torch.tensor([list(range(5)) + list(range(7)), list(range(12))]).to(DEV)
    logp, _ = model(tokens, input_pos=pos, segments=seg, targets=tokens)
    logp.sum().backward()
    assert logp.device == DEV and model.lm_head.weight.grad.device == DEV
