"""The Clover decode loop, run by `transformers`' `generate` as a `custom_generate` callable.

Each step: draft a tree with the heads -> verify it in one base forward -> accept the longest
matching path plus a bonus token (greedy, or by lossless rejection sampling) -> compact the base
cache -> feed the accepted tokens to the heads.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .cache import compact_cache, new_cache
from .heads import CloverHeads
from .lookup import lookup_continuation
from .tree import DynamicTree, StepTree, TreeBuffers, build_tree, select_dynamic, with_chain
from .verification import MaskLayout, accept_greedy, accept_sampled, process_tree_logits, sample_token


@dataclass
class GenerationStats:
    """What one `generate` call did. `steps` counts base forwards, the prefill included."""

    steps: int = 0
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # drafted tokens accepted per verify step
    stage_seconds: dict[str, float] = field(default_factory=dict)  # filled when profiling

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0


class _Clock:
    """Wall time per decode stage. Only when profiling: it syncs the device at every lap."""

    def __init__(self, totals: dict[str, float] | None, device: torch.device) -> None:
        self.totals, self.device = totals, device
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.totals is None:
            return
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)
        now = time.perf_counter()
        self.totals[stage] = self.totals.get(stage, 0.0) + now - self.last
        self.last = now


@dataclass
class _Emitter:
    """Appends tokens one at a time, honouring stopping criteria, the streamer and output scores."""

    input_ids: torch.Tensor
    stopping_criteria: StoppingCriteriaList
    streamer: object | None
    scores: list[torch.Tensor] | None
    raw_logits: list[torch.Tensor] | None

    def emit(self, tokens: torch.Tensor, scores: torch.Tensor, logits: torch.Tensor) -> tuple[int, bool]:
        """Append tokens (n,) whose processed scores/raw logits are (n, V); return (appended, finished)."""
        for i in range(tokens.shape[0]):
            self.input_ids = torch.cat([self.input_ids, tokens[i].view(1, 1)], dim=1)
            if self.scores is not None:
                self.scores.append(scores[i : i + 1])
            if self.raw_logits is not None:
                self.raw_logits.append(logits[i : i + 1])
            if bool(self.stopping_criteria(self.input_ids, scores[i : i + 1]).any()):
                self._stream(tokens[: i + 1])
                return i + 1, True
        self._stream(tokens)
        return tokens.shape[0], False

    def _stream(self, tokens: torch.Tensor) -> None:
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())


def _base_forward(model: PreTrainedModel, ids, mask, positions, cache, logits_to_keep: int = 0):
    kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep and model._supports_logits_to_keep() else {}
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions[None],
        past_key_values=cache,
        use_cache=True,
        output_hidden_states=True,
        return_dict=True,
        **kwargs,
    )
    return out.logits[0].float(), out.hidden_states[-1][0]  # (n, V) fp32, (T, H)


def _tree_spec(tree: list[list[int]] | DynamicTree | dict | None, config) -> list[list[int]] | DynamicTree:
    if tree is None:
        tree = config.dynamic_tree if config.dynamic_tree is not None else config.tree
    return DynamicTree(**tree) if isinstance(tree, dict) else tree


def _draft_tree(heads: CloverHeads, feature, root, spec, trees, chain, embed, lm_weight, lm_bias
                ) -> tuple[torch.Tensor, TreeBuffers | StepTree]:
    """This step's node tokens (root first) and the tree that verifies them."""
    if trees is not None:
        drafted = heads.draft(feature, root, trees[0], embed, lm_weight, lm_bias)
        tree = trees[chain.shape[0]]
        return tree.assemble(root, drafted, chain), tree
    candidates = heads.draft_dynamic(feature, root, spec.depth, spec.width, embed, lm_weight, lm_bias)
    drafted, parents, depths = select_dynamic(*candidates, spec.nodes)
    zero = parents.new_zeros(1)
    tokens, parents, depths = torch.cat([root.view(1), drafted]), torch.cat([zero, parents]), torch.cat([zero, depths])
    if chain.numel():
        tokens, parents, depths = with_chain(tokens, parents, depths, chain)
    return tokens, StepTree.from_parents(parents, depths, max(spec.depth, chain.shape[0]))


def clover_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: object | None = None,
    clover_heads: CloverHeads | None = None,
    clover_tree: list[list[int]] | DynamicTree | dict | None = None,
    clover_lookup: int | None = None,
    clover_lookup_max: int | None = None,
    clover_streamer: object | None = None,
    clover_stats: GenerationStats | None = None,
    clover_profile: bool = False,
    **model_kwargs,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """Clover decoding (greedy or sampling) for one sequence; the signature is transformers'
    `custom_generate` contract. Sampling draws from the global torch RNG (`torch.manual_seed`).

    `clover_tree` (static paths, or a `DynamicTree` / its dict), `clover_lookup` (prompt-lookup
    chain length) and `clover_lookup_max` (the length a chain may grow to while the text keeps
    copying) default to the heads' config.
    `generate` does not hand its `streamer` to custom callables, so it arrives as `clover_streamer`.
    `clover_profile=True` records wall time per stage in `stats.stage_seconds`.
    """
    if clover_heads is None:
        raise ValueError("clover_generate needs clover_heads=CloverHeads(...)")
    if input_ids.shape[0] != 1:
        raise ValueError(f"clover_generate decodes one sequence at a time, got batch size {input_ids.shape[0]}")
    heads, device = clover_heads, input_ids.device
    spec = _tree_spec(clover_tree, heads.config)
    lookup = heads.config.lookup_tokens if clover_lookup is None else clover_lookup
    lookup_max = max(lookup, heads.config.lookup_max_tokens if clover_lookup_max is None else clover_lookup_max)
    # static trees are compiled once per lookup chain length
    trees = None if isinstance(spec, DynamicTree) else [build_tree(spec, device, lookup=m) for m in range(lookup_max + 1)]
    depth = spec.depth if trees is None else len(trees[0].levels)
    if depth > heads.config.num_heads:
        raise ValueError(f"the tree is {depth} deep but the heads draft {heads.config.num_heads} tokens")
    stats = clover_stats if clover_stats is not None else GenerationStats()
    streamer = clover_streamer if clover_streamer is not None else streamer
    want = generation_config.return_dict_in_generate
    emitter = _Emitter(
        input_ids,
        stopping_criteria,
        streamer,
        [] if want and generation_config.output_scores else None,
        [] if want and generation_config.output_logits else None,
    )
    embed = model.get_input_embeddings()
    lm_weight, lm_bias = heads.draft_lm_head(model.get_output_embeddings())
    layout = MaskLayout.for_config(model.config)
    dtype = model.dtype
    prompt_len = input_ids.shape[1]

    # Prefill: the prompt through the base, then its hidden states through the Augmenting Block.
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        positions = torch.arange(prompt_len, device=device)
    else:
        valid = attention_mask[0].bool()
        positions = torch.where(valid, attention_mask[0].long().cumsum(0) - 1, -1)
    causal = torch.ones(prompt_len, prompt_len, dtype=torch.bool, device=device).tril()
    causal = (causal & (positions >= 0)[None, :]) | torch.eye(prompt_len, dtype=torch.bool, device=device)
    empty = positions[:0]
    cache = new_cache()
    mask = layout.build(empty, positions, causal, dtype)
    logits, hidden = _base_forward(model, input_ids, mask, positions.clamp(min=0), cache, logits_to_keep=1)
    stats.steps += 1
    scores = logits_processor(input_ids, logits[-1:])
    sample = bool(generation_config.do_sample)
    root = sample_token(scores[0].softmax(-1), torch.rand((), device=device)) if sample else scores[0].argmax()
    _, finished = emitter.emit(root.view(1), scores, logits[-1:])
    next_pos = positions.max() + 1
    if not finished:
        next_tokens = torch.cat([input_ids[0, 1:], root.view(1)])
        features, aug_cache = heads.features(
            hidden[None], embed(next_tokens)[None], positions.clamp(min=0)[None]
        )
        feature = features[0, -1]

    clock = _Clock(stats.stage_seconds if clover_profile else None, device)
    chain_len = lookup
    while not finished:
        # Draft, then verify the whole tree in one forward over the cache.
        chain = lookup_continuation(emitter.input_ids[0], chain_len) if chain_len else root.new_empty(0)
        tokens, tree = _draft_tree(heads, feature, root, spec, trees, chain, embed, lm_weight, lm_bias)
        clock.lap("draft")
        past_len = positions.shape[0]
        node_pos = next_pos + tree.depths
        mask = layout.build(positions, node_pos, tree.ancestors, dtype)
        logits, hidden = _base_forward(model, tokens[None], mask, node_pos, cache)
        stats.steps += 1
        clock.lap("verify forward")
        scores = process_tree_logits(logits, emitter.input_ids, tokens, tree, logits_processor)
        if sample:
            uniforms = torch.rand(tokens.shape[0], device=device)
            nodes, bonus = accept_sampled(tokens, scores.softmax(-1), tree, uniforms)
        else:
            nodes, bonus = accept_greedy(tokens, scores.argmax(-1), tree)
        stats.accepted_lengths.append(nodes.shape[0] - 1)
        clock.lap("accept")

        # Emit the accepted drafts and the bonus token; each was scored at its parent node.
        new = torch.cat([tokens[nodes[1:]], bonus.view(1)])
        n, finished = emitter.emit(new, scores[nodes], logits[nodes])
        kept = nodes[:n]  # cache holds every emitted token but the last
        compact_cache(cache, past_len, kept)
        positions = torch.cat([positions, node_pos[kept]])
        next_pos = next_pos + n
        root = bonus
        # while the text copies earlier text, let the next chain reach further (as HF's assistant heuristic)
        copied = 0 < chain.shape[0] < n and torch.equal(new[: chain.shape[0]], chain)
        chain_len = min(2 * chain_len, lookup_max) if copied else lookup
        clock.lap("emit + compact")
        if not finished:
            features, aug_cache = heads.features(
                hidden[nodes][None], embed(new)[None], node_pos[nodes][None], cache=aug_cache
            )
            feature = features[0, -1]
            clock.lap("augment")

    if streamer is not None:
        streamer.end()
    sequences = emitter.input_ids
    stats.new_tokens = sequences.shape[1] - prompt_len
    if not want:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(emitter.scores) if emitter.scores is not None else None,
        logits=tuple(emitter.raw_logits) if emitter.raw_logits is not None else None,
        past_key_values=cache,
    )
