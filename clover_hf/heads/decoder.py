"""The Attention Decoder (the heads' input decoder and their Regressive Connection) and the output heads that turn
a state into the features the base's lm_head reads."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from clover_hf import cpu

from .config import CloverConfig
from .norm import RMSNorm


class AttentionDecoder(nn.Module):
    """Merges a state with a token embedding through a per-head cosine gate: h + v(e) * cos(q(h), k(e))."""

    shared_input = False  # q reads the state, k and v the embedding: no stacked product (`linears.shared_input_groups`)

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.n_heads = config.num_attention_heads
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.q_proj = nn.Linear(h, h, bias=config.decoder_bias)
        self.k_proj = nn.Linear(h, h, bias=config.decoder_bias)
        self.v_proj = nn.Linear(h, h, bias=config.decoder_bias)
        nn.init.zeros_(self.v_proj.weight)  # starts as the identity on h
        if config.decoder_bias:
            nn.init.zeros_(self.v_proj.bias)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(self.norm(h)), self.k_proj(e), self.v_proj(e)
        if not torch.is_grad_enabled() and h.shape == q.shape == k.shape == v.shape and cpu.serves(h) and (
                q.dtype == k.dtype == v.dtype == h.dtype):
            return cpu.cosine_gate(h, q, k, v, self.n_heads)  # drafting in bf16: one call for the lines below
        shape = (*h.shape[:-1], self.n_heads, -1)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        gate = F.cosine_similarity(q, k, dim=-1).unsqueeze(-1)  # (..., n_heads, 1)
        return h + (v * gate).flatten(-2)


class OutputHead(nn.Module):
    """Head i: normed features norm(s + SiLU(FC([s; e]))) that the base's lm_head turns into logits."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        nn.init.zeros_(self.fc.weight)
        nn.init.zeros_(self.fc.bias)

    def forward(self, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.norm(s + F.silu(self.fc(torch.cat([s, e], dim=-1))))


def _near_identity(weight: torch.Tensor, spread: float = 0.01) -> None:
    """Clover-2's start for a square or [I | ...] weight: U(0, spread) plus the identity on its first columns."""
    nn.init.uniform_(weight, 0.0, spread)
    weight[:, : weight.shape[0]] += torch.eye(weight.shape[0], dtype=weight.dtype, device=weight.device)


class LinearOutputHeads(nn.Module):
    """Clover-2's output heads (its public code): norm(W0 s) for the first head, norm(W [s; e]) with one W
    shared by the others, one norm for all; both W start near the identity on s."""

    def __init__(self, config: CloverConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.first = nn.Linear(h, h)
        self.later = nn.Linear(2 * h, h)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        with torch.no_grad():
            for fc in (self.first, self.later):
                _near_identity(fc.weight)
                nn.init.zeros_(fc.bias)

    def forward(self, i: int, s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return self.norm(self.first(s) if i == 0 else self.later(torch.cat([s, e], dim=-1)))
