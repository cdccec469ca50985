"""Static draft trees compiled once into index tensors (after Medusa's `generate_medusa_buffers`).

Node 0 is the root: the token chosen after the last accepted one. The other nodes are the tree's
paths sorted by depth, so the nodes of each depth are contiguous. A tree may also carry a lookup
chain: one extra branch below the root whose tokens come from an n-gram match in the text so far
(prompt lookup) instead of the heads; its nodes sort after the drafted ones of each depth.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from itertools import accumulate

import torch


def validate_tree(tree: list[list[int]], num_heads: int) -> list[list[int]]:
    """Check a tree in the Medusa path format and return it as a sorted list of lists.

    Every path's parent (the path without its last rank) must also be in the tree, so the tree is
    closed under prefixes, and no path may be deeper than the number of heads that draft it.
    """
    if not tree:
        raise ValueError("tree must hold at least one path, e.g. [[0], [0, 0]]")
    paths = sorted({tuple(int(r) for r in p) for p in tree}, key=lambda p: (len(p), p))
    known = set(paths)
    for p in paths:
        if len(p) == 0 or any(r < 0 for r in p):
            raise ValueError(f"tree path {list(p)} must be a non-empty list of ranks >= 0")
        if len(p) > num_heads:
            raise ValueError(
                f"tree path {list(p)} has depth {len(p)} but the heads draft only {num_heads} tokens; "
                f"use paths of at most {num_heads} ranks or train more heads"
            )
        if len(p) > 1 and p[:-1] not in known:
            raise ValueError(f"tree path {list(p)} has no parent {list(p[:-1])} in the tree")
    return [list(p) for p in paths]


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
    node_paths: torch.Tensor  # (N, D) node indices at depths 1..depth of each node's path, padded with 0
    depth_ranges: tuple[tuple[int, int], ...]  # [start, end) node indices of each depth, root first
    levels: tuple[TreeLevel, ...]  # how the heads draft their nodes, one level per depth
    draft_nodes: torch.Tensor  # (n_drafted,) node index of each drafted token, in drafting order
    lookup_nodes: torch.Tensor  # (n_lookup,) node indices of the lookup chain, shallowest first
    on_host: tuple[tuple[int, ...], tuple[int, ...], tuple[bool, ...]]  # depths, parents, lookup nodes (N,) each
    chain_flags: torch.Tensor  # (N,) bool: the lookup chain's nodes
    order: torch.Tensor  # (N,) each node's place in [root, drafted tokens, lookup chain]

    @property
    def num_nodes(self) -> int:
        return self.depths.shape[0]

    @property
    def max_depth(self) -> int:
        return self.node_paths.shape[1]

    def assemble(self, root: torch.Tensor, drafted: torch.Tensor, lookup: torch.Tensor) -> torch.Tensor:
        """Node tokens (N,): the root, the heads' drafts and the lookup chain, each at its nodes."""
        return torch.cat([root.view(1), drafted, lookup])[self.order]


LOOKUP_RANK = 1 << 30  # the rank that marks lookup-chain nodes in a path; sorts after any drafted sibling


def build_tree(paths: list[list[int]], device: torch.device | str = "cpu", lookup: int = 0) -> TreeBuffers:
    """Compile a tree in the Medusa path format, plus a lookup chain of `lookup` nodes; cached."""
    key = tuple(tuple(p) for p in validate_tree(paths, num_heads=max(len(p) for p in paths) if paths else 1))
    if lookup < 0:
        raise ValueError(f"lookup must be >= 0, got {lookup}")
    return _build_tree(key, str(torch.device(device)), lookup)


@lru_cache(maxsize=128)
@torch.inference_mode(False)  # cached: its tensors outlive the (inference-mode) decoding call that built them
def _build_tree(drafted: tuple[tuple[int, ...], ...], device: str, lookup: int) -> TreeBuffers:
    chain = [(LOOKUP_RANK,) * d for d in range(1, lookup + 1)]
    paths = tuple(sorted(drafted + tuple(chain), key=lambda p: (len(p), p)))
    index = {(): 0} | {p: i + 1 for i, p in enumerate(paths)}
    depths = [0] + [len(p) for p in paths]
    parents = [0] + [index[p[:-1]] for p in paths]
    shape = StepTree.from_lists(parents, depths, torch.device("cpu"))
    has_children = {p[:-1] for p in paths}
    is_chain = (False,) + tuple(p[0] == LOOKUP_RANK for p in paths)

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
        ancestors=shape.ancestors.to(device),
        node_paths=shape.node_paths.to(device),
        depth_ranges=shape.depth_ranges,
        levels=tuple(
            TreeLevel(lv.k, dev(lv.child_parent), dev(lv.child_rank), dev(lv.parent_of_expanded), dev(lv.next_expanded))
            for lv in levels
        ),
        draft_nodes=torch.tensor([index[p] for p in drafted], dtype=torch.long, device=device),
        lookup_nodes=torch.tensor([index[p] for p in chain], dtype=torch.long, device=device),
        on_host=(tuple(depths), tuple(parents), is_chain),
        chain_flags=torch.tensor(is_chain, device=device),
        order=torch.tensor([0, *(1 + len(drafted) + len(p) - 1 if chain else 1 + drafted.index(p)
                                 for p, chain in zip(paths, is_chain[1:]))], device=device),
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


@dataclass(frozen=True)
class DynamicTree:
    """An EAGLE-2-style tree drafted anew each step: the `width` likeliest paths are expanded at each
    of `depth` levels (top-`width` children each), then the `nodes` likeliest drafts are verified."""

    depth: int = 4
    width: int = 4
    nodes: int = 16

    def __post_init__(self) -> None:
        if self.depth < 1 or self.width < 1 or self.nodes < 1:
            raise ValueError(f"dynamic tree depth, width and nodes must be >= 1, got {self}")
        if self.nodes > self.width + (self.depth - 1) * self.width**2:
            raise ValueError(f"a dynamic tree of depth {self.depth} and width {self.width} drafts fewer than {self.nodes} nodes")


@dataclass
class StepTree:
    """A tree from parent pointers (nodes sorted by depth, root first): a dynamic tree's shape each
    step, and how static trees are compiled."""

    depths: torch.Tensor  # (N,)
    parents: torch.Tensor  # (N,) the root is its own parent
    ancestors: torch.Tensor  # (N, N) bool: node i may attend to node j
    max_depth: int  # no node is deeper (known to the caller, so reading the depths needs no host sync)

    @classmethod
    def from_parents(cls, parents: torch.Tensor, depths: torch.Tensor, max_depth: int) -> "StepTree":
        n = parents.shape[0]
        ancestors = torch.eye(n, dtype=torch.bool, device=parents.device)
        rows, up = torch.arange(n, device=parents.device), parents
        for _ in range(max_depth):  # one level up per pass, no host sync: the root points at itself
            ancestors[rows, up] = True
            up = parents[up]
        return cls(depths, parents, ancestors, max_depth)

    @classmethod
    def from_lists(cls, parents: list[int], depths: list[int], device: torch.device) -> "StepTree":
        """`from_parents` of a tree the host holds as lists: its ancestors made there, in two transfers where
        `from_parents` runs two ops a level."""
        ancestors = []
        for node, parent in enumerate(parents):
            row = list(ancestors[parent]) if node else [False] * len(parents)
            row[node] = True
            ancestors.append(row)
        parents_t, depths_t = torch.tensor([parents, depths], device=device)
        return cls(depths_t, parents_t, torch.tensor(ancestors, device=device), max(depths))

    @property
    def num_nodes(self) -> int:
        return self.depths.shape[0]

    @cached_property
    def depth_ranges(self) -> tuple[tuple[int, int], ...]:
        counts = torch.bincount(self.depths).tolist()  # a host sync; needed only by logits processors
        ends = list(accumulate(counts))
        return tuple((end - c, end) for c, end in zip(counts, ends))

    @cached_property
    def node_paths(self) -> torch.Tensor:
        """(N, max_depth): the node at depths 1..max_depth on each node's path (0 past its own depth)."""
        levels = torch.arange(1, self.max_depth + 1, device=self.depths.device)
        at = self.ancestors[:, None, :] & (self.depths[None, None, :] == levels[None, :, None])  # (N, D, N)
        return at.int().argmax(dim=-1)


def select_dynamic(
    tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor, nodes: int,
    *extras: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Keep the `nodes` likeliest drafted candidates (a prefix-closed set) and renumber them.

    Candidates come in drafting order (by depth); `parents` index candidates + 1 (0 is the root) and
    `scores` are path log-probabilities, never higher than the parent's, so a stable sort keeps every
    kept node's parent. Returns (tokens, parents, depths) of the kept nodes, root excluded, by depth,
    then each of `extras` (other per-candidate values) at the kept nodes.
    """
    order = scores.sort(descending=True, stable=True).indices[:nodes]
    kept = order.sort().values  # drafting order is depth order
    new_index = torch.zeros(tokens.shape[0] + 1, dtype=torch.long, device=tokens.device)
    new_index[kept + 1] = torch.arange(1, kept.shape[0] + 1, device=tokens.device)
    return (tokens[kept], new_index[parents[kept]], depths[kept], *(extra[kept] for extra in extras))


def with_chain(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, chain: torch.Tensor,
               *extras: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Append a lookup chain below the root and re-sort all nodes by depth (root included, first).

    Each of `extras` is a pair (per-node values of the tree, the chain's values) that is joined and
    re-sorted the same way; returns tokens, parents, depths, then each joined extra.
    """
    n, m = tokens.shape[0], chain.shape[0]
    device = tokens.device
    steps = torch.arange(m, device=device)
    tokens = torch.cat([tokens, chain])
    parents = torch.cat([parents, torch.where(steps == 0, 0, n + steps - 1)])
    depths = torch.cat([depths, steps + 1])
    order = depths.sort(stable=True).indices
    position = torch.empty_like(order)
    position[order] = torch.arange(n + m, device=device)
    joined = tuple(torch.cat(pair)[order] for pair in extras)
    return (tokens[order], position[parents[order]], depths[order], *joined)
