"""Clover's own heads, tested directly: which token `draft` and `draft_dynamic` place under which
parent, the Augmenting Block's incremental cache, and heads trained by `Trainer` drafting back what they
learned through the real decoding loop."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from clover_hf import CloverForCausalLM
from clover_hf.heads.clover import CloverHeads
from clover_hf.heads.rope import RotaryTable, rope_tables
from clover_hf.heads.tree import build_tree
from clover_hf.training.features import Example, FeatureSet, cache_features
from clover_hf.training.trainer import TrainConfig, Trainer

from .tiny import prompt, random_heads, same, tiny_model


def random_clover(base, draft_vocab: int | None = None, seed: int = 0) -> CloverForCausalLM:
    """Random Clover heads; with a draft vocabulary, a random one."""
    model, g = random_heads(base, seed, draft_vocab_size=draft_vocab)
    if draft_vocab:
        model.clover_heads.draft_token_ids.copy_(torch.randperm(base.config.vocab_size, generator=g)[:draft_vocab])
    return model


@torch.no_grad()
def _node_by_node(heads: CloverHeads, feature, root: int, path: tuple[int, ...], embed, lm_head):
    """The token and probability `path` should get, computed along the path alone: head d reads the
    state carried down the path (the Regressive Connection over the parent's token) and the parent's
    embedding; the node is its parent's rank-`path[-1]` token."""
    state, token, prob = feature.view(1, -1), root, None
    for d, rank in enumerate(path):
        e = embed(torch.tensor([token])).to(state.dtype)
        if d > 0:
            state = heads.regressive(state, e)
        probs = lm_head(heads.heads[d](state, e)).float().softmax(-1)[0]
        top = probs.topk(rank + 1)
        index = int(top.indices[rank])
        token = index if heads.draft_token_ids is None else int(heads.draft_token_ids[index])
        prob = float(top.values[rank])
    return token, prob


@pytest.mark.parametrize("draft_vocab", [None, 48])
def test_clover_draft_places_each_parents_top_k(draft_vocab):
    base = tiny_model("llama")
    heads = random_clover(base, draft_vocab).clover_heads
    paths = [[0], [1], [2], [0, 0], [0, 1], [2, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 1]]
    tree = build_tree(paths)
    torch.manual_seed(3)
    feature = torch.randn(base.config.hidden_size)
    embed, lm_head = base.get_input_embeddings(), heads.draft_lm_head(base.get_output_embeddings())
    drafted, probs = heads.draft(feature, torch.tensor(7), tree, embed, lm_head)
    by_path = dict(zip(tree.paths, zip(drafted.tolist(), probs.tolist())))
    assert set(by_path) == {tuple(p) for p in paths}
    for path, (token, prob) in by_path.items():
        want_token, want_prob = _node_by_node(heads, feature, 7, path, embed, lm_head)
        assert token == want_token, path
        assert prob == pytest.approx(want_prob, rel=1e-5, abs=1e-7), path
    # sequential heads: unlike Medusa's, two parents give their children different tokens
    assert by_path[(0, 0)][0] != by_path[(2, 0)][0] or by_path[(0, 0)][1] != by_path[(2, 0)][1]
    # and the root matters (the tiny model's embeddings are small, so it moves the probabilities)
    assert not torch.equal(probs, heads.draft(feature, torch.tensor(8), tree, embed, lm_head)[1])


def test_clover_draft_dynamic_expands_the_likeliest_paths():
    """Against a brute-force expansion: at each depth the `width` likeliest paths so far get their
    top-`width` children, scored by the path's summed log-probability."""
    base = tiny_model("qwen2")
    heads = random_clover(base, 40, seed=1).clover_heads
    torch.manual_seed(4)
    feature = torch.randn(base.config.hidden_size)
    embed, lm_head = base.get_input_embeddings(), heads.draft_lm_head(base.get_output_embeddings())
    depth, width = 3, 3
    tokens, parents, depths, scores = heads.draft_dynamic(feature, torch.tensor(11), depth, width, embed, lm_head)

    with torch.no_grad():
        expected = _brute_force_dynamic(heads, feature, 11, depth, width, embed, lm_head)
    assert tokens.shape[0] == width + (depth - 1) * width * width == len(expected)
    got_paths = []
    for i in range(tokens.shape[0]):
        path, node = [], i
        while True:
            path.insert(0, int(tokens[node]))
            if int(parents[node]) == 0:
                break
            node = int(parents[node]) - 1
        got_paths.append(tuple(path))
        assert len(path) == int(depths[i])
    got = sorted(zip(got_paths, depths.tolist(), scores.tolist()))
    for (gp, gd, gs), (wp, wd, ws) in zip(got, sorted(expected)):
        assert (gp, gd) == (wp, wd)
        assert gs == pytest.approx(ws, rel=1e-5, abs=1e-5)


def _brute_force_dynamic(heads, feature, root, depth, width, embed, lm_head):
    """(path tokens, depth, score) of every candidate, expanding one path at a time."""
    frontier = [((), feature.view(1, -1), 0.0)]  # (tokens on the path, state, log-probability)
    expected = []
    for d in range(depth):
        children = []
        for path, state, logp in frontier:
            e = embed(torch.tensor([path[-1] if path else root])).to(state.dtype)
            state = heads.regressive(state, e) if d > 0 else state
            lp = lm_head(heads.heads[d](state, e)).float().log_softmax(-1)[0]
            top = lp.topk(width)
            for v, i in zip(top.values.tolist(), top.indices.tolist()):
                children.append((path + (int(heads.draft_token_ids[i]),), state, logp + v))
        expected += [(p, d + 1, s) for p, _, s in children]
        frontier = sorted(children, key=lambda c: -c[2])[:width]
    return expected


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_augment_cache_gives_the_features_of_a_full_pass(arch):
    """Decoding extends the Augmenting Block's cache a few positions at a time; the features must be
    those of one pass over the whole sequence (fp32, to rounding)."""
    base = tiny_model(arch)
    heads = random_clover(base, seed=2).clover_heads
    g = torch.Generator().manual_seed(5)
    T, H = 23, base.config.hidden_size
    hidden, next_embeds = torch.randn(1, T, H, generator=g), torch.randn(1, T, H, generator=g)
    positions = torch.arange(T)[None]
    full, _ = heads.features(hidden, next_embeds, positions)
    parts, cache, start = [], None, 0
    for size in (9, 1, 3, 1, 5, 4):  # a prefill, then accepted paths of several lengths
        end = start + size
        out, cache = heads.features(hidden[:, start:end], next_embeds[:, start:end], positions[:, start:end], cache)
        parts.append(out)
        start = end
    assert start == T and cache.length == T
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)


def test_clover_heads_learn_the_tokens_they_draft(tmp_path):
    """Clover heads fitted by `Trainer` to one continuation draft it back through the real decoding
    loop: the training targets of head i and the depth it drafts at line up (an off-by-one would leave
    about one token per forward).

    The tiny base's lm_head is scaled up so that its next-token distributions, the soft labels, are as
    peaked as a trained model's (greedy output is unchanged); a random model's are nearly flat.
    Measured: 3.4 tokens per forward.
    """
    base = tiny_model("llama").eval().requires_grad_(False)
    with torch.no_grad():
        base.lm_head.weight.mul_(10)
    ids = prompt(3, 8)
    reference = base.generate(ids, max_new_tokens=48, do_sample=False)
    text = reference[0].tolist()
    cache_features(base, [Example(text, [0] * 8 + [1] * (len(text) - 8))], tmp_path / "f", top_k=4)
    torch.manual_seed(0)
    clover = CloverForCausalLM.from_base(base, num_heads=3, tree=[[0], [0, 0], [0, 0, 0]], lookup_tokens=0)
    config = TrainConfig(output_dir=str(tmp_path / "o"), max_steps=150, batch_size=1, lr=1e-2, warmup_steps=5,
                         eval_fraction=0, eval_every=0, save_every=1000)
    Trainer(config, clover.clover_heads, base, FeatureSet.load(tmp_path / "f")).train(log=lambda *_: None)
    out = clover.generate(ids, max_new_tokens=48, do_sample=False, budget="full")
    assert same(out, reference)
    stats = clover.generation_stats
    assert stats.tokens_per_step > 2.5, stats.accepted_lengths
    assert max(stats.accepted_lengths) == 3  # whole chains of the three heads were accepted


def test_augmenting_block_starts_from_a_base_whose_head_dim_is_not_hidden_over_heads(tmp_path):
    """Qwen3-style bases set head_dim apart from hidden / heads: the heads take it, so the base's last
    decoder layer is copied in, and it survives saving; decoding stays exact."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from .tiny import ARCHS

    config = AutoConfig.for_model("qwen3", **dict(ARCHS["qwen3"], head_dim=32))  # 4 heads x 32 != hidden 64
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(config).eval()
    clover = CloverForCausalLM.from_base(base)
    assert clover.clover_config.head_dim == 32
    last = base.model.layers[-1]
    for ours, theirs in [("q_proj", last.self_attn.q_proj), ("o_proj", last.self_attn.o_proj), ("down_proj", last.mlp.down_proj)]:
        assert torch.equal(getattr(clover.clover_heads.augment[0], ours).weight, theirs.weight), ours
    ids = prompt(4)
    assert same(clover.generate(ids, max_new_tokens=24, do_sample=False),
                base.generate(ids, max_new_tokens=24, do_sample=False))
    clover.save_pretrained(tmp_path / "heads")
    assert CloverForCausalLM.from_pretrained(tmp_path / "heads", base_model=base).clover_config.head_dim == 32


def test_fresh_heads_say_when_nothing_of_the_base_fits_the_augmenting_block():
    gpt2 = tiny_model("gpt2")  # its blocks name their weights c_attn, c_fc, ...: nothing to copy
    with pytest.warns(UserWarning, match="starts from random weights"):
        CloverForCausalLM.from_base(gpt2)


def test_rope_tables_read_from_the_position_table_are_bitwise_the_computed_ones():
    """Without gradients on the CPU the heads' cos and sin come from a table of positions, grown as longer texts
    need: bitwise what computing them for the positions gives (a row of positions in order read as a view of it,
    others gathered)."""
    table = RotaryTable(64, 10000.0)
    for positions in (torch.tensor([[0, 1, 2]]), torch.tensor([[9]]), torch.tensor([[4, 3, 7]]),
                      torch.tensor([[5, 9], [700, 701]]), torch.arange(3000)[None]):
        for dtype in (torch.bfloat16, torch.float32):
            with torch.no_grad():
                read = table(positions, dtype)
            computed = rope_tables(positions, 64, 10000.0, dtype)
            assert all(torch.equal(a, b) for a, b in zip(read, computed))


def test_bf16_heads_draft_a_static_trees_tokens_from_rows_of_the_draft_vocabulary():
    """Drafting in bf16 with the heads' products in the kernel's tiled form where it is built (the Augmenting Block's
    layers then one kernel call each, the rest the kernel's primitive ops): the features of positions fed a few at a
    time, after which the heads can still be copied and pickled; then, from bf16 draft rows (in the same forms, as
    decoding's), a static tree's tokens, each of the draft vocabulary, one per node, for the whole tree and one cut
    shallower."""
    from dataclasses import replace

    from clover_hf import cpu
    from clover_hf.cpu.binding import linear_forms
    from clover_hf.cpu.linears import TILED, WeightCopies
    from clover_hf.decode.drafting import static_trees

    base = tiny_model("llama", dtype=torch.bfloat16, head_dim=32)
    model, g = random_heads(base, seed=0, draft_vocab_size=64)
    heads = model.clover_heads.to(torch.bfloat16)
    heads.draft_token_ids.copy_(torch.randperm(base.config.vocab_size, generator=g)[:64])
    T, H = 14, base.config.hidden_size
    hidden, embeds = (torch.randn(1, T, H, generator=g).to(torch.bfloat16) for _ in range(2))
    positions = torch.arange(T)[None]
    forms = {1 << k: TILED for k in range(5)} if cpu.available() else {}
    with torch.no_grad(), linear_forms([heads], forms, WeightCopies(limit=10**9)):
        cache, start = None, 0
        for size in (9, 1, 4):
            features, cache = heads.features(hidden[:, start : start + size], embeds[:, start : start + size],
                                             positions[:, start : start + size], cache)
            start += size
    assert cache.length == T and features.dtype == torch.bfloat16
    copy.deepcopy(heads)
    pickle.loads(pickle.dumps(heads))
    whole, shallow = (static_trees(heads.config.tree, "cpu", 0, depth)[0] for depth in (None, 2))
    lm_head = replace(heads.draft_lm_head(base.get_output_embeddings()), forms=forms)
    embed = heads.token_embedding(base)
    with torch.no_grad(), linear_forms([heads], forms, WeightCopies(limit=10**9)):
        for tree in (whole, shallow):
            tokens, probs = heads.draft(features[0, -1], torch.tensor(5), tree, embed, lm_head)
            assert tokens.shape == probs.shape == (tree.num_nodes - 1,)
            assert set(tokens.tolist()) <= set(heads.draft_token_ids.tolist())
            assert ((probs > 0) & (probs <= 1)).all()
