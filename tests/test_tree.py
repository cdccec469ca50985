"""Tree compilation, masks and greedy acceptance on hand-made examples."""

from __future__ import annotations

import pytest
import torch

from clover_hf import DEFAULT_TREE, build_tree
from clover_hf.base.forward import additive_mask
from clover_hf.decode.verification import accept_greedy
from clover_hf.heads.config import validate_tree

TREE = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]


def test_build_tree_indices():
    t = build_tree(TREE)
    # nodes: 0 root, 1 [0], 2 [1], 3 [0,0], 4 [0,1], 5 [1,0], 6 [0,0,0]
    assert t.num_nodes == 7 and t.max_depth == 3
    assert t.depths.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert t.parents.tolist() == [0, 0, 0, 1, 1, 2, 3]
    assert t.depth_ranges == ((0, 1), (1, 3), (3, 6), (6, 7))
    anc = t.ancestors.int().tolist()
    assert anc[6] == [1, 1, 0, 1, 0, 0, 1]
    assert anc[5] == [1, 0, 1, 0, 0, 1, 0]
    assert t.node_paths.tolist()[6] == [1, 3, 6] and t.node_paths.tolist()[5] == [2, 5, 0]
    assert [lv.k for lv in t.levels] == [2, 2, 1]
    assert t.levels[1].child_parent.tolist() == [0, 0, 1]  # [0,0],[0,1] from [0]; [1,0] from [1]
    assert t.levels[1].parent_of_expanded.tolist() == [0, 0]  # expanded [0] and [1] hang off the root
    assert t.levels[2].parent_of_expanded.tolist() == [0]  # [0,0] hangs off expanded [0]
    assert build_tree(TREE) is t  # compiled once per (tree, device)


def test_default_tree_is_valid():
    t = build_tree(DEFAULT_TREE)
    assert 16 <= t.num_nodes - 1 <= 32


@pytest.mark.parametrize(
    "bad, message",
    [([], "at least one"), ([[0, 0]], "no parent"), ([[0], [0, 0], [0, 0, 0]], "depth 3"), ([[-1]], ">= 0")],
)
def test_validate_tree_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        validate_tree(bad, num_heads=2)


def test_accept_greedy_picks_longest_path_and_bonus():
    t = build_tree(TREE)
    tokens = torch.tensor([5, 10, 11, 20, 21, 22, 30])
    # base's argmax at each node: root -> 11 (so branch [1] matches), [1] -> 22 ([1,0] matches), [1,0] -> 99
    targets = torch.tensor([11, 20, 22, 30, 0, 99, 0])
    nodes, bonus = accept_greedy(tokens, targets, t)
    assert nodes.tolist() == [0, 2, 5] and bonus.item() == 99
    # nothing matches: root only, bonus is the root's argmax
    nodes, bonus = accept_greedy(tokens, torch.full((7,), 7), t)
    assert nodes.tolist() == [0] and bonus.item() == 7
    # the full-depth path
    targets = torch.tensor([10, 20, 0, 30, 0, 0, 42])
    nodes, bonus = accept_greedy(tokens, targets, t)
    assert nodes.tolist() == [0, 1, 3, 6] and bonus.item() == 42


def test_accept_greedy_takes_the_first_of_the_deepest_matching_paths():
    # random trees whose siblings may carry the same token (a lookup chain repeating a drafted one): the accepted path
    # is the deepest whose every node matches, the first in node order among equally deep ones
    from clover_hf.heads.tree import StepTree

    torch.manual_seed(0)
    for _ in range(300):
        n = int(torch.randint(2, 14, ()))
        parents = [0] + [int(torch.randint(0, i, ())) for i in range(1, n)]
        depths = [0]
        for i in range(1, n):
            depths.append(depths[parents[i]] + 1)
        order = sorted(range(n), key=lambda i: (depths[i], i))  # nodes sorted by depth, parents first
        index = {old: new for new, old in enumerate(order)}
        parents = [index[parents[old]] for old in order]
        depths = [depths[old] for old in order]
        tree = StepTree.from_parents(torch.tensor(parents), torch.tensor(depths), max(depths))
        tokens, targets = torch.randint(0, 3, (n,)), torch.randint(0, 3, (n,))
        on_path = [True] * n
        for i in range(1, n):
            on_path[i] = on_path[parents[i]] and tokens[i] == targets[parents[i]]
        last = max(range(n), key=lambda i: (on_path[i], depths[i], -i))
        path = [last]
        while path[-1]:
            path.append(parents[path[-1]])
        for given in (None, parents):
            nodes, bonus = accept_greedy(tokens, targets, tree, given)
            assert nodes.tolist() == path[::-1] and bonus.item() == targets[last].item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_unpadded_rows_tree_mask_is_the_layouts(dtype):
    from clover_hf.base.forward import MaskLayout
    from clover_hf.decode.rows import Batch

    layout = MaskLayout(mapping=False, sliding_window=None)
    t = build_tree(TREE)
    for past in (1, 7, 40):
        positions = torch.arange(past)[None]
        batch = Batch([], None, positions, layout, plain_mask=True)
        node_pos = (past + t.depths)[None]
        mask = batch.attention(node_pos, t.ancestors[None], dtype)
        assert torch.equal(mask, layout.build(positions, node_pos, t.ancestors[None], dtype))
        assert mask.dtype == dtype and (mask[0, 0, :, :past] == 0).all()


def test_additive_mask_prefix_tree_and_window():
    t = build_tree(TREE)
    past = torch.tensor([-1, 0, 1, 2, 3])  # one padded key, then positions 0..3
    pos = 4 + t.depths
    m = additive_mask(past, pos, t.ancestors, torch.float32)
    assert m.shape == (1, 1, 7, 12) and m.dtype == torch.float32
    blocked = m[0, 0] < 0
    assert blocked[:, 0].all() and not blocked[:, 1:5].any()
    assert blocked[:, 5:].tolist() == (~t.ancestors).tolist()
    w = additive_mask(past, pos, t.ancestors, torch.bfloat16, sliding_window=3)[0, 0] < 0
    # node 6 sits at position 7: with a window of 3 it sees positions 5..7 only: [0], [0,0] and itself
    assert w[6, :5].all() and w[6].tolist()[5:] == [True, False, True, False, True, True, False]


def test_tree_from_accuracies_prefers_likely_paths():
    from clover_hf.heads.tree import expected_accepted, tree_from_accuracies

    ranks = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.2, 0.1]]
    tree = tree_from_accuracies(ranks, 5)
    assert tree == [[0], [1], [0, 0], [0, 1], [0, 0, 0]]  # chances .6 .2 .3 .12 .12 beat [2]=.1
    build_tree(tree)  # closed under prefixes
    assert expected_accepted(tree, ranks) == pytest.approx(0.6 + 0.2 + 0.3 + 0.12 + 0.12)
    bigger = tree_from_accuracies(ranks, 12)
    assert expected_accepted(bigger, ranks) > expected_accepted(tree, ranks)
    assert len(bigger) == 12 and all(p[:-1] in bigger or len(p) == 1 for p in bigger)
