"""The decode loop's steps for a batch's rows: draft each row's tree (cut by the budget to what pays), fit it to the
cache's room, accept each row's longest matching path and bonus token, emit the tokens, and queue the accepted
positions for the heads."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
from torch import nn

from clover_hf.backends import TorchBackend
from clover_hf.base.verify_forward import Verified

from .choosing import StepBudget
from .drafting import Draft, draft_rows
from .rows import Row

if TYPE_CHECKING:
    from .call import Plan
from .stats import Clock, GenerationStats
from .verification import TopKCut, accept_greedy, accept_sampled, process_tree_logits, sample_columns


def draft(rows: list[Row], plan: Plan, budget: StepBudget | None, stats: GenerationStats, clock: Clock
           ) -> tuple[list[Draft], list[torch.Tensor]]:
    """Each row's tree for this step and its lookup chain: drafted by the heads with the chain below the
    root (or the chain alone, while the budget pauses the heads), cut by the budget to what pays."""
    with_heads = budget is None or budget.drafting()
    lm_head = plan.lm_head if with_heads else None  # made at the first draft: not part of what drafting costs
    started = time.perf_counter()
    spec, trees = budget.shallower(plan.spec, plan.trees) if with_heads and budget else (plan.spec, plan.trees)
    drafts, chains, augment_s, augmented = draft_rows(
        rows, plan.heads if with_heads else None, spec, trees, None if budget is None else plan.lookup_max,
        plan.max_length, plan.embed, lm_head)
    stats.head_drafts += with_heads
    clock.lap("draft")
    if budget is not None:
        drafts = budget.choose(drafts, with_heads, started, augment_s, augmented,
                               [row.emitter.input_ids.shape[1] for row in rows])
        clock.lap("choose")
    return drafts, chains


def fit(drafts: list[Draft], room: int | None) -> list[Draft]:
    """The drafts cut to the root where a static cache has no room left for the whole tree (a caller's own
    cache, sized for the text alone: near its end, steps verify one token)."""
    if room is None or all(d.tokens.shape[0] <= room for d in drafts):
        return drafts
    return [d.root_only() for d in drafts]


def accept_rows(rows: list[Row], drafts: list[Draft], verified: Verified, backend: TorchBackend, logits_processor,
                sample: bool, cut: TopKCut | None, stats: GenerationStats, budget: StepBudget | None
                ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Each row's accepted nodes (root first), bonus token, and its tree's scores after the logits processors
    (greedy, or lossless rejection sampling, over the tokens a top-k `cut` keeps where one is given; the scores are
    None where the forward gave each node's greedy choice, `targets`, instead of logits, or the cut served). The
    logits are those of the vocabulary's `columns` alone where the forward gave those. The budget learns what was
    accepted."""
    logits, targets, columns = verified.logits, verified.targets, verified.columns
    accepted = []
    for b, (row, draft) in enumerate(zip(rows, drafts)):
        tokens, tree = draft.tokens, draft.tree
        n = tokens.shape[0]
        host = None if draft.host is None else draft.host[1]
        scores = None
        if targets is not None:
            nodes, bonus = accept_greedy(tokens, targets[b, :n], tree, host)
        elif sample:
            uniforms = torch.rand(n, device=tokens.device)
            made = None if cut is None else sample_columns(logits[b, :n], row.emitter.input_ids, tokens, tree, cut,
                                                          columns, backend.top_k_columns)
            if made is not None:
                probs, ids, at = made
                nodes, bonus = accept_sampled(at, probs, tree, uniforms, host)
                bonus = ids[bonus]
            elif columns is not None:  # the whole logits are not at hand, and these hold a NaN: no distribution
                raise RuntimeError("clover-hf: the base's logits hold a NaN, so there is no distribution to sample "
                                   "from (the model's weights or activations are not finite)")
            else:
                scores = process_tree_logits(logits[b, :n], row.emitter.input_ids, tokens, tree, logits_processor)
                nodes, bonus = accept_sampled(tokens, scores.softmax(-1), tree, uniforms, host)
        else:
            scores = process_tree_logits(logits[b, :n], row.emitter.input_ids, tokens, tree, logits_processor)
            nodes, bonus = accept_greedy(tokens, backend.argmax(scores), tree, host)
        stats.accepted_lengths.append(nodes.shape[0] - 1)
        stats.verified_tokens += n
        if budget is not None:
            budget.accepted(b, draft, nodes)
        accepted.append((nodes, bonus, scores))
    return accepted


def emit_rows(rows: list[Row], drafts: list[Draft], chains: list[torch.Tensor], accepted,
               logits: torch.Tensor | None, lookup: int, lookup_max: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Emit each row's accepted drafts and bonus token (each was scored at its parent node) until a
    stopping criterion; returns each row's new tokens and the tree nodes its cache keeps. Without `logits` (a
    step that gave greedy choices alone) or a row's scores (sampled through a top-k cut) the emitters, which then
    keep no scores, get None for them."""
    news, kept = [], []
    for b, (row, draft, chain, (nodes, bonus, scores)) in enumerate(zip(rows, drafts, chains, accepted)):
        new = torch.cat([draft.tokens.index_select(0, nodes[1:]), bonus.view(1)])
        # the scores and logits of a path down a chain (nodes 0..n-1: every one-token step) are views where the
        # emitter keeps neither (a kept view would hold the step's every row), sparing a vocabulary-wide copy per
        # step; elsewhere reading the last node would be a host sync
        keeps = row.emitter.scores is not None or row.emitter.raw_logits is not None
        chain_path = not keeps and nodes.device.type == "cpu" and int(nodes[-1]) == nodes.shape[0] - 1
        rows_at = (lambda t: t[: nodes.shape[0]]) if chain_path else (lambda t: t.index_select(0, nodes))
        n, row.finished = (row.emitter.emit(new, None, None) if logits is None or scores is None else
                           row.emitter.emit(new, rows_at(scores), rows_at(logits[b])))
        row.ngrams.extend(new[:n].tolist())
        kept.append(nodes[:n])  # the cache holds every emitted token but the last
        row.next_pos = row.next_pos + n
        row.root = bonus
        # while the text copies earlier text, let the next chain reach further (as HF's assistant heuristic)
        copied = 0 < chain.shape[0] < n and torch.equal(new[: chain.shape[0]], chain)
        row.chain_len = min(2 * row.chain_len, lookup_max) if copied else lookup
        news.append(new)
    return news, kept


def feed_heads(rows: list[Row], accepted, news: list[torch.Tensor], hidden: torch.Tensor, node_pos: torch.Tensor,
                embed: nn.Module) -> None:
    """Queue each unfinished row's accepted positions (hidden states, the embeddings of the tokens that follow
    them, positions) for the heads, which run over them when they next draft."""
    for b, (row, (nodes, _, _), new) in enumerate(zip(rows, accepted, news)):
        if not row.finished:
            row.pending.append((hidden[b].index_select(0, nodes)[None], embed(new)[None],
                                node_pos[b].index_select(0, nodes)[None]))
