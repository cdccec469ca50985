"""Medusa-1's draft heads, the baseline Clover is measured against."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .base import DraftHeads
from .config import CloverConfig
from .lm_head import DraftLMHead

if TYPE_CHECKING:
    from .tree import TreeBuffers


class ResBlock(nn.Module):
    """Medusa's residual block x + SiLU(Wx + b). As in Medusa, W starts at zero and b at PyTorch's
    default, so a fresh block is close to the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(DraftHeads):
    """Medusa-1 heads (Cai et al., 2024), the baseline Clover is measured against.

    Head i maps the base's last hidden state at t through `medusa_num_layers` residual blocks to the token at t+2+i,
    independently of the tokens drafted before it: every node of a depth draws from the same top-k.
    By default they share the base's lm_head and Clover's draft vocabulary, so that a comparison
    with Clover trained by the same recipe isolates the heads' architecture. With
    `config.own_lm_heads` each head projects to the draft vocabulary with weights of its own,
    initialised from the base's lm_head rows, as in Medusa-1 proper.
    """

    def __init__(self, config: CloverConfig) -> None:
        super().__init__(config)
        self.heads = nn.ModuleList(
            nn.Sequential(*(ResBlock(config.hidden_size) for _ in range(config.medusa_num_layers)))
            for _ in range(config.num_heads)
        )
        if config.own_lm_heads:
            rows = config.draft_vocab_size or config.vocab_size
            self.lm_heads = nn.ModuleList(nn.Linear(config.hidden_size, rows, bias=False)
                                          for _ in range(config.num_heads))

    def upgrade_state_dict(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Heads saved when each had one residual block kept it at `heads.{i}.linear`: now `heads.{i}.0.linear`."""
        old = re.compile(r"heads\.(\d+)\.linear\.(weight|bias)")
        return {(f"heads.{m[1]}.0.linear.{m[2]}" if (m := old.fullmatch(k)) else k): v for k, v in state.items()}

    @torch.no_grad()
    def init_projections(self, lm_head: nn.Module) -> None:
        """Each head's own projection starts as the base's lm_head rows of the draft vocabulary."""
        if not self.config.own_lm_heads:
            return
        rows = self.draft_lm_head(lm_head)
        if rows.bias is not None:
            raise ValueError("own_lm_heads starts from the base's lm_head, which has a bias here; this is not supported")
        for proj in self.lm_heads:
            proj.weight.copy_(rows.weight)

    def head_logits(self, i: int, hidden: torch.Tensor, lm_head: DraftLMHead) -> torch.Tensor:
        if self.config.own_lm_heads:
            return self.lm_heads[i](hidden.to(self.lm_heads[i].weight.dtype))
        return lm_head(hidden)

    def features(
        self,
        hidden: torch.Tensor,
        next_embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        """Medusa reads the base's hidden states as they are and keeps no cache."""
        return hidden, None

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Teacher-forced pass, shaped as `CloverHeads.forward`: head i at t = 0..T-2-i predicts x_{t+2+i}.
        Each position is drafted from on its own, so packed examples need no mask."""
        T = hidden.shape[1]
        return [head(hidden[:, : T - 1 - i]) for i, head in enumerate(self.heads) if T - 1 - i > 0]

    @torch.no_grad()
    def draft(
        self,
        feature: torch.Tensor,  # (H,)
        root: torch.Tensor,  # () unused: Medusa's heads do not see the tokens before their own
        tree: "TreeBuffers",
        embed: nn.Module,
        lm_head: DraftLMHead,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft the tree's tokens (num_nodes - 1,): the node of rank r at depth d is head d's r-th
        token; and each token's probability under its head (num_nodes - 1,)."""
        depth = len(tree.levels)
        states = [head(feature) for head in self.heads[:depth]]
        if self.config.own_lm_heads:
            probs = torch.stack([self.head_logits(d, h, lm_head) for d, h in enumerate(states)]).float().softmax(-1)
        else:
            probs = lm_head(torch.stack(states)).float().softmax(-1)  # (D, V'), one product for all heads
        drafted, chances = [], []
        for d, level in enumerate(tree.levels):
            top = probs[d].topk(level.k)
            ids = top.indices if self.draft_token_ids is None else self.draft_token_ids[top.indices]
            drafted.append(ids[level.child_rank])
            chances.append(top.values[level.child_rank])
        return torch.cat(drafted), torch.cat(chances)
