"""The parts of a base model clover-hf reads (its decoder layers and final norm, where its `Architecture` keeps them),
and the final norm's input, which `output_hidden_states` does not return."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .architectures import of_model


def final_norm(base_model: nn.Module) -> nn.Module | None:
    """The base's norm after its last decoder layer, where its architecture keeps it."""
    return of_model(base_model).final_norm_of(base_model)


@contextmanager
def norm_inputs(base_model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collects, for every forward inside, the input of the base's final norm: its last hidden states before
    that norm (`head_input="pre_norm"`), which `output_hidden_states` does not return."""
    norm = final_norm(base_model)
    if norm is None:
        raise ValueError(f"head_input='pre_norm' reads the input of the base's final norm, and {type(base_model).__name__} "
                         "has none that clover-hf finds (base/architectures.py says where each family keeps it)")
    captured: list[torch.Tensor] = []
    handle = norm.register_forward_pre_hook(lambda module, args: captured.append(args[0]))
    try:
        yield captured
    finally:
        handle.remove()


@contextmanager
def layer_outputs(base_model: nn.Module, taps: tuple[int, ...]) -> Iterator[list[torch.Tensor]]:
    """Collects, for one forward inside, the outputs of the base's decoder layers `taps` (0-based; negative from the
    end), in the order given: the low and middle layers' features fused heads read (`CloverConfig.feature_layers`)."""
    if not taps:
        yield []
        return
    layers = decoder_layers(base_model)
    if layers is None:
        raise ValueError(f"heads with feature_layers read the base's decoder layers, and {type(base_model).__name__} "
                         "has none that clover-hf finds (base/architectures.py says where each family keeps them)")
    captured: list[torch.Tensor | None] = [None] * len(taps)
    handles = [layers[i].register_forward_hook(functools.partial(grab_layer_output, captured, at))
               for at, i in enumerate(taps)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


def grab_layer_output(captured: list, at: int, module: nn.Module, args, out) -> None:
    """A forward hook's body: the decoder layer's output (its hidden states) into `captured[at]`."""
    captured[at] = out[0] if isinstance(out, tuple) else out


def rms_final_norm(base_model: nn.Module) -> nn.Module | None:
    """The base's final norm where it is an RMSNorm that scales by its weight (the heads' kind of norm)."""
    norm = final_norm(base_model)
    if norm is None or of_model(base_model).norm_plus_one or "RMSNorm" not in type(norm).__name__:
        return None
    return norm


def decoder_layers(base_model: nn.Module) -> nn.ModuleList | None:
    """The base's decoder layers, where its architecture keeps them, or None."""
    return of_model(base_model).layers_of(base_model)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (rotate-half form). x: (B, nh, T, hd); cos, sin from `rope_tables`."""
    hd = x.shape[-1]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin
