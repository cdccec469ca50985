"""What the base computed at every position of each row's text, kept as decoding goes: the states the heads read and
the base's likeliest next tokens, which is what training the heads needs. Self-distillation by Clover writes these
as it generates (`clover_hf.training.distill`), with no second forward of the generated text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .rows import Row


@dataclass
class RowFeatures:
    """One row's positions so far: the heads' input states (T, H') and the base's `top_k` likeliest next tokens and
    their probabilities (T, k), zero where the base gave no logits (the prompt's positions but its last)."""

    states: list[torch.Tensor] = field(default_factory=list)
    topk_ids: list[torch.Tensor] = field(default_factory=list)
    topk_probs: list[torch.Tensor] = field(default_factory=list)

    def add(self, states: torch.Tensor, logits: torch.Tensor | None, top_k: int) -> None:
        """States (n, H') of n positions, with the logits (m, V) of the last m of them (m <= n; None: none)."""
        n, m = states.shape[0], 0 if logits is None else logits.shape[0]
        ids = torch.zeros(n, top_k, dtype=torch.int32)
        probs = torch.zeros(n, top_k, dtype=torch.float16)
        if m:
            top = logits.float().softmax(-1).topk(top_k, dim=-1)
            ids[n - m:], probs[n - m:] = top.indices.int().cpu(), top.values.half().cpu()
        self.states.append(states.to(torch.bfloat16).cpu())
        self.topk_ids.append(ids)
        self.topk_probs.append(probs)

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"states": torch.cat(self.states), "topk_ids": torch.cat(self.topk_ids),
                "topk_probs": torch.cat(self.topk_probs)}


class FeatureRecord:
    """Each row's features as a generate call computes them (pass as `clover_record=` to `generate`): row b's
    `rows[b]` covers every position of its text (prompt and generated, the padding left out) but the last token,
    which the base never read. The call then computes full logits at every verified node (no greedy screen, no
    top-k cut), so that the top-k holds the base's own distribution."""

    def __init__(self, top_k: int = 8) -> None:
        self.top_k = top_k
        self.rows: list[RowFeatures] = []
        self._of: dict[int, RowFeatures] = {}  # by the id of the decode loop's row

    def prefilled(self, rows: list[Row], hidden: torch.Tensor, positions: torch.Tensor, logits: torch.Tensor) -> None:
        """The decode loop's `rows` after the prefill: its states (B, P, H') at `positions` (B, P; -1: padding) and
        its last logits (B, 1, V)."""
        self.rows = [RowFeatures() for _ in rows]
        self._of = {id(row): features for row, features in zip(rows, self.rows)}
        for b, features in enumerate(self.rows):
            features.add(hidden[b, positions[b] >= 0], logits[b, -1:], self.top_k)

    def kept(self, rows: list[Row], kept: list[torch.Tensor], hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """The nodes each of the decode loop's `rows` keeps in its cache this step (`kept`), their states in `hidden`
        (B, T, H') and logits (B, T, V), B over `rows`."""
        for i, (row, nodes) in enumerate(zip(rows, kept)):
            self._of[id(row)].add(hidden[i].index_select(0, nodes), logits[i].index_select(0, nodes), self.top_k)
