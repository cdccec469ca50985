"""The same exactness checks on a CUDA GPU: the decoding loop is device-agnostic, so greedy Clover
output must equal the base's own `generate` there too, in fp32.

Skipped on machines without CUDA (CI has none); run them on a GPU with `pytest tests/test_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch

from clover_hf import CloverForCausalLM

from .test_decoding import DRAFTING
from .test_shipped_heads import _chat
from .tiny import ARCHS, left_padded, oracle_model, prompt, same, tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    """TF32 would round the many-token verify forward differently from one-token decoding."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("drafting", ["static", "lookup", "dynamic+lookup"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_cuda_matches_base(arch, drafting):
    base = tiny_model(arch).to(CUDA)
    clover = CloverForCausalLM.from_base(base)
    assert next(clover.clover_heads.parameters()).device.type == "cuda"
    for seed in (1, 2):
        ids = prompt(seed).to(CUDA)
        ref = base.generate(ids, max_new_tokens=60, do_sample=False)
        out = clover.generate(ids, max_new_tokens=60, do_sample=False, **DRAFTING[drafting])
        assert out.device.type == "cuda" and same(out, ref)
        assert clover.generation_stats.new_tokens == 60


def test_cuda_drafts_the_accelerator_tree():
    """On the GPU the heads' `accelerator_dynamic_tree` replaces their one-node static tree."""
    base = tiny_model("llama").to(CUDA)
    ids = prompt(3, length=6).to(CUDA)
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    clover = oracle_model(base, ref, tree=[[0]], accelerator_dynamic_tree={"depth": 3, "width": 3, "nodes": 10})
    out = clover.generate(ids, max_new_tokens=40, do_sample=False)
    assert same(out, ref)
    assert max(clover.generation_stats.accepted_lengths) == 3


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt2"])
def test_cuda_batch_matches_base(arch):
    base = tiny_model(arch).to(CUDA)
    clover = CloverForCausalLM.from_base(base)
    ids, mask, _ = left_padded(prompt(1, length=10), prompt(2, length=6), prompt(3, length=8))
    ids, mask = ids.to(CUDA), mask.to(CUDA)
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    out = clover.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, lookup=4)
    assert same(out, ref)


def test_cuda_model_takes_cpu_inputs():
    """Like transformers, inputs may sit on another device; the output comes back on the inputs' device."""
    base = tiny_model("llama").to(CUDA)
    clover = CloverForCausalLM.from_base(base)
    ids = prompt(4)
    out = clover.generate(ids, max_new_tokens=20, do_sample=False)
    assert out.device.type == "cpu"
    assert same(out, base.generate(ids.to(CUDA), max_new_tokens=20, do_sample=False).cpu())


def test_cuda_top1_sampling_matches_greedy():
    """Sampling with top_k=1 runs the lossless-sampling path on the GPU and must give the greedy tokens."""
    base = tiny_model("qwen2").to(CUDA)
    clover = CloverForCausalLM.from_base(base)
    ids = prompt(5).to(CUDA)
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    torch.manual_seed(0)
    out = clover.generate(ids, max_new_tokens=40, do_sample=True, top_k=1)
    assert same(out, ref)


@pytest.mark.parametrize("cache, rate", [({}, 1.5), ({"cache_implementation": "static", "budget": "full"}, 1.3)],
                         ids=["dynamic cache", "static cache, CUDA graphs"])
def test_cuda_shipped_heads_exact(converted, cache, rate):
    """The embedded SmolLM2 with its shipped heads, fp32 on the GPU: token for token the base's output, on a
    dynamic cache and on a static one with the verify forward compiled (CUDA graphs). The static case drafts
    the whole tree every step, as the CPU's static test does: what the default budget drafts there follows
    the step costs it times (1.18 tokens a step on these prompts on an H200), which no test should assert."""
    from transformers import AutoTokenizer

    from clover_hf.embedded import shipped_heads_path
    from clover_hf.training.data import mtbench_questions

    model = CloverForCausalLM.from_pretrained(shipped_heads_path(), base_model=str(converted),
                                              dtype=torch.float32).to(CUDA)
    tok = AutoTokenizer.from_pretrained(converted)
    steps = tokens = 0
    for question in range(4):
        ids = _chat(tok, question).to(CUDA)
        expected = model.base_model.generate(ids, max_new_tokens=64, do_sample=False)
        out = model.generate(ids, max_new_tokens=64, do_sample=False, **cache)
        assert torch.equal(out, expected)
        steps, tokens = steps + model.generation_stats.steps, tokens + model.generation_stats.new_tokens
    assert tokens / steps > rate  # the trained heads draft on the GPU as they do on the CPU


def test_cuda_tree_forwards_run_without_cudnn_attention():
    """Clover's forwards run with cuDNN attention disabled (it plans per shape); plain `generate` is left alone."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    base = tiny_model("llama").to(CUDA)
    clover = CloverForCausalLM.from_base(base)
    seen = []
    hook = base.register_forward_pre_hook(lambda module, args: seen.append(torch.backends.cuda.cudnn_sdp_enabled()))
    every = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    ids = prompt(6).to(CUDA)
    try:
        with sdpa_kernel(every):
            clover.generate(ids, max_new_tokens=20, do_sample=False)
            assert seen and not any(seen)
            assert torch.backends.cuda.cudnn_sdp_enabled()
            seen.clear()
            base.generate(ids, max_new_tokens=5, do_sample=False)
            assert seen and all(seen)
    finally:
        hook.remove()


def test_cuda_packed_examples_keep_apart():
    """Packed rows on the GPU: the base's targets and the heads' outputs per example equal those of the
    example alone (TF32 off, float32), as on the CPU."""
    from clover_hf.training.features import Example, base_targets
    from clover_hf.training.packing import PackedRows

    base = tiny_model("llama").to(CUDA)
    heads = CloverForCausalLM.from_base(base, num_heads=2).clover_heads
    examples = [Example(prompt(i, n)[0].tolist(), [1] * n) for i, n in enumerate([12, 9])]
    rows = PackedRows.pack(examples, length=21, pad_id=0)
    ids, pos = rows.input_ids.long().to(CUDA), rows.position_ids.long().to(CUDA)
    embed = base.get_input_embeddings()
    with torch.no_grad():
        h = base_targets(base, ids, 4, pos)["hidden"]
        packed = heads(h[:, :-1], embed(ids[:, 1:]), pos[:, :-1])
        first = torch.tensor([examples[0].input_ids], device=CUDA)
        h0 = base_targets(base, first, 4)["hidden"]
        alone = heads(h0[:, :-1], embed(first[:, 1:]))
    torch.testing.assert_close(h[0, :12], h0[0], rtol=1e-4, atol=1e-5)
    for p, a in zip(packed, alone):
        torch.testing.assert_close(p[:, : a.shape[1]], a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("labels", ["full", "data"])
def test_cuda_online_training_in_bf16_autocast_learns(tmp_path, labels):
    """A few online steps on the GPU with bf16 autocast (as the GPU session trains): the loss falls, the base
    stays as it was, the heads stay float32."""
    from accelerate import Accelerator

    from clover_hf.training.features import Example
    from clover_hf.training.packing import PackedRows
    from clover_hf.training.trainer import TrainConfig, Trainer

    base = tiny_model("llama", dtype=torch.bfloat16).to(CUDA).requires_grad_(False)
    head_type = {"full": "clover", "data": "medusa"}[labels]
    clover = CloverForCausalLM.from_base(base, num_heads=3, draft_vocab_size=64, head_type=head_type,
                                         own_lm_heads=head_type == "medusa")
    rows = PackedRows.pack([Example(prompt(i, 10 + i)[0].tolist(), [1] * (10 + i)) for i in range(12)], 48, 0)
    config = TrainConfig(output_dir=str(tmp_path), max_steps=12, batch_size=2, eval_fraction=0, save_every=100,
                         eval_every=0, warmup_steps=1, labels=labels, mixed_precision="bf16")
    trainer = Trainer(config, clover.clover_heads, base, rows, Accelerator(mixed_precision="bf16"), top_k=4)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    batch = trainer._device_batch([0, 1, 2])
    first, _ = trainer._losses(batch)
    trainer.train(log=lambda *_: None)
    last, _ = trainer._losses(batch)
    assert last.item() < first.item()
    assert all(torch.equal(v, before[k]) for k, v in base.state_dict().items())
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in trainer.heads.parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_cuda_static_cache_with_cuda_graphs_matches_base(arch):
    """`cache_implementation="static"` on the GPU compiles the verify forward by transformers' own rules
    (its default CompileConfig: inductor with CUDA graphs): oracle heads, long paths, the base's output;
    each shape compiles once over two calls."""
    from clover_hf.base import verify_forward

    base = tiny_model(arch).to(CUDA)
    ids = prompt(3, length=9).to(CUDA)
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    clover = oracle_model(base, ref)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    for _ in range(2):
        out = clover.generate(ids, max_new_tokens=40, do_sample=False, cache_implementation="static")
        assert same(out, ref)
        assert max(clover.generation_stats.accepted_lengths) >= 3
    shapes = next(iter(verify_forward._COMPILED[base].values())).shapes
    assert shapes and len(shapes) <= verify_forward.MAX_SHAPES
    assert counters["stats"]["unique_graphs"] - graphs == len(shapes)  # one graph per shape, none compiled twice


def test_cuda_static_cache_batch_and_sampling():
    base = tiny_model("llama").to(CUDA)
    clover = CloverForCausalLM.from_base(base)
    ids, mask, _ = left_padded(prompt(1, length=10), prompt(2, length=6), prompt(3, length=8))
    ids, mask = ids.to(CUDA), mask.to(CUDA)
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = clover.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, lookup=4, budget="full",
                          cache_implementation="static")
    assert same(out, ref)
    one = prompt(5).to(CUDA)
    torch.manual_seed(0)
    out = clover.generate(one, max_new_tokens=30, do_sample=True, top_k=1, cache_implementation="static")
    assert same(out, base.generate(one, max_new_tokens=30, do_sample=False))
