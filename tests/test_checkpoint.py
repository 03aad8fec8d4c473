"""checkpoint.py: the sharded (DCP) training state, its atomic save, loading at another world size, the HF export.

The reference for "the state a checkpoint holds" is DCP's own converter (format_utils.dcp_to_torch_save, a single
process reading every rank's file into full tensors) and, for the weights, the HF files read by safetensors; the
multi-rank cases are real torchrun subprocesses on gloo."""

import os
import pickle
import sys
from pathlib import Path

import pytest
import torch
from conftest import run_job
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import checkpoint
import common
import model as model_lib
from hf import char_tokenizer, load_model, save_model

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _tiny(layers=1):
    tok = char_tokenizer()
    cfg = model_lib.preset_config("tiny", len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    return model_lib.Transformer(cfg), tok


def saved_state(ckpt: Path, tmp_path: Path) -> dict:
    """Everything in a checkpoint's train_state/, as full tensors, read by DCP's own converter."""
    out = tmp_path / f"{ckpt.parent.name}_{ckpt.name}.pt"
    dcp_to_torch_save(ckpt / checkpoint.TRAIN_STATE, out)
    return torch.load(out, weights_only=True)


def assert_equal_states(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], dict):
            assert_equal_states(a[k], b[k])
        else:
            assert torch.equal(a[k], b[k]), k


def test_checkpoint_roundtrip(tmp_path):
    torch.manual_seed(0)
    model, tok = _tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    d = common.Dist()
    for step in (1, 2, 3):
        model(torch.randint(0, 50, (2, 5))).sum().backward()
        opt.step()
        opt.zero_grad()
        torch.manual_seed(100 + step)  # the global RNG state the checkpoint must restore
        checkpoint.save_checkpoint(tmp_path, step, model, tok, {"data_position": 8 * step}, d, optimizer=opt,
                                   rank_state={"gen": common.make_generator(7, step).get_state()}, keep=2)
    after_save = torch.rand(3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000002", "step_000003"]
    ckpt = tmp_path / "step_000003"
    assert {p.name for p in ckpt.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json", "train_state",
                                                "rng_rank0.pt", "progress.json"}  # fmt: skip
    assert checkpoint.find_latest(tmp_path) == ckpt
    assert checkpoint.resolve_model_dir(tmp_path) == ckpt
    # an interrupted later save (no progress.json) and a stale tmp dir are ignored
    (tmp_path / "step_000009").mkdir()
    (tmp_path / ".tmp_step_000010").mkdir()
    (tmp_path / "latest").unlink()
    assert checkpoint.find_latest(tmp_path) == ckpt

    fresh, _ = _tiny()
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=5e-3, weight_decay=0.5)  # the new run's hyperparameters
    torch.manual_seed(999)
    state, rank_state = checkpoint.load_checkpoint(ckpt, fresh, d, optimizer=opt2)
    assert state == {"step": 3, "world_size": 1, "data_position": 24}
    assert torch.equal(torch.rand(3), after_save)  # the global torch RNG continues where the save left it
    assert torch.equal(rank_state["gen"], common.make_generator(7, 3).get_state())
    for (k, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), k
    s1, s2 = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[i][k], s2[i][k]) for i in s1 for k in ("exp_avg", "exp_avg_sq", "step"))
    assert opt2.param_groups[0]["lr"] == 5e-3 and opt2.param_groups[0]["weight_decay"] == 0.5  # not the saved ones
    # the checkpoint is a self-contained HF model dir; publish_model copies the model files only
    checkpoint.publish_model(ckpt, tmp_path / "model", common.Dist())
    assert {p.name for p in (tmp_path / "model").iterdir()} >= {"config.json", "model.safetensors"}
    assert not list((tmp_path / "model").glob("*.pt")) and not (tmp_path / "model" / "train_state").exists()
    x = torch.randint(0, 50, (1, 6))
    assert torch.allclose(load_model(tmp_path / "model")(x), model(x))


def test_metadata_is_read_through_an_allowlist(tmp_path):
    """DCP's .metadata is a pickle: one naming anything but DCP's own classes is refused, not executed."""
    model, tok = _tiny()
    ckpt = checkpoint.save_checkpoint(tmp_path, 1, model, tok, {}, common.Dist())

    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (ckpt / "train_state" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ValueError, match="posix.system is not allowed in a checkpoint's metadata"):
        checkpoint.load_checkpoint(ckpt, _tiny()[0], common.Dist())
    assert not (tmp_path / "pwned").exists()


class _Pwn:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, ("touch " + self.marker,))


def _bytes_entry(ckpt: Path, marker: Path) -> None:
    """Turn one tensor of ckpt's train_state into a DCP "bytes" entry whose storage is a pickle that runs a command
    (DCP's load_bytes reads it with torch.load(weights_only=False))."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    ts = ckpt / checkpoint.TRAIN_STATE
    meta = pickle.loads((ts / ".metadata").read_bytes())  # our own file: trusted here
    key = next(k for k in meta.state_dict_metadata if k.startswith("model."))
    evil = pickle.dumps(_Pwn(marker))
    (ts / "evil.distcp").write_bytes(evil)
    meta.state_dict_metadata[key] = BytesStorageMetadata()
    meta.storage_data = {k: v for k, v in meta.storage_data.items() if k.fqn != key}
    meta.storage_data[MetadataIndex(key)] = _StorageInfo("evil.distcp", 0, len(evil))
    (ts / ".metadata").write_bytes(pickle.dumps(meta))


@pytest.mark.parametrize("layer", ["allowlist", "planner"])
def test_a_checkpoint_built_to_run_code_does_not(tmp_path, monkeypatch, layer):
    """A tensor re-labelled as DCP bytes, its storage a pickle of os.system: loading refuses it with one error line
    and runs nothing. Each defence is tested alone: the allowlist (no BytesStorageMetadata), and the planner
    (load_bytes refuses) with the allowlist and the reader's check opened up."""
    model, tok = _tiny()
    ckpt = checkpoint.save_checkpoint(tmp_path / "run", 1, model, tok, {}, common.Dist())
    marker = tmp_path / "pwned"
    _bytes_entry(ckpt, marker)
    if layer == "planner":
        allowed = {**checkpoint._METADATA_CLASSES}
        allowed["torch.distributed.checkpoint.metadata"] = allowed["torch.distributed.checkpoint.metadata"] | {
            "BytesStorageMetadata"}
        monkeypatch.setattr(checkpoint, "_METADATA_CLASSES", allowed)
        monkeypatch.setattr(checkpoint, "_check_metadata", lambda path, metadata: None)  # the reader's check: off
        want = "is stored as bytes, not a tensor; minigrpo saves only tensors"
    else:
        want = "BytesStorageMetadata is not allowed in a checkpoint's metadata"
    with pytest.raises((CheckpointException, ValueError), match=want):
        checkpoint.load_checkpoint(ckpt, _tiny()[0], common.Dist())
    assert not marker.exists()


def test_hf_export_in_several_files_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model, tok = _tiny(layers=2)
    save_model(model, tmp_path, tok, max_file_bytes=40_000)  # a few tensors per file
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert (tmp_path / "model.safetensors.index.json").is_file()
    x = torch.randint(0, 50, (2, 7))
    want = model(x)
    assert torch.equal(load_model(tmp_path)(x), want)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    with torch.no_grad():
        assert torch.allclose(hf(x).logits, want, atol=1e-5)
    save_model(model, tmp_path, tok)  # saved again as one file: no stale shard or index is left behind
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


# -----------------------------------------------------------------------------
# several ranks: save under one world size / wrapping, load under another

_WORKER = r"""
import sys, torch
import checkpoint, common, model as M
from hf import char_tokenizer
mode, action, run_dir = sys.argv[1], sys.argv[2], sys.argv[3]
d = common.init_dist()
tok = char_tokenizer()
cfg = M.preset_config("tiny", len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
torch.manual_seed(0)  # the same init on every rank
model = common.wrap_model(M.Transformer(cfg), mode, d)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
if action == "train":  # two steps on rank-specific data, then a checkpoint
    for step in (1, 2):
        x = torch.randint(0, 50, (2, 9), generator=torch.Generator().manual_seed(10 * step + d.rank))
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    checkpoint.save_checkpoint(run_dir, 2, model, tok, {"data_position": 2}, d, optimizer=opt)
else:  # load, then save the loaded state again under this world size as step 3
    src = checkpoint.find_latest(run_dir)
    state, _ = checkpoint.load_checkpoint(src, model, d, optimizer=opt)
    assert state["step"] == 2 and state["data_position"] == 2, state
    checkpoint.save_checkpoint(sys.argv[4], 3, model, tok, {}, d, optimizer=opt)
common.cleanup_dist()
# free what holds the gloo group while the interpreter is whole (left to shutdown, gloo can abort the process)
del model, opt
import gc; gc.collect()
"""


def _launch(nproc: int, *args):
    cmd = [sys.executable, "-c", _WORKER, *args] if nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
        "--no-python", sys.executable, "-c", _WORKER, *args]  # fmt: skip
    r = run_job(cmd, 300, env=ENV, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(nproc, dist mode) -> a run dir whose step-2 checkpoint that many ranks wrote (made once, on first use)."""
    made = {}

    def get(nproc: int, mode: str) -> Path:
        if (nproc, mode) not in made:
            made[nproc, mode] = tmp_path_factory.mktemp(f"saved_{nproc}_{mode}")
            _launch(nproc, mode, "train", str(made[nproc, mode]))
        return made[nproc, mode]

    return get


@pytest.mark.parametrize("save, load", [((2, "fsdp"), (2, "fsdp")), ((2, "fsdp"), (1, "none")),
                                        ((1, "none"), (2, "fsdp")), ((2, "fsdp"), (2, "ddp"))])
def test_state_loads_bitwise_at_another_world_size(saved, tmp_path, save, load):
    """A checkpoint written by N ranks, loaded by M ranks (and another wrapping), holds bitwise the same weights and
    optimizer state: the loaded state, saved again, equals the original, tensor for tensor, both read back by DCP's
    own converter. The saved weights also equal the HF export's."""
    src, dst = saved(*save), tmp_path / "dst"
    ckpt = checkpoint.find_latest(src)
    assert sorted(p.name for p in (ckpt / "train_state").glob("*.distcp")) == [f"__{r}_0.distcp"
                                                                               for r in range(save[0])]
    assert sorted(p.name for p in ckpt.glob("rng_rank*.pt")) == [f"rng_rank{r}.pt" for r in range(save[0])]
    _launch(load[0], load[1], "load", str(src), str(dst))
    a, b = saved_state(ckpt, tmp_path), saved_state(dst / "step_000003", tmp_path)
    assert a["optimizer"]["layers.0.mlp.up_proj.weight"]["exp_avg"].abs().sum() > 0  # real optimizer state
    assert_equal_states(a, b)
    hf = load_model(ckpt).state_dict()
    assert all(torch.equal(hf[k], a["model"][k]) for k in hf)
