"""The dtype a base runs in by default on a device: where this package's kernel runs, bf16 on any x86 CPU."""

from __future__ import annotations

import torch

from clover_hf.core.hardware import bf16_reads_faster_cpu, native_bf16_cpu

from .kernel import available


def default_dtype(device: torch.device | str = "cpu") -> torch.dtype:
    """bf16 on accelerators and on CPUs that compute it natively (AVX-512-bf16, AMX); on other CPUs bf16 where
    clover_hf's compiled kernel runs (built here first if need be: it reads the bf16 bytes alone, and one-token
    steps ran 53 against 24 tokens/s in float32 on the AVX2-only EPYC) or where torch's bf16 products were
    measured faster than fp32 ones (`bf16_reads_faster_cpu`), else fp32."""
    device = torch.device(device)
    if device.type != "cpu" or native_bf16_cpu() or available():
        return torch.bfloat16
    return torch.bfloat16 if bf16_reads_faster_cpu() else torch.float32
