"""What a verify step's cost depends on: the key a draft budget keeps a machine's costs (and the kernel's forms)
under."""

from __future__ import annotations

import hashlib

import torch
from transformers import PreTrainedModel

from clover_hf import cpu
from clover_hf.core.hardware import cpu_capability, cpu_name
from clover_hf.core.quantized import quantization


def cost_key(model: PreTrainedModel, device: torch.device) -> str:
    """What a verify step's cost depends on: the base (its name, architecture and quantization), dtype,
    device, threads, CPU capability, torch version, and for bf16 on the CPU which kernel build computes (a
    changed kernel learns its costs and forms again)."""
    config = model.config.to_json_string(use_diff=False)
    arch = hashlib.sha1(config.encode()).hexdigest()[:12]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return "|".join([getattr(model.config, "_name_or_path", "") or "?", arch, str(model.dtype).removeprefix("torch."),
                     where, f"{torch.get_num_threads()} threads", cpu_name(), cpu_capability(),
                     f"torch {torch.__version__}"] + ([quantized] if (quantized := quantization(model)) else [])
                    + ([f"bf16 kernel {cpu.build_id()}"] if model.dtype == torch.bfloat16
                       and device.type == "cpu" and cpu.available() else []))


def machine_key(model: PreTrainedModel, weight_copies: bool | int) -> str:
    """The key of `model`'s costs on this machine, and whether weight copies are allowed (the forms depend on it)."""
    return f"{cost_key(model, model.device)}|{'weight copies' if weight_copies is not False else 'no weight copies'}"
