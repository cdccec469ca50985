"""The dtype a base runs in by default on a device: where this package's kernel runs, bf16 on any x86 CPU."""

from __future__ import annotations

import torch

from clover_hf.core import hardware

from . import kernel


def default_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 on accelerators and on CPUs that compute it natively (AVX-512-bf16, AMX); on other CPUs bf16 where
    clover_hf's compiled kernel runs (built here first if need be: it reads the bf16 bytes alone, where float32
    products read twice as many) or where torch's bf16 products were measured faster than float32 ones
    (`hardware.bf16_reads_faster_cpu`), else float32."""
    device = torch.device(device)
    if device.type != "cpu" or hardware.native_bf16_cpu() or kernel.available():
        return torch.bfloat16
    return torch.bfloat16 if hardware.bf16_reads_faster_cpu() else torch.float32
