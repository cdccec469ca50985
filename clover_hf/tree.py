"""Static draft trees compiled once into index tensors (after Medusa's `generate_medusa_buffers`).

Node 0 is the root: the token chosen after the last accepted one. The other nodes are the tree's
paths sorted by depth, so the nodes of each depth are contiguous. A tree may also carry a lookup
chain: one extra branch below the root whose tokens come from an n-gram match in the text so far
(prompt lookup) instead of the heads; its nodes sort after the drafted ones of each depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from .config import validate_tree


@dataclass(frozen=True)
class TreeLevel:
    """Index tensors to draft the nodes of one depth from the expanded nodes of the depth above."""

    k: int  # top-k taken from each expanded parent's logits
    child_parent: torch.Tensor  # (n_level,) index of each node's parent among the expanded parents
    child_rank: torch.Tensor  # (n_level,) rank of each node in its parent's top-k
    parent_of_expanded: torch.Tensor | None  # expanded parents: index of their parent one level up
    next_expanded: torch.Tensor | None  # which nodes of this level have children (None: last level)


@dataclass(frozen=True)
class TreeBuffers:
    paths: tuple[tuple[int, ...], ...]
    depths: torch.Tensor  # (N,) depth of each node, root 0
    parents: torch.Tensor  # (N,) parent node of each node (root: 0)
    ancestors: torch.Tensor  # (N, N) bool: node i may attend to node j (j is i or an ancestor of i)
    retrieve: torch.Tensor  # (L, D+1) node indices of each root-to-leaf path, padded with -1
    node_paths: torch.Tensor  # (N, D) node indices at depths 1..depth of each node's path, padded with 0
    depth_ranges: tuple[tuple[int, int], ...]  # [start, end) node indices of each depth, root first
    levels: tuple[TreeLevel, ...]  # how the heads draft their nodes, one level per depth
    draft_nodes: torch.Tensor  # (n_drafted,) node index of each drafted token, in drafting order
    lookup_nodes: torch.Tensor  # (n_lookup,) node indices of the lookup chain, shallowest first

    @property
    def num_nodes(self) -> int:
        return self.depths.shape[0]

    @property
    def max_depth(self) -> int:
        return self.retrieve.shape[1] - 1

    def assemble(self, root: torch.Tensor, drafted: torch.Tensor, lookup: torch.Tensor) -> torch.Tensor:
        """Node tokens (N,): the root, the heads' drafts and the lookup chain, each at its nodes."""
        tokens = root.new_empty(self.num_nodes)
        tokens[0] = root
        tokens[self.draft_nodes] = drafted
        tokens[self.lookup_nodes] = lookup
        return tokens


LOOKUP_RANK = 1 << 30  # the rank that marks lookup-chain nodes in a path; sorts after any drafted sibling


def build_tree(paths: list[list[int]], device: torch.device | str = "cpu", lookup: int = 0) -> TreeBuffers:
    """Compile a tree in the Medusa path format, plus a lookup chain of `lookup` nodes; cached."""
    key = tuple(tuple(p) for p in validate_tree(paths, num_heads=max(len(p) for p in paths) if paths else 1))
    if lookup < 0:
        raise ValueError(f"lookup must be >= 0, got {lookup}")
    return _build_tree(key, str(torch.device(device)), lookup)


@lru_cache(maxsize=128)
def _build_tree(drafted: tuple[tuple[int, ...], ...], device: str, lookup: int) -> TreeBuffers:
    chain = [(LOOKUP_RANK,) * d for d in range(1, lookup + 1)]
    paths = tuple(sorted(drafted + tuple(chain), key=lambda p: (len(p), p)))
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    n = len(index)
    depths = [0] + [len(p) for p in paths]
    parents = [0] + [index[p[:-1]] for p in paths]
    ancestors = torch.zeros(n, n, dtype=torch.bool)
    for p, i in index.items():
        for d in range(len(p) + 1):
            ancestors[i, index[p[:d]]] = True

    has_children = {p[:-1] for p in paths}
    leaves = [p for p in index if p not in has_children]
    max_depth = max(depths)
    retrieve = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)
    for r, leaf in enumerate(leaves):
        for d in range(len(leaf) + 1):
            retrieve[r, d] = index[leaf[:d]]

    node_paths = torch.zeros(n, max_depth, dtype=torch.long)
    for p, i in index.items():
        for d in range(1, len(p) + 1):
            node_paths[i, d - 1] = index[p[:d]]
    depth_ranges = tuple(
        (depths.index(d), len(depths) - depths[::-1].index(d)) for d in range(max_depth + 1)
    )

    levels = []
    expanded = [()]  # parents of the current level, in drafting order
    draft_depth = max(len(p) for p in drafted)
    for depth in range(1, draft_depth + 1):
        nodes = [p for p in drafted if len(p) == depth]
        pos = {p: i for i, p in enumerate(expanded)}
        nxt = [p for p in nodes if p in has_children]
        levels.append(
            TreeLevel(
                k=max(p[-1] for p in nodes) + 1,
                child_parent=torch.tensor([pos[p[:-1]] for p in nodes]),
                child_rank=torch.tensor([p[-1] for p in nodes]),
                parent_of_expanded=None,
                next_expanded=torch.tensor([nodes.index(p) for p in nxt]) if depth < draft_depth else None,
            )
        )
        expanded = nxt
    # parent_of_expanded of level d: for each expanded parent, its own parent's index one level up.
    for d in range(1, len(levels)):
        prev = levels[d - 1]
        levels[d] = TreeLevel(
            k=levels[d].k,
            child_parent=levels[d].child_parent,
            child_rank=levels[d].child_rank,
            parent_of_expanded=prev.child_parent[prev.next_expanded],
            next_expanded=levels[d].next_expanded,
        )

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return TreeBuffers(
        paths=paths,
        depths=torch.tensor(depths, device=device),
        parents=torch.tensor(parents, device=device),
        ancestors=ancestors.to(device),
        retrieve=retrieve.to(device),
        node_paths=node_paths.to(device),
        depth_ranges=depth_ranges,
        levels=tuple(
            TreeLevel(lv.k, dev(lv.child_parent), dev(lv.child_rank), dev(lv.parent_of_expanded), dev(lv.next_expanded))
            for lv in levels
        ),
        draft_nodes=torch.tensor([index[p] for p in drafted], dtype=torch.long, device=device),
        lookup_nodes=torch.tensor([index[p] for p in chain], dtype=torch.long, device=device),
    )



def tree_from_accuracies(rank_probs: list[list[float]], size: int) -> list[list[int]]:
    """The `size`-node tree with the largest expected accepted length (Medusa's greedy tree search).

    rank_probs[i][r] is the measured chance that the base's choice is head i's r-th candidate, given
    a correct parent. A path's chance of being accepted is the product along it; greedily adding the
    most likely child keeps the tree closed under prefixes and maximises the sum of node chances.
    """
    if size < 1 or not rank_probs:
        raise ValueError("need size >= 1 and accuracies for at least one head")
    chosen: dict[tuple[int, ...], float] = {}
    frontier = {(r,): p for r, p in enumerate(rank_probs[0])}
    while len(chosen) < size and frontier:
        path = max(frontier, key=lambda p: (frontier[p], -len(p)))
        chance = frontier.pop(path)
        chosen[path] = chance
        depth = len(path)
        if depth < len(rank_probs):
            for r, p in enumerate(rank_probs[depth]):
                frontier[path + (r,)] = chance * p
    return [list(p) for p in sorted(chosen, key=lambda p: (len(p), p))]


def expected_accepted(paths: list[list[int]], rank_probs: list[list[float]]) -> float:
    """Expected drafted tokens accepted per step under the same independence model."""
    total = 0.0
    for p in paths:
        chance = 1.0
        for depth, r in enumerate(p):
            chance *= rank_probs[depth][r] if r < len(rank_probs[depth]) else 0.0
        total += chance
    return total
