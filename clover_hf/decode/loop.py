"""The Clover decode loop, run by `transformers`' `generate` as a `custom_generate` callable.

The prefill, then each step: draft a tree per row with the heads and the lookup chain, cut by the budget to the
nodes that pay on this machine (drafting.py, choosing.py) -> verify them in one base forward (the backend's) ->
accept the longest matching path plus a bonus token, greedy or by lossless rejection sampling (verification.py) ->
emit the tokens and compact the base cache (rows.py) -> queue the accepted positions for the heads (steps.py).
The loop does not know which backend computes the base's forwards (clover_hf.backends).
"""

from __future__ import annotations

import time
import warnings

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from clover_hf.base.forward import MaskLayout
from clover_hf.heads.base import DraftHeads
from clover_hf.heads.tree import DynamicTree

from .budget import DraftBudget
from .call import DecodeCall, decode_context
from .drafting import stack_trees
from .record import FeatureRecord
from .rows import Batch, Row, start_rows
from .stats import Clock, GenerationStats
from .steps import accept_rows, draft, emit_rows, feed_heads, fit

# `int8_draft=`: accepted for one release, with this warning, and otherwise ignored
INT8_DRAFT_IGNORED = ("int8_draft has no effect any more and is ignored: drafting reads the lm_head's rows in the "
                      "base's dtype, faster on the CPUs measured; see docs/budget.md")


@decode_context
def clover_generate(
    model: PreTrainedModel, input_ids: torch.LongTensor, logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig, synced_gpus: bool = False,
    streamer: object | None = None, clover_heads: DraftHeads | None = None,
    clover_tree: list[list[int]] | DynamicTree | dict | None = None, clover_lookup: int | None = None,
    clover_lookup_max: int | None = None, clover_streamer: object | None = None,
    clover_stats: GenerationStats | None = None, clover_profile: bool = False, clover_int8_draft: bool | None = None,
    clover_budget: DraftBudget | None = None, clover_calibrate: bool | None = None,
    clover_record: FeatureRecord | None = None, **model_kwargs,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """Clover decoding, greedy or sampled (from the global torch RNG): transformers' `custom_generate` contract, with
    the `clover_*` arguments `CloverForCausalLM.generate` documents (`clover_int8_draft` is ignored, with a
    FutureWarning); `clover_record` keeps the base's features at every position (`record.FeatureRecord`)."""
    if clover_int8_draft is not None:
        warnings.warn(INT8_DRAFT_IGNORED, FutureWarning, stacklevel=2)
    call = DecodeCall.of(model, input_ids, logits_processor, stopping_criteria, generation_config,
                         clover_streamer if clover_streamer is not None else streamer, clover_heads, clover_tree,
                         clover_lookup, clover_lookup_max, clover_stats, clover_budget, clover_calibrate,
                         clover_record, model_kwargs)
    plan, backend, stats = call.plan, call.backend, call.stats
    with backend.bound():
        rows, batch = prefill(call)
        budget = call.step_budget(batch)
        clock = Clock(stats.stage_seconds if clover_profile else None, model.device)  # the steps' stages, from here
        dtype = model.dtype  # (transformers' property looks through the parameters)
        while batch.active:
            stats.learning_steps += backend.learning()
            backend.before_step(budget)
            drafts, chains = draft(batch.active, plan, budget, stats, clock)
            room = batch.room()
            drafts = fit(drafts, room)
            started = time.perf_counter()
            width = backend.width(max(d.tokens.shape[0] for d in drafts), room)
            ids, node_pos, allowed = stack_trees(drafts, batch.active, width)
            verified = backend.verify(ids, batch.attention(node_pos, allowed, dtype), node_pos, batch.cache)
            stats.steps += 1
            clock.lap("verify forward")
            accepted = accept_rows(batch.active, drafts, verified, backend, call.logits_processor, call.sample,
                                   call.cut, stats, budget)
            clock.lap("accept")
            news, kept = emit_rows(batch.active, drafts, chains, accepted, verified.logits, plan.lookup,
                                   plan.lookup_max)
            if call.record is not None:
                call.record.kept(batch.active, kept, verified.hidden, verified.logits)
            batch.keep(kept, node_pos)
            clock.lap("emit + compact")
            backend.after_step(budget, len(batch.active), ids.shape[1], started, sum(k.shape[0] for k in kept))
            feed_heads(batch.active, accepted, news, verified.hidden, node_pos, plan.embed)
            batch.drop_finished()
    return call.finish(rows, batch, budget)


def prefill(call: DecodeCall) -> tuple[list[Row], Batch]:
    """The prompts through the base, and each row's first token; each row's hidden states wait for the heads' first
    draft."""
    layout = MaskLayout.for_config(call.model.config)
    logits, hidden, positions, cache, plain_mask = call.backend.prefill(call.input_ids, call.attention_mask, layout,
                                                                        call.pre_norm, call.cache)
    call.stats.steps += 1
    rows = start_rows(call.input_ids, call.attention_mask, positions, logits, hidden, call.logits_processor,
                      call.sample, call.stopping_criteria, call.streamer, call.keep, call.plan.lookup, call.plan.embed)
    if call.record is not None:
        call.record.prefilled(rows, hidden, positions, logits)
    return rows, Batch(rows, cache, positions, layout, plain_mask)
