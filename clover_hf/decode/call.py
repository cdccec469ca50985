"""One generate call's setup and ending: its arguments checked, the tree and draft rows it drafts with (`Plan`), the
backend that computes the base's forwards, its cache, and what it returns."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, MaxLengthCriteria, PreTrainedModel, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput

from clover_hf.backends import KernelBackend, TorchBackend
from clover_hf.base.cache import OUTPUT_CACHE_FIELD, given_cache, is_static, static_cache, to_normal_tensors
from clover_hf.base.verify_forward import VerifyForward, compile_settings
from clover_hf.heads.base import DraftHeads
from clover_hf.heads.lm_head import DraftLMHead
from clover_hf.heads.tree import DynamicTree, TreeBuffers

from .budget import DraftBudget
from .choosing import StepBudget
from .drafting import static_trees, tree_spec
from .record import FeatureRecord
from .rows import Batch, Row, criteria_read_scores, pad_id, sequences
from .stats import GenerationStats
from .verification import TopKCut


@dataclass
class DecodeCall:
    """A generate call as the decode loop runs it: what it keeps and streams, how it chooses tokens, what it drafts
    with (`plan`), the backend computing the base's forwards, and its stats."""

    model: PreTrainedModel
    input_ids: torch.Tensor  # on the model's device
    caller_device: torch.device
    attention_mask: torch.Tensor | None
    logits_processor: LogitsProcessorList
    stopping_criteria: StoppingCriteriaList
    generation_config: GenerationConfig
    streamer: object | None
    keep: tuple[bool, bool]  # whether the output keeps (scores, logits)
    sample: bool
    pre_norm: bool
    cut: TopKCut | None  # sampling through a top-k cut, on the CPU
    plan: Plan
    backend: TorchBackend
    cache: object | None  # the cache to decode into (None: a dynamic one, made by the prefill)
    budget: DraftBudget | None
    calibrate: bool | None
    stats: GenerationStats
    record: FeatureRecord | None  # the base's features kept at every position (full logits computed for them)

    @classmethod
    def of(cls, model: PreTrainedModel, input_ids: torch.Tensor, logits_processor: LogitsProcessorList,
           stopping_criteria: StoppingCriteriaList, generation_config: GenerationConfig, streamer, heads, tree,
           lookup, lookup_max, stats, budget, calibrate, record: FeatureRecord | None, model_kwargs: dict
           ) -> DecodeCall:
        """The call from `clover_generate`'s arguments, refusing what would fail only after decoding started."""
        if heads is None:
            raise ValueError("clover_generate needs clover_heads=CloverHeads(...) (or other DraftHeads)")
        device, caller_device = model.device, input_ids.device
        input_ids = input_ids.to(device)  # transformers lets inputs stay on another device; Clover works on the model's
        want = generation_config.return_dict_in_generate
        keep = (want and generation_config.output_scores, want and generation_config.output_logits)
        if input_ids.shape[0] > 1 and (any(keep) or streamer is not None):
            raise ValueError("Clover returns scores and streams for batch size 1 only; pass one sequence at a time")
        prepared = given_cache(model_kwargs)  # generate's or the caller's
        sample, pre_norm = bool(generation_config.do_sample), heads.config.head_input == "pre_norm"
        # nothing reads a step's scores but acceptance: none kept or recorded, no criteria reading them
        unread = record is None and not any(keep) and not criteria_read_scores(stopping_criteria)
        greedy = not sample and not logits_processor and unread  # reads no logits but each node's argmax
        cut = TopKCut.of(logits_processor, getattr(model.get_output_embeddings(), "out_features", None)) if (
            sample and unread and device.type == "cpu") else None
        verify = VerifyForward(model, pre_norm, compile_settings(model, generation_config, prepared), greedy,
                               cut.k if cut is not None and cut.screens else None, heads.taps)
        plan = make_plan(model, heads, input_ids.shape[0], generation_config, stopping_criteria, tree, lookup,
                         lookup_max)
        backend = KernelBackend.create(model, [model, heads], verify, budget, calibrate, input_ids.shape[0],
                                       is_static(prepared))
        cache = _decode_cache(model, model_kwargs, generation_config, backend.width(plan.widest, None))
        attention_mask = model_kwargs.get("attention_mask")
        return cls(model, input_ids, caller_device, None if attention_mask is None else attention_mask.to(device),
                   logits_processor, stopping_criteria, generation_config, streamer, keep, sample, pre_norm, cut,
                   dataclasses.replace(plan, forms=backend.forms), backend, cache, budget, calibrate,
                   stats if stats is not None else GenerationStats(), record)

    def step_budget(self, batch: Batch) -> StepBudget | None:
        """The budget at work in this call (None: the whole tree every step)."""
        plan = self.plan
        return StepBudget.start(self.budget, self.backend.key, self.calibrate, self.model, batch, plan.widest,
                                plan.depth, plan.lookup_max, self.sample, self.backend, plan.setting,
                                self.backend.forms_settled())

    def finish(self, rows: list[Row], batch: Batch, budget: StepBudget | None
               ) -> torch.LongTensor | GenerateDecoderOnlyOutput:
        """Keep what the call learnt, end the stream, and return what `generate` returns."""
        self.backend.finish()
        if budget is not None:
            budget.save()
        if self.streamer is not None:
            self.streamer.end()
        self.stats.new_tokens = sum(row.emitter.input_ids.shape[1] - self.input_ids.shape[1] for row in rows)
        out = sequences(rows, self.generation_config).to(self.caller_device)
        if not self.generation_config.return_dict_in_generate:
            return out
        first = rows[0].emitter
        return GenerateDecoderOnlyOutput(
            sequences=out,
            scores=None if first.scores is None else tuple(first.scores),
            logits=None if first.raw_logits is None else tuple(first.raw_logits),
            **{OUTPUT_CACHE_FIELD: batch.cache if len(rows) == 1 else None},  # a batch's cache has masked slots
        )


@dataclass(frozen=True)
class Plan:
    """What one generate call drafts with (fixed for the call)."""

    heads: DraftHeads
    spec: list[list[int]] | DynamicTree
    trees: list[TreeBuffers] | None  # a static tree compiled per lookup chain length (None: dynamic trees)
    depth: int  # how deep the heads draft
    lookup: int  # the lookup chain's length, and the most it may grow to while the text copies
    lookup_max: int
    embed: nn.Module  # how the heads embed tokens
    output_embeddings: nn.Module  # the base's lm_head, whose rows the heads draft from
    max_length: int
    forms: dict[int, str]  # how linear layers multiply each row count here (the backend's)
    setting: Hashable | None = None  # the caller's tree and chain where they override the heads' own (None: the
    # heads' own): the budget's heads gate is kept per setting, since what drafting costs and gains depends on it

    @functools.cached_property
    def lm_head(self) -> DraftLMHead:
        """The lm_head rows the heads draft from, made at the first draft (a short first call that verifies one token
        a step need not pay for them)."""
        rows = self.heads.draft_lm_head(self.output_embeddings)
        return dataclasses.replace(rows, forms=self.forms)

    @property
    def widest(self) -> int:
        """The most nodes a step may verify: the whole tree with the longest lookup chain."""
        return self.trees[-1].num_nodes if self.trees is not None else self.spec.nodes + self.lookup_max + 1


def make_plan(model: PreTrainedModel, heads: DraftHeads, batch: int, generation_config: GenerationConfig,
              stopping_criteria: StoppingCriteriaList, tree, lookup: int | None, lookup_max: int | None) -> Plan:
    """The call's tree, lookup chain and draft rows from the arguments and the heads' config, refusing what would
    fail only after decoding started."""
    device = model.device
    spec = tree_spec(tree, heads.config, device, batch)
    setting = None if tree is None and lookup is None and lookup_max is None else (
        spec if isinstance(spec, DynamicTree) else tuple(map(tuple, spec)), lookup, lookup_max)
    if isinstance(spec, DynamicTree) and not heads.dynamic_trees:
        raise ValueError(f"{heads.config.head_type} heads draft static trees only: pass tree=[[0], [1], [0, 0], ...] "
                         "(paths in Medusa's format) instead of a dynamic tree")
    check_arguments(lookup, lookup_max, batch, generation_config, stopping_criteria)
    lookup = heads.config.lookup_tokens if lookup is None else lookup
    lookup_max = max(lookup, heads.config.lookup_max_tokens if lookup_max is None else lookup_max)
    # static trees are compiled once per lookup chain length (and per drafting depth, when the budget cuts it)
    trees = None if isinstance(spec, DynamicTree) else static_trees(spec, device, lookup_max, depth=None)
    depth = spec.depth if trees is None else len(trees[0].levels)
    if depth > heads.config.num_heads:
        raise ValueError(f"the tree is {depth} deep but the heads draft {heads.config.num_heads} tokens")
    return Plan(heads, spec, trees, depth, lookup, lookup_max, heads.token_embedding(model),
                model.get_output_embeddings(), generation_config.max_length, {}, setting)


def check_arguments(lookup: int | None, lookup_max: int | None, batch: int, generation_config: GenerationConfig,
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


def decode_context(generate):
    """Run `generate(model, ...)` under `tree_attention_backends(model.device)` and `torch.inference_mode()`.

    Plain `generate` runs under `no_grad`; inference mode also skips autograd's version counting and
    view tracking on every op, which on a small base's one-token CPU forward saves as much as Clover's own
    work in a step that verifies one token."""

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
