"""The draft vocabulary's lm_head rows, in the base's dtype: exact output from them."""

from __future__ import annotations

import warnings

import pytest
import torch

from clover_hf import CloverForCausalLM
from clover_hf.heads.lm_head import DraftLMHead

from .tiny import prompt, same, tiny_model


@pytest.mark.parametrize("tree", [None, {"depth": 3, "width": 3, "nodes": 10}])
def test_draft_rows_keep_output_exact(tree):
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, draft_vocab_size=40)
    ids = prompt(21)
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    # the heads draft every step: a first call on an empty cost cache verifies one token a step while it learns
    # (no draft, no rows), so with the default budget the test had passed only after other tests stored costs
    out = clover.generate(ids, max_new_tokens=40, do_sample=False, tree=tree, budget="full")
    assert same(out, ref)
    drafted_from = clover.clover_heads._lm_head_rows[-1]  # the rows this generate call drafted from
    weight = base.get_output_embeddings().weight
    assert torch.equal(drafted_from.weight, weight[clover.clover_heads.draft_token_ids])


def test_bf16_on_the_cpu_drafts_from_bf16_rows():
    base = tiny_model("llama", dtype=torch.bfloat16)
    clover = CloverForCausalLM.from_base(base, draft_vocab_size=40)
    clover.generate(prompt(23), max_new_tokens=12, do_sample=False, budget="full")  # the heads draft every step
    rows = clover.clover_heads._lm_head_rows[-1]
    assert rows.weight.dtype == torch.bfloat16 and rows.weight.shape == (40, base.config.hidden_size)


def test_int8_draft_warns_that_it_is_ignored_and_changes_nothing():
    """`int8_draft=` is still accepted for a release: a FutureWarning, and plain generate's output (float32)."""
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, draft_vocab_size=40)
    ids = prompt(24)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    for value in (True, False):
        with pytest.warns(FutureWarning, match="int8_draft has no effect"):
            out = clover.generate(ids, max_new_tokens=30, do_sample=False, budget="full", int8_draft=value)
        assert same(out, ref)
        assert clover.clover_heads._lm_head_rows[-1].weight.dtype == torch.float32
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # not given: no warning
        assert same(clover.generate(ids, max_new_tokens=30, do_sample=False, budget="full"), ref)


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
    first = heads.draft_lm_head(lm_head)
    assert heads.draft_lm_head(lm_head) is first
    with torch.no_grad():
        lm_head.weight.mul_(2.0)
    again = heads.draft_lm_head(lm_head)
    assert again is not first and torch.equal(again.weight, 2 * first.weight)
    with torch.no_grad():
        heads.draft_token_ids.copy_(torch.arange(40) + 3)  # as training fills in its vocabulary
    moved = heads.draft_lm_head(lm_head)
    assert moved is not again and torch.equal(moved.weight[:-3], again.weight[3:])
    assert moved.weight.dtype == torch.float32
    base.to(torch.bfloat16)  # the same parameter objects, new storage
    assert heads.draft_lm_head(lm_head).weight.dtype == torch.bfloat16


def test_heads_without_a_draft_vocabulary_read_the_lm_heads_own_weight():
    base = tiny_model("llama")
    heads = CloverForCausalLM.from_base(base).clover_heads
    assert heads.draft_lm_head(base.get_output_embeddings()).weight is base.get_output_embeddings().weight


def test_a_call_whose_steps_never_draft_makes_no_draft_rows():
    """The draft rows are made at the first draft: a call of one-token steps makes none."""
    base = tiny_model("llama", dtype=torch.bfloat16)
    clover = CloverForCausalLM.from_base(base, draft_vocab_size=40)
    clover.generate(prompt(23), max_new_tokens=12, do_sample=False, budget="one-token")
    assert clover.clover_heads._lm_head_rows is None
    clover.generate(prompt(23), max_new_tokens=12, do_sample=False, budget="full")
    assert clover.clover_heads._lm_head_rows is not None


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
