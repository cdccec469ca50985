"""Decoder layers of the Llama pattern run without their modules' per-call machinery.

Most of a one-token forward of a small model is its decoder layers, and calling each layer's parts through
`nn.Module.__call__`, with transformers' keyword plumbing and decorators, is a sizeable share of those. Within
`lean_layers`, a decoder layer of a class listed in `LEAN_MODULES` runs one function instead (`LeanForward`): the same
operations on the same parts (the norms', projections' and activation's own `forward`s, Llama's rotary embedding of
queries and keys in one pass, the cache's `update`, the attention function its config names), so its output is
bitwise the layer's own.

One exception, asked for with `pack` (where a call multiplies in Clover's linear forms, whose products round
differently from plain `generate`'s anyway): on the CPU in bf16 or float16, SDPA attends one query token to shared
key/value heads (`enable_gqa`, what transformers asks for where there is no mask) several times slower than with the
query heads packed as rows of their key/value head (transformers' `pack_gqa`). A verify forward's few masked query
tokens gain only where the text is long (over a short text, or from a dozen tokens up, packing measured no faster):
so up to PACK_QUERIES tokens attend packed over PACK_KEYS keys or more. Packed, attention rounds the same but for rare
last bits, and bf16 decoding can drift from plain `generate`'s within 64 tokens. With `pack` in bf16, the layer's
RMSNorms and its rotary embedding also run as one call each of `bf16_kernel` where it is built (a norm rounding as
the module does but for rare last bits; the rotary embedding bitwise torch's), and so does attention
(`cpu.attention`, float32 scores and sums like SDPA's, in another order). Where, besides, every product is in the
kernel's tiled copies and the cache grows in place, the whole layer is one call of those same functions
(`lean_stack._WholeLayer`, bitwise them one by one); where all of a model's layers run so, the first runs them all in
one call (`lean_stack._Stack`), and a verify forward of the model runs without its modules' forwards
(`lean_model._ModelForward`, `model_forward`). docs/cpu-measurements.md keeps what each of these gained.

Layers of other classes, with hooks or a replaced `forward` (accelerate's offloading), or in training keep
their own forward; so does a class whose first lean forward in a process does not match its own on a
trial input (a transformers version that changed the layer).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from clover_hf import cpu

from .architectures import LEAN_MODULES, RMS_NORMS
from .cache import new_cache
from .lean_model import VERDICTS, _ModelForward
from .lean_stack import _Stack, _WholeLayer
from .parts import apply_rope, decoder_layers

# activations that compute F.silu (transformers' ACT2FN["silu"], torch's module): the MLP's act_fn(gate) * up in bf16
# is `cpu.silu_mul`'s one call
SILU = ("SiLUActivation", "SiLU")
PACK_QUERIES, PACK_KEYS = 8, 1024  # a few query tokens attend packed (`pack`): this many at most, over this many keys
TRIAL_TOKENS = 3  # tokens of the input a class's lean forward is checked on, once per process (`Verdicts.layers`)


def _parts(layer: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
    """The modules whose forwards the lean forward stands in for or calls directly, and the projections
    (called through their `forward` attribute, whatever computes it: `cpu.linear_forms`, accelerate's
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
    every layer the same mask): repeating it in every layer cost a share of a forward over a long text."""

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


def _whole_layer(layer: nn.Module) -> _WholeLayer | None:
    """The layer as one kernel call, or None where its norms differ in epsilon."""
    if float(layer.input_layernorm.variance_epsilon) != float(layer.post_attention_layernorm.variance_epsilon):
        return None
    return _WholeLayer(layer)


class LeanForward:
    """A decoder layer's forward as one function over its parts (see the module's docstring), bound as the layer's
    `forward` within `lean_layers`. `pack`: in half precision one query token attends packed, and so do up to
    PACK_QUERIES over PACK_KEYS keys or more, their mask repeated by `masks` (one for all of a model's layers; None:
    the layer's own); `fused`: bf16 RMSNorms and the rotary embedding in one `bf16_kernel` call each (`_norm`,
    `cpu.rope`); `stack`: the model's layers in one kernel call from the first's forward, where each runs whole.
    `model_forward`: on the first layer's forward, the model's lean verify forward where `lean_layers` made one."""

    def __init__(self, layer: nn.Module, pack: bool = False, masks: _PackedMasks | None = None, fused: bool = False,
                 stack: _Stack | None = None) -> None:
        self.masks = masks if masks is not None else _PackedMasks()
        attn, mlp = layer.self_attn, layer.mlp
        self.norm_in, self.norm_post = _norm(layer.input_layernorm, fused), _norm(layer.post_attention_layernorm, fused)
        # the projections, looked up once (a lookup through nn.Module.__getattr__ is slow, and a forward makes
        # hundreds); their `forward` is looked up at each call (`cpu.linear_forms` binds it after this is made)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.gate_proj, self.up_proj, self.down_proj = mlp.gate_proj, mlp.up_proj, mlp.down_proj
        self.act_fn = mlp.act_fn
        self.q_norm = _norm(getattr(attn, "q_norm", None), fused)
        self.k_norm = _norm(getattr(attn, "k_norm", None), fused)
        self.head_dim, self.layer_idx, self.scaling = attn.head_dim, attn.layer_idx, attn.scaling
        self._kernel_calls(layer, fused)
        self._attention_calls(layer, pack)
        # the whole layer in one call where each of its parts has a kernel call of its own, and all the model's layers
        # in one from the first where they all do (`stack`)
        self.whole = (_whole_layer(layer) if self.attend is not None and self.silu_mul is not None
                      and self.add_norm is not None and self.q_norm is None and not self.extra.get("sliding_window")
                      else None)
        self.stack, self.first = stack, stack is not None and not stack.wholes
        if stack is not None:
            stack.add(self.whole)
        self.model_forward: _ModelForward | None = None

    def _kernel_calls(self, layer: nn.Module, fused: bool) -> None:
        """The parts `bf16_kernel` computes in one call each, where `fused` and it serves the layer's weights: the
        rotary embedding, the MLP's silu(gate) * up, and the residual sum with the norm after it; else None."""
        kernel = fused and cpu.serves(layer.input_layernorm.weight)
        self.rope = cpu.rope if kernel else None
        self.silu_mul = cpu.silu_mul if kernel and type(self.act_fn).__name__ in SILU else None
        post = layer.post_attention_layernorm
        self.add_norm = (cpu.add_rms_norm(post.weight, float(post.variance_epsilon)) if kernel and _kernel_norm(post)
                         else None)
        self.kernel = kernel

    def _attention_calls(self, layer: nn.Module, pack: bool) -> None:
        """The attention function the config names, and where SDPA's or the kernel's stand in for it."""
        attn = layer.self_attn
        eager = sys.modules[type(layer).__module__].eager_attention_forward
        window = LEAN_MODULES[type(layer).__module__]
        self.attn, self.extra = attn, window(attn) if window is not None else {}
        self.attention = attention = ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)
        # SDPA on the CPU: several query tokens attend to shared key/value heads without transformers' copies of
        # them per query head (`repeat_kv`), bitwise the same; in half precision one query token (or a few over a
        # long text) packed (above)
        self.gqa = (attention is sdpa_attention_forward and layer.input_layernorm.weight.device.type == "cpu"
                    and attn.num_key_value_groups > 1)
        self.pack = pack and layer.input_layernorm.weight.dtype != torch.float32
        # the kernel's attention stands in for SDPA's or eager attention (the same softmax(q k^T * scaling + mask) v),
        # with a mask, or for one token without (it sees every key; several would need the causal mask SDPA implies)
        self.attend = cpu.attention if self.kernel and attention in (sdpa_attention_forward, eager) else None
        # and for SDPA's causal attention without a mask (a prompt's over an empty cache), as transformers' SDPA
        # forward asks for it (its keys then are the prompt's own: queries and keys aligned)
        self.causal = (self.attend is not None and attention is sdpa_attention_forward
                       and getattr(attn, "is_causal", True) is True and not self.extra.get("sliding_window"))

    def __call__(self, hidden_states: torch.Tensor, attention_mask=None, position_ids=None, cache=None,
                 use_cache=False, position_embeddings=None, past_key_values=None, **kwargs) -> torch.Tensor:
        cache = cache if cache is not None else past_key_values
        if self.whole is not None and cache is not None and position_embeddings is not None:
            out = self._whole(hidden_states, attention_mask, position_embeddings, cache)
            if out is not None:
                return out
        kwargs = {"position_ids": position_ids, "use_cache": use_cache, **kwargs}  # what the attention's **kwargs hold
        residual, hidden_states = self._self_attention(hidden_states, attention_mask, position_embeddings, cache,
                                                       kwargs)
        gate, up = self.gate_proj.forward(hidden_states), self.up_proj.forward(hidden_states)
        mixed = self.silu_mul(gate, up) if self.silu_mul is not None else None
        hidden_states = self.down_proj.forward(self.act_fn(gate) * up if mixed is None else mixed)
        return residual + hidden_states

    def _whole(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None, position_embeddings: tuple,
               cache) -> torch.Tensor | None:
        """The layer's output in one kernel call (the first layer's: all the model's layers in one, `stack`; a later
        layer's, where the first ran them all: its input as it is), or None (nothing done)."""
        stack = self.stack
        if self.first:
            out = stack(hidden_states, attention_mask, position_embeddings, cache)
            if out is not None:
                return out
        elif stack is not None and (handed := stack.hand_on(hidden_states, self.layer_idx)) is not None:
            return handed  # the first layer ran them all
        return self.whole(hidden_states, attention_mask, position_embeddings, cache)

    def _self_attention(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                        position_embeddings: tuple, cache, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual after self-attention, its post-attention norm): the layer's first half."""
        residual = hidden_states
        hidden_states = self.norm_in(hidden_states)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj.forward(hidden_states).view(hidden_shape)
        key = self.k_proj.forward(hidden_states).view(hidden_shape)
        if self.q_norm is not None:
            query, key = self.q_norm(query), self.k_norm(key)
        value = self.v_proj.forward(hidden_states).view(hidden_shape).transpose(1, 2)
        turned = self.rope(query, key, *position_embeddings) if self.rope is not None else None
        query, key = turned if turned is not None else _rotary_together(query, key, *position_embeddings)
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        out = None
        if self.attend is not None and (attention_mask is not None or query.shape[2] == 1):
            out = self.attend(query, key, value, attention_mask, self.scaling)
        elif self.causal and attention_mask is None and key.shape[-2] == query.shape[2] and kwargs.get(
                "is_causal") in (None, True):
            out = self.attend(query, key, value, None, self.scaling, causal=True)
        if out is None:
            out = self._torchs_attention(query, key, value, attention_mask, kwargs)
        attended = self.o_proj.forward(out.reshape(*input_shape, -1).contiguous())
        summed = self.add_norm(residual, attended) if self.add_norm is not None else None
        if summed is None:
            hidden_states = residual + attended
            return hidden_states, self.norm_post(hidden_states)
        return summed

    def _torchs_attention(self, query, key, value, attention_mask, kwargs) -> torch.Tensor:
        """(B, T, heads, head_dim): SDPA, packed or over shared key/value heads (above), else the config's function."""
        if self.gqa and self.pack and _packs(query.shape[2], key.shape[-2], attention_mask):
            return _packed_attention(query, key, value, attention_mask, self.scaling, self.masks)
        if self.gqa and attention_mask is not None and query.shape[2] > 1:
            return F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=self.scaling,
                                                  enable_gqa=True).transpose(1, 2).contiguous()
        return self.attention(self.attn, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling,
                              **self.extra, **kwargs)[0]


def lean_forward(layer: nn.Module, pack: bool = False, masks: _PackedMasks | None = None, fused: bool = False,
                 stack: _Stack | None = None) -> LeanForward:
    """The decoder layer's lean forward (`LeanForward`)."""
    return LeanForward(layer, pack, masks, fused, stack)


def model_forward(model: nn.Module) -> _ModelForward | None:
    """Within a `lean_layers` block whose layers all run in one kernel call: the model's lean verify forward
    (`lean_model._ModelForward`, kept by its first layer's `LeanForward`), where the model is one it runs; else None."""
    layers = decoder_layers(model)
    lean = layers[0].forward if layers else None
    return lean.model_forward if isinstance(lean, LeanForward) else None


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


def _lean_matches(model: nn.Module, layer: nn.Module, pack: bool, masks: _PackedMasks) -> bool:
    """Whether the layer's class (with its attention, dtype and device type) computes bitwise its own output in a lean
    forward: checked once a process, with the modules' own norms (which it must match bitwise), and kept in
    `VERDICTS`; where it does not, with a warning (once)."""
    param = layer.input_layernorm.weight
    key = (type(layer), layer.self_attn.config._attn_implementation, param.dtype, param.device.type)
    checked = VERDICTS.layers
    if key not in checked:
        checked[key] = _matches(model, layer, lean_forward(layer, pack, masks))
        if not checked[key]:
            warnings.warn(f"clover-hf's lean forward of {type(layer).__name__} does not match this transformers "
                          "version's; its layers run their own forward (slower)", stacklevel=4)
    return checked[key]


@contextlib.contextmanager
def lean_layers(model: nn.Module, pack: bool = False, taps: tuple[int, ...] = ()) -> Iterator[int]:
    """Within the block, the base's decoder layers that `lean_reason` passes run `lean_forward`; yields
    how many do. Enter it outside `cpu.linear_forms` (its trial forward would be timed there). `taps`: the layers
    whose outputs the heads read (`CloverConfig.feature_layers`), which the layers all run in one call then keep."""
    layers = list(decoder_layers(model) or [])
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        layers = []
    chosen, masks, stack = [], _PackedMasks(), _Stack(taps) if pack else None
    for layer in layers:
        if lean_reason(layer) is None and _lean_matches(model, layer, pack, masks):
            layer.forward = lean_forward(layer, pack, masks, fused=pack, stack=stack)
            chosen.append(layer)
    if stack is not None:
        stack.ready(layers)
        if stack.stack is not None and _ModelForward.fits(model):
            first = layers[0].forward  # a `LeanForward`: every layer runs whole
            final_norm = functools.partial(_norm, model.get_decoder().norm, fused=True)
            first.model_forward = _ModelForward(model, stack, final_norm)
    try:
        yield len(chosen)
    finally:
        for layer in chosen:
            del layer.forward
