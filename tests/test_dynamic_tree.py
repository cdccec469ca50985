"""Dynamic (EAGLE-2-style) draft trees: selection, per-step tree tensors, exact greedy output."""

from __future__ import annotations

import pytest
import torch

from clover_hf import CloverConfig, CloverForCausalLM, DynamicTree
from clover_hf.decode.verification import accept_greedy
from clover_hf.heads.tree import StepTree, build_tree, select_dynamic, with_chain

from .tiny import oracle_model, prompt, same, tiny_model

t = torch.tensor
SPEC = {"depth": 3, "width": 3, "nodes": 10}



def test_step_tree_from_parents():
    static = build_tree([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    step = StepTree.from_parents(t([0, 0, 0, 1, 1, 2, 3]), t([0, 1, 1, 2, 2, 2, 3]), max_depth=3)
    anc = step.ancestors.int().tolist()
    assert anc[6] == [1, 1, 0, 1, 0, 0, 1] and anc[5] == [1, 0, 1, 0, 0, 1, 0] and anc[0] == [1, 0, 0, 0, 0, 0, 0]
    assert step.depth_ranges == ((0, 1), (1, 3), (3, 6), (6, 7))
    assert step.node_paths.tolist() == [[0, 0, 0], [1, 0, 0], [2, 0, 0], [1, 3, 0], [1, 4, 0], [2, 5, 0], [1, 3, 6]]
    tokens = t([5, 10, 11, 20, 21, 22, 30])
    targets = t([11, 20, 22, 30, 0, 99, 0])
    for tree in (static, step):
        nodes, bonus = accept_greedy(tokens, targets, tree)
        assert nodes.tolist() == [0, 2, 5] and bonus.item() == 99


def test_select_dynamic_keeps_parents_and_renumbers():
    # candidates in drafting order: depth 1: a b c; depth 2: children of a (ids 1) and of b (id 2)
    tokens = t([10, 11, 12, 20, 21, 22, 23])
    parents = t([0, 0, 0, 1, 1, 2, 2])
    depths = t([1, 1, 1, 2, 2, 2, 2])
    scores = t([-0.1, -1.0, -3.0, -0.1, -2.0, -1.5, -1.0])  # a child ties with its parent: the parent wins
    kept_tokens, kept_parents, kept_depths = select_dynamic(tokens, parents, depths, scores, nodes=4)
    assert kept_tokens.tolist() == [10, 11, 20, 23]
    assert kept_parents.tolist() == [0, 0, 1, 2]  # renumbered: 10 is node 1, 11 is node 2
    assert kept_depths.tolist() == [1, 1, 2, 2]


def test_with_chain_resorts_by_depth():
    tokens, parents, depths = t([7, 10, 11, 20]), t([0, 0, 0, 1]), t([0, 1, 1, 2])
    tok, par, dep = with_chain(tokens, parents, depths, t([30, 31, 32]))
    assert dep.tolist() == [0, 1, 1, 1, 2, 2, 3]
    assert tok.tolist() == [7, 10, 11, 30, 20, 31, 32]
    assert par.tolist() == [0, 0, 0, 0, 1, 3, 5]


def test_dynamic_tree_config():
    cfg = CloverConfig(hidden_size=8, vocab_size=16, num_attention_heads=2, num_heads=3, dynamic_tree=SPEC)
    assert cfg.dynamic_tree == SPEC
    with pytest.raises(ValueError, match="exceeds"):
        CloverConfig(hidden_size=8, vocab_size=16, num_attention_heads=2, num_heads=2, dynamic_tree=SPEC)
    with pytest.raises(ValueError, match="fewer than"):
        DynamicTree(depth=2, width=2, nodes=7)
    with pytest.raises(TypeError):
        CloverConfig(hidden_size=8, vocab_size=16, num_attention_heads=2, dynamic_tree={"deep": 3})


@pytest.mark.parametrize("arch", ["llama", "mistral", "gemma3_text", "gpt2"])
def test_dynamic_tree_accepts_long_paths(arch):
    base = tiny_model(arch)
    ids = prompt(3, length=6)
    ref = base.generate(ids, max_new_tokens=60, do_sample=False)
    clover = oracle_model(base, ref, dynamic_tree={"depth": 4, "width": 3, "nodes": 12})
    out = clover.generate(ids, max_new_tokens=60, do_sample=False)
    assert same(out, ref)
    stats = clover.generation_stats
    assert max(stats.accepted_lengths) == 4 and min(stats.accepted_lengths) <= 1
    assert stats.tokens_per_step > 2.5


@pytest.mark.parametrize(
    "processors", [dict(repetition_penalty=1.5), dict(no_repeat_ngram_size=2)], ids=["repetition", "no_repeat"]
)
@pytest.mark.parametrize("max_new_tokens", [3, 9, 30])
def test_dynamic_tree_with_processors_and_lengths(processors, max_new_tokens):
    base = tiny_model("qwen2")
    ids = prompt(9)
    ref = base.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, **processors)
    long_ref = base.generate(ids, max_new_tokens=40, do_sample=False, **processors)
    for clover in (CloverForCausalLM.from_base(base), oracle_model(base, long_ref, dynamic_tree=SPEC)):
        out = clover.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, tree=SPEC, **processors)
        assert same(out, ref)


def test_dynamic_tree_saved_with_heads(tmp_path):
    base = tiny_model("llama")
    clover = CloverForCausalLM.from_base(base, dynamic_tree=SPEC, lookup_tokens=5)
    clover.save_pretrained(tmp_path / "heads")
    again = CloverForCausalLM.from_pretrained(tmp_path / "heads", base_model=base)
    assert again.clover_config.dynamic_tree == SPEC and again.clover_config.lookup_tokens == 5
    ids = prompt(4)
    assert same(again.generate(ids, max_new_tokens=30, do_sample=False),
                 base.generate(ids, max_new_tokens=30, do_sample=False))


def test_accelerator_tree_is_the_default_off_the_cpu_only():
    """Heads may carry a second, larger tree for accelerators at batch size 1; the CPU and batches keep
    the static tree, and an explicit tree wins everywhere."""
    from clover_hf.decode.drafting import tree_spec as _tree_spec

    base = tiny_model("llama")
    ids = prompt(3, length=6)
    ref = base.generate(ids, max_new_tokens=40, do_sample=False)
    clover = oracle_model(base, ref, tree=[[0]], accelerator_dynamic_tree=SPEC)
    out = clover.generate(ids, max_new_tokens=40, do_sample=False)
    assert same(out, ref)
    assert max(clover.generation_stats.accepted_lengths) == 1  # the one-node static tree ran on the CPU
    config = clover.clover_config
    assert _tree_spec(None, config, torch.device("cpu"), 1) == [[0]]
    assert _tree_spec(None, config, torch.device("cuda"), 1) == DynamicTree(**SPEC)
    assert _tree_spec(None, config, torch.device("cuda"), 4) == [[0]]
    assert _tree_spec([[0], [1]], config, torch.device("cuda"), 1) == [[0], [1]]


def test_accelerator_tree_config_checks_and_round_trip(tmp_path):
    deep = {"depth": 4, "width": 2, "nodes": 6}
    with pytest.raises(ValueError, match="accelerator_dynamic_tree depth 4 exceeds the 3 heads"):
        CloverConfig(hidden_size=8, vocab_size=16, num_attention_heads=2, num_heads=3, accelerator_dynamic_tree=deep)
    with pytest.raises(ValueError, match="Medusa heads draft static trees only: drop accelerator_dynamic_tree"):
        CloverConfig(hidden_size=64, vocab_size=100, head_type="medusa", accelerator_dynamic_tree=SPEC)
    base = tiny_model("llama")
    CloverForCausalLM.from_base(base, accelerator_dynamic_tree=SPEC).save_pretrained(tmp_path / "heads")
    again = CloverForCausalLM.from_pretrained(tmp_path / "heads", base_model=base)
    assert again.clover_config.accelerator_dynamic_tree == SPEC and again.clover_config.dynamic_tree is None
    # heads without one save no such key, so clover-hf from before the field still reads them
    assert "accelerator_dynamic_tree" not in CloverConfig(hidden_size=8, vocab_size=16, num_attention_heads=2).to_dict()


def test_model_card_describes_the_draft_settings():
    from clover_hf.hub.card import render_model_card

    static = CloverConfig(hidden_size=8, vocab_size=16, num_attention_heads=2, num_heads=3, tree=[[0], [1], [0, 0]])
    assert "static, 3 nodes, depth 2" in render_model_card(static)
    dynamic = CloverConfig(hidden_size=8, vocab_size=16, num_attention_heads=2, num_heads=3, dynamic_tree=SPEC,
                           lookup_tokens=8)
    text = render_model_card(dynamic)
    assert "dynamic: 10 nodes chosen each step, depth 3, width 3, plus a prompt-lookup chain of up to 8 tokens" in text
    both = CloverConfig(hidden_size=8, vocab_size=16, num_attention_heads=2, num_heads=3, tree=[[0], [1], [0, 0]],
                        accelerator_dynamic_tree=SPEC)
    assert ("static, 3 nodes, depth 2; on a GPU or other accelerator, at batch size 1, the tree is dynamic: "
            "10 nodes chosen each step" in render_model_card(both))
