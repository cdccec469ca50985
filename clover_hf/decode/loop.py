"""The Clover decode loop, run by `transformers`' `generate` as a `custom_generate` callable.

The prefill (rows.py), then each step: draft a tree per row with the heads and the lookup chain
(drafting.py) -> choose the nodes that pay on this machine (choosing.py) -> verify them in one base
forward -> accept the longest matching path plus a bonus token, greedy or by lossless rejection
sampling (verification.py) -> emit the tokens and compact the base cache (rows.py) -> queue the
accepted positions for the heads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
import weakref
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, MaxLengthCriteria, PreTrainedModel, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from clover_hf import cpu
from clover_hf.base.cache import OUTPUT_CACHE_FIELD, given_cache, is_static, static_cache, to_normal_tensors
from clover_hf.base.forward import MaskLayout
from clover_hf.base.lean_layers import lean_layers
from clover_hf.base.verify_forward import VerifyForward, compile_settings
from clover_hf.cpu import FormTrials, LinearForms, faster_forms, linear_forms
from clover_hf.heads.modules import DraftHeads, DraftLMHead
from clover_hf.heads.tree import DynamicTree, TreeBuffers

from .budget import DraftBudget, cost_key
from .choosing import StepBudget
from .drafting import Draft, draft_rows, stack_trees, static_trees, tree_spec
from .rows import Batch, Row, criteria_read_scores, pad_id, prefill, sequences, start_rows
from .verification import TopKCut, accept_greedy, accept_sampled, process_tree_logits, sample_columns


@dataclass
class GenerationStats:
    """What one `generate` call did. `steps` counts base forwards, the prefill included."""

    steps: int = 0
    new_tokens: int = 0
    accepted_lengths: list[int] = field(default_factory=list)  # drafted tokens accepted per verify step and row
    verified_tokens: int = 0  # tokens verified (root included) over all verify steps and rows
    head_drafts: int = 0  # verify steps whose tree the heads drafted (the others verified the lookup chain alone)
    # verify steps taken while the call still learnt how this machine multiplies (the linear forms, and the weight
    # copies they compute from: first calls on a machine, then kept in the user cache): until the call is far enough
    # ahead of plain decoding to afford that, such steps verify one token
    learning_steps: int = 0
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


def _out_of_inference_mode(out: torch.Tensor | GenerateDecoderOnlyOutput, callers_cache
                           ) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """What `generate` returns, as normal tensors the caller may change in place. A dynamic cache stays as it
    is (cloning it would double its memory): it only ever concatenates onto its tensors; a static cache, the
    caller's own or the one returned, is updated in place, so its tensors are copied out."""
    to_normal_tensors(callers_cache)
    if isinstance(out, torch.Tensor):
        return out.clone()
    to_normal_tensors(getattr(out, OUTPUT_CACHE_FIELD, None))
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
        return _out_of_inference_mode(out, given_cache(kwargs))

    return run


def _decode_cache(model: PreTrainedModel, model_kwargs: dict, generation_config: GenerationConfig, widest: int):
    """The cache to decode into: the caller's own static cache, a static one of room enough for the text and
    the widest forward where `generate` prepared one (cache_implementation="static"), else None (a dynamic
    cache, made by the prefill)."""
    given = given_cache(model_kwargs)
    if getattr(given, "_is_user_defined", False):  # the caller's (transformers marks it)
        return given
    if not is_static(given):
        return None
    # as transformers sizes its static caches: never smaller than an earlier call's (its shapes stay compiled),
    # nor than `max_cache_len`, which fixes the size for calls up to that length
    slots = max(generation_config.max_length + widest, generation_config.max_cache_len or 0,
                _STATIC_SLOTS.get(model, 0))
    _STATIC_SLOTS[model] = slots
    return static_cache(model, slots)


_STATIC_SLOTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its last static cache's slots


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
    `clover_calibrate`: None learns the verify costs not known yet from the first steps; True times
    them all again first; False never measures.
    `generate` does not hand its `streamer` to custom callables, so it arrives as `clover_streamer`.
    `clover_profile=True` records wall time per stage in `stats.stage_seconds`.
    `clover_int8_draft` drafts from int8 lm_head rows (`DraftHeads.draft_lm_head`); default: on the CPU in bf16.
    """
    if clover_heads is None:
        raise ValueError("clover_generate needs clover_heads=CloverHeads(...) (or other DraftHeads)")
    device, caller_device = model.device, input_ids.device
    input_ids = input_ids.to(device)  # transformers lets inputs stay on another device; Clover works on the model's
    want = generation_config.return_dict_in_generate
    keep = (want and generation_config.output_scores, want and generation_config.output_logits)
    streamer = clover_streamer if clover_streamer is not None else streamer
    if input_ids.shape[0] > 1 and (any(keep) or streamer is not None):
        raise ValueError("Clover returns scores and streams for batch size 1 only; pass one sequence at a time")
    prepared = given_cache(model_kwargs)  # generate's or the caller's
    sample, pre_norm = bool(generation_config.do_sample), clover_heads.config.head_input == "pre_norm"
    # nothing reads a step's scores but acceptance: none kept, no criteria reading them
    unread = not any(keep) and not criteria_read_scores(stopping_criteria)
    # greedy decoding that reads no logits but each node's argmax
    greedy = not sample and not logits_processor and unread
    # sampling through a top-k cut, on the CPU: each node's distribution over the tokens the cut keeps
    cut = TopKCut.of(logits_processor, getattr(model.get_output_embeddings(), "out_features", None)) if (
        sample and unread and device.type == "cpu") else None
    verify = VerifyForward(model, pre_norm, compile_settings(model, generation_config, prepared), greedy,
                           cut.k if cut is not None and cut.screens else None)
    plan = _plan(model, clover_heads, input_ids.shape[0], generation_config, stopping_criteria, clover_tree,
                 clover_lookup, clover_lookup_max, clover_int8_draft, clover_budget, clover_calibrate,
                 cache_kind=f"static {verify.key}" if is_static(prepared) else None,
                 compiled=verify.compiled is not None)
    stats = clover_stats if clover_stats is not None else GenerationStats()
    attention_mask = model_kwargs.get("attention_mask")
    attention_mask = None if attention_mask is None else attention_mask.to(device)
    layout = MaskLayout.for_config(model.config)

    widest = verify.width(plan.widest, None)
    cache = _decode_cache(model, model_kwargs, generation_config, widest)

    copies = None if clover_budget is None else clover_budget.use_copies(plan.forms, plan.trials)
    # the decoder layers without their modules' per-call machinery (eager forwards; attention packed where the
    # call's products already round differently from plain decoding's), and how this machine multiplies
    kernels = bool(plan.forms) or plan.trials is not None  # the call multiplies in forms stored or being learnt
    lean = lean_layers(model, pack=kernels) if verify.compiled is None else contextlib.nullcontext()
    bind_forms = functools.partial(linear_forms, [model, clover_heads], plan.forms, copies, plan.trials)
    with lean, contextlib.ExitStack() as forms_block:
        forms_block.enter_context(bind_forms())
        # Prefill: the prompts through the base; each row's hidden states wait for the heads' first draft.
        prefill_start = time.perf_counter()
        logits, hidden, positions, cache, plain_mask = prefill(model, input_ids, attention_mask, layout, pre_norm,
                                                               cache)
        if plan.trials is not None:
            plan.trials.prefilled(time.perf_counter() - prefill_start)
        stats.steps += 1
        rows = start_rows(input_ids, attention_mask, positions, logits, hidden, logits_processor, sample,
                          stopping_criteria, streamer, keep, plan.lookup, plan.embed)
        batch = Batch(rows, cache, positions, layout, plain_mask)
        forms_settled = plan.trials is None or plan.trials.ready()  # the forms settled and their copies made
        budget = StepBudget.start(clover_budget, plan.key, clover_calibrate, model, batch, plan.widest, plan.depth,
                                  plan.lookup_max, sample, verify, plan.setting, forms_settled)
        clock = _Clock(stats.stage_seconds if clover_profile else None, device)  # the steps' stages, from here
        dtype = model.dtype  # (transformers' property looks through the parameters)
        while batch.active:
            if plan.trials is not None and not plan.trials.ready():
                stats.learning_steps += 1
            if budget is not None and plan.trials is not None:  # a first call learns wider forms once it runs long
                budget.cap = 1 if plan.trials.one_token_steps() else None
                budget.learn(plan.trials.width_to_learn())
            drafts, chains = _draft(batch.active, plan, budget, stats, clock)
            room = batch.room()
            drafts = _fit(drafts, room)
            started, unsettled = time.perf_counter(), 0 if plan.trials is None else plan.trials.unsettled
            width = verify.width(max(d.tokens.shape[0] for d in drafts), room)
            ids, node_pos, allowed = stack_trees(drafts, batch.active, width)
            mask = batch.attention(node_pos, allowed, dtype)
            logits, hidden, targets, columns = verify(ids, mask, node_pos, batch.cache)
            stats.steps += 1
            clock.lap("verify forward")
            accepted = _accept_rows(batch.active, drafts, logits, targets, columns, logits_processor, sample, cut,
                                    stats, budget)
            clock.lap("accept")
            news, kept = _emit_rows(batch.active, drafts, chains, accepted, logits, plan.lookup, plan.lookup_max)
            batch.keep(kept, node_pos)
            clock.lap("emit + compact")
            if plan.trials is not None:
                plan.trials.emitted(sum(k.shape[0] for k in kept))
            if budget is not None:  # a step that compiled its forward is not `settled`: no cost to learn; one
                # that learnt linear forms (or lacked the copies they compute from) costs more than it will
                provisional = plan.trials is not None and plan.trials.unsettled != unsettled
                budget.verified(len(batch.active), ids.shape[1], started, verify.settled, provisional)
                if not budget.forms_settled and plan.trials.ready():
                    budget.forms_ready()
                    # bound as the call began, the layers' products of the row counts it learnt still run through
                    # the trials (a layer at a time, outside the decoder layers' one kernel call): bound again, the
                    # rest of the call runs in the settled forms
                    forms_block.close()
                    forms_block.enter_context(bind_forms())
            _feed_heads(batch.active, accepted, news, hidden, node_pos, plan.embed)
            batch.drop_finished()

    if plan.trials is not None:
        clover_budget.keep_learnt(plan.machine, plan.trials)
    if budget is not None:
        budget.save()
    if streamer is not None:
        streamer.end()
    stats.new_tokens = sum(row.emitter.input_ids.shape[1] - input_ids.shape[1] for row in rows)
    out = sequences(rows, generation_config).to(caller_device)
    if not want:
        return out
    first = rows[0].emitter
    return GenerateDecoderOnlyOutput(
        sequences=out,
        scores=None if first.scores is None else tuple(first.scores),
        logits=None if first.raw_logits is None else tuple(first.raw_logits),
        **{OUTPUT_CACHE_FIELD: batch.cache if len(rows) == 1 else None},  # a batch's cache has masked slots
    )


@dataclass(frozen=True)
class _Plan:
    """What one generate call drafts with, and how this machine multiplies (fixed for the call)."""

    heads: DraftHeads
    spec: list[list[int]] | DynamicTree
    trees: list[TreeBuffers] | None  # a static tree compiled per lookup chain length (None: dynamic trees)
    depth: int  # how deep the heads draft
    lookup: int  # the lookup chain's length, and the most it may grow to while the text copies
    lookup_max: int
    embed: nn.Module  # how the heads embed tokens
    output_embeddings: nn.Module  # the base's lm_head, whose rows the heads draft from
    int8: bool  # drafting from int8 rows of it
    max_length: int
    key: str | None  # the machine's key in the draft budget's costs (None: no budget)
    forms: LinearForms  # how linear layers multiply each row count here (linears.py)
    machine: str | None = None  # the key the forms are kept under (`key` less the cache's kind)
    trials: FormTrials | None = None  # the row counts whose forms this call's products learn
    setting: Hashable | None = None  # the caller's tree and chain where they override the heads' own (None: the
    # heads' own): the budget's heads gate is kept per setting, since what drafting costs and gains depends on it

    @functools.cached_property
    def lm_head(self) -> DraftLMHead:
        """The lm_head rows the heads draft from, made at the first draft: int8 rows of SmolLM2's took 26 ms to
        make on the AVX-512-bf16 EPYC, a tenth of a short first call that verifies one token a step."""
        rows = self.heads.draft_lm_head(self.output_embeddings, int8=self.int8)
        return dataclasses.replace(rows, forms=self.forms)

    @property
    def widest(self) -> int:
        """The most nodes a step may verify: the whole tree with the longest lookup chain."""
        return self.trees[-1].num_nodes if self.trees is not None else self.spec.nodes + self.lookup_max + 1


def _plan(model: PreTrainedModel, heads: DraftHeads, batch: int, generation_config: GenerationConfig,
          stopping_criteria: StoppingCriteriaList, tree, lookup: int | None, lookup_max: int | None, int8: bool | None,
          budget: DraftBudget | None, calibrate: bool | None, cache_kind: str | None = None, compiled: bool = False
          ) -> _Plan:
    """The call's tree, lookup chain and draft rows from the arguments and the heads' config (refusing what
    would fail only after decoding started), and the linear forms the budget has for this machine (none
    where the forward is `compiled`: the compiler chooses its kernels). `cache_kind` ("static eager", ...)
    keys the verify costs apart from a dynamic cache's; the forms are the machine's either way."""
    device = model.device
    spec = tree_spec(tree, heads.config, device, batch)
    setting = None if tree is None and lookup is None and lookup_max is None else (
        spec if isinstance(spec, DynamicTree) else tuple(map(tuple, spec)), lookup, lookup_max)
    if isinstance(spec, DynamicTree) and not heads.dynamic_trees:
        raise ValueError(f"{heads.config.head_type} heads draft static trees only: pass tree=[[0], [1], [0, 0], ...] "
                         "(paths in Medusa's format) instead of a dynamic tree")
    _check_arguments(lookup, lookup_max, batch, generation_config, stopping_criteria)
    lookup = heads.config.lookup_tokens if lookup is None else lookup
    lookup_max = max(lookup, heads.config.lookup_max_tokens if lookup_max is None else lookup_max)
    # static trees are compiled once per lookup chain length (and per drafting depth, when the budget cuts it)
    trees = None if isinstance(spec, DynamicTree) else static_trees(spec, device, lookup_max, depth=None)
    depth = spec.depth if trees is None else len(trees[0].levels)
    if depth > heads.config.num_heads:
        raise ValueError(f"the tree is {depth} deep but the heads draft {heads.config.num_heads} tokens")
    if int8 is None:  # by default only where it was measured to pay: the CPU in bf16
        int8 = device.type == "cpu" and model.dtype == torch.bfloat16
    machine = None if budget is None else f"{cost_key(model, device)}|{budget.key_suffix()}"
    # a batch's rows multiply at 4 rows and more, where trying slow forms inside its forwards cost more than timing
    # them apart (batch 4's first call on the AVX-512-bf16 EPYC: 0.91x plain against 1.18x): batches time them
    learn = machine is not None and not compiled and batch == 1
    trials = budget.form_trials(machine, calibrate, [model, heads]) if learn else None
    if trials is not None:  # none stored: learnt from the call's own products
        forms = trials.forms
    else:
        forms = {} if machine is None or compiled else budget.forms(
            machine, calibrate, lambda limit: faster_forms([model, heads], copy_limit=limit, copies=budget.copies))
    key = machine if machine is None or not cache_kind else f"{machine}|{cache_kind}"
    if key != machine:  # the same forms on another cache, with costs of its own
        budget.share_forms(key, forms, learning=trials is not None)
    return _Plan(heads, spec, trees, depth, lookup, lookup_max, heads.token_embedding(model),
                 model.get_output_embeddings(), int8, generation_config.max_length, key, forms, machine, trials,
                 setting)


def _draft(rows: list[Row], plan: _Plan, budget: StepBudget | None, stats: GenerationStats, clock: _Clock
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


def _fit(drafts: list[Draft], room: int | None) -> list[Draft]:
    """The drafts cut to the root where a static cache has no room left for the whole tree (a caller's own
    cache, sized for the text alone: near its end, steps verify one token)."""
    if room is None or all(d.tokens.shape[0] <= room for d in drafts):
        return drafts
    return [d.root_only() for d in drafts]


def _accept_rows(rows: list[Row], drafts: list[Draft], logits: torch.Tensor | None, targets: torch.Tensor | None,
                 columns: torch.Tensor | None, logits_processor, sample: bool, cut: TopKCut | None,
                 stats: GenerationStats, budget: StepBudget | None
                 ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Each row's accepted nodes (root first), bonus token, and its tree's scores after the logits processors
    (greedy, or lossless rejection sampling, over the tokens a top-k `cut` keeps where one is given; the scores are
    None where the forward gave each node's greedy choice, `targets`, instead of logits, or the cut served). The
    logits are those of the vocabulary's `columns` alone where the forward gave those. The budget learns what was
    accepted."""
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
                                                          columns)
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
            chosen = cpu.argmax(scores)
            nodes, bonus = accept_greedy(tokens, scores.argmax(-1) if chosen is None else chosen, tree, host)
        stats.accepted_lengths.append(nodes.shape[0] - 1)
        stats.verified_tokens += n
        if budget is not None:
            budget.accepted(b, draft, nodes)
        accepted.append((nodes, bonus, scores))
    return accepted


def _emit_rows(rows: list[Row], drafts: list[Draft], chains: list[torch.Tensor], accepted,
               logits: torch.Tensor | None, lookup: int, lookup_max: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Emit each row's accepted drafts and bonus token (each was scored at its parent node) until a
    stopping criterion; returns each row's new tokens and the tree nodes its cache keeps. Without `logits` (a
    step that gave greedy choices alone) or a row's scores (sampled through a top-k cut) the emitters, which then
    keep no scores, get None for them."""
    news, kept = [], []
    for b, (row, draft, chain, (nodes, bonus, scores)) in enumerate(zip(rows, drafts, chains, accepted)):
        new = torch.cat([draft.tokens.index_select(0, nodes[1:]), bonus.view(1)])
        # the scores and logits of a path down a chain (nodes 0..n-1: every one-token step) are views where the
        # emitter keeps neither (a kept view would hold the step's every row): copying a vocabulary-wide row took
        # 10-14 us (SmolLM2, CPU); elsewhere reading the last node would be a host sync
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


def _feed_heads(rows: list[Row], accepted, news: list[torch.Tensor], hidden: torch.Tensor, node_pos: torch.Tensor,
                embed: nn.Module) -> None:
    """Queue each unfinished row's accepted positions (hidden states, the embeddings of the tokens that follow
    them, positions) for the heads, which run over them when they next draft."""
    for b, (row, (nodes, _, _), new) in enumerate(zip(rows, accepted, news)):
        if not row.finished:
            row.pending.append((hidden[b].index_select(0, nodes)[None], embed(new)[None],
                                node_pos[b].index_select(0, nodes)[None]))


def _check_arguments(lookup: int | None, lookup_max: int | None, batch: int, generation_config: GenerationConfig,
                     stopping_criteria: StoppingCriteriaList) -> None:
    """Refuse what would fail or mislead only after decoding started."""
    for name, value in (("lookup", lookup), ("lookup_max", lookup_max)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be an int >= 0 (0: no lookup chain), got {value!r}")
    may_stop_early = generation_config.eos_token_id is not None or any(
        not isinstance(c, MaxLengthCriteria) for c in stopping_criteria)
    if batch > 1 and may_stop_early and pad_id(generation_config) is None:
        raise ValueError("a batch whose rows may stop at different lengths needs pad_token_id to pad the shorter "
                         "ones: pass pad_token_id=tokenizer.pad_token_id (or eos_token_id) to generate")
