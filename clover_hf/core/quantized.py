"""Quantized bases: which weights are plain, a dense view of those that are not, and what to call them.

Clover runs a quantized base's own modules for every forward, so its layers may hold any
quantization. Only two places read a base weight directly: the heads' draft lm_head rows and the
heads' token embedding when they embed from the lm_head (and training copies the base's last layer
into the Augmenting Block). Those get a dense copy: torchao's quantized tensors dequantize
themselves, bitsandbytes' through its own functions. The budget's linear forms leave every quantized
layer to its own forward.
"""

from __future__ import annotations

import torch
from torch import nn

WORKS = ("torchao's weight-only int8 (Int8WeightOnlyConfig) or int4 (IntxWeightOnlyConfig), "
         "bitsandbytes' 8-bit or 4-bit layers, or any quantization that leaves the lm_head unquantized")


def plain(t: torch.Tensor) -> bool:
    """Whether `t` is a dense floating tensor that ATen's own kernels take (not a quantized subclass)."""
    return type(t) in (torch.Tensor, nn.Parameter) and t.is_floating_point() and t.layout == torch.strided


def _kind(t: torch.Tensor) -> str:
    cls = type(t)
    return f"{cls.__module__.split('.')[0]} {cls.__name__}"


def _dequantizer(t: torch.Tensor):
    """The function that reads `t` back as a plain tensor, or None where none is known."""
    if hasattr(t, "dequantize") and type(t).__module__.startswith("torchao"):
        return lambda: t.dequantize()
    if type(t).__module__.startswith("bitsandbytes"):
        import bitsandbytes.functional as bnb

        if getattr(t, "quant_state", None) is not None:  # Params4bit
            return lambda: bnb.dequantize_4bit(t.data, t.quant_state)
        if getattr(t, "SCB", None) is not None:  # Int8Params, once quantized
            return lambda: bnb.int8_vectorwise_dequant(t.data, t.SCB)
    return None


def readable(t: torch.Tensor) -> bool:
    """Whether `dense` can read `t`."""
    return plain(t) or _dequantizer(t) is not None


def check_readable(t: torch.Tensor) -> None:
    """Raise ValueError, naming the quantization and what works, where `t` cannot be read back."""
    if not readable(t):
        raise ValueError(
            f"Clover's heads read the base's lm_head weight, which is a {_kind(t)} ({t.dtype}) that cannot be "
            f"dequantized here. Leave the lm_head unquantized (for torchao: quantize_(model, config, "
            f"filter_fn=lambda m, name: isinstance(m, torch.nn.Linear) and 'lm_head' not in name)), or use {WORKS}."
        )


def dense(t: torch.Tensor) -> torch.Tensor:
    """`t` as a plain tensor: itself when plain, else dequantized into a new tensor of its nominal dtype."""
    if plain(t):
        return t
    check_readable(t)
    out = _dequantizer(t)()
    return out.to(t.dtype) if t.dtype.is_floating_point else out


def quantization(model: nn.Module) -> str | None:
    """What quantizes the model's weights, in words ("torchao Int8Tensor", "bitsandbytes Params4bit"), or None."""
    kinds = {_kind(m.weight) for m in model.modules()
             if isinstance(getattr(m, "weight", None), torch.Tensor) and not plain(m.weight)}
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    if config is not None and not kinds:
        method = config.get("quant_method") if isinstance(config, dict) else getattr(config, "quant_method", None)
        kinds.add(str(getattr(method, "value", method)))
    return ", ".join(sorted(kinds)) or None


TORCHAO_CONFIGS = ("int8", "int4")


def quantize_base(model: nn.Module, kind: str) -> None:
    """Quantize the model's linear layers in place with torchao, weight-only: "int8" (Int8WeightOnlyConfig)
    or "int4" (IntxWeightOnlyConfig, int4 in groups of 32: the int4 form torchao computes on a CPU)."""
    if kind not in TORCHAO_CONFIGS:
        raise ValueError(f"unknown quantization {kind!r}: choose one of {', '.join(TORCHAO_CONFIGS)}")
    try:
        from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup
    except ImportError as e:
        raise ImportError(f"quantizing the base needs torchao: pip install torchao ({e})") from e
    config = Int8WeightOnlyConfig() if kind == "int8" else IntxWeightOnlyConfig(weight_dtype=torch.int4,
                                                                                granularity=PerGroup(32))
    quantize_(model, config)


def nbytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds: for a quantized tensor subclass, those of the tensors inside it."""
    if not plain(t) and hasattr(t, "__tensor_flatten__"):
        return sum(nbytes(getattr(t, name)) for name in t.__tensor_flatten__()[0] if getattr(t, name) is not None)
    return t.numel() * t.element_size()
