"""The heads' RMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from clover_hf import cpu


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled() and x.dtype == self.weight.dtype and cpu.serves(x):
            return cpu.norm(x, self.weight, self.eps)  # one call for the six ops below (drafting in bf16)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
