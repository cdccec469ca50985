"""Batches: every row of a left-padded batch gets exactly the base's own batched `generate` output."""

from __future__ import annotations

import warnings

import pytest
import torch

from clover_hf import CloverForCausalLM
from clover_hf.decode import rows

from .test_decoding import DRAFTING
from .tiny import ARCHS, left_padded, oracle_model, prompt, same, tiny_model


def three_rows() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    return left_padded(prompt(1, length=10), prompt(2, length=6), prompt(3, length=8))


@pytest.mark.parametrize("drafting", list(DRAFTING))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_batch_matches_base(arch, drafting):
    base = tiny_model(arch)
    clover = CloverForCausalLM.from_base(base)
    ids, mask, _ = three_rows()
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = clover.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, **DRAFTING[drafting])
    assert same(out, ref)
    stats = clover.generation_stats
    assert stats.new_tokens == 3 * 30
    # one acceptance per unfinished row and forward; rows that finish early leave the batch
    assert stats.steps - 1 <= len(stats.accepted_lengths) <= 3 * (stats.steps - 1)


@pytest.mark.parametrize("repack", ["when mostly masked", "every step"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text", "gpt2"])
@pytest.mark.parametrize("tree", [None, {"depth": 3, "width": 3, "nodes": 10}])
def test_batch_rows_accept_different_lengths(arch, tree, repack, monkeypatch):
    """Oracle heads: rows accept paths of different lengths in the same forward, so the shared cache
    carries masked slots (repacked when they dominate, or at every step here); long paths and bonus
    tokens must still give the base's output."""
    if repack == "every step":
        monkeypatch.setattr(rows, "REPACK_UNUSED_SHARE", 0.0)
    base = tiny_model(arch)
    ids, mask, pads = three_rows()
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=50, do_sample=False)
    clover = oracle_model(base, ref, pads)
    out = clover.generate(ids, attention_mask=mask, max_new_tokens=50, do_sample=False, tree=tree)
    assert same(out, ref)
    stats = clover.generation_stats
    assert len(stats.accepted_lengths) < 3 * (stats.steps - 1)  # a row finished first: rows advanced unevenly
    assert max(stats.accepted_lengths) == (3 if tree else clover.clover_config.num_heads)


@pytest.mark.parametrize("arch", ["llama", "mistral", "phi3"])
def test_batch_rows_stop_at_their_own_eos(arch):
    """A row that ends early leaves the batch; its output is padded like the base's."""
    base = tiny_model(arch)
    ids, mask, _ = three_rows()
    free = base.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    new = free[:, ids.shape[1]:]
    # an end-of-sequence token that row 1 produces early and the other rows later or never
    eos = next(int(t) for t in new[1, 3:] if int(t) not in new[0, :12].tolist() and int(t) not in new[2, :12].tolist())
    base.generation_config.eos_token_id = eos
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    clover = CloverForCausalLM.from_base(base)
    out = clover.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, lookup=4)
    assert same(out, ref)
    pad = base.generation_config.pad_token_id
    assert (ref[1, -1] == pad) and (ref[1, ids.shape[1]:] == eos).any()  # the test is not vacuous
    row_tokens = [int((r != pad).sum()) for r in out[:, ids.shape[1]:]]
    assert clover.generation_stats.new_tokens <= sum(row_tokens) + 3  # pads are not counted as generated


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_batch_top_k_1_sampling_and_return_sequences(arch):
    """Sampling runs per row; with top_k=1 it is deterministic and must equal batched greedy, and
    num_return_sequences copies each prompt into its own row."""
    base = tiny_model(arch)
    clover = CloverForCausalLM.from_base(base)
    ids, mask, _ = left_padded(prompt(1, length=10), prompt(2, length=6))
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = clover.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=True, top_k=1,
                          num_return_sequences=2)
    assert clover.generation_stats is not None
    assert same(out, ref.repeat_interleave(2, dim=0))


def test_batch_sampling_rows_are_independent():
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base)
    ids = prompt(4)
    torch.manual_seed(0)
    out = clover.generate(ids, max_new_tokens=20, do_sample=True, temperature=1.5, num_return_sequences=4)
    assert out.shape == (4, ids.shape[1] + 20) and clover.generation_stats is not None
    assert len({tuple(r.tolist()) for r in out}) == 4
    assert (out[:, : ids.shape[1]] == ids).all()


def test_batch_scores_fall_back_to_the_base():
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base)
    ids, mask, _ = left_padded(prompt(1), prompt(2, length=7))
    kwargs = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True,
                  output_scores=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = clover.generate(ids, **kwargs)
    assert any("output_scores / output_logits for a batch" in str(w.message) for w in caught)
    assert same(out.sequences, base.generate(ids, **kwargs).sequences)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5])
def test_batch_short_generations(max_new_tokens):
    base = tiny_model("qwen3")
    ids, mask, pads = three_rows()
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False)
    clover = oracle_model(base, base.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False), pads)
    assert same(clover.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False), ref)


def test_batched_text_generation_pipeline():
    from transformers import pipeline

    from .tiny import byte_tokenizer

    tok = byte_tokenizer()
    tok.pad_token, tok.padding_side = tok.convert_ids_to_tokens(0), "left"
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base)
    texts = ["hello there", "a longer prompt than that", "short"]
    kw = dict(max_new_tokens=15, do_sample=False, batch_size=3)
    ours = pipeline("text-generation", model=clover, tokenizer=tok)(texts, **kw)
    assert ours == pipeline("text-generation", model=base, tokenizer=tok)(texts, **kw)
    assert clover.generation_stats is not None and clover.generation_stats.new_tokens == 3 * 15


def test_batch_row_that_ends_at_its_first_token():
    """One row's first token is end-of-sequence: it leaves the batch at the prefill, the others go on."""
    base = tiny_model("llama")
    ids, mask, pads = three_rows()
    free = base.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)[:, -1].tolist()
    assert free[1] not in (free[0], free[2])
    base.generation_config.eos_token_id = free[1]
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert ref[1, ids.shape[1] + 1 :].eq(base.generation_config.pad_token_id).all()
    clover = oracle_model(base, ref, pads)
    out = clover.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert same(out, ref)
    assert max(clover.generation_stats.accepted_lengths) == clover.clover_config.num_heads


def test_batch_without_eos_but_with_stop_strings_falls_back():
    """Without an eos_token_id transformers keeps generating rows that matched a stop string until all
    rows have; Clover leaves that to the base instead of padding them."""
    from .tiny import byte_tokenizer

    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base)
    ids, mask, _ = three_rows()
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, stop_strings=["a"],
                  tokenizer=byte_tokenizer())
    with pytest.warns(UserWarning, match="stopping criteria but no eos_token_id"):
        out = clover.generate(ids, **kwargs)
    assert same(out, base.generate(ids, **kwargs))


def test_a_batch_speculates_where_every_row_s_drafts_hold():
    """The budget weighs a batch's widths by the tokens they move its last row: where drafts hold for every row
    (oracle heads) and verifying more costs nothing, each step still verifies the whole tree, exactly; where each
    token costs a forward, it verifies one."""
    from clover_hf import CostModel, DraftBudget

    base = tiny_model("llama")
    ids, mask, pads = three_rows()
    ref = base.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False)
    clover = oracle_model(base, ref, pads)
    flat = DraftBudget(costs=CostModel.from_function(lambda rows, width: 10.0, draft_ms=0.0))
    assert same(clover.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, budget=flat), ref)
    stats = clover.generation_stats
    assert stats.verified_per_step > 4 and stats.tokens_per_step > 6  # three rows, several tokens each a step
    steep = DraftBudget(costs=CostModel.from_function(lambda rows, width: 10.0 * rows * width, draft_ms=5.0))
    assert same(clover.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, budget=steep), ref)
    assert clover.generation_stats.verified_per_step == 1.0
