"""The base's forward over a tree: the attention mask of new tokens over a cache, and the forward itself, returning
the logits and the hidden states the heads read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from .cache import cache_keyword
from .parts import layer_outputs, norm_inputs


def additive_mask(
    past_positions: torch.Tensor,  # ([B,] P) position of each cached key; -1 for padding
    new_positions: torch.Tensor,  # ([B,] N) position of each new token
    new_allowed: torch.Tensor,  # ([B,] N, N) bool: new token i may attend to new token j
    dtype: torch.dtype,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Additive 4D mask (B, 1, N, P + N) in the model's dtype: 0 = attend, finfo.min = blocked.

    Without a batch dimension in the inputs, B is 1.
    """
    if new_positions.dim() == 1:
        past_positions, new_positions, new_allowed = past_positions[None], new_positions[None], new_allowed[None]
    allowed_past = (past_positions >= 0)[:, None, :].expand(-1, new_positions.shape[1], -1)
    if sliding_window is not None:
        allowed_past = allowed_past & (new_positions[:, :, None] - past_positions[:, None, :] < sliding_window)
        new_allowed = new_allowed & (new_positions[:, :, None] - new_positions[:, None, :] < sliding_window)
    allowed = torch.cat([allowed_past, new_allowed], dim=-1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None]


@dataclass(frozen=True)
class MaskLayout:
    """Which attention masks a model's forward expects (read from its config)."""

    mapping: bool  # the model accepts {"full_attention": ..., "sliding_attention": ...}
    sliding_window: int | None  # window of its sliding layers (or of all layers when not mapping)

    @classmethod
    def for_config(cls, config: Any) -> "MaskLayout":
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None) or []
        if "sliding_attention" in layer_types and "full_attention" in layer_types:
            return cls(mapping=True, sliding_window=window)
        if layer_types and "sliding_attention" not in layer_types:
            return cls(mapping=False, sliding_window=None)
        return cls(mapping=False, sliding_window=window)

    def build(
        self, past_positions: torch.Tensor, new_positions: torch.Tensor, new_allowed: torch.Tensor, dtype: torch.dtype,
        slots: int | None = None,
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """The `attention_mask` argument for a forward of new tokens over a cache of past keys; `slots`: the
        keys a static cache returns (all its slots), of which those past the new tokens' are blocked."""
        if self.mapping:
            return {
                "full_attention": _blocked_after(additive_mask(past_positions, new_positions, new_allowed, dtype), slots),
                "sliding_attention": _blocked_after(additive_mask(
                    past_positions, new_positions, new_allowed, dtype, self.sliding_window
                ), slots),
            }
        return _blocked_after(additive_mask(past_positions, new_positions, new_allowed, dtype, self.sliding_window), slots)


def _blocked_after(mask: torch.Tensor, slots: int | None) -> torch.Tensor:
    """`mask` (B, 1, N, K) widened to `slots` keys, the added ones blocked."""
    if slots is None or slots == mask.shape[-1]:
        return mask
    return torch.nn.functional.pad(mask, (0, slots - mask.shape[-1]), value=torch.finfo(mask.dtype).min)


def base_forward(model: PreTrainedModel, ids, mask, positions, cache, logits_to_keep: int = 0, pre_norm: bool = False,
                 keyword: str | None = None, taps: tuple[int, ...] = ()):
    """Logits (B, n, V) in fp32 and the hidden states the heads read (B, T, H) of one base forward: the last ones
    (with `pre_norm`, those before the final norm), after the outputs of the decoder layers `taps` where given
    (B, T, (len(taps) + 1) H: `fused`). `keyword`: the one the forward takes its cache by (`cache_keyword`),
    resolved by the caller where this runs compiled."""
    with layer_outputs(model, taps) as tapped:
        logits, last = _last_hidden_forward(model, ids, mask, positions, cache, logits_to_keep, pre_norm, keyword)
    return logits, fused(tapped, last)


def fused(tapped: list[torch.Tensor], last: torch.Tensor) -> torch.Tensor:
    """The heads' input from the tapped layers' outputs and the last hidden states: those alone without taps."""
    return torch.cat([*tapped, last], -1) if tapped else last


def _last_hidden_forward(model: PreTrainedModel, ids, mask, positions, cache, logits_to_keep: int, pre_norm: bool,
                         keyword: str | None):
    """`base_forward` without taps.

    The hidden states are read off the decoder's output with a hook: asking for `output_hidden_states`
    collects every layer's, a cost a one-token step on a CPU shows. A model that is its own
    decoder is asked for them."""
    kwargs = {"logits_to_keep": logits_to_keep} if logits_to_keep and model._supports_logits_to_keep() else {}
    kwargs[keyword or cache_keyword(type(model))] = cache
    if pre_norm:
        with norm_inputs(model) as captured:
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, return_dict=True,
                        **kwargs)
        return out.logits.float(), captured[-1]
    decoder = model.get_decoder()
    captured = []
    hook = None if decoder is model else decoder.register_forward_hook(lambda m, args, out: captured.append(out))
    try:
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
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
    return out.logits.float(), last_hidden(last)


def last_hidden(decoder_output) -> torch.Tensor:
    """The last hidden states in what a base's decoder returns (a tuple or a model output)."""
    return decoder_output[0] if isinstance(decoder_output, tuple) else decoder_output.last_hidden_state


# transformers' warpers that transform each row of scores on its own, whatever the prefix
