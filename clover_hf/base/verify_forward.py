"""The verify forward of each step's tree: eager, or over a static cache compiled once per width bucket.

A compiled forward has fixed shapes, so a step's tree is padded (`drafting.stack_trees`) to the smallest
of `BUCKETS` that holds it, and each bucket (per batch size) compiles once. At most `MAX_SHAPES` shapes are
compiled per model and settings; other shapes run eager. The compiled region is the
base's forward alone: the mask, positions, acceptance and every read on the host stay outside it. When
to compile follows transformers' own rules for `generate` (`compile_settings`); on CUDA its default
`CompileConfig` captures CUDA graphs (mode "reduce-overhead").
"""

from __future__ import annotations

import functools
import inspect
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import CompileConfig, GenerationConfig, PreTrainedModel

from .cache import cache_keyword, is_static
from .forward import base_forward, fused, last_hidden
from .lean_layers import model_forward
from .parts import decoder_layers, final_norm, grab_layer_output

BUCKETS = (1, 4, 16, 64, 160, 256)  # tree widths a compiled forward is padded to (wider: multiples of the last);
# 160 holds an accelerator's 128-node dynamic tree with its lookup chain
MAX_SHAPES = 8  # shapes compiled at most per model and settings (dynamo's own default recompile limit)
WARM_CALLS = 3  # a shape's first calls compile it (and on CUDA record its graph): the budget does not time them


def compile_settings(model: PreTrainedModel, generation_config: GenerationConfig, cache) -> CompileConfig | None:
    """The `CompileConfig` to compile the verify forward with, or None for eager, by the rules transformers'
    `generate` applies to its one-token forward: a static cache, a device it compiles on by default
    (CUDA, XPU) or `compile_config._compile_all_devices`, no `disable_compile`, a quantizer that compiles."""
    if not is_static(cache) or generation_config.disable_compile:
        return None
    config = generation_config.compile_config
    if model.device.type not in ("cuda", "xpu") and not (config is not None and config._compile_all_devices):
        return None
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None and not quantizer.is_compileable:
        return None
    return config if config is not None else CompileConfig()


def bucket(width: int, buckets: tuple[int, ...] | None = None) -> int:
    """The compiled width that holds a tree of `width` tokens, among `buckets` (default `BUCKETS`)."""
    buckets = buckets or BUCKETS
    fits = [b for b in buckets if b >= width]
    return fits[0] if fits else -(-width // buckets[-1]) * buckets[-1]


@dataclass
class _Compiled:
    """One model's compiled forward for one (settings, pre_norm, taps), and the calls each shape has had.

    The heads read the last hidden states, which a hook on the decoder (or, for `pre_norm`, the final norm) hands
    over through `last[0]`, and the tapped layers' outputs, which hooks on those hand over through `last[1:]`: a hook
    registered inside the compiled region would break its graph, so `hooks` are registered around each call, the
    same functions each time (dynamo guards on them)."""

    fn: object
    hooks: list  # (module, whether a forward pre-hook, the hook)
    last: list
    calls: dict[tuple, int] = field(default_factory=dict)  # shape -> calls so far (-1: runs eager)

    @property
    def shapes(self) -> set[tuple]:
        """The shapes compiled."""
        return {shape for shape, calls in self.calls.items() if calls > 0}

    def __call__(self, *args) -> tuple[torch.Tensor, torch.Tensor]:
        handles = [(module.register_forward_pre_hook if pre else module.register_forward_hook)(hook)
                   for module, pre, hook in self.hooks]
        try:
            return self.fn(*args)
        finally:
            for handle in handles:
                handle.remove()
            self.last[:] = [None] * len(self.last)


def _grab_input(last: list, module, args) -> None:
    last[0] = args[0]


def _grab_output(last: list, module, args, out) -> None:
    last[0] = last_hidden(out)


def _logits_and_last(model: PreTrainedModel, keyword: str, last: list, ids, mask, positions, cache):
    """The region compiled: the base's forward, its logits in float32 and the heads' input the hooks put in `last`."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, return_dict=True,
                **{keyword: cache})
    return out.logits.float(), fused(last[1:], last[0])


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(settings, pre_norm, taps): _Compiled}


def _recompile_options() -> dict:
    """At most MAX_SHAPES graphs for this function alone, where torch.compile takes that per function (2.13+);
    older versions keep dynamo's global limit."""
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return {"recompile_limit": MAX_SHAPES, "isolate_recompiles": True}
    return {}


def _compiled(model: PreTrainedModel, config: CompileConfig, pre_norm: bool, taps: tuple[int, ...] = ()
              ) -> _Compiled | None:
    """The model's compiled forward for these settings, made once and kept with the model across calls;
    None for a model that is its own decoder (no module to read the last hidden states from)."""
    module = final_norm(model) if pre_norm else model.get_decoder()
    layers = decoder_layers(model) if taps else None
    if module is None or module is model or (taps and layers is None):
        return None
    settings = (config.backend, config.mode, config.fullgraph, config.dynamic, repr(config.options))
    per_model = _COMPILED.setdefault(model, {})
    if (settings, pre_norm, taps) not in per_model:
        last = [None] * (len(taps) + 1)
        forward = functools.partial(_logits_and_last, model, cache_keyword(type(model)), last)
        inductor = config.backend == "inductor"
        fn = torch.compile(forward, fullgraph=config.fullgraph, dynamic=bool(config.dynamic), backend=config.backend,
                           mode=config.mode if inductor and not config.options else None, options=config.options,
                           **_recompile_options())
        hooks = [(module, pre_norm, functools.partial(_grab_input if pre_norm else _grab_output, last))]
        hooks += [(layers[i], False, functools.partial(grab_layer_output, last, at + 1)) for at, i in enumerate(taps)]
        per_model[(settings, pre_norm, taps)] = _Compiled(fn, hooks, last)
    return per_model[(settings, pre_norm, taps)]


class Verified(NamedTuple):
    """What a verify forward gives: its logits (B, T, V) in float32 and last hidden states (B, T, H); asked only for
    greedy choices, where the lm_head screens them (`lean_layers._ModelForward`), those (B, T) instead of logits;
    asked for a top-k cut's columns, where it screens them, the logits (B, T, C) at those `columns` (C,) alone."""

    logits: torch.Tensor | None
    hidden: torch.Tensor
    targets: torch.Tensor | None = None
    columns: torch.Tensor | None = None


class VerifyForward:
    """The base forward of a step's tree over the batch's cache: `(logits, hidden, targets, columns) = verify(ids,
    mask, positions, cache)`, compiled when `config` is given and the cache is static. `greedy`: the call reads each
    token's greedy choice alone (no sampling, logits processors, or scores kept or read), which the lean forward
    then gives as `targets` without the logits where it can. `top_k`: the call samples through a top-k cut of the
    logits alone (`verification.TopKCut.screens`), whose columns the lean forward then gives where it can."""

    def __init__(self, model: PreTrainedModel, pre_norm: bool, config: CompileConfig | None = None,
                 greedy: bool = False, top_k: int | None = None, taps: tuple[int, ...] = ()) -> None:
        self.model, self.pre_norm, self.greedy, self.top_k, self.taps = model, pre_norm, greedy, top_k, taps
        self.compiled = None if config is None else _compiled(model, config, pre_norm, taps)
        self.config = None if self.compiled is None else config
        self.settled = True  # whether the last call's time is the step's: past its compiling calls, with no one-off
        # set-up (the lean forward's checks, `lean_layers._ModelForward.checked`)

    @property
    def buckets(self) -> tuple[int, ...] | None:
        """The widths trees are padded to (None: not compiled, each tree runs at its own size)."""
        return None if self.compiled is None else BUCKETS

    @property
    def key(self) -> str:
        """What the verify costs depend on beyond the machine: the cache kind and compilation."""
        return "eager" if self.config is None else f"compiled {self.config.backend} {self.config.mode}"

    def width(self, tokens: int, room: int | None) -> int:
        """The forward's width for a tree of `tokens` tokens: its bucket when compiled and the cache has
        `room` for it, else the tree's own size."""
        if self.compiled is None:
            return tokens
        padded = bucket(tokens)
        return padded if room is None or padded <= room else tokens

    def __call__(self, ids: torch.Tensor, mask, positions: torch.Tensor, cache) -> Verified:
        calls = self._calls_before((tuple(ids.shape), tuple(mask.shape))) if is_static(cache) else -1
        self.settled = calls < 0 or calls >= WARM_CALLS
        if calls < 0:
            lean = model_forward(self.model)  # within `lean_layers`, where the layers all run in one kernel call
            out = None if lean is None else lean(ids, mask, positions, cache, self.pre_norm, self.greedy, self.top_k)
            if out is not None and self.taps:  # the tapped layers' outputs, kept by the call running the layers
                out = (out[0], fused(lean.stack.tapped, out[1]), *out[2:])
            self.settled = lean is None or not lean.checked  # a process's one-off checks are no step's cost
            return Verified(*(out if out is not None else base_forward(self.model, ids, mask, positions, cache,
                                                                       pre_norm=self.pre_norm, taps=self.taps)))
        if self.model.device.type == "cuda" and self.config.mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # the previous step's outputs were copied out
        logits, hidden = self.compiled(ids, mask, positions, cache)
        return Verified(logits.clone(), hidden.clone())  # a CUDA graph's outputs are overwritten by its next replay

    def _calls_before(self, shape: tuple) -> int:
        """How many times `shape` ran compiled before this call, which it counts; -1 where it runs eager (not
        compiled, or a new shape past `MAX_SHAPES`)."""
        if self.compiled is None:
            return -1
        calls = self.compiled.calls.get(shape, 0)
        if calls == 0 and len(self.compiled.shapes) >= MAX_SHAPES:
            calls = -1
        self.compiled.calls[shape] = calls + 1 if calls >= 0 else -1
        return calls


def top_k_columns(scores: torch.Tensor, k: int, marked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A top-k warper's cut of float32 `scores` (R, n): each row's k-th largest (R,) and, ascending, the columns some
    row keeps or `marked` names; None where a score is a NaN."""
    if torch.isnan(scores).any():
        return None
    kth = scores.topk(k).values[:, -1]
    return kth, torch.cat([(scores >= kth[:, None]).any(0).nonzero()[:, 0], marked]).unique()
