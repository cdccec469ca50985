"""Drafting: each row's tree for a step, from the heads (a static or dynamic tree) and the prompt-lookup
chain, assembled into the tokens, positions and attention of one verify forward."""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from clover_hf.heads.base import DraftHeads
from clover_hf.heads.lm_head import DraftLMHead
from clover_hf.heads.tree import DynamicTree, StepTree, TreeBuffers, build_tree, select_dynamic, with_chain

from .widths import prune


@dataclass
class Draft:
    """One row's tree to verify: node tokens (N,) root first, their tree, and for the draft budget the
    heads' probability of each node (N,) and which nodes are the lookup chain's (N,) (found by an
    `ngram`-token match). `host`: the budget's copy of (depths, parents, probs, is_chain) as lists; a draft cut by
    the budget has them there alone (probs and is_chain None)."""

    tokens: torch.Tensor
    tree: TreeBuffers | StepTree
    probs: torch.Tensor | None
    is_chain: torch.Tensor | None
    ngram: int
    host: tuple[list[int], list[int], list[float], list[bool]] | None = None

    def on_host(self) -> tuple[list[int], list[int], list[float], list[bool]]:
        """(depths, parents, probs, is_chain) as lists, read in one transfer (a host sync)."""
        if self.host is None and isinstance(self.tree, TreeBuffers):  # a static tree's shape is known: read the probs
            depths, parents, chain = self.tree.on_host
            self.host = (list(depths), list(parents), self.probs.float().tolist(), list(chain))
        elif self.host is None:
            t = self.tree
            depths, parents, probs, chain = torch.stack(  # float32: exact for node counts, and MPS has no float64
                [t.depths.float(), t.parents.float(), self.probs.float(), self.is_chain.float()]).tolist()
            self.host = ([int(d) for d in depths], [int(p) for p in parents], probs, [c > 0 for c in chain])
        return self.host

    def keep(self, nodes: list[int]) -> "Draft":
        """The draft cut to `nodes` (sorted, root first, closed under parents)."""
        depths, parents, probs, is_chain = self.on_host()
        kept_parents, kept_depths = prune(parents, depths, nodes)
        index = torch.tensor(nodes, device=self.tokens.device)
        tree = cut_shape(tuple(kept_parents), tuple(kept_depths), self.tokens.device)
        host = (kept_depths, kept_parents, [probs[i] for i in nodes], [is_chain[i] for i in nodes])
        return Draft(self.tokens[index], tree, None, None, self.ngram, host)

    def root_only(self) -> "Draft":
        """The draft cut to its root: a plain decoding step (its one-node tree is built once)."""
        tree, _ = chain_shape(1, self.tokens.device)
        return Draft(self.tokens[:1], tree, None, None, self.ngram, ([0], [0], [1.0], [False]))


def catch_up(heads: DraftHeads, row) -> int:
    """Run the heads' features (the Augmenting Block) over the positions accepted since they last
    drafted: steps that verify without the heads defer this work to the next step that drafts.
    Returns how many positions it ran."""
    if not row.pending:
        return 0
    hidden, embeds, positions = (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1) for parts in zip(*row.pending))
    features, row.aug_cache = heads.features(hidden, embeds, positions, cache=row.aug_cache)
    row.feature = features[0, -1]
    row.pending.clear()
    return positions.shape[1]


def stack_trees(drafts: list[Draft], rows: list, width: int | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One (B, N) forward's tokens, positions and (B, N, N) attention among new tokens; N is the largest
    tree's size, or `width` where that is more (a compiled forward's fixed width).

    Smaller trees are padded with filler nodes that only see themselves and are never accepted.
    """
    sizes = [d.tokens.shape[0] for d in drafts]
    width = max(sizes + [width or 0])
    if len(drafts) == 1 and width == sizes[0]:
        tokens, tree = drafts[0].tokens, drafts[0].tree
        return tokens[None], (rows[0].next_pos + tree.depths)[None], tree.ancestors[None]
    device = rows[0].next_pos.device
    ids = torch.stack([row.root.expand(width) for row in rows]).clone()
    positions = torch.stack([row.next_pos.expand(width) for row in rows]).clone()
    allowed = torch.eye(width, dtype=torch.bool, device=device).repeat(len(rows), 1, 1)
    for b, (draft, row, n) in enumerate(zip(drafts, rows, sizes)):
        ids[b, :n] = draft.tokens
        positions[b, :n] = row.next_pos + draft.tree.depths
        allowed[b, :n, :n] = draft.tree.ancestors
    return ids, positions, allowed


def tree_spec(tree: list[list[int]] | DynamicTree | dict | None, config, device: torch.device, batch: int
               ) -> list[list[int]] | DynamicTree:
    """The tree to draft: the caller's, else the heads' tree for this device and batch size."""
    if tree is None and device.type != "cpu" and batch == 1 and config.accelerator_dynamic_tree is not None:
        tree = config.accelerator_dynamic_tree
    if tree is None:
        tree = config.dynamic_tree if config.dynamic_tree is not None else config.tree
    return DynamicTree(**tree) if isinstance(tree, dict) else tree


def draft_tree(heads: DraftHeads, feature, root, spec, trees, chain, ngram: int, embed, lm_head: DraftLMHead
                ) -> Draft:
    """This step's tree drafted by the heads, with the lookup chain below its root."""
    if trees is not None:
        drafted, probs = heads.draft(feature, root, trees[0], embed, lm_head)
        tree = trees[chain.shape[0]]
        node_probs = probs.new_ones(tree.num_nodes)
        node_probs[tree.draft_nodes] = probs
        return Draft(tree.assemble(root, drafted, chain), tree, node_probs, tree.chain_flags, ngram)
    tokens, parents, depths, scores = heads.draft_dynamic(feature, root, spec.depth, spec.width, embed, lm_head)
    probs = (scores - torch.cat([scores.new_zeros(1), scores])[parents]).exp()  # each node's own, given its parent
    drafted, parents, depths, probs = select_dynamic(tokens, parents, depths, scores, spec.nodes, probs)
    zero = parents.new_zeros(1)
    tokens, parents, depths = torch.cat([root.view(1), drafted]), torch.cat([zero, parents]), torch.cat([zero, depths])
    probs = torch.cat([probs.new_ones(1), probs])
    is_chain = torch.zeros_like(tokens, dtype=torch.bool)
    if chain.numel():
        tokens, parents, depths, probs, is_chain = with_chain(
            tokens, parents, depths, chain, (probs, probs.new_ones(chain.shape[0])),
            (is_chain, torch.ones_like(chain, dtype=torch.bool)))
    return Draft(tokens, StepTree.from_parents(parents, depths, max(spec.depth, chain.shape[0])), probs, is_chain, ngram)


def static_trees(paths, device: torch.device | str, lookup_max: int, depth: int | None) -> list[TreeBuffers]:
    """The static tree (cut to `depth` levels, when given) compiled for each chain length 0..lookup_max."""
    return _compiled_trees(tuple(tuple(p) for p in paths), str(device), lookup_max, depth)


@functools.lru_cache(maxsize=64)
def _compiled_trees(paths: tuple[tuple[int, ...], ...], device: str, lookup_max: int, depth: int | None
                    ) -> list[TreeBuffers]:
    cut = [list(p) for p in paths if depth is None or len(p) <= depth]
    return [build_tree(cut, device, lookup=m) for m in range(lookup_max + 1)]


def shallower(spec, trees: list[TreeBuffers] | None, depth: int, lookup_max: int):
    """The step's tree spec and static trees, drafted no deeper than `depth` (builds are cached)."""
    if trees is not None:
        if depth >= len(trees[0].levels):
            return spec, trees
        return spec, static_trees(trees[0].paths, trees[0].depths.device, lookup_max, depth)
    if depth >= spec.depth:
        return spec, trees
    most = spec.width + (depth - 1) * spec.width**2  # what a tree that deep and wide can hold
    return DynamicTree(depth=depth, width=spec.width, nodes=min(spec.nodes, most)), trees


@functools.lru_cache(maxsize=512)
@torch.inference_mode(False)  # cached: its tensors outlive the decoding call that built them
def cut_shape(parents: tuple[int, ...], depths: tuple[int, ...], device: torch.device) -> StepTree:
    """A cut tree's shape (`StepTree.from_lists`), built once: steps keep the same few shapes again and again, and
    building one is a visible share of a step."""
    return StepTree.from_lists(list(parents), list(depths), device)


@functools.lru_cache(maxsize=256)
@torch.inference_mode(False)  # cached: its tensors outlive the decoding call that built them
def chain_shape(n: int, device: torch.device) -> tuple[StepTree, torch.Tensor]:
    """A chain of `n` nodes, root first (built once per length: most steps verify one), and which
    nodes are drafted."""
    depths = torch.arange(n, device=device)
    return StepTree.from_parents((depths - 1).clamp(min=0), depths, n - 1), depths > 0


def chain_tree(root: torch.Tensor, chain: torch.Tensor, ngram: int) -> Draft:
    """The root and the lookup chain alone: a step that does not draft with the heads."""
    n = chain.shape[0] + 1
    tree, is_chain = chain_shape(n, root.device)
    host = (list(range(n)), [0, *range(n - 1)], [0.0] + [1.0] * (n - 1), [False] + [True] * (n - 1))
    return Draft(torch.cat([root.view(1), chain]), tree, is_chain.float(), is_chain, ngram, host)


def no_deeper(draft: Draft, depth: int) -> Draft:
    """The part of a drafted tree at most `depth` below the root: near `max_length` deeper nodes could
    not be emitted, and their positions may lie past what the model embeds. Nodes are sorted by
    depth, so the part is a prefix."""
    if draft.tree.max_depth <= depth:
        return draft
    n = int((draft.tree.depths <= depth).sum())
    host = None if draft.host is None else tuple(part[:n] for part in draft.host)
    probs, is_chain = ((None, None) if draft.probs is None else (draft.probs[:n], draft.is_chain[:n]))
    return Draft(draft.tokens[:n], StepTree.from_parents(draft.tree.parents[:n], draft.tree.depths[:n], depth),
                  probs, is_chain, draft.ngram, host)


def draft_rows(rows: list, heads: DraftHeads | None, spec, trees: list[TreeBuffers] | None, chain_len: int | None,
               max_length: int, embed, lm_head: DraftLMHead | None
               ) -> tuple[list[Draft], list[torch.Tensor], float, int]:
    """Each row's tree for this step: drafted by `heads` from the rows of `lm_head` with the lookup chain below
    its root, or (heads and lm_head None) the chain alone, no deeper than the row's `max_length` leaves room
    for. `chain_len`: the chain's length (None: each row's own). Returns the drafts, the chains, and the seconds
    and positions the Augmenting Block spent catching up."""
    drafts, chains = [], []
    augment_s, augmented = 0.0, 0
    for row in rows:
        text = row.emitter.input_ids[0, row.start :]
        depth_left = max_length - row.emitter.input_ids.shape[1] - 1  # after the bonus token
        n = min(row.chain_len if chain_len is None else chain_len, depth_left)
        chain_start, ngram = row.ngrams.match(n) if n > 0 else (text.shape[0], 0)
        chain = text[chain_start : chain_start + n]
        if heads is not None:
            augment_start = time.perf_counter()
            augmented += catch_up(heads, row)
            augment_s += time.perf_counter() - augment_start
            draft = draft_tree(heads, row.feature, row.root, spec, trees, chain, ngram, embed, lm_head)
        else:
            draft = chain_tree(row.root, chain, ngram)
        drafts.append(no_deeper(draft, depth_left))
        chains.append(chain)
    return drafts, chains, augment_s, augmented

