"""sampler.generate against cache-free decoding, HF generate and teacher-forced log-probs; DDP and FSDP2 runs."""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import fast
from hf import save_model
from lora import LORA_TARGETS, adapters_off, add_lora, lora_layers
from model import ModelConfig, Transformer
from sampler import generate, sample

V = 53
PROMPTS = [[5, 9, 11, 3, 7, 2, 8], [4, 1], [12, 30, 6, 6, 40], [17]]  # ragged on purpose


def tiny_model(seed=0):
    cfg = ModelConfig(model_type="qwen2", vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    m = Transformer(cfg).eval()
    with torch.no_grad():  # O(1) logits, so greedy decoding never hinges on a rounding-level tie
        for p in m.parameters():
            p.normal_(0.0, 0.3).add_(p.dim() == 1)
    return m


def greedy_no_cache(model, prompt, n):
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(model(torch.tensor([seq]))[0, -1].argmax().item())
    return seq[len(prompt):]


def test_greedy_matches_uncached_argmax_and_hf(tmp_path):
    model = tiny_model()
    out = generate(model, PROMPTS, 12, temperature=0)
    assert out.tokens.shape == (4, 12) and out.mask.all() and out.truncated.all()
    for row, prompt in zip(out.tokens.tolist(), PROMPTS):
        assert row == greedy_no_cache(model, prompt, 12)
    # HF generate on the same weights, the same left-padded batch
    save_model(model, tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    L = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in PROMPTS])
    with torch.no_grad():
        ref = hf.generate(ids, attention_mask=(torch.arange(L) >= L - torch.tensor([[len(p)] for p in PROMPTS])).long(),
                          do_sample=False, max_new_tokens=12, min_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.tokens, ref[:, L:])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_per_row_eos_stop_and_early_exit(temperature):
    # rows that stop leave the batch (sampler.DROP_EVERY): the others must decode and draw exactly as in the run
    # where no row stops (no EOS)
    model = tiny_model()
    gen = lambda: torch.Generator().manual_seed(0)
    free_out = generate(model, PROMPTS * 3, 10, temperature=temperature, generator=gen())
    free = free_out.tokens
    eos = [free[0, 2].item(), free[2, 0].item()]  # rows stop at different steps
    out = generate(model, PROMPTS * 3, 10, temperature=temperature, eos_ids=eos, pad_id=V - 1, generator=gen())
    stops = []
    for i, row in enumerate(free.tolist()):
        stop = next((t for t, tok in enumerate(row) if tok in eos), None)  # index of the first EOS, or None
        n = len(row) if stop is None else stop + 1
        stops.append(n)
        assert out.mask[i, :n].all() and not out.mask[i, n:].any()
        assert out.tokens[i, :n].tolist() == row[:n] and (out.tokens[i, n:] == V - 1).all()
        assert out.truncated[i] == (stop is None) and (out.logprobs[i, n:] == 0).all()
        assert (out.logprobs[i, :n] - free_out.logprobs[i, :n]).abs().max() <= 1e-5
    assert out.tokens.shape[1] == max(stops)  # the loop stopped once every row had
    assert len(set(stops)) > 2  # several drops
    everyone = generate(model, PROMPTS, 10, temperature=0, eos_ids=list(range(V)))
    assert everyone.tokens.shape == (4, 1) and everyone.mask.all() and not everyone.truncated.any()


def test_seeded_sampling_is_reproducible():
    model = tiny_model()
    run = lambda seed: generate(model, PROMPTS, 8, num_samples=3, generator=torch.Generator().manual_seed(seed))
    a, b, c = run(0), run(0), run(1)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.logprobs, b.logprobs)
    assert not torch.equal(a.tokens, c.tokens)


def reference_logp(logits, temperature, top_k, top_p):
    """log-probs of the sampling distribution, written independently of sampler.sample: logits (T, V)."""
    logits = logits / temperature
    if top_k:  # as in HF: top-k first, then top-p on what remains
        logits = logits.masked_fill(logits < logits.sort(-1, descending=True).values[:, top_k - 1:top_k], -torch.inf)
    if top_p < 1:
        keep = torch.zeros_like(logits, dtype=torch.bool)
        for t in range(len(logits)):
            probs, order = logits[t].softmax(-1).sort(descending=True)
            n = int((probs.cumsum(0) < top_p).sum()) + 1  # smallest prefix with mass >= top_p
            keep[t, order[:n]] = True
        logits = logits.masked_fill(~keep, -torch.inf)
    return logits.log_softmax(-1)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (1.0, 0, 0.8),
                                                     (0.8, 10, 0.9)])
def test_logprobs_match_teacher_forcing(temperature, top_k, top_p):
    model = tiny_model(1)
    out = generate(model, PROMPTS, 9, num_samples=2, temperature=temperature, top_k=top_k, top_p=top_p,
                   eos_ids=[3], generator=torch.Generator().manual_seed(0))
    for i, prompt in enumerate(p for p in PROMPTS for _ in range(2)):  # rows are prompt-major
        n = int(out.mask[i].sum())
        seq = torch.tensor([prompt + out.tokens[i, :n].tolist()])
        with torch.no_grad():
            logits = model(seq)[0, len(prompt) - 1: -1]  # (n, V): the logits each completion token was drawn from
        want = reference_logp(logits, temperature, top_k, top_p).gather(-1, seq[0, len(prompt):, None])[:, 0]
        assert want.isfinite().all()  # every sampled token lies inside the top-k / top-p set
        assert (out.logprobs[i, :n] - want).abs().max() <= 1e-4


def test_sample_draws_from_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -9.0]]).expand(40000, 6)
    tok, logp = sample(logits, 0.8, 4, 0.9, torch.Generator().manual_seed(0))
    want = reference_logp(logits[:1], 0.8, 4, 0.9)[0].exp()  # top-4, then top-0.9 of those: 3 tokens left
    freq = torch.bincount(tok, minlength=6) / len(tok)
    assert (freq - want).abs().max() < 0.01 and (freq[want == 0] == 0).all()
    assert torch.allclose(logp, want.log()[tok])


def test_cache_copies_equal_independent_prefills():
    model = tiny_model()
    together = generate(model, PROMPTS, 10, num_samples=3, temperature=0)
    for p, prompt in enumerate(PROMPTS):
        alone = generate(model, [prompt] * 3, 10, temperature=0)  # prefilled three times, separately
        assert torch.equal(together.tokens[3 * p: 3 * p + 3], alone.tokens)
        assert (together.logprobs[3 * p: 3 * p + 3] - alone.logprobs).abs().max() <= 1e-5


def test_bad_arguments():
    model = tiny_model()
    for kwargs, msg in [(dict(prompts=[]), "non-empty"), (dict(prompts=[[1], []]), "non-empty"),
                        (dict(prompts=[[1, V]]), r"\[0, 53\)"), (dict(eos_ids=[-1]), r"\[0, 53\)"),
                        (dict(max_new_tokens=0), "max_new_tokens=0"), (dict(top_p=0.0), "top_p=0.0"),
                        (dict(temperature=-1), "temperature=-1"), (dict(num_samples=0), "num_samples=0"),
                        (dict(fast="static"), "fast='static': use one of")]:
        with pytest.raises(ValueError, match=msg):
            generate(model, **{"prompts": [[1, 2]], "max_new_tokens": 4} | kwargs)


WORKER = """
import os, sys
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import sampler
from sampler import generate, sample
from test_sampler import PROMPTS, tiny_model

dist.init_process_group("gloo")
rank = dist.get_rank()
prompts = PROMPTS[rank::2]
n = 4 + 7 * rank  # rank 0 decodes 4 steps, rank 1 eleven: a collective per step would hang
want = generate(tiny_model(), prompts, n, temperature=0).tokens
ddp = DistributedDataParallel(tiny_model())
assert torch.equal(generate(ddp, prompts, n, temperature=0).tokens, want)
fsdp = tiny_model()
for layer in fsdp.layers:
    fully_shard(layer)
fully_shard(fsdp)
g = torch.Generator().manual_seed(rank)
for _ in range(2):  # twice: the parameters must be sharded again, and usable for training, in between
    assert torch.equal(generate(fsdp, prompts, n, temperature=0).tokens, want)
    generate(fsdp, prompts, n, num_samples=2, generator=g)
    logp, _ = fsdp(torch.tensor([PROMPTS[0]]), targets=torch.tensor([PROMPTS[0]]))
    logp.sum().backward()
    assert type(fsdp.layers[0].mlp.up_proj.weight).__name__ == "DTensor"
open(os.path.join({out!r}, f"rank{{rank}}.ok"), "w").close()
dist.barrier()  # both ranks done before either destroys the group (a lone destroy can abort gloo)
dist.destroy_process_group()
# free what holds the gloo group while the interpreter is whole (left to shutdown, gloo can abort the process)
del ddp, fsdp, logp
import gc; gc.collect()
"""


def test_generate_under_ddp_and_fsdp2(tmp_path):
    tests = Path(__file__).resolve().parent
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER.format(root=str(tests.parent), tests=str(tests), out=str(tmp_path))))
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out = proc.communicate(timeout=180)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both workers: a hang must not outlive the test
        out = proc.communicate()[0]
    assert proc.returncode == 0, out[-4000:]
    assert (tmp_path / "rank0.ok").exists() and (tmp_path / "rank1.ok").exists()


def decode_modes(model, eos, temperature):
    """The same sampling call in each decode mode: the model's forward over per-row copies of the prompt slots
    (fast="off"), the fused step on those copies, with the shared prompt slots, and compiled (its shapes grow and
    rows leave)."""
    run = lambda mode: generate(model, PROMPTS, 9, num_samples=3, eos_ids=eos, temperature=temperature,
                                generator=torch.Generator().manual_seed(0), fast=mode)
    return [run(mode) for mode in ("off", "fused", "shared+fused", "compile")]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_fused_and_compiled_steps_equal_the_eager_forward(temperature):
    model = tiny_model(1)
    gen = lambda: torch.Generator().manual_seed(0)
    free = generate(model, PROMPTS, 9, num_samples=3, temperature=temperature, generator=gen()).tokens
    eos = [free[0, 3].item(), free[7, 1].item()]  # rows stop at different steps
    outs = decode_modes(model, eos, temperature)
    eager = outs[0]
    assert eager.mask.sum(1).min() < eager.tokens.shape[1]  # some rows stopped early, so the masks are exercised
    for other in outs[1:]:
        assert torch.equal(other.tokens, eager.tokens) and torch.equal(other.mask, eager.mask)
        assert (other.logprobs - eager.logprobs).abs().max() <= 1e-5
    again = generate(model, PROMPTS, 9, num_samples=3, eos_ids=eos, temperature=temperature, generator=gen(),
                     fast="compile")  # the compiled step, reused: the same result
    assert torch.equal(again.tokens, eager.tokens)


def test_compiled_fused_step_compiles_once_for_all_shapes():
    # fast="compile": fast.fused_step through torch.compile, its rows, slots and step symbolic from the first
    # call: one graph serves every step, row count (rows leave) and cache length
    from torch._dynamo.utils import counters
    model = tiny_model(2)
    graphs = lambda: counters["stats"]["unique_graphs"]
    run = lambda prompts, n, G, mode: generate(model, prompts, n, num_samples=G, eos_ids=[7, 9],
                                               generator=torch.Generator().manual_seed(1), fast=mode)
    torch._dynamo.reset()  # this test's compiles only
    start = graphs()
    run(PROMPTS, 9, 3, "compile"), run(PROMPTS[:2], 12, 4, "compile")  # (rows stop at different steps)
    before = graphs()
    # one graph (each size that changes marked dynamic; without, 2-3 graphs, and past dynamo's recompile limit, 8,
    # it runs the step eagerly, one logged warning); and it is fused_step's
    assert before - start == 1
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list
    assert len(entries(fast.fused_step)) == before - start
    for prompts, n, G in ((PROMPTS[1:], 7, 5), (PROMPTS * 2, 15, 2), ([[3] * 20], 6, 6)):
        out, want = run(prompts, n, G, "compile"), run(prompts, n, G, "shared+fused")
        assert torch.equal(out.tokens, want.tokens) and (out.logprobs - want.logprobs).abs().max() <= 1e-5
        assert want.mask.sum(1).min() < n and want.mask.sum(1).max() > 1  # rows left the batch at some step
    assert graphs() == before  # no compile after the first calls
    one = run([[3] * 5], 6, 1, "compile")  # one row: Dynamo specializes a size of 1, so a graph of its own
    assert torch.equal(one.tokens, run([[3] * 5], 6, 1, "shared+fused").tokens) and graphs() == before + 1
    # a process that compiles afresh at this call (a resumed run) decodes bitwise what the warmed-up one did
    torch._dynamo.reset()
    again = run(prompts, n, G, "compile")
    assert torch.equal(again.tokens, out.tokens) and torch.equal(again.logprobs, out.logprobs)


@pytest.mark.skipif(not fast.ONEDNN_AVAILABLE, reason="needs oneDNN's fp32 linear (an x86 CPU build of torch)")
def test_compiled_step_runs_onednn_products_on_packed_weights(monkeypatch):
    # where oneDNN runs the projections, the compiled step keeps the products of its large weights oneDNN's (one
    # opaque op each) on copies packed once per call, not inductor's GEMMs; which ones, by the weight's size alone
    # (a rule on rows x size would compile again when the row count changes, and never pack these small weights)
    from torch._dynamo.utils import counters
    monkeypatch.setattr(fast, "ONEDNN", True)
    monkeypatch.setattr(fast, "COMPILED_ONEDNN_MIN_WEIGHT", 2000)  # q/k/v (64 x 32) and gate/up (96 x 32) only
    decode_calls, onednn = [], fast._onednn
    monkeypatch.setattr(fast, "_onednn", lambda x, w, b=None: decode_calls.append(x.dim() == 2) or onednn(x, w, b))
    model = fast.use_onednn(tiny_model(3))
    run = lambda G, mode: generate(model, PROMPTS, 8, num_samples=G, eos_ids=[7], temperature=1.0,
                                   generator=torch.Generator().manual_seed(0), fast=mode)
    torch._dynamo.reset()
    run(2, "compile")  # compiles
    graphs = counters["stats"]["unique_graphs"]
    for G in (2, 3):
        want = run(G, "shared+fused")
        decode_calls.clear()
        out = run(G, "compile")
        assert torch.equal(out.tokens, want.tokens) and (out.logprobs - want.logprobs).abs().max() <= 1e-5
        steps = out.tokens.shape[1] - 1  # the first token comes from the prefill
        assert sum(decode_calls) == 2 * model.config.num_hidden_layers * steps > 0
    assert counters["stats"]["unique_graphs"] == graphs  # 6 rows, then 12: the same graph


def test_compiled_decode_attention_equals_sdpa():
    # traced, fast.decode_attention's products are multiply-and-sums (inductor fuses each into one pass): against
    # SDPA, with grouped queries, masked slots and a fully visible row
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 4, 8), torch.randn(3, 2, 11, 8), torch.randn(3, 2, 11, 8)  # 2 kv heads for 4
    mask = torch.zeros(3, 1, 1, 11).masked_fill_(torch.rand(3, 1, 1, 11) < 0.4, float("-inf"))
    mask[:, ..., 0] = 0.0  # every row sees a slot
    mask[2] = 0.0
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask,
                                                            enable_gqa=True).transpose(1, 2)  # (3, 1, 4, 8)
    traced = []  # the functions the traced graph calls: no matmul (the eager path's) in it

    def record(gm, inputs):
        traced.extend(n.target for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    torch._dynamo.reset()
    assert (torch.compile(fast.decode_attention, backend=record)(q, k, v, mask) - want).abs().max() <= 1e-5
    assert traced and torch.matmul not in traced and torch.bmm not in traced
    got = torch.compile(fast.decode_attention, fullgraph=True)(q, k, v, mask)  # inductor's fused passes
    assert (got - want).abs().max() <= 1e-5 and (fast.decode_attention(q, k, v, mask) - want).abs().max() <= 1e-5


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prompt_slots_equal_per_row_copies(temperature):
    # fast="shared" (on the CPU by default for num_samples > 1): each prompt's cache slots held once for its G rows,
    # against G copies of them attended with SDPA (itself checked against uncached decoding and HF above); rows
    # stop at different steps and leave the batch, the prompts are ragged (left padding masked), 4 heads share 2
    model = tiny_model(1)
    run = lambda shared, eos=(): generate(model, PROMPTS * 2, 11, num_samples=4, temperature=temperature, eos_ids=eos,
                                          generator=torch.Generator().manual_seed(0),
                                          fast="shared" if shared else "off")
    eos = [run(False).tokens[0, 2].item(), run(False).tokens[5, 0].item()]
    for stops in ((), eos):
        copies, shared = run(False, stops), run(True, stops)
        assert torch.equal(shared.tokens, copies.tokens) and torch.equal(shared.mask, copies.mask)
        assert (shared.logprobs - copies.logprobs).abs().max() <= 1e-5
    assert len(set(shared.mask.sum(1).tolist())) > 2  # rows stopped at several steps: dropped rows exercised
    for i, prompt in enumerate(p for p in PROMPTS * 2 for _ in range(4)):  # and against teacher forcing
        n = int(shared.mask[i].sum())
        seq = torch.tensor([prompt + shared.tokens[i, :n].tolist()])
        with torch.no_grad():
            logits = model(seq)[0, len(prompt) - 1 : -1]
        want = reference_logp(logits, max(temperature, 1.0), 0, 1.0).gather(-1, seq[0, len(prompt):, None])[:, 0]
        assert (shared.logprobs[i, :n] - want).abs().max() <= 1e-4


@pytest.mark.parametrize("mode", ["off", "shared", "auto"])
def test_decode_modes_under_bf16_autocast(mode):
    # grpo.py --dtype bfloat16 samples under torch.autocast: fp32 weights, a bf16 cache, RoPE's tables fp32
    model = tiny_model(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = generate(model, PROMPTS, 9, num_samples=3, temperature=0, fast=mode)
    want = generate(model, PROMPTS, 9, num_samples=3, temperature=0)  # fp32
    assert out.logprobs.isfinite().all() and (out.tokens == want.tokens).float().mean() >= 0.9


FUSED_CONFIGS = {  # the fused step against the model's forward on each kind of attention it meets
    "qwen2: q/k/v biases, GQA": dict(model_type="qwen2", hidden_size=32, intermediate_size=48, num_attention_heads=4,
                                     num_key_value_heads=2),
    "llama: MHA, untied, head_dim 16": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                            num_key_value_heads=4, tie_word_embeddings=False),
    "llama: 1 kv head for 4, tied": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                         num_key_value_heads=1, tie_word_embeddings=True),
}


@pytest.mark.parametrize("arch", FUSED_CONFIGS)
@pytest.mark.parametrize("G,shared,temperature,top_k,top_p", [(1, False, 1.0, 0, 1.0), (1, False, 0.0, 0, 1.0),
                                                               (4, True, 1.0, 0, 1.0), (4, False, 0.8, 5, 0.9),
                                                               (4, True, 0.0, 0, 1.0)])
def test_fused_step_equals_the_forward(arch, G, shared, temperature, top_k, top_p):
    # fast.fused_step (the CPU's default) against the model's own forward, itself checked against HF generate
    # and uncached decoding above: the same tokens, log-probs to float rounding (with MKL's AVX-512 kernels
    # bitwise the same where widths are multiples of 32; docs/speed.md); ragged prompts, rows stopping at different
    # steps
    cfg = ModelConfig(vocab_size=V, num_hidden_layers=2, **FUSED_CONFIGS[arch])
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3).add_(p.dim() == 1)
    run = lambda fused, eos=(): generate(model, PROMPTS * 2, 12, num_samples=G, temperature=temperature, top_k=top_k,
                                         top_p=top_p, eos_ids=eos, generator=torch.Generator().manual_seed(0),
                                         fast={(False, False): "off", (False, True): "fused", (True, False): "shared",
                                               (True, True): "shared+fused"}[shared, fused])
    free = run(False).tokens
    eos = [free[0, 2].item(), free[-1, 0].item()]
    forward, fused = run(False, eos), run(True, eos)
    assert torch.equal(fused.tokens, forward.tokens) and torch.equal(fused.mask, forward.mask)
    assert (fused.logprobs - forward.logprobs).abs().max() <= 1e-5
    assert len(set(forward.mask.sum(1).tolist())) > 2  # rows stopped at several steps (and left the batch)


@pytest.mark.skipif(not fast.ONEDNN_AVAILABLE, reason="oneDNN's linear needs an x86 CPU and torch's mkldnn")
def test_fused_step_with_onednn_packed_weights(monkeypatch):
    # where oneDNN runs the projections (an AMD CPU with AVX-512; forced here), fused_layers hands the step copies
    # in oneDNN's own layout: the same tokens and log-probs as the model's forward, whose oneDNN calls reorder
    # the weights themselves
    monkeypatch.setattr(fast, "ONEDNN", True)
    monkeypatch.setattr(fast, "ONEDNN_MIN_MACS", 0)
    cfg = ModelConfig(vocab_size=V, num_hidden_layers=2, **FUSED_CONFIGS["qwen2: q/k/v biases, GQA"])
    torch.manual_seed(0)
    assert fast.fused_layers(Transformer(cfg), 16)[0][1][1] is None  # a model use_onednn left alone: aten's
    model = fast.use_onednn(Transformer(cfg).eval())
    layers = fast.fused_layers(model, 16)
    assert all(w[1] is not None and w[1].is_mkldnn for layer in layers for w in (layer[1], layer[3], layer[5]))
    assert fast.fused_layers(model)[0][1][1] is None  # without a row count: the plain weights
    run = lambda fused: generate(model, PROMPTS, 12, num_samples=4, eos_ids=[3, 7],
                                 generator=torch.Generator().manual_seed(0), fast="shared+fused" if fused else "shared")
    forward, fused = run(False), run(True)
    assert torch.equal(fused.tokens, forward.tokens) and torch.equal(fused.mask, forward.mask)
    assert (fused.logprobs - forward.logprobs).abs().max() <= 1e-5


@pytest.mark.parametrize("targets", [("o_proj", "down_proj"), ("q_proj", "v_proj", "up_proj"), LORA_TARGETS])
def test_fused_step_with_lora_equals_the_forward(targets):
    # LoRA adapters (trained: B != 0) on any of the projections: the fused step decodes with each merged weight,
    # W + scale * B @ A, the forward computes W x + scale * B (A x): the same tokens, log-probs to float rounding;
    # adapters switched off (GRPO's reference), the base model's. (It once used the base o_proj and down_proj,
    # adapters ignored: rollouts from another policy than the one trained.)
    model = add_lora(tiny_model(1), rank=4, alpha=8.0, targets=targets).eval()
    with torch.no_grad():
        for m in lora_layers(model).values():
            m.lora_B.weight.normal_(0.0, 0.2)
    run = lambda fused: generate(model, PROMPTS * 2, 12, num_samples=4, generator=torch.Generator().manual_seed(0),
                                 fast="shared+fused" if fused else "shared")
    assert fast.fused_layers(model) is not None
    forward, fused = run(False), run(True)
    assert torch.equal(fused.tokens, forward.tokens)
    assert (fused.logprobs - forward.logprobs).abs().max() <= 1e-4
    with adapters_off(model):
        base = run(True)
    plain = generate(tiny_model(1), PROMPTS * 2, 12, num_samples=4, generator=torch.Generator().manual_seed(0),
                     fast="shared")
    assert torch.equal(base.tokens, plain.tokens) and not torch.equal(base.tokens, fused.tokens)


def test_fused_step_falls_back_to_the_forward(monkeypatch):
    # where fused_layers returns None, generate(fast="shared+fused") decodes with the forward: bf16 weights,
    # autocast, weight copies over FUSED_MAX_BYTES, LoRA dropout in training mode (each call draws its own masks)
    model = tiny_model(1)
    assert fast.fused_layers(model) is not None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fast.fused_layers(model) is None
    assert fast.fused_layers(tiny_model(1).to(torch.bfloat16)) is None
    monkeypatch.setattr(fast, "FUSED_MAX_BYTES", 1000)
    assert fast.fused_layers(model) is None
    monkeypatch.undo()
    lora = add_lora(tiny_model(1), rank=2, alpha=4.0, dropout=0.1).train()
    assert fast.fused_layers(lora) is None and fast.fused_layers(lora.eval()) is not None
    half = tiny_model(1).to(torch.bfloat16)
    run = lambda fused: generate(half, PROMPTS, 6, num_samples=2, generator=torch.Generator().manual_seed(0),
                                 fast="shared+fused" if fused else "shared")
    assert torch.equal(run(True).tokens, run(False).tokens)
