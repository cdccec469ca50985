"""The Clover decode loop, run by `transformers`' `generate` as a `custom_generate` callable.

Each step: draft a tree with the heads -> verify it in one base forward -> accept the longest
matching path plus a bonus token (greedy, or by lossless rejection sampling) -> compact the base
cache -> feed the accepted tokens to the heads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig, LogitsProcessorList, MaxLengthCriteria, PreTrainedModel, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .budget import CATCH_UP_STEPS, CostModel, DraftBudget, choose_width, cost_key, likeliest, path_chances
from .cache import compact_cache, new_cache, select_rows, select_slots
from .drafting import Draft, draft_rows, shallower, stack_trees, static_trees, tree_spec
from .hardware import timed
from .heads import AugmentCache, DraftHeads, norm_inputs
from .linears import LinearForms, faster_forms, linear_forms
from .lookup import NgramIndex
from .tree import DynamicTree
from .verification import MaskLayout, accept_greedy, accept_sampled, process_tree_logits, sample_token


@dataclass
class GenerationStats:
    """What one `generate` call did. `steps` counts base forwards, the prefill included."""

    steps: int = 0
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # drafted tokens accepted per verify step and row
    verified_tokens: int = 0  # tokens verified (root included) over all verify steps and rows
    head_drafts: int = 0  # verify steps whose tree the heads drafted (the others verified the lookup chain alone)
    stage_seconds: dict[str, float] = field(default_factory=dict)  # filled when profiling

    @property
    def tokens_per_step(self) -> float:
        """New tokens per base forward; the prefill forward counts as a step (it yields the first token)."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def verified_per_step(self) -> float:
        """Mean tokens verified per row and verify step: 1 is a plain decoding step."""
        return self.verified_tokens / len(self.accepted_lengths) if self.accepted_lengths else 0.0


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


def _base_forward(model: PreTrainedModel, ids, mask, positions, cache, logits_to_keep: int = 0, pre_norm: bool = False):
    """Logits (B, n, V) in fp32 and the last hidden states (B, T, H) of one base forward (with `pre_norm`,
    those before the final norm).

    The hidden states are read off the decoder's output with a hook: asking for `output_hidden_states`
    collects every layer's, which cost 1% of a one-token step on a CPU. A model that is its own
    decoder is asked for them."""
    kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep and model._supports_logits_to_keep() else {}
    if pre_norm:
        with norm_inputs(model) as captured:
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        use_cache=True, return_dict=True, **kwargs)
        return out.logits.float(), captured[-1]
    decoder = model.get_decoder()
    captured = []
    hook = None if decoder is model else decoder.register_forward_hook(lambda m, args, out: captured.append(out))
    try:
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            output_hidden_states=hook is None,
            return_dict=True,
            **kwargs,
        )
    finally:
        if hook is not None:
            hook.remove()
    if hook is None:
        return out.logits.float(), out.hidden_states[-1]
    if not captured:
        raise RuntimeError(f"{type(model).__name__}.get_decoder() returned a module its forward did not run; Clover "
                           "reads the last hidden states from it")
    last = captured[-1]
    return out.logits.float(), last[0] if isinstance(last, tuple) else last.last_hidden_state


@dataclass
class _Row:
    """One sequence's decode state. The rows of a batch share the base's cache and its forwards."""

    emitter: _Emitter
    start: int  # first column of its text after the left padding
    root: torch.Tensor  # () the token after the cached text: chosen, not yet in the cache
    next_pos: torch.Tensor  # () the root's position
    chain_len: int  # prompt-lookup chain length of the next step
    finished: bool
    ngrams: NgramIndex | None = None  # its text's n-grams, for the lookup chain
    feature: torch.Tensor | None = None  # (H,) the heads' features at the last position they have seen
    aug_cache: AugmentCache | None = None
    # (hidden, next-token embeddings, positions), each (1, T, ...), of the last steps' positions the heads have not
    # seen yet: after a long pause the Augmenting Block catches up on the last CATCH_UP_STEPS steps only
    pending: deque[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(
        default_factory=lambda: deque(maxlen=CATCH_UP_STEPS))


def _choose_nodes(drafts: list[Draft], acceptance, costs: CostModel, gate, draft_ms: tuple[float, float] | None,
                  explore: bool) -> tuple[list[Draft], list[list[int]]]:
    """Cut each row's draft to the nodes that pay: the width with the most expected tokens per
    millisecond under `costs` (`explore`: retrying widths untimed for long), each row keeping its
    likeliest nodes. Returns the cut drafts and each node's acceptance bucket. When the heads
    drafted (`draft_ms`: their drafting time, and the Augmenting Block's per position), tells
    `gate` how that compared with the chain alone."""
    buckets, chances = [], []
    for d in drafts:
        depths, parents, probs, is_chain = d.on_host()
        b = acceptance.buckets(depths, probs, is_chain, d.ngram)
        buckets.append(b)
        chances.append(path_chances(acceptance.rates(b), parents)[1:])
    width, tokens, ms = choose_width(chances, costs, explore)
    cut, cut_buckets = [], []
    for d, b, c in zip(drafts, buckets, chances):
        if width >= len(b):
            cut.append(d)
            cut_buckets.append(b)
        elif width == 1:
            cut.append(d.root_only())
            cut_buckets.append(b[:1])
        else:
            nodes = likeliest(c, width)
            cut.append(d.keep(nodes))
            cut_buckets.append([b[i] for i in nodes])
    if draft_ms is not None:
        chain_only = [[x if chain else 0.0 for x, chain in zip(c, d.host[3][1:])] for c, d in zip(chances, drafts)]
        _, chain_tokens, chain_ms = choose_width(chain_only, costs)
        gate.record(*draft_ms, tokens, ms, chain_tokens / chain_ms)
        gate.used(max(depth for d in cut for depth, chain in zip(d.host[0], d.host[3]) if not chain))
    return cut, cut_buckets


def _measure_verify(model: PreTrainedModel, cache, positions: torch.Tensor, layout: MaskLayout,
                    token: torch.Tensor, forms: LinearForms):
    """`measure(width) -> ms`: the time of one forward of `width` tokens per row over the cache as it
    is (linear layers in `forms`), which is then cut back. Calibrates the draft budget's cost model."""
    rows, past_len = positions.shape
    device = positions.device
    last = positions.max(dim=1, keepdim=True).values  # a position every model embeds: one it already has

    def measure(width: int) -> float:
        new_pos = last.expand(rows, width)
        causal = torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(rows, -1, -1)
        mask = layout.build(positions, new_pos, causal, model.dtype)
        with linear_forms([model], forms):
            _, seconds = timed(lambda: _base_forward(model, token.expand(rows, width), mask, new_pos, cache), device)
        compact_cache(cache, past_len, new_pos[:, :0])
        return 1000 * seconds

    return measure


@contextlib.contextmanager
def tree_attention_backends(device: torch.device) -> Iterator[None]:
    """On CUDA, turn cuDNN attention off for the duration, where memory-efficient or math attention can serve.

    PyTorch 2.10+ with a bundled cuDNN newer than 9.15 prefers cuDNN attention on Hopper and Blackwell
    GPUs. cuDNN builds a plan for each new input shape, and tree forwards change shape every step.
    Memory-efficient and math attention take the tree's explicit mask with no per-shape plan (flash
    attention takes no explicit mask). Elsewhere, or when neither is enabled, nothing changes. The
    flags are process-wide: other threads' forwards lose cuDNN attention during the call as well.
    """
    cuda = torch.backends.cuda
    if device.type != "cuda" or not cuda.cudnn_sdp_enabled() or not (cuda.mem_efficient_sdp_enabled() or cuda.math_sdp_enabled()):
        yield
        return
    cuda.enable_cudnn_sdp(False)
    try:
        yield
    finally:
        cuda.enable_cudnn_sdp(True)


def _out_of_inference_mode(out: torch.Tensor | GenerateDecoderOnlyOutput) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """What `generate` returns, as normal tensors the caller may change in place. The cache stays as it is
    (cloning it would double its memory): `DynamicCache` only ever concatenates onto its tensors."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    out.sequences = out.sequences.clone()
    for name in ("scores", "logits"):
        if getattr(out, name) is not None:
            setattr(out, name, tuple(t.clone() for t in getattr(out, name)))
    return out


def _decode_context(generate):
    """Run `generate(model, ...)` under `tree_attention_backends(model.device)` and `torch.inference_mode()`.

    Plain `generate` runs under `no_grad`; inference mode also skips autograd's version counting and
    view tracking on every op, which saved 1.5-2 ms of a 37-62 ms one-token SmolLM2-135M forward on
    a 2-core CPU: as much as Clover's own work in a step that verifies one token."""

    @functools.wraps(generate)  # keeps the signature, which transformers reads for custom arguments
    def run(*args, **kwargs):
        model = kwargs["model"] if "model" in kwargs else args[0]
        with tree_attention_backends(model.device), torch.inference_mode():
            out = generate(*args, **kwargs)
        return _out_of_inference_mode(out)

    return run


@_decode_context
def clover_generate(
    model: PreTrainedModel,
    input_ids: torch.LongTensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: object | None = None,
    clover_heads: DraftHeads | None = None,
    clover_tree: list[list[int]] | DynamicTree | dict | None = None,
    clover_lookup: int | None = None,
    clover_lookup_max: int | None = None,
    clover_streamer: object | None = None,
    clover_stats: GenerationStats | None = None,
    clover_profile: bool = False,
    clover_int8_draft: bool | None = None,
    clover_budget: DraftBudget | None = None,
    clover_calibrate: bool | None = None,
    **model_kwargs,
) -> torch.LongTensor | GenerateDecoderOnlyOutput:
    """Clover decoding (greedy or sampling); the signature is transformers' `custom_generate` contract.
    Sampling draws from the global torch RNG (`torch.manual_seed`).

    A batch (left-padded, with its `attention_mask`) is verified in one forward per step; each row
    accepts its own path, so rows advance at their own pace over a shared cache whose unused slots
    are masked, and a finished row leaves the batch. Finished rows are padded with `pad_token_id`.

    `clover_tree` (static paths, or a `DynamicTree` / its dict), `clover_lookup` (prompt-lookup
    chain length) and `clover_lookup_max` (the length a chain may grow to while the text keeps
    copying) default to the heads' config; off the CPU, at batch size 1, the tree defaults to the
    config's `accelerator_dynamic_tree` where it has one.
    `clover_budget` (a `DraftBudget`) verifies, each step, only the nodes that pay on this machine,
    and drafts with the heads only while that pays; None verifies the whole tree every step.
    `clover_calibrate` (None: when this machine's costs are not known yet; True: again; False: never)
    times a few verify forwards first.
    `generate` does not hand its `streamer` to custom callables, so it arrives as `clover_streamer`.
    `clover_profile=True` records wall time per stage in `stats.stage_seconds`.
    `clover_int8_draft` drafts from int8 lm_head rows (`DraftHeads.draft_lm_head`); default: on the CPU in bf16.
    """
    if clover_heads is None:
        raise ValueError("clover_generate needs clover_heads=CloverHeads(...) (or other DraftHeads)")
    heads, device, caller_device = clover_heads, model.device, input_ids.device
    input_ids = input_ids.to(device)  # transformers lets inputs stay on another device; Clover works on the model's
    batch, prompt_len = input_ids.shape
    want = generation_config.return_dict_in_generate
    want_scores = want and (generation_config.output_scores or generation_config.output_logits)
    streamer = clover_streamer if clover_streamer is not None else streamer
    if batch > 1 and (want_scores or streamer is not None):
        raise ValueError("Clover returns scores and streams for batch size 1 only; pass one sequence at a time")
    spec = tree_spec(clover_tree, heads.config, device, batch)
    if isinstance(spec, DynamicTree) and not heads.dynamic_trees:
        raise ValueError(f"{heads.config.head_type} heads draft static trees only: pass tree=[[0], [1], [0, 0], ...] "
                         "(paths in Medusa's format) instead of a dynamic tree")
    _check_arguments(clover_lookup, clover_lookup_max, batch, generation_config, stopping_criteria)
    lookup = heads.config.lookup_tokens if clover_lookup is None else clover_lookup
    lookup_max = max(lookup, heads.config.lookup_max_tokens if clover_lookup_max is None else clover_lookup_max)
    # static trees are compiled once per lookup chain length (and per drafting depth, when the budget cuts it)
    trees = None if isinstance(spec, DynamicTree) else static_trees(spec, device, lookup_max, depth=None)
    depth = spec.depth if trees is None else len(trees[0].levels)
    if depth > heads.config.num_heads:
        raise ValueError(f"the tree is {depth} deep but the heads draft {heads.config.num_heads} tokens")
    stats = clover_stats if clover_stats is not None else GenerationStats()
    embed = heads.token_embedding(model)
    pre_norm = heads.config.head_input == "pre_norm"
    int8 = clover_int8_draft
    if int8 is None:  # by default only where it was measured to pay: the CPU in bf16
        int8 = device.type == "cpu" and model.dtype == torch.bfloat16
    lm_head = heads.draft_lm_head(model.get_output_embeddings(), int8=int8)
    layout = MaskLayout.for_config(model.config)
    dtype = model.dtype
    sample = bool(generation_config.do_sample)

    # How linear layers compute each row count on this machine (linears.py); the prefill uses them too.
    key = None if clover_budget is None else cost_key(model, device)
    forms = {} if key is None else clover_budget.forms(key, clover_calibrate, lambda: faster_forms([model, heads]))

    # Prefill: the prompts through the base; each row's hidden states wait for the heads' first draft.
    attention_mask = model_kwargs.get("attention_mask")
    attention_mask = None if attention_mask is None else attention_mask.to(device)
    logits, hidden, positions, cache, plain_mask = _prefill(model, input_ids, attention_mask, layout, forms, pre_norm)
    stats.steps += 1
    keep = (want and generation_config.output_scores, want and generation_config.output_logits)
    rows = _start_rows(input_ids, attention_mask, positions, logits, hidden, logits_processor, sample,
                       stopping_criteria, streamer, keep, lookup, embed)
    active, positions = _drop_finished(rows, cache, positions)

    # The draft budget: this machine's verify costs (measured now if unknown) and calibrated acceptance.
    costs = acceptance = None
    if clover_budget is not None and active:
        widest = (trees[-1].num_nodes if trees is not None else spec.nodes + lookup_max + 1)
        measure = _measure_verify(model, cache, positions, layout, active[0].root, forms)
        costs = clover_budget.costs(key, len(active), widest, measure, clover_calibrate)
        acceptance = clover_budget.acceptance(sample, depth, lookup_max)
        acceptance.start_text()
    budgeted = costs is not None

    clock = _Clock(stats.stage_seconds if clover_profile else None, device)
    forms = forms if budgeted else {}  # without costs the whole tree is verified, in F.linear
    lm_head = dataclasses.replace(lm_head, forms=forms)
    with linear_forms([model, heads], forms):
        while active:
            # Draft a tree per row (with the heads, or the lookup chain alone), cut it to what pays,
            # then verify all rows in one forward over the cache.
            started = time.perf_counter()
            with_heads = not budgeted or clover_budget.gate.drafting()
            step_spec, step_trees = spec, trees
            if with_heads and budgeted:
                step_spec, step_trees = shallower(spec, trees, clover_budget.gate.draft_depth(depth), lookup_max)
            drafts, chains, augment_s, augmented = draft_rows(
                active, heads if with_heads else None, step_spec, step_trees, lookup_max if budgeted else None,
                generation_config.max_length, embed, lm_head)
            stats.head_drafts += with_heads
            clock.lap("draft")
            if budgeted:
                draft_ms = None  # (drafting, Augmenting Block per position) in ms, when the heads drafted
                if with_heads and costs.draft_ms is not None:
                    draft_ms = (costs.draft_ms, 0.0)
                elif with_heads:
                    for draft in drafts:  # read now, not in the choice: off the CPU drafting runs until read
                        draft.on_host()
                    drafting_s = time.perf_counter() - started - augment_s
                    draft_ms = (1000 * drafting_s, 1000 * augment_s / max(augmented, 1))
                drafts, buckets = _choose_nodes(drafts, acceptance, costs, clover_budget.gate, draft_ms,
                                                explore=clover_budget.fixed is None)
                clock.lap("choose")
            verify_started = time.perf_counter()
            past_len = positions.shape[1]
            ids, node_pos, allowed = stack_trees(drafts, active)
            if plain_mask and ids.shape[1] == 1:
                mask = torch.ones(1, past_len + 1, dtype=torch.long, device=device)
            else:
                mask = layout.build(positions, node_pos, allowed, dtype)
            logits, hidden = _base_forward(model, ids, mask, node_pos, cache, pre_norm=pre_norm)
            stats.steps += 1
            clock.lap("verify forward")
            accepted = _accept_rows(active, drafts, logits, logits_processor, sample, stats,
                                    (acceptance, buckets) if budgeted else None)
            clock.lap("accept")
            news, kept = _emit_rows(active, drafts, chains, accepted, logits, lookup, lookup_max)
            positions = torch.cat([positions, _compact(cache, past_len, kept, node_pos)], dim=1)
            if len(active) > 1:
                positions = _repack(cache, positions)
            clock.lap("emit + compact")
            if budgeted and clover_budget.fixed is None:
                costs.observe(len(active), ids.shape[1], 1000 * (time.perf_counter() - verify_started))
            for b, (row, (nodes, _, _), new) in enumerate(zip(active, accepted, news)):
                if not row.finished:
                    row.pending.append((hidden[b, nodes][None], embed(new)[None], node_pos[b, nodes][None]))
            active, positions = _drop_finished(active, cache, positions)

    if budgeted:
        clover_budget.save(key)
    if streamer is not None:
        streamer.end()
    sequences = _pad_rows([row.emitter.input_ids[0] for row in rows], generation_config).to(caller_device)
    stats.new_tokens = sum(row.emitter.input_ids.shape[1] - prompt_len for row in rows)
    if not want:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(rows[0].emitter.scores) if rows[0].emitter.scores is not None else None,
        logits=tuple(rows[0].emitter.raw_logits) if rows[0].emitter.raw_logits is not None else None,
        past_key_values=cache if batch == 1 else None,  # a batch's cache has masked slots
    )


def _prefill(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, layout: MaskLayout,
             forms: LinearForms, pre_norm: bool):
    """The prompts (B, P), left-padded where `attention_mask` says so, through the base into a new cache.
    Returns the last position's logits, the hidden states, positions (B, P) (-1: a masked slot), the
    cache, and whether decoding may keep the base's own mask path (one unpadded row without a window)."""
    batch, prompt_len = input_ids.shape
    device = input_ids.device
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    positions = torch.where(valid, valid.long().cumsum(1) - 1, -1)
    # One unpadded row without a window goes through the base's own mask path, as in plain decoding: its
    # prefill builds no (P, P) mask (a long prompt's would take gigabytes), and in bf16 an explicit additive
    # mask rounds differently from the base's own at some lengths.
    plain_mask = batch == 1 and not layout.mapping and layout.sliding_window is None and bool(valid.all())
    cache = new_cache()
    if plain_mask:
        mask = torch.ones(1, prompt_len, dtype=torch.long, device=device)
    else:
        eye = torch.eye(prompt_len, dtype=torch.bool, device=device)
        causal = (eye.new_ones(prompt_len, prompt_len).tril() & valid[:, None, :]) | eye
        mask = layout.build(positions[:, :0], positions, causal, model.dtype)
    with linear_forms([model], forms):
        logits, hidden = _base_forward(model, input_ids, mask, positions.clamp(min=0), cache, logits_to_keep=1,
                                       pre_norm=pre_norm)
    return logits, hidden, positions, cache, plain_mask


def _start_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, positions: torch.Tensor,
                logits: torch.Tensor, hidden: torch.Tensor, logits_processor, sample: bool, stopping_criteria,
                streamer, keep: tuple[bool, bool], lookup: int, embed) -> list[_Row]:
    """Each row's first token, chosen from the prefill's last logits and emitted, and its decode state;
    `keep`: whether to keep (scores, logits) for the output."""
    scores = logits_processor(input_ids, logits[:, -1])
    rows = []
    for b in range(input_ids.shape[0]):
        root = sample_token(scores[b].softmax(-1), torch.rand((), device=input_ids.device)) if sample else scores[b].argmax()
        emitter = _Emitter(input_ids[b : b + 1], stopping_criteria, streamer,
                           [] if keep[0] else None, [] if keep[1] else None)
        _, finished = emitter.emit(root.view(1), scores[b : b + 1], logits[b, -1:])
        valid = positions[b] >= 0
        start = 0 if attention_mask is None else int(valid.long().argmax())
        row = _Row(emitter, start, root, positions[b].max() + 1, lookup, finished)
        if not finished:
            row.ngrams = NgramIndex(emitter.input_ids[0, start:].tolist())
            cols = slice(None) if attention_mask is None else valid
            text = torch.cat([input_ids[b, cols][1:], root.view(1)])
            row.pending.append((hidden[b, cols][None], embed(text)[None], positions[b, cols][None]))
        rows.append(row)
    return rows


def _accept_rows(rows: list[_Row], drafts: list[Draft], logits: torch.Tensor, logits_processor, sample: bool,
                 stats: GenerationStats, budget_view: tuple | None) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Each row's accepted nodes (root first), bonus token, and its tree's scores after the logits processors
    (greedy, or lossless rejection sampling). `budget_view` (acceptance, buckets) learns what was accepted."""
    accepted = []
    for b, (row, draft) in enumerate(zip(rows, drafts)):
        tokens, tree = draft.tokens, draft.tree
        n = tokens.shape[0]
        scores = process_tree_logits(logits[b, :n], row.emitter.input_ids, tokens, tree, logits_processor)
        if sample:
            uniforms = torch.rand(n, device=tokens.device)
            nodes, bonus = accept_sampled(tokens, scores.softmax(-1), tree, uniforms)
        else:
            nodes, bonus = accept_greedy(tokens, scores.argmax(-1), tree)
        stats.accepted_lengths.append(nodes.shape[0] - 1)
        stats.verified_tokens += n
        if budget_view is not None:
            acceptance, buckets = budget_view
            acceptance.observe(buckets[b], draft.host[1], nodes.tolist())
        accepted.append((nodes, bonus, scores))
    return accepted


def _emit_rows(rows: list[_Row], drafts: list[Draft], chains: list[torch.Tensor], accepted, logits: torch.Tensor,
               lookup: int, lookup_max: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Emit each row's accepted drafts and bonus token (each was scored at its parent node) until a
    stopping criterion; returns each row's new tokens and the tree nodes its cache keeps."""
    news, kept = [], []
    for b, (row, draft, chain, (nodes, bonus, scores)) in enumerate(zip(rows, drafts, chains, accepted)):
        new = torch.cat([draft.tokens[nodes[1:]], bonus.view(1)])
        n, row.finished = row.emitter.emit(new, scores[nodes], logits[b, nodes])
        row.ngrams.extend(new[:n].tolist())
        kept.append(nodes[:n])  # the cache holds every emitted token but the last
        row.next_pos = row.next_pos + n
        row.root = bonus
        # while the text copies earlier text, let the next chain reach further (as HF's assistant heuristic)
        copied = 0 < chain.shape[0] < n and torch.equal(new[: chain.shape[0]], chain)
        row.chain_len = min(2 * row.chain_len, lookup_max) if copied else lookup
        news.append(new)
    return news, kept


def _drop_finished(rows: list[_Row], cache, positions: torch.Tensor) -> tuple[list[_Row], torch.Tensor]:
    """The unfinished rows. Finished ones leave the cache, and so do the slots no remaining row uses."""
    alive = [b for b, row in enumerate(rows) if not row.finished]
    if not alive or len(alive) == len(rows):  # nothing to drop, or done (the cache is returned as is)
        return [rows[b] for b in alive], positions
    keep = torch.tensor(alive, device=positions.device)
    positions = positions[keep]
    used = (positions >= 0).any(dim=0)
    select_rows(cache, keep, used)
    return [rows[b] for b in alive], positions[:, used]


REPACK_UNUSED_SHARE = 0.5  # a batch's cache is repacked once more than this share of its slots is masked


def _repack(cache, positions: torch.Tensor) -> torch.Tensor:
    """Move each row's used slots to the end of the cache once masked slots dominate it.

    Rows of a batch keep different numbers of tree nodes per step, so each step leaves masked slots
    in the rows that kept fewer; without repacking they would cost memory and attention for good.
    """
    used = positions >= 0
    if (~used).sum() <= REPACK_UNUSED_SHARE * used.numel():  # one host sync per batched step
        return positions
    width = int(used.sum(dim=1).max())
    index = used.int().argsort(dim=1, stable=True)[:, -width:]  # masked slots first, then used ones in order
    select_slots(cache, index)
    return positions.gather(1, index)


def _compact(cache, past_len: int, kept: list[torch.Tensor], node_pos: torch.Tensor) -> torch.Tensor:
    """Keep each row's accepted nodes in the cache; returns the (B, K) positions of the kept slots (-1: unused)."""
    if len(kept) == 1:
        if kept[0].shape[0] < node_pos.shape[1]:  # else every verified node was kept, in place
            compact_cache(cache, past_len, kept[0][None])
        return node_pos[:, kept[0]]
    width = max(k.shape[0] for k in kept)
    index = torch.zeros(len(kept), width, dtype=torch.long, device=node_pos.device)
    slot_pos = torch.full_like(index, -1)
    for b, k in enumerate(kept):
        index[b, : k.shape[0]] = k
        slot_pos[b, : k.shape[0]] = node_pos[b, k]
    compact_cache(cache, past_len, index)
    return slot_pos


def _check_arguments(lookup: int | None, lookup_max: int | None, batch: int, generation_config: GenerationConfig,
                     stopping_criteria: StoppingCriteriaList) -> None:
    """Refuse what would fail or mislead only after decoding started."""
    for name, value in (("lookup", lookup), ("lookup_max", lookup_max)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be an int >= 0 (0: no lookup chain), got {value!r}")
    may_stop_early = generation_config.eos_token_id is not None or any(
        not isinstance(c, MaxLengthCriteria) for c in stopping_criteria)
    if batch > 1 and may_stop_early and _pad_id(generation_config) is None:
        raise ValueError("a batch whose rows may stop at different lengths needs pad_token_id to pad the shorter "
                         "ones: pass pad_token_id=tokenizer.pad_token_id (or eos_token_id) to generate")


def _pad_id(generation_config: GenerationConfig) -> torch.Tensor | int | None:
    pad = getattr(generation_config, "_pad_token_tensor", None)
    return generation_config.pad_token_id if pad is None else pad


def _pad_rows(rows: list[torch.Tensor], generation_config: GenerationConfig) -> torch.Tensor:
    """(B, L) sequences; rows that stopped early end in `pad_token_id`, as in transformers' own decoding."""
    length = max(r.shape[0] for r in rows)
    if all(r.shape[0] == length for r in rows):
        return torch.stack(rows)
    pad = torch.as_tensor(_pad_id(generation_config), device=rows[0].device)  # checked before decoding
    out = pad.to(rows[0].dtype).expand(len(rows), length).clone()
    for b, r in enumerate(rows):
        out[b, : r.shape[0]] = r
    return out
