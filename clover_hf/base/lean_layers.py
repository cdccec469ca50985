"""Decoder layers of the Llama pattern run without their modules' per-call machinery.

A one-token forward of SmolLM2-135M on the AVX-512-bf16 EPYC took 16.2 ms, 13.6 of them in its 30
decoder layers; calling each layer's parts through `nn.Module.__call__`, with transformers' keyword
plumbing and decorators, was 1.4 ms of that. Within `lean_layers`, a decoder layer of a class listed in
`LEAN_MODULES` runs one function instead: the same operations on the same parts (the norms', projections'
and activation's own `forward`s, Llama's rotary embedding of queries and keys in one pass, the cache's
`update`, the attention function its config names), so its output is bitwise the layer's own.

One exception, asked for with `pack` (where a call multiplies in Clover's linear forms, whose products
round differently from plain `generate`'s anyway): on the CPU in bf16 or float16, SDPA attends one query
token to shared key/value heads (`enable_gqa`, what transformers asks for where there is no mask) 4-5x
slower than with the query heads packed as rows of their key/value head (transformers' `pack_gqa`): 119
against 24 us at 300 keys in bf16, 30 layers a token. A verify forward's few masked query tokens gain where
the text is long: 2-6 tokens over 1,200-1,800 keys took 1-1.5 ms less a forward packed (5%), while over
150-300 keys, alternating packed and not within a call, 2-8 tokens took as long either way (within 0.2 ms)
(AVX-512-bf16 EPYC, SmolLM2's 9 query heads on 3; from 12 tokens up packing measured no faster). So up to PACK_QUERIES tokens attend packed over
PACK_KEYS keys or more. Packed, attention rounds the same but for rare last bits (4 inputs in 45 differed
in bf16), and bf16 decoding can drift from plain `generate`'s within 64 tokens. With `pack` in bf16, the
layer's RMSNorms and its rotary embedding also run as one call each of `bf16_kernel` where it is built: a norm
2.3 against 13.5 us, rounding as the module does but for rare last bits (2 outputs in 806,400); the rotary
embedding bitwise torch's. So does attention (`cpu.attention`,
float32 scores and sums like SDPA's, in another order): whole-tree verify forwards of SmolLM2 took 10.4 against
11.5 ms, one-token ones 8.5 against 8.9 (alternating call by call). Where, besides, every product is in the
kernel's tiled copies and the cache grows in place, the whole layer is one call of those same functions
(`cpu.DecoderLayer`, bitwise them one by one): one-token forwards 12.8 against 17.8 ms on the AVX2-only EPYC.
Where all of a model's layers run so, in one call, a verify forward of a model of LEAN_MODELS runs its decoder's
embedding, mask and rotary embedding, that call, the final norm and the lm_head without the model's own forwards
(`model_forward`, checked bitwise against them once a process): one-token forwards 10.5 against 11.4 ms there.
Asked for greedy choices alone, where the lm_head computes from its tiled copy, it gives each token's argmax from
the lm_head's int8 screen (`cpu.Screen`, the same tokens) instead of the logits.

Layers of other classes, with hooks or a replaced `forward` (accelerate's offloading), or in training keep
their own forward; so does a class whose first lean forward in a process does not match its own on a
trial input (a transformers version that changed the layer).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from clover_hf import cpu
from clover_hf.core.watch import unchanged, watch
from clover_hf.cpu import BlockMemo, layer_weights

from .cache import GrowingLayer, new_cache
from .forward import base_forward
from .parts import apply_rope, decoder_layers

# transformers' modeling modules whose decoder layer, attention, MLP and RMSNorm the lean forward mirrors, and
# what each passes its attention function as `sliding_window` (Llama: nothing)
LEAN_MODULES: dict[str, Callable[[nn.Module], dict] | None] = {
    "transformers.models.llama.modeling_llama": None,
    "transformers.models.mistral.modeling_mistral": lambda attn: {"sliding_window": getattr(attn.config, "sliding_window", None)},
    "transformers.models.qwen2.modeling_qwen2": lambda attn: {"sliding_window": attn.sliding_window},
    "transformers.models.qwen3.modeling_qwen3": lambda attn: {"sliding_window": attn.sliding_window},
}
# transformers' RMSNorms of these layers, all weight * bf16(x * rsqrt(mean(x^2) + eps)): `cpu.rms_norm`'s
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
# activations that compute F.silu (transformers' ACT2FN["silu"], torch's module): the MLP's act_fn(gate) * up in bf16
# is `cpu.silu_mul`'s one call
SILU = ("SiLUActivation", "SiLU")
# transformers' causal LMs whose forward is its decoder's embedding, causal mask, rotary embedding, layers and final
# norm, then the lm_head (by class name, with the module both classes come from): `_ModelForward` runs just those
LEAN_MODELS = {"LlamaForCausalLM": "transformers.models.llama.modeling_llama",
               "MistralForCausalLM": "transformers.models.mistral.modeling_mistral",
               "Qwen2ForCausalLM": "transformers.models.qwen2.modeling_qwen2"}
_MODELS_CHECKED: dict[tuple, bool] = {}  # (model class, dtype) -> whether `_ModelForward` matched its own forward
_SCREENS_CHECKED: dict[tuple, bool] = {}  # (model class, dtype[, "top-k"]) -> whether the lm_head's screen chose as
# its logits do (its argmax, or the columns of a top-k cut)
_SCREENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # lm_head -> (what it was made of, its screen)
_ROTARY_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # rotary module -> its `_RotaryTable`
STATIC_ROPE = ("default", "linear", "llama3")  # rope types whose angles do not change with the sequence length
ROTARY_TABLE_MOST = 1 << 14  # positions a rotary table holds at most (2 MiB at head_dim 64 in bf16): past them, the module
PACK_QUERIES, PACK_KEYS = 8, 1024  # a few query tokens attend packed (`pack`): this many at most, over this many keys
TRIAL_TOKENS = 3  # tokens of the input a class's lean forward is checked on, once per process (`_checked`)

_checked: dict[tuple, bool] = {}  # (layer class, attention, dtype, device type) -> the lean forward matched the own


def _parts(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules whose forwards the lean forward stands in for or calls directly, and the projections
    (called through their `forward` attribute, whatever computes it: `linears.linear_forms`, accelerate's
    offloading hooks), none of which may have hooks that would then not run."""
    attn, mlp = layer.self_attn, layer.mlp
    own = [layer, attn, mlp, layer.input_layernorm, layer.post_attention_layernorm,
           *(m for m in (getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)) if m is not None)]
    projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return own, projections


def lean_reason(layer: nn.Module) -> str | None:
    """Why `layer` keeps its own forward, or None where the lean one computes the same."""
    module_name = type(layer).__module__
    if module_name not in LEAN_MODULES or not type(layer).__name__.endswith("DecoderLayer"):
        return f"{type(layer).__name__} is not a decoder layer of {', '.join(LEAN_MODULES)}"
    prefix, module = type(layer).__name__[: -len("DecoderLayer")], sys.modules[module_name]
    try:
        kinds = {"self_attn": "Attention", "mlp": "MLP", "input_layernorm": "RMSNorm", "post_attention_layernorm": "RMSNorm"}
        if any(type(getattr(layer, name)) is not getattr(module, prefix + kind) for name, kind in kinds.items()):
            return f"{type(layer).__name__}'s parts are not {prefix}'s own classes"
    except AttributeError:
        return f"{type(layer).__name__} lacks the parts of {prefix}'s decoder layer"
    if layer.training:
        return "the model is in training mode"
    own, projections = _parts(layer)
    for part in own + projections:
        if part._forward_hooks or part._forward_pre_hooks:
            return f"{type(part).__name__} has hooks"
    for part in own:
        if "forward" in part.__dict__:
            return f"{type(part).__name__} has a replaced forward"
    return None


def _rotary_together(query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary embedding (`x * cos + rotate_half(x) * sin`, as the heads' `apply_rope` computes it) of
    queries and keys (B, T, heads, head_dim), both in one pass, as (B, heads, T, head_dim): the same
    elementwise operations as rotating each apart, so bitwise the same, in half the operations."""
    both = apply_rope(torch.cat((query, key), dim=2).transpose(1, 2), cos.unsqueeze(1), sin.unsqueeze(1))
    return both.split((query.shape[2], key.shape[2]), dim=1)


def _packs(tokens: int, keys: int, mask: torch.Tensor | None) -> bool:
    """Whether `tokens` query tokens attend to `keys` keys packed under `mask`: one token, under no mask or one all
    heads share; up to PACK_QUERIES tokens over PACK_KEYS keys or more, under a mask all heads share (several need
    theirs: packed, `is_causal` would mask the wrong rows)."""
    shared = mask is None or (mask.dim() == 4 and mask.shape[1] == 1)
    if tokens == 1:
        return shared
    return tokens <= PACK_QUERIES and keys >= PACK_KEYS and mask is not None and shared


class _PackedMasks:
    """A forward's mask repeated for each packed query head, made once for all its layers (transformers hands
    every layer the same mask): 7 us a layer at 4 tokens over 1,500 keys, 0.2 ms a forward, made 30 times."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None
        self.repeated: torch.Tensor | None = None

    def __call__(self, mask: torch.Tensor, groups: int) -> torch.Tensor:
        if mask is not self.mask or self.repeated.shape[2] != groups * mask.shape[2]:
            self.mask, self.repeated = mask, mask.repeat(1, 1, groups, 1)
        return self.repeated


def _packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                      scaling: float, masks: _PackedMasks) -> torch.Tensor:
    """SDPA of query (B, heads, T, d) over shared key/value heads (B, kv_heads, K, d), each key/value head's query
    heads packed as its rows (head-major, then token), as (B, T, heads, d). `mask` (B, 1, T, K) is repeated for each
    packed head (by `masks`); one token may go without (it sees every key)."""
    batch, heads, tokens, head_dim = query.shape
    groups = heads // key.shape[1]
    if mask is not None and tokens > 1:
        mask = masks(mask, groups)
    out = F.scaled_dot_product_attention(query.reshape(batch, key.shape[1], groups * tokens, head_dim), key, value,
                                         attn_mask=mask, scale=scaling)
    return out.reshape(batch, heads, tokens, head_dim).transpose(1, 2).contiguous()


def _kernel_norm(module: nn.Module) -> bool:
    """Whether `bf16_kernel` computes the norm: a bf16 RMSNorm of RMS_NORMS where the kernel serves."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__ in RMS_NORMS and isinstance(weight, torch.Tensor) and weight.dim() == 1
            and cpu.serves(weight))


def _norm(module: nn.Module | None, fused: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The norm's forward: where `fused`, as one `bf16_kernel` call if it is a bf16 RMSNorm of RMS_NORMS."""
    if module is None:
        return None
    if fused and _kernel_norm(module):
        return cpu.rms_norm(module.weight, float(module.variance_epsilon), module.forward)
    return module.forward


class _WholeLayer:
    """A decoder layer in one `cpu.DecoderLayer` call, as a function of (hidden states, mask, position
    embeddings, cache) that returns None (nothing done) where a call is not one it computes: its products not all
    in the kernel's tiled copies (`linears.layer_weights`: q/k/v and gate/up stacked), or a cache that is not a
    growing one holding keys."""

    def __init__(self, layer: nn.Module) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        norm_in, post = layer.input_layernorm, layer.post_attention_layernorm
        head_dim = attn.head_dim
        self.kernel = cpu.DecoderLayer(norm_in.weight, post.weight, float(norm_in.variance_epsilon),
                                               attn.q_proj.out_features // head_dim,
                                               attn.k_proj.out_features // head_dim, head_dim, attn.scaling)
        self.projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj,
                            mlp.down_proj)
        self.layer_idx = attn.layer_idx

    def weights(self, rows: int) -> list | None:
        return layer_weights(rows, *self.projections)

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None, embeddings: tuple, cache) -> torch.Tensor | None:
        if getattr(cache, "offloading", False) or self.layer_idx >= len(getattr(cache, "layers", ())):
            return None
        stored = cache.layers[self.layer_idx]
        weights = self.weights(x.numel() // x.shape[-1]) if isinstance(stored, GrowingLayer) else None
        return None if weights is None else stored.extend(self.kernel, x, *embeddings, weights, mask)


def _whole_layer(layer: nn.Module) -> _WholeLayer | None:
    """The layer as one kernel call, or None where its norms differ in epsilon."""
    if float(layer.input_layernorm.variance_epsilon) != float(layer.post_attention_layernorm.variance_epsilon):
        return None
    return _WholeLayer(layer)


class _Held(NamedTuple):
    """The cache stores a `_Stack`'s kernels were last pointed at."""

    layers: list  # the cache's layers
    stores: list[tuple[torch.Tensor, torch.Tensor]]  # each one's keys and values stores
    slots: int  # the fewest slots of those
    batch: int
    pointed: int  # `cpu.DecoderLayer.pointed` then
    inference: bool  # whether any store is an inference tensor (written in inference mode only)


class _Stack:
    """All of a model's decoder layers in one `cpu.DecoderStack` call, made by the first layer's forward where
    each layer would run whole (`_WholeLayer`): the layers after it then hand on what they are given, the stack's
    output (`out`). Per layer Python took ~90 us in situ of a whole layer's ~400 (SmolLM2, AVX2-only EPYC)."""

    def __init__(self) -> None:
        self.wholes: list[_WholeLayer | None] = []
        self.stack: cpu.DecoderStack | None = None
        self.key: tuple | None = None  # (form, or rows past the steady ones; the first q projection's forward) the
        # weights were last set for
        self.memo = BlockMemo()  # the layers' weights by rows
        self.out: torch.Tensor | None = None
        self.held: _Held | None = None  # the stores the kernels were last pointed at

    def add(self, whole: _WholeLayer | None) -> None:
        self.wholes.append(whole)

    def ready(self, layers: list[nn.Module]) -> None:
        """Run as one where the layers added are the model's `layers`, in order, each whole."""
        if self.wholes and len(self.wholes) == len(layers) and all(
                w is not None and w.layer_idx == i for i, w in enumerate(self.wholes)):
            self.stack = cpu.DecoderStack([w.kernel for w in self.wholes])

    def _weights(self, rows: int) -> list | None:
        """Each layer's tiled weights for `rows` rows, or None where any computes otherwise."""
        weights = [whole.weights(rows) for whole in self.wholes]
        return None if any(w is None for w in weights) else weights

    def _holding(self, stored: list, length: int, end: int, batch: int) -> bool:
        """Whether the kernels point at the stores the cache's layers hold `length` slots in, with room for `end`: as
        they were pointed at last, no kernel pointed elsewhere since, where they may be written (`reserve_after`)."""
        held = self.held
        return (held is not None and end <= held.slots and batch == held.batch
                and held.pointed == cpu.DecoderLayer.pointed and stored[: len(held.layers)] == held.layers
                and (not held.inference or torch.is_inference_mode_enabled())
                and GrowingLayer.hold(held.layers, held.stores, length))

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None, embeddings: tuple, cache) -> torch.Tensor | None:
        """The last layer's output (kept as `out`), or None (nothing done: the layers compute one by one)."""
        self.out = None
        stored = getattr(cache, "layers", ())
        if self.stack is None or getattr(cache, "offloading", False) or len(stored) < len(self.wholes) or x.dim() != 3:
            return None
        rows, tokens = x.numel() // x.shape[-1], x.shape[1]
        forward = self.wholes[0].projections[0].forward  # a new block of linear forms binds new forwards
        # the row counts of a form compute from the same weights (`BlockMemo`): a width of the form last set needs none
        form = BlockMemo.steady_form(forward, rows)
        key = (rows if form is None else form, forward)
        if key != self.key:
            self.key = None
            weights = self.memo.get(forward, rows, self._weights)
            if weights is None or not all(whole.kernel.set_weights(w) for whole, w in zip(self.wholes, weights)):
                return None
            self.key = key
        length = stored[0].get_seq_length()
        end = length + tokens
        if not self._holding(stored, length, end, x.shape[0]):
            self.held = None
            held = []
            for whole, layer in zip(self.wholes, stored):
                stores = layer.reserve_after(length, end) if isinstance(layer, GrowingLayer) else None
                if stores is None or not whole.kernel.set_stores(*stores, x.shape[0], end, layer.key_layout()):
                    return None
                held.append(stores)
            self.held = _Held(stored[: len(self.wholes)], held, min(keys.shape[-2] for keys, _ in held), x.shape[0],
                              cpu.DecoderLayer.pointed, any(keys.is_inference() for keys, _ in held))
        self.out = self.stack(x, *embeddings, length, mask)
        if self.out is not None:
            for layer in stored[: len(self.wholes)]:
                layer.set_length(length + tokens)
        return self.out


class _ModelForward:
    """A verify forward of a causal LM of LEAN_MODELS whose layers all run in one kernel call (`_Stack`): its decoder's
    embedding, causal mask and rotary embedding as its forward computes them, that call, the final norm (one kernel
    call) and the lm_head, without the Python of transformers' model forwards, their decorators and the 29 layers'
    pass-through calls around them (~1 ms a one-token forward of SmolLM2, AVX2-only EPYC). Its first call in a process
    (per model class and dtype) is checked bitwise against the model's own forward, run after it over the same slots
    of the cache; where they differ (another transformers version) the model's own forward runs from then on."""

    def __init__(self, model: nn.Module, stack: _Stack) -> None:
        self.model, self.stack = model, stack
        self.inner = inner = model.get_decoder()
        self.causal_mask = getattr(sys.modules[type(inner).__module__], "create_causal_mask", None)
        self.norm: Callable[[torch.Tensor], torch.Tensor] | None = None  # made at the first call that needs it
        self.parts = (model, inner, inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head)
        self.key = (type(model), inner.norm.weight.dtype)
        self.screens = BlockMemo()  # the lm_head's screen by row count, where its product of those rows is tiled
        # whether the model's mask function returned a 4D mask (a tree's) as given: then later ones skip it (its
        # checks of the cache took ~0.05 ms a drafted step, Zen 4 EPYC)
        self.mask_as_given = False
        # whether the last call made the lm_head's screen or ran a process's first check (of the forward or of the
        # screen): its time is no step's cost (on the AVX-512-bf16 EPYC such a step of 3 tokens took 61 ms, not 10)
        self.checked = False

    @staticmethod
    def fits(model: nn.Module) -> bool:
        """Whether `model` is one of LEAN_MODELS, transformers' own classes with the parts their forwards use."""
        inner = model.get_decoder() if type(model).__name__ in LEAN_MODELS else None
        return inner is not None and all(hasattr(inner, name) for name in ("embed_tokens", "rotary_emb", "norm")) and (
            type(model).__module__ == type(inner).__module__ == LEAN_MODELS[type(model).__name__])

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor, cache, pre_norm: bool,
                 greedy: bool = False, top_k: int | None = None) -> tuple | None:
        """(float32 logits, last hidden states: before the final norm with `pre_norm`, None), or None (nothing done).
        With `greedy`, where the lm_head's screen serves (`_greedy`): (None, hidden states, each token's argmax). With
        `top_k`, where it serves (`_top_k`): (logits (B, T, C) at columns (C,) alone, hidden states, None, columns),
        the columns holding every logit at least its token's k-th largest."""
        self.checked = False
        if self.causal_mask is None or _MODELS_CHECKED.get(self.key) is False or any(
                part._forward_hooks or part._forward_pre_hooks for part in self.parts):
            return None
        inner, stored = self.inner, getattr(cache, "layers", ())
        length = stored[0].get_seq_length() if stored else 0
        x = inner.embed_tokens(ids)
        if ids.shape[1] == 1 and (mask is None or mask.dim() == 2 and bool(mask.all())):
            # one token of rows without padding sees every key: the mask SDPA skips (a mask of zeros otherwise),
            # which transformers' checks took ~0.17 ms a one-token forward to find (AVX-512-bf16 EPYC, Zen 4)
            causal = None
        elif self.mask_as_given and mask is not None and mask.dim() == 4:
            causal = mask
        else:
            try:
                causal = self.causal_mask(config=inner.config, inputs_embeds=x, attention_mask=mask, cache=cache,
                                          position_ids=positions)
            except TypeError:  # another transformers version's signature
                _MODELS_CHECKED[self.key] = False
                return None
            if mask is not None and mask.dim() == 4:
                self.mask_as_given = causal is mask
        out = self.stack(x, causal, rotary_embeddings(inner.rotary_emb, x, positions), cache)
        if out is None:
            return None
        if self.norm is None:
            self.norm = _norm(inner.norm, fused=True)
        normed = self.norm(out)
        hidden = out if pre_norm else normed
        if greedy and _MODELS_CHECKED.get(self.key):
            targets = self._greedy(normed)
            if targets is not None:
                return None, hidden, targets
        if top_k and _MODELS_CHECKED.get(self.key):
            made = self._top_k(normed, top_k)
            if made is not None:
                return made[1].view(*normed.shape[:2], -1), hidden, None, made[0]
        logits = self.model.lm_head(normed).float()
        if self.key not in _MODELS_CHECKED:
            self.checked = True
            for layer in stored:
                layer.set_length(length)  # the model's own forward writes the same slots again
            own_logits, own_hidden = base_forward(self.model, ids, mask, positions, cache, pre_norm=pre_norm)
            _MODELS_CHECKED[self.key] = torch.equal(own_logits, logits) and torch.equal(own_hidden, hidden)
            if not _MODELS_CHECKED[self.key]:
                warnings.warn(f"clover-hf's lean forward of {type(self.model).__name__} does not match this "
                              "transformers version's; it runs its own forward (slower)", stacklevel=2)
            return own_logits, own_hidden, None
        return logits, hidden, None

    def _greedy(self, normed: torch.Tensor) -> torch.Tensor | None:
        """Each token's greedy choice (B, T) from the lm_head's screen (`cpu.Screen`), the argmax of the
        logits the lm_head computes, where it computes these rows by the kernel's tiled product; else None. Its first
        choices in a process are checked against the whole logits' argmax."""
        targets = self._screened(self.key, normed, lambda screen, x: screen(x),
                                 lambda whole, targets: torch.equal(whole.argmax(-1), targets),
                                 "greedy choice", "its logits' argmax")
        return None if targets is None else targets.view(normed.shape[:2])

    def _top_k(self, normed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(columns (C,), their logits (rows, C)) of the lm_head's screen (`cpu.Screen.top_k`), every logit at
        least its row's k-th largest among them, where it computes these rows by the kernel's tiled product; else None.
        Its first columns in a process are checked against the whole logits."""

        def agrees(whole: torch.Tensor, made: tuple[torch.Tensor, torch.Tensor]) -> bool:
            kept = (whole >= whole.topk(k).values[:, -1:]).any(0).nonzero()[:, 0]
            return bool(torch.isin(kept, made[0]).all()) and torch.equal(whole[:, made[0]], made[1])

        return self._screened((*self.key, "top-k"), normed, lambda screen, x: screen.top_k(x, k), agrees,
                              "top-k columns", "its logits'")

    def _screened(self, key: tuple, normed: torch.Tensor, ask: Callable, agrees: Callable, what: str, against: str):
        """What `ask(screen, rows)` gives of the lm_head's screen for the rows of `normed`, where the lm_head computes
        them by the kernel's tiled product and its screen has not disagreed under `key`; else None. Its first answer
        in a process is checked by `agrees(whole float32 logits (rows, V), answer)`: where that fails, it warns (the
        screen's `what` differed from `against`) and the logits are computed whole from then on."""
        rows = normed.shape[0] * normed.shape[1]
        if _SCREENS_CHECKED.get(key) is False:
            return None
        screen = self.screens.get(self.model.lm_head.forward, rows, self._screen)
        made = None if screen is None else ask(screen, normed.reshape(rows, -1))
        if made is None or key in _SCREENS_CHECKED:
            return made
        self.checked = True  # the screen made (once a process) and its first answer checked
        _SCREENS_CHECKED[key] = agrees(self.model.lm_head(normed).float().reshape(rows, -1), made)
        if not _SCREENS_CHECKED[key]:
            warnings.warn(f"clover-hf's {what} from {type(self.model).__name__}'s lm_head screen differed from "
                          f"{against}; the logits are computed whole from now on (slower)", stacklevel=4)
            return None
        return made

    def _screen(self, rows: int) -> cpu.Screen | None:
        """The lm_head's screen where its product of `rows` rows computes from the kernel's tiled copy; else None."""
        tiled = getattr(self.model.lm_head.forward, "kernel_weights", None)
        return None if tiled is None or tiled(rows) is None else lm_head_screen(self.model.lm_head)


def lm_head_screen(lm_head: nn.Module) -> cpu.Screen | None:
    """The screen (`cpu.Screen`) of an nn.Linear lm_head's weight, made once and kept while its weight and bias
    are unchanged (`heads.watch`: SmolLM2's took ~25 ms to make, AVX2-only EPYC); None where the kernel does not take
    it."""
    weight, bias = getattr(lm_head, "weight", None), getattr(lm_head, "bias", None)
    if not isinstance(lm_head, nn.Linear) or weight is None or weight.requires_grad and torch.is_grad_enabled():
        return None
    kept = _SCREENS.get(lm_head)
    if kept is None or not unchanged(kept[0], [weight, bias]):
        kept = _SCREENS[lm_head] = ([watch(weight), watch(bias)], cpu.Screen.of(weight.detach(), bias))
    return kept[1]


class _RotaryTable(NamedTuple):
    """A rotary module's cos and sin (P, head_dim) of positions 0..P-1, and what they were made of."""

    inv_freq: list  # the module's inv_freq as `heads.watch` saw it
    made: tuple  # (dtype, attention scaling)
    cos: torch.Tensor
    sin: torch.Tensor


def rotary_embeddings(rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary(x, position_ids=positions)`: for a rope type whose angles are fixed (`STATIC_ROPE`), on the CPU, the rows
    of a table the module made of positions 0..P-1 (each position's cos and sin are the same elementwise ops of it,
    whatever the positions beside it: bitwise its own call's, checked over SmolLM2's first 4,096 positions at widths
    1-33 in bf16 and float32). Its call took ~0.1 ms a verify forward in situ (Zen 4 EPYC), a table's rows ~0.01."""
    inv_freq = getattr(rotary, "inv_freq", None)
    if (getattr(rotary, "rope_type", None) not in STATIC_ROPE or not isinstance(inv_freq, torch.Tensor) or not x.is_cpu
            or positions.dim() != 2 or not positions.is_cpu or not positions.numel()):
        return rotary(x, position_ids=positions)
    least, most = (int(t) for t in torch.aminmax(positions))
    if least < 0 or most >= ROTARY_TABLE_MOST:
        return rotary(x, position_ids=positions)
    made = (x.dtype, getattr(rotary, "attention_scaling", None))
    kept = _ROTARY_TABLES.get(rotary)
    if kept is None or kept.made != made or not unchanged(kept.inv_freq, [inv_freq]) or kept.cos.shape[0] <= most:
        with torch.inference_mode(False):  # kept past the call that makes it
            every = torch.arange(1 << max(most, 255).bit_length())[None]
            cos, sin = rotary(torch.empty(1, 1, x.shape[-1], dtype=x.dtype), position_ids=every)
        kept = _ROTARY_TABLES[rotary] = _RotaryTable([watch(inv_freq)], made, cos[0], sin[0])
    return kept.cos[positions], kept.sin[positions]


def model_forward(model: nn.Module) -> _ModelForward | None:
    """Within a `lean_layers` block whose layers all run in one kernel call: the model's lean verify forward
    (`_ModelForward`), where the model is one it runs; else None."""
    layers = decoder_layers(model)
    return getattr(layers[0].forward, "model_forward", None) if layers else None


def lean_forward(layer: nn.Module, pack: bool = False, masks: _PackedMasks | None = None, fused: bool = False,
                 stack: _Stack | None = None) -> Callable[..., torch.Tensor]:
    """The decoder layer's forward as one function over its parts (see the module's docstring); `pack`: in half
    precision one query token attends packed, and so do up to PACK_QUERIES over PACK_KEYS keys or more, their
    mask repeated by `masks` (one for all of a model's layers; None: the layer's own); `fused`: bf16 RMSNorms
    and the rotary embedding in one `bf16_kernel` call each (`_norm`, `cpu.rope`)."""
    masks = masks if masks is not None else _PackedMasks()
    attn, mlp = layer.self_attn, layer.mlp
    norm_in, norm_post = _norm(layer.input_layernorm, fused), _norm(layer.post_attention_layernorm, fused)
    # the projections, looked up once (each through nn.Module.__getattr__ took 0.6 us, 240 a SmolLM2 forward); their
    # `forward` is looked up at each call (`linears.linear_forms` sets it after this is made)
    q_proj, k_proj, v_proj, o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
    gate_proj, up_proj, down_proj, act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
    q_norm, k_norm = _norm(getattr(attn, "q_norm", None), fused), _norm(getattr(attn, "k_norm", None), fused)
    kernel = fused and cpu.serves(layer.input_layernorm.weight)
    rope = cpu.rope if kernel else None
    silu_mul = cpu.silu_mul if kernel and type(act_fn).__name__ in SILU else None
    post = layer.post_attention_layernorm  # the residual sum before it and the norm in one call, where it is fused
    add_norm = cpu.add_rms_norm(post.weight, float(post.variance_epsilon)) if kernel and _kernel_norm(post) else None
    module = sys.modules[type(layer).__module__]
    eager = module.eager_attention_forward
    window = LEAN_MODULES[type(layer).__module__]
    extra = window(attn) if window is not None else {}
    head_dim, layer_idx, scaling = attn.head_dim, attn.layer_idx, attn.scaling
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
    # SDPA on the CPU: several query tokens attend to shared key/value heads without transformers' copies of
    # them per query head (`repeat_kv`), bitwise the same; in half precision one query token (or a few over a
    # long text) packed (above)
    gqa = (attention is sdpa_attention_forward and layer.input_layernorm.weight.device.type == "cpu"
           and attn.num_key_value_groups > 1)
    pack = pack and layer.input_layernorm.weight.dtype != torch.float32
    # the kernel's attention stands in for SDPA's or eager attention (the same softmax(q k^T * scaling + mask) v), with
    # a mask, or for one token without (it sees every key; several would need the causal mask SDPA implies)
    attend = cpu.attention if kernel and attention in (sdpa_attention_forward, eager) else None
    # and for SDPA's causal attention without a mask (a prompt's over an empty cache), as transformers' SDPA forward
    # asks for it (its keys then are the prompt's own: queries and keys aligned)
    causal = (attend is not None and attention is sdpa_attention_forward and getattr(attn, "is_causal", True) is True
              and not extra.get("sliding_window"))
    # the whole layer in one call where each of its parts has a kernel call of its own, and all the model's layers in
    # one from the first where they all do (`stack`)
    whole = (_whole_layer(layer) if attend is not None and silu_mul is not None and add_norm is not None
             and q_norm is None and not extra.get("sliding_window") else None)
    first = stack is not None and not stack.wholes
    if stack is not None:
        stack.add(whole)

    def torchs_attention(query, key, value, attention_mask, kwargs) -> torch.Tensor:
        """(B, T, heads, head_dim): SDPA, packed or over shared key/value heads (above), else the config's function."""
        if gqa and pack and _packs(query.shape[2], key.shape[-2], attention_mask):
            return _packed_attention(query, key, value, attention_mask, scaling, masks)
        if gqa and attention_mask is not None and query.shape[2] > 1:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                  enable_gqa=True).transpose(1, 2).contiguous()
        return attention(attn, query, key, value, attention_mask, dropout=0.0, scaling=scaling, **extra, **kwargs)[0]

    def forward(hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, past_key_values=None, **kwargs) -> torch.Tensor:
        cache = cache if cache is not None else past_key_values
        if whole is not None and cache is not None and position_embeddings is not None:
            if first:
                out = stack(hidden_states, attention_mask, position_embeddings, cache)
                if out is not None:
                    return out
            elif stack is not None and hidden_states is stack.out:
                return hidden_states  # the first layer ran them all
            out = whole(hidden_states, attention_mask, position_embeddings, cache)
            if out is not None:
                return out
        kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}  # what the attention's **kwargs hold
        residual = hidden_states
        hidden_states = norm_in(hidden_states)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, head_dim)
        query = q_proj.forward(hidden_states).view(hidden_shape)
        key = k_proj.forward(hidden_states).view(hidden_shape)
        if q_norm is not None:
            query, key = q_norm(query), k_norm(key)
        value = v_proj.forward(hidden_states).view(hidden_shape).transpose(1, 2)
        turned = rope(query, key, *position_embeddings) if rope is not None else None
        query, key = turned if turned is not None else _rotary_together(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, layer_idx, kwargs=kwargs)
        out = None
        if attend is not None and (attention_mask is not None or query.shape[2] == 1):
            out = attend(query, key, value, attention_mask, scaling)
        elif causal and attention_mask is None and key.shape[-2] == query.shape[2] and kwargs.get("is_causal") in (
                None, True):
            out = attend(query, key, value, None, scaling, causal=True)
        if out is None:
            out = torchs_attention(query, key, value, attention_mask, kwargs)
        attended = o_proj.forward(out.reshape(*input_shape, -1).contiguous())
        summed = add_norm(residual, attended) if add_norm is not None else None
        if summed is None:
            hidden_states = residual + attended
            residual, hidden_states = hidden_states, norm_post(hidden_states)
        else:
            residual, hidden_states = summed
        gate, up = gate_proj.forward(hidden_states), up_proj.forward(hidden_states)
        mixed = silu_mul(gate, up) if silu_mul is not None else None
        hidden_states = down_proj.forward(act_fn(gate) * up if mixed is None else mixed)
        return residual + hidden_states

    return forward


def _matches(model: nn.Module, layer: nn.Module, forward: Callable[..., torch.Tensor]) -> bool:
    """Whether `forward` computes bitwise what the layer's own forward does, on a causal input of
    TRIAL_TOKENS random hidden states (each with a cache of its own)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    rotary_emb = getattr(decoder, "rotary_emb", None)
    if rotary_emb is None:
        return False
    param = layer.input_layernorm.weight
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(1, TRIAL_TOKENS, param.shape[-1], generator=generator).to(param)
    positions = torch.arange(TRIAL_TOKENS, device=param.device)[None]
    blocked = torch.ones(TRIAL_TOKENS, TRIAL_TOKENS, dtype=torch.bool, device=param.device).triu(1)
    mask = torch.zeros(1, 1, TRIAL_TOKENS, TRIAL_TOKENS, dtype=param.dtype, device=param.device)
    mask.masked_fill_(blocked, torch.finfo(param.dtype).min)
    with torch.no_grad():
        embeddings = rotary_emb(x, position_ids=positions)
        args = dict(attention_mask=mask, position_ids=positions, use_cache=True, position_embeddings=embeddings)
        own = type(layer).forward(layer, x, cache=new_cache(), **args)
        lean = forward(x, cache=new_cache(), **args)
    own = own[0] if isinstance(own, tuple) else own
    return own.shape == lean.shape and torch.equal(own, lean)


@contextlib.contextmanager
def lean_layers(model: nn.Module, pack: bool = False) -> Iterator[int]:
    """Within the block, the base's decoder layers that `lean_reason` passes run `lean_forward`; yields
    how many do. Enter it outside `linears.linear_forms` (its trial forward would be timed there)."""
    layers = list(decoder_layers(model) or [])
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        layers = []
    chosen, masks, stack = [], _PackedMasks(), _Stack() if pack else None
    for layer in layers:
        if lean_reason(layer) is not None:
            continue
        param = layer.input_layernorm.weight
        key = (type(layer), layer.self_attn.config._attn_implementation, param.dtype, param.device.type)
        if key not in _checked:  # checked with the modules' own norms, which it must match bitwise
            _checked[key] = _matches(model, layer, lean_forward(layer, pack, masks))
            if not _checked[key]:
                warnings.warn(f"clover-hf's lean forward of {type(layer).__name__} does not match this transformers "
                              "version's; its layers run their own forward (slower)", stacklevel=3)
        if _checked[key]:
            layer.forward = lean_forward(layer, pack, masks, fused=pack, stack=stack)
            chosen.append(layer)
    if stack is not None:
        stack.ready(layers)
        if stack.stack is not None and _ModelForward.fits(model):
            layers[0].forward.model_forward = _ModelForward(model, stack)
    try:
        yield len(chosen)
    finally:
        for layer in chosen:
            del layer.forward
