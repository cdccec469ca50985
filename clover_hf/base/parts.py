"""Where a base model keeps the parts clover-hf reads: its decoder stack, decoder layers and final norm
(named differently across architectures), and the final norm's input, which `output_hidden_states` does
not return."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def _decoder(base_model: nn.Module) -> nn.Module | None:
    """The base's decoder stack under its LM head (`model` in Llama-style bases, `transformer` in GPT-2)."""
    return getattr(base_model, "model", None) or getattr(base_model, "transformer", None)


def final_norm(base_model: nn.Module) -> nn.Module | None:
    """The base's norm after its last decoder layer (`norm` in Llama-style bases, `ln_f` in GPT-2's)."""
    decoder = _decoder(base_model)
    return next((m for m in (getattr(decoder, n, None) for n in ("norm", "ln_f", "final_layer_norm")) if m is not None),
                None)


@contextmanager
def norm_inputs(base_model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collects, for every forward inside, the input of the base's final norm: its last hidden states before
    that norm (`head_input="pre_norm"`), which `output_hidden_states` does not return."""
    norm = final_norm(base_model)
    if norm is None:
        raise ValueError(f"head_input='pre_norm' reads the input of the base's final norm, and {type(base_model).__name__} "
                         "has none that clover-hf finds (norm, ln_f or final_layer_norm under its decoder)")
    captured: list[torch.Tensor] = []
    handle = norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        yield captured
    finally:
        handle.remove()


def rms_final_norm(base_model: nn.Module) -> nn.Module | None:
    """The base's final norm where it is an RMSNorm (the heads' kind of norm)."""
    norm = final_norm(base_model)
    return norm if norm is not None and "RMSNorm" in type(norm).__name__ else None


def decoder_layers(base_model: nn.Module) -> nn.ModuleList | None:
    """The base's decoder layers (`layers` in Llama-style bases, `h` in GPT-2), or None."""
    inner = _decoder(base_model)
    for name in ("layers", "h", "blocks"):
        layers = getattr(inner, name, None)
        if isinstance(layers, nn.ModuleList) and len(layers):
            return layers
    return None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form). x: (B, nh, T, hd); cos, sin from `rope_tables`."""
    hd = x.shape[-1]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin
