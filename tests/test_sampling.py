"""Clover sampling is lossless: emitted tokens follow the base's own sampling distribution exactly."""

from __future__ import annotations

from collections import Counter
from statistics import NormalDist

import pytest
import torch
from transformers import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from clover_hf import CloverForCausalLM, CostModel
from clover_hf.cpu import kernel as bf16_kernel
from clover_hf.decode import steps as decoding
from clover_hf.decode import verification
from clover_hf.decode.verification import TopKCut, accept_sampled, process_tree_logits, sample_columns, sample_token
from clover_hf.heads.tree import StepTree, build_tree

from .test_decoding import DRAFTING
from .tiny import ARCHS, oracle_model, patch_kernel, prompt, same, tiny_model

FAMILY_ALPHA = 1e-3  # chance that an exact sampler fails one of these tests, all cells together


def binomial_z(cells: int, alpha: float = FAMILY_ALPHA) -> float:
    """Two-sided z bound for `cells` binomial counts tested together (Bonferroni)."""
    return NormalDist().inv_cdf(1 - alpha / (2 * cells))


def detectable_shift(m: int, z: float, power: float = 0.9) -> float:
    """The smallest shift of a marginal near 1/2 that `m` samples detect with this power at bound `z`."""
    return (z + NormalDist().inv_cdf(power)) * 0.5 / m**0.5


def assert_marginals(counts: Counter, target: dict, m: int, z: float, where) -> None:
    """Each outcome's count in `m` draws against Binomial(m, p): |count - m p| <= z sd. Outcomes expected
    fewer than 10 times are pooled into one cell (where the normal bound would be loose); an outcome of
    probability 0 never appears."""
    rare_p = rare_c = 0.0
    for key in set(counts) | set(target):
        p, c = target.get(key, 0.0), counts.get(key, 0)
        assert p > 0.0 or c == 0, (where, key)
        if m * p < 10:
            rare_p, rare_c = rare_p + p, rare_c + c
            continue
        assert abs(c - m * p) <= z * (m * p * (1 - p)) ** 0.5, (where, key, c, m * p)
    if rare_p > 0:
        assert abs(rare_c - m * rare_p) <= z * (m * rare_p * (1 - rare_p)) ** 0.5 + 1, (where, "pooled", rare_c, m * rare_p)


def test_accept_sampled_follows_the_target_distribution():
    """Monte Carlo over one step: after every emitted prefix the next token has the target's distribution.

    The tree's lookup chain repeats a drafted token below the root and then goes on past the heads'
    depth, so acceptance, renormalisation after rejections, residual sampling and the merging of
    repeated paths all matter. The test: every (prefix, token) count against its binomial, two-sided z
    bound, Bonferroni over all cells for a family-wise alpha of 0.001. With n = 20000 steps it detects a
    2% shift in the first token's marginals with power 0.9 (asserted below); a prefix seen m times is
    tested to 2% * sqrt(20000 / m).
    """
    g = torch.Generator().manual_seed(0)
    tree = build_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0]], lookup=3)
    vocab = 5
    tokens = torch.empty(tree.num_nodes, dtype=torch.long)
    tokens[0] = 4
    tokens[tree.draft_nodes] = torch.tensor([0, 1, 2, 3, 1, 2])  # depth 1: 0 1 2; depth 2: 3 1 | 2
    tokens[tree.lookup_nodes] = torch.tensor([1, 0, 3])  # repeats drafted token 1, then 0 and 3 below it
    probs = torch.softmax(2.0 * torch.randn(tree.num_nodes, vocab, generator=g), dim=-1)
    probs[0] = torch.tensor([0.20, 0.40, 0.15, 0.05, 0.20])
    paths = {}  # the tokens on each node's path -> the first node with that path
    for node in range(tree.num_nodes):
        path = tuple(int(tokens[i]) for i in tree.ancestors[node].nonzero().flatten()[1:])
        paths.setdefault(path, node)
    probs[paths[(1,)], 0] += 2.0  # make the chain's continuation below the repeated token likely
    probs[int(tree.lookup_nodes[1]), 3] += 2.0
    probs = probs / probs.sum(dim=-1, keepdim=True)
    probs[int(tree.lookup_nodes[0])] = probs[paths[(1,)]]  # one prefix, one distribution, as from the base
    n = 20000
    following: dict[tuple[int, ...], Counter] = {}
    torch.manual_seed(1)
    for _ in range(n):
        nodes, bonus = accept_sampled(tokens, probs, tree, torch.rand(tree.num_nodes))
        emitted = tokens[nodes[1:]].tolist() + [int(bonus)]
        assert tuple(emitted) not in paths  # the last token is never one the tree offered there
        for k in range(len(emitted)):
            following.setdefault(tuple(emitted[:k]), Counter())[emitted[k]] += 1
    assert (1, 0, 3) in following  # the chain was followed below the repeated token, to depth 3
    z = binomial_z(vocab * len(following))
    assert detectable_shift(n, z) <= 0.02
    for prefix, counts in following.items():
        assert_marginals(counts, dict(enumerate(probs[paths[prefix]].tolist())), sum(counts.values()), z, prefix)


def test_accept_sampled_with_one_hot_targets_is_greedy():
    tree = build_tree([[0], [1], [0, 0], [1, 0]])
    tokens = torch.tensor([9, 3, 5, 7, 2])
    targets = torch.tensor([5, 1, 2, 0, 0])  # the root wants 5 (node 2), node 2 wants 2 (node 4)
    probs = torch.nn.functional.one_hot(targets, 10).float()
    for _ in range(20):
        nodes, bonus = accept_sampled(tokens, probs, tree, torch.rand(5))
        assert nodes.tolist() == [0, 2, 4] and int(bonus) == 0


def test_accept_sampled_on_the_root_alone_draws_the_root_distribution():
    """A one-node step (a plain decoding step) draws the next token by inverting the root's CDF at
    the root's uniform, as the walk does when every child is rejected."""
    tree = build_tree([[0]])
    root_only = StepTree.from_parents(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), 0)
    probs = torch.tensor([[0.1, 0.0, 0.3, 0.6], [0.25, 0.25, 0.25, 0.25]])
    for u in (0.0, 0.05, 0.1, 0.39, 0.41, 0.99):
        nodes, bonus = accept_sampled(torch.tensor([2]), probs[:1], root_only, torch.tensor([u]))
        assert nodes.tolist() == [0] and int(bonus) == int(sample_token(probs[0], torch.tensor(u)))
        # the same draw as a two-node tree whose only child (token 1, no mass at the root) is rejected
        _, walked = accept_sampled(torch.tensor([2, 1]), probs, tree, torch.tensor([u, 0.5]))
        assert int(walked) == int(bonus)
    assert [int(accept_sampled(torch.tensor([2]), probs[:1], root_only, torch.tensor([u]))[1])
            for u in (0.05, 0.3, 0.9)] == [0, 2, 3]


def exact_three_token_distribution(base, ids, temperature: float, top_k: int) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3 | prompt) under temperature + top-k sampling, by enumerating the top-k tree."""

    def dist(prefix: torch.Tensor) -> torch.Tensor:
        logits = base(prefix).logits[0, -1] / temperature
        kth = logits.topk(top_k).values[-1]
        return torch.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)

    out: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        frontier = [((), 1.0)]
        for _ in range(3):
            nxt = []
            for seq, p in frontier:
                q = dist(torch.cat([ids, torch.tensor([seq], dtype=torch.long)], dim=1) if seq else ids)
                for t in q.nonzero().flatten().tolist():
                    nxt.append((seq + (t,), p * float(q[t])))
            frontier = nxt
    out.update(frontier)
    return out


def first_two(weights: dict) -> Counter:
    """(position, token) -> summed weight, for the first two tokens of 3-token continuations."""
    out = Counter()
    for seq, w in weights.items():
        for k in range(2):
            out[k, seq[k]] += w
    return out


@pytest.mark.parametrize("cache", [{}, {"cache_implementation": "static"}], ids=["dynamic cache", "static cache"])
@pytest.mark.parametrize("arch, n, shift", [("llama", 2000, 0.06)])
def test_clover_sampling_matches_the_base_distribution(arch, n, shift, cache):
    """End to end: 3-token continuations sampled by Clover (oracle heads drafting the greedy path, so
    drafts are often but not always accepted), as rows of batches of one prompt, against the exact
    distribution of base sampling. The test: each continuation's count and each marginal of its first
    two tokens against their binomials, two-sided z bounds, Bonferroni over all cells, family-wise alpha
    0.001. This checks the wiring (which node's distribution, which random number, which row): n = 2000
    detects a 6% shift in a marginal with power 0.9 (2% would take about 17000 samples; the Monte Carlo
    test of `accept_sampled` above has that power). Other architectures' masks meet sampling in
    `test_top_k_1_sampling_is_greedy`."""
    base = tiny_model(arch)
    ids = prompt(5, length=8)
    ref = base.generate(ids, max_new_tokens=12, do_sample=False)
    clover = oracle_model(base, ref)
    # low temperature keeps the drafted (greedy) token likely, so both acceptance and rejection occur
    # 4 new tokens: after the prefill's first, one step may keep two drafts and a bonus token
    settings = dict(do_sample=True, temperature=0.7, top_k=2, max_new_tokens=4, pad_token_id=0)
    exact = exact_three_token_distribution(base, ids, settings["temperature"], settings["top_k"])
    counts, accepted = Counter(), []
    torch.manual_seed(0)
    for rows in [1000] * (n // 1000):
        batch = ids.repeat(rows, 1)
        out = clover.generate(batch, attention_mask=torch.ones_like(batch), **settings, **cache)
        assert clover.generation_stats is not None  # Clover decoded, on the cache asked for
        counts.update(tuple(row) for row in out[:, ids.shape[1] : ids.shape[1] + 3].tolist())
        accepted += clover.generation_stats.accepted_lengths
    assert 0 in accepted and max(accepted) >= 2  # rejections and multi-token acceptances both happened
    assert set(counts) <= set(exact)  # never a continuation the base cannot sample
    marginals = first_two(exact)
    z = binomial_z(len(exact) + len(marginals))
    assert_marginals(counts, exact, n, z, "continuations")
    assert_marginals(first_two(counts), marginals, n, z, "marginals")
    assert detectable_shift(n, z) <= shift


@pytest.mark.parametrize("drafting", list(DRAFTING))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_top_k_1_sampling_is_greedy(arch, drafting):
    """Sampling with top_k=1 is deterministic: Clover's sampling path must reproduce greedy output."""
    base = tiny_model(arch)
    clover = CloverForCausalLM.from_base(base)
    ids = prompt(2)
    ref = base.generate(ids, max_new_tokens=30, do_sample=False)
    # the whole tree every step: a per-step budget may verify other nodes in each mode
    out = clover.generate(ids, max_new_tokens=30, do_sample=True, top_k=1, budget="full", **DRAFTING[drafting])
    assert same(out, ref)
    assert clover.generation_stats is not None  # ran through Clover, no fallback
    sampled_steps = clover.generation_stats.steps
    assert same(clover.generate(ids, max_new_tokens=30, do_sample=True, top_k=1, **DRAFTING[drafting]), ref)
    clover.generate(ids, max_new_tokens=30, do_sample=False, budget="full", **DRAFTING[drafting])
    assert sampled_steps == clover.generation_stats.steps  # one-hot targets accept what greedy accepts


@pytest.mark.parametrize("budget", ["full", "fixed costs"])
def test_sampling_is_reproducible_with_the_seed(budget):
    """With the whole tree, or a budget whose costs are fixed, the seed fixes the output. (Under "auto"
    the nodes verified follow this machine's timing, so runs may differ; each is still an exact sample.)"""
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    if budget == "fixed costs":
        budget = CostModel.from_function(lambda rows, width: 10 + width, draft_ms=1.0)
    ids = prompt(4)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(clover.generate(ids, max_new_tokens=30, do_sample=True, temperature=1.0, budget=budget))
    assert same(runs[0], runs[1]) and not same(runs[0], runs[2])


def test_sample_token_is_exact_and_skips_zero_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    draws = torch.stack([sample_token(probs * 7.0, u) for u in torch.rand(6000, generator=torch.Generator().manual_seed(3))])
    freq = torch.bincount(draws, minlength=6).float() / 6000
    assert freq[[0, 2, 5]].sum() == 0  # zero-mass tokens never come out, even unnormalised
    assert (freq - probs).abs().max() < 0.025
    assert int(sample_token(probs, torch.tensor(0.0))) == 1 and int(sample_token(probs, torch.tensor(0.9999))) == 4
    assert int(sample_token(probs, torch.tensor(1 - 2**-24))) == 4  # rounding at the top end: last nonzero token


def test_tree_processors_match_per_node_application():
    """Warpers run once over all nodes, prefix readers per depth: same scores as one call per node."""
    from transformers import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    tree = build_tree([[0], [1], [0, 0], [1, 0], [0, 0, 0]], lookup=2)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(tree.num_nodes, 40, generator=g) * 3
    tokens = torch.randint(0, 40, (tree.num_nodes,), generator=g)
    input_ids = torch.randint(0, 40, (1, 12), generator=g)
    procs = LogitsProcessorList([TemperatureLogitsWarper(0.7), RepetitionPenaltyLogitsProcessor(1.5),
                                 TopKLogitsWarper(8), TopPLogitsWarper(0.9)])
    fast = process_tree_logits(logits, input_ids, tokens, tree, procs)
    for i in range(tree.num_nodes):
        path = [int(tokens[j]) for j in tree.ancestors[i].nonzero().flatten()[1:]]  # below the root
        ids = torch.cat([input_ids, torch.tensor([path], dtype=torch.long)], dim=1)
        assert torch.equal(fast[i], procs(ids, logits[i : i + 1])[0])


def _tie_heavy_scores(rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits as a bf16 lm_head gives them (few distinct values: many equal ones), some of them -inf."""
    g = torch.Generator().manual_seed(seed)
    scores = (torch.randn(rows, vocab, generator=g) * 3).bfloat16().float()
    scores[:, torch.randint(0, vocab, (vocab // 50,), generator=g)] = float("-inf")
    return scores


@pytest.mark.skipif(not bf16_kernel.available(), reason="needs the CPU kernel (x86 with AVX2 and a C compiler)")
def test_top_k_columns_is_torchs_cut():
    """Each row's k-th largest is torch.topk's, equal values counted apart; the columns are those some row keeps
    (at least its k-th largest, as transformers' TopKLogitsWarper keeps them) and the marked ones, ascending."""
    for seed, (rows, vocab) in enumerate([(1, 49152), (4, 1000), (3, 37), (2, 8)]):
        scores = _tie_heavy_scores(rows, vocab, seed)
        if vocab == 37:
            scores = torch.randint(0, 3, (rows, vocab), generator=torch.Generator().manual_seed(seed)).float()
        marked = torch.tensor([0, vocab - 1, vocab - 1])
        for k in sorted({1, 2, min(50, vocab), vocab}):
            kth, columns = bf16_kernel.top_k_columns(scores, k, marked)
            assert torch.equal(kth, scores.topk(k).values[:, -1]), (vocab, k)
            keep = (scores >= kth[:, None]).any(0)
            keep[marked] = True
            assert torch.equal(columns, keep.nonzero()[:, 0]), (vocab, k)
    scores = _tie_heavy_scores(2, 500, 9)
    strided = torch.cat([scores, scores], dim=1)[:, :500]  # rows 1000 floats apart
    assert torch.equal(bf16_kernel.top_k_columns(strided, 5, marked[:0])[0], scores.topk(5).values[:, -1])
    scores[1, 300] = float("nan")
    assert bf16_kernel.top_k_columns(scores, 5, marked[:0]) is None  # torch ranks NaNs apart: not this cut
    assert bf16_kernel.top_k_columns(scores[:1], 5, torch.tensor([500])) is None  # a column out of range
    assert bf16_kernel.top_k_columns(scores[:1].double(), 5, marked[:0]) is None


CUT_PROCESSORS = {
    "top-k": lambda: [TopKLogitsWarper(50)],
    "temperature, top-k": lambda: [TemperatureLogitsWarper(0.7), TopKLogitsWarper(20)],
    "penalty, top-k, min-p": lambda: [RepetitionPenaltyLogitsProcessor(1.3), TemperatureLogitsWarper(0.8),
                                      TopKLogitsWarper(10), MinPLogitsWarper(0.05)],
    "two cuts, temperature between": lambda: [TopKLogitsWarper(8), TemperatureLogitsWarper(0.5), TopKLogitsWarper(3)],
    "temperature, top-k, top-p": lambda: [TemperatureLogitsWarper(0.7), TopKLogitsWarper(50), TopPLogitsWarper(0.9)],
    "top-k, top-p keeping 3, min-p": lambda: [TopKLogitsWarper(40), TopPLogitsWarper(0.5, min_tokens_to_keep=3),
                                              MinPLogitsWarper(0.05)],
}


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "torch"])
@pytest.mark.parametrize("name", list(CUT_PROCESSORS))
def test_sample_columns_is_the_whole_distribution(name, kernel, monkeypatch):
    """Over the columns a top-k cut leaves, each node's distribution is the processors' softmax over the whole
    vocabulary (up to float32 sums' order), whose every other token has probability 0; node tokens map to their
    columns. Without the kernel, torch's operations find the same columns."""
    if not kernel:
        patch_kernel(monkeypatch, "top_k_columns", lambda *args: None)
    tree = build_tree([[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]], lookup=2)
    g = torch.Generator().manual_seed(1)
    scores = _tie_heavy_scores(tree.num_nodes, 3000, 2)
    tokens = torch.randint(0, 3000, (tree.num_nodes,), generator=g)
    input_ids = torch.cat([torch.randint(0, 3000, (1, 30), generator=g), tokens[:1, None]], dim=1)
    processors = LogitsProcessorList(CUT_PROCESSORS[name]())
    cut = TopKCut.of(processors)
    probs, columns, at = sample_columns(scores, input_ids, tokens, tree, cut)
    whole = process_tree_logits(scores, input_ids, tokens, tree, processors).softmax(-1)
    assert torch.equal(columns[at], tokens) and bool((columns[1:] > columns[:-1]).all())
    outside = torch.ones(3000, dtype=torch.bool)
    outside[columns] = False
    assert not whole[:, outside].any()
    assert torch.equal(probs > 0, whole[:, columns] > 0)
    torch.testing.assert_close(probs, whole[:, columns], rtol=1e-5, atol=1e-7)
    scores[2, 7] = float("nan")
    assert sample_columns(scores, input_ids, tokens, tree, cut) is None


def test_a_top_k_cut_serves_only_processors_it_keeps_exact():
    """The cut serves a first top-k warper (anything before it) followed by temperature, top-k, top-p or min-p
    warpers that fill -inf; not another filter value, min-p keeping more than one token, or any other processor after
    the cut. Its columns alone stand for the logits (`screens`) given the vocabulary, no processor before it but a
    temperature, and k up to 256."""
    cut = TopKCut.of(LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.7),
                                          TopKLogitsWarper(40), MinPLogitsWarper(0.1)]))
    assert cut is not None and cut.k == 40 and len(cut.before) == 2 and len(cut.after) == 1 and not cut.screens
    tempered = [TemperatureLogitsWarper(0.7), TopKLogitsWarper(40), TopPLogitsWarper(0.9)]
    assert TopKCut.of(LogitsProcessorList(tempered), 1000).screens and not TopKCut.of(LogitsProcessorList(tempered)).screens
    assert not TopKCut.of(LogitsProcessorList([TopKLogitsWarper(300)]), 1000).screens
    for declined in ([TemperatureLogitsWarper(0.7)], [TopKLogitsWarper(40), TopPLogitsWarper(0.9, filter_value=-1e4)],
                     [TopKLogitsWarper(40, filter_value=-1e4)], [TopKLogitsWarper(40), MinPLogitsWarper(0.1, min_tokens_to_keep=2)],
                     [TopKLogitsWarper(40), RepetitionPenaltyLogitsProcessor(1.2)], []):
        assert TopKCut.of(LogitsProcessorList(declined)) is None, declined


def test_accept_sampled_over_columns_is_accept_sampled_over_the_vocabulary():
    """Given the same probabilities, the walk over a cut's columns accepts the same nodes and draws the same token as
    over the whole vocabulary (zero columns added change no sum): the tree's repeats and rejections included."""
    tree = build_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]], lookup=3)
    g = torch.Generator().manual_seed(5)
    for trial in range(300):
        columns = torch.randperm(200, generator=g)[:12].sort().values
        probs = torch.rand(tree.num_nodes, 12, generator=g) ** 4
        probs[torch.rand(probs.shape, generator=g) < 0.4] = 0.0
        probs[:, 0] += 1e-3  # no row all zero
        probs /= probs.sum(-1, keepdim=True)
        at = torch.randint(0, 12, (tree.num_nodes,), generator=g)
        at[tree.num_nodes - 3 :] = at[1 : 4]  # a lookup chain that repeats drafted tokens
        uniforms = torch.rand(tree.num_nodes, generator=g)
        whole = torch.zeros(tree.num_nodes, 200).index_copy_(1, columns, probs)
        nodes, drawn = accept_sampled(at, probs, tree, uniforms)
        whole_nodes, whole_drawn = accept_sampled(columns[at], whole, tree, uniforms)
        assert torch.equal(nodes, whole_nodes) and int(columns[drawn]) == int(whole_drawn), trial


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_sampling_through_the_cut_draws_what_the_whole_distribution_draws(arch, monkeypatch):
    """End to end, seeded: sampling with a top-k cut emits the tokens the whole vocabulary's scores give (the same
    draws from the same distribution); a call that returns scores computes them whole."""
    base = tiny_model(arch)
    clover = CloverForCausalLM.from_base(base, lookup_tokens=3)
    ids = prompt(4)
    settings = dict(max_new_tokens=40, do_sample=True, temperature=0.9, top_k=5, budget="full")
    served = []
    real = decoding.sample_columns
    monkeypatch.setattr(decoding, "sample_columns", lambda *a: served.append(1) or real(*a))
    runs = []
    for cut in (True, False):
        if not cut:
            monkeypatch.setattr(decoding.TopKCut, "of", classmethod(lambda cls, *args: None))
        served.clear()
        torch.manual_seed(3)
        runs.append(clover.generate(ids, **settings))
        assert bool(served) == cut
    assert same(runs[0], runs[1])
    monkeypatch.undo()
    monkeypatch.setattr(decoding, "sample_columns", lambda *a: served.append(2) or real(*a))
    out = clover.generate(ids, return_dict_in_generate=True, output_scores=True, **settings)
    assert 2 not in served and len(out.scores) == out.sequences.shape[1] - ids.shape[1]


def test_the_walk_on_the_host_is_the_walk_in_tensors():
    """On the CPU the walk runs over host lists: it accepts the nodes and draws the token the tensor operations do
    (off the CPU), over trees with repeated paths (a lookup chain down a drafted branch), rejections and zero masses.
    Given the tree's parents as a list, it reads the same."""
    tree = build_tree([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]], lookup=3)
    parents = tree.parents.tolist()
    assert tree.chain_flags.nonzero().flatten().tolist() == [4, 8, 10] and parents[5] == 1 and parents[9] == 5
    g = torch.Generator().manual_seed(11)
    for trial in range(500):
        probs = torch.rand(tree.num_nodes, 9, generator=g) ** 3
        probs[torch.rand(probs.shape, generator=g) < 0.3] = 0.0
        probs[:, 0] += 1e-3
        probs /= probs.sum(-1, keepdim=True)
        tokens = torch.randint(0, 9, (tree.num_nodes,), generator=g)
        if trial % 2:  # the chain (nodes 4, 8, 10) repeats the drafted path (0,), (0, 0), (0, 0, 0) (nodes 1, 5, 9)
            tokens[[4, 8, 10]] = tokens[[1, 5, 9]]
        uniforms = torch.rand(tree.num_nodes, generator=g)
        want = verification._walk_in_tensors(tokens, probs, tree, uniforms)
        for given in (None, parents):
            nodes, token = accept_sampled(tokens, probs, tree, uniforms, given)
            assert torch.equal(nodes, want[0]) and int(token) == int(want[1]), trial


def test_top_p_over_a_cuts_columns_is_top_p_over_the_whole_rows(monkeypatch):
    """Top-p over the columns a top-k cut keeps removes what it removes over the whole rows, exactly: where equal
    scores straddle its cut, or a cumulative probability lies near its bound, it runs over the whole rows made of
    those columns (both happen over these tie-heavy rows)."""
    from clover_hf.decode import verification

    wholes = []
    real = TopPLogitsWarper.__call__
    monkeypatch.setattr(TopPLogitsWarper, "__call__", lambda self, ids, scores: wholes.append(scores.shape[1]) or
                        real(self, ids, scores))
    g = torch.Generator().manual_seed(4)
    fast = 0
    for trial in range(300):
        vocab = 2000
        scores = (torch.randn(3, vocab, generator=g) * 2).bfloat16().float()
        kth = scores.topk(30).values[:, -1:]
        cut = scores.masked_fill(scores < kth, -float("inf"))
        columns = (cut > -float("inf")).any(0).nonzero()[:, 0]
        warper = TopPLogitsWarper([0.3, 0.6, 0.9, 0.95][trial % 4], min_tokens_to_keep=1 + trial % 3)
        texts = torch.zeros(3, 1, dtype=torch.long)
        wholes.clear()
        got = verification._top_p_of_kept(cut[:, columns], warper, texts, columns, vocab)
        want = real(warper, texts, cut)
        assert torch.equal(got, want[:, columns]) and not (want > -float("inf"))[:, ~torch.isin(
            torch.arange(vocab), columns)].any(), trial
        fast += not wholes
    assert 0 < fast < 300  # both ways ran
