"""Tree verification: the attention mask of a tree forward, the base forward itself, and acceptance (greedy or
sampled)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import LogitsProcessorList
from transformers.generation.logits_process import (
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from clover_hf.base.verify_forward import top_k_columns
from clover_hf.heads.tree import StepTree, TreeBuffers

ROW_WISE = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper, TypicalLogitsWarper,
            EpsilonLogitsWarper, EtaLogitsWarper)


def sample_token(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One draw from `probs` (V,), unnormalised, by inverting its CDF at `uniform` in [0, 1).

    Exact like `torch.multinomial`, and much faster on CPU over a large vocabulary.
    """
    cdf = probs.cumsum(0)
    index = torch.searchsorted(cdf, uniform * cdf[-1], right=True)  # right: never a zero-mass token
    positions = torch.arange(probs.shape[0], device=probs.device)
    last = torch.where(probs > 0, positions, -1).argmax()  # where rounding puts u * total at the end
    return torch.minimum(index, last)


def process_tree_logits(
    logits: torch.Tensor,  # (N, V) float32 raw logits at each node
    input_ids: torch.Tensor,  # (1, L) emitted tokens, the root last
    tokens: torch.Tensor,  # (N,) node tokens, root first
    tree: TreeBuffers | StepTree,
    logits_processor: LogitsProcessorList,
) -> torch.Tensor:
    """Apply the logits processors to every node with that node's own prefix.

    Processors that read the prefix run once per depth; the sampling warpers, which only look at each
    row's own scores, run once over all nodes. The list's order is kept.
    """
    if not logits_processor:
        return logits
    scores = logits
    prefixes = None  # each depth's node prefixes, built once, when a processor first reads them
    for processor in logits_processor:
        if isinstance(processor, ROW_WISE):
            scores = processor(input_ids.expand(scores.shape[0], -1), scores)
            continue
        if prefixes is None:
            prefixes = _depth_prefixes(input_ids, tokens, tree)
        out = torch.empty_like(scores)
        for (start, end), ids in zip(tree.depth_ranges, prefixes):
            out[start:end] = processor(ids, scores[start:end])
        scores = out
    return scores


# warpers that may follow a top-k cut and act on the tokens it keeps alone: a removed token's probability stays 0 and
# takes no part in what they do to the others (top-p where that is certain: `_top_p_of_kept`)
AFTER_CUT = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
SCREENED_K = 256  # the largest k whose columns the lm_head's screen gives (a few times k columns a node)
# a cumulative probability this close to top-p's bound may fall on its other side over the whole row, whose sums run
# in another order: apart by under 3 float32 roundings (2^-24) per kept token, under 5e-5 for 256 of them; the margin
# grows past that with the tokens kept
TOP_P_MARGIN = 1e-4


@dataclass(frozen=True)
class TopKCut:
    """Logits processors read as a top-k cut: those before it (run over the whole vocabulary), its k, and the
    warpers after it (run over the tokens it keeps)."""

    before: LogitsProcessorList
    k: int
    after: tuple
    vocab: int | None = None  # the logits' width, where they may come as some columns alone (`screens`)

    @classmethod
    def of(cls, processors: LogitsProcessorList, vocab: int | None = None) -> "TopKCut | None":
        """The processors' cut: their first `TopKLogitsWarper`, where it and every processor after it is one of
        AFTER_CUT that fills what it removes with -inf (min-p keeping at least one token); else None."""
        at = next((i for i, p in enumerate(processors) if type(p) is TopKLogitsWarper), None)
        if at is None:
            return None
        for p in processors[at:]:
            if type(p) not in AFTER_CUT or getattr(p, "filter_value", -float("inf")) != -float("inf") or (
                    type(p) is MinPLogitsWarper and p.min_tokens_to_keep != 1):
                return None
        return cls(LogitsProcessorList(processors[:at]), processors[at].top_k, tuple(processors[at + 1 :]), vocab)

    @property
    def screens(self) -> bool:
        """Whether the cut reads the logits alone (no processor before it but a temperature, which keeps every
        two bf16 logits apart at temperatures of 1e-3 to 1e3): the lm_head may then give only the columns that may
        hold a node's k largest (`cpu.Screen.top_k`)."""
        return self.vocab is not None and self.k <= SCREENED_K and all(
            type(p) is TemperatureLogitsWarper and 1e-3 <= p.temperature <= 1e3 for p in self.before)


def sample_columns(
    logits: torch.Tensor,  # (N, V) float32 raw logits at each node
    input_ids: torch.Tensor,  # (1, L) emitted tokens, the root last
    tokens: torch.Tensor,  # (N,) node tokens, root first
    tree: TreeBuffers | StepTree,
    cut: TopKCut,
    columns: torch.Tensor | None = None,  # (C,) the vocabulary ids of `logits`' columns, ascending; None: all of them
    # the backend's top-k cut (`TorchBackend.top_k_columns`); None: torch's
    top_k: Callable[[torch.Tensor, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor] | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Each node's sampling distribution over the columns its top-k `cut` leaves some node, with the node tokens:
    (probs (N, C), their token ids (C,) ascending, each node token's column (N,)). It is `process_tree_logits(...)
    .softmax(-1)` at those columns (every other token's probability there is 0), up to the order of float32 sums,
    without its operations over the whole vocabulary after the cut (the cut, the softmax and the draw over every
    token cost a visible share of a step, even at one node). Given `columns` (where the cut `screens`: every
    logit left out lies below its node's k-th largest), node tokens outside them join at -inf. None where a score is
    a NaN."""
    ids, at = columns, tokens
    if columns is not None:
        ids, inverse = torch.cat([columns, tokens]).unique(return_inverse=True)
        given = logits
        logits = given.new_full((given.shape[0], ids.shape[0]), -float("inf"))
        logits[:, inverse[: columns.shape[0]]] = given
        at = inverse[columns.shape[0] :]
    scores = process_tree_logits(logits, input_ids, tokens, tree, cut.before)
    k = min(cut.k, scores.shape[1])
    made = (top_k or top_k_columns)(scores, k, at)
    if made is None:
        return None
    kth, kept_at = made
    kept = scores[:, kept_at]
    kept = kept.masked_fill(kept < kth[:, None], -float("inf"))
    kept_ids = kept_at if ids is None else ids[kept_at]
    texts = input_ids.expand(kept.shape[0], -1)
    for warper in cut.after:
        if type(warper) is TopPLogitsWarper:
            kept = _top_p_of_kept(kept, warper, texts, kept_ids, scores.shape[1] if ids is None else cut.vocab)
        else:
            kept = warper(texts, kept)
    return kept.softmax(-1), kept_ids, torch.searchsorted(kept_at, at)


def _top_p_of_kept(kept: torch.Tensor, warper: TopPLogitsWarper, texts: torch.Tensor, columns: torch.Tensor,
                   vocab: int) -> torch.Tensor:
    """`warper` (top-p) over rows (N, C) at vocabulary `columns`, every other token of which is removed (-inf): what
    it does over the whole rows (N, vocab), where that follows from these columns alone; else it runs over whole rows
    made of them (it sorts every token of the vocabulary, row by row). It does not follow where equal scores
    straddle its cut (which of them go follows torch.sort's order over the whole row, which is not stable) or a
    cumulative probability lies within TOP_P_MARGIN of its bound (more, with more tokens kept), which at common
    sampling settings happens on a good share of steps."""
    inf = float("inf")
    ranked, order = torch.sort(kept, descending=False)
    cumulative = ranked.softmax(-1).cumsum(-1)
    removed = cumulative <= (1 - warper.top_p)
    removed[..., -warper.min_tokens_to_keep :] = False
    finite = ranked > -inf
    margin = (finite.sum(-1, keepdim=True) * 2.0**-22).clamp(min=TOP_P_MARGIN)
    near = finite & ((cumulative - (1 - warper.top_p)).abs() <= margin)
    straddle = (torch.where(removed & finite, ranked, -inf).amax(-1)
                >= torch.where(~removed & finite, ranked, inf).amin(-1))
    out = kept.masked_fill(removed.scatter(1, order, removed), -inf)
    unsure = near.any(-1) | straddle
    if bool(unsure.any()):  # those rows whole: top-p reads each row alone
        rows = unsure.nonzero()[:, 0]
        whole = kept.new_full((rows.shape[0], vocab), -inf)
        whole[:, columns] = kept[rows]
        out[rows] = warper(texts[rows], whole)[:, columns]
    return out


def _depth_prefixes(input_ids: torch.Tensor, tokens: torch.Tensor, tree: TreeBuffers | StepTree) -> list[torch.Tensor]:
    """Per depth, the (n, L + depth) token prefixes of that depth's nodes: the text, then their path."""
    prefixes = []
    for depth, (start, end) in enumerate(tree.depth_ranges):
        path = tokens[tree.node_paths[start:end, :depth]]  # (n, depth) tokens below the root
        prefixes.append(torch.cat([input_ids.expand(end - start, -1), path], dim=1))
    return prefixes


def accept_greedy(
    tokens: torch.Tensor, targets: torch.Tensor, tree: TreeBuffers | StepTree, parents: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Deepest node whose path from the root matches the base's choice at every step.

    tokens, targets: (N,) drafted token and base argmax at each node; nodes are sorted by depth.
    `parents`: the tree's parents as a list, where the caller holds them on the host (else read with the
    tokens). Returns the accepted node indices (root first) and the bonus token (the base's choice after
    the last accepted node). The walk runs on the host, over the tokens read in one transfer (its one host
    sync): as torch ops on a tree of a few nodes, its per-operation overhead was a visible share of a step.
    """
    if tokens.shape[0] == 1:  # a plain decoding step
        return tokens.new_zeros(1), targets[0]
    rows = [tokens, targets.to(tokens.dtype)] + ([] if parents is not None else [tree.parents.to(tokens.dtype)])
    drafted, chosen, *read = torch.stack(rows).tolist()
    parents = read[0] if parents is None else parents
    passed = [True] + [drafted[node] == chosen[parents[node]] for node in range(1, len(parents))]
    path = _deepest_on_host(parents, passed)
    return torch.tensor(path, device=tokens.device), targets[path[-1]]


def _deepest_on_host(parents: list[int], passed: list[bool]) -> list[int]:
    """The path (root first) to the first of the deepest nodes whose every node from the root `passed` (nodes sorted
    by depth, so a parent comes first; the root passes)."""
    on_path, depths, last = [True], [0], 0
    for node in range(1, len(parents)):
        parent = parents[node]
        on_path.append(on_path[parent] and passed[node])
        depths.append(depths[parent] + 1)
        if on_path[node] and depths[node] > depths[last]:  # the first of the deepest, as an argmax picks
            last = node
    path = [last]
    while path[-1]:
        path.append(parents[path[-1]])
    return path[::-1]


def _deepest_path(passed: torch.Tensor, tree: TreeBuffers | StepTree) -> tuple[torch.Tensor, torch.Tensor]:
    """The deepest node whose every node from the root passed, and that path's node indices (root first)."""
    on_path = ~(tree.ancestors & ~passed[None, :]).any(dim=-1)
    last = torch.where(on_path, tree.depths, -1).argmax()
    return last, tree.ancestors[last].nonzero().flatten()  # the step's one host sync


def accept_sampled(
    tokens: torch.Tensor, probs: torch.Tensor, tree: TreeBuffers | StepTree, uniforms: torch.Tensor,
    parents: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless tree sampling: the emitted tokens follow the base's own sampling distribution exactly.

    tokens: (N,) node tokens, root first; probs: (N, V) the base's processed and warped distribution
    at each node; uniforms: (N,) draws from U[0, 1), one per node (the root's draws the last token).
    Drafts are point masses, so SpecInfer's recursive rejection reduces to: try the children of the
    current node in index order, accept child c with probability p(x_c) renormalised over the tokens
    of the siblings already rejected; when none is accepted (or at a leaf) sample the next token
    from p with those tokens removed. Nodes whose paths carry the same tokens (a lookup chain that
    repeats drafted tokens) are one node of the tree, so their children are all tried below it.
    On the CPU the walk runs on the host (`parents`: the tree's, where the caller holds them as a list); elsewhere
    all nodes are decided at once by tensor operations, without a host sync until the path is read off.
    Returns the accepted node indices (root first) and the sampled token after the last of them.
    """
    n = tokens.shape[0]
    if n == 1:  # a plain decoding step: what the walk below reduces to, a draw from the root's distribution
        return tokens.new_zeros(1), sample_token(probs[0], uniforms[0])
    if tokens.is_cpu:
        return _walk_on_host(tokens, probs, tree, uniforms, parents)
    return _walk_in_tensors(tokens, probs, tree, uniforms)


def _walk_on_host(tokens: torch.Tensor, probs: torch.Tensor, tree: TreeBuffers | StepTree, uniforms: torch.Tensor,
                  parents: list[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_sampled`'s walk over host lists: as a few dozen tensor operations on a tree of a few nodes, their
    per-operation overhead was a visible share of a drafted step. The acceptance tests run in float64 (the
    tensors' in float32: the two differ only where a uniform falls within float32 rounding of its bound)."""
    n = tokens.shape[0]
    parents = tree.parents.tolist() if parents is None else parents
    drafted, draws = tokens.tolist(), uniforms.tolist()
    first, paths, seen = [], [()], {(): 0}  # each node's first node with the same path of tokens (often itself)
    for node in range(n):
        if node:
            paths.append(paths[parents[node]] + (drafted[node],))
        first.append(seen.setdefault(paths[node], node))
    below = [first[parents[node]] for node in range(n)]  # a repeat's children hang below the first with its path
    children = [node for node in range(1, n) if first[node] == node]
    mass = probs[below[1:], tokens[1:]].tolist() if children else []  # p_parent(x_i) of every node but the root
    chosen, tried = [True] + [False] * (n - 1), {}  # tried: mass of a parent's children rejected so far
    for node in children:
        parent = below[node]
        if parent in tried and tried[parent] is None:  # an earlier sibling was accepted
            continue
        done = tried.get(parent, 0.0)
        if draws[node] * max(1.0 - done, 0.0) < mass[node - 1]:
            chosen[node], tried[parent] = True, None
        else:
            tried[parent] = done + mass[node - 1]
    path = _deepest_on_host(parents, [chosen[first[node]] for node in range(n)])  # a repeat falls with its first
    last = first[path[-1]]
    rejected = [drafted[node] for node in children if below[node] == last]  # every child of the last was tried
    residual = probs[last]
    if rejected:
        cut = residual.index_fill(0, torch.tensor(rejected), 0.0)
        residual = cut if bool(cut.sum() > 0) else residual  # rounding guard
    return torch.tensor(path), sample_token(residual, uniforms[0])  # the root's draw: no acceptance uses it


def _walk_in_tensors(tokens: torch.Tensor, probs: torch.Tensor, tree: TreeBuffers | StepTree, uniforms: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept_sampled`'s walk, every node decided at once by tensor operations (one host sync)."""
    n = tokens.shape[0]
    index = torch.arange(n, device=tokens.device)
    first = _first_with_same_path(tokens, tree)
    parents = first[tree.parents]  # a repeat's children hang below the first node with its path
    is_child = (index > 0) & (first == index)  # one child per distinct path; the root is its own parent
    earlier = (parents[:, None] == parents[None, :]) & (index[None, :] < index[:, None])
    earlier &= is_child[:, None] & is_child[None, :]  # [i, j]: j is a sibling tried before i
    mass = probs[parents, tokens]  # p_parent(x_i)
    tried = earlier.to(mass.dtype) @ mass  # mass removed by the rejected siblings before i
    accepted = is_child & (uniforms * (1.0 - tried).clamp(min=0.0) < mass)
    chosen = accepted & ~(earlier & accepted[None, :]).any(dim=1)  # the first accepted child of its parent
    chosen[0] = True
    last, nodes = _deepest_path(chosen[first], tree)  # a repeat stands or falls with its first
    last = first[last]
    rejected = (parents == last) & is_child  # every child of the last node was tried and rejected
    hit = probs.new_zeros(probs.shape[1]).index_add_(0, tokens, rejected.to(probs.dtype)) > 0
    residual = probs[last].masked_fill(hit, 0.0)
    residual = torch.where(residual.sum() > 0, residual, probs[last])  # rounding guard; no sync
    return nodes, sample_token(residual, uniforms[0])  # the root's draw is free: no acceptance uses it


def _first_with_same_path(tokens: torch.Tensor, tree: TreeBuffers | StepTree) -> torch.Tensor:
    """(N,) for each node, the first node whose path from the root carries the same tokens (often itself)."""
    paths = tokens[tree.node_paths]  # (N, D) tokens at depths 1..D; past a node's depth, the root's token
    same = (tree.depths[:, None] == tree.depths[None, :]) & (paths[:, None, :] == paths[None, :, :]).all(dim=-1)
    return same.int().argmax(dim=1)
