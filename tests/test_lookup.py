"""The prompt-lookup chain: n-gram matching, its place in the tree, and exact greedy output with it."""

from __future__ import annotations

import pytest
import torch

from clover_hf import CloverForCausalLM
from clover_hf.decode.lookup import NgramIndex, lookup_continuation
from clover_hf.heads.config import CloverConfig
from clover_hf.heads.tree import build_tree

from .tiny import oracle_model, prompt, same, tiny_model

t = torch.tensor


def test_lookup_continuation():
    assert lookup_continuation(t([1, 2, 3, 4, 5, 1, 2, 3]), 3).tolist() == [4, 5, 1]
    assert lookup_continuation(t([1, 2, 3, 4, 5, 1, 2, 3]), 10).tolist() == [4, 5, 1, 2, 3]  # cut by the end
    assert lookup_continuation(t([5, 6, 7, 8]), 3).tolist() == []
    assert lookup_continuation(t([7]), 3).tolist() == []
    # the longest n-gram wins: (8, 1) matches at 3, the lone 1 would also match at 0
    assert lookup_continuation(t([1, 9, 9, 8, 1, 4, 4, 8, 1]), 2).tolist() == [4, 4]
    # the most recent match that has num_tokens after it, not the first one
    assert lookup_continuation(t([1, 2, 3, 7, 7, 1, 2, 3, 5, 6, 0, 0, 1, 2, 3]), 2, max_ngram=3).tolist() == [5, 6]


def _scan(ids: list[int], num_tokens: int, max_ngram: int = 3) -> tuple[list[int], int]:
    """The chain by scanning the whole text: the longest n-gram ending it that occurred earlier, its
    most recent occurrence with num_tokens after it, else its first."""
    for n in range(min(max_ngram, len(ids) - 1), 0, -1):
        starts = [s for s in range(len(ids) - n) if ids[s : s + n] == ids[len(ids) - n :]]
        if starts:
            full = [s for s in starts if s + n + num_tokens <= len(ids)]
            start = (full[-1] if full else starts[0]) + n
            return ids[start : start + num_tokens], n
    return [], 0


def test_ngram_index_grown_step_by_step_finds_what_a_scan_finds():
    generator = torch.Generator().manual_seed(0)
    for _ in range(500):
        length, vocab, num = (int(x) for x in torch.randint(1, 40, (3,), generator=generator))
        ids = torch.randint(0, max(vocab // 6, 2), (length,), generator=generator).tolist()
        index = NgramIndex(ids[: length // 2])
        for token in ids[length // 2 :]:  # as decoding grows it, a step's tokens at a time
            index.extend([token])
        start, n = index.match(num)
        assert (ids[start : start + num], n) == _scan(ids, num)


def test_tree_with_lookup_chain():
    plain = build_tree([[0], [1], [0, 0]])
    tree = build_tree([[0], [1], [0, 0]], lookup=3)
    assert tree.num_nodes == plain.num_nodes + 3
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2, 3]
    assert tree.depth_ranges == ((0, 1), (1, 4), (4, 6), (6, 7))  # each depth contiguous
    assert tree.lookup_nodes.tolist() == [3, 5, 6]
    assert tree.draft_nodes.tolist() == [1, 2, 4]
    assert tree.chain_flags.tolist() == [False, False, False, True, False, True, True] == list(tree.on_host[2])
    # the chain sees the root and its own earlier nodes only
    assert tree.ancestors[6].nonzero().flatten().tolist() == [0, 3, 5, 6]
    assert tree.ancestors[5].nonzero().flatten().tolist() == [0, 3, 5]
    assert [lv.k for lv in tree.levels] == [lv.k for lv in plain.levels]  # drafting is unchanged
    tokens = tree.assemble(t(100), t([1, 2, 3]), t([7, 8, 9]))
    assert tokens.tolist() == [100, 1, 2, 7, 3, 8, 9]
    assert build_tree([[0]], lookup=0).lookup_nodes.numel() == 0
    with pytest.raises(ValueError, match="lookup"):
        build_tree([[0]], lookup=-1)
    with pytest.raises(ValueError, match="lookup_tokens"):
        CloverConfig(hidden_size=8, vocab_size=16, num_attention_heads=2, lookup_tokens=-2)
    with pytest.raises(ValueError, match="lookup_max_tokens"):
        CloverConfig(hidden_size=8, vocab_size=16, num_attention_heads=2, lookup_max_tokens=-1)


def test_lookup_chain_is_accepted_beyond_the_heads_depth():
    """Tiny random models repeat themselves: the chain gets accepted past what 4 heads can draft."""
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base)
    clover.budget = "full"  # the chain's acceptance, not whether this machine's timings make drafting pay
    ids = prompt(2)
    ref = base.generate(ids, max_new_tokens=60, do_sample=False)
    heads_only = clover.generate(ids, max_new_tokens=60, do_sample=False)
    tps_heads = clover.generation_stats.tokens_per_step
    out = clover.generate(ids, max_new_tokens=60, do_sample=False, lookup=8)
    stats = clover.generation_stats
    assert same(out, ref) and same(heads_only, ref)
    assert max(stats.accepted_lengths) > clover.clover_config.num_heads
    assert stats.tokens_per_step > tps_heads


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_lookup_chain_grows_while_the_text_copies(arch):
    """A chain accepted whole doubles next step (up to lookup_max): longer accepts, output unchanged."""
    base = tiny_model(arch)
    ids = prompt(2)
    ref = base.generate(ids, max_new_tokens=60, do_sample=False)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=2)
    clover.budget = "full"  # the chain's own growth rule, without a budget cutting it
    fixed = clover.generate(ids, max_new_tokens=60, do_sample=False)
    fixed_stats = clover.generation_stats
    grown = clover.generate(ids, max_new_tokens=60, do_sample=False, lookup_max=16)
    stats = clover.generation_stats
    assert same(fixed, ref) and same(grown, ref)
    assert max(fixed_stats.accepted_lengths) <= clover.clover_config.num_heads
    assert max(stats.accepted_lengths) > 8  # only a chain grown from 2 past 4 and 8 reaches this far
    assert stats.steps < fixed_stats.steps
    # from the config too, and with sampling at top_k=1 (the greedy output)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=2, lookup_max_tokens=16)
    assert same(clover.generate(ids, max_new_tokens=60, do_sample=True, top_k=1, budget="full"), ref)
    assert clover.generation_stats.steps == stats.steps  # repeats of drafted paths merged: no chain lost


def test_lookup_from_config_and_with_oracle_heads():
    """Heads and chain in one tree; the config's lookup_tokens applies when generate is not told."""
    base = tiny_model("qwen3")
    ids = prompt(3, length=6)
    ref = base.generate(ids, max_new_tokens=50, do_sample=False)
    clover = oracle_model(base, ref, lookup_tokens=6)
    out = clover.generate(ids, max_new_tokens=50, do_sample=False)
    assert same(out, ref)
    assert clover.generation_stats.tokens_per_step > 2.5


@pytest.mark.parametrize("max_new_tokens", [1, 3, 7, 11])
@pytest.mark.parametrize(
    "processors",
    [dict(), dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=3)],
    ids=["none", "repetition_penalty", "no_repeat_ngram"],
)
def test_lookup_with_processors_and_lengths(processors, max_new_tokens):
    base = tiny_model("mistral")
    ids = prompt(2)
    ref = base.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **processors)
    out = CloverForCausalLM.from_base(base).generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, lookup=6, **processors
    )
    assert same(out, ref)


def test_growing_chain_is_named_on_the_card():
    from clover_hf.hub.card import tree_summary

    config = CloverConfig(hidden_size=8, vocab_size=16, num_attention_heads=2, lookup_tokens=5, lookup_max_tokens=20)
    assert tree_summary(config).endswith("a prompt-lookup chain of up to 5 tokens that doubles up to 20 while the text copies earlier text")
    assert "doubles" not in tree_summary(CloverConfig(hidden_size=8, vocab_size=16, num_attention_heads=2, lookup_tokens=5))
