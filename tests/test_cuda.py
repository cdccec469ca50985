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


def test_cuda_shipped_heads_exact(converted):
    """The embedded SmolLM2 with its shipped heads, fp32 on the GPU: token for token the base's output."""
    from transformers import AutoTokenizer

    from clover_hf.data import mtbench_questions
    from clover_hf.embedded import shipped_heads_path

    model = CloverForCausalLM.from_pretrained(shipped_heads_path(), base_model=str(converted),
                                              dtype=torch.float32).to(CUDA)
    tok = AutoTokenizer.from_pretrained(converted)
    steps = tokens = 0
    for question in mtbench_questions()[:4]:
        ids = _chat(tok, question).to(CUDA)
        expected = model.base_model.generate(ids, max_new_tokens=64, do_sample=False)
        out = model.generate(ids, max_new_tokens=64, do_sample=False)
        assert torch.equal(out, expected)
        steps, tokens = steps + model.generation_stats.steps, tokens + model.generation_stats.new_tokens
    assert tokens / steps > 1.5  # the trained heads draft on the GPU as they do on the CPU


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
