"""The draft vocabulary's lm_head rows: int8 on the CPU, exact output either way."""

from __future__ import annotations

import pytest
import torch

from clover_hf import CloverForCausalLM
from clover_hf.heads.lm_head import DraftLMHead

from .tiny import prompt, same, tiny_model


@pytest.mark.parametrize("int8", [None, True, False])
@pytest.mark.parametrize("tree", [None, {"depth": 3, "width": 3, "nodes": 10}])
def test_int8_draft_rows_keep_output_exact(int8, tree):
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, draft_vocab_size=40)
    ids = prompt(21)
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    kwargs = {} if int8 is None else {"int8_draft": int8}
    # the heads draft every step: a first call on an empty cost cache verifies one token a step while it learns
    # (no draft, no rows), so with the default budget the test had passed only after other tests stored costs
    out = clover.generate(ids, max_new_tokens=40, do_sample=False, tree=tree, budget="full", **kwargs)
    assert same(out, ref)
    drafted_from = clover.clover_heads._lm_head_rows[-1]  # the rows this generate call drafted from
    assert drafted_from.weight.dtype == (torch.int8 if int8 else torch.float32)  # None: int8 in bf16 only
    assert drafted_from.weight.shape == (40, base.config.hidden_size)


def test_bf16_on_the_cpu_drafts_from_int8_rows_by_default():
    base = tiny_model("llama", dtype=torch.bfloat16)
    clover = CloverForCausalLM.from_base(base, draft_vocab_size=40)
    clover.generate(prompt(23), max_new_tokens=12, do_sample=False, budget="full")  # the heads draft every step
    assert clover.clover_heads._lm_head_rows[-1].weight.dtype == torch.int8
    clover.generate(prompt(23), max_new_tokens=12, do_sample=False, int8_draft=False, budget="full")
    assert clover.clover_heads._lm_head_rows[-1].weight.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_rows_approximate_the_logits(dtype):
    torch.manual_seed(0)
    weight, hidden = torch.randn(300, 64).to(dtype), torch.randn(2, 5, 64).to(dtype)
    exact, rows = hidden.float() @ weight.float().T, DraftLMHead.quantized(weight)
    approx = rows(hidden)
    assert approx.shape == (2, 5, 300) and approx.dtype == dtype
    # each weight is off by at most half a step of its row's scale, plus the output's own rounding
    bound = 0.5 * hidden.float().abs().sum(-1, keepdim=True) * rows.scales.float()
    rounding = exact.abs() * (2e-2 if dtype == torch.bfloat16 else 1e-5) + 1e-4
    assert (approx.float() - exact).abs().le(bound + rounding).all()
    assert (approx.float().argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
    assert rows(hidden.transpose(0, 1)).shape == (5, 2, 300)  # any layout of the rows in
    bias = torch.randn(300).to(dtype)
    assert torch.allclose(DraftLMHead.quantized(weight, bias)(hidden).float(), (approx + bias).float())


def test_generation_under_inference_mode():
    with torch.inference_mode():
        base = tiny_model("llama")
        clover = CloverForCausalLM.from_base(base, draft_vocab_size=40)
        ids = prompt(22)
        assert same(clover.generate(ids, max_new_tokens=20, do_sample=False),
                    base.generate(ids, max_new_tokens=20, do_sample=False))


def test_what_decoding_caches_stays_usable_outside_inference_mode():
    """Decoding runs in inference mode; rows and trees it caches must not be inference tensors."""
    from clover_hf.heads.tree import build_tree

    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, draft_vocab_size=40)
    clover.generate(prompt(6), max_new_tokens=8, do_sample=False)
    rows = clover.clover_heads.draft_lm_head(base.get_output_embeddings())
    hidden = torch.randn(2, base.config.hidden_size, requires_grad=True)
    rows(hidden).sum().backward()  # as training's draft logits do
    assert not rows.weight.is_inference() and hidden.grad is not None
    assert not build_tree(clover.clover_config.tree).depths.is_inference()


def test_draft_rows_are_built_once_and_rebuilt_when_the_weight_changes():
    base = tiny_model("llama")
    heads = CloverForCausalLM.from_base(base, draft_vocab_size=40).clover_heads
    lm_head = base.get_output_embeddings()
    first = heads.draft_lm_head(lm_head, int8=True)
    assert heads.draft_lm_head(lm_head, int8=True) is first
    with torch.no_grad():
        lm_head.weight.mul_(2.0)
    again = heads.draft_lm_head(lm_head, int8=True)
    assert again is not first and torch.allclose(again.scales, 2 * first.scales)
    with torch.no_grad():
        heads.draft_token_ids.copy_(torch.arange(40) + 3)  # as training fills in its vocabulary
    moved = heads.draft_lm_head(lm_head, int8=True)
    assert moved is not again and torch.equal(moved.scales[:-3], again.scales[3:])
    assert heads.draft_lm_head(lm_head, int8=False).weight.dtype == torch.float32
    base.to(torch.bfloat16)  # the same parameter objects, new storage
    assert heads.draft_lm_head(lm_head, int8=False).weight.dtype == torch.bfloat16


def test_int8_rows_only_where_the_kernel_takes_them():
    assert DraftLMHead.int8_fits(torch.zeros(8, 576, dtype=torch.bfloat16))
    assert not DraftLMHead.int8_fits(torch.zeros(8, 24, dtype=torch.bfloat16))  # the kernel tiles by 16
    assert not DraftLMHead.int8_fits(torch.zeros(8, 64, dtype=torch.float16))
    assert not DraftLMHead.int8_fits(torch.zeros(8, 64, dtype=torch.float32, device="meta"))
    # heads without a draft vocabulary read the base's own lm_head, never a copy
    base = tiny_model("llama")
    heads = CloverForCausalLM.from_base(base).clover_heads
    assert heads.draft_lm_head(base.get_output_embeddings(), int8=True).weight is base.get_output_embeddings().weight


def test_a_call_whose_steps_never_draft_makes_no_draft_rows():
    """The draft rows are made at the first draft: a call of one-token steps (int8 rows of SmolLM2's took 26 ms
    to make, a tenth of a short first call) makes none."""
    base = tiny_model("llama", dtype=torch.bfloat16)
    clover = CloverForCausalLM.from_base(base, draft_vocab_size=40)
    clover.generate(prompt(23), max_new_tokens=12, do_sample=False, budget="one-token")
    assert clover.clover_heads._lm_head_rows is None
    clover.generate(prompt(23), max_new_tokens=12, do_sample=False, budget="full")
    assert clover.clover_heads._lm_head_rows is not None


def test_bf16_int8_rows_compute_in_the_kernel_where_it_is_built():
    """Where the kernel is built (AVX2, or AVX-512 with VNNI), bf16 int8 rows compute in its int8 product, close to
    torch's int8 kernel (both exact products of the int8 rows, rounded to bf16); float32 rows never do."""
    from clover_hf.cpu import kernel as bf16_kernel

    torch.manual_seed(0)
    weight = torch.randn(64, 32, dtype=torch.bfloat16)
    rows = DraftLMHead.quantized(weight)
    probe = bf16_kernel.int8_product(rows.weight, rows.scales, None) if bf16_kernel.cpu_supports() else None
    if probe is None:
        assert rows.kernel is None
        pytest.skip("no kernel on this CPU")
    assert rows.kernel is not None and DraftLMHead.quantized(weight.float()).kernel is None
    hidden = torch.randn(3, 32, dtype=torch.bfloat16)
    by_torch = DraftLMHead(rows.weight, None, rows.scales)(hidden)
    assert torch.allclose(rows(hidden).float(), by_torch.float(), rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_compute_from_a_copy_where_their_form_computes_from_one(dtype):
    """Rows kept in the base's dtype compute in their row count's form; where that form computes from a weight copy
    (oneDNN's blocked layout, the kernel's tiles), from a copy of the rows made once and shared by the per-call
    `replace`s of the rows, not in F.linear (5.6 against 0.21 ms for 3 rows of SmolLM2's draft rows in float32)."""
    from dataclasses import replace

    from clover_hf.cpu import kernel as bf16_kernel
    from clover_hf.cpu.linears import PACKED, TILED, onednn_packs

    form = TILED if dtype == torch.bfloat16 and bf16_kernel.available() else PACKED
    if form == PACKED and not onednn_packs():
        pytest.skip("this torch build has no oneDNN: no blocked copies")
    torch.manual_seed(0)
    weight, hidden = torch.randn(96, 64).to(dtype), torch.randn(3, 64).to(dtype)
    rows = DraftLMHead(weight)
    made = replace(rows, forms={1: form, 2: form})
    assert torch.allclose(made(hidden).float(), torch.nn.functional.linear(hidden, weight).float(), rtol=2e-2, atol=2e-2)
    copy = made.copies[form]
    assert copy is not None and copy is not weight
    again = replace(rows, forms={1: form, 2: form})
    again(hidden)
    assert again.copies[form] is copy  # made once: later calls' rows share it
    assert replace(rows, forms={}).__call__(hidden).shape == (3, 96)  # F.linear's form: no copy
    assert set(rows.copies) == {form}
