"""What the heads read from the base's lm_head: its rows restricted to the draft vocabulary (`DraftLMHead`, in
the base's dtype), token embeddings read from those rows (`LMHeadEmbedding`), and the likeliest tokens of the logits
they give (`top_probabilities`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from clover_hf import cpu
from clover_hf.core.quantized import dense, plain
from clover_hf.cpu import LinearForms, linear, make_copy


class LMHeadEmbedding(nn.Module):
    """Token embeddings read from an lm_head's rows (Clover-2 embeds drafted tokens so); holds no weights of its own."""

    def __init__(self, lm_head: nn.Module) -> None:
        super().__init__()
        self._lm_head = [lm_head]  # in a list: the base's module, not a submodule of this one
        # a quantized lm_head is read back once, here (one plan of a decoding call holds this module)
        self._dense = None if plain(lm_head.weight) else [dense(lm_head.weight).detach()]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self._lm_head[0].weight if self._dense is None else self._dense[0])


@dataclass(frozen=True, eq=False)
class DraftLMHead:
    """The base lm_head's rows that the heads draft from: logits = hidden @ weight.T (+ bias)."""

    weight: torch.Tensor  # (V', H) in the base's dtype
    bias: torch.Tensor | None = None
    forms: LinearForms = field(default_factory=dict)  # how each row count is computed (`linears.faster_forms`)
    # the rows' copies for forms that compute from one, made at first use and shared by the copies `replace` makes
    copies: dict[str, torch.Tensor | None] = field(default_factory=dict, repr=False)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden.to(self.weight.dtype), self.weight, self.bias, self.forms, self._copy)

    def _copy(self, form: str) -> torch.Tensor | None:
        """The rows' copy for `form`, a form that computes from one (as the forms' layers do from theirs): without
        one, a copy form would compute in F.linear, many times slower for the draft rows' few rows, and a drafting
        step's largest cost."""
        if form not in self.copies:
            with torch.inference_mode(False):  # kept past the call that makes it, as the rows are
                self.copies[form] = make_copy(self.weight, form)
        return self.copies[form]


def top_probabilities(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens of each row of `logits` (N, V) and their probabilities (float32), likeliest first:
    softmax then topk, or `cpu.top_probs` in one call where it serves."""
    fast = cpu.top_probs(logits, k)
    if fast is not None:
        return fast
    top = logits.float().softmax(-1).topk(k, dim=-1)
    return top.values, top.indices
